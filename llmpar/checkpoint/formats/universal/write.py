"""``llmpar checkpoint convert SRC DST --to universal``: a checkpoint (llmpar's or DeepSpeed's) written in DeepSpeed's
universal checkpoint layout, as DeepSpeed 0.19's ``ds_to_universal`` writes it, which DeepSpeed loads at any dp and
ZeRO stage 1-3 with ``"checkpoint": {"load_universal": true}``:

    DST/latest_universal                              the tag (``global_stepN``), what DeepSpeed reads there
    DST/TAG/zero/<param name>/fp32.pt                 {"param": the fp32 master, full shape}
    DST/TAG/zero/<param name>/exp_avg.pt, exp_avg_sq.pt   {"param": the Adam moment, full shape}
    DST/TAG/zero/<param name>/step.pt                 the optimizer step count (a 0-d float32 tensor, as torch's AdamW)
    DST/TAG/zero/optimizer_state.pt                   the ZeRO optimizer's global state: "loss_scaler",
                                                      "dynamic_loss_scale", "overflow", "clip_grad" (a DeepSpeed
                                                      source's; else left out: the engine's own), "ds_version",
                                                      "zero_stage", "partition_count", "param_groups" (what a ZeRO 1-2
                                                      load reads) and "optimizer_state_dict" {"state": {0: {"step"}},
                                                      "param_groups"} (what a ZeRO-3 load reads)
    DST/TAG/mp_rank_00_model_states.pt                the run's state (counters, lr_scheduler, client_state,
    DST/TAG/zero_pp_rank_0_mp_rank_00_model_states.pt param_shapes, ...) as ``deepspeed/write.py`` writes it for
                                                      ZeRO-2 (whole module) and ZeRO-3 (empty module): an engine of
                                                      either kind finds its file

A universal load restores only the trained params (DeepSpeed skips the module state dict): buffers and frozen params
keep the model's values, as with DeepSpeed's own universal checkpoints. Every tensor file written is read back and
compared bitwise with the source. The refusals are ``deepspeed/write.py``'s. Memory: one param's tensor at a time (read
from the memory-mapped source, streamed into its file, checked in pieces against the source, dropped), and the model
states file (every param whole in ``module``, as DeepSpeed writes it). A universal checkpoint is a source too.
"""

from __future__ import annotations

import math
import os

import torch

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.deepspeed import write as ds_write
from llmpar.checkpoint.formats.deepspeed.files import (
    DS_VERSION,
    load_file,
    owned,
    save_pickled,
    static_loss_scaler,
    torch_groups,
    write_bytes,
    zero_stage,
)
from llmpar.checkpoint.formats.open import Writable, clip_grad, open_source, writable
from llmpar.checkpoint.formats.source import locate

FILES = {"master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
PIECE = 1 << 24  # elements compared at a time


@torch.no_grad()  # the sources' tensors may require grad (DeepSpeed saves params so)
def write_universal(src: str, out_dir: str, *, tag: str | None = None, source: str = "auto") -> list[str]:
    """Write checkpoint ``src`` to ``out_dir`` in DeepSpeed's universal layout (module docstring), verify it and
    return the paths written."""
    s = writable(open_source(locate(src, tag, source)))
    out_tag = f"global_step{int(s.counters.get('global_steps', 0))}"
    d = os.path.join(out_dir, out_tag)
    zero = os.path.join(d, "zero")
    written: list[str] = []
    names = [n for g in s.groups for n in g]
    for n in names:  # one tensor in memory at a time, written streamed
        os.makedirs(os.path.join(zero, n), exist_ok=True)
        for key, fname in FILES.items():
            path = os.path.join(zero, n, f"{fname}.pt")
            t = owned(s.full(n, key)).view(s.shapes[n])
            save_pickled({"param": t}, path)
            del t
            written.append(path)
        path = os.path.join(zero, n, "step.pt")
        save_pickled(torch.tensor(s.step, dtype=torch.float32), path)
        written.append(path)
    hyper = torch_groups(s.hyper)
    state = {
        "loss_scaler": static_loss_scaler(),
        "dynamic_loss_scale": False,
        "overflow": False,
        **clip_grad(s),
        "ds_version": DS_VERSION,
        "zero_stage": zero_stage(s.stage),
        "partition_count": [s.dp] * len(s.groups),
        "param_groups": hyper,
        "optimizer_state_dict": {
            "state": {g: {"step": torch.tensor(s.step)} for g in range(len(s.groups))},
            "param_groups": hyper,
        },
    }
    path = os.path.join(zero, "optimizer_state.pt")
    save_pickled(state, path)
    written.append(path)
    for stage, fname in ((2, "mp_rank_00_model_states.pt"), (3, "zero_pp_rank_0_mp_rank_00_model_states.pt")):
        path = os.path.join(d, fname)
        save_pickled(ds_write.model_states(s, stage, s.dp, 0), path)
        written.append(path)
    write_bytes(os.path.join(out_dir, "latest_universal"), out_tag.encode())
    verify(s, d)
    return written


def _check(s: Writable, n: str, key: str, path: str) -> None:
    """``path`` (memory-mapped) equals the source's ``key`` of ``n`` bitwise, in its full shape, compared in pieces
    of at most ``PIECE`` elements; a CheckpointError naming it otherwise."""
    got = load_file(path)
    t = got.get("param") if isinstance(got, dict) else None
    k = math.prod(s.shapes[n])
    flat = t.reshape(-1) if t is not None and tuple(t.shape) == tuple(s.shapes[n]) else None
    same = flat is not None and all(
        torch.equal(flat[a : a + PIECE], s.piece(n, key, a, min(a + PIECE, k))) for a in range(0, k, PIECE)
    )
    if not same:
        raise CheckpointError(
            f"{path[:-3]}.pt read back differs from the source's {key} of {n!r} (shape "
            f"{tuple(s.shapes[n])}, {k} elements)"
        )


def verify(s: Writable, path: str) -> None:
    """Every ``zero/<name>/*.pt`` of universal checkpoint ``path`` read back equals the source's tensor, bitwise, in
    its full shape; the step and the param groups too; a CheckpointError naming what differs."""
    zero = os.path.join(path, "zero")
    for n in (n for g in s.groups for n in g):
        for key, fname in FILES.items():
            _check(s, n, key, os.path.join(zero, n, f"{fname}.pt"))
        step = load_file(os.path.join(zero, n, "step.pt"))
        if float(step) != s.step:
            raise CheckpointError(f"{zero}/{n}/step.pt reads back {float(step)}, the source's step is {s.step}")
    groups = load_file(os.path.join(zero, "optimizer_state.pt"))["param_groups"]
    if [g["lr"] for g in groups] != [h["lr"] for h in s.hyper]:
        raise CheckpointError(f"{zero}/optimizer_state.pt reads back param groups {groups}, the source's {s.hyper}")


__all__ = ["verify", "write_universal"]
