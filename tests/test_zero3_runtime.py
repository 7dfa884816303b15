"""ZeRO-3 runtime behaviour on CPU/gloo ranks: per-param persistence, sharded frozen params, offload copies issued
early (checked by the order of operations, never by timing), and step() without host reads of device tensors."""

import pytest
import torch
from zero_helpers import GPT_CFG, engine_loop, gpt_batch, single_gpt_losses

import llmpar
import llmpar.zero
from llmpar.models import GPT, GPTConfig

from multirank import run_ranks


def _engine(model, micro=2, **zero):
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 700,
            "overlap_comm": True,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 5000,
            **zero,
        },
    }
    env = llmpar.init_distributed(tp=1)
    engine, opt, _, _ = llmpar.initialize(model=model, config=cfg, mesh=env.mesh)
    engine.dp_mesh = env.mesh["dp"]
    return engine, opt


# ------------------------------------------------------------------------------------------ per-param persistence
def persistence_body(threshold):
    model = GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64)
    engine, opt = _engine(model, stage3_param_persistence_threshold=threshold)
    losses = engine_loop(engine, model, 3, 2, engine.dp_mesh)
    whole = {n: p.untyped_storage().nbytes() > 0 for n, p in model.named_parameters()}
    numel = {n: p.ds_numel for n, p in model.named_parameters()}  # a released param is empty: its size kept aside
    persistent = sum(opt.stage3._numel(k) for k in opt.stage3.persistent)
    return losses, whole, numel, opt.memory_bytes(), persistent, opt.stage3.live_numel


def test_persistence_threshold_applies_per_param():
    threshold = 16  # d_model: the norms and the biases of d_model elements, not the weights of the same modules
    kept = run_ranks(persistence_body, 2, threshold, timeout=90)
    sharded = run_ranks(persistence_body, 2, 0, timeout=90)
    ref = single_gpt_losses(GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64), 3, 4)
    for (losses, whole, numel, mem, persistent, live), (losses0, *_rest) in zip(kept, sharded):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(torch.tensor(losses0), torch.tensor(ref), rtol=1e-7, atol=1e-9)
        assert all(whole[n] == (numel[n] <= threshold) for n in whole), whole
        assert whole["blocks.0.ln1.weight"] and not whole["blocks.0.attn.qkv.weight"]  # same unit module, per param
        small = sum(v for n, v in numel.items() if v <= threshold)
        assert small <= persistent < small + 2 * 16  # one persistent unit, padded to dp * align
        assert mem["persistent"] == 8 * persistent and live == persistent  # float64: 8 bytes each
    assert all(not w for n, w in sharded[0][1].items())  # threshold 0: every param sharded between uses


# ---------------------------------------------------------------------------------------------- frozen params
def _freeze(model):
    model.blocks[0].requires_grad_(False)  # a middle unit: its input needs a gradient, its params never do
    model.pos_emb.requires_grad_(False)


def frozen_body():
    model = GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64)
    _freeze(model)
    engine, opt = _engine(model)
    frozen_live = []
    model.tok_emb.weight.register_post_accumulate_grad_hook(  # the last grad of a backward: frozen units gone?
        lambda p: frozen_live.append(len(set(opt.stage3.live) & opt.stage3.frozen_keys))
    )
    losses = engine_loop(engine, model, 3, 2, engine.dp_mesh)
    frozen_numel = sum(p.ds_numel for p in model.parameters() if not p.requires_grad)
    frozen_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters() if not p.requires_grad)
    full = llmpar.zero.consolidated_state_dict(model, opt, rank0_only=False)
    frozen = llmpar.zero.frozen_state_dict(opt, rank0_only=False)  # what a checkpoint stores for them
    name = next(iter(frozen))
    with pytest.raises(ValueError, match=f"load_frozen: '{name}' has shape"):
        llmpar.zero.load_frozen(opt, {name: frozen[name].reshape(-1)[:-1]})
    taken = llmpar.zero.load_frozen(opt, {n: 2 * v for n, v in frozen.items()})
    doubled = llmpar.zero.consolidated_state_dict(model, opt, rank0_only=False)
    checks = (
        sorted(frozen) == sorted(taken)
        and all(torch.equal(frozen[n], full[n]) for n in frozen)
        and all(torch.equal(doubled[n], 2 * full[n]) if n in frozen else torch.equal(doubled[n], full[n]) for n in full)
    )
    return (
        losses,
        frozen_live,
        frozen_numel,
        frozen_bytes,
        opt.memory_bytes(),
        opt.num_params(),
        full,
        len(opt.stage3.frozen_keys),
        checks,
    )


def test_frozen_params_are_sharded_and_match_one_process():
    ref_model = GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64)
    _freeze(ref_model)
    ref = single_gpt_losses(ref_model, 3, 4)
    untouched = GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64).state_dict()
    for losses, frozen_live, frozen_numel, frozen_bytes, mem, psi, full, n_frozen, io_ok in run_ranks(
        frozen_body, 2, timeout=90
    ):
        assert io_ok  # frozen_state_dict == the gathered params; load_frozen writes every rank's slices
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-7, atol=1e-9)
        assert n_frozen >= 2 and frozen_live == [0, 0, 0]  # freed right after their module's backward
        assert frozen_bytes == 0  # no frozen param whole between uses
        # this rank's params: (trained + frozen) / dp, float64
        assert mem["params"] == pytest.approx(8 * (psi + frozen_numel) / 2, rel=0.05)
        for n, v in full.items():  # frozen ones unchanged (gathered from the shards), trained ones moved
            frozen = n.startswith("blocks.0.") or n == "pos_emb.weight"
            assert torch.equal(v, untouched[n]) == frozen, n


