"""Optimizers: FusedAdamW (fused multi-tensor AdamW in fp32 / fp32_master / bf16_sr / bf16_kahan precision)."""

from __future__ import annotations

from .adamw import STATE_PRECISIONS, FusedAdamW, group_mode, resolve_precision, state_dtypes

__all__ = ["STATE_PRECISIONS", "FusedAdamW", "group_mode", "resolve_precision", "state_dtypes"]
