"""The ``"pipeline"`` block of the config ``llmpar.initialize`` reads (DeepSpeed keeps pipeline settings in code, in
its ``PipelineModule``; llmpar takes them here):

    "pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 8}

stages: pipeline-parallel degree pp (>= 1); schedule: gpipe, 1f1b (default) or interleaved_1f1b; micro_batches:
micro-batches per step, which *is* DeepSpeed PipelineEngine's gradient_accumulation_steps (give either, or both
equal); virtual_stages: stages per rank (default 2 for interleaved_1f1b, else 1); partition: "parameters" (balance
parameter counts, DeepSpeed's default) or a list of boundaries (first block index of stages 1..S-1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmpar.pipeline.schedules import normalize_schedule
from llmpar.zero.config import as_int, check_keys

_KEYS = ["stages", "schedule", "micro_batches", "virtual_stages", "partition"]
_UNSUPPORTED = {
    "activation_checkpoint_interval": "use torch.utils.checkpoint in the model",
    "pipe_partitioned": "not supported", "grad_partitioned": "not supported (use ZeRO stage 1/2 over dp)",
    "seed_layers": "not supported", "use_reentrant": "not supported",
}


@dataclass(kw_only=True)
class PipelineConfig:
    stages: int = 1
    schedule: str = "1f1b"
    micro_batches: int | None = None  # None: gradient_accumulation_steps
    virtual_stages: int | None = None
    partition: str | list[int] = "parameters"

    def __post_init__(self) -> None:
        self.stages = as_int("pipeline.stages", self.stages, minimum=1)
        try:
            self.schedule = normalize_schedule(self.schedule)
        except ValueError as e:
            raise ValueError(f'"pipeline.schedule": {e}') from None
        if self.micro_batches is not None:
            self.micro_batches = as_int("pipeline.micro_batches", self.micro_batches, minimum=1)
        if self.virtual_stages is None:
            self.virtual_stages = 2 if self.schedule == "interleaved_1f1b" else 1
        self.virtual_stages = as_int("pipeline.virtual_stages", self.virtual_stages, minimum=1)
        if isinstance(self.partition, str):
            if self.partition != "parameters":
                raise ValueError(f'"pipeline.partition"={self.partition!r} must be "parameters" or a list of '
                                 "block boundaries")
        elif not isinstance(self.partition, list) or not all(isinstance(b, int) and not isinstance(b, bool)
                                                             for b in self.partition):
            raise TypeError(f'"pipeline.partition" must be "parameters" or a list of ints, got {self.partition!r}')

    @classmethod
    def from_dict(cls, block: Any) -> "PipelineConfig":
        check_keys("pipeline", block, _KEYS, _UNSUPPORTED)
        return cls(**block)

    @property
    def boundaries(self) -> list[int] | None:
        return None if isinstance(self.partition, str) else list(self.partition)


__all__ = ["PipelineConfig"]
