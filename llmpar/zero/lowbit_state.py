"""8- and 4-bit AdamW states (``llmpar.ops.lowbit``) inside ZeRO's flat partitions.

Where the blocks lie: along each *unit* of the flat layout (``layout.py``), from the unit's first element, in blocks of
B = ``lowbit.BLOCK[bits]`` (256 / 128). A buffer with low-bit states is laid out with ``align`` a multiple of B, so
every unit shard is a whole number of blocks and starts on a block boundary: rank r's shard of unit u holds exactly
blocks [r * shard / B, (r + 1) * shard / B) of the unit, and quantizing the shard on its own is quantizing those blocks
of the whole unit. Hence:
  - no block straddles two ranks (no communication to find a block's absmax; each rank re-quantizes its own codes);
  - the blocks do not depend on the dp degree or the stage: units are cut by ``reduce_bucket_size`` (stage 3: by
    module) and padded with zeros, and zero padding changes no block's absmax. A run at dp=1, 2 or 8 quantizes the
    same values in the same blocks, so checkpoints reshard the codes and scales exactly (no dequantize/requantize);
  - a block may hold the end of one param and the start of the next (params are packed back to back in a unit):
    single-process FusedAdamW blocks each param on its own instead, so ZeRO matches it only where params are whole
    multiples of B; ZeRO at dp=N matches ZeRO at dp=1 (and the torch step over each whole unit) exactly.
The cost: up to ``shards * B`` padding elements per unit (4 KiB of bf16 at dp=8, 8-bit).

Per buffer, ``FlatBuffer.state`` holds partition-sized tensors, each unit's shard at a fixed ratio of the element
offsets: m_codes / v_codes uint8 [partition] (8 bits) or [partition / 2] (4 bits), m_scale / v_scale float32
[partition / B], plus "master" float32 [partition] for bf16 params or under offload_optimizer (the host steps the
masters, as for fp32 states).

Stochastic rounding (``OptimizerConfig.stochastic_rounding``; ``sr=(seed, rank)`` below): each unit shard is one tensor
of the low-bit step, salted by :func:`sr_salt` (the buffer's key and the unit) and offset by the shard's first element
in the unit: an element draws the counter of its place in the unit from the stream of (seed, step count, salt), as
the whole unit would (``lowbit.adamw_lowbit_step``'s ``sr_offsets``). So, like nearest rounding, it gives the same
codes at any dp degree, stage, offload or order of the unit steps, and a resumed run repeats it bitwise.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Iterator

import torch

from llmpar.ops import lowbit
from llmpar.ops.adamw import check_param_dtype
from llmpar.optim.adamw import LOWBIT_BITS, group_mode

CODE_KEYS = ("m_codes", "m_scale", "v_codes", "v_scale")


def bits_of(mode: str) -> int | None:
    """8 / 4 for the low-bit modes ("int8" / "int4"), None for the others."""
    return LOWBIT_BITS.get(mode)


def buffer_mode(precision: str, state_precision: str | None, dtype: torch.dtype, what: str) -> str:
    """The mode of a flat buffer of ``dtype`` params: low-bit states ("int8" / "int4") or a MODES precision, its
    errors naming ``what``."""
    try:
        mode = group_mode(precision, state_precision, dtype)
    except TypeError as e:
        raise TypeError(f"{what}: {e}") from None
    if bits_of(mode) is None:
        check_param_dtype(mode, dtype, what)
    return mode


def block_align(align: int, mode: str) -> int:
    """The layout's ``align`` for a buffer of ``mode``: a multiple of the block size for low-bit states."""
    bits = bits_of(mode)
    return align if bits is None else math.lcm(align, lowbit.BLOCK[bits])


def state_numel(key: str, numel: int, bits: int) -> int:
    """Entries of state ``key`` for ``numel`` elements (block-aligned numel: codes, scales; else the elements)."""
    if key.endswith("_codes"):
        return lowbit.code_bytes(numel, bits)
    if key.endswith("_scale"):
        return lowbit.num_blocks(numel, bits)
    return numel


