"""Schedule names, their constraints, and the bubble each one leaves.

The schedules themselves are ``torch.distributed.pipelining``'s; llmpar only names them and checks the micro-batch
count up front, so a bad choice raises the same ``ValueError`` on every rank before any send or receive.

Bubble (idle) fraction of a step, with p = pp ranks, m = micro-batches, v = virtual stages per rank, and the
forward+backward of one micro-batch on one stage taking time t (all stages equal, no communication cost):

    GPipe, 1F1B:        (p - 1) / (m + p - 1)          step = (m + p - 1) t, of which (p - 1) t is idle
    interleaved 1F1B:   (p - 1) / (v m + p - 1)        each rank's t is split into v chunks of t / v

1F1B has GPipe's bubble but keeps at most p micro-batches of activations alive on the first stage (GPipe keeps m).
"""

from __future__ import annotations

from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_ALIASES = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved_1f1b": "interleaved_1f1b",
    "interleaved": "interleaved_1f1b",
    "interleaved1f1b": "interleaved_1f1b",
}


def normalize_schedule(schedule: str) -> str:
    if not isinstance(schedule, str) or schedule.lower().replace("-", "_") not in _ALIASES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    return _ALIASES[schedule.lower().replace("-", "_")]


def check_schedule(schedule: str, *, pp: int, micro_batches: int, virtual_stages: int) -> str:
    """Normalised name; raises ValueError naming the argument when the combination cannot run."""
    name = normalize_schedule(schedule)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be a positive int")
    if name == "interleaved_1f1b":
        if virtual_stages < 2 and pp > 1:
            raise ValueError(f"schedule='interleaved_1f1b' needs virtual_stages >= 2 in split(), got {virtual_stages}")
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            raise ValueError(
                f"micro_batches={micro_batches} does not work with interleaved 1F1B on pp={pp}: it must "
                f"be a multiple of max(1, micro_batches // pp) = {rounds} (e.g. < pp or a multiple of pp)"
            )
    elif virtual_stages != 1:
        raise ValueError(
            f"schedule={schedule!r} runs one stage per rank, but split() made virtual_stages="
            f"{virtual_stages}; use schedule='interleaved_1f1b' or virtual_stages=1"
        )
    if name == "1f1b" and micro_batches < pp:
        raise ValueError(f"micro_batches={micro_batches} must be >= pp={pp} for the 1F1B schedule")
    return name


def bubble_fraction(schedule: str, *, pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The schedule's idle fraction of a step (formulas in the module docstring)."""
    name = normalize_schedule(schedule)
    v = virtual_stages if name == "interleaved_1f1b" else 1
    return (pp - 1) / (v * micro_batches + pp - 1)


def schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[name]


__all__ = ["SCHEDULES", "bubble_fraction", "check_schedule", "normalize_schedule", "schedule_class"]
