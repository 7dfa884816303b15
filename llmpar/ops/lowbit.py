"""AdamW with 8- and 4-bit optimizer states: the quantization maps, block quantize / dequantize, and the step (the
float64 reference the kernels are tested against, and the float32 torch path).

The contract (the fused kernels in ``llmpar.ops.lowbit_kernels`` follow it bit for bit where float32 allows)
---------------------------------------------------------------------------------------------------------------
A flat tensor of n elements (a param, or a ZeRO flat shard) keeps each moment as codes + per-block scales, with bits
b in {8, 4} and block size B = ``BLOCK[b]`` (256 for 8 bits, 128 for 4 bits):
    codes:  uint8, n bytes (b=8), or ceil(n/2) bytes (b=4: element 2i in the low nibble of byte i, element 2i+1 in
            its high nibble; when n is odd the high nibble of the last byte is 0)
    scale:  float32 [ceil(n/B)], the absmax of the moment over each block (the last block may be partial)
    qmap:   float32 [2^b], ascending: signed, in [-1, 1], for m (``qmap(b, signed=True)``); unsigned, in [0, 1], for v
            (``qmap(b, signed=False)``). The maps are data, passed to every kernel; no kernel hard-codes them.
Dequantize: x[i] = qmap[code[i]] * scale[i // B].
Quantize a block x[0..B): s = max |x| (float32). If s == 0 every code is that of the map's entry nearest 0. Else
y = x * r with r = 1 / s (one float32 division per block, then a multiply per element: the vector kernels would spend
as much on a division per element as on the rest of the quantization) and code = the number of midpoints
mid[k] = (qmap[k] + qmap[k+1]) / 2 (in float32, k = 0 .. 2^b - 2) with mid[k] < y strictly: round to nearest entry,
ties to the lower code. (With y = 0 this count is already the code of the entry nearest 0, so s == 0 needs no special
case beyond y = 0.)
The step, per element in float32, t = the step count after this step's increment; skipped entirely (params, codes,
scales, step counts unchanged) when found_inf is nonzero:
    g = grad * gscale;  m = deq(m);  v = deq(v);  p = p * (1 - lr * wd)
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p = p - lr / (1 - b1^t) * m / (sqrt(v) * c + eps),  c = 1 / sqrt(1 - b2^t) rounded to float32 once per tensor
(a multiply where torch's AdamW divides: a vector CPU core has one divider, and the step already needs it twice)
then m and v are re-quantized with their new block absmax. Params are float32, or bf16 with a float32 master
(the bf16 param is the master rounded to nearest even, written in the same pass).
Kernels match this module: params within float32 rounding; codes equal except where y falls within a float32 ulp of
a midpoint. Optional stochastic rounding of the codes (``seed`` given) runs on the torch path only.

The maps, and why
-----------------
8 bits, both moments: the dynamic tree map of Dettmers et al. 2022 ("8-bit Optimizers via Block-wise Quantization"),
as bitsandbytes and torchao build it. A code is a sign bit (signed map only), then a run of zero bits whose length e
is a decimal exponent (10^-e, e = 0..6), an indicator 1 bit, and the remaining bits as a linear fraction: entry values
are the centres of 2^f equal bins of [0.1, 1] times 10^-e. Precision thus moves between range and resolution, which
fits Adam's moments: most of a block is orders of magnitude below its absmax, and block-wise scaling keeps outliers
from widening other blocks. Signed: 127 magnitudes per sign (1 + 2 + ... + 64 fraction bins), 0 and +1 make 256
entries in bitsandbytes, whose map lacks -1 (a block whose absmax element is negative stores it as -0.99297 s).
Here the smallest negative magnitude (-5.5e-7, the one-bin decade) is traded for -1, so that every block's absmax
element dequantizes to exactly +-s. That makes dequantize -> quantize the identity on (codes, scales) for normal
floats (the scale is found again exactly, and every other y = fl(fl(q s) r) lies within two ulps of its entry, far from
any midpoint), which is what lets checkpoints store plain float32 moments and reload them bitwise. Unsigned: 254
positive magnitudes (the sign bit becomes one more fraction bit), 0 and 1.
4 bits: Li et al. 2023 ("Memory Efficient Optimizers with 4-bit States"), as torchao's AdamW4bit uses them with block
128. m: the dynamic map shrunk to 4 bits (3 exponent steps 10^0, 10^-1, 10^-2 with 4, 2, 1 fraction bins per sign,
plus 0 and 1; as at 8 bits, the smallest negative entry -0.0055 gives way to -1, where torchao's most negative entry
is -0.8875: an 11 % error on every negative block maximum). v: linear, without zero ({1/16, 2/16, ..., 1}): the
paper's "zero-point problem" is that v quantized to 0 turns the update m / (sqrt(v) + eps) into m / eps, and a map
without zero removes exactly that failure.

Backends: ``adamw_lowbit_step`` hands the whole list to ``llmpar.ops.lowbit_kernels.adamw_lowbit_step`` (CUDA C++,
Triton, CPU C++: that module chooses with ``_dispatch.select_backend``, which knows what this machine has); it returns
True when it did the step, False when no kernel suits the inputs or is available (then the torch path here runs). That
module imports without triton or a built extension, so it is imported plainly: an error in it is an error here, never a
silent switch of every step to the torch path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

import llmpar.ops.lowbit_kernels as lowbit_kernels
from llmpar.ops.adamw import step_salts
from llmpar.ops.adamw_torch import mix
from llmpar.ops.lowbit_maps import BLOCK, check_bits, midpoints, qmap
from llmpar.ops.lowbit_quant import (  # noqa: F401  (the state's quantization: importable from here as before)
    check_state,
    code_bytes,
    dequantize,
    new_state,
    num_blocks,
    pack4,
    quantize,
    state_bytes,
    uniform,
    unpack4,
)

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # with masters (the kernels: bf16)


# ------------------------------------------------------------------------------------------- float64 reference


class LowbitRef(NamedTuple):
    """Result of :func:`adamw_lowbit_reference`: the new param (float64; the bf16 param rounded from the master
    when there is one), master (float64 or None), the new codes / scales, the float64 moments before quantization,
    and y = moment / scale (float64) for finding ties."""

    param: torch.Tensor
    master: torch.Tensor | None
    m_codes: torch.Tensor
    m_scale: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    y_m: torch.Tensor
    y_v: torch.Tensor


def _quantize64(x: torch.Tensor, bits: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes of float64 x against the float32 midpoints; scale in float32 (as stored)."""
    n, block = x.numel(), BLOCK[bits]
    nb = -(-n // block)
    xb = torch.cat([x, x.new_zeros(nb * block - n)]).view(nb, block)
    scale = xb.abs().amax(dim=1).to(torch.float32)
    s64 = scale.to(torch.float64)
    y = (xb / torch.where(s64 == 0, torch.ones_like(s64), s64)[:, None]).reshape(-1)[:n]
    mids = midpoints(qmap(bits, signed)).to(torch.float64)
    codes = torch.searchsorted(mids, y, side="left").to(torch.uint8)
    return (codes if bits == 8 else pack4(codes)), scale, y


def adamw_lowbit_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    step: int,
    master: torch.Tensor | None = None,
    *,
    bits: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gscale: float = 1.0,
    found_inf: bool = False,
) -> LowbitRef:
    """One step of the contract for one tensor, in float64, without touching the inputs. ``step`` is t, the count
    after this step's increment. Quantization uses the float32 scales and midpoints, as stored and as the kernels
    compute them; everything else is float64."""
    bits = check_bits(bits)
    n = param.numel()
    f64 = torch.float64
    p = (master if master is not None else param).detach().reshape(-1).to(f64)
    if found_inf:
        return LowbitRef(
            param.detach().reshape(-1).to(f64),
            None if master is None else p,
            m_codes.clone(),
            m_scale.clone(),
            v_codes.clone(),
            v_scale.clone(),
            dequantize(m_codes, m_scale, bits, True, n, dtype=f64),
            dequantize(v_codes, v_scale, bits, False, n, dtype=f64),
            torch.full((n,), math.nan, dtype=f64),
            torch.full((n,), math.nan, dtype=f64),
        )
    g = grad.detach().reshape(-1).to(f64) * gscale
    m = dequantize(m_codes, m_scale, bits, True, n, dtype=f64)
    v = dequantize(v_codes, v_scale, bits, False, n, dtype=f64)
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1**step) * m / (v.sqrt() / math.sqrt(1 - beta2**step) + eps)
    mc, ms, ym = _quantize64(m, bits, True)
    vc, vs, yv = _quantize64(v, bits, False)
    if master is not None:
        new_param = p.to(torch.float32).to(param.dtype).to(f64)
        return LowbitRef(new_param, p, mc, ms, vc, vs, m, v, ym, yv)
    return LowbitRef(p, None, mc, ms, vc, vs, m, v, ym, yv)


