"""``llmpar checkpoint convert SRC DST --to deepspeed``: a checkpoint (llmpar's or DeepSpeed's) written in DeepSpeed
0.19's ZeRO layout (``files.py`` describes it), so that ``DeepSpeedEngine.load_checkpoint(DST)`` on the same
model and config resumes from it.

    DST/latest                                     the tag (the source's: ``global_stepN``)
    DST/TAG/mp_rank_00_model_states.pt             stages 1-2: "module" (every param whole, fp32, from the
                                                   masters; buffers), "param_shapes" [per group {name: shape}],
                                                   "frozen_param_shapes" / "frozen_param_fragments", "buffer_names",
                                                   "lr_scheduler", "global_steps", "global_samples", "skipped_steps",
                                                   "dp_world_size", "mp_world_size", "ds_config" ({} unless the
                                                   source had one), "ds_version", and the source's client_state keys
    DST/TAG/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: the same per dp rank R, "module" with empty
                                                   tensors for the params (as DeepSpeed writes it), R's chunks of
                                                   the frozen params
    DST/TAG/zero_pp_rank_R_mp_rank_00_optim_states.pt   per dp rank R: {"optimizer_state_dict": ...}
        stages 1-2: group g flat in param_shapes order (no per-param alignment padding:
                    ``param_alignment_paddings`` all 0, DeepSpeed's default), padded at its end to a multiple of 2 x dp
                    (``nccl_start_alignment_factor``) and cut into dp partitions of P elements;
                    "single_partition_of_fp32_groups" (R's partition less its end padding), "base_optimizer_state"
                    (torch AdamW's state dict: state[g] = {step, exp_avg, exp_avg_sq} over the padded partition),
                    "group_paddings", "param_alignment_paddings", "partition_count", "param_slice_mappings",
                    "zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "ds_version", "clip_grad" (a
                    DeepSpeed source's gradient_clipping; left out for an llmpar source: the engine keeps its own)
        stage 3:    each param alone cut into dp chunks of ceil(numel / dp) (the last padded with zeros), R's flat
                    of group g = its chunks in turn; "fp32_flat_groups", "optimizer_state_dict" (state[g] over R's
                    flat), "zero_stage", "partition_count", "loss_scaler", "dynamic_loss_scale", "overflow"

DeepSpeed's own classes (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``) are pickled by name without importing
DeepSpeed. Refused (a ``CheckpointError`` / ``ValueError`` naming what was found): a source whose groups have different
step counts, an llmpar source of several param groups (which param is in which is not recorded), an llmpar source with
buffers or frozen params converted to stage 3 (the checkpoint does not tell them apart), stage 0 or > 3, dp < 1, an
llmpar pipeline (pp > 1) source and DeepSpeed tensor-parallel ones (``open.writable``); a DeepSpeed pipeline source is
written under its PipelineModule's names as one model-parallel rank. A tensor-parallel llmpar source is merged
(``CheckpointReader.full``: params named and shaped as in the unsplit model, vocabulary padding dropped), so the output
is model-parallel degree 1. Params are written in the order the source lists them (DeepSpeed's param_shapes; llmpar's
layout, the model's order): DeepSpeed's ZeRO 1-2 flat groups follow the model's parameter order, so a model whose order
differs would load other values. The sources: any reader of the protocol (``formats/source.py``): a DeepSpeed, universal
or llmpar checkpoint. After writing, :func:`verify` reads every file back with ``open.open_deepspeed`` and compares
every element of every param's master and moments, its step, the stage 1-2 module weights, buffers and frozen params
with the source, bitwise. Memory: the model states file is written first (stages 1-2: every param whole, as
DeepSpeed's), then each rank's optimizer file, built from pieces of the params it overlaps (``source.piece_into``: a
range of the memory-mapped source; an llmpar source reads one whole param at a time), streamed into its file and dropped
before the next; the check reads one rank's file at a time, the reader letting it go (its mapped pages released) before
the next. Peak: one output file + about two copies of the largest tensor. A universal checkpoint (``universal/read.py``)
is a source too (``--from universal``, or detected).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.deepspeed.files import (
    DS_VERSION,
    fragment_address,
    owned,
    save_pickled,
    static_loss_scaler,
    torch_groups,
    write_bytes,
    zero_stage,
)
from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed
from llmpar.checkpoint.formats.open import Writable, clip_grad, open_source, writable
from llmpar.checkpoint.formats.source import locate

KEYS = ("master", "exp_avg", "exp_avg_sq")
PIECE = 1 << 22  # elements compared at a time


# ---------------------------------------------------------------------- the writer
def _check_args(stage: Any, dp: Any) -> None:
    if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool) or stage not in (1, 2, 3)):
        raise ValueError(f"stage={stage!r}: DeepSpeed's ZeRO layout is written for stages 1, 2 or 3")
    if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool) or dp < 1):
        raise ValueError(f"dp={dp!r}: the data-parallel degree to write for is an int >= 1")


@torch.no_grad()  # the sources' tensors may require grad (DeepSpeed saves params so)
def write_deepspeed(
    src: str,
    out_dir: str,
    *,
    stage: int | None = None,
    dp: int | None = None,
    tag: str | None = None,
    source: str = "auto",
) -> list[str]:
    """Write checkpoint ``src`` to ``out_dir`` in DeepSpeed's ZeRO-``stage`` layout for ``dp`` ranks (defaults: the
    source's; its stage 0 becomes 1), verify it (module docstring) and return the paths written."""
    _check_args(stage, dp)
    s = writable(open_source(locate(src, tag, source)))
    stage, dp = stage or s.stage, dp or s.dp
    if stage == 3 and s.buffers and s.format == "llmpar":
        raise CheckpointError(
            f"{src}: llmpar checkpoint with buffers / frozen params {sorted(s.buffers)[:8]}: "
            "llmpar does not record which are frozen params, so they cannot be placed in a "
            "ZeRO-3 layout; write stage 1 or 2"
        )
    out_tag = f"global_step{int(s.counters.get('global_steps', 0))}"
    d = os.path.join(out_dir, out_tag)
    os.makedirs(d, exist_ok=True)
    written: list[str] = []
    for r in range(dp):  # each file built, streamed into place and dropped before the next
        if stage == 3 or r == 0:
            name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
            save_pickled(model_states(s, stage, dp, r), os.path.join(d, name))
            written.append(os.path.join(d, name))
        path = os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        save_pickled(optim_states(s, stage, dp, r), path)
        written.append(path)
    write_bytes(os.path.join(out_dir, "latest"), out_tag.encode())
    verify(s, d, stage, dp)
    return written