def zero_fill_(state: dict[str, torch.Tensor], bits: int) -> None:
    """Codes of 0.0 in each map (the moments start at zero; scales are zero already)."""
    for key, signed in (("m_codes", True), ("v_codes", False)):
        code = int(torch.searchsorted(lowbit.midpoints(lowbit.qmap(bits, signed)), torch.tensor(0.0)))
        byte = code if bits == 8 else code | (code << 4)
        state[key].fill_(byte)


def unit_view(layout: Any, part: torch.Tensor, key: str, unit: int, bits: int) -> torch.Tensor:
    """Unit ``unit``'s shard of the partition-sized state tensor ``part`` of ``key``."""
    u = layout.units[unit]
    n = u.shard_numel(layout.shards)
    start, size = state_numel(key, u.shard_offset, bits), state_numel(key, n, bits)
    return part[start : start + size]


def unit_views(b: Any, key: str, units: list[int] | range | None = None) -> list[torch.Tensor]:
    bits = bits_of(b.mode)
    assert bits is not None
    units = range(len(b.layout.units)) if units is None else units
    return [unit_view(b.layout, b.state[key], key, u, bits) for u in units]


def sr_salt(b: Any, unit: int) -> int:
    """The stochastic-rounding salt (32 bits) of unit ``unit`` of buffer ``b``: a hash of the buffer's key (param
    group, dtype, tensor-parallel kind) and the unit; every shard of the unit draws from its stream."""
    return zlib.crc32(repr((b.key[0], str(b.key[1]), bool(b.key[3]), unit)).encode())


def sr_offset(b: Any, unit: int, rank: int) -> int:
    """Where rank ``rank``'s shard of unit ``unit`` starts in the unit (elements): its first counter of the stream."""
    return rank * b.layout.units[unit].shard_numel(b.layout.shards)


def step_units(
    b: Any,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    units: list[int],
    *,
    masters: list[torch.Tensor] | None,
    steps: list[torch.Tensor],
    sr: tuple[int, int] | None = None,
    **hyper: Any,
) -> None:
    """The low-bit AdamW step over units ``units`` of buffer ``b`` (params / grads / masters: those units' shards).
    ``sr``: None rounds the codes to nearest; ``(seed, rank)`` stochastically (:func:`sr_salt`, :func:`sr_offset`)."""
    bits = bits_of(b.mode)
    assert bits is not None
    m_codes, m_scale, v_codes, v_scale = (unit_views(b, k, units) for k in CODE_KEYS)
    seed, salts, offsets = None, None, None
    if sr is not None:
        seed, salts, offsets = int(sr[0]), [sr_salt(b, u) for u in units], [sr_offset(b, u, sr[1]) for u in units]
    lowbit.adamw_lowbit_step(
        params,
        grads,
        m_codes,
        m_scale,
        v_codes,
        v_scale,
        steps,
        masters,
        bits=bits,
        seed=seed,
        salts=salts,
        sr_offsets=offsets,
        **hyper,
    )


def step_each(
    b: Any,
    shards: list[torch.Tensor],
    grads: list[torch.Tensor],
    units: list[int],
    masters: list[torch.Tensor] | None,
    *,
    each: bool,
    **kw: Any,
) -> Iterator[int]:
    """:func:`step_units` over ``units`` of buffer ``b``: one call per unit when ``each``, else one call; yields each
    unit once its shard holds the new values."""
    for sel in [[u] for u in units] if each else [units]:
        step_units(
            b,
            [shards[u] for u in sel],
            [grads[u] for u in sel],
            sel,
            masters=None if masters is None else [masters[u] for u in sel],
            steps=[b.steps[u] for u in sel],
            **kw,
        )
        yield from sel


