"""A DeepSpeed checkpoint of a model made tensor-parallel by its user (``deepspeed.initialize(..., mpu=...)``,
Megatron style), read as the unsplit model's: DeepSpeed 0.19 writes one file set per model-parallel rank T,

    DIR/TAG/mp_rank_TT_model_states.pt                     T's model states: "param_shapes" of T's shards
    DIR/TAG/[bf16_]zero_pp_rank_R_mp_rank_TT_optim_states.pt  T's ZeRO partitions (stages 1-2; zero_pp_rank_R_mp_rank_TT
                                                           model states at stage 3), "checkpoint_parallel_dimensions"
                                                           {"tp_degree": tp, "pp_degree": 1}

each read by a :class:`~llmpar.checkpoint.formats.deepspeed.rank.RankCheckpoint` of that rank. Which dim a param is
split on the files do not say; the model loading it does (``model``: {name: (full shape, trained)}, the loading
engine's full shapes, ``load.py``): a param whose shards all have its full shape is replicated (read from rank 0),
one whose shards concatenate to it along exactly one dim is split there (Megatron's convention: column-parallel
weights and biases dim 0, row-parallel weights dim 1), merged in rank order when read (one whole param at a time);
any other is refused naming the param, its shards' shapes and the model's. Buffers, frozen params, counters,
scheduler and client_state are rank 0's.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.deepspeed.files import detect, model_parallel_ranks
from llmpar.checkpoint.formats.deepspeed.rank import RankCheckpoint


def _split_dim(shards: list[tuple[int, ...]], full: tuple[int, ...]) -> int | None | Literal["?"]:
    """None: replicated; d: split along d; "?": neither."""
    if all(s == full for s in shards):
        return None
    fits = [
        d
        for d in range(len(full))
        if all(len(s) == len(full) for s in shards)
        and sum(s[d] for s in shards) == full[d]
        and all(s[:d] + s[d + 1 :] == full[:d] + full[d + 1 :] for s in shards)
    ]
    return fits[0] if len(fits) == 1 else "?"


class DeepSpeedTPCheckpoint(RankCheckpoint):
    """A tensor-parallel DeepSpeed checkpoint (module docstring). ``tp``: its degree; ``parts[t]``: rank t's reader;
    ``dims``: {name: split dim or None}."""

    def __init__(self, path: str, mp_rank: int | None = None, model: dict | None = None) -> None:
        self.path = path
        mp = model_parallel_ranks(detect(path))
        if mp != list(range(len(mp))):
            raise CheckpointError(f"{path}: DeepSpeed model-parallel ranks {mp} are not 0..{len(mp) - 1}")
        self.tp = len(mp)
        try:
            self.parts = [RankCheckpoint(path, mp_rank=t) for t in range(self.tp)]
        except CheckpointError as e:
            raise CheckpointError(
                f"tensor-parallel DeepSpeed checkpoint {path} of model-parallel ranks {mp}: {e}"
            ) from e
        first = self.parts[0]
        dims = first.model.get("checkpoint_parallel_dimensions") or {}
        if int(dims.get("tp_degree", self.tp)) != self.tp or int(dims.get("pp_degree", 1)) != 1:
            raise CheckpointError(f"{path}: DeepSpeed checkpoint of {dims} has the files of model-parallel ranks {mp}")
        for t, part in enumerate(self.parts):
            if (part.kind, part.stage, part.dp, part.names) != (first.kind, first.stage, first.dp, first.names):
                raise CheckpointError(
                    f"{path}: model-parallel rank {t}'s files ({part.describe()}, params "
                    f"{part.names[:4]}...) are not rank 0's kind ({first.describe()}, "
                    f"{first.names[:4]}...)"
                )
        if not model:
            raise CheckpointError(
                f"{path} is a tensor-parallel (tp={self.tp}) DeepSpeed checkpoint: its files do not "
                "say which dim each param is split on; load it with engine.load_checkpoint, whose "
                "model's full shapes tell"
            )
        self.stage, self.dp, self.bf16, self.kind, self.mp_rank = first.stage, first.dp, first.bf16, first.kind, 0
        self.model, self.aliases, self.unnamed = first.model, dict(first.aliases), False
        self.names, self.shapes = list(first.names), {}
        self.dims: dict[str, int | None] = {}
        for name in self.names:
            shards = [p.shapes[name] for p in self.parts]
            full = tuple(int(d) for d in model[name][0]) if name in model else shards[0]
            dim = _split_dim(shards, full)
            if isinstance(dim, str):  # "?", the only str _split_dim returns
                raise CheckpointError(
                    f"param {name!r} of tensor-parallel (tp={self.tp}) DeepSpeed checkpoint {path} "
                    f"has shards of shapes {shards}: they are neither the model's full shape {full} "
                    "nor its split along one dim"
                )
            self.dims[name], self.shapes[name] = dim, full
        self._cache: tuple[tuple[str, str], torch.Tensor] | None = None

    def file_of(self, name: str) -> str:
        return f"mp_rank_00..{self.tp - 1:02d}"

    def describe(self) -> str:
        return f"tensor-parallel tp={self.tp}, {self.parts[0].describe()}"

    def has(self, name: str, key: str) -> bool:
        return self.parts[0].has(self.source(name), key)

    def read(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        name = self.source(name)
        dim = self.dims[name]
        if dim is None:
            return self.parts[0].read(name, key, a, z)
        if self._cache is None or self._cache[0] != (name, key):
            shards = [p.read(name, key, 0, math.prod(p.shapes[name])).view(p.shapes[name]) for p in self.parts]
            self._cache = ((name, key), torch.cat(shards, dim).reshape(-1))
        return self._cache[1][a:z]

    def step(self, name: str) -> float:
        return self.parts[0].step(self.source(name))

    def buffers(self) -> dict[str, torch.Tensor]:
        return self.parts[0].buffers()

    def frozen(self) -> dict[str, torch.Tensor]:
        return self.parts[0].frozen()

    def counters(self) -> dict[str, Any]:
        return self.parts[0].counters()

    def hyper(self) -> list[dict[str, Any]]:
        return self.parts[0].hyper()

    def scheduler(self) -> dict | None:
        return self.parts[0].scheduler()

    def client_state(self) -> dict:
        return self.parts[0].client_state()

    def release(self, name: str = "") -> None:
        if name:
            return
        self._cache = None
        for part in self.parts:
            part.release(name)


__all__ = ["DeepSpeedTPCheckpoint"]
