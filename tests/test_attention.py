"""llmpar.ops.attention (the torch path here; tests/test_attention_triton.py runs the same checks on the Triton kernels)
against plain softmax attention in float64, differentiated by autograd.

The error bound of each output is derived, not a fixed floor (DESIGN habit 6): with u the unit of one rounding of the
dtype (half an ulp at 1 when rounding to nearest, a whole ulp when truncating: the Triton interpreter's fp32 -> bf16),
r the number of roundings to that dtype on the way to the value, and ``mag`` the same sum taken over absolute values,
    |got - ref| <= (r u + c32 u32) mag,    c32 = 2 (D + 2)(1 + max|s|) + G Sq + Sk + 16
where c32 u32 covers the fp32 arithmetic (scores summed over D, exp of a score that is that far off, sums over keys
and over a group's query rows). A wrong mask, position or head mapping is off by O(mag), far outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from llmpar.ops import attention_bwd, attention_fwd, flash_attention, merge_partials

U32 = torch.finfo(torch.float32).eps / 2


@dataclass(kw_only=True)
class Case:
    """One attention call: q [b, hq, sq, d], k/v [b, hkv, sk, d], positions, key padding."""

    b: int
    hq: int
    hkv: int
    sq: int
    sk: int
    d: int
    causal: bool = True
    q_pos: list[int] | None = None
    k_pos: list[int] | None = None
    pad: str = "none"  # "none" | "some" (random keys padded) | "row" (some, and batch 0 fully padded)

    def __str__(self) -> str:
        return f"b{self.b}h{self.hq}:{self.hkv}q{self.sq}k{self.sk}d{self.d}{'c' if self.causal else 'n'}-{self.pad}"


def zigzag(seq: int, sp: int, rank: int) -> list[int]:
    """Global indices rank ``rank`` of ``sp`` holds under the zigzag split (chunks rank and 2 sp - 1 - rank)."""
    c = seq // (2 * sp)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * sp - 1 - rank) * c, (2 * sp - rank) * c))


CASES = [
    Case(b=1, hq=1, hkv=1, sq=1, sk=1, d=16),
    Case(b=2, hq=4, hkv=1, sq=7, sk=7, d=24, pad="some"),  # GQA 4:1
    Case(b=1, hq=6, hkv=2, sq=37, sk=37, d=64, causal=False),  # GQA 6:2
    Case(b=2, hq=2, hkv=2, sq=130, sk=130, d=16, pad="row"),  # a fully padded batch row
    Case(b=1, hq=4, hkv=2, sq=20, sk=20, d=24, q_pos=zigzag(40, 2, 0), k_pos=zigzag(40, 2, 1)),  # zigzag blocks
    Case(b=2, hq=2, hkv=1, sq=37, sk=130, d=16, q_pos=list(range(93, 130)), pad="some"),  # Sq != Sk
]


def make(case: Case, dtype: torch.dtype, seed: int = 0, device: str = "cpu", *, seq_major: bool = False):
    """(q, k, v, dout, q_pos, k_pos, k_valid) on random data (never zeros). ``seq_major``: q, k, v, dout are views
    of [B, S, H, D] tensors (the layout a model's projections produce), not contiguous."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)
        return x.transpose(1, 2).contiguous().transpose(1, 2) if seq_major else x

    q, k, v = (
        rnd(case.b, case.hq, case.sq, case.d),
        rnd(case.b, case.hkv, case.sk, case.d),
        rnd(case.b, case.hkv, case.sk, case.d),
    )
    dout = rnd(case.b, case.hq, case.sq, case.d)
    pos = [None if p is None else torch.tensor(p, device=device) for p in (case.q_pos, case.k_pos)]
    valid = None
    if case.pad != "none":
        valid = torch.rand(case.b, case.sk, generator=g) > 0.3
        valid[:, -1] = True
        if case.pad == "row":
            valid[0] = False
        valid = valid.to(device)
    return q, k, v, dout, pos[0], pos[1], valid


def reference(q, k, v, dout, *, scale, causal, q_pos, k_pos, k_valid):
    """Plain softmax attention in float64 and its autograd gradients; returns (out, lse, grads, magnitudes, smax)."""
    q, k, v, dout = (t.detach().double().cpu().requires_grad_(t is not dout) for t in (q, k, v, dout))
    B, Hq, Sq, D = q.shape
    Sk, g = k.shape[2], Hq // k.shape[1]
    qp = q_pos.cpu() if q_pos is not None else torch.arange(Sq)
    kp = k_pos.cpu() if k_pos is not None else torch.arange(Sk)
    vis = torch.ones(B, 1, Sq, Sk, dtype=torch.bool)
    if causal:
        vis = vis & (kp[None, :] <= qp[:, None])
    if k_valid is not None:
        vis = vis & k_valid.cpu()[:, None, None, :]
    vis = vis.expand(B, Hq, Sq, Sk)
    empty = ~vis.any(-1)
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = scale * q @ kk.transpose(-1, -2)
    s_m = s.masked_fill(~vis, -math.inf).masked_fill(empty[..., None], 0.0)
    p = torch.softmax(s_m, -1) * (~empty)[..., None]
    out = p @ vv
    lse = torch.logsumexp(s_m, -1).masked_fill(empty, -math.inf)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    with torch.no_grad():
        p, ao, ado = p.detach(), out.abs().detach(), dout.abs()
        ds_abs = p * (ado @ vv.abs().transpose(-1, -2) + (ado * ao).sum(-1, keepdim=True))
        red = (B, k.shape[1], g, Sk, D)
        mag = {
            "out": p @ vv.abs() + ao,
            "dq": scale * ds_abs @ kk.abs() + dq.abs(),
            "dk": (scale * ds_abs.transpose(-1, -2) @ q.abs()).view(red).sum(2) + dk.abs(),
            "dv": (p.transpose(-1, -2) @ ado).view(red).sum(2) + dv.abs(),
        }
        smax = (scale * q.abs() @ kk.abs().transpose(-1, -2)).max().item() if q.numel() and k.numel() else 0.0
    return out.detach(), lse, {"dq": dq, "dk": dk, "dv": dv}, mag, smax


def unit(dtype: torch.dtype, *, truncates: bool = False) -> float:
    """One rounding to ``dtype`` (relative): half an ulp at 1, a whole one when the conversion truncates."""
    eps = torch.finfo(dtype).eps
    return eps if truncates else eps / 2


def assert_within(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    mag: torch.Tensor,
    *,
    roundings: int,
    dtype: torch.dtype,
    d: int,
    smax: float,
    g: int,
    sq: int,
    sk: int,
    truncates: bool = False,
) -> None:
    """|got - ref| <= (roundings u + c32 u32) mag elementwise (module docstring), plus, for float16, the absolute
    error of probabilities below its subnormal range."""
    c32 = 2 * (d + 2) * (1 + smax) + g * sq + sk + 16
    bound = (roundings * unit(dtype, truncates=truncates) + c32 * U32) * mag
    if dtype == torch.float16:
        bound = bound + (sk + sq) * 2.0**-25 * mag.amax()
    err = (got.double().cpu() - ref).abs()
    worst = (err - bound).argmax() if err.numel() else None
    assert bool((err <= bound).all()), (
        f"{name}: |error| {err.flatten()[worst].item():.3g} > bound "
        f"{bound.flatten()[worst].item():.3g} at flat index {worst.item()}"
    )


def check_case(
    case: Case,
    dtype: torch.dtype,
    *,
    truncates: bool = False,
    fwd_roundings: int = 1,
    bwd_roundings: int = 2,
    device: str = "cpu",
    seed: int = 0,
    seq_major: bool = False,
) -> None:
    """flash_attention (forward with lse, and backward through autograd) against :func:`reference`."""
    q, k, v, dout, q_pos, k_pos, valid = make(case, dtype, seed, device, seq_major=seq_major)
    scale = 1.0 / math.sqrt(case.d)
    ref_out, ref_lse, ref_grads, mag, smax = reference(
        q, k, v, dout, scale=scale, causal=case.causal, q_pos=q_pos, k_pos=k_pos, k_valid=valid
    )
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(qg, kg, vg, causal=case.causal, q_pos=q_pos, k_pos=k_pos, k_valid=valid, return_lse=True)
    out.backward(dout)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    kw = dict(dtype=dtype, d=case.d, smax=smax, g=case.hq // case.hkv, sq=case.sq, sk=case.sk, truncates=truncates)
    assert_within("out", out, ref_out, mag["out"], roundings=fwd_roundings, **kw)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse.cpu()), empty) and bool((lse.cpu()[empty] < 0).all())
    assert bool((out.cpu()[empty] == 0).all())
    # lse: the max score is exact up to c32 u32 |s|; the log of a sum of >= 1 terms adds that much again
    lse_err = (lse.double().cpu() - ref_lse)[~empty].abs()
    assert bool((lse_err <= (4 * case.d + case.sk + 16) * U32 * (1 + smax)).all()), lse_err.max()
    for name, t in (("dq", qg), ("dk", kg), ("dv", vg)):
        assert t.grad.dtype == dtype and bool(torch.isfinite(t.grad).all()), name
        assert_within(name, t.grad, ref_grads[name], mag[name], roundings=bwd_roundings, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_path_vs_float64(case, dtype, monkeypatch):
    """Forward out / lse and the backward of the torch path, against float64 (roundings: out 1; grads 2, the second
    being delta's use of the rounded out)."""
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")
    check_case(case, dtype)


def check_split_keys(
    case: Case,
    dtype: torch.dtype,
    cut: int,
    *,
    truncates: bool = False,
    fwd_roundings: int = 1,
    bwd_roundings: int = 2,
    device: str = "cpu",
) -> None:
    """A ring's use: attention over two disjoint key blocks, merged with merge_partials, equals the unsplit result;
    the backward of each block given the *final* out / lse gives dq (summed over blocks) and each block's dk / dv."""
    q, k, v, dout, q_pos, k_pos, valid = make(case, dtype, 1, device)
    scale = 0.3
    kp = k_pos if k_pos is not None else torch.arange(case.sk, device=device)
    blocks = [slice(0, cut), slice(cut, case.sk)]
    kw = dict(scale=scale, causal=case.causal, q_pos=q_pos)
    parts = [
        attention_fwd(q, k[:, :, s], v[:, :, s], k_pos=kp[s], k_valid=None if valid is None else valid[:, s], **kw)
        for s in blocks
    ]
    out, lse = merge_partials(*parts[0], *parts[1])
    ref_out, ref_lse, ref_grads, mag, smax = reference(q, k, v, dout, k_pos=kp, k_valid=valid, **kw)
    for s in blocks:  # each block has rows that see some of its keys: otherwise this checks zeros against zeros
        sees = torch.isfinite(
            reference(
                q, k[:, :, s], v[:, :, s], dout, k_pos=kp[s], k_valid=None if valid is None else valid[:, s], **kw
            )[1]
        )
        assert bool(sees.any()), f"{case}: no row sees a key of block {s}"
    tol = dict(dtype=dtype, d=case.d, smax=smax, g=case.hq // case.hkv, sq=case.sq, sk=case.sk, truncates=truncates)
    assert_within("merged out", out, ref_out, mag["out"], roundings=fwd_roundings + 1, **tol)  # + the merge's rounding
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(ref_lse))
    whole_out, whole_lse = attention_fwd(q, k, v, k_pos=kp, k_valid=valid, **kw)
    grads = [
        attention_bwd(
            q,
            k[:, :, s],
            v[:, :, s],
            whole_out,
            whole_lse,
            dout,
            k_pos=kp[s],
            k_valid=None if valid is None else valid[:, s],
            **kw,
        )
        for s in blocks
    ]
    dq = grads[0][0].double() + grads[1][0].double()
    assert_within("dq (sum over blocks)", dq, ref_grads["dq"], mag["dq"], roundings=bwd_roundings + 1, **tol)
    for i, name in ((1, "dk"), (2, "dv")):
        got = torch.cat([grads[0][i], grads[1][i]], dim=2)
        assert_within(f"{name} (blocks)", got, ref_grads[name], mag[name], roundings=bwd_roundings, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_split_key_blocks_merge_and_backward_from_final_lse(dtype, monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")
    # zigzag positions, GQA 6:2, key padding with a fully padded row: a block sees nothing for some rows
    case = Case(b=2, hq=6, hkv=2, sq=20, sk=40, d=24, q_pos=zigzag(40, 2, 1), k_pos=list(range(40)), pad="row")
    check_split_keys(case, dtype, cut=10)


def test_merge_partials_of_an_empty_block_is_the_other():
    g = torch.Generator().manual_seed(3)
    o = torch.randn(2, 3, 5, 8, generator=g)
    lse = torch.randn(2, 3, 5, generator=g)
    lse[0, 0, 0] = -math.inf
    o[0, 0, 0] = 0
    empty_o, empty_lse = torch.zeros_like(o), torch.full_like(lse, -math.inf)
    for a, b in (((o, lse), (empty_o, empty_lse)), ((empty_o, empty_lse), (o, lse))):
        mo, ml = merge_partials(*a, *b)
        assert torch.equal(ml, lse) and torch.allclose(mo, o, rtol=2 * U32, atol=0) and not torch.isnan(mo).any()


def _bad(**change):
    g = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(2, 4, 5, 8, generator=g),
        k=torch.randn(2, 2, 6, 8, generator=g),
        v=torch.randn(2, 2, 6, 8, generator=g),
    )
    kw = {}
    for key, value in change.items():
        (args if key in args else kw)[key] = value
    return args, kw


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (dict(q=torch.randn(4, 5, 8)), ValueError, "q must be [batch, heads, seq, head_dim]"),
        (dict(k=torch.randn(2, 3, 6, 8), v=torch.randn(2, 3, 6, 8)), ValueError, "query heads 4 must be a multiple of"),
        (dict(v=torch.randn(2, 2, 7, 8)), ValueError, "k and v must have the same shape"),
        (dict(k=torch.randn(2, 2, 6, 4), v=torch.randn(2, 2, 6, 4)), ValueError, "head_dim"),
        (dict(q=torch.ones(2, 4, 5, 8, dtype=torch.int64)), TypeError, "q has dtype torch.int64"),
        (dict(q_pos=torch.arange(4)), ValueError, "q_pos must be 1-D of length Sq=5"),
        (dict(k_pos=torch.arange(6.0)), TypeError, "k_pos must be an integer tensor"),
        (dict(k_valid=torch.ones(2, 5, dtype=torch.bool)), ValueError, "k_valid must be a bool tensor of shape (2, 6)"),
        (dict(k_valid=torch.ones(2, 6)), ValueError, "k_valid must be a bool tensor"),
        (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
        (dict(scale="0.5"), ValueError, "scale must be a finite number"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_inputs_raise_naming_the_argument(change, exc, words):
    args, kw = _bad(**change)
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        attention_fwd(**args, **kw)
    q = args["q"]
    if q.dim() == 4 and q.is_floating_point():
        with pytest.raises(exc):
            attention_bwd(**args, out=q, lse=q[..., 0], dout=q, **kw)


def test_backward_checks_out_lse_dout():
    args, _ = _bad()
    q = args["q"]
    with pytest.raises(ValueError, match="out/dout must have q's shape"):
        attention_bwd(**args, out=q, lse=q[..., :2], dout=q)
    with pytest.raises(TypeError, match="lse must be a floating-point tensor, got torch.int64"):
        attention_bwd(**args, out=q, lse=q[..., 0].long(), dout=q)
    with pytest.raises(TypeError, match="dout must be a floating-point tensor, got NoneType"):
        attention_bwd(**args, out=q, lse=q[..., 0], dout=None)


def test_backend_choice_on_cpu(monkeypatch):
    """Without the interpreter, CPU tensors run the torch path; forcing a backend that cannot run raises naming it."""
    args, _ = _bad()
    monkeypatch.setenv("LLMPAR_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="LLMPAR_BACKEND=cuda"):
        attention_fwd(**args)
    from llmpar.kernels import attention as kernels

    if not kernels.INTERPRETED:
        monkeypatch.setenv("LLMPAR_BACKEND", "triton")
        with pytest.raises(RuntimeError, match="LLMPAR_BACKEND=triton.*TRITON_INTERPRET"):
            attention_fwd(**args)
    monkeypatch.delenv("LLMPAR_BACKEND")
    out, lse = attention_fwd(*(t.double() for t in args.values()))
    assert out.dtype == lse.dtype == torch.float64


def check_no_keys(device: str = "cpu") -> None:
    """A block with no keys at all (Sk = 0): every row is empty (out 0, lse -inf), gradients 0, and no NaN."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 5, 16, generator=g).to(device)
    k = v = torch.randn(2, 2, 0, 16, generator=g).to(device)
    out, lse = attention_fwd(q, k, v, q_pos=torch.arange(3, 8, device=device), k_pos=torch.arange(0, device=device))
    assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isneginf(lse).all())
    dq, dk, dv = attention_bwd(q, k, v, out, lse, torch.randn_like(q))
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == v.shape


def test_a_block_without_keys(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")
    check_no_keys()
