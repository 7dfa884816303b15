"""ZeRO-3 ``stage3_max_reuse_distance`` (DeepSpeed's rule): a unit fewer than that many gathered elements from its
next use stays gathered from forward to backward instead of being gathered again; the kept elements stay within
``stage3_max_live_parameters``. The rule on recorded orders (``kept_units``), then on CPU/gloo ranks: bytes moved per
step, what stays gathered, and the same losses whatever is kept."""

import pytest
import torch
from zero_helpers import SEQ, gpt_batch

import llmpar
from llmpar.distributed.collectives import CommCounter
from llmpar.models import GPT, GPTConfig
from llmpar.zero.units import kept_units

from multirank import run_ranks

SIZES = {"emb": 7, "b0": 11, "b1": 13, "b2": 17, "head": 5}


def _kept(fwd, bwd, *, prefetch=0, max_live=10**9, reuse=10**9):
    return kept_units(fwd, bwd, SIZES.__getitem__, prefetch=prefetch, max_live=max_live, reuse=reuse)


FWD = ["emb", "b0", "b1", "b2", "head"]
BWD = ["head", "b2", "b1", "b0", "emb"]


def test_gaps_are_the_elements_gathered_between_two_uses():
    # gaps to the backward use: head 0, b2 5 + 5 = 10 (head twice: its forward and its backward use), b1 17 + 5 + 5 +
    # 17 = 44, b0 13 + 17 + 5 + 5 + 17 + 13 = 70, emb 11 + 70 + 11 = 92
    assert _kept(FWD, BWD, reuse=1) == {"head"}
    assert _kept(FWD, BWD, reuse=10) == {"head"}  # fewer than reuse: 10 is not kept
    assert _kept(FWD, BWD, reuse=11) == {"head", "b2"}
    assert _kept(FWD, BWD, reuse=45) == {"head", "b2", "b1"}
    assert _kept(FWD, BWD, reuse=93) == set(SIZES)
    assert _kept(FWD, BWD, reuse=0) == set()


def test_prefetch_window_is_kept_whatever_the_reuse_distance():
    # backward starts with head (5) and b2 (17): within 22 elements, both kept, even at reuse 0 (as before the rule)
    assert _kept(FWD, BWD, prefetch=22, reuse=0) == {"head", "b2"}
    assert _kept(FWD, BWD, prefetch=21, reuse=0) == {"head"}
    assert _kept(FWD, BWD, prefetch=22, reuse=45) == {"head", "b2", "b1"}


def test_max_live_caps_what_is_kept_in_backward_order():
    assert _kept(FWD, BWD, max_live=5 + 17 + 13) == {"head", "b2", "b1"}
    assert _kept(FWD, BWD, max_live=5 + 17 + 12) == {"head", "b2"}  # b1 would pass the cap: it and the rest go
    assert _kept(FWD, BWD, max_live=4) == set()


def test_a_unit_used_twice_in_forward_needs_both_gaps_small():
    # tied embedding: gathered for the embedding and again for the head; gap in forward 11 + 13 + 17 = 41, to its first
    # backward use 0 (the head's backward comes first)
    fwd = ["emb", "b0", "b1", "b2", "emb"]
    bwd = ["emb", "b2", "b1", "b0", "emb"]
    assert "emb" in _kept(fwd, bwd, reuse=42)
    assert "emb" not in _kept(fwd, bwd, reuse=41)


def _reuse_body(reuse, max_live, steps=3):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, n_layer=3, n_head=2, d_model=40, seq_len=SEQ, tie_embeddings=True), seed=2)
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 4_000,
        "reduce_bucket_size": 10**6,
    }
    if reuse is not None:
        zero["stage3_max_reuse_distance"] = reuse
    if max_live is not None:
        zero["stage3_max_live_parameters"] = max_live
    counter = CommCounter()
    engine, opt, _, _ = llmpar.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        },
        counter=counter,
    )
    rt = opt.stage3
    losses, peaks = [], []
    for step in range(steps):  # step 0 records the orders, the next ones keep along them
        counter.reset()
        rt.peak_live_numel = 0
        x, y = gpt_batch(step, 2, vocab=97)
        loss = model.loss(engine(x), y)
        kept_after_forward = {k for k in rt.keep_for_bwd if k in rt.live}
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        peaks.append(rt.peak_live_numel)
    units = sum(rt._numel(k) for k in rt.full)
    kept = sum(rt._numel(k) for k in rt.keep_for_bwd)
    want = kept_units(
        rt.trace["fwd"],
        rt.trace["bwd"],
        rt._numel,
        prefetch=min(rt.prefetch_numel, rt.max_live_numel),
        max_live=rt.max_live_numel,
        reuse=rt.reuse_numel,
    )
    fc = model.blocks[0].mlp.fc.weight.untyped_storage().nbytes()
    # forward gathers each unit once, a unit used twice (the tied embedding) again unless kept; backward the others
    again = sum(rt._numel(k) for k in set(rt.trace["fwd"]) if rt.trace["fwd"].count(k) > 1 and k not in rt.keep_for_bwd)
    return (
        losses,
        dict(counter.volume),
        units,
        kept,
        again,
        kept_after_forward == rt.keep_for_bwd,
        rt.keep_for_bwd == want,
        peaks[-1],
        fc,
        len(rt.live),
    )


