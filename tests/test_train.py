"""`llmpar train`: data-parallel training on 2 gloo ranks equals single-process training on the concatenated
batch, ranks stay identical, and the command runs end to end under torchrun."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from llmpar.train import TrainConfig, train
from multirank import run_ranks

TINY = dict(steps=6, batch_size=3, seq_len=16, n_layer=2, n_head=2, d_model=16, lr=1e-2, warmup_steps=2,
            log_every=2, dtype="float64")


def _flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _dp_body(kw):
    model, result = train(TrainConfig(**kw), dp_group=dist.group.WORLD)
    return _flat_params(model), result.losses, result.mem_mb


def test_dp_equals_single_process_on_concatenated_batch():
    outs = run_ranks(_dp_body, 2, TINY, timeout=120)
    (p0, losses0, mem0), (p1, losses1, _) = outs
    assert torch.equal(p0, p1), "dp ranks drifted apart"
    assert losses0 == losses1
    assert len(mem0) == 2 and all(m > 0 for m in mem0)

    single_kw = dict(TINY, batch_size=2 * TINY["batch_size"])
    model, result = train(TrainConfig(**single_kw), dp_group=None)
    torch.testing.assert_close(p0, _flat_params(model), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.tensor(losses0), torch.tensor(result.losses), rtol=1e-10, atol=1e-12)
    init = _flat_params(train(TrainConfig(**dict(single_kw, steps=1, lr=1e-12)), dp_group=None)[0])
    assert not torch.allclose(p0, init)  # the parameters did move


def test_single_process_loss_falls_fp32():
    _, result = train(TrainConfig(steps=25, batch_size=8, seq_len=32, d_model=32, n_layer=1, log_every=5))
    assert result.fell and result.final_loss < 0.8 * result.first_loss
    assert result.tokens_per_s > 0 and result.mem_mb and result.mem_mb[0] > 0


def _tp_dp_body(kw, tp):
    """tp x dp ranks: the tp groups are consecutive ranks, dp groups strided (as the [pp, dp, tp] mesh lays them)."""
    import llmpar

    env = llmpar.init_distributed(tp=tp)
    _, result = train(TrainConfig(**dict(kw, tp=tp)), dp_group=env.mesh["dp"], tp_group=env.mesh["tp"])
    return result.losses


@pytest.mark.parametrize("world_size, tp", [(2, 2), (4, 2)])
def test_tensor_parallel_training_matches_single_process(world_size, tp):
    """--tp lands the same loss curve as one process training on the whole (dp-concatenated) batch."""
    outs = run_ranks(_tp_dp_body, world_size, TINY, tp, timeout=180)
    dp = world_size // tp
    _, single = train(TrainConfig(**dict(TINY, batch_size=dp * TINY["batch_size"])), dp_group=None)
    for rank, losses in enumerate(outs):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(single.losses), rtol=1e-9, atol=1e-10,
                                   msg=f"rank {rank}")


def _pp_body(kw, pp, tp):
    import llmpar

    env = llmpar.init_distributed(tp=tp, pp=pp)
    dp_group = env.mesh["dp"] if env.dims.dp > 1 else None
    _, result = train(TrainConfig(**dict(kw, tp=tp, pp=pp, micro_batches=3)), dp_group=dp_group,
                      tp_group=env.mesh["tp"] if tp > 1 else None, mesh=env.mesh)
    return result.losses


@pytest.mark.parametrize("world_size, pp, tp", [(2, 2, 1), (4, 2, 2), (4, 2, 1)])
def test_pipeline_training_matches_single_process(world_size, pp, tp):
    """--pp (with --tp inside the stages, and dp over the rest) lands the single-process loss curve."""
    outs = run_ranks(_pp_body, world_size, TINY, pp, tp, timeout=180)
    dp = world_size // (pp * tp)
    _, single = train(TrainConfig(**dict(TINY, batch_size=dp * TINY["batch_size"])), dp_group=None)
    for rank, losses in enumerate(outs):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(single.losses), rtol=1e-9, atol=1e-10,
                                   msg=f"rank {rank}")


def test_bad_flags_fail_clearly():
    with pytest.raises(ValueError, match="--tp=0"):
        TrainConfig(tp=0)
    with pytest.raises(ValueError, match="--batch-size=0"):
        TrainConfig(batch_size=0)
    out = subprocess.run([sys.executable, "-m", "llmpar.cli", "train", "--nproc", "3", "--tp", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--tp=2 does not divide the 3 ranks" in out.stderr


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [cfg.lr_at(s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_cli_two_ranks_under_torchrun(tmp_path):
    summary = tmp_path / "summary.json"
    env = dict(os.environ)
    env.pop("RANK", None)
    out = subprocess.run(
        [sys.executable, "-m", "llmpar.cli", "train", "--nproc", "2", "--steps", "30", "--log-every", "5",
         "--sample", "40", "--json", str(summary)],
        capture_output=True, text=True, timeout=150, env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "PASS: loss fell" in out.stdout and "tokens/s" in out.stdout and "rank 1:" in out.stdout
    data = json.loads(summary.read_text())
    assert data["dp"] == 2 and len(data["losses"]) == 30 and len(data["mem_mb"]) == 2
    assert data["final_loss"] < 0.8 * data["first_loss"] and data["fell"] is True
