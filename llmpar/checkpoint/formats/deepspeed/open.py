"""A directory of DeepSpeed's files opened as the reader of the layout it holds, and its files checked against each
other, once, before anything is read into an engine or a conversion.

    open_deepspeed(path, model=None)   the reader (the reader protocol's terms, ``formats/source.py``):
        rank.RankCheckpoint                      one model-parallel rank: ZeRO 0-3 (``files.py`` shows the files)
        pipeline.DeepSpeedPipelineCheckpoint     ``layer_*`` files: a pipeline, its stages
        tensor_parallel.DeepSpeedTPCheckpoint    files of mp ranks > 0 and no layer files: a model made
                                                 tensor-parallel through an mpu
    needs_model(path)                  whether the files name no params or say no split dim, so that the loading
                                       model's names and full shapes (``model``) must be given
    check(ck)                          the check below; ``open_deepspeed`` runs it unless ``validate=False``

DeepSpeed writes no digest, so files of different saves, or swapped between ranks, would load silently. ``check``
opens every optimizer file (and ZeRO-3 model states file: each read once, kept by the reader) and checks their
``partition_count``; their optimizer step counts (one per param group): equal in every rank's file and at most the
model states file's ``global_steps`` (which counts skipped steps too); and, where the model states file holds the
weights (ZeRO 1-2: ``mp_rank_00_model_states.pt``'s "module"), each rank's fp32 masters: of every param its
partition holds, the first and last elements there (at most ``SAMPLE`` each), cast to the weights' dtype, equal the
weights (DeepSpeed copies the masters into the weights after every step, so they agree bitwise in any precision).

A mismatch raises a ``CheckpointError`` naming the files (and the steps, or the param and elements that differ).
ZeRO-3 saves hold no whole weights: there only the files and the step counts are checked (rank files of one step
swapped whole, or optimizer files of an earlier save than the model states, are not told apart). A pipeline's stages
and a tensor-parallel checkpoint's ranks are each checked.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.deepspeed.files import LAYER_RE, MODEL_RE, OPTIM_RE, detect, load_file, scalar
from llmpar.checkpoint.formats.deepspeed.moe import DeepSpeedMoECheckpoint, expert_files
from llmpar.checkpoint.formats.deepspeed.pipeline import DeepSpeedPipelineCheckpoint
from llmpar.checkpoint.formats.deepspeed.rank import RankCheckpoint
from llmpar.checkpoint.formats.deepspeed.tensor_parallel import DeepSpeedTPCheckpoint

SAMPLE = 16  # elements compared at each end of a rank's partition


MODEL_00 = "mp_rank_00_model_states.pt"


def _moe(path: str, found: list[str]) -> bool:
    """Whether ``path`` is a DeepSpeed MoE checkpoint (expert files beside the model states: ``moe.py``); one of a
    pipeline or of tensor-parallel ranks with expert files is refused, naming them."""
    experts = expert_files(path)
    if not experts:
        return False
    if any(LAYER_RE.match(f) for f in found) or any(
        (m := MODEL_RE.match(f) or OPTIM_RE.match(f)) and int(m.groups()[-1]) > 0 for f in found
    ):
        raise CheckpointError(
            f"{path} is a DeepSpeed MoE checkpoint ({len(experts)} expert files: {experts[:3]}) of a pipeline or "
            "of tensor-parallel ranks: only MoE checkpoints of model-parallel degree 1 without pipeline are read"
        )
    return True


def open_deepspeed(
    path: str, model: dict | None = None, *, validate: bool = True, loaded: dict[str, Any] | None = None
) -> RankCheckpoint:
    """The reader of the layout directory ``path`` holds (module docstring), its files checked (:func:`check`)
    unless ``validate`` is False. ``model``: {name: (full shape, trained)} of the loading model, which a
    tensor-parallel checkpoint or a pipeline one saved without ZeRO need (:func:`needs_model`); ``loaded``: {file
    name: object} of files already read."""
    found = detect(path)
    ck: RankCheckpoint
    if _moe(path, found):
        ck = DeepSpeedMoECheckpoint(path, loaded=loaded)
    elif any(LAYER_RE.match(f) for f in found):
        ck = DeepSpeedPipelineCheckpoint(path, model=model, loaded=loaded)
    elif any((m := MODEL_RE.match(f) or OPTIM_RE.match(f)) and int(m.groups()[-1]) > 0 for f in found):
        ck = DeepSpeedTPCheckpoint(path, model=model)
    else:
        ck = RankCheckpoint(path, loaded=loaded)
    if validate:
        check(ck)
    return ck


def needs_model(path: str) -> tuple[bool, dict[str, Any]]:
    """(whether checkpoint ``path`` is read with the loading model's names and full shapes, {file name: object} of
    the files read to tell). A tensor-parallel one (files of mp ranks > 0, no layer files: ``tensor_parallel.py``)
    or a pipeline one saved without ZeRO, whose files name no params (``pipeline_names.py``)."""
    found = detect(path)
    if _moe(path, found):
        return False, {}
    if not any(LAYER_RE.match(f) for f in found):
        return any((m := MODEL_RE.match(f) or OPTIM_RE.match(f)) and int(m.groups()[-1]) > 0 for f in found), {}
    if MODEL_00 not in found:
        return False, {}
    try:
        m = load_file(os.path.join(path, MODEL_00))
    except CheckpointError:
        return False, {}  # reported when the checkpoint opens
    unnamed = isinstance(m, dict) and m.get("module") is None and not isinstance(m.get("param_shapes"), list)
    return unnamed, {MODEL_00: m}


def check(ck: Any) -> None:
    """Check the files of DeepSpeed checkpoint reader ``ck`` against each other (module docstring)."""
    for rc in getattr(ck, "stages", None) or getattr(ck, "parts", None) or [ck]:
        if isinstance(rc, RankCheckpoint):
            _rank_files(rc)
        if isinstance(rc, DeepSpeedMoECheckpoint):
            rc.check_experts()


def _rank_files(rc: RankCheckpoint) -> None:
    if rc.stage == 0 or rc.kind == "FP16_Optimizer":  # one file holds it all
        return
    files = {r: os.path.join(rc.path, rc.optim[r]) for r in range(rc.dp)}
    need = (
        ("fp32_flat_groups", "optimizer_state_dict")
        if rc.stage == 3
        else ("single_partition_of_fp32_groups", "base_optimizer_state")
    )
    for r, name in files.items():
        z = rc.zero_state(r)  # opens the file: a truncated one is named here
        lacking = [k for k in need if k not in z]
        if lacking:
            raise CheckpointError(
                f"{name} has no {lacking} (it holds {sorted(z)[:8]}): not a ZeRO-{rc.stage} "
                "optimizer file of this checkpoint"
            )
        count = z.get("partition_count")
        if count is not None and count != rc.zero_state(0).get("partition_count"):
            raise CheckpointError(
                f"{name} has partition_count {count!r}, {files[0]} "
                f"{rc.zero_state(0).get('partition_count')!r}: files of different saves"
            )
    if rc.stage == 3:  # every rank's model states file opens (kept: the frozen params are read from them)
        for r in range(rc.dp):
            rc.model_states(r)
    _steps(rc, files)
    if rc.stage < 3 and not rc.unnamed and isinstance(rc.model.get("module"), dict):
        for r in range(rc.dp):
            _masters(rc, r, files[r])


def _steps(rc: RankCheckpoint, files: dict[int, str]) -> None:
    """The step count of every param group is the same in every rank's optimizer file."""
    steps = {r: [scalar(m["step"]) if "step" in m else None for m in rc.moments(r)] for r in files}
    model = rc.model.get("global_steps")
    if all(s == steps[0] for s in steps.values()):
        most = max((s for s in steps[0] if s is not None), default=None)
        if most is not None and isinstance(model, int) and most > model:  # global_steps counts skipped steps too
            raise CheckpointError(
                f"{rc.path}: the optimizer files record {most:g} optimizer steps, more than the "
                f"{model} global steps of its model states file: they are of a later save"
            )
        return
    shown = "; ".join(f"{os.path.basename(files[r])}: {s}" for r, s in steps.items())
    raise CheckpointError(
        f"{rc.path}: the optimizer files are of different saves: their step counts per param "
        f"group differ ({shown}; the model states file records global_steps {model!r}); "
        "load a checkpoint whose files were all written by one save"
    )


def _masters(rc: RankCheckpoint, r: int, file: str) -> None:
    """Rank ``r``'s fp32 masters (from its file, ``file``) at both ends of its partition equal the weights in the
    model states file."""
    module = rc.model["module"]
    for name, (g, at) in rc.where.items():
        if name not in rc.shapes or not isinstance(module.get(name), torch.Tensor):
            continue
        size, n = rc.part_size(g), math.prod(rc.shapes[name])
        a, z = max(at, r * size), min(at + n, (r + 1) * size)
        if a >= z:
            continue
        w = module[name].reshape(-1)
        for lo, hi in {(a - at, min(z, a + SAMPLE) - at), (max(a, z - SAMPLE) - at, z - at)}:
            got = rc.read(name, "master", lo, hi)
            if w.numel() != n or not torch.equal(got.to(w.dtype), w[lo:hi]):
                raise CheckpointError(
                    f"{file} does not hold dp rank {r}'s partition of this save: its fp32 master of {name!r} "
                    f"(elements [{lo}, {hi})) differs from the weights in the model states file of {rc.path} "
                    "(optimizer files swapped between ranks, or of another save)"
                )


__all__ = ["SAMPLE", "check", "needs_model", "open_deepspeed"]
