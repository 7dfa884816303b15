"""Reused scratch buffers of the gradient reduction (``llmpar.zero.scratch.ScratchPool``) and the ``scratch=`` of
``reduce_scatter_flat``: the same numbers as fresh buffers, no allocation once the first step has run, never more
memory held than the reduction's own peak."""

import pytest
import torch
import torch.distributed as dist
from zero_helpers import engine_micro_steps

from llmpar.distributed.collectives import DIRECT_REDUCE_SCATTER_MIN, reduce_scatter_flat
from llmpar.models import GPT, GPTConfig
from llmpar.zero.scratch import ScratchPool

from multirank import run_ranks


def test_pool_serves_from_the_smallest_free_buffer_that_holds_the_request():
    pool = ScratchPool()
    a, b = pool.take(1000, torch.float32, "cpu"), pool.take(3000, torch.float32, "cpu")
    assert a.shape == (1000,) and b.shape == (3000,) and pool.allocations == 2
    pa, pb = a.data_ptr(), b.data_ptr()
    pool.give(a)
    pool.give(b)
    c = pool.take(900, torch.float32, "cpu")  # both hold it: the smaller one
    assert c.data_ptr() == pa and c.shape == (900,) and c.is_contiguous() and pool.allocations == 2
    d = pool.take(1600, torch.float32, "cpu")  # the 3000 one holds it within twice the size
    assert d.data_ptr() == pb and d.shape == (1600,) and pool.allocations == 2
    e = pool.take(10, torch.bfloat16, "cpu")  # another dtype: a new buffer
    assert e.dtype == torch.bfloat16 and pool.allocations == 3
    pool.take(10, torch.float32, "cpu")  # nothing free: a new buffer
    assert pool.allocations == 4
    pool.give(pool.take(10, torch.float32, "cpu"))
    pool.take(4, torch.float32, "cpu")  # the free 10-element one is more than twice as large: a new buffer
    assert pool.allocations == 6
    pool.give(c)
    pool.give(d)  # the views go back as their whole buffers
    assert pool.free_bytes == 4000 * 4 + 10 * 4 and pool.live_bytes == 10 * 2 + 10 * 4 + 4 * 4


def test_pool_holds_at_most_twice_its_peak_free():
    pool = ScratchPool()
    bufs = [pool.take(n, torch.float32, "cpu") for n in (4000, 2000, 1000)]
    assert pool.peak_bytes == 7000 * 4
    for t in bufs:
        pool.give(t)
    assert pool.live_bytes == 0 and pool.free_bytes == 7000 * 4
    for n in (5000, 6000, 7000):  # taken and given one at a time: the peak stays 7000 elements
        pool.give(pool.take(n, torch.float32, "cpu"))
        assert pool.free_bytes <= 2 * pool.peak_bytes == 2 * 7000 * 4
    # the smallest went first: what is left are the largest, which serve the requests of this size
    sizes = sorted(t.numel() for t in pool._free)
    assert sizes == [6000, 7000], sizes
    before = pool.allocations
    assert pool.take(3000, torch.float32, "cpu").numel() == 3000  # from the 6000 one
    pool.take(3500, torch.float32, "cpu")  # from the 7000 one
    assert pool.allocations == before and pool.free_bytes == 0
    pool.clear()
    assert pool.free_bytes == 0


def test_pool_leaves_non_cpu_memory_to_the_allocator():
    pool = ScratchPool()
    t = pool.take(123, torch.float32, "meta")
    assert t.device.type == "meta" and t.shape == (123,)
    pool.give(t)
    assert pool.allocations == 0 and pool.free_bytes == 0 and pool.live_bytes == 0


