"""A parallel layout as the planner prices it (:class:`Layout`): the degrees tp x pp x dp (x cp), the ZeRO stage and
offload, sequence parallelism, activation checkpointing, the ZeRO++-class options and long-context choices, checked
once where it is built (with ``llmpar.zero.ZeroConfig``'s rules for the ZeRO++ keys). ``memory.py``, ``comm.py``,
``cp_plan.py`` and ``planner.py`` read it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .context import CP_MODES, DEFAULT_TILE

OFFLOAD_MODES = ("none", "optimizer", "optimizer+params")
CHECKPOINT_MODES = ("none", "selective", "full")


def check_choice(name: str, value: Any, accepted: tuple[Any, ...] | list[Any]) -> None:
    if value not in accepted:
        raise ValueError(f"{name}={value!r}; accepted: {', '.join(map(repr, accepted))}")


def check_degree(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass(kw_only=True, frozen=True)
class Layout:
    """A parallel layout: degrees tp x pp x dp = world size, ZeRO stage over dp, offload, sequence parallelism
    (tp > 1 only) and activation checkpointing (``"none"``, ``"selective"``: attention core only, ``"full"``).

    ZeRO++-class compressed communication, under ``zero_optimization``'s key names and checks
    (``llmpar.zero.ZeroConfig``): ``zero_quantized_weights`` (qwZ, stage 3), ``zero_hpz_partition_size`` (hpZ,
    stage 3, divides dp), ``zero_quantized_gradients`` (qgZ, stages 2-3) with ``..._error_feedback``, the bits
    (8 or 4) and ``zero_quantization_block_size`` (values per fp32 scale). ``comm.py`` gives their bytes.
    ``stage3_max_reuse_distance`` (stage 3, DeepSpeed's default 1e9): layers that close to their backward use stay
    gathered from forward to backward (``ModelSpec.stage3_kept_layers``): more gathered memory, less traffic.

    Long context (``context.py``): ``cp`` context-parallel ranks per dp rank (the sequence split over them;
    ``cp_mode`` "ulysses", "ring" or "hybrid" with ``ulysses_size`` Ulysses ranks inside), ZeRO shards over dp x cp;
    ``tiled``: the sequence-tiled loss and MLP with ``tile`` tokens per tile. Both need pp=1.

    Mixture of experts (``moe.py``): ``ep`` expert-parallel ranks folded over the dp x cp ranks (it divides them);
    each holds num_experts / ep experts, sharded by ZeRO over the edp = dp cp / ep ranks holding the same ones."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0
    offload: str = "none"
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    zero_quantized_weights: bool = False
    zero_hpz_partition_size: int = 1
    zero_quantized_gradients: bool = False
    zero_quantized_gradients_error_feedback: bool = False
    zero_quantization_block_size: int = 256
    zero_quantized_weights_bits: int = 8
    zero_quantized_gradients_bits: int = 4
    stage3_max_reuse_distance: int = 1_000_000_000
    cp: int = 1
    cp_mode: str = "ulysses"
    ulysses_size: int = 1
    tiled: bool = False
    tile: int = DEFAULT_TILE
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ulysses_size", "tile", "ep"):
            check_degree(name, getattr(self, name))
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} does not divide dp x cp = {self.dp * self.cp}: experts fold over them")
        self._check_context()
        check_choice("zero_stage", self.zero_stage, (0, 1, 2, 3))
        check_choice("offload", self.offload, OFFLOAD_MODES)
        check_choice("activation_checkpointing", self.activation_checkpointing, CHECKPOINT_MODES)
        if self.offload == "optimizer+params" and self.zero_stage != 3:
            raise ValueError(f"offload='optimizer+params' needs zero_stage=3, got zero_stage={self.zero_stage}")
        if self.offload != "none" and self.zero_stage == 0:
            raise ValueError(f"offload={self.offload!r} needs a ZeRO stage >= 1, got zero_stage=0")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1, got tp=1")
        reuse = self.stage3_max_reuse_distance
        if not isinstance(reuse, int) or isinstance(reuse, bool) or reuse < 0:
            raise ValueError(f"stage3_max_reuse_distance={reuse!r} must be an integer >= 0 (elements)")
        self._check_compression()

    def _check_context(self) -> None:
        check_choice("cp_mode", self.cp_mode, CP_MODES)
        if not isinstance(self.tiled, bool):
            raise ValueError(f"tiled={self.tiled!r} must be True or False")
        u = self.ulysses_size
        if self.cp_mode == "hybrid" and self.cp > 1 and not (1 < u < self.cp and self.cp % u == 0):
            raise ValueError(
                f"cp_mode='hybrid' needs 1 < ulysses_size < cp dividing cp={self.cp}, got ulysses_size={u}"
            )
        if (self.cp > 1 or self.tiled) and self.pp > 1:
            raise ValueError(
                f"cp={self.cp} / tiled={self.tiled} needs pp=1 (context parallelism is not planned with "
                f"pipeline stages), got pp={self.pp}"
            )

    def _check_compression(self) -> None:
        """The checks of ``ZeroConfig._check_compression``, plus hpZ dividing this layout's dp."""
        for name in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_gradients_error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        check_degree("zero_hpz_partition_size", self.zero_hpz_partition_size)
        block = self.zero_quantization_block_size
        check_degree("zero_quantization_block_size", block)
        if block & (block - 1) or not 16 <= block <= 4096:
            raise ValueError(f"zero_quantization_block_size={block} must be a power of two in [16, 4096]")
        check_choice("zero_quantized_weights_bits", self.zero_quantized_weights_bits, (8, 4))
        check_choice("zero_quantized_gradients_bits", self.zero_quantized_gradients_bits, (8, 4))
        k = self.zero_hpz_partition_size
        if (self.zero_quantized_weights or k > 1) and self.zero_stage != 3:
            key = "zero_quantized_weights" if self.zero_quantized_weights else f"zero_hpz_partition_size={k}"
            raise ValueError(
                f"{key} applies to the stage-3 parameter all-gather: needs zero_stage=3, got "
                f"zero_stage={self.zero_stage}"
            )
        if self.zero_quantized_gradients and self.zero_stage not in (2, 3):
            raise ValueError(
                "zero_quantized_gradients applies to the gradient reduce-scatter of stages 2 and 3, got "
                f"zero_stage={self.zero_stage}"
            )
        if self.zero_quantized_gradients_error_feedback and not self.zero_quantized_gradients:
            raise ValueError("zero_quantized_gradients_error_feedback needs zero_quantized_gradients=True")
        if self.dp % k:
            raise ValueError(f"zero_hpz_partition_size={k} must divide dp={self.dp}")
        if self.offload == "optimizer+params" and (self.zero_quantized_weights or k > 1):
            raise ValueError(
                "offload='optimizer+params' cannot be combined with zero_quantized_weights / "
                "zero_hpz_partition_size (the host shards are gathered as they are)"
            )

    @property
    def hpz(self) -> int:
        """The hpZ partition in effect: ``zero_hpz_partition_size`` when 1 < k < dp (k = dp is plain ZeRO-3), else 1."""
        k = self.zero_hpz_partition_size
        return k if 1 < k < self.dp else 1

    @property
    def compressed(self) -> bool:
        """Whether any ZeRO++-class option is on (dp > 1)."""
        return self.dp > 1 and (self.zero_quantized_weights or self.hpz > 1 or self.zero_quantized_gradients)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
