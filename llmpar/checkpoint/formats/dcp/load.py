"""``load_checkpoint`` of a ``torch.distributed.checkpoint`` directory (FSDP2 / torchtitan: ``format.py``) into an
engine, through the checkpoint protocol, at any dp, ZeRO stage and tp.

Every rank reads the DCP metadata and plans what it needs: each param of this rank must be in the checkpoint with the
same full shape (a tensor-parallel param is cut from the full tensor, ``loader.Pieces``), and the states its
optimizer cannot derive must be there (Adam's ``exp_avg`` / ``exp_avg_sq`` and each param's ``step``: a CheckpointError
names the DCP keys that are missing); ``strict`` as in llmpar's own load. The ranks agree on the outcome before
anything is modified. Then each rank reads, in one ``dcp.load`` without collectives, only the rows holding the
element ranges it asked for (``checkpoint_reads``: the params; ``checkpoint_held``: its shard of the moments), and
``load_pieces`` fills its params (the fp32 weights), moments and step counts; buffers follow. ``global_steps`` becomes
the saved Adam step; the param-group hyper-parameters, the LR scheduler and the RNG states stay as this engine has
them (a DCP checkpoint of FSDP2 carries no llmpar scheduler: configure the same one).
"""

from __future__ import annotations

import logging

from llmpar.checkpoint import files
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.dcp.format import MOMENTS, DcpCheckpoint
from llmpar.checkpoint.formats.loader import Pieces, shown
from llmpar.checkpoint.protocol import Checkpointable, DescribesModel
from llmpar.checkpoint.shards import extras_names
from llmpar.checkpoint.view import EngineView

logger = logging.getLogger("llmpar")


def _plan(
    engine: Checkpointable, view: EngineView, ck: DcpCheckpoint, src: Pieces, strict: bool
) -> tuple[set[str], dict]:
    """The optimizer names this rank keeps (absent from the checkpoint) and the buffers it takes; raises naming the
    DCP keys a load needs and the checkpoint lacks."""
    missing: set[str] = set()
    lacking_keys: list[str] = []
    for b, required in zip(view.layout, view.opt.checkpoint_required()):
        for slot in b["params"]:
            name = view.saved_name[slot["name"]]
            if name not in ck.shapes:
                missing.add(slot["name"])
                continue
            src.check(slot["name"])
            for key in required:
                if key != "params" and not ck.has(name, key):
                    lacking_keys.append(ck.key(name, key) + ("" if key in MOMENTS else f" (state {key!r})"))
            if any(k in MOMENTS for k in required) and ck.key(name, "step") not in ck.md.state_dict_metadata:
                lacking_keys.append(ck.key(name, "step"))
    if lacking_keys:
        raise CheckpointError(
            f"DCP checkpoint {ck.path} lacks {len(lacking_keys)} keys this optimizer needs (Adam's "
            f"moments and step of every trained param, saved as get_state_dict(model, optimizer) "
            f"names them): {shown(lacking_keys)}"
        )
    targets, frozen = view.targets(), view.opt.frozen_shapes()
    unsaved = set(engine.checkpoint_model().get("unsaved_buffers", ())) if isinstance(engine, DescribesModel) else set()
    extras, lacking = {}, {view.saved_name[n] for n in missing}
    for name in set(extras_names(targets, set(view.saved_name.values()) | set(frozen))) | set(frozen):
        if name in unsaved:
            continue
        if name not in ck.shapes:
            lacking.add(name)
            continue
        shape = frozen.get(name, tuple(targets[name][0].shape) if name in targets else None)
        if ck.shapes[name] != tuple(shape or ()):
            raise CheckpointError(f"{name!r} has shape {ck.shapes[name]} in {ck.path} and {shape} here")
        whole = ck.buffers().get(name)
        extras[name] = (
            whole if whole is not None else ck.read(name, "params", 0, _numel(ck.shapes[name])).view(ck.shapes[name])
        )
    if lacking and strict:
        raise CheckpointError(
            f"{len(lacking)} params / buffers of this model are not in DCP checkpoint {ck.path}: "
            f"{shown(lacking)} (load_checkpoint(..., strict=False) keeps their current values)"
        )
    if lacking:
        logger.warning(
            "load_checkpoint(strict=False): %d params / buffers of this model are not in %s, they keep "
            "their current values: %s",
            len(lacking),
            ck.path,
            shown(lacking),
        )
    return missing, extras


def _prefetch(view: EngineView, ck: DcpCheckpoint, src: Pieces, keep: set[str]) -> None:
    """Read in one go what ``load_pieces`` will ask for: the params' ranges and this rank's moments (whole tensors
    of a tensor-parallel param, which ``Pieces`` cuts)."""
    ranges = []

    def add(local: str, key: str, a: int, z: int) -> None:
        name = view.saved_name[local]
        if src.cuts[local].spec is not None:
            a, z = 0, max(1, _numel(ck.shapes[name]))
        ranges.append((name, key, a, z))

    for local, a, z in view.opt.checkpoint_reads():
        if local not in keep:
            add(local, "params", a, z)
    for desc, held in zip(view.layout, view.opt.checkpoint_held()):
        for local, a, z, _ in held:
            if local not in keep:
                for key in desc["state_keys"]:
                    if key in MOMENTS:
                        add(local, key, a, z)
    ck.prefetch(ranges)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def load(
    engine: Checkpointable, view: EngineView, path: str, *, strict: bool, scheduler: bool
) -> tuple[str, dict | None]:
    """Load DCP directory ``path`` into ``engine`` (collective over its grid; ``load.py`` calls it once the ranks
    agreed they read the same checkpoint). Returns ``(path, None)``: DCP holds no llmpar client_state."""
    g, opt = view.grid, engine.optimizer
    with files.agreed(g, "load_checkpoint"):
        ck = DcpCheckpoint(path)
        src = Pieces(ck, view)
        keep, extras = _plan(engine, view, ck, src, strict)
    view.unexpected(sorted(ck.shapes), strict=strict, where=f"DCP checkpoint {path}", show=shown)  # same metadata
    steps = []
    with files.all_or_mixed(g, path):  # agreed before the stage-3 re-gather so that no rank waits alone
        _prefetch(view, ck, src, keep)

        def step(local: str) -> float:
            steps.append(ck.step(view.saved_name[local]))
            return steps[-1]

        if keep:
            opt.load_pieces(src.get, step, keep=frozenset(keep))
        else:
            opt.load_pieces(src.get, step)
        view.put_extras(extras)
    opt.after_load()
    top = files.agree_all([int(max(steps, default=0))], g.groups, g.device)[0]
    engine.restore_counters({"global_steps": int(top)})
    if g.rank0:
        logger.info(
            "loaded DCP checkpoint %s (step %d; loaded at pp=%d dp=%d tp=%d stage %d); the hyper-parameters, "
            "LR scheduler and RNG states stay as this engine has them",
            path,
            top,
            g.pp,
            g.dp,
            g.tp,
            opt.stage,
        )
    return path, None


__all__ = ["load"]
