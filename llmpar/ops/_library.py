"""The ``llmpar::`` operator library: the one place where each op of the CUDA extension is registered.

For every op, ``OPS`` holds its schema (identical to what csrc/*.cpp implements), its fake impl (shapes, dtypes and
strides only: FakeTensor, torch.compile and the Meta device trace the op with it, no GPU needed; ``_fakes.py``) and a
plain-torch reference impl registered for CPU tensors (so ``torch.library.opcheck`` runs here, and tests can compare
the CUDA kernels with it; ``_references.py``). The CUDA extension ``llmpar._C`` only adds CUDA kernels
(``TORCH_LIBRARY_IMPL(llmpar, CUDA, m)``); it may be loaded before or after this module is imported. Whether a build
has the CUDA kernel of an op: ``llmpar.ops._dispatch.has_ext_op(name)``.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import llmpar.ops._references as ref
from llmpar.ops._fakes import (
    ADAMW_CHUNK,  # noqa: F401  (the block of sum_squares: tests and the CUDA build read it here)
    fake_bias_act_backward,
    fake_linear_lt,
    fake_linear_lt_aux,
    fake_none,
    fake_sum_squares,
)


@dataclass(frozen=True, kw_only=True)
class OpDef:
    """One ``llmpar::`` op: its schema, its fake impl and its plain-torch reference (the CPU kernel)."""

    schema: str  # "name(args) -> returns", the signature of the C++ kernel in csrc/*.cpp (csrc/cpu/*.cpp)
    fake: Callable[..., Any]
    reference: Callable[..., Any] | None  # None: the CPU kernel comes from the CPU extension

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


# ------------------------------------------------------------------------------------------------- the table

OPS: dict[str, OpDef] = {
    op.name: op
    for op in (
        OpDef(
            schema="pack_bucket(Tensor[] tensors, Tensor(a!) out, float scale) -> ()",
            fake=fake_none,
            reference=ref.pack_bucket,
        ),
        OpDef(
            schema="unpack_bucket(Tensor flat, Tensor(a!)[] outs, float scale) -> ()",
            fake=fake_none,
            reference=ref.unpack_bucket,
        ),
        OpDef(
            schema="adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
            "Tensor(d!)[] extras, Tensor[] steps, int[] salts, int mode_code, float lr, Tensor? lr_tensor, "
            "Tensor? gscale, Tensor? found_inf, float beta1, float beta2, float eps, float weight_decay, "
            "int seed) -> ()",
            fake=fake_none,
            reference=ref.adamw_step,
        ),
        OpDef(
            schema="adamw_lowbit_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] m_codes, "
            "Tensor(c!)[] m_scales, Tensor(d!)[] v_codes, Tensor(e!)[] v_scales, Tensor(f!)[] masters, "
            "Tensor[] steps, Tensor qmap_m, Tensor qmap_v, int bits, float lr, Tensor? lr_tensor, Tensor? gscale, "
            "Tensor? found_inf, float beta1, float beta2, float eps, float weight_decay) -> ()",
            fake=fake_none,
            reference=ref.adamw_lowbit_step,
        ),
        OpDef(schema="sum_squares(Tensor[] tensors) -> Tensor", fake=fake_sum_squares, reference=ref.sum_squares),
        OpDef(
            schema="bias_act_backward(Tensor grad, Tensor pre, int act) -> (Tensor, Tensor)",
            fake=fake_bias_act_backward,
            reference=ref.bias_act_backward,
        ),
        OpDef(
            schema="linear_lt(Tensor x, Tensor weight, Tensor? bias, int act, Tensor? residual) -> Tensor",
            fake=fake_linear_lt,
            reference=ref.linear_lt,
        ),
        OpDef(
            schema="linear_lt_aux(Tensor x, Tensor weight, Tensor? bias) -> (Tensor, Tensor)",
            fake=fake_linear_lt_aux,
            reference=ref.linear_lt_aux,
        ),
        OpDef(
            schema="quantize_rows(Tensor x, Tensor(a!) wire, int m, int bits, int block) -> ()",
            fake=fake_none,
            reference=ref.quantize_rows,
        ),
        OpDef(
            schema="pack_quantize(Tensor[] tensors, Tensor(a!) wire, int rows, int m, int bits, int block, "
            "float scale, Tensor(b!)? residual) -> ()",
            fake=fake_none,
            reference=ref.pack_quantize,
        ),
        OpDef(
            schema="dequantize_rows(Tensor wire, Tensor(a!) out, int m, int bits, int block) -> ()",
            fake=fake_none,
            reference=ref.dequantize_rows,
        ),
        OpDef(
            schema="dequantize_sum(Tensor wire, Tensor(a!) out, int m, int bits, int block, bool accumulate) -> ()",
            fake=fake_none,
            reference=ref.dequantize_sum,
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
            fake=fake_none,
            reference=None,
        ),
        OpDef(
            schema="cpu_adamw_lowbit_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] m_codes, "
            "Tensor(c!)[] m_scales, Tensor(d!)[] v_codes, Tensor(e!)[] v_scales, Tensor(f!)[] outs, "
            "Tensor qmap_m, Tensor qmap_v, int[] steps, int bits, float lr, float beta1, float beta2, float eps, "
            "float weight_decay, float gscale, int isa) -> ()",
            fake=fake_none,
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
