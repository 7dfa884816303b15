"""llmpar's own checkpoints as a reader of the protocol (``source.py``): what the writers of the other formats
(``convert``) and ``consolidate`` read.

Every rank file is verified first (sizes and every block's sha256: ``shards.RankFiles.check(full=True)``). Each
trained param is named and shaped as in the unsplit model (``reshard.CheckpointReader``: a tensor-parallel param
concatenated over the saved tp ranks along its split dim, vocabulary padding dropped; a pipeline checkpoint already
names params as the unsplit model does, a tied weight once) and read whole, one param at a time (the last one read
is kept: a writer reads it in pieces). The experts of an expert-parallel run (``experts.py``) are in their own param
group, as ``split_params_into_different_moe_groups_for_optimizer`` makes them: the group the engine built them from
when it holds no dense param (the split's), else a group appended after the dense ones with the hyper-parameters of
the group they follow (an engine given ``model.parameters()``). Module buffers and frozen params come from dp rank
0's files, as ``buffers()`` (llmpar does not record which of them are frozen params: ``frozen()`` is empty). The param
groups are those the layout records per buffer; their hyper-parameters, the engine counters, the scheduler,
client_state and the HuggingFace config are ``metadata.json``'s.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from llmpar.checkpoint import files, metacheck
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.reshard import CheckpointReader


class LlmparCheckpoint:
    """llmpar checkpoint directory ``path`` (module docstring), every file verified when it opens."""

    format = "llmpar"

    def __init__(self, path: str) -> None:
        self.path = path
        self.meta = meta = metacheck.read(path)
        self.reader = reader = CheckpointReader(path, meta)
        for fname in sorted(meta["files"]):
            why = reader.files.check(fname, full=True)  # every block; read below from the same opened files
            if why is not None:
                raise CheckpointError(f"checkpoint shard {os.path.join(path, fname)} is {why}")
        buffers = meta["layout"]["buffers"]
        self.names: list[str] = list(reader.where)
        self.shapes: dict[str, tuple[int, ...]] = {n: reader.full_shape(n) for n in self.names}
        self.aliases: dict[str, str] = {}
        self.keys = {n: list(buffers[bi]["state_keys"]) for n, (bi, _, _) in reader.where.items()}
        self.group_of = {n: int(buffers[bi].get("group", 0)) for n, (bi, _, _) in reader.where.items()}
        count = max(len(meta["param_groups"]), 1)
        dense = set(self.group_of.values())
        self.extra: dict[int, int] = {}  # dense group an expert group follows -> the experts' own group, appended
        for n in sorted(set(reader.experts.shapes) - set(self.shapes)):  # an expert-parallel run's experts, whole
            self.names.append(n)
            self.shapes[n] = reader.experts.shapes[n]
            self.keys[n] = reader.experts.keys(n)
            owner = reader.experts.group.get(n, 0)
            if owner in dense or owner >= count:  # beside dense params: a group of their own after the dense ones
                self.group_of[n] = self.extra.setdefault(owner, count + len(self.extra))
            else:  # the group made for them (split_params_into_different_moe_groups_for_optimizer)
                self.group_of[n] = owner
        self.stage, self.dp = int(meta["stage"]), int(meta["dp"])
        self.tp, self.pp = int(meta["tp"]), int(meta.get("pp", 1))
        self._last: tuple[tuple[str, str], torch.Tensor] | None = None

    def expert_groups(self) -> set[int]:
        """The param groups holding experts and nothing else (an expert-parallel run's, module docstring)."""
        experts = set(self.reader.experts.shapes) - set(self.reader.where)
        by: dict[int, set[bool]] = {}
        for n in self.names:
            by.setdefault(self.group_of[n], set()).add(n in experts)
        return {g for g, kinds in by.items() if kinds == {True}}

    def groups(self) -> list[list[str]]:
        """The param groups' names, by the group each param's buffer records (one group when none does); the
        experts of an expert-parallel run in their own groups (module docstring)."""
        count = max(len(self.meta["param_groups"]), 1) + len(self.extra)
        return [[n for n in self.names if self.group_of[n] == g] for g in range(count)]

    def hyper(self) -> list[dict[str, Any]]:
        saved = self.meta["param_groups"]
        groups = [*saved, *(saved[o] if o < len(saved) else saved[0] for o in self.extra)]
        return [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]

    def source(self, name: str) -> str:
        if name not in self.shapes:
            raise CheckpointError(f"param {name!r} is not in llmpar checkpoint {self.path}")
        return name

    def has(self, name: str, key: str) -> bool:
        return key == "params" or key in self.keys[self.source(name)]

    def read(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        """Elements ``[a, z)`` of param ``name``'s state ``key``, flat, as saved (the whole param read once)."""
        if not self.has(name, key):
            raise CheckpointError(
                f"param {name!r} has no {key!r} in the llmpar checkpoint (saved: {self.keys[name]}): an "
                "optimizer without Adam moments is not written"
            )
        if self._last is None or self._last[0] != (name, key):  # one param's whole tensor at a time
            self._last = ((name, key), self.reader.full(name, key).reshape(-1))
        return self._last[1][a:z]

    def step(self, name: str) -> float:
        return self.reader.step(self.source(name))

    def prepare(self, name: str, shape: tuple[int, ...]) -> None:
        pass

    def release(self, name: str = "") -> None:
        if not name:  # the one param kept is what a writer reads in pieces: kept until every param is let go
            self._last = None

    def buffers(self) -> dict[str, torch.Tensor]:
        return self.reader.extras(self.tp, 0)

    def frozen(self) -> dict[str, torch.Tensor]:
        return {}

    def counters(self) -> dict[str, Any]:
        engine = self.meta["engine"]
        return {k: engine.get(k, 0) for k in ("global_steps", "global_samples", "skipped_steps")}

    def scheduler(self) -> dict | None:
        return self.meta["scheduler"]

    def client_state(self) -> dict:
        if files.CLIENT_STATE not in self.meta["files"]:
            return {}
        return files.load_file(os.path.join(self.path, files.CLIENT_STATE), mmap=False)

    def ds_config(self) -> dict:
        return {}

    def hf_config(self) -> dict:
        return dict(self.meta.get("model") or {})

    def describe(self) -> str:
        return f"llmpar ZeRO-{self.stage} at dp={self.dp} tp={self.tp} pp={self.pp}"

    def file_of(self, name: str) -> str:
        return ""


__all__ = ["LlmparCheckpoint"]
