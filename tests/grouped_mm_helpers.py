"""Float64 references and error bounds for the grouped GEMM (llmpar.ops.grouped_mm), shared by
tests/test_grouped_mm.py and bench/bench_grouped_mm.py.

Bounds (elementwise, first order in the unit roundoff, plus the second-order products that matter). With u the unit
of one rounding to the dtype (half an ulp at 1; a whole ulp where the conversion truncates: the Triton interpreter's
fp32 -> bf16), U = 2^-24 (fp32) and, per group e, the magnitudes |x| |w[e]| (float64):
  P = x w[e] = [g, u]           |dP| <= (r_in u + (K + 2) U) |x| |w[e]|          (fp32 accumulation, then r_in
                                                                                  roundings of P before the epilogue)
  out = P (act none)            |d out| <= (u + (K + 2) U) |x| |w[e]|
  h = silu(g) u (swiglu)        |dh| <= 1.1 |u| dg + |silu(g)| du + 1.1 dg du + (r_out u + 4 U) |h|
                                (|silu'| <= 1.1, |silu''| <= 0.5 everywhere)
  G (backward, swiglu)          G_g = dy u silu'(g):
                                    |dG_g| <= |dy| (1.1 du + 0.5 |u| dg + 0.5 dg du) + (r_G u + 6 U) |G_g|
                                G_u = dy silu(g):  |dG_u| <= 1.1 |dy| dg + (r_G u + 4 U) |G_u|
                                (act none: G = dy exactly)
  dX = G w[e]^T                 |d dX| <= dG |w[e]^T| + (u + (N + 2) U) (|G| + dG) |w[e]^T|
  dW[e] = x^T G                 |d dW| <= |x|^T dG + (u + (rows_e + 2) U) |x|^T (|G| + dG)
Roundings: the fused Triton kernels keep P in fp32 (r_in = 0) and round h and G once (r_out = r_G = 1); the unfused
paths (the per-expert torch loop, torch._grouped_mm + the SwiGLU after it) round P (r_in = 1), silu(g) and the
product (r_out = 2), dy u and silu_backward / silu(g) and the product (r_G = 2); a backward from the kept product
(``recompute=False``) computes G the unfused way from P rounded once (r_in = 1, r_G = 2) on every path. For float32,
u = U. float16 adds, per rounding, the absolute error of a result in its subnormal range (2^-25); an empty group's
dW must be exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

U32 = 2.0**-24


def unit(dtype: torch.dtype, *, truncates: bool = False) -> float:
    """One rounding to ``dtype`` (relative): half an ulp at 1, a whole one when the conversion truncates."""
    eps = torch.finfo(dtype).eps
    return eps if truncates and dtype != torch.float32 else eps / 2


def rand(shape, dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    return torch.where(x == 0, torch.full_like(x, 0.5 * scale), x).to(dtype)


@dataclass
class Case:
    """Inputs of one check: x [M, K], w [E, K, N] (``packed``: a transposed view of [E, N, K] weights, the MoE
    layout), dy [M, N or N/2]."""

    x: torch.Tensor
    w: torch.Tensor
    counts: list[int]
    act: str
    dy: torch.Tensor
    packed: bool
    recompute: bool | None = None  # grouped_mm's: None = its default for the device

    @property
    def kept(self) -> bool:
        """Whether the backward starts from the forward's kept (rounded) product [g, u] rather than recomputing."""
        from llmpar.ops.grouped_gemm import recompute_default

        recompute = recompute_default(self.x.device) if self.recompute is None else self.recompute
        return self.act == "swiglu" and not recompute


