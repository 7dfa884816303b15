"""Tensor-parallel linears on the fused path (llmpar.ops.gemm) == the plain-torch layers == a float64 single device.

The fused path is taken on CUDA tensors or when LLMPAR_BACKEND forces a kernel backend; here LLMPAR_BACKEND=triton
on CPU ranks runs the Triton GEMM kernels under TRITON_INTERPRET=1. As in test_ops_gemm.py the variable must be set
before llmpar.kernels is imported (and before the rank pool starts), so without it this file re-runs itself in a
subprocess with it set. Each body builds a column (with an activation) -> row MLP from float64 nn.Linear layers, runs
it once plain and once fused on the same input, checks that the fused run really went through the Triton kernels
(and the plain one did not), and compares output and every gradient with the float64 reference: the fused error is
at most 2x the plain layers' error in the same dtype, plus one rounding of the reference as a floor.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from interp import run_interpreted
from multirank import run_ranks

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
D_IN, D_FF = 33, 18  # odd sizes; D_FF / tp is 18 or 9


@contextlib.contextmanager
def _backend(name: str | None):
    old = os.environ.pop("LLMPAR_BACKEND", None)
    if name is not None:
        os.environ["LLMPAR_BACKEND"] = name
    try:
        yield
    finally:
        os.environ.pop("LLMPAR_BACKEND", None)
        if old is not None:
            os.environ["LLMPAR_BACKEND"] = old


@contextlib.contextmanager
def _count_kernel_calls():
    """Counts the launches of the Triton GEMM entry points (forward, input grad, weight grad)."""
    from llmpar.kernels import gemm as kernels

    counts = {}
    saved = {name: getattr(kernels, name) for name in ("linear_fwd", "linear_bwd_input", "linear_bwd_weight")}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(kernels, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)


def _rows(t, rank, tp, dim=0):
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


def _err(got, ref):
    return (got.double() - ref).abs().max().item()


def _mlp_run(fc, proj, x, w_out, act, sp, chunks, overlap, dtype, backend):
    """(output, [x grad, fc.weight/bias grads, proj.weight/bias grads], kernel call counts) of this rank."""
    from llmpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    g = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    with _backend(backend), _count_kernel_calls() as counts:
        col = ColumnParallelLinear.from_linear(
            copy.deepcopy(fc).to(dtype),
            group=g,
            activation=act,
            sequence_parallel=sp,
            comm_chunks=chunks,
            overlap_grad_comm=overlap,
        )
        row = RowParallelLinear.from_linear(
            copy.deepcopy(proj).to(dtype), group=g, sequence_parallel=sp, comm_chunks=chunks
        )
        xin = (_rows(x, rank, tp) if sp else x).to(dtype).clone().requires_grad_()
        out = row(col(xin))
        (out * (_rows(w_out, rank, tp) if sp else w_out).to(dtype)).sum().backward()
    grads = [xin.grad, col.weight.grad, col.bias.grad, row.weight.grad, row.bias.grad]
    return out.detach(), grads, dict(counts)


def _fused_mlp_body(act: str, sp: bool, chunks: int, overlap: bool, dtype_name: str):
    from llmpar.kernels import gemm as kernels
    from llmpar.ops.gemm import _act_torch

    assert kernels.INTERPRETED, "TRITON_INTERPRET=1 must be set before the ranks import llmpar.kernels"
    tp, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    fc, proj = nn.Linear(D_IN, D_FF, dtype=torch.float64), nn.Linear(D_FF, D_IN, dtype=torch.float64)
    s = 3 * tp if sp else 5  # [s, 1, D_IN]: 5 tokens, or 3 per rank under sequence parallelism (chunks 2 + 1)
    x = torch.randn(s, 1, D_IN, dtype=torch.float64)
    w_out = torch.randn(s, 1, D_IN, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref_out = proj(_act_torch(fc(xr), act))
    (ref_out * w_out).sum().backward()
    refs = [
        _rows(ref_out.detach(), rank, tp) if sp else ref_out.detach(),
        _rows(xr.grad, rank, tp) if sp else xr.grad,
        _rows(fc.weight.grad, rank, tp),
        _rows(fc.bias.grad, rank, tp),
        _rows(proj.weight.grad, rank, tp, 1),
        proj.bias.grad,
    ]
    plain_out, plain_grads, plain_calls = _mlp_run(fc, proj, x, w_out, act, sp, chunks, overlap, dtype, None)
    fused_out, fused_grads, fused_calls = _mlp_run(fc, proj, x, w_out, act, sp, chunks, overlap, dtype, "triton")
    assert plain_calls == {}, f"the plain layers launched Triton kernels: {plain_calls}"
    # column + row forward (row: one launch per chunk without sequence parallelism), and both backward GEMMs
    assert (
        fused_calls.get("linear_fwd", 0) >= 2
        and fused_calls.get("linear_bwd_input", 0) >= 2
        and fused_calls.get("linear_bwd_weight", 0) >= 2
    ), f"the fused layers skipped the kernels: {fused_calls}"
    floor_eps = torch.finfo(dtype).eps
    names = ["output", "x grad", "fc.weight grad", "fc.bias grad", "proj.weight grad", "proj.bias grad"]
    for name, got, plain, ref in zip(names, [fused_out, *fused_grads], [plain_out, *plain_grads], refs):
        assert got is not None and got.dtype == dtype and got.shape == ref.shape, name
        e_got, e_plain = _err(got, ref), _err(plain, ref)
        floor = floor_eps * ref.abs().max().item()
        assert e_got <= 2 * e_plain + floor, (
            f"rank {rank} {name} ({act}, sp={sp}, chunks={chunks}, {dtype_name}):"
            f" fused error {e_got:.3g} vs plain {e_plain:.3g}"
        )


CASES = [  # (world size, activation, sequence parallel, chunks, overlapped input-grad collective, dtype)
    (1, "gelu_tanh", False, 1, True, "float32"),
    (2, "gelu_tanh", False, 1, True, "float32"),
    (2, "silu", False, 2, False, "float32"),
    (2, "relu", True, 1, True, "float32"),
    (2, "gelu_erf", True, 2, False, "float32"),
    (2, "gelu_tanh", True, 2, True, "bfloat16"),
]


@pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("world_size, act, sp, chunks, overlap, dtype", CASES)
def test_fused_mlp_matches_plain_and_float64(world_size, act, sp, chunks, overlap, dtype):
    pytest.importorskip("triton")
    run_ranks(_fused_mlp_body, world_size, act, sp, chunks, overlap, dtype, timeout=300)


def _fused_head_body(bias: bool):
    """A ParallelLMHead on the fused path: the -inf of the padding columns comes through the GEMM's bias epilogue,
    and the loss over its split logits (no vocab_size) matches float64 F.cross_entropy over the real vocabulary."""
    from llmpar.tensor_parallel import ParallelLMHead, vocab_parallel_cross_entropy

    g = dist.group.WORLD
    rank = dist.get_rank()
    V = 67  # padded to 68 at tp 2
    torch.manual_seed(1)
    ref = nn.Linear(D_IN, V, bias=bias, dtype=torch.float64)
    x = torch.randn(5, D_IN, dtype=torch.float64)
    target = torch.randint(0, V, (5,))
    target[0] = V - 1
    want = torch.nn.functional.cross_entropy(ref(x), target, label_smoothing=0.1)
    results = []
    for backend in (None, "triton"):
        with _backend(backend), _count_kernel_calls() as counts:
            head = ParallelLMHead.from_linear(copy.deepcopy(ref).float(), group=g)
            logits = head(x.float())
            loss = vocab_parallel_cross_entropy(logits, target, g, label_smoothing=0.1)
            loss.backward()
        assert (counts.get("linear_fwd", 0) > 0) == (backend == "triton"), counts
        real = min(max(V - rank * logits.shape[-1], 0), logits.shape[-1])
        assert torch.isneginf(logits[:, real:]).all() and torch.isfinite(logits[:, :real]).all()
        assert not head.weight.grad[real:].any(), "padding rows got a gradient"
        results.append((loss.detach(), head.weight.grad))
    (plain_loss, plain_grad), (fused_loss, fused_grad) = results
    floor = torch.finfo(torch.float32).eps * want.abs().item()
    assert (fused_loss.double() - want).abs() <= 2 * (plain_loss.double() - want).abs() + 4 * floor, (
        fused_loss,
        plain_loss,
        want,
    )
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("bias", [False, True])
def test_fused_lm_head_pads_with_minus_inf_and_the_loss_matches(bias):
    pytest.importorskip("triton")
    run_ranks(_fused_head_body, 2, bias, timeout=300)


def _errors_body():
    from llmpar.tensor_parallel import ColumnParallelLinear

    with pytest.raises(ValueError, match="activation='gelu2' is not supported; use one of none, gelu_tanh"):
        ColumnParallelLinear(8, 4, group=dist.group.WORLD, activation="gelu2")
    with _backend("triton"):  # forced kernels do not take float64: a clear error, not a silent fallback
        col = ColumnParallelLinear(8, 4, group=dist.group.WORLD, dtype=torch.float64)
        with pytest.raises(TypeError, match="cannot use the triton kernel: x dtype torch.float64"):
            col(torch.randn(3, 8, dtype=torch.float64))


@pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_bad_activation_and_forced_kernel_dtype_raise_on_every_rank():
    run_ranks(_errors_body, 2, timeout=120)


@pytest.mark.skipif(INTERPRET, reason="already under TRITON_INTERPRET=1: the tests above run in-process")
def test_fused_layers_under_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, timeout=900, what="fused tp tests")