def host_step(b: Any, shards: list[torch.Tensor], grads: list[torch.Tensor], **hyper: Any) -> None:
    """offload_optimizer: the step on the host masters (float32; the CPU kernel of ``lowbit_kernels`` when built),
    then the param shards (device or host, any float dtype) take them, rounded to nearest."""
    units = list(range(len(b.layout.units)))
    masters = [b.layout.shard_of_partition(b.state["master"], u) for u in units]
    host = masters[0].device
    gscale, found_inf = hyper.pop("gscale"), hyper.pop("found_inf")
    grads = [g if g.dtype == torch.float32 else g.float() for g in grads]
    step_units(
        b,
        masters,
        grads,
        units,
        masters=None,
        steps=b.steps,
        gscale=None if gscale is None else gscale.to(host),
        found_inf=None if found_inf is None else found_inf.to(host),
        **hyper,
    )
    for dst, src in zip(shards, masters):  # (a skipped step: the masters as they were)
        dst.copy_(src, non_blocking=dst.device.type != "cpu")


# ------------------------------------------------------------------------------------------------- checkpoints
# At the checkpoint seam (``checkpointing.py``) a low-bit buffer shows float32 moments "exp_avg" / "exp_avg_sq"
# (dequantized, element for element like an fp32-state buffer), so every writer, reader, consolidation and conversion
# handles it unchanged. Loading quantizes them again per unit shard: dequantize -> quantize is the identity on codes
# and scales (``llmpar.ops.lowbit``: both signs' absmax entries are exact), and the blocks do not depend on dp, so a
# load at the same units (any dp degree, any stage with the same units) restores the state bitwise; at other units
# (another reduce_bucket_size, stage 3 vs 1/2, another tp split) the moments are re-quantized in the new blocks.

SEAM_KEYS = {"exp_avg": ("m_codes", "m_scale", True), "exp_avg_sq": ("v_codes", "v_scale", False)}


def _lowbit_bits(b: Any) -> int:
    """The bits of low-bit buffer ``b``; a ValueError for a buffer of another mode (no codes to read or write)."""
    bits = bits_of(b.mode)
    if bits is None:
        raise ValueError(f"buffer mode {b.mode!r} keeps no 8- / 4-bit states")
    return bits


def seam_keys(b: Any) -> list[str]:
    """The state keys buffer ``b`` shows a checkpoint."""
    if bits_of(b.mode) is None:
        return list(b.state)
    return [*SEAM_KEYS, *(k for k in b.state if k not in CODE_KEYS)]


def dequantized(b: Any, key: str) -> torch.Tensor:
    """This rank's partition of moment ``key`` ("exp_avg" / "exp_avg_sq"), float32 [partition], fresh."""
    bits = _lowbit_bits(b)
    codes_key, scale_key, signed = SEAM_KEYS[key]
    lay = b.layout
    parts = [
        lowbit.dequantize(
            unit_view(lay, b.state[codes_key], codes_key, u, bits),
            unit_view(lay, b.state[scale_key], scale_key, u, bits),
            bits,
            signed,
            lay.units[u].shard_numel(lay.shards),
        )
        for u in range(len(lay.units))
    ]
    return torch.cat(parts) if parts else torch.zeros(0)


@torch.no_grad()
def quantize_into(b: Any, key: str, values: torch.Tensor) -> None:
    """Moment ``key`` of this rank's partition from float32 ``values: [partition]`` (quantized per unit shard)."""
    bits = _lowbit_bits(b)
    codes_key, scale_key, signed = SEAM_KEYS[key]
    lay = b.layout
    if not signed:
        values = values.clamp_min(0)  # a foreign checkpoint's v is >= 0 up to its own rounding
    for u in range(len(lay.units)):
        codes, scale = lowbit.quantize(lay.shard_of_partition(values, u), bits, signed)
        unit_view(lay, b.state[codes_key], codes_key, u, bits).copy_(codes)
        unit_view(lay, b.state[scale_key], scale_key, u, bits).copy_(scale)
