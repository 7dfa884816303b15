"""How a DeepSpeed config reaches llmpar through ``transformers.TrainingArguments``: llmpar's
:class:`TrainingArguments` (``deepspeed=`` / ``llmpar_config=``), and transformers' own arguments (and their
subclasses) routed the same way once this package is imported; a ZeRO-3 config is registered for sharded builds
(``zero3.py``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import transformers

from llmpar.integrations.transformers.zero3 import register
from llmpar.runtime.config import read_config

logger = logging.getLogger("llmpar")


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` whose ``deepspeed=`` (or ``llmpar_config=``) is a config for llmpar."""

    llmpar_config: Any = dataclasses.field(
        default=None, metadata={"help": "DeepSpeed config (dict or JSON path) run by llmpar"}
    )

    def __post_init__(self) -> None:
        if self.deepspeed is not None:
            if self.llmpar_config is not None:
                raise ValueError("TrainingArguments: give the config once, deepspeed= or llmpar_config=")
            self.llmpar_config, self.deepspeed = self.deepspeed, None
        super().__post_init__()
        if self.llmpar_config is not None:  # a ZeRO-3 config: from_config / from_pretrained build sharded from now on
            register(self, read_config(self.llmpar_config))


def _route_deepspeed_to_llmpar() -> None:
    """From now on ``transformers.TrainingArguments(deepspeed=cfg)`` (and its subclasses') gives ``cfg`` to llmpar:
    ``llmpar_config`` set, ``deepspeed`` None before transformers' ``__post_init__`` runs (so DeepSpeed is never
    configured), and a ZeRO-3 config registered for sharded HF builds (``zero3.py``). Installed once."""
    cls = transformers.TrainingArguments
    if getattr(cls.__post_init__, "_llmpar", False):
        return
    original = cls.__post_init__
    said: list[bool] = []  # the log line, once per process

    def __post_init__(self: Any) -> None:
        config = None if isinstance(self, TrainingArguments) else self.deepspeed
        if config is not None:
            if getattr(self, "llmpar_config", None) is not None:
                raise ValueError("TrainingArguments: give the config once, deepspeed= or llmpar_config=")
            self.llmpar_config, self.deepspeed = config, None
            if not said:
                said.append(True)
                logger.info(
                    "llmpar: %s(deepspeed=...) runs its config on llmpar's engine (llmpar's Trainer), not DeepSpeed",
                    type(self).__name__,
                )
        original(self)
        if config is not None:
            register(self, read_config(config))

    __post_init__._llmpar = True  # type: ignore[attr-defined]
    __post_init__.__doc__ = original.__doc__
    cls.__post_init__ = __post_init__


_route_deepspeed_to_llmpar()


__all__ = ["TrainingArguments"]
