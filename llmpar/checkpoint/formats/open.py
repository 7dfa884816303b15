"""A located checkpoint (``source.locate``) opened as its format's reader, as the writers read it.

src = open_source(locate("ckpts", None, "auto"))    # llmpar's, DeepSpeed's (any layout) or universal
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.dcp.format import DcpCheckpoint
from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed
from llmpar.checkpoint.formats.llmpar import LlmparCheckpoint
from llmpar.checkpoint.formats.source import Located, Source, full, one_step, piece, piece_into
from llmpar.checkpoint.formats.universal.read import UniversalCheckpoint


def open_source(found: Located) -> Source:
    """The reader of ``found`` (``source.locate``) as the writers read it: every file checked (a DeepSpeed checkpoint's
    against each other, an llmpar one's block hashes) and every param's files opened before anything is written (a
    universal checkpoint's shapes come from them)."""
    reader: Source
    if found.format == "deepspeed":
        reader = open_deepspeed(found.path)
    elif found.format == "universal":
        reader = UniversalCheckpoint(found.path)
    elif found.format == "dcp":
        reader = DcpCheckpoint(found.path)
    else:
        reader = LlmparCheckpoint(found.path)
    for name in reader.names:
        reader.prepare(name, reader.shapes[name])
    return reader


@dataclass(kw_only=True)
class Writable:
    """What DeepSpeed's layouts are written from, read once from reader ``src`` (:func:`writable`): the param
    ``groups`` and ``shapes``, each group's ``hyper``-parameters, the one ``step``, buffers, frozen params, the run
    (``counters``, ``scheduler``, ``client`` state, ``ds_config``), the saved ``stage`` (0 read as 1) and ``dp``;
    each param's fp32 states through :meth:`full` / :meth:`piece` / :meth:`piece_into`."""

    src: Source
    format: str
    groups: list[list[str]]
    shapes: dict[str, tuple[int, ...]]
    hyper: list[dict]
    step: float
    buffers: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]
    counters: dict[str, Any]
    scheduler: Any
    client: dict
    ds_config: dict
    stage: int
    dp: int

    def full(self, name: str, key: str) -> torch.Tensor:
        return full(self.src, name, key)

    def piece(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        return piece(self.src, name, key, a, z)

    def piece_into(self, name: str, key: str, a: int, z: int, out: torch.Tensor) -> None:
        piece_into(self.src, name, key, a, z, out)


def writable(src: Source) -> Writable:
    """``src`` as the writers read it; refused, naming what was found: param groups at different step counts, a
    group count that differs between the param shapes and the optimizer, an llmpar pipeline (pp > 1) source, an
    llmpar source of several param groups."""
    if isinstance(src, LlmparCheckpoint) and src.pp > 1:
        raise CheckpointError(
            f"{src.path}: llmpar pipeline checkpoint (pp={src.pp}): DeepSpeed's ZeRO and "
            "universal layouts are written from pp=1 checkpoints only (load it at pp=1 and save)"
        )
    groups, hyper = src.groups(), src.hyper()
    if isinstance(src, LlmparCheckpoint) and len(hyper) - len(src.expert_groups()) != 1:  # experts' own: recorded
        raise CheckpointError(
            f"{src.path}: llmpar checkpoint of {len(hyper)} param groups: which "
            "param is in which is not recorded; only one group is written to DeepSpeed's layout"
        )
    if len(hyper) != len(groups):
        raise CheckpointError(
            f"{src.path}: {len(groups)} param groups by param_shapes, {len(hyper)} "
            "in the optimizer state: cannot be written"
        )
    return Writable(
        src=src,
        format=src.format,
        groups=groups,
        shapes=dict(src.shapes),
        hyper=hyper,
        step=one_step(src),
        buffers=src.buffers(),
        frozen=src.frozen(),
        counters=src.counters(),
        scheduler=src.scheduler(),
        client=src.client_state(),
        ds_config=src.ds_config(),
        stage=min(max(src.stage, 1), 3),
        dp=src.dp,
    )


def clip_grad(s: Writable) -> dict:
    """{"clip_grad": the source's gradient clipping} when it recorded one (a DeepSpeed source's ds_config), else {}:
    a ZeRO 1-2 load then keeps the engine's own (DeepSpeed takes a saved 0.0 as clipping off)."""
    clip = s.ds_config.get("gradient_clipping")
    return {} if clip is None else {"clip_grad": float(clip)}


__all__ = ["Writable", "clip_grad", "open_source", "writable"]
