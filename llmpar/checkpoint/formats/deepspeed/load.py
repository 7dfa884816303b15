"""``load_checkpoint`` of a DeepSpeed checkpoint into an engine: the generic load of a reader (``formats/loader.py``:
the same named pieces as llmpar's own checkpoints, so any dp, ZeRO stage and tp load it), plus what DeepSpeed's
files need first:

* the loading model's names and full shapes (collective: every rank's params joined), for the files that name no
  params (a pipeline saved without ZeRO) or do not say how a param is split (a tensor-parallel one):
  ``open.needs_model``;
* the files checked against each other, once, on every rank, before anything is modified (``open.check``; each file
  opened once: the model states file read to tell whether the model is needed is the one the reader keeps);
* a MoE checkpoint (``moe.py``: every expert under its global index) loads into an engine holding every expert
  (ep=1) or spreading them over expert-parallel ranks (each rank's experts by their global index, into the expert
  optimizer: ``loader.ExpertPieces``), each MoE layer's expert count checked against the model's first (an error
  naming the layer and the counts).

DeepSpeed saves no RNG states in these files: this engine's stay as they are.
"""

from __future__ import annotations

import json

from llmpar.checkpoint import files
from llmpar.checkpoint.formats.deepspeed.moe import DeepSpeedMoECheckpoint
from llmpar.checkpoint.formats.deepspeed.open import needs_model, open_deepspeed
from llmpar.checkpoint.formats.deepspeed.rank import RankCheckpoint
from llmpar.checkpoint.formats.loader import every_expert, load_source
from llmpar.checkpoint.protocol import Checkpointable
from llmpar.checkpoint.reshard import full_shape
from llmpar.checkpoint.view import EngineView


def model_names(view: EngineView) -> dict[str, tuple[list[int], bool]]:
    """Collective: {checkpoint name: (full shape, trained)} of the whole model, every rank's params joined."""
    specs, shapes = view.specs(), view.shapes()
    mine = {view.saved_name[n]: (list(full_shape(s, specs[n])), True) for n, s in shapes.items()}
    frozen = {n: tuple(t.shape) for n, (t, is_param) in view.targets().items() if is_param and n not in mine}
    mine.update({n: (list(s), False) for n, s in {**frozen, **view.opt.frozen_shapes()}.items()})
    out: dict[str, tuple[list[int], bool]] = {}
    for text in files.gather_text(json.dumps(mine), view.grid, limit=1 << 22):
        out.update({k: (v[0], v[1]) for k, v in json.loads(text or "{}").items()})
    return out


def load(
    engine: Checkpointable, view: EngineView, path: str, *, strict: bool, scheduler: bool
) -> tuple[str, dict | None]:
    """Load DeepSpeed checkpoint directory ``path`` into ``engine`` (collective over its grid; ``load.py``'s
    ``load_checkpoint`` calls it once the ranks agreed they read the same checkpoint). Returns ``(path,
    client_state)``."""
    needed, loaded = needs_model(path)  # every rank sees the same files: the same answer
    model = model_names(view) if needed else None  # collective

    def open_reader() -> RankCheckpoint:
        ck = open_deepspeed(path, model, loaded=loaded)  # every file checked against the others
        if isinstance(ck, DeepSpeedMoECheckpoint):  # the whole model's experts, under their global names
            ck.fits(list(view.saved_name.values()) + every_expert(engine))
        return ck

    return load_source(
        engine,
        view,
        path,
        open_reader,
        strict=strict,
        scheduler=scheduler,
        what="DeepSpeed",
    )


__all__ = ["load", "model_names"]