def frozen_meta_body():
    with llmpar.zero.Init():
        model = GPT(GPTConfig(**GPT_CFG), seed=1)
    model.blocks[0].requires_grad_(False)
    engine, opt = _engine(model)
    frozen = llmpar.zero.frozen_state_dict(opt, rank0_only=False)
    engine.backward(model.loss(engine(gpt_batch(0, 2)[0]), gpt_batch(0, 2)[1]))
    engine.step()
    return frozen, [p.untyped_storage().nbytes() for p in model.blocks[0].parameters()]


def test_frozen_params_of_a_model_built_sharded():
    outs = run_ranks(frozen_meta_body, 2, timeout=60)
    for frozen, nbytes in outs:
        assert sorted(frozen) == sorted(n for n in frozen if n.startswith("blocks.0.")) and len(frozen) == 12
        assert frozen["blocks.0.attn.qkv.weight"].std() > 0.01  # initialised unit by unit, then sharded
        assert all(torch.equal(v, outs[0][0][n]) for n, v in frozen.items())  # the same values on every rank
        assert nbytes == [0] * 12


# --------------------------------------------------------------------------------------- offload copy order
def offload_order_body():
    model = GPT(GPTConfig(**GPT_CFG), seed=1)
    engine, opt = _engine(model, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    x, y = gpt_batch(0, 2)
    engine.backward(model.loss(engine(x), y))  # step 1 records the gather order
    engine.step()
    opt.stage3.log, opt.reducer.log = [], []
    out = engine(x)
    fwd = list(opt.stage3.log)
    out_before = opt.copier.copies_out
    engine.backward(model.loss(out, y))
    engine.step()
    return (
        fwd,
        opt.stage3.trace["fwd"],
        opt.reducer.log,
        opt.copier.copies_out - out_before,
        sum(len(b.layout.units) for b in opt.buffers),
    )


def test_offload_copies_are_issued_early():
    for fwd, order, red, copies, units in run_ranks(offload_order_body, 2, timeout=90):
        # offload_param: the next unit's host->device copy is issued before the current unit is waited for
        for cur, nxt in zip(order, order[1:]):
            if cur != nxt:
                assert fwd.index(("h2d", nxt)) < fwd.index(("wait", cur)), (cur, nxt, fwd)
        # offload_optimizer: each reduced shard goes to the host during backward, not in a batch at its end
        launches = [k for what, k in red if what == "reduce"]
        assert copies == units == len(launches)
        for i, key in enumerate(launches[:-3]):
            assert red.index(("reduced", key)) < red.index(("reduce", launches[i + 3])), red


def _halves(module):
    with torch.no_grad():
        for p in module.parameters():
            if p.untyped_storage().nbytes() > 0:  # this unit's params (the others hold no memory yet)
                p.fill_(0.5)


def init_fn_body():
    with llmpar.zero.Init(init_fn=_halves):
        model = GPT(GPTConfig(**GPT_CFG), seed=1)
    with llmpar.zero.Init():  # another model built in between does not change the first one's init_fn
        GPT(GPTConfig(**GPT_CFG), seed=1)
    engine, opt = _engine(model)
    full = llmpar.zero.consolidated_state_dict(model, opt, rank0_only=False)
    return {n: bool((v == 0.5).all()) for n, v in full.items()}


def test_init_fn_stays_with_the_model_built_in_its_block():
    for halves in run_ranks(init_fn_body, 2, timeout=60):
        assert len(halves) == len(list(GPT(GPTConfig(**GPT_CFG)).parameters())) and all(halves.values()), halves


# ------------------------------------------------------------------------------------------------ host syncs
_READS = ("item", "__float__", "__int__", "__bool__", "tolist", "__index__")


def no_sync_body():
    model = GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64)
    engine, opt = _engine(model)
    x, y = gpt_batch(0, 2)
    engine.backward(model.loss(engine(x), y))
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def refuse(*_a, **_k):
        raise AssertionError("a host read of a tensor inside ZeroOptimizer.step()")

    for name in _READS:
        setattr(torch.Tensor, name, refuse)
    try:
        applied = opt.step()
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
    read = (bool(applied), opt.skipped_steps, opt.last_grad_norm)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="skipped_steps must be a non-negative int"):
            opt.skipped_steps = bad
    opt.skipped_steps, opt.last_grad_norm = 7, 1.25  # what load_checkpoint assigns
    engine.skipped_steps = 3
    return read, (opt.skipped_steps, opt.last_grad_norm, engine.skipped_steps)


def test_step_reads_nothing_on_the_host_until_asked():
    for (applied, skipped, norm), assigned in run_ranks(no_sync_body, 2, timeout=60):
        assert applied and skipped == 0 and isinstance(norm, float) and norm > 0
        assert assigned == (7, 1.25, 3)