def test_reuse_distance_sets_what_backward_gathers_again_with_the_same_losses():
    cases = [None, 0, 25_000, 30_000]  # None: the default, 1e9 (DeepSpeed's); 30k: the default, at most 30k kept
    results = run_ranks(_reuse_body_cases, 2, cases, timeout=120)
    for rank, per_case in enumerate(results):
        default, lean, mid, small_live = per_case
        ref_losses = lean[0]
        for name, (losses, volume, units, kept, again, kept_in_fwd, as_rule, _peak, fc, live) in zip(
            ("default", "reuse 0", "reuse 3000", "max_live 500"), per_case
        ):
            assert losses == ref_losses, (rank, name)  # bitwise: keeping changes where values come from, not them
            assert kept_in_fwd and as_rule, (rank, name)  # kept from forward on, exactly the recorded-order rule
            # a step: forward gathers every unit, backward the ones not kept; one reduce-scatter of everything
            assert volume["all_gather"] == units + again + units - kept, (rank, name, volume, units, kept)
            assert volume["reduce_scatter"] == units, (rank, name)
            assert fc == 0 and live == 0, (rank, name)  # nothing stays gathered after the step
        assert default[3] == default[2] and default[4] == 0  # the default keeps the whole (small) model, tied included
        assert default[7] == default[2]  # ... gathered at once, as DeepSpeed holds it
        assert 0 < lean[3] <= 4_000 < mid[3] < default[3]  # reuse 0: the prefetch window only; 25k: the last block too
        assert lean[7] <= mid[7] < default[7]
        assert 0 < small_live[3] <= 30_000 < default[3] and small_live[7] < default[7]


def _reuse_body_cases(cases):
    out = []
    for reuse in cases:
        if reuse == 30_000:  # the default reuse distance capped by stage3_max_live_parameters
            out.append(_reuse_body(None, 30_000))
        else:
            out.append(_reuse_body(reuse, None))
    return out


@pytest.mark.parametrize("value", [-1, "far", 1.5])
def test_bad_reuse_distance_is_refused_with_its_key(value):
    from llmpar.zero.config import ZeroConfig

    with pytest.raises((ValueError, TypeError), match="stage3_max_reuse_distance"):
        ZeroConfig(stage=3, stage3_max_reuse_distance=value)


def _hpz_body(reuse):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, n_layer=3, n_head=2, d_model=40, seq_len=SEQ), seed=2)
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0,
        "zero_hpz_partition_size": 2,
        "stage3_max_reuse_distance": reuse,
    }
    engine, opt, _, _ = llmpar.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        },
    )
    weights, losses, secondary = opt.stage3.weights, [], 0
    for step in range(3):
        x, y = gpt_batch(step, 2, vocab=97)
        loss = model.loss(engine(x), y)
        secondary = max(secondary, weights.secondary_numel()) if step else 0
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, secondary, weights.from_secondary


def test_hpz_builds_no_secondary_shard_for_kept_units():
    """hpZ keeps a secondary shard for backward's gather inside the node; a unit kept gathered until its backward
    needs none (the default reuse distance keeps this whole model: no secondary after the recording step)."""
    lean = run_ranks(_hpz_body, 4, 0, timeout=120)
    kept = run_ranks(_hpz_body, 4, 10**9, timeout=120)
    for (l_losses, l_sec, l_from), (k_losses, k_sec, _k_from) in zip(lean, kept):
        assert k_losses == l_losses
        assert l_sec > 0 and l_from > 0
        assert k_sec == 0
