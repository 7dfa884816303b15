"""A DeepSpeed checkpoint's files checked against each other before anything is read into an engine or a
conversion: DeepSpeed writes no digest, so files of different saves, or swapped between ranks, would load silently.

    validate(ck)    every optimizer file (and ZeRO-3 model states file) opened (a truncated or foreign one
                    named); their ``partition_count``; their optimizer step counts (one per param group): equal in
                    every rank's file and at most the model states file's ``global_steps`` (which counts skipped
                    steps too); and, where the model states file holds the weights (ZeRO 1-2:
                    ``mp_rank_00_model_states.pt``'s "module"), each rank's fp32 masters: of every param its
                    partition holds, the first and last elements there (at most ``SAMPLE`` each), cast to the
                    weights' dtype, equal the weights (DeepSpeed copies the masters into the weights after every
                    step, so they agree bitwise in any precision)

A mismatch raises a ``CheckpointError`` naming the files (and the steps, or the param and elements that differ).
ZeRO-3 saves hold no whole weights: there only the files and the step counts are checked (rank files of one step
swapped whole, or optimizer files of an earlier save than the model states, are not told apart). ``ck``: a
``deepspeed_read.DeepSpeedCheckpoint`` of any layout (a pipeline's stages and a tensor-parallel checkpoint's ranks
are each checked).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from llmpar.checkpoint.ds_files import load_file
from llmpar.checkpoint.ds_rank_read import RankCheckpoint, _scalar
from llmpar.checkpoint.files import CheckpointError

SAMPLE = 16  # elements compared at each end of a rank's partition


def validate(ck: Any) -> None:
    """Check the files of DeepSpeed checkpoint reader ``ck`` against each other (module docstring)."""
    for rc in getattr(ck, "stages", None) or getattr(ck, "parts", None) or [ck]:
        if isinstance(rc, RankCheckpoint):
            _rank_files(rc)


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
    if rc.stage == 3:  # every rank's model states file opens (rank 0's is open already)
        mp = f"mp_rank_{rc.mp_rank:02d}"
        for r in range(1, rc.dp):
            load_file(os.path.join(rc.path, f"zero_pp_rank_{r}_{mp}_model_states.pt"))
    _steps(rc, files)
    if rc.stage < 3 and not rc.unnamed and isinstance(rc.model.get("module"), dict):
        for r in range(rc.dp):
            _masters(rc, r, files[r])


def _steps(rc: RankCheckpoint, files: dict[int, str]) -> None:
    """The step count of every param group is the same in every rank's optimizer file."""
    steps = {r: [_scalar(m["step"]) if "step" in m else None for m in rc.moments(r)] for r in files}
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


__all__ = ["SAMPLE", "validate"]