def near_tie(y: torch.Tensor, bits: int, signed: bool, ulps: float = 2.0) -> torch.Tensor:
    """Bool mask of the elements whose y (float64) lies within ``ulps`` float32 ulps of a midpoint: there a
    float32 computation may legitimately pick the other neighbour."""
    mids = midpoints(qmap(bits, signed)).to(torch.float64)
    k = torch.searchsorted(mids, y).clamp(1, mids.numel() - 1)
    dist = torch.minimum((y - mids[k - 1]).abs(), (y - mids[k]).abs())
    ulp = torch.finfo(torch.float32).eps * y.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return dist <= ulps * ulp


# ------------------------------------------------------------------------------------------- the step (lists)


def _check_step_lists(params, grads, m_codes, m_scales, v_codes, v_scales, steps, masters, bits) -> None:
    n = len(params)
    named = {
        "grads": grads,
        "m_codes": m_codes,
        "m_scales": m_scales,
        "v_codes": v_codes,
        "v_scales": v_scales,
        "steps": steps,
    }
    if masters is not None:
        named["masters"] = masters
    for name, lst in named.items():
        if len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} tensors but params has {n}")
    for i, p in enumerate(params):
        k = p.numel()
        if masters is None and p.dtype != torch.float32:
            raise TypeError(
                f"params[{i}] has dtype {p.dtype}; without masters the low-bit step takes float32 params "
                "(bf16 params need float32 masters=)"
            )
        if masters is not None:
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(
                    f"params[{i}] has dtype {p.dtype}; with masters the params are bfloat16, float16 or float32"
                )
            if masters[i].dtype != torch.float32 or masters[i].numel() != k:
                raise TypeError(
                    f"masters[{i}] ({masters[i].dtype}, {masters[i].numel()} elements) must be float32 "
                    f"with the {k} elements of params[{i}]"
                )
        if grads[i].numel() != k or not grads[i].is_floating_point():
            raise ValueError(
                f"grads[{i}] ({grads[i].dtype}, {grads[i].numel()} elements) must be floating point "
                f"with the {k} elements of params[{i}]"
            )
        check_state(m_codes[i], m_scales[i], bits, k, f"m_codes[{i}]", f"m_scales[{i}]")
        check_state(v_codes[i], v_scales[i], bits, k, f"v_codes[{i}]", f"v_scales[{i}]")
        for name in named:
            t = named[name][i]
            if t.device != p.device:
                raise ValueError(f"{name}[{i}] is on {t.device} but params[{i}] is on {p.device}")
        s = steps[i]
        if s.numel() != 1 or s.dtype != torch.float32:
            raise TypeError(f"steps[{i}] must be a float32 scalar tensor, got {s.dtype} of shape {tuple(s.shape)}")


