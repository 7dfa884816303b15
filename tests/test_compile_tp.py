"""torch.compile over the tensor-, context- and expert-parallel layers on 2 CPU ranks (gloo).

One 2-rank job loops over the cases (the suite's budget): each builds a block, runs it eagerly, then compiled
(``backend="aot_eager"``: what dynamo and AOT autograd make of it, without a C++ compile), and checks

* the graph breaks dynamo counted (``torch._dynamo.utils.counters["graph_break"]``): 0, or the exact number a case
  documents;
* forward output and every gradient (input and parameters) equal to eager's at 1e-6 in float32, and eager's equal to a
  single-device float64 reference where the block has one.

Under compile the collectives are functional collectives in autograd Functions whose ``ctx`` holds a group name
(``llmpar.tensor_parallel._traceable``, ``llmpar.distributed.funcol``).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from multirank import run_ranks

TOL = dict(rtol=1e-6, atol=1e-6)


def _breaks() -> dict:
    from torch._dynamo.utils import counters

    return {reason.split("\n")[0][:200]: n for reason, n in counters["graph_break"].items()}


def _fwd_bwd(fn, inputs, params, grad_out):
    """(output, [grads of the float inputs and params]) of ``fn(*inputs)`` with ``(out * grad_out).sum()`` as loss."""
    for p in params:
        p.grad = None
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*xs)
    (out * grad_out).sum().backward() if grad_out is not None else out.backward()
    grads = [x.grad for x in xs if x.is_floating_point()] + [p.grad for p in params]
    return out.detach(), [g.clone() for g in grads]


def _compare(name: str, fn, inputs, params, grad_out=None, *, breaks: int = 0, only: str = "", reference=None):
    """Eager vs ``torch.compile(fn, backend="aot_eager")``: outputs and gradients at 1e-6, exactly ``breaks`` graph
    breaks, each naming ``only``; ``reference``: (output, grads) of a float64 single-device run the eager one must
    match."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    want = _fwd_bwd(fn, inputs, params, grad_out)
    if reference is not None:
        ref_out, ref_grads = reference
        torch.testing.assert_close(want[0].double(), ref_out, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for i, (a, b) in enumerate(zip(want[1], ref_grads)):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} grad {i}: {m}")
    compiled = torch.compile(fn, backend="aot_eager")
    graphs = []
    for _ in range(2):  # the second call runs the cached graphs (no recompile, same numbers)
        got = _fwd_bwd(compiled, inputs, params, grad_out)
        graphs.append(counters["stats"]["unique_graphs"])
        seen = _breaks()
        assert sum(seen.values()) == breaks, f"{name}: {sum(seen.values())} graph breaks, expected {breaks}: {seen}"
        assert all(only in reason for reason in counters["graph_break"]), f"{name}: a break elsewhere than {only}"
        torch.testing.assert_close(got[0], want[0], **TOL, msg=lambda m: f"{name} output: {m}")
        assert len(got[1]) == len(want[1])
        for i, (a, b) in enumerate(zip(got[1], want[1])):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name} grad {i}: {m}")
    assert graphs[0] == graphs[1] >= 1, f"{name}: graphs after the first and the second call: {graphs}"
    return compiled


