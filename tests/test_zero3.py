"""ZeRO stage 3 on CPU/gloo ranks == single-process FusedAdamW (and == stage 2), with and without CPU offload.

The ``test_zero`` Net (odd shapes straddling shards, a frozen param, an unused param on the root unit, two param groups,
clipping, gradient accumulation) plus a Linear used twice in one forward. float64 runs match the reference to ~1e-9.
GPT runs cover tied embeddings and tp=2 x dp=2 through ``llmpar.initialize``.
"""

import pytest
import torch
import torch.distributed as dist
from test_zero import MICRO, Net, _batch, _groups
from zero_helpers import reference_loop, zero_loop

from llmpar.zero import OptimizerConfig, ZeroConfig, ZeroOptimizer, consolidated_state_dict

from multirank import run_ranks

STEPS = 4
GAS = 2


class Net3(Net):
    """Net with ``twice`` applied two times in one forward (its grads add up across the two uses)."""

    def __init__(self, dtype):
        super().__init__(dtype)
        torch.manual_seed(1)
        self.twice = torch.nn.Linear(5, 5).to(dtype)

    def forward(self, x):
        return self.twice(torch.tanh(self.twice(super().forward(x))))


def _loss(net, x, y):
    return ((net(x) - y) ** 2).mean()


def reference(dtype, world, steps=STEPS):
    net = Net3(dtype)
    losses = reference_loop(net, _groups(net), steps, GAS, lambda s, m: _batch(s, m, MICRO * world, dtype), _loss, 0.5)
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def zero3_body(dtype, offload_opt, offload_param, prefetch, steps=STEPS, stage=3):
    world = dist.get_world_size()
    net = Net3(dtype)
    zc = ZeroConfig(
        stage=stage,
        reduce_bucket_size=37,
        overlap_comm=True,
        stage3_param_persistence_threshold=20,
        stage3_prefetch_bucket_size=prefetch,
        offload_optimizer={"device": "cpu" if offload_opt else "none"},
        offload_param={"device": "cpu" if offload_param else "none"},
    )
    opt = ZeroOptimizer(
        _groups(net),
        OptimizerConfig(lr=2e-2, weight_decay=0.1),
        dist.group.WORLD,
        zero_config=zc,
        max_grad_norm=0.5,
        module=net,
        grad_accum_dtype=torch.float32 if dtype != torch.float64 else None,
    )
    losses = zero_loop(opt, net, steps, GAS, lambda s, m: _batch(s, m, MICRO * world, dtype), _loss, MICRO)
    full = consolidated_state_dict(net, opt, rank0_only=False)
    live = opt.stage3.live_numel if opt.stage3 is not None else None
    persistent = sum(opt.stage3._numel(k) for k in opt.stage3.persistent) if opt.stage3 is not None else None
    sharded = {n: p.untyped_storage().nbytes() for n, p in net.named_parameters()}
    return losses, full, live, persistent, sharded, dict(opt.placement.where), opt.memory_bytes()


def _check(outs, ref_losses, ref_params, rtol, atol):
    for rank, (losses, full, *_rest) in enumerate(outs):
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(ref_losses),
            rtol=rtol,
            atol=atol,
            msg=lambda m: f"rank {rank} losses: {m}",
        )
        for n, want in ref_params.items():
            torch.testing.assert_close(
                full[n].double(),
                want.double(),
                rtol=rtol * 100,
                atol=atol * 100,
                msg=lambda m: f"rank {rank} param {n}: {m}",
            )


@pytest.mark.parametrize(
    "world, offload_opt, offload_param, prefetch",
    [
        (2, False, False, 0),
        (2, False, False, 10_000),
        (4, False, False, 10_000),
        (2, True, False, 10_000),
        (4, True, True, 10_000),
    ],
)
def test_stage3_matches_single_process_fp64(world, offload_opt, offload_param, prefetch):
    ref_losses, ref_params = reference(torch.float64, world)
    outs = run_ranks(zero3_body, world, torch.float64, offload_opt, offload_param, prefetch, timeout=90)
    _check(outs, ref_losses, ref_params, rtol=1e-9, atol=1e-11)
    losses, full, live, persistent, sharded, where, mem = outs[0]
    assert live == persistent  # after a step only the persistent (small) units stay gathered
    assert sharded["a.weight"] == 0 and sharded["twice.weight"] == 0  # freed between uses (> 20 elements)
    assert sharded["b.bias"] > 0  # 5 elements: below stage3_param_persistence_threshold, kept whole
    assert sharded["a.bias"] > 0  # 13 elements: kept whole although its module's weight (91) is sharded (per param)
    assert sharded["frozen.weight"] == 0 and sharded["frozen.bias"] > 0  # frozen params: the same rule
    assert where["params"] == ("host" if offload_param else "device")
    assert where["master"] == where["grads"] == where["optimizer_state"] == ("host" if offload_opt else "device")
    if offload_opt and offload_param:
        assert mem["device"] == mem["persistent"]  # the device pool holds only the gathered units
    assert not torch.allclose(ref_params["a.weight"], Net3(torch.float64).a.weight.double())


def test_stage3_equals_stage2_bf16_with_offload():
    ref_losses, ref_params = reference(torch.bfloat16, 2, steps=3)
    s2 = run_ranks(zero3_body, 2, torch.bfloat16, False, False, 0, steps=3, stage=2, timeout=90)
    s3 = run_ranks(zero3_body, 2, torch.bfloat16, True, True, 10_000, steps=3, timeout=90)
    torch.testing.assert_close(torch.tensor(s3[0][0]), torch.tensor(s2[0][0]), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(torch.tensor(s3[0][0]), torch.tensor(ref_losses), rtol=2e-2, atol=1e-2)
    for n, want in ref_params.items():
        torch.testing.assert_close(s3[0][1][n].double(), want.double(), rtol=3e-2, atol=3e-2)


def test_stage3_needs_the_module():
    net = Net(torch.float32)
    with pytest.raises(TypeError, match="needs module="):
        ZeroOptimizer(net.parameters(), None, object(), stage=3)


def test_map_tensors_keeps_no_reference_cycle():
    """Stage 3 passes every unit's outputs through map_tensors: the tensors it saw must be freed by reference
    counting alone (a cycle would keep each block's activations alive until the cyclic GC runs)."""
    import gc
    import weakref

    from llmpar.zero.units import map_tensors

    x = torch.randn(3, 4, requires_grad=True)
    out = {"a": (x * 2, [x + 1, 5]), "b": torch.ones(2)}
    refs = [weakref.ref(out["a"][0]), weakref.ref(out["a"][1][0])]
    gc.disable()
    try:
        mapped = map_tensors(out, lambda ts: [t * 3 for t in ts])
        assert torch.equal(mapped["a"][0], x.detach() * 6) and mapped["a"][1][1] == 5 and mapped["b"] is out["b"]
        new_ref = weakref.ref(mapped["a"][0])
        del out, mapped
        assert all(r() is None for r in refs + [new_ref])
    finally:
        gc.enable()