def adamw_lowbit_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    m_codes: Sequence[torch.Tensor],
    m_scales: Sequence[torch.Tensor],
    v_codes: Sequence[torch.Tensor],
    v_scales: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor] | None,
    *,
    bits: int,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gscale: float | torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    seed: int | None = None,
    salts: Sequence[int] | None = None,
    sr_offsets: Sequence[int] | None = None,
) -> None:
    """One low-bit AdamW step, in place, over every tensor (module docstring); increments ``steps`` unless found_inf.

    params[i] any shape (float32, or bf16 / float32 with float32 ``masters[i]``); grads[i] the same numel; codes and
    scales as :func:`check_state`; steps[i] float32 0-d. gscale multiplies the grads (clip coefficient, loss-scale
    inverse) and is not left in them. seed: None rounds codes to nearest (kernels may run); an int rounds them
    stochastically on the torch path: element e of tensor i draws counter sr_offsets[i] + e (default 0) of the stream
    of (seed, step, salts[i], moment), so tensors that are shards of one (ZeRO's unit shards: the same salt, their
    offsets in the unit) round exactly as the whole would, at any number of shards.
    """
    bits = check_bits(bits)
    lists = [list(x) for x in (params, grads, m_codes, m_scales, v_codes, v_scales, steps)]
    params, grads, m_codes, m_scales, v_codes, v_scales, steps = lists
    masters = list(masters) if masters is not None else None
    _check_step_lists(params, grads, m_codes, m_scales, v_codes, v_scales, steps, masters, bits)
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"betas ({beta1}, {beta2}) must lie in [0, 1)")
    if not params:
        return
    salts = step_salts(salts, len(params))
    offsets = [0] * len(params) if sr_offsets is None else [int(o) for o in sr_offsets]
    if len(offsets) != len(params) or any(o < 0 for o in offsets):
        raise ValueError(f"sr_offsets={list(sr_offsets or [])} must hold one int >= 0 per param ({len(params)})")
    with torch.no_grad():
        device = params[0].device
        if seed is None and lowbit_kernels.adamw_lowbit_step(
            params,
            grads,
            m_codes,
            m_scales,
            v_codes,
            v_scales,
            steps,
            masters,
            bits=bits,
            lr=lr,
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(eps),
            weight_decay=float(weight_decay),
            gscale=gscale,
            found_inf=found_inf,
            qmap_m=qmap(bits, True, device),
            qmap_v=qmap(bits, False, device),
        ):
            return
        if found_inf is not None and float(found_inf) != 0:
            return
        torch._foreach_add_(steps, 1.0)
        qm, qv = qmap(bits, True, device), qmap(bits, False, device)
        lr_f, gs = float(lr), None if gscale is None else float(gscale)
        for i, p in enumerate(params):
            n = p.numel()
            if n == 0:
                continue
            t = float(steps[i])
            g = grads[i].detach().reshape(-1).to(torch.float32)
            if gs is not None:
                g = g * gs
            m = dequantize(m_codes[i], m_scales[i], bits, True, n, qmap_=qm)
            v = dequantize(v_codes[i], v_scales[i], bits, False, n, qmap_=qv)
            w = masters[i].view(-1) if masters is not None else p.view(-1)
            w.mul_(1.0 - lr_f * weight_decay)
            m.mul_(beta1).add_(g, alpha=1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            denom = v.sqrt().mul_(1.0 / math.sqrt(1.0 - beta2**t)).add_(eps)
            w.addcdiv_(m, denom, value=-lr_f / (1.0 - beta1**t))
            if masters is not None:
                p.view(-1).copy_(w)
            u_m = u_v = None
            if seed is not None:
                count = num_blocks(n, bits) * BLOCK[bits]
                u_m = uniform(mix(seed, int(t), salts[i], 0), offsets[i], count, device)
                u_v = uniform(mix(seed, int(t), salts[i], 1), offsets[i], count, device)
            mc, ms = quantize(m, bits, True, qmap_=qm, noise=u_m)
            vc, vs = quantize(v, bits, False, qmap_=qv, noise=u_v)
            m_codes[i].view(-1).copy_(mc)
            m_scales[i].copy_(ms)
            v_codes[i].view(-1).copy_(vc)
            v_scales[i].copy_(vs)
