"""``engine.optimizer.state_dict()`` / ``load_state_dict()`` (this rank's shard, DeepSpeed's meaning) and
``engine.destroy()``, on 2 CPU ranks at ZeRO stages 0-3 (one run of the ranks for every stage)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

import llmpar

from multirank import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(13, 11), torch.nn.Tanh(), torch.nn.Linear(11, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5)
    )


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(3, 13, generator=g, dtype=torch.float32)


def _train(engine: object, steps: range) -> list[float]:
    """Two micro-steps per optimizer step; the loss of each micro-step (float64 on the host)."""
    out = []
    for s in steps:
        for micro in range(2):
            loss = engine(_batch(10 * s + micro)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            out.append(float(loss.detach().double()))
    return out


def _round_trip(stage: int) -> dict:
    model = _model()
    total = sum(p.numel() for p in model.parameters())
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 20},
    }
    engine, opt, _, _ = llmpar.initialize(model=model, config=cfg)
    _train(engine, range(3))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # the usual trip: through a file
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    after = _train(engine, range(3, 6))
    opt.param_groups[0]["lr"] = 5e-3  # a scheduler's change: undone by the load
    _train(engine, range(20, 22))  # move away (params, moments, steps) with other data
    opt.load_state_dict(saved)
    again = _train(engine, range(3, 6))
    numel = sum(b["params"].numel() for b in saved["buffers"])
    # a state dict of the other rank is refused on both ranks, before anything changes
    other = [None, None]
    dist.all_gather_object(other, saved)
    refused = ""
    if stage > 0:
        try:
            opt.load_state_dict(other[1 - dist.get_rank()])
        except ValueError as e:
            refused = str(e)
    x = _batch(99)
    before = model(x).detach() if stage < 3 else None
    engine.destroy()
    engine.destroy()  # idempotent
    errors = []
    for call in (lambda: engine.step(), lambda: engine(x), lambda: opt.state_dict(), lambda: opt.step()):
        try:
            call()
        except RuntimeError as e:
            errors.append(str(e))
    hooks = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    plain = ""
    if stage < 3:  # a plain module with the trained weights; backward fills .grad, no hook left
        out = model(x)
        assert torch.equal(out.detach(), before)
        out.pow(2).mean().backward()
        assert all(p.grad is not None for p in model.parameters())
    else:
        try:
            model(x)
        except RuntimeError as e:
            plain = str(e)
    return {
        "after": after,
        "again": again,
        "numel": numel,
        "total": total,
        "refused": refused,
        "errors": errors,
        "hooks": hooks,
        "stage3_forward": plain,
    }


def _all_stages() -> dict[int, dict]:
    return {stage: _round_trip(stage) for stage in (0, 1, 2, 3)}


def test_optimizer_state_dict_round_trip_and_destroy():
    results = run_ranks(_all_stages, 2, timeout=240)
    for rank, by_stage in enumerate(results):
        for stage, r in by_stage.items():
            where = f"rank {rank}, stage {stage}"
            # exact: the same losses, bit for bit, from the loaded state as from the state it was taken from
            assert r["after"] == r["again"], where
            assert len(set(r["after"])) == len(r["after"]), where  # and the run moved
            if stage == 0:
                assert r["numel"] >= r["total"], where  # every rank holds everything
            else:
                assert r["total"] / 2 <= r["numel"] < r["total"], where  # this rank's shard (plus padding)
                assert "dp rank" in r["refused"], (where, r["refused"])
            assert len(r["errors"]) == 4 and all("destroy" in e for e in r["errors"]), (where, r["errors"])
            assert r["hooks"] == 0, where
            if stage == 3:
                assert "destroyed" in r["stage3_forward"], where


def test_load_state_dict_refuses_foreign_input():
    """Not a state dict of this optimizer: a ValueError naming what was expected (one rank, no collective)."""
    model = _model()
    engine, opt, _, _ = llmpar.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6}
    )
    with pytest.raises(ValueError, match="ZeroOptimizer.state_dict"):
        opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    sd = opt.state_dict()
    sd["layout"] = sd["layout"][:0]
    with pytest.raises(ValueError, match="other params or param groups"):
        opt.load_state_dict(sd)
    sd = opt.state_dict()
    del sd["buffers"][0]["state"]["exp_avg"]
    with pytest.raises(ValueError, match="buffer 0"):
        opt.load_state_dict(sd)
    engine.destroy()
