"""``deepspeed.utils`` for DeepSpeed scripts: the logger, ``log_dist``, ``RepeatingLoader``, ``zero_to_fp32``
(consolidating llmpar checkpoints) and ``groups`` (the expert-parallel groups of DeepSpeed MoE scripts).

    from llmpar.utils import log_dist, logger
    log_dist("loaded the data", ranks=[0])          # "[Rank 0] loaded the data" on global rank 0
    from llmpar.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

``logger`` is ``logging.getLogger("llmpar")``; ``llmpar.initialize`` gives it a stdout handler when the program set
up no logging (``llmpar.runtime.logs``). DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` accessors of ZeRO
partitions are not provided (errors naming ``llmpar.zero.GatheredParameters`` / ``engine.module_state_dict()``).
A DeepSpeed-compatibility package: nothing inside llmpar imports it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from llmpar.runtime.logs import RANKS_CHOSEN
from llmpar.runtime.pipeline_engine import RepeatingLoader
from llmpar.utils import (
    groups,  # noqa: F401  (deepspeed.utils.groups: the expert-parallel group registry)
    zero_to_fp32,  # noqa: F401  (deepspeed.utils.zero_to_fp32 as an attribute too)
)

logger = logging.getLogger("llmpar")


def get_dist_msg(message: str, ranks: list[int] | None = None) -> str | None:
    """``"[Rank r] message"`` when this process should log it (torch.distributed not initialized, this rank in
    ``ranks``, or ``ranks`` starting with -1: every rank), else None."""
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    ranks = ranks or []
    if not initialized or (ranks and (ranks[0] == -1 or rank in set(ranks))):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the global ``ranks`` (``[-1]``: all; none given: only when torch.distributed is not
    initialized), prefixed ``[Rank r]``, at ``level`` (DeepSpeed's)."""
    msg = get_dist_msg(message, ranks)
    if msg is not None:
        logger.log(level, msg, extra={RANKS_CHOSEN: True})


def print_dist(message: str, ranks: list[int] | None = None) -> None:
    """:func:`log_dist` with ``print`` (whatever the log level)."""
    msg = get_dist_msg(message, ranks)
    if msg is not None:
        print(msg)


def _not_here(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"deepspeed.utils.{name} is not provided: read whole params inside `with "
            "llmpar.zero.GatheredParameters(params):` (stage 3; modifier_rank= to write them), "
            "the full weights with engine.module_state_dict(), this rank's reduced gradient "
            "pieces with engine.optimizer.grad_pieces(param)"
        )

    refuse.__name__ = name
    return refuse


safe_get_full_fp32_param = _not_here("safe_get_full_fp32_param")
safe_get_full_grad = _not_here("safe_get_full_grad")
safe_get_full_optimizer_state = _not_here("safe_get_full_optimizer_state")
safe_set_full_fp32_param = _not_here("safe_set_full_fp32_param")
safe_set_full_optimizer_state = _not_here("safe_set_full_optimizer_state")
safe_get_local_fp32_param = _not_here("safe_get_local_fp32_param")
safe_get_local_grad = _not_here("safe_get_local_grad")
safe_get_local_optimizer_state = _not_here("safe_get_local_optimizer_state")

__all__ = [
    "RepeatingLoader",
    "get_dist_msg",
    "log_dist",
    "logger",
    "print_dist",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "groups",
    "zero_to_fp32",
]
