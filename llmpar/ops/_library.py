"""The ``llmpar::`` operator library: the one place where each op of the CUDA extension is registered.

For every op, ``OPS`` holds its schema (identical to what csrc/*.cpp implements), its fake impl (shapes, dtypes and
strides only: FakeTensor, torch.compile and the Meta device trace the op with it, no GPU needed) and a plain-torch
reference impl registered for CPU tensors (so ``torch.library.opcheck`` runs here, and tests can compare the CUDA
kernels with it). The CUDA extension ``llmpar._C`` only adds CUDA kernels (``TORCH_LIBRARY_IMPL(llmpar, CUDA, m)``);
it may be loaded before or after this module is imported. Whether a build has the CUDA kernel of an op:
``llmpar.ops._dispatch.has_ext_op(name)``.

    pack_bucket(tensors, out, scale)     out[o_i : o_i + n_i] = Out(float32(tensors[i].flatten()) * scale)
    unpack_bucket(flat, outs, scale)     outs[i][...] = Out(float32(flat[o_i : o_i + n_i]) * scale)
    adamw_step(params, ..., mode_code, ...)  one AdamW step in place; mode_code: position in llmpar.ops.adamw.MODES
    adamw_lowbit_step(params, grads, m_codes, m_scales, v_codes, v_scales, masters, steps, qmap_m, qmap_v, bits,
                      lr, lr_tensor, gscale, found_inf, ...)  AdamW with 8/4-bit block-quantized moments in place
                                         (llmpar/ops/lowbit.py's contract), t = steps[i] (read, already incremented)
    sum_squares(tensors)                 float32 [max(1, sum_i ceil(n_i / ADAMW_CHUNK))]: per-block sums of squares
                                         (one dtype for all tensors)
    bias_act_backward(grad, pre, act)    (grad * act'(pre) in pre's dtype [M, N], its float32 column sums [N])
    linear_lt(x, weight, bias, act, residual)  act(x W^T + b) (+ residual) in x's dtype [M, N]; act 0, 1 or 4
    linear_lt_aux(x, weight, bias)       (gelu_tanh(z), z) for z = x W^T + b; z: a [M, N] view of [M, ceil8(N)]
    quantize_rows(x, wire, m, bits, block)   wire [rows, row_bytes] := int8/int4 codes + float32 scales of x [rows, m]
    pack_quantize(tensors, wire, rows, m, bits, block, scale, residual)  wire := quantized rows of
                                         [cat(tensors), 0...] * scale (+ residual); residual := x - dequant(wire)
    dequantize_rows(wire, out, m, bits, block)          out [rows, m] := dequant(wire)
    dequantize_sum(wire, out, m, bits, block, accumulate)  out [m] (+)= sum over rows of dequant(wire), float32
(wire format: llmpar/ops/quant.py.)
(o_i = n_0 + ... + n_{i-1}; act codes: positions in llmpar.ops.gemm.ACTIVATIONS.)
``CPU_OPS`` holds the ops of the CPU extension ``llmpar._C_cpu`` (csrc/cpu/), defined here the same way but without a
Python CPU impl: their CPU kernel is the C++ one, registered when the extension loads (llmpar/ops/_cpu_ext.py);
without the build, the op function (llmpar/ops/cpu_adam.py) runs its torch path instead of calling the op.
    cpu_adamw_step(params, grads, exp_avgs, exp_avg_sqs, outs, steps, lr, ..., gscale, isa)  steps += 1, then float32
                                         AdamW in place; outs[i] = the new params[i], rounded (float32/bfloat16/float16)
    cpu_adamw_lowbit_step(params, grads, m_codes, m_scales, v_codes, v_scales, outs, qmap_m, qmap_v, steps, bits,
                          lr, ..., gscale, isa)  AdamW with 8/4-bit block-quantized moments (llmpar/ops/lowbit.py's
                                         contract), t = steps[i]; outs[i] = the new params[i] in bfloat16
The schemas are the ones the CUDA kernels were written against, with one rename: adamw_step's ``int mode`` is
``int mode_code`` (an argument named ``mode`` collides with torch's auto_functionalized, so torch.compile could not
trace the op; the C++ kernel binds arguments by position, so it is unaffected).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmpar.ops.adamw import PRECISIONS, _torch_step
from llmpar.ops.gemm import (
    ACTIVATIONS,
    LT_ACTS,
    bias_act_backward_reference,
    linear_lt_aux_reference,
    linear_lt_reference,
)
from llmpar.ops.quant import (
    _check_wire,
    _torch_dequantize,
    _torch_dequantize_sum,
    _torch_pack_quantize,
    _torch_quantize,
)

ADAMW_CHUNK = 4096  # LLMPAR_ADAMW_CHUNK of csrc/adamw.cuh: elements per block of sum_squares, one partial each
_LT_CODES = tuple(ACTIVATIONS.index(a) for a in LT_ACTS)


@dataclass(frozen=True, kw_only=True)
class OpDef:
    """One ``llmpar::`` op: its schema, its fake impl and its plain-torch reference (the CPU kernel)."""

    schema: str  # "name(args) -> returns", the signature of the C++ kernel in csrc/*.cpp (csrc/cpu/*.cpp)
    fake: Callable[..., Any]
    reference: Callable[..., Any] | None  # None: the CPU kernel comes from the CPU extension

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


# ------------------------------------------------------------------------------------------- checks (fake and CPU)


def _check_bias_act(grad: torch.Tensor, pre: torch.Tensor, act: int) -> None:
    if grad.dim() != 2:
        raise ValueError(f"bias_act_backward: grad must be 2-D [M, N], got shape {tuple(grad.shape)}")
    if pre.shape != grad.shape:
        raise ValueError(f"bias_act_backward: pre {tuple(pre.shape)} must match grad {tuple(grad.shape)}")
    if not 0 <= act < len(ACTIVATIONS):
        raise ValueError(
            f"bias_act_backward: act={act} is not an activation code (0..{len(ACTIVATIONS) - 1}: "
            f"{', '.join(ACTIVATIONS)})"
        )


def _check_linear_lt(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int, residual: torch.Tensor | None
) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"linear_lt: x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_lt: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree on K")
    if x.dtype != weight.dtype:
        raise TypeError(f"linear_lt: x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    if act not in _LT_CODES:
        raise ValueError(
            f"linear_lt: act={act} has no cuBLASLt epilogue; it takes "
            f"{', '.join(f'{c} ({ACTIVATIONS[c]})' for c in _LT_CODES)}"
        )
    n = weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.dtype != x.dtype):
        raise ValueError(f"linear_lt: bias must be [{n}] in {x.dtype}, got {tuple(bias.shape)} in {bias.dtype}")
    if residual is not None:
        if act != 0:
            raise ValueError("linear_lt: a residual is added before the epilogue's activation; only act 0 takes one")
        if tuple(residual.shape) != (x.shape[0], n) or residual.dtype != x.dtype:
            raise ValueError(
                f"linear_lt: residual must be [{x.shape[0]}, {n}] in {x.dtype}, got "
                f"{tuple(residual.shape)} in {residual.dtype}"
            )


# ------------------------------------------------------------------------------------------------------ fakes


def _fake_none(*args: Any) -> None:
    """The mutating ops return nothing: their fake impl only has to exist."""
    return None


def _fake_sum_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    # (an empty list never gets here: with no tensor the dispatcher has no device to dispatch on)
    blocks = sum(-(-t.numel() // ADAMW_CHUNK) for t in tensors)
    return tensors[0].new_empty((torch.sym_max(blocks, 1),), dtype=torch.float32)


def _fake_bias_act_backward(grad: torch.Tensor, pre: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_bias_act(grad, pre, act)
    return pre.new_empty(grad.shape), grad.new_empty((grad.shape[1],), dtype=torch.float32)


def _fake_linear_lt(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int, residual: torch.Tensor | None
) -> torch.Tensor:
    _check_linear_lt(x, weight, bias, act, residual)
    return x.new_empty((x.shape[0], weight.shape[0]))


def _aux_buffer(x: torch.Tensor, n: int) -> torch.Tensor:
    """[M, ceil(N / 8) * 8] in x's dtype: cuBLASLt's GELU aux matrix, whose [M, N] view is linear_lt_aux's z."""
    return x.new_empty((x.shape[0], (n + 7) // 8 * 8))


def _fake_linear_lt_aux(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_linear_lt(x, weight, bias, 1, None)
    n = weight.shape[0]
    return x.new_empty((x.shape[0], n)), _aux_buffer(x, n).narrow(1, 0, n)


# ------------------------------------------------------------------------------------ plain-torch references


def _bucket_offsets(tensors: Sequence[torch.Tensor], flat: torch.Tensor, what: str) -> list[int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += t.numel()
    if total > flat.numel():
        raise ValueError(f"{what} hold {total} elements, the flat buffer only {flat.numel()}")
    return offsets


def _ref_pack_bucket(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    for t, o in zip(tensors, _bucket_offsets(tensors, out, "tensors")):
        out[o : o + t.numel()].copy_(t.reshape(-1).float() * scale)  # float32 product, scale rounded to float32


def _ref_unpack_bucket(flat: torch.Tensor, outs: Sequence[torch.Tensor], scale: float) -> None:
    for t, o in zip(outs, _bucket_offsets(outs, flat, "outs")):
        t.copy_((flat[o : o + t.numel()].float() * scale).view(t.shape))


def _ref_adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    extras: list[torch.Tensor],
    steps: list[torch.Tensor],
    salts: list[int],
    mode_code: int,
    lr: float,
    lr_tensor: torch.Tensor | None,
    gscale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    seed: int,
) -> None:
    """The torch path of llmpar.ops.adamw_step (same math; its own stochastic-rounding stream), grads untouched."""
    if not 0 <= mode_code < len(PRECISIONS):
        raise ValueError(
            f"adamw_step: mode_code={mode_code} is not a mode code (0..{len(PRECISIONS) - 1}: {', '.join(PRECISIONS)})"
        )
    if not params:
        return
    if gscale is not None:  # torch's fused AdamW unscales the grads in place; the op reads them only
        grads = [g.clone() for g in grads]
    _torch_step(
        PRECISIONS[mode_code],
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        steps,
        list(extras) or None,
        list(salts),
        lr=lr_tensor if lr_tensor is not None else lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        gscale=gscale,
        found_inf=found_inf,
        seed=seed,
    )


def _ref_adamw_lowbit_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    m_codes: list[torch.Tensor],
    m_scales: list[torch.Tensor],
    v_codes: list[torch.Tensor],
    v_scales: list[torch.Tensor],
    masters: list[torch.Tensor],
    steps: list[torch.Tensor],
    qmap_m: torch.Tensor,
    qmap_v: torch.Tensor,
    bits: int,
    lr: float,
    lr_tensor: torch.Tensor | None,
    gscale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """The contract's float64 reference (llmpar.ops.lowbit), written back in place; steps are read (already
    incremented), as the CUDA kernel reads them. The maps must be llmpar.ops.lowbit's (the reference uses them)."""
    import llmpar.ops.lowbit as lowbit

    if found_inf is not None and float(found_inf) != 0:
        return
    for name, q, signed in (("qmap_m", qmap_m, True), ("qmap_v", qmap_v, False)):
        if not torch.equal(q.cpu(), lowbit.qmap(bits, signed)):
            raise ValueError(
                f"adamw_lowbit_step (CPU reference): {name} is not llmpar.ops.lowbit.qmap({bits}, signed={signed})"
            )
    lr = float(lr_tensor) if lr_tensor is not None else lr
    for i, p in enumerate(params):
        master = masters[i] if masters else None
        ref = lowbit.adamw_lowbit_reference(
            p,
            grads[i],
            m_codes[i],
            m_scales[i],
            v_codes[i],
            v_scales[i],
            int(float(steps[i])),
            master,
            bits=bits,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            gscale=1.0 if gscale is None else float(gscale),
        )
        if master is not None:
            master.view(-1).copy_(ref.master)
        p.view(-1).copy_(ref.param)
        for t, new in (
            (m_codes[i], ref.m_codes),
            (m_scales[i], ref.m_scale),
            (v_codes[i], ref.v_codes),
            (v_scales[i], ref.v_scale),
        ):
            t.view(-1).copy_(new.view(-1))


def _ref_sum_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:  # as the CUDA kernel (one dtype per launch): callers group by dtype
        raise TypeError(f"sum_squares: tensors mix dtypes {sorted(map(str, dtypes))}; one dtype per call")
    parts = []
    for t in tensors:
        flat = t.reshape(-1).float()
        pad = -flat.numel() % ADAMW_CHUNK
        parts.append(torch.nn.functional.pad(flat, (0, pad)).view(-1, ADAMW_CHUNK).square().sum(1))
    out = torch.cat(parts)
    return out if out.numel() > 0 else out.new_zeros(1)


def _ref_bias_act_backward(grad: torch.Tensor, pre: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_bias_act(grad, pre, act)
    gp, db = bias_act_backward_reference(grad, pre, act)
    return gp.contiguous(), db


def _ref_linear_lt(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int, residual: torch.Tensor | None
) -> torch.Tensor:
    _check_linear_lt(x, weight, bias, act, residual)
    return linear_lt_reference(x, weight, bias, act, residual).contiguous()


def _ref_linear_lt_aux(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_linear_lt(x, weight, bias, 1, None)
    y, z = linear_lt_aux_reference(x, weight, bias)
    n = weight.shape[0]
    pre = _aux_buffer(x, n).narrow(1, 0, n)  # the layout the CUDA kernel returns
    pre.copy_(z)
    return y.contiguous(), pre


def _ref_quantize_rows(x: torch.Tensor, wire: torch.Tensor, m: int, bits: int, block: int) -> None:
    if x.dim() != 2 or x.shape[1] != m:
        raise ValueError(f"quantize_rows: x must be [rows, {m}], got {tuple(x.shape)}")
    _torch_quantize(x, _check_wire(wire, m, bits, block, x.shape[0]), m, bits, block, None)


def _ref_pack_quantize(
    tensors: Sequence[torch.Tensor],
    wire: torch.Tensor,
    rows: int,
    m: int,
    bits: int,
    block: int,
    scale: float,
    residual: torch.Tensor | None,
) -> None:
    _check_wire(wire, m, bits, block, rows)
    total = sum(t.numel() for t in tensors)
    if total > rows * m:
        raise ValueError(f"pack_quantize: tensors hold {total} elements, more than rows * m = {rows * m}")
    if residual is not None and (residual.dtype != torch.float32 or residual.shape != (rows * m,)):
        raise ValueError(
            f"pack_quantize: residual must be float32 [{rows * m}], got {residual.dtype} {tuple(residual.shape)}"
        )
    _torch_pack_quantize(list(tensors), wire, rows, m, bits, block, scale, residual)


def _ref_dequantize_rows(wire: torch.Tensor, out: torch.Tensor, m: int, bits: int, block: int) -> None:
    _check_wire(wire, m, bits, block)
    if out.shape != (wire.shape[0], m):
        raise ValueError(f"dequantize_rows: out must be [{wire.shape[0]}, {m}], got {tuple(out.shape)}")
    _torch_dequantize(wire, m, bits, block, out)


def _ref_dequantize_sum(wire: torch.Tensor, out: torch.Tensor, m: int, bits: int, block: int, accumulate: bool) -> None:
    _check_wire(wire, m, bits, block)
    if out.shape != (m,):
        raise ValueError(f"dequantize_sum: out must be [{m}], got {tuple(out.shape)}")
    _torch_dequantize_sum(wire, m, bits, block, out, accumulate)


# ------------------------------------------------------------------------------------------------- the table

OPS: dict[str, OpDef] = {
    op.name: op
    for op in (
        OpDef(
            schema="pack_bucket(Tensor[] tensors, Tensor(a!) out, float scale) -> ()",
            fake=_fake_none,
            reference=_ref_pack_bucket,
        ),
        OpDef(
            schema="unpack_bucket(Tensor flat, Tensor(a!)[] outs, float scale) -> ()",
            fake=_fake_none,
            reference=_ref_unpack_bucket,
        ),
        OpDef(
            schema="adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
            "Tensor(d!)[] extras, Tensor[] steps, int[] salts, int mode_code, float lr, Tensor? lr_tensor, "
            "Tensor? gscale, Tensor? found_inf, float beta1, float beta2, float eps, float weight_decay, "
            "int seed) -> ()",
            fake=_fake_none,
            reference=_ref_adamw_step,
        ),
        OpDef(
            schema="adamw_lowbit_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] m_codes, "
            "Tensor(c!)[] m_scales, Tensor(d!)[] v_codes, Tensor(e!)[] v_scales, Tensor(f!)[] masters, "
            "Tensor[] steps, Tensor qmap_m, Tensor qmap_v, int bits, float lr, Tensor? lr_tensor, Tensor? gscale, "
            "Tensor? found_inf, float beta1, float beta2, float eps, float weight_decay) -> ()",
            fake=_fake_none,
            reference=_ref_adamw_lowbit_step,
        ),
        OpDef(schema="sum_squares(Tensor[] tensors) -> Tensor", fake=_fake_sum_squares, reference=_ref_sum_squares),
        OpDef(
            schema="bias_act_backward(Tensor grad, Tensor pre, int act) -> (Tensor, Tensor)",
            fake=_fake_bias_act_backward,
            reference=_ref_bias_act_backward,
        ),
        OpDef(
            schema="linear_lt(Tensor x, Tensor weight, Tensor? bias, int act, Tensor? residual) -> Tensor",
            fake=_fake_linear_lt,
            reference=_ref_linear_lt,
        ),
        OpDef(
            schema="linear_lt_aux(Tensor x, Tensor weight, Tensor? bias) -> (Tensor, Tensor)",
            fake=_fake_linear_lt_aux,
            reference=_ref_linear_lt_aux,
        ),
        OpDef(
            schema="quantize_rows(Tensor x, Tensor(a!) wire, int m, int bits, int block) -> ()",
            fake=_fake_none,
            reference=_ref_quantize_rows,
        ),
        OpDef(
            schema="pack_quantize(Tensor[] tensors, Tensor(a!) wire, int rows, int m, int bits, int block, "
            "float scale, Tensor(b!)? residual) -> ()",
            fake=_fake_none,
            reference=_ref_pack_quantize,
        ),
        OpDef(
            schema="dequantize_rows(Tensor wire, Tensor(a!) out, int m, int bits, int block) -> ()",
            fake=_fake_none,
            reference=_ref_dequantize_rows,
        ),
        OpDef(
            schema="dequantize_sum(Tensor wire, Tensor(a!) out, int m, int bits, int block, bool accumulate) -> ()",
            fake=_fake_none,
            reference=_ref_dequantize_sum,
        ),
    )
}

CPU_OPS: dict[str, OpDef] = {
    op.name: op
    for op in (
        OpDef(
            schema="cpu_adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
            "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] outs, Tensor(e!)[] steps, float lr, float beta1, float beta2, "
            "float eps, float weight_decay, float gscale, int isa) -> ()",
            fake=_fake_none,
            reference=None,
        ),
        OpDef(
            schema="cpu_adamw_lowbit_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] m_codes, "
            "Tensor(c!)[] m_scales, Tensor(d!)[] v_codes, Tensor(e!)[] v_scales, Tensor(f!)[] outs, "
            "Tensor qmap_m, Tensor qmap_v, int[] steps, int bits, float lr, float beta1, float beta2, float eps, "
            "float weight_decay, float gscale, int isa) -> ()",
            fake=_fake_none,
            reference=None,
        ),
    )
}


def _register() -> torch.library.Library:
    """Defines every op of OPS and CPU_OPS with its fake impl and CPU reference (if any); returns the library handle
    (kept alive below: dropping it would unregister them). "DEF": llmpar owns the namespace, nothing else may define
    ops in it."""
    lib = torch.library.Library("llmpar", "DEF")
    for name, op in {**OPS, **CPU_OPS}.items():
        lib.define(op.schema)
        torch.library.register_fake(f"llmpar::{name}", op.fake, lib=lib)
        if op.reference is not None:
            lib.impl(name, op.reference, "CPU")
    return lib


_LIBRARY = _register()
