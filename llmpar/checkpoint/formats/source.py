"""THE reader protocol: a checkpoint of any layout read as it is, by name, and which layout a directory holds.

    found = find("ckpts", None)                # the foreign checkpoint load_checkpoint reads (None: llmpar's own)
    src = open_source(locate("ckpts"))         # convert's (``open.py``): llmpar's, DeepSpeed's or universal
    src.names, src.shapes                      # the trained params (the optimizer's order) and their full shapes
    src.read("h.0.w", "exp_avg", a, z)         # elements [a, z) of one state, flat, as saved
    src.step("h.0.w"), src.hyper()             # its Adam step; the param groups' hyper-parameters

Every format has one reader (N readers) and every writer (``deepspeed/write.py``, ``universal/write.py``,
``dcp/write.py``, ``hf/write.py``) and loader (``loader.py``) asks only these questions (M writers): a conversion is
``writer(open_source(locate(src)))`` (``open.py`` opens a located checkpoint as its reader), never a path between
two formats. The readers:

    llmpar      ``llmpar.LlmparCheckpoint``                  llmpar's own (``metadata.json``), every file verified
    deepspeed   ``deepspeed/open.open_deepspeed``            DeepSpeed's ZeRO 0-3, pipeline, tensor-parallel files
    universal   ``universal/read.UniversalCheckpoint``       DeepSpeed's universal layout (``zero/<param>/fp32.pt``)
    dcp         ``dcp/format.DcpCheckpoint``                 ``torch.distributed.checkpoint`` (loaded, not converted)

:func:`detect` says which layout one directory holds; :func:`find` resolves ``(load_dir, tag)`` as
``load_checkpoint`` does (a universal checkpoint first, also through ``latest_universal``; DCP unless DeepSpeed's
files are there too; DeepSpeed's; None: llmpar's, which ``load.py`` resolves itself); :func:`locate` as ``convert``
does (``source``: "auto" or the layout it must be, each refusal naming what was found). The helpers below read a
reader as the writers need it: fp32 pieces (:func:`piece_into`, a master read as the params where the run kept
none), whole tensors (:func:`full`), the one step count (:func:`one_step`) and the full weights (:func:`weights`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from llmpar.checkpoint import files
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.dcp import format as dcp_format
from llmpar.checkpoint.formats.deepspeed import files as ds_files
from llmpar.checkpoint.formats.universal import read as universal_read

FORMATS = ("llmpar", "deepspeed", "universal", "dcp")
SOURCES = ("auto", "deepspeed", "llmpar", "universal")  # what convert reads (``--from``)
HYPER = ("lr", "betas", "eps", "weight_decay")
CHUNK = 1 << 22  # elements of a source read at a time by piece_into


@runtime_checkable
class Source(Protocol):
    """A checkpoint read as it is. ``names``: the trained params (those with optimizer state) in the optimizer's
    order; ``shapes``: their full shapes (the unsplit model's); ``aliases``: {tied name: the name stored};
    ``stage`` / ``dp``: the ZeRO stage and data-parallel degree it was saved at; ``format``: which of ``FORMATS``.
    States are named "params" (the weights as saved), "master" (the fp32 master), "exp_avg", "exp_avg_sq"."""

    format: str
    path: str
    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, str]
    stage: int
    dp: int

    def groups(self) -> list[list[str]]:
        """The param groups' names, in the optimizer's order."""
        ...

    def hyper(self) -> list[dict[str, Any]]:
        """Per param group: lr, betas, eps, weight_decay (and the rest the optimizer kept)."""
        ...

    def source(self, name: str) -> str:
        """The name ``name``'s values are stored under (a tied copy's: its source); a CheckpointError when absent."""
        ...

    def has(self, name: str, key: str) -> bool: ...

    def read(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        """Elements ``[a, z)`` of param ``name``'s state ``key``, flat, as saved (its dtype; maybe a view)."""
        ...

    def step(self, name: str) -> float:
        """The optimizer step count of the state holding ``name``."""
        ...

    def prepare(self, name: str, shape: tuple[int, ...]) -> None:
        """Before ``name`` is read at full ``shape``: its files opened and checked (a no-op where they are)."""
        ...

    def release(self, name: str = "") -> None:
        """Let go of what was mapped to read ``name`` where it is ``name``'s alone (a universal param's files), of
        everything read so far when ``name`` is empty; read again when next asked for (their mapped pages leave the
        process once no tensor holds them)."""
        ...

    def buffers(self) -> dict[str, torch.Tensor]: ...

    def frozen(self) -> dict[str, torch.Tensor]: ...

    def counters(self) -> dict[str, Any]:
        """The engine's counters (``global_steps``, ``global_samples``, ``skipped_steps``, a loss scaler)."""
        ...

    def scheduler(self) -> dict | None: ...

    def client_state(self) -> dict: ...

    def ds_config(self) -> dict:
        """The DeepSpeed config the checkpoint recorded ({} when none)."""
        ...

    def hf_config(self) -> dict:
        """{"hf_config", "hf_generation_config"} of the model when the checkpoint recorded them, else {}."""
        ...

    def describe(self) -> str:
        """The layout in words, for messages."""
        ...

    def file_of(self, name: str) -> str:
        """Where ``name`` is saved, for messages ("" when the directory says it)."""
        ...


