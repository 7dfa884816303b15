"""What llmpar prints without being asked: a default handler for the ``llmpar`` logger (when the program configured
no logging) and the line ``initialize`` logs about what it built.

    [2026-01-01 12:00:00,000] [INFO] [llmpar] llmpar.initialize: Engine on 8 ranks (dp=4 x tp=2 x pp=1), ZeRO
    stage 2, bfloat16, train_batch_size 64 = micro 8 x gradient accumulation 2 x dp 4, optimizer AdamW (lr=0.0003,
    betas=(0.9, 0.95), eps=1e-08, weight_decay=0.1), scheduler WarmupCosineLR, gradient_clipping 1.0,
    steps_per_print 10

Global rank 0 prints llmpar's INFO lines (the line above, the engine's ``steps_per_print`` progress lines) to stdout;
every rank prints warnings, to stderr. A program that set up logging (a handler on the root or the ``llmpar`` logger,
e.g. ``logging.basicConfig``) gets nothing added: its handlers decide.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("llmpar")
HANDLER_NAME = "llmpar-default"
FORMAT = "[%(asctime)s] [%(levelname)s] [llmpar] %(message)s"
RANKS_CHOSEN = "llmpar_ranks_chosen"  # a record with this attribute true passes on any rank (``utils.log_dist``)


class RankFilter(logging.Filter):
    """Below WARNING, only global rank 0's records pass (and those whose caller chose the ranks)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING or bool(getattr(record, RANKS_CHOSEN, False))


class StdHandler(logging.StreamHandler):
    """INFO and below to stdout, warnings and errors to stderr (where Python prints them without a handler)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        super().emit(record)


def default_log_handler(rank: int) -> logging.Handler | None:
    """Attach (once) the default handler of the ``llmpar`` logger unless logging is configured already: INFO and up
    on global rank ``rank`` 0, WARNING and up elsewhere (:class:`RankFilter`); INFO to stdout, warnings to stderr
    (:class:`StdHandler`). Returns the handler, None when none is ours."""
    for h in logger.handlers:
        if h.get_name() == HANDLER_NAME:
            for f in h.filters:
                if isinstance(f, RankFilter):
                    f.rank = rank
            return h
    if logger.handlers or logging.getLogger().handlers:
        return None
    handler = StdHandler()
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(RankFilter(rank))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return handler


def describe(engine: Any, world: int) -> str:
    """One line: what ``initialize`` built (engine kind, degrees, ZeRO, precision, batch, optimizer, schedule)."""
    cfg, opt = engine.config, engine.optimizer
    pp = engine.runner.split.pp if hasattr(engine, "runner") else 1
    dp, tp = engine.dp_world_size, engine.mp_world_size
    zero = f"ZeRO stage {cfg.zero.stage}"
    offload = [k for k in ("optimizer", "param") if getattr(cfg.zero, f"offload_{k}").enabled]
    if offload:
        zero += f" (offload_{' + offload_'.join(offload)}: cpu)"
    dtype = (
        "bfloat16"
        if cfg.bf16
        else "float16 (loss scaling)"
        if engine.fp16_enabled()
        else str(engine.get_data_types()[0]).replace("torch.", "")
    )
    g = opt.param_groups[0]
    hyper = f"lr={g['lr']:.4g}, betas={tuple(g['betas'])}, eps={g['eps']:.3g}, weight_decay={g['weight_decay']:.4g}"
    groups = f", {len(opt.param_groups)} param groups" if len(opt.param_groups) > 1 else ""
    client = " (client optimizer mapped)" if engine.client_optimizer_name else ""
    sched = engine.lr_scheduler
    sched = (
        "none"
        if sched is None
        else engine.scheduler_name()
        if type(sched).__name__ == "WarmupSchedule"
        else f"{type(sched).__name__} (client)"
    )
    ranks = f"{world} rank{'s' if world != 1 else ''}"
    cp = getattr(engine, "context_parallel", None)
    if cp is not None:  # ZeRO shards over dp x cp
        ranks += (
            f" (context parallel: cp={cp.size} {cp.mode}"
            + (f" = ulysses {cp.ulysses_size} x ring {cp.ring_size}" if cp.mode == "hybrid" else "")
            + ")"
        )
    return (
        f"llmpar.initialize: {type(engine).__name__} on {ranks} (dp={dp} x tp={tp} x pp={pp}), {zero}, "
        f"{dtype}, train_batch_size {cfg.train_batch_size} = micro {cfg.train_micro_batch_size_per_gpu} x "
        f"gradient accumulation {cfg.gradient_accumulation_steps} x dp {dp}, optimizer "
        f"{engine.optimizer_name()}{client} ({hyper}{groups}), scheduler {sched}, gradient_clipping "
        f"{cfg.gradient_clipping}, steps_per_print {cfg.steps_per_print}"
    )


def log_initialized(engine: Any) -> None:
    """Global rank 0 logs :func:`describe` at INFO."""
    if engine.global_rank == 0 and logger.isEnabledFor(logging.INFO):
        logger.info("%s", describe(engine, engine.world_size))


__all__ = [
    "FORMAT",
    "HANDLER_NAME",
    "RANKS_CHOSEN",
    "RankFilter",
    "StdHandler",
    "default_log_handler",
    "describe",
    "log_initialized",
]
