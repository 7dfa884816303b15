"""The plain-torch references of the ``llmpar::`` ops, registered as their CPU kernels by ``_library.py``: the same
math as the CUDA kernels of csrc/ (so ``torch.library.opcheck`` runs on CPU, and tests compare the kernels with them),
with the same argument checks as the fake impls (``_fakes.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmpar.ops._fakes import ADAMW_CHUNK, aux_buffer, check_bias_act, check_linear_lt
from llmpar.ops.adamw import PRECISIONS
from llmpar.ops.adamw_torch import torch_step
from llmpar.ops.gemm_reference import bias_act_backward_reference, linear_lt_aux_reference, linear_lt_reference
from llmpar.ops.quant import (
    _check_wire,
    _torch_dequantize,
    _torch_dequantize_sum,
    _torch_pack_quantize,
    _torch_quantize,
)


def bucket_offsets(tensors: Sequence[torch.Tensor], flat: torch.Tensor, what: str) -> list[int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += t.numel()
    if total > flat.numel():
        raise ValueError(f"{what} hold {total} elements, the flat buffer only {flat.numel()}")
    return offsets


def pack_bucket(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    for t, o in zip(tensors, bucket_offsets(tensors, out, "tensors")):
        out[o : o + t.numel()].copy_(t.reshape(-1).float() * scale)  # float32 product, scale rounded to float32


def unpack_bucket(flat: torch.Tensor, outs: Sequence[torch.Tensor], scale: float) -> None:
    for t, o in zip(outs, bucket_offsets(outs, flat, "outs")):
        t.copy_((flat[o : o + t.numel()].float() * scale).view(t.shape))


def adamw_step(
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
    torch_step(
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


def adamw_lowbit_step(
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
            assert ref.master is not None  # adamw_lowbit_reference returns a master exactly when given one
            master.view(-1).copy_(ref.master)
        p.view(-1).copy_(ref.param)
        for t, new in (
            (m_codes[i], ref.m_codes),
            (m_scales[i], ref.m_scale),
            (v_codes[i], ref.v_codes),
            (v_scales[i], ref.v_scale),
        ):
            t.view(-1).copy_(new.view(-1))


def sum_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
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


def bias_act_backward(grad: torch.Tensor, pre: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_bias_act(grad, pre, act)
    gp, db = bias_act_backward_reference(grad, pre, act)
    return gp.contiguous(), db


def linear_lt(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int, residual: torch.Tensor | None
) -> torch.Tensor:
    check_linear_lt(x, weight, bias, act, residual)
    return linear_lt_reference(x, weight, bias, act, residual).contiguous()


def linear_lt_aux(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_linear_lt(x, weight, bias, 1, None)
    y, z = linear_lt_aux_reference(x, weight, bias)
    n = weight.shape[0]
    pre = aux_buffer(x, n).narrow(1, 0, n)  # the layout the CUDA kernel returns
    pre.copy_(z)
    return y.contiguous(), pre


def quantize_rows(x: torch.Tensor, wire: torch.Tensor, m: int, bits: int, block: int) -> None:
    if x.dim() != 2 or x.shape[1] != m:
        raise ValueError(f"quantize_rows: x must be [rows, {m}], got {tuple(x.shape)}")
    _torch_quantize(x, _check_wire(wire, m, bits, block, x.shape[0]), m, bits, block, None)


def pack_quantize(
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


def dequantize_rows(wire: torch.Tensor, out: torch.Tensor, m: int, bits: int, block: int) -> None:
    _check_wire(wire, m, bits, block)
    if out.shape != (wire.shape[0], m):
        raise ValueError(f"dequantize_rows: out must be [{wire.shape[0]}, {m}], got {tuple(out.shape)}")
    _torch_dequantize(wire, m, bits, block, out)


def dequantize_sum(wire: torch.Tensor, out: torch.Tensor, m: int, bits: int, block: int, accumulate: bool) -> None:
    _check_wire(wire, m, bits, block)
    if out.shape != (m,):
        raise ValueError(f"dequantize_sum: out must be [{m}], got {tuple(out.shape)}")
    _torch_dequantize_sum(wire, m, bits, block, out, accumulate)