# ---------------------------------------------------------------------------------------------------- which layout
def detect(path: str) -> str | None:
    """The layout directory ``path`` holds (one of ``FORMATS``), None when it is none of them."""
    if universal_read.detect(path):
        return "universal"
    if ds_files.detect(path):
        return "deepspeed"
    if dcp_format.detect(path):
        return "dcp"
    return "llmpar" if files.complete(path) else None


@dataclass(frozen=True)
class Located:
    """A foreign checkpoint directory ``path`` of layout ``format``."""

    format: str
    path: str

    def identity(self) -> str:
        """What tells this checkpoint from another (its files' names, sizes and mtimes), the same on every rank."""
        ident = {"universal": universal_read.identity, "dcp": dcp_format.identity, "deepspeed": ds_files.identity}
        return ident[self.format](self.path)


def find(load_dir: Any, tag: str | None) -> Located | None:
    """The foreign checkpoint ``(load_dir, tag)`` names, as ``load_checkpoint`` reads it: a universal one
    (``universal_read.resolve``: also the tag ``latest_universal`` names), else a DCP directory without DeepSpeed's
    files, else DeepSpeed's; None: llmpar's own layout (or nothing), which ``files.resolve`` reports."""
    uni = universal_read.resolve(load_dir, tag)
    if uni is not None:
        return Located("universal", uni)
    path = ds_files.resolve(load_dir, tag) or dcp_format.resolve(load_dir, tag)
    return Located(detect(path) or "", path) if path is not None else None  # DeepSpeed's files first: its layout


def _holds(where: str) -> Any:
    return sorted(os.listdir(where))[:8] if os.path.isdir(where) else "nothing (no such directory)"