# ---------------------------------------------------------------- tensor parallel
def _regions_case() -> None:
    """The seven region wrappers of tensor_parallel.comm in one compiled function, the group a 1-D DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from llmpar.tensor_parallel import comm

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(2)
    x = torch.randn(6, 3, 4)  # [s, b, h], the same on every rank
    w = torch.randn(3, 3, 4)

    def regions(x):
        y = comm.gather_from_tensor_region(torch.sin(comm.scatter_to_tensor_region(x, mesh)), mesh)  # [6, 3, 4]
        y = comm.gather_from_sequence_region(comm.scatter_to_sequence_region(y, mesh) * 3, mesh, grad_is_partial=False)
        y = comm.reduce_from_tensor_region(torch.cos(comm.copy_to_tensor_region(y, mesh)), mesh)
        return comm.reduce_scatter_to_sequence_region(y * x, mesh)  # [3, 3, 4]

    _compare("tp=2 comm regions", regions, [x], [], w)


def _mlp_case(sp: bool) -> None:
    from llmpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    g = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(3)
    d, hidden = 6, 10
    ref_fc, ref_proj = nn.Linear(d, hidden, dtype=torch.float64), nn.Linear(hidden, d, dtype=torch.float64)
    full = torch.randn(5 * tp, 3, d, dtype=torch.float64)  # [s, b, d], s = 5 tokens per rank
    w_full = torch.randn(5 * tp, 3, d, dtype=torch.float64)
    fc = ColumnParallelLinear.from_linear(ref_fc.float(), group=g, sequence_parallel=sp, comm_chunks=2)
    proj = RowParallelLinear.from_linear(ref_proj.float(), group=g, sequence_parallel=sp, comm_chunks=2)
    ref_fc.double(), ref_proj.double()

    xr = full.clone().requires_grad_()
    ref_out = ref_proj(F.gelu(ref_fc(xr)))
    (ref_out * w_full).sum().backward()
    rows = slice(rank * 5, (rank + 1) * 5)
    ref_w1 = ref_fc.weight.grad[rank * hidden // tp : (rank + 1) * hidden // tp]
    ref_b1 = ref_fc.bias.grad[rank * hidden // tp : (rank + 1) * hidden // tp]
    ref_w2 = ref_proj.weight.grad[:, rank * hidden // tp : (rank + 1) * hidden // tp]
    x, w_out = (full[rows], w_full[rows]) if sp else (full, w_full)
    ref_x = xr.grad[rows] if sp else xr.grad
    ref = ((ref_out[rows] if sp else ref_out).detach(), [ref_x, ref_w1, ref_b1, ref_w2, ref_proj.bias.grad])

    def block(x):
        return proj(F.gelu(fc(x)))

    params = [fc.weight, fc.bias, proj.weight, proj.bias]
    _compare(f"tp={tp} MLP sp={sp}", block, [x.float()], params, w_out.float(), reference=ref)


def _vocab_case() -> None:
    from llmpar.tensor_parallel import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_cross_entropy

    g = dist.group.WORLD
    torch.manual_seed(5)
    vocab, d = 13, 6  # 13 rows: the vocabulary is padded to a multiple of tp, -inf logits on the padding
    ref_emb, ref_head = nn.Embedding(vocab, d, dtype=torch.float64), nn.Linear(d, vocab, dtype=torch.float64)
    emb = VocabParallelEmbedding.from_embedding(ref_emb.float(), group=g)
    head = ParallelLMHead.from_linear(ref_head.float(), group=g)
    ref_emb.double(), ref_head.double()
    ids = torch.randint(0, vocab, (3, 7))
    target = torch.randint(0, vocab, (3, 7))
    target[0, 2] = -100

    def model(ids):
        return vocab_parallel_cross_entropy(head(torch.tanh(emb(ids))), target, g, label_smoothing=0.1)

    ref_loss = F.cross_entropy(ref_head(torch.tanh(ref_emb(ids))).flatten(0, 1), target.flatten(), label_smoothing=0.1)
    ref_loss.backward()
    tp, rank = dist.get_world_size(), dist.get_rank()
    per = -(-vocab // tp)
    lo, hi = rank * per, min((rank + 1) * per, vocab)
    pad = per - (hi - lo)
    ref_grads = [F.pad(ref_emb.weight.grad[lo:hi], (0, 0, 0, pad)), F.pad(ref_head.weight.grad[lo:hi], (0, 0, 0, pad))]
    ref_grads.append(F.pad(ref_head.bias.grad[lo:hi], (0, pad)))
    params = [emb.weight, head.weight, head.bias]
    compiled = _compare(f"tp={tp} embedding + cross-entropy", model, [ids], params, reference=(ref_loss, ref_grads))
    bad = ids.clone()
    bad[1, 1] = vocab + 4 if rank == tp - 1 else bad[1, 1]  # one rank's id outside the vocabulary: both ranks fail
    try:
        compiled(bad)
    except RuntimeError as err:  # the traced check is the device-side assert (a RuntimeError on CPU)
        assert "token ids outside [0, 13)" in str(err), str(err)
    else:
        raise AssertionError("an id outside the vocabulary passed a compiled VocabParallelEmbedding")


def _gpt_case() -> None:
    """The demo GPT through ``parallelize`` (sequence parallel: its pre-hooks, the tp gradient hooks of the norms)."""
    from torch.distributed.device_mesh import init_device_mesh

    from llmpar.models import GPT, GPTConfig
    from llmpar.tensor_parallel import parallelize

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=4, d_model=16, seq_len=12), seed=1)
    parallelize(model, mesh, sequence_parallel=True)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    w = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(4))  # d loss / d logits (gathered vocab)
    _compare("tp=2 sp GPT", model, [ids], list(model.parameters()), w)


# ---------------------------------------------------------------- context parallel
def _cp_case(mode: str, seq_len: int) -> None:
    from llmpar.context_parallel import ContextParallel, shard_tensor

    g = dist.group.WORLD
    cp = ContextParallel(mode, **{("ring_group" if mode == "ring" else "ulysses_group"): g})
    shard = cp.shard(seq_len)
    torch.manual_seed(7)
    q, k, v, w = (torch.randn(2, 4, seq_len, 6, dtype=torch.float64) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    (ref * w).sum().backward()
    local = [shard_tensor(t, shard, dim=2) for t in (q, k, v, w, ref.detach(), qr.grad, kr.grad, vr.grad)]

    def attend(q, k, v):
        return cp.attention(q, k, v, shard=shard)

    inputs = [t.float() for t in local[:3]]
    _compare(f"cp=2 {mode} attention", attend, inputs, [], local[3].float(), reference=(local[4], local[5:]))
    if mode == "ring":  # the ring's torch.library op: schema, fake implementation, autograd registration
        positions = cp._positions(seq_len, q.device)[0]
        name = cp.ring_group.name
        args = tuple([t.clone().requires_grad_() for t in inputs] + [None, positions, name, seq_len, True, 6**-0.5])
        checks = ("test_schema", "test_autograd_registration", "test_faketensor")  # traced: _compare above
        torch.library.opcheck(torch.ops.llmpar.ring_attention_fwd.default, args, test_utils=checks)


# ---------------------------------------------------------------- expert parallel
# the split sizes are data: the count exchange is a functional all-to-all, the checks and the token exchange
# llmpar:: ops that read the counts when they run (llmpar::moe_exchange_splits, llmpar::all_to_all_v), the received
# rows an unbacked size (torch lets an op return one only with capture_dynamic_output_shape_ops on): no graph break,
# and a routing change recompiles nothing.
DYNAMIC_ROWS = dict(capture_dynamic_output_shape_ops=True)
MOE_STEPS = 10


@torch._dynamo.config.patch(**DYNAMIC_ROWS)
def _moe_case() -> None:
    from llmpar.moe.alltoall import AllToAllDispatcher
    from llmpar.moe.router import Router
    from llmpar.ops import grouped_mm

    g = dist.group.WORLD
    ep, rank = dist.get_world_size(), dist.get_rank()
    E, H, k, T = 2 * ep, 6, 2, 9
    torch.manual_seed(9)
    router = Router(H, E, k)
    experts = torch.randn(E, H, H, dtype=torch.float64) / H**0.5
    mine = nn.Parameter(experts[rank * 2 : rank * 2 + 2].float())
    xs = [torch.randn(T, H, dtype=torch.float64) for _ in range(ep)]  # every rank's tokens (its own: xs[rank])
    ws = [torch.randn(T, H, dtype=torch.float64) for _ in range(ep)]
    dispatcher = AllToAllDispatcher(E, g)

    def moe(x):
        x_local, counts, meta = dispatcher.dispatch(x, router(x))
        return dispatcher.combine(torch.tanh(grouped_mm(x_local, mine, counts=counts)), meta)

    # float64 single device: every rank's tokens through all E experts, k picks weighed as routed
    ref_router = Router(H, E, k, dtype=torch.float64)
    with torch.no_grad():
        ref_router.weight.copy_(router.weight)
    ref_experts = experts.clone().requires_grad_()
    for r in range(ep):
        xr = xs[r].clone().requires_grad_()
        ref_router.weight.grad = None  # each rank's router sees its own tokens only
        routing = ref_router(xr)
        picked = torch.tanh(torch.einsum("th,tjhd->tjd", xr, ref_experts[routing.indices]))
        out = (routing.weights.unsqueeze(-1) * picked).sum(1)
        (out * ws[r]).sum().backward()
        if r == rank:
            ref = (out.detach(), [xr.grad, ref_router.weight.grad.clone()])
    ref[1].append(ref_experts.grad[rank * 2 : rank * 2 + 2])
    params = [router.weight, mine]
    _compare(
        f"ep={ep} MoE all-to-all",
        moe,
        [xs[rank].float()],
        params,
        ws[rank].float(),
        reference=ref,
    )
    # the ops the traced dispatch holds: schema, autograd registration, fake impl (an unbacked row count)
    name = g.group_name
    send, recv = (
        (torch.tensor([1, 2]), torch.tensor([1, 3])) if rank == 0 else (torch.tensor([3, 0]), torch.tensor([2, 0]))
    )
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    x = torch.randn(int(send.sum()), 3, requires_grad=True)
    torch.library.opcheck(torch.ops.llmpar.all_to_all_v.default, (x, send, recv, name, None), test_utils=checks)
    table = torch.cat([send.view(2, 1), torch.zeros(2, 2, dtype=torch.int64)], dim=1)  # [ep, E_l + 2], E_l = 1
    torch.library.opcheck(
        torch.ops.llmpar.moe_exchange_splits.default, (table, table, torch.tensor(0), 5, name), test_utils=checks
    )


def _moe_training_case() -> None:
    """An ep=2 MoEBlock compiled with ``fullgraph=True`` (no config flag) trains MOE_STEPS SGD steps on fresh tokens
    (the routing changes every step; the per-rank token counts differ; on the last rank 1 receives no row) equal to
    its eager twin at 1e-6, with no graph break and no graph after the first step."""
    from torch._dynamo.utils import counters

    from llmpar.moe import MoEBlock

    rank = dist.get_rank()
    torch._dynamo.reset()
    counters.clear()
    blocks = []
    for _ in range(2):
        torch.manual_seed(3)
        blocks.append(MoEBlock(6, 10, 4, 2, ep_group=dist.group.WORLD, init_std=0.2))
    eager, model = blocks
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # unbacked sizes allowed (no flag needed)
    opts = [torch.optim.SGD(b.parameters(), lr=0.05) for b in blocks]
    gen = torch.Generator().manual_seed(100 + rank)
    graphs, routed = [], set()
    for step in range(MOE_STEPS):
        x = torch.randn(1 + rank, 5, 6, generator=gen)
        if step == MOE_STEPS - 1:  # the last step: no token picks rank 1's experts (it receives zero rows)
            x = x.abs()
            with torch.no_grad():
                for block in blocks:
                    block.router.weight[2:] = -1.0
        for fn, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            out = fn(x)
            out.square().sum().backward()
            opt.step()
            if fn is compiled:
                got = out.detach()
            else:
                want = out.detach()
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"ep=2 MoEBlock step {step}: {m}")
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"ep=2 MoEBlock step {step} {name}: {m}")
        routed_last = model.stats.received.tolist()
        routed.add(tuple(routed_last))
        graphs.append(counters["stats"]["unique_graphs"])
    assert routed_last == [0, 0] or rank == 0, f"rank 1 received {routed_last} rows on the last step"
    assert _breaks() == {}, f"ep=2 MoEBlock: graph breaks {_breaks()}"
    assert len(routed) > 1, f"the routing never changed: {routed}"
    assert graphs == [graphs[0]] * MOE_STEPS, f"ep=2 MoEBlock: graphs after each step {graphs} (a recompile)"
    assert sum(counters["recompiles"].values()) == 0, f"ep=2 MoEBlock recompiled: {dict(counters['recompiles'])}"
    # a NaN token on rank 1: refused inside the compiled graph (llmpar::moe_exchange_splits) on both ranks, as eagerly
    x = torch.randn(1 + rank, 5, 6, generator=gen)
    x[0, 0, 0] = float("nan") if rank == 1 else x[0, 0, 0]
    want = (
        "non-finite logits .* for 1 of 10 tokens on expert-parallel rank 1" if rank else "rank 1 .* failed: its router"
    )
    try:
        compiled(x)
    except ValueError as err:
        assert re.search(want, str(err)), f"rank {rank}: {err}"
    else:
        raise AssertionError(f"rank {rank}: a NaN routing on rank 1 was not refused under compile")


def _body() -> None:
    _regions_case()
    _mlp_case(sp=False)
    _mlp_case(sp=True)
    _vocab_case()
    _gpt_case()
    _cp_case("ulysses", 10)
    _cp_case("ring", 12)
    _moe_case()
    _moe_training_case()


def test_compile_tp_cp_ep_no_graph_breaks():
    """TP regions, MLP (plain and sequence parallel), vocab-parallel embedding + loss, a parallelized GPT, cp=2
    Ulysses and ring attention, the ep=2 MoE all-to-all dispatcher: compiled with no graph break; an ep=2 MoEBlock
    trains 10 steps of changing routing compiled with no recompile; all equal to eager (fp32, 1e-6), eager to a
    float64 single-device reference where built."""
    run_ranks(_body, 2, timeout=300)
