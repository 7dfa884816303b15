"""ZeRO stages 0/1/2 on CPU/gloo ranks == single-process FusedAdamW on the concatenated batch.

The model has odd-sized params that straddle unit and shard boundaries (tiny reduce buckets), a frozen param, an unused
param (ZeRO, like DeepSpeed, gives it a zero gradient; the reference does the same), two param groups (no weight decay
on vectors) and gradient clipping. float64 runs match to float32-rounded clip coefficients (~1e-9); bf16 runs to the
bf16 tolerance.
"""

import pytest
import torch
import torch.distributed as dist
from zero_helpers import reference_loop, zero_loop

from llmpar.zero import FlatLayout, OptimizerConfig, ZeroConfig, ZeroOptimizer

from multirank import run_ranks

MICRO = 3  # samples per rank per micro-step
STEPS = 4


class Net(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(7, 13)
        self.frozen = torch.nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.b = torch.nn.Linear(13, 5)
        self.unused = torch.nn.Parameter(torch.randn(11))
        self.to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.frozen(torch.tanh(self.a(x)))))


def _groups(net):
    named = [(n, p) for n, p in net.named_parameters()]
    return [
        {"params": [(n, p) for n, p in named if p.dim() >= 2]},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def _batch(step, micro, n, dtype):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(n, 7, generator=g, dtype=torch.float64)
    y = torch.randn(n, 5, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def _loss(net, x, y):
    return ((net(x) - y) ** 2).mean()


def _flat(net):
    return torch.cat([p.detach().double().flatten() for p in net.parameters()])


def reference(dtype, world, gas, clip=0.5, steps=STEPS):
    net = Net(dtype)
    losses = reference_loop(net, _groups(net), steps, gas, lambda s, m: _batch(s, m, MICRO * world, dtype), _loss, clip)
    return losses, _flat(net)


def zero_body(stage, dtype, gas, bucket, overlap, clip=0.5, steps=STEPS, offload=False):
    world = dist.get_world_size()
    net = Net(dtype)
    opt = ZeroOptimizer(
        _groups(net),
        OptimizerConfig(lr=2e-2, weight_decay=0.1),
        dist.group.WORLD,
        zero_config=ZeroConfig(
            stage=stage,
            reduce_bucket_size=bucket,
            overlap_comm=overlap,
            allgather_bucket_size=bucket,
            offload_optimizer={"device": "cpu" if offload else "none"},
        ),
        max_grad_norm=clip,
        grad_accum_dtype=torch.float32 if dtype != torch.float64 and gas > 1 else None,
    )
    losses = zero_loop(opt, net, steps, gas, lambda s, m: _batch(s, m, MICRO * world, dtype), _loss, MICRO)
    frozen_same = torch.equal(net.frozen.weight, Net(dtype).frozen.weight)
    return losses, _flat(net), frozen_same, opt.memory_bytes()


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_stages_match_single_process_fp64(stage, world):
    gas = 2 if world == 2 else 1
    ref_losses, ref_params = reference(torch.float64, world, gas)
    outs = run_ranks(zero_body, world, stage, torch.float64, gas, 37, world == 2, timeout=90)
    for rank, (losses, params, frozen_same, _) in enumerate(outs):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-9, atol=1e-12, msg=f"rank {rank} losses"
        )
        torch.testing.assert_close(params, ref_params, rtol=1e-7, atol=1e-9, msg=f"rank {rank} params")
        assert frozen_same
        assert torch.equal(params, outs[0][1]), "dp ranks drifted apart"
    assert not torch.allclose(ref_params, _flat(Net(torch.float64)))


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_fp32_master_matches_within_bf16_tolerance(stage):
    ref_losses, ref_params = reference(torch.bfloat16, 2, 2, steps=3)
    outs = run_ranks(zero_body, 2, stage, torch.bfloat16, 2, 64, True, steps=3, timeout=90)
    losses, params, _, mem = outs[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(params, ref_params, rtol=2e-2, atol=2e-2)
    assert torch.equal(params, outs[1][1])
    assert mem["grads"] % 4 == 0  # fp32 accumulation buffer under accumulation


@pytest.mark.parametrize("world, gas, overlap", [(2, 2, True), (2, 1, False), (4, 2, False)])
def test_stage1_offload_optimizer_matches_stage1(world, gas, overlap):
    """ZeRO-1 + offload_optimizer (DeepSpeed accepts it; ``llmpar plan`` recommends it): the accumulator stays on the
    device, the reduced partition is copied to the host at the boundary and stepped there; same training as stage 1
    (and as one process)."""
    ref_losses, ref_params = reference(torch.float64, world, gas)
    plain = run_ranks(zero_body, world, 1, torch.float64, gas, 37, overlap, timeout=90)
    off = run_ranks(zero_body, world, 1, torch.float64, gas, 37, overlap, offload=True, timeout=90)
    for rank, ((losses, params, frozen_same, mem), (want_l, want_p, _, mem0)) in enumerate(zip(off, plain)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_l), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(params, want_p, rtol=1e-12, atol=1e-14, msg=f"rank {rank} params")
        torch.testing.assert_close(params, ref_params, rtol=1e-7, atol=1e-9)
        assert frozen_same
        # the device keeps the params and the whole-model accumulator; master, moments and the reduced gradient
        # partition (float64 here: the host steps in the master dtype) live on the host
        total = mem0["grads"]
        assert mem["device"] == mem["params"] + total
        assert mem["host"] == mem["master"] + mem["optimizer_state"] + total // world
        assert mem["optimizer_state"] == mem0["optimizer_state"] == 2 * mem["master"]  # (+ a master copy on the host)
    torch.testing.assert_close(torch.tensor(off[0][0]), torch.tensor(ref_losses), rtol=1e-9, atol=1e-12)


def test_stage1_offload_optimizer_bf16():
    ref_losses, ref_params = reference(torch.bfloat16, 2, 2, steps=3)
    outs = run_ranks(zero_body, 2, 1, torch.bfloat16, 2, 64, True, steps=3, offload=True, timeout=90)
    losses, params, _, mem = outs[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(params, ref_params, rtol=2e-2, atol=2e-2)
    assert torch.equal(params, outs[1][1])
    # what the planner's model_state_bytes(zero_stage=1, offload="optimizer") counts: bf16 params and the whole
    # accumulator (fp32 here, under accumulation) on the device; fp32 master, moments and grad partition (16/N) host
    total = mem["params"] // 2
    assert mem["device"] == 2 * total + 4 * total and mem["host"] == 16 * total // 2


def test_layout_units_shards_and_slices():
    ps = [torch.empty(s) for s in (5, 123, 1, 40, 97)]
    lay = FlatLayout(ps, [f"p{i}" for i in range(5)], shards=4, unit_numel=100, align=2)
    assert sum(u.numel for u in lay.units) == lay.numel == 266
    for u in lay.units:
        assert u.padded % 8 == 0 and u.padded >= u.numel and u.padded - u.numel < 8
    assert lay.partition * 4 == lay.total
    # units follow reverse registration order, whole params each
    assert lay.units[0].params[0] == 4
    flat = torch.arange(lay.total, dtype=torch.float64)
    # every element of every param is in exactly one rank's shard, at the place param_slices says
    seen = {i: torch.zeros(p.numel(), dtype=torch.int64) for i, p in enumerate(ps)}
    for u in range(len(lay.units)):
        for r in range(4):
            shard = lay.shard_of_full(flat, u, r)
            for i, a, b, at in lay.param_slices(u, r):
                seen[i][a:b] += 1
                assert torch.equal(shard[at : at + b - a], lay.param_view(flat, i).flatten()[a:b])
    assert all(bool((v == 1).all()) for v in seen.values())
    desc = lay.describe()
    assert desc["params"][1]["shape"] == [123] and desc["total"] == lay.total


def test_bad_arguments_raise_clearly():
    net = Net(torch.float32)
    with pytest.raises(TypeError, match="dp_group is required"):
        ZeroOptimizer(net.parameters(), None, None)
    with pytest.raises(TypeError, match="needs module="):
        ZeroOptimizer(net.parameters(), None, None, stage=3)
    with pytest.raises(ValueError, match="must be 0, 1, 2 or 3"):
        ZeroOptimizer(net.parameters(), None, None, stage=4)
    with pytest.raises(ValueError, match="params is empty"):
        ZeroOptimizer([], None, object())


def test_the_stage_has_one_source():
    """zero_config carries the stage: given alone it decides (stage 3 asks for module=; it used to be refused as
    disagreeing with the default stage=2); stage= is its shorthand without one; both given: a different stage= is an
    error naming both, an equal one a FutureWarning."""
    net = Net(torch.float32)
    with pytest.raises(TypeError, match="needs module="):
        ZeroOptimizer(net.parameters(), None, None, zero_config=ZeroConfig(stage=3))
    with pytest.raises(ValueError, match=r"stage=1 disagrees with zero_config.stage=3"):
        ZeroOptimizer(net.parameters(), None, None, stage=1, zero_config=ZeroConfig(stage=3))
    with pytest.warns(FutureWarning, match="zero_config alone"), pytest.raises(TypeError, match="needs module="):
        ZeroOptimizer(net.parameters(), None, None, stage=3, zero_config=ZeroConfig(stage=3))
    with pytest.raises(TypeError, match="zero_config must be a ZeroConfig or None, got dict"):
        ZeroOptimizer(net.parameters(), None, None, zero_config={"stage": 3})
    assert ZeroConfig.resolve(None, None, default_stage=1).stage == 1
    assert ZeroConfig.resolve(0, None, default_stage=2).stage == 0
    given = ZeroConfig(stage=3, reduce_bucket_size=99)
    assert ZeroConfig.resolve(None, given, default_stage=2) is given


def mismatch_body():
    torch.manual_seed(0)
    size = 5 + dist.get_rank()
    net = torch.nn.Linear(size, 3)
    ZeroOptimizer(net.parameters(), None, dist.group.WORLD, stage=2)


def test_ranks_with_different_models_fail_on_every_rank():
    from multirank import RankFailure

    with pytest.raises(RankFailure, match="hold different models") as info:
        run_ranks(mismatch_body, 2, timeout=30)
    assert "rank 0 traceback" in str(info.value) and "rank 1 traceback" in str(info.value)


def nonfinite_body(stage):
    net = Net(torch.float32)
    before = _flat(net)
    opt = ZeroOptimizer(_groups(net), None, dist.group.WORLD, stage=stage, max_grad_norm=1.0)
    x, y = _batch(0, 0, MICRO, torch.float32)
    if dist.get_rank() == 1:
        x[0, 0] = float("inf")
    _loss(net, x, y).backward()
    applied = opt.step()
    return applied, torch.equal(before, _flat(net)), opt.skipped_steps


@pytest.mark.parametrize("stage", [1, 2])
def test_nonfinite_grad_on_one_rank_skips_the_step_everywhere(stage):
    for applied, unchanged, skipped in run_ranks(nonfinite_body, 2, stage, timeout=60):
        assert not applied and unchanged and skipped == 1


def exchange_body():
    from llmpar.distributed.collectives import CommCounter, reduce_scatter_flat, reduce_scatter_uses_exchange

    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(world * 37, generator=g, dtype=torch.float64)
    out = {}
    for async_op in (False, True):
        counter, o = CommCounter(), torch.full((37,), float("nan"), dtype=torch.float64)
        h = reduce_scatter_flat(o, x, dist.group.WORLD, async_op=async_op, counter=counter)
        if h is not None:
            h.wait()
        out[async_op] = (o, dict(counter.volume), dict(counter.bytes_sent))
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)
    want = torch.stack(everyone).sum(0)[rank * 37 : (rank + 1) * 37]
    return out, want, reduce_scatter_uses_exchange(dist.group.WORLD)


def test_reduce_scatter_by_exchange_equals_reduce_scatter():
    """gloo: llmpar.distributed's reduce-scatter runs as an all-to-all + local sum (ZeRO's hot path), gives the
    reduce-scatter's result and is counted as the reduce-scatter it is."""
    for out, want, exchange in run_ranks(exchange_body, 3, timeout=60):  # odd world, odd chunk
        assert exchange
        for o, vol, sent in out.values():
            torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)
            assert vol == {"reduce_scatter": 3 * 37} and sent == {"reduce_scatter": pytest.approx(2 * 37 * 8)}