def _scratch_body(n):
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(5)
    everyone = [torch.randn(world * n, generator=g, dtype=torch.float64) for _ in range(world)]
    ref = torch.stack(everyone).sum(0)[rank * n : (rank + 1) * n]
    for dtype in (torch.float32, torch.float64):
        x = everyone[rank].to(dtype)
        out, fresh = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        scratch = torch.full(((world - 1) * n + 17,), float("nan"), dtype=dtype)  # larger than needed, dirty
        reduce_scatter_flat(out, x, dist.group.WORLD, scratch=scratch)
        reduce_scatter_flat(fresh, x, dist.group.WORLD)
        assert torch.equal(out, fresh)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        assert torch.allclose(out.double(), ref, rtol=tol, atol=tol)
    errors = []
    x = everyone[rank].float()
    for bad in (
        torch.empty((world - 1) * n - 1),
        torch.empty((world - 1) * n, dtype=torch.float64),
        torch.empty(2 * (world - 1) * n)[::2],
    ):
        with pytest.raises(ValueError, match="scratch") as err:
            reduce_scatter_flat(torch.empty(n), x, dist.group.WORLD, scratch=bad)
        errors.append(str(err.value))
    dist.barrier()  # nothing was left in flight by the refused calls
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_into_scratch_equals_a_fresh_buffer(world):
    n = DIRECT_REDUCE_SCATTER_MIN // world + 7  # the point-to-point path, odd length
    results = run_ranks(_scratch_body, world, n)
    assert all(len(r) == 3 for r in results)
    assert "at least (group size - 1) x output" in results[0][0]


def _zero_body(stage, pooled, dtype):
    import llmpar

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, n_layer=2, n_head=2, d_model=256, seq_len=9)).to(dtype)
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.7,
        "steps_per_print": 10**9,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        # units large enough for the point-to-point path, several of them
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 3 * DIRECT_REDUCE_SCATTER_MIN,
            "allgather_bucket_size": 10**6,
        },
    }
    engine, opt, _, _ = llmpar.initialize(model=model, config=cfg)
    units = opt.buffers[0].layout.units
    assert len(units) >= 2 and max(u.padded for u in units) >= DIRECT_REDUCE_SCATTER_MIN or stage == 3
    if not pooled:
        opt.reducer.pool = ScratchPool(reuse=False)  # what the reduction did before: a fresh buffer every time
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, allocations = [], []
    for _ in range(4):
        losses += engine_micro_steps(engine, model, g)
        allocations.append(opt.reducer.pool.allocations)
        if stage == 3:
            assert opt.reducer.pool.free_bytes == 0  # stage 3 holds nothing between steps
    with llmpar.zero.GatheredParameters(list(model.parameters())):  # stage 3: sharded params are read gathered
        params = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    peak = opt.reducer.pool.peak_bytes if pooled else 0
    elt = torch.finfo(dtype).bits // 8
    # what one step needs at once: stage 2 its staging + received chunks (``staging_peak`` counts both), stage 1 a
    # landing buffer + the received chunks per unit, at most the whole accumulator
    bound = elt * (opt.reducer.staging_peak if stage == 2 else sum(b.layout.total for b in opt.buffers))
    return losses, params, allocations, peak, bound


@pytest.mark.parametrize("stage,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_zero_reduction_reuses_its_buffers(stage, dtype):
    pooled = run_ranks(_zero_body, 2, stage, True, dtype)
    fresh = run_ranks(_zero_body, 2, stage, False, dtype)
    for (l0, p0, a0, peak, bound), (l1, p1, a1, _, _) in zip(pooled, fresh):
        assert l0 == l1 and torch.equal(p0, p1)  # bitwise the same training
        assert a0[0] > 0 and a0[-1] == a0[0], f"allocations after each step {a0}: none once the first step ran"
        assert a1 == [a1[0] * k for k in (1, 2, 3, 4)] and a1[0] > 0
        assert 0 < peak <= 2 * bound, (peak, bound)  # a buffer serves requests down to half its size


def test_zero3_holds_no_scratch_between_steps():
    pooled = run_ranks(_zero_body, 2, 3, True, torch.float32)
    fresh = run_ranks(_zero_body, 2, 3, False, torch.float32)
    for (l0, p0, a0, _, _), (l1, p1, _, _, _) in zip(pooled, fresh):
        assert l0 == l1 and torch.equal(p0, p1)
        assert a0 == [a0[0] * k for k in (1, 2, 3, 4)] and a0[0] > 0  # allocated anew every step
