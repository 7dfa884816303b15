"""Pipeline x ZeRO on CPU/gloo ranks: pp=2 x dp=2 with ZeRO-1 and ZeRO-2 (the optimizer reduces over dp, tied
embeddings summed over pp inside its shards, the clipping norm counts the whole model over pp) gives the loss
trajectory of single-process training on the dp-concatenated batch (20 steps, float64), for 1F1B and GPipe."""

import pytest
import torch
from test_pipeline_ranks import CLIP, LR, STEPS, _batch, _cfg, _reference

from llmpar.models import GPT

from multirank import run_ranks

# (ZeRO stage, schedule, micro-batches, tied embeddings); B=6: 3 divides, 4 does not
RUNS = [(1, "1f1b", 3, True), (1, "gpipe", 4, False), (2, "1f1b", 4, False), (2, "gpipe", 3, True)]


def _zero_body(pp, tp, runs):
    import llmpar
    from llmpar.pipeline import build_pipeline, zero_optimizer
    from llmpar.zero import OptimizerConfig

    env = llmpar.init_distributed(pp=pp, tp=tp)
    dp_rank = env.dims.coordinates(env.rank)["dp"]
    results, norms = {}, {}
    for stage, schedule, m, tie in runs:
        model = GPT(_cfg(tie), seed=0, dtype=torch.float64)
        runner = build_pipeline(
            model, env.mesh, GPT.loss, micro_batches=m, schedule=schedule, dp_group=None, verbose=False
        )
        opt = zero_optimizer(runner, OptimizerConfig(lr=LR, weight_decay=0.01), stage=stage, max_grad_norm=CLIP)
        losses = []
        for s in range(STEPS):
            x, y = _batch(s, dp_rank)
            losses.append(runner.step(x, y))
            opt.step()
            opt.zero_grad()
        results[(stage, schedule, m, tie)] = losses
        norms[(stage, schedule, m, tie)] = opt.last_grad_norm
    return results, norms


def _reference_norm(tie, dp):
    """The last step's pre-clip global gradient norm of single-process training."""
    model = GPT(_cfg(tie), seed=0, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in range(STEPS):
        x, y = (torch.cat(t) for t in zip(*(_batch(s, r) for r in range(dp))))
        opt.zero_grad()
        GPT.loss(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return float(norm)


def test_pp2_dp2_zero_matches_single_process():
    outs = run_ranks(_zero_body, 4, 2, 1, RUNS, timeout=600)
    refs = {tie: torch.tensor(_reference(tie, 2)) for tie in (False, True)}
    ref_norm = {tie: _reference_norm(tie, 2) for tie in (False, True)}
    for rank, (results, norms) in enumerate(outs):
        for run in RUNS:
            torch.testing.assert_close(
                torch.tensor(results[run]),
                refs[run[3]],
                rtol=1e-10,
                atol=1e-10,
                msg=lambda m: f"rank {rank} {run}: {m}",
            )
            assert norms[run] == pytest.approx(ref_norm[run[3]], rel=1e-9), (rank, run)
