"""Tensor-parallel layers on CPU/gloo ranks == the single-device layers (float64 reference; fp32 and fp64 runs).

Each body builds the plain layers in float64 on every rank (same seed), the parallel layers from them, feeds the
same random input (a shard of it under sequence parallelism) and compares outputs and gradients.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmpar.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tensor_region,
    vocab_parallel_cross_entropy,
)

from multirank import run_ranks

WORLD = (1, 2, 4)
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=1e-5, atol=2e-6)}


def _close(got, want, what, dtype):
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _rows(t, rank, tp, dim=0):
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


# ---------------------------------------------------------------- communication regions
def _comm_body():
    g = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1)
    x = torch.randn(4 * 3, 5, 4 * 2, dtype=torch.float64)  # same on every rank
    w = torch.randn_like(x)
    for name, fn, want in [
        ("copy_to", copy_to_tensor_region, x),
        ("scatter_to_tensor", scatter_to_tensor_region, _rows(x, rank, tp, -1)),
        ("scatter_to_sequence", scatter_to_sequence_region, _rows(x, rank, tp)),
    ]:
        a = x.clone().requires_grad_()
        out = fn(a, g)
        _close(out, want, name, torch.float64)
        # every rank sends back the matching part of the same w: copy_to sums tp copies, scatters re-assemble w
        grad_out = w if name == "copy_to" else (_rows(w, rank, tp, -1) if "tensor" in name else _rows(w, rank, tp))
        out.backward(grad_out)
        _close(a.grad, w * tp if name == "copy_to" else w, name + " grad", torch.float64)
    # partial values: rank r holds (r + 1) * x; the sum is x * tp (tp + 1) / 2
    s = tp * (tp + 1) / 2
    part = (x * (rank + 1)).requires_grad_()
    out = reduce_from_tensor_region(part, g)
    _close(out, x * s, "reduce_from", torch.float64)
    out.backward(w)
    _close(part.grad, w, "reduce_from grad", torch.float64)
    part.grad = None
    out = reduce_scatter_to_sequence_region(part, g)
    _close(out, _rows(x * s, rank, tp), "reduce_scatter_seq", torch.float64)
    out.backward(_rows(w, rank, tp))
    _close(part.grad, w, "reduce_scatter_seq grad", torch.float64)  # all-gather of the shards of w
    shard = _rows(x, rank, tp, -1).clone().requires_grad_()
    out = gather_from_tensor_region(shard, g)
    _close(out, x, "gather_tensor", torch.float64)
    out.backward(w)
    _close(shard.grad, _rows(w, rank, tp, -1), "gather_tensor grad", torch.float64)
    shard = _rows(x, rank, tp).clone().requires_grad_()
    out = gather_from_sequence_region(shard, g)
    _close(out, x, "gather_seq", torch.float64)
    out.backward(w * (rank + 1))  # partial grads: reduce-scattered
    _close(shard.grad, _rows(w * s, rank, tp), "gather_seq grad", torch.float64)


@pytest.mark.parametrize("world_size", WORLD)
def test_comm_regions_forward_backward(world_size):
    run_ranks(_comm_body, world_size)


# ---------------------------------------------------------------- column -> row MLP
def _mlp_body(sp: bool, chunks: int, overlap: bool, dtype_name: str):
    g = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    d, hidden = 7, 12
    ref_fc, ref_proj = nn.Linear(d, hidden, dtype=torch.float64), nn.Linear(hidden, d, dtype=torch.float64)
    s = 4 * 3 if sp else 5  # odd token count without sequence parallelism
    x = torch.randn(s, 3, d, dtype=torch.float64)
    w_out = torch.randn(s, 3, d, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref = ref_proj(F.gelu(ref_fc(xr)))
    (ref * w_out).sum().backward()

    fc = ColumnParallelLinear.from_linear(
        ref_fc.to(dtype), group=g, sequence_parallel=sp, comm_chunks=chunks, overlap_grad_comm=overlap
    )
    proj = RowParallelLinear.from_linear(ref_proj.to(dtype), group=g, sequence_parallel=sp, comm_chunks=chunks)
    ref_fc.double(), ref_proj.double()
    xin = (_rows(x, rank, tp) if sp else x).to(dtype).clone().requires_grad_()
    out = proj(F.gelu(fc(xin)))
    w_here = _rows(w_out, rank, tp) if sp else w_out
    (out * w_here.to(dtype)).sum().backward()
    _close(out, _rows(ref, rank, tp) if sp else ref, "output", dtype)
    _close(xin.grad, _rows(xr.grad, rank, tp) if sp else xr.grad, "input grad", dtype)
    _close(fc.weight.grad, _rows(ref_fc.weight.grad, rank, tp), "fc.weight grad", dtype)
    _close(fc.bias.grad, _rows(ref_fc.bias.grad, rank, tp), "fc.bias grad", dtype)
    _close(proj.weight.grad, _rows(ref_proj.weight.grad, rank, tp, 1), "proj.weight grad", dtype)
    _close(proj.bias.grad, ref_proj.bias.grad, "proj.bias grad", dtype)


@pytest.mark.parametrize("world_size", WORLD)
@pytest.mark.parametrize(
    "sp,chunks,overlap", [(False, 1, False), (False, 3, True), (True, 1, True), (True, 3, False), (True, 2, True)]
)
def test_column_row_mlp_matches_single_device(world_size, sp, chunks, overlap):
    for dtype in ("float64", "float32"):
        run_ranks(_mlp_body, world_size, sp, chunks, overlap, dtype)


def _chunked_body(sp: bool, bias: bool, dtype_name: str):
    """k = 3 chunks (token counts 5 and 7: not divisible by 3) == k = 1, outputs and every gradient; also with an
    input that needs no gradient (the input-gradient products and collectives skipped)."""
    g = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(11)
    d, hidden = 6, 8
    ref_fc, ref_proj = nn.Linear(d, hidden, bias=bias, dtype=dtype), nn.Linear(hidden, d, bias=bias, dtype=dtype)
    x = torch.randn(tp if sp else 7, 5 if sp else 1, d, dtype=dtype)  # SP: 5 local rows per rank; else 7 tokens
    x = _rows(x, rank, tp) if sp else x
    w_out = torch.randn(x.shape[:-1] + (d,), dtype=dtype)
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=2e-6, atol=1e-6)
    for needs_input_grad in (True, False):
        results = []
        for chunks in (1, 3):
            fc = ColumnParallelLinear.from_linear(ref_fc, group=g, sequence_parallel=sp, comm_chunks=chunks)
            proj = RowParallelLinear.from_linear(ref_proj, group=g, sequence_parallel=sp, comm_chunks=chunks)
            xin = x.clone().requires_grad_(needs_input_grad)
            h = F.gelu(fc(xin))
            if needs_input_grad:
                out = proj(h)
                (out * w_out).sum().backward()
            else:  # neither layer needs its input's gradient
                out = proj(h.detach())
                ((out * w_out).sum() + h.square().sum()).backward()
            grads = [p.grad for p in (*fc.parameters(), *proj.parameters())]
            results.append([out, xin.grad, *grads])
        assert (results[1][1] is None) == (not needs_input_grad)
        for i, (got, want) in enumerate(zip(results[1], results[0])):
            if want is not None:
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"tensor {i} (sp={sp}): {m}")


@pytest.mark.parametrize("world_size", WORLD)
@pytest.mark.parametrize("sp,bias", [(False, True), (True, True), (True, False)])
def test_chunked_overlap_equals_unchunked(world_size, sp, bias):
    for dtype in ("float64", "float32"):
        run_ranks(_chunked_body, world_size, sp, bias, dtype)


def _gather_and_scatter_body():
    g = dist.group.WORLD
    torch.manual_seed(3)
    fc, proj = nn.Linear(5, 8, dtype=torch.float64), nn.Linear(8, 3, bias=False, dtype=torch.float64)
    x = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    ref = proj(fc(x))
    ref.sum().backward()
    col = ColumnParallelLinear.from_linear(fc, group=g, gather_output=True)
    row = RowParallelLinear.from_linear(proj, group=g, input_is_parallel=False)
    x2 = x.detach().clone().requires_grad_()
    out = row(col(x2))
    out.sum().backward()
    _close(out, ref, "output", torch.float64)
    _close(x2.grad, x.grad, "input grad", torch.float64)


@pytest.mark.parametrize("world_size", WORLD)
def test_gather_output_and_unsplit_row_input(world_size):
    run_ranks(_gather_and_scatter_body, world_size)


# ---------------------------------------------------------------- init identical to nn.Linear / nn.Embedding
def _init_body():
    g = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    for seed in (0, 7):
        torch.manual_seed(seed)
        ref = nn.Linear(6, 8)
        torch.manual_seed(seed)
        col = ColumnParallelLinear(6, 8, group=g)
        assert torch.equal(col.weight, _rows(ref.weight, rank, tp)) and torch.equal(col.bias, _rows(ref.bias, rank, tp))
        torch.manual_seed(seed)
        row = RowParallelLinear(8, 6, group=g)
        torch.manual_seed(seed)
        ref = nn.Linear(8, 6)
        assert torch.equal(row.weight, _rows(ref.weight, rank, tp, 1)) and torch.equal(row.bias, ref.bias)
        torch.manual_seed(seed)
        emb = VocabParallelEmbedding(1001, 5, group=g)
        torch.manual_seed(seed)
        ref = nn.Embedding(1001, 5)
        n = emb.num_embeddings_per_rank
        padded = F.pad(ref.weight, (0, 0, 0, emb.padded_num_embeddings - 1001))
        assert torch.equal(emb.weight, padded[rank * n : (rank + 1) * n])
    col = ColumnParallelLinear(6, 8, group=g, init_method=lambda w: nn.init.constant_(w, 0.5))
    assert bool((col.weight == 0.5).all()) and bool((col.bias == 0).all())


@pytest.mark.parametrize("world_size", WORLD)
def test_init_holds_the_single_device_slice(world_size):
    run_ranks(_init_body, world_size)


# ---------------------------------------------------------------- vocab-parallel embedding, head and loss
def _vocab_body(sp: bool, smoothing: float):
    g = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(5)
    V, d = 1001, 6
    emb_ref = nn.Embedding(V, d, padding_idx=3, dtype=torch.float64)
    head_ref = nn.Linear(d, V, bias=False, dtype=torch.float64)
    s = 4 if sp else 5
    ids = torch.randint(0, V, (s, 3))
    ids[0, 0], ids[1, 1] = 3, V - 1  # the padding id and the last id
    target = torch.randint(0, V, (s, 3))
    target[2, 0] = -100
    target[0, 1] = V - 1
    hr = emb_ref(ids)
    loss_ref = F.cross_entropy(head_ref(hr).reshape(-1, V), target.reshape(-1), label_smoothing=smoothing)
    loss_ref.backward()

    emb = VocabParallelEmbedding.from_embedding(emb_ref, group=g, sequence_parallel=sp)
    head = ParallelLMHead.from_linear(head_ref, group=g, sequence_parallel=sp)
    h = emb(ids)
    _close(h, _rows(hr, rank, tp) if sp else hr, "embedding output", torch.float64)
    logits = head(h)
    assert logits.shape[-1] == head.padded_out_features // tp
    loss = vocab_parallel_cross_entropy(logits, target, g, label_smoothing=smoothing, vocab_size=V)
    loss.backward()
    _close(loss, loss_ref, "loss", torch.float64)
    n = emb.num_embeddings_per_rank
    pad_rows = emb.padded_num_embeddings - V
    want_emb = F.pad(emb_ref.weight.grad, (0, 0, 0, pad_rows))[rank * n : (rank + 1) * n]
    _close(emb.weight.grad, want_emb, "embedding grad", torch.float64)
    want_head = F.pad(head_ref.weight.grad, (0, 0, 0, pad_rows))[rank * n : (rank + 1) * n]
    _close(head.weight.grad, want_head, "head grad", torch.float64)
    # gathered logits are the full [.., V] logits (padding dropped)
    head_g = ParallelLMHead.from_linear(head_ref, group=g, gather_output=True)
    _close(head_g(hr), head_ref(hr), "gathered logits", torch.float64)
    # per-token losses and fp32 logits
    per_tok = vocab_parallel_cross_entropy(logits.detach().float(), target, g, vocab_size=V, reduction="none")
    want = F.cross_entropy(head_ref(hr).reshape(-1, V).float(), target.reshape(-1), reduction="none")
    _close(per_tok.reshape(-1), want, "per-token loss fp32", torch.float32)


@pytest.mark.parametrize("world_size", WORLD)
@pytest.mark.parametrize("sp,smoothing", [(False, 0.0), (True, 0.1)])
def test_vocab_parallel_embedding_head_and_cross_entropy(world_size, sp, smoothing):
    run_ranks(_vocab_body, world_size, sp, smoothing)


# ---------------------------------------------------------------- bad inputs raise on every rank, no hang
def _errors_body():
    from torch.distributed.device_mesh import init_device_mesh

    g = dist.group.WORLD
    tp = dist.get_world_size()
    if tp == 4:
        with pytest.raises(ValueError, match="out_features 10 is not divisible by tp=4"):
            ColumnParallelLinear(6, 10, group=g)
    if tp > 1:
        with pytest.raises(ValueError, match=f"in_features 7 is not divisible by tp={tp}"):
            RowParallelLinear(7, 4, group=g)
    col = ColumnParallelLinear(6, 8, group=g)
    with pytest.raises(ValueError, match="does not end in in_features=6"):
        col(torch.randn(3, 5))
    row = RowParallelLinear(8, 6, group=g, sequence_parallel=True)
    with pytest.raises(ValueError, match="does not end in in_features/tp"):
        row(torch.randn(4, 8 // tp + 1))
    if tp > 1:
        with pytest.raises(ValueError, match="dim 0 divisible by tp"):
            row(torch.randn(tp + 1, 8 // tp))
    with pytest.raises(ValueError, match="needs input_is_parallel=True"):
        RowParallelLinear(8, 6, group=g, sequence_parallel=True, input_is_parallel=False)
    with pytest.raises(TypeError, match="group is required"):
        ColumnParallelLinear(6, 8, group=None)
    with pytest.raises(ValueError, match="comm_chunks=0"):
        RowParallelLinear(8, 6, group=g, comm_chunks=0)
    mesh = init_device_mesh("cpu", (1, tp), mesh_dim_names=("dp", "cp"))
    with pytest.raises(ValueError, match="has no 'tp' axis"):
        ColumnParallelLinear(6, 8, group=mesh)
    mesh = init_device_mesh("cpu", (1, tp), mesh_dim_names=("dp", "tp"))
    assert ColumnParallelLinear(6, 8, group=mesh).tp == tp  # a mesh with a tp axis is fine
    logits = torch.randn(5, 4)
    with pytest.raises(ValueError, match="must agree on all but the last"):
        vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long), g)
    with pytest.raises(ValueError, match="outside"):
        vocab_parallel_cross_entropy(logits, torch.full((5,), 4 * tp), g)
    with pytest.raises(TypeError, match="integer"):
        VocabParallelEmbedding(11, 3, group=g)(torch.randn(2))


@pytest.mark.parametrize("world_size", WORLD)
def test_bad_inputs_raise_clear_errors_on_every_rank(world_size):
    run_ranks(_errors_body, world_size)