def make_case(counts, k, n, act, dtype, *, packed=True, seed=0, device="cpu", recompute=None) -> Case:
    g = torch.Generator().manual_seed(seed)
    m, e = sum(counts), len(counts)
    x = rand((m, k), dtype, g)
    w = rand((e, n, k), dtype, g, k**-0.5).transpose(1, 2) if packed else rand((e, k, n), dtype, g, k**-0.5)
    dy = rand((m, n // 2 if act == "swiglu" else n), dtype, g)
    to = dict(device=device)
    w = w.to(**to)
    return Case(x.to(**to), w, list(counts), act, dy.to(**to), packed, recompute)


def leaves(case: Case, dtype=None):
    """Fresh leaves (x, the weight parameter, the [E, K, N] view the op takes), copied, in ``dtype``."""
    dtype = dtype or case.x.dtype
    x = case.x.detach().to(dtype).clone().requires_grad_()
    if case.packed:
        param = case.w.detach().transpose(1, 2).to(dtype).contiguous().requires_grad_()
        return x, param, param.transpose(1, 2)
    param = case.w.detach().to(dtype).contiguous().requires_grad_()
    return x, param, param


def reference(case: Case):
    """(out, dx, dw in the [E, K, N] view's layout, G, magnitudes) in float64 (per-group loop, autograd)."""
    x, param, w = leaves(case, torch.float64)
    outs, start = [], 0
    for e, rows in enumerate(case.counts):
        p = x[start : start + rows] @ w[e]
        if case.act == "swiglu":
            gate, up = p.chunk(2, dim=-1)
            p = F.silu(gate) * up
        outs.append(p)
        start += rows
    out = torch.cat(outs)
    out.backward(case.dy.double())
    dw = param.grad.transpose(1, 2) if case.packed else param.grad
    return out.detach(), x.grad, dw


def bounds(case: Case, dtype: torch.dtype, *, fused: bool, truncates: bool = False) -> dict[str, torch.Tensor]:
    """Elementwise bounds of |got - reference| for out, dx, dw (module docstring)."""
    u = unit(dtype, truncates=truncates)
    tiny = 2.0**-25 if dtype == torch.float16 else 0.0  # a rounding into float16's subnormals: absolute error
    r_in, r_out = (0, 1) if fused else (1, 2)
    r_in_g, r_g = (0, 1) if fused and not case.kept else (1, 2)  # G from the kept (rounded) product: unfused
    x, w, dy = case.x.double(), case.w.double(), case.dy.double()
    k, n = x.shape[1], w.shape[2]
    ax, aw = x.abs(), w.abs()
    b_out, b_dx, b_dw = torch.zeros_like(dy), torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, rows in enumerate(case.counts):
        r = slice(start, start + rows)
        start += rows
        mag = ax[r] @ aw[e]
        if case.act == "none":
            b_out[r] = (u + (k + 2) * U32) * mag + tiny
            grad, d_grad = dy[r].abs(), torch.zeros_like(dy[r])
        else:
            p = x[r] @ w[e]
            gate, up = p.chunk(2, dim=-1)
            dp = (r_in * u + (k + 2) * U32) * mag + r_in * tiny
            dg, du = dp.chunk(2, dim=-1)
            dg_b, du_b = ((r_in_g * u + (k + 2) * U32) * mag + r_in_g * tiny).chunk(2, dim=-1)
            s = torch.sigmoid(gate)
            silu, dsilu = gate * s, s * (1 + gate * (1 - s))
            h = silu * up
            b_out[r] = (
                1.1 * up.abs() * dg + silu.abs() * du + 1.1 * dg * du + (r_out * u + 4 * U32) * h.abs() + r_out * tiny
            )
            ady = dy[r].abs()
            g_g, g_u = (dy[r] * up * dsilu).abs(), (dy[r] * silu).abs()
            d_g = (
                ady * (1.1 * du_b + 0.5 * up.abs() * dg_b + 0.5 * dg_b * du_b) + (r_g * u + 6 * U32) * g_g + r_g * tiny
            )
            d_u = 1.1 * ady * dg_b + (r_g * u + 4 * U32) * g_u + r_g * tiny
            grad, d_grad = torch.cat([g_g, g_u], -1), torch.cat([d_g, d_u], -1)
        b_dx[r] = d_grad @ aw[e].t() + (u + (n + 2) * U32) * ((grad + d_grad) @ aw[e].t()) + tiny
        b_dw[e] = ax[r].t() @ d_grad + (u + (rows + 2) * U32) * (ax[r].t() @ (grad + d_grad)) + tiny * bool(rows)
    return {"out": b_out, "dx": b_dx, "dw": b_dw}


def run_op(case: Case, fn=None):
    """(out, dx, dw in the view's layout) of ``llmpar.ops.grouped_mm`` (or ``fn(x, w, counts, act)``) on fresh
    leaves, backward with ``case.dy``."""
    from llmpar.ops import grouped_mm

    x, param, w = leaves(case)
    fn = fn or (lambda x, w, counts, act: grouped_mm(x, w, counts=counts, act=act, recompute=case.recompute))
    out = fn(x, w, case.counts, case.act)
    out.backward(case.dy)
    dw = param.grad.transpose(1, 2) if case.packed else param.grad
    return out.detach(), x.grad, dw


def assert_within(case: Case, got, *, fused: bool, truncates: bool = False, what: str = "") -> None:
    """``got`` = (out, dx, dw) within ``bounds`` of the float64 reference, elementwise."""
    ref = reference(case)
    bnd = bounds(case, case.x.dtype, fused=fused, truncates=truncates)
    for name, a, b in zip(("out", "dx", "dw"), got, ref):
        assert a.shape == b.shape and a.dtype == case.x.dtype, (what, name, a.shape, b.shape, a.dtype)
        err = (a.double().cpu() - b.cpu()).abs()
        limit = bnd[name].cpu()
        if err.numel():
            worst = (err - limit).argmax()
            assert bool((err <= limit).all()), (
                f"{what} {name}: |error| {err.flatten()[worst].item():.3g} > bound {limit.flatten()[worst].item():.3g} "
                f"at flat index {worst.item()} (|ref| max {b.abs().max().item():.3g})"
            )
