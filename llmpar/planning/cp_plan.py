"""The planner's long-context layouts and their context-parallel traffic (``planner.py``'s module doc, ``context.py``
for the formulas)."""

from __future__ import annotations

from typing import Any, Callable

from .comm import AxisComm, _link
from .context import attention_seconds, cp_traffic
from .layout import CHECKPOINT_MODES, Layout
from .model_spec import ModelSpec
from .presets import Hardware


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def context_layouts(
    req: Any, gpus: int, tp: int, zero_choices: Callable[[int, bool], list[tuple[int, str]]]
) -> list[Layout]:
    """The tiled (cp = 1) and context-parallel layouts of ``tp`` at pp=1: per cp | gpus / tp, ring, Ulysses when
    tp cp divides the heads, and hybrid with the largest Ulysses part u (1 < u < cp, u | cp, tp u | heads); ZeRO
    stages and offload as ``zero_choices`` gives for dp x cp ranks, every recompute mode."""
    out: list[Layout] = []
    heads = req.model.n_heads
    for cp in _divisors(gpus // tp):
        dp = gpus // (tp * cp)
        modes: list[tuple[str, int]] = [("ulysses", 1)] if cp == 1 else [("ring", 1)]
        if cp > 1 and heads % (tp * cp) == 0:
            modes.append(("ulysses", 1))
        inner = [u for u in _divisors(cp) if 1 < u < cp and heads % (tp * u) == 0]
        if inner:
            modes.append(("hybrid", inner[-1]))
        for mode, u in modes:
            for stage, offload in zero_choices(dp * cp, req.allow_offload):
                for ckpt in CHECKPOINT_MODES:
                    out.append(
                        Layout(
                            tp=tp,
                            dp=dp,
                            cp=cp,
                            cp_mode=mode,
                            ulysses_size=u,
                            tiled=True,
                            zero_stage=stage,
                            offload=offload,
                            activation_checkpointing=ckpt,
                            sequence_parallel=req.sequence_parallel and tp > 1,
                        )
                    )
    return out


def cp_comm(
    spec: ModelSpec,
    layout: Layout,
    hw: Hardware,
    *,
    micro_batch: int,
    micro_batches: int,
    precision: str,
    mfu: float,
    tokens: float,
) -> tuple[AxisComm, float]:
    """The cp axis of one step (``context.cp_traffic``) on NVLink when tp x cp ranks fit a node, else the network,
    and its exposed seconds: all of Ulysses' all-to-alls, the ring's beyond the rank's attention compute."""
    act = 4 if precision == "fp32" else 2
    uly, ring = cp_traffic(
        spec, layout, seq_len=spec.seq_len, micro_batch=micro_batch, micro_batches=micro_batches, act_bytes=act
    )
    link, bw = _link(hw, layout.tp * layout.cp)
    hide = attention_seconds(
        spec, layout, seq_len=spec.seq_len, tokens_per_rank=tokens / layout.world_size, flops_per_s=hw.peak_flops * mfu
    )
    exposed = uly / bw + max(0.0, ring / bw - hide)
    axis = AxisComm(
        axis="cp",
        bytes=uly + ring,
        seconds=(uly + ring) / bw,
        link=link,
        cross_node_bytes=uly + ring if link == "network" else 0.0,
    )
    return axis, exposed