@torch.no_grad()
def optim_states(s: Writable, stage: int, dp: int, r: int) -> dict:
    """The optimizer file of dp rank ``r`` for ZeRO-``stage`` at ``dp`` ranks (module docstring)."""
    flats, state, hyper = [], {}, torch_groups(s.hyper)
    if stage < 3:
        pads, slices, groups_pad = [], [], []
        for g, names in enumerate(s.groups):
            total = sum(math.prod(s.shapes[n]) for n in names)
            part = -(-total // (2 * dp)) * 2  # the group padded to a multiple of 2 x dp, cut into dp partitions
            lo, hi = r * part, (r + 1) * part
            keep = max(0, min(hi, total) - lo)
            cut = {k: _partition(s, names, k, lo, hi if k != "master" else lo + keep) for k in KEYS}
            flats.append(cut.pop("master"))  # the fp32 copy without the group's end padding
            state[g] = {"step": torch.tensor(s.step), "exp_avg": cut["exp_avg"], "exp_avg_sq": cut["exp_avg_sq"]}
            pads.append([0] * len(names))
            groups_pad.append(part - keep)
            at, m = 0, {}
            for n in names:
                k = math.prod(s.shapes[n])
                a, z = max(at, lo), min(at + k, hi)
                if a < z:
                    m[n] = fragment_address(z - a, a - lo)
                at += k
            slices.append(m)
        extra = {
            "single_partition_of_fp32_groups": flats,
            "zero_stage": zero_stage(stage),
            "group_paddings": groups_pad,
            "param_alignment_paddings": pads,
            "partition_count": [dp] * len(s.groups),
            "param_slice_mappings": slices,
            "ds_version": DS_VERSION,
            **clip_grad(s),
        }
        base_key = "base_optimizer_state"
    else:
        for g, names in enumerate(s.groups):
            cut = {k: _chunks(s, names, k, r, dp) for k in KEYS}
            flats.append(cut["master"])
            state[g] = {"step": torch.tensor(s.step), "exp_avg": cut["exp_avg"], "exp_avg_sq": cut["exp_avg_sq"]}
        extra = {"zero_stage": zero_stage(3), "partition_count": dp, "fp32_flat_groups": flats}
        base_key = "optimizer_state_dict"
    osd = {
        "loss_scaler": static_loss_scaler(),
        "dynamic_loss_scale": False,
        "overflow": False,
        base_key: {"state": state, "param_groups": hyper},
        **extra,
    }
    return {"optimizer_state_dict": osd, "ds_config": s.ds_config, "ds_version": DS_VERSION}


def _partition(s: Writable, names: list[str], key: str, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the group of ``names`` flat in turn (zeros past its end), state ``key``: filled
    from the pieces of the params that overlap it, none read whole."""
    out, at = torch.zeros(hi - lo), 0
    for n in names:
        k = math.prod(s.shapes[n])
        a, z = max(at, lo), min(at + k, hi)
        if a < z:
            s.piece_into(n, key, a - at, z - at, out[a - lo : z - lo])
        at += k
    return out


def _chunks(s: Writable, names: list[str], key: str, r: int, dp: int) -> torch.Tensor:
    """ZeRO-3: rank ``r``'s chunk of each param of ``names`` in turn (``ceil(numel / dp)`` elements, the last
    padded with zeros), state ``key``, each read as a piece."""
    sizes = [-(-math.prod(s.shapes[n]) // dp) for n in names]
    out, at = torch.zeros(sum(sizes)), 0
    for n, c in zip(names, sizes):
        a, z = r * c, min((r + 1) * c, math.prod(s.shapes[n]))
        if a < z:
            s.piece_into(n, key, a, z, out[at : at + z - a])
        at += c
    return out


@torch.no_grad()
def model_states(s: Writable, stage: int, dp: int, r: int) -> dict:
    """The model states file of dp rank ``r`` (stages 1-2: the one file) for ZeRO-``stage`` at ``dp`` ranks."""
    module = {
        n: torch.empty(0) if stage == 3 else owned(s.full(n, "master")).view(s.shapes[n]) for g in s.groups for n in g
    }
    frozen = {n: t.reshape(-1) for n, t in s.frozen.items()}
    if stage == 3:
        frozen = {
            n: torch.cat([t, t.new_zeros(-(-t.numel() // dp) * dp - t.numel())]).chunk(dp)[r].clone()
            for n, t in frozen.items()
        }
    else:
        frozen = {n: t.view(s.frozen[n].shape) for n, t in frozen.items()}
        module.update(s.frozen)
    module.update(s.buffers)
    run = {
        "lr_scheduler": s.scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": int(s.counters.get("skipped_steps", 0)),
        "global_steps": int(s.counters.get("global_steps", 0)),
        "global_samples": int(s.counters.get("global_samples", 0)),
        "dp_world_size": dp,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": s.ds_config,
        "ds_version": DS_VERSION,
    }
    return {
        "module": module,
        "buffer_names": list(s.buffers),
        "optimizer": None,
        "param_shapes": [{n: torch.Size(s.shapes[n]) for n in g} for g in s.groups],
        "frozen_param_shapes": {n: t.shape for n, t in s.frozen.items()},
        "shared_params": {},
        "frozen_param_fragments": frozen,
        **run,
        **s.client,
    }


def _held(s: Writable, stage: int, dp: int, r: int) -> list[tuple[str, int, int]]:
    """(name, a, z): the element ranges ``[a, z)`` of each param that dp rank ``r``'s optimizer file holds."""
    out = []
    for names in s.groups:
        if stage == 3:
            for n in names:
                k = math.prod(s.shapes[n])
                c = -(-k // dp)
                if r * c < k:
                    out.append((n, r * c, min((r + 1) * c, k)))
            continue
        total = sum(math.prod(s.shapes[n]) for n in names)
        part = -(-total // (2 * dp)) * 2
        lo, hi, at = r * part, (r + 1) * part, 0
        for n in names:
            k = math.prod(s.shapes[n])
            if max(at, lo) < min(at + k, hi):
                out.append((n, max(at, lo) - at, min(at + k, hi) - at))
            at += k
    return out


def _same(s: Writable, path: str, what: str, n: str, key: str, a: int, z: int, got: Any) -> None:
    """``got(b, e)`` (elements [b, e) read back) equals the source's ``key`` of ``n`` over [a, z), compared in
    pieces of at most ``PIECE`` elements; a CheckpointError naming it otherwise."""
    for b in range(a, z, PIECE):
        e = min(b + PIECE, z)
        if not torch.equal(got(b, e), s.piece(n, key, b, e)):
            raise CheckpointError(f"{path}: {what} {n!r} {key} read back differs from the source (elements [{b}, {e}))")


def verify(s: Writable, path: str, stage: int, dp: int) -> None:
    """Read DeepSpeed checkpoint ``path`` back (``open_deepspeed``): its layout (stage, dp, names, shapes),
    every param's master and moments (every element, bitwise), its step, the stage 1-2 module weights, the buffers
    and the frozen params equal the source's; a CheckpointError naming what differs. Bounded: one rank's optimizer
    file at a time (the reader lets it go before the next: ``release``, its mapped pages leave the RSS), compared in
    pieces of at most ``PIECE`` elements."""
    names = [n for g in s.groups for n in g]
    ck = open_deepspeed(path, validate=False)
    if (ck.stage, ck.dp, ck.names) != (stage, dp, names) or ck.shapes != {n: tuple(s.shapes[n]) for n in names}:
        raise CheckpointError(
            f"{path} reads back as ZeRO-{ck.stage} dp={ck.dp} with params {ck.names[:4]}..., "
            f"written as ZeRO-{stage} dp={dp} with {names[:4]}..."
        )
    for n in names:
        if ck.step(n) != s.step:
            raise CheckpointError(f"{path}: param {n!r} step {ck.step(n)} read back, {s.step} in the source")
    seen = dict.fromkeys(names, 0)
    for r in range(dp):
        ck.release()  # only rank r's file is read next, then let go
        for n, a, z in _held(s, stage, dp, r):
            seen[n] += z - a
            for key in KEYS:
                _same(s, path, "param", n, key, a, z, lambda b, e: ck.read(n, key, b, e))  # noqa: B023
    ck.release()
    short = [n for n in names if seen[n] != math.prod(s.shapes[n])]
    if short:  # the ranges above must cover every element: else some were never compared
        raise CheckpointError(
            f"{path}: the read-back covered {[seen[n] for n in short[:4]]} elements of params "
            f"{short[:4]}, not all of them"
        )
    module = ck.model["module"]
    for n in names if stage < 3 else ():
        t = module.get(n)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(s.shapes[n]):
            raise CheckpointError(
                f"{path}: module weight {n!r} reads back as {type(t).__name__} "
                f"{tuple(getattr(t, 'shape', ()))}, the source's shape is {tuple(s.shapes[n])}"
            )
        _same(s, path, "module weight", n, "master", 0, t.numel(), lambda b, e: t.reshape(-1)[b:e])  # noqa: B023
    for n, t in s.buffers.items():
        if not torch.equal(ck.buffers().get(n, torch.empty(0)), t):
            raise CheckpointError(f"{path}: buffer {n!r} read back differs from the source")
    frozen = ck.frozen()
    for n, t in s.frozen.items():
        if n not in frozen or not torch.equal(frozen[n].reshape(t.shape), t):
            raise CheckpointError(f"{path}: frozen param {n!r} read back differs from the source")


__all__ = ["model_states", "optim_states", "verify", "write_deepspeed"]
