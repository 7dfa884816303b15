"""What ``llmpar checkpoint convert`` needs beside ``consolidate.py``: which layout a source is, a DeepSpeed
checkpoint's full weights tensor by tensor, and the check of what was written.

    locate(src, tag, source)   ("deepspeed" | "llmpar", checkpoint dir): ``source="auto"`` takes DeepSpeed's layout
                               (``ds_files``) when ``src`` / ``src/TAG`` / ``src/latest``'s tag has its files, else
                               llmpar's (``files.resolve``: an unknown layout is an error listing what it holds)
    state_dict(path, dtype)    {name: full tensor}: the fp32 masters (ZeRO 1-3; stage 0: the weights or its bf16
                               optimizer's fp32 copies), a tied name as the same tensor as its source, buffers and
                               frozen params; float tensors cast to ``dtype`` (float64 kept; None: as saved)
    verify(state, written)     every weight file written read back, every tensor compared bitwise with ``state``
                               (tied copies once, as ``hf_files.untied``); a CheckpointError naming what differs
"""
from __future__ import annotations

import math
import os

import torch

from llmpar.checkpoint import ds_files, files, hf_files
from llmpar.checkpoint.deepspeed_read import DeepSpeedCheckpoint
from llmpar.checkpoint.files import CheckpointError

SOURCES = ("auto", "deepspeed", "llmpar")


def locate(src: str, tag: str | None, source: str = "auto") -> tuple[str, str]:
    """(kind, checkpoint directory) of ``src`` (a checkpoint directory, or a save directory with ``latest`` or
    ``tag``); ``source``: "auto", or the layout it must be."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is not one of {list(SOURCES)}")
    src = os.fspath(src)
    ds = ds_files.resolve(src, tag) or (src if tag is None and ds_files.detect(src) else None)
    if ds is not None and source in ("auto", "deepspeed"):
        return "deepspeed", ds
    if ds is not None:
        raise CheckpointError(f"{ds} is a DeepSpeed checkpoint, not llmpar's (--from llmpar): convert it with "
                              "--from deepspeed or auto")
    if source == "deepspeed":
        where = os.path.join(src, tag) if tag is not None else src
        found = sorted(os.listdir(where))[:8] if os.path.isdir(where) else "nothing (no such directory)"
        raise CheckpointError(f"{where} is not a DeepSpeed checkpoint (no mp_rank_*_model_states.pt or "
                              f"*zero_pp_rank_*_optim_states.pt, or a metadata.json): it holds {found}")
    if tag is None and os.path.isfile(os.path.join(src, files.METADATA)):
        return "llmpar", src
    return "llmpar", files.resolve(src, tag)[1]


def state_dict(path: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The full weights of DeepSpeed checkpoint directory ``path`` (module docstring)."""
    ck = DeepSpeedCheckpoint(path)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != torch.float64 else t

    out: dict[str, torch.Tensor] = {}
    for name in ck.names:
        shape = ck.shapes[name]
        key = "master" if ck.has(name, "master") else "params"
        out[name] = cast(ck.read(name, key, 0, math.prod(shape)).view(shape))
    for alias, src in ck.aliases.items():
        if src in out:
            out[alias] = out[src]
    for name, t in {**ck.buffers(), **ck.frozen()}.items():
        out.setdefault(name, cast(t))
    return out


def _read_back(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def verify(state: dict[str, torch.Tensor], written: list[str]) -> int:
    """Read back every weight file of ``written`` (``hf_files.write_hf_model``'s list) and compare each tensor with
    ``state`` bitwise (dtype, shape, values); returns the number of tensors checked."""
    want = hf_files.untied(state)
    seen: set[str] = set()
    for path in written:
        if path.endswith(".json"):
            continue
        for name, t in _read_back(path).items():
            ref = want.get(name)
            if ref is None:
                raise CheckpointError(f"convert: {path} holds {name!r}, which the source does not")
            if t.dtype != ref.dtype or t.shape != ref.shape or not torch.equal(t, ref):
                raise CheckpointError(f"convert: {name!r} in {path} differs from the source ({t.dtype} "
                                      f"{tuple(t.shape)} written, {ref.dtype} {tuple(ref.shape)} read)")
            seen.add(name)
    if seen != set(want):
        raise CheckpointError(f"convert: {sorted(set(want) - seen)[:8]} were not written to {written}")
    return len(seen)


__all__ = ["SOURCES", "locate", "state_dict", "verify"]