def locate(src: str, tag: str | None = None, source: str = "auto") -> Located:
    """The checkpoint ``src`` names for a conversion (a checkpoint directory, or a save directory with ``latest`` /
    ``latest_universal`` or ``tag``); ``source``: "auto", or the layout it must be (one of ``SOURCES``)."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is not one of {list(SOURCES)}")
    src = os.fspath(src)
    if source in ("auto", "universal"):
        uni = universal_read.resolve(src, tag)
        if uni is not None:
            return Located("universal", uni)
        if source == "universal":
            where = os.path.join(src, tag) if tag is not None else src
            raise CheckpointError(
                f"{where} is not a universal checkpoint (no zero/ folder beside a model states file, "
                f"and no latest_universal naming one): it holds {_holds(where)}"
            )
    ds = ds_files.resolve(src, tag) or (src if tag is None and ds_files.detect(src) else None)
    if ds is not None and source in ("auto", "deepspeed"):
        return Located("deepspeed", ds)
    if ds is not None:
        raise CheckpointError(
            f"{ds} is a DeepSpeed checkpoint, not llmpar's (--from llmpar): convert it with --from deepspeed or auto"
        )
    if source == "deepspeed":
        where = os.path.join(src, tag) if tag is not None else src
        raise CheckpointError(
            f"{where} is not a DeepSpeed checkpoint (no mp_rank_*_model_states.pt or "
            f"*zero_pp_rank_*_optim_states.pt, or a metadata.json): it holds {_holds(where)}"
        )
    if tag is None and os.path.isfile(os.path.join(src, files.METADATA)):
        return Located("llmpar", src)
    return Located("llmpar", files.resolve(src, tag)[1])


# ---------------------------------------------------------------------------------------------------- reading
def state_key(src: Source, name: str, key: str) -> str:
    """``key``, or "params" for a "master" the run did not keep (its weights are the fp32 values)."""
    return "params" if key == "master" and not src.has(name, "master") else key


def piece_into(src: Source, name: str, key: str, a: int, z: int, out: torch.Tensor) -> None:
    """Elements ``[a, z)`` of ``name``'s state ``key`` (:func:`state_key`) copied into ``out`` (cast to its dtype),
    read ``CHUNK`` elements at a time, what was mapped for ``name`` alone let go after each (``Source.release``)."""
    key = state_key(src, name, key)
    if not src.has(name, key):
        raise CheckpointError(f"{src.format} checkpoint {src.path} has no {key!r} of {name!r}")
    for b in range(a, z, CHUNK):
        e = min(b + CHUNK, z)
        out[b - a : e - a].copy_(src.read(name, key, b, e).detach())  # saved as a param: no grad
        src.release(name)


def piece(src: Source, name: str, key: str, a: int, z: int) -> torch.Tensor:
    """Elements ``[a, z)`` of ``name``'s state ``key`` as a new flat fp32 tensor (:func:`piece_into`)."""
    out = torch.empty(z - a, dtype=torch.float32)
    piece_into(src, name, key, a, z, out)
    return out


def full(src: Source, name: str, key: str) -> torch.Tensor:
    """``name``'s state ``key``, every element, as a new flat fp32 tensor."""
    return piece(src, name, key, 0, math.prod(src.shapes[name]))


def one_step(src: Source) -> float:
    """The step count of every trained param (DeepSpeed's layouts keep one per group); a CheckpointError naming
    the steps found when they differ."""
    steps = {src.step(n) for n in src.names}
    if len(steps) > 1:
        raise CheckpointError(f"{src.path}: param groups at different step counts {sorted(steps)}: DeepSpeed keeps one")
    return float(next(iter(steps), 0.0))


def weights(
    src: Source, dtype: torch.dtype | None, *, copy: bool = False, extras_as_saved: bool = False
) -> dict[str, torch.Tensor]:
    """{name: full tensor} of the model: each trained param's fp32 master (its weights where the run kept none),
    a tied name as the same tensor as its source, then buffers and frozen params; float tensors cast to ``dtype``
    (float64 kept; None: as saved), buffers and frozen params kept as saved when ``extras_as_saved``. ``copy``:
    every tensor a copy of its own (else a view of the files where the dtype is kept)."""

    def cast(t: torch.Tensor, extra: bool = False) -> torch.Tensor:
        keep = dtype is None or not t.is_floating_point() or t.dtype == torch.float64 or (extra and extras_as_saved)
        t = t if keep else t.to(dtype)
        return t.clone() if copy else t

    out: dict[str, torch.Tensor] = {}
    for name in src.names:
        shape = src.shapes[name]
        key = state_key(src, name, "master")
        out[name] = cast(src.read(name, key, 0, math.prod(shape)).view(shape))
    for alias, name in src.aliases.items():
        if name in out:
            out[alias] = out[name]
    for name, t in {**src.buffers(), **src.frozen()}.items():
        out.setdefault(name, cast(t, extra=True))
    return out


__all__ = [
    "FORMATS",
    "HYPER",
    "SOURCES",
    "Located",
    "Source",
    "detect",
    "find",
    "full",
    "locate",
    "one_step",
    "piece",
    "piece_into",
    "state_key",
    "weights",
]
