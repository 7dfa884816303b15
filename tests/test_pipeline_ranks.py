"""Pipeline parallelism on CPU/gloo ranks: every schedule, pp = 2 and 4, pp x tp, pp x dp and tied embeddings give
the loss trajectory of single-process training (20 steps, micro-batch counts that do and do not divide the batch);
the layout is the same on every rank; bubble and activation accounting; a stage that raises fails every rank."""

import time

import pytest
import torch

from llmpar.models import GPT, GPTConfig

import multirank
from multirank import run_ranks

STEPS, B, T, V, LR, CLIP = 20, 6, 8, 32, 1e-2, 1.0


def _cfg(tie=False, n_layer=6):
    return GPTConfig(vocab_size=V, n_layer=n_layer, n_head=2, d_model=16, seq_len=T, tie_embeddings=tie)


def _batch(step, dp_rank):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    d = torch.randint(0, V, (B, T + 1), generator=g)
    return d[:, :-1], d[:, 1:]


def _reference(tie, dp):
    """Single process, whole (dp-concatenated) batch, AdamW, global-norm clipping."""
    model = GPT(_cfg(tie), seed=0, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for s in range(STEPS):
        x, y = (torch.cat(t) for t in zip(*(_batch(s, r) for r in range(dp))))
        opt.zero_grad()
        loss = GPT.loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        out.append(loss.item())
    return out


def _train_body(pp, tp, runs, tie=False):
    """On every rank: for each (schedule, micro_batches) in runs, 20 steps; returns {run: losses} and tied weights."""
    import llmpar
    from llmpar.pipeline import build_pipeline

    env = llmpar.init_distributed(pp=pp, tp=tp)
    dp_rank = env.dims.coordinates(env.rank)["dp"]
    results, tied = {}, {}
    for schedule, m in runs:
        model = GPT(_cfg(tie), seed=0, dtype=torch.float64)
        runner = build_pipeline(model, env.mesh, GPT.loss, micro_batches=m, schedule=schedule, verbose=False)
        opt = torch.optim.AdamW(runner.parameters(), lr=LR)
        losses = []
        for s in range(STEPS):
            x, y = _batch(s, dp_rank)
            opt.zero_grad()
            losses.append(runner.step(x, y))
            runner.clip_grad_norm_(CLIP)
            opt.step()
        results[(schedule, m)] = losses
        if tie:
            for mod in runner.split.modules:
                for name, p in mod.named_parameters():
                    if name in ("embed.tok_emb.weight", "head.lm_head.weight"):
                        tied[name] = p.detach().clone()
    return results, tied


def _check(outs, runs, tie=False, dp=1):
    ref = torch.tensor(_reference(tie, dp))
    for rank, (results, _) in enumerate(outs):
        for run in runs:
            torch.testing.assert_close(
                torch.tensor(results[run]), ref, rtol=1e-10, atol=1e-10, msg=lambda m: f"rank {rank} {run}: {m}"
            )


PP2_RUNS = [(s, m) for s in ("gpipe", "1f1b", "interleaved_1f1b") for m in (3, 4)]  # B=6: 3 divides, 4 does not


def test_pp2_every_schedule_matches_single_process():
    _check(run_ranks(_train_body, 2, 2, 1, PP2_RUNS, timeout=240), PP2_RUNS)


def test_pp2_tied_embeddings_match_and_copies_stay_equal():
    runs = [("1f1b", 4), ("interleaved_1f1b", 4)]
    outs = run_ranks(_train_body, 2, 2, 1, runs, True, timeout=240)
    _check(outs, runs, tie=True)
    emb, head = outs[0][1]["embed.tok_emb.weight"], outs[1][1]["head.lm_head.weight"]
    torch.testing.assert_close(emb, head, rtol=0, atol=0)


def test_pp4_every_schedule_matches_single_process():
    runs = [(s, m) for s in ("gpipe", "1f1b", "interleaved_1f1b") for m in (4, 6)]  # B=6: 6 divides, 4 does not
    _check(run_ranks(_train_body, 4, 4, 1, runs, timeout=240), runs)


def test_pp2_tp2_matches_single_process():
    runs = [("gpipe", 3), ("1f1b", 4), ("interleaved_1f1b", 4)]
    _check(run_ranks(_train_body, 4, 2, 2, runs, timeout=240), runs)
    tied = [("1f1b", 4)]
    _check(run_ranks(_train_body, 4, 2, 2, tied, True, timeout=240), tied, tie=True)


def test_pp2_dp2_matches_single_process_on_concatenated_batch():
    runs = [("1f1b", 4), ("interleaved_1f1b", 3)]
    _check(run_ranks(_train_body, 4, 2, 1, runs, timeout=240), runs, dp=2)


def _layout_body():
    import llmpar
    from llmpar.pipeline import split

    env = llmpar.init_distributed(pp=2)
    model = GPT(_cfg(n_layer=4), seed=0)
    by_params = split(model, env.mesh, verbose=False)
    sample = torch.randint(0, V, (2, T))
    by_time = split(model, env.mesh, by="time", sample=sample, verbose=False)
    explicit = split(model, env.mesh, boundaries=[2], verbose=False)
    return by_params.boundaries, by_time.boundaries, explicit.format(), [m.block_names for m in explicit.modules]


def test_split_layout_is_the_same_on_every_rank():
    outs = run_ranks(_layout_body, 2, timeout=120)
    assert outs[0][:3] == outs[1][:3]
    params_cuts, time_cuts, table, _ = outs[0]
    assert len(params_cuts) == 1 and len(time_cuts) == 1
    assert "split by boundaries" in table and "embed, blocks.0" in table and "weights MiB" in table
    assert outs[0][3] == [["embed", "blocks.0"]] and outs[1][3] == [["blocks.1", "blocks.2", "blocks.3", "head"]]


def _accounting_body(schedule, m):
    import llmpar
    from llmpar.pipeline import build_pipeline

    env = llmpar.init_distributed(pp=2)
    model = GPT(_cfg(n_layer=2), seed=0)
    runner = build_pipeline(
        model, env.mesh, GPT.loss, micro_batches=m, schedule=schedule, verbose=False, track_memory=True
    )
    x, y = _batch(0, 0)
    x, y = x.repeat(2, 1), y.repeat(2, 1)  # 12 rows
    for _ in range(2):
        for p in runner.parameters():
            p.grad = None
        runner.step(x, y)
    return runner.gather_stats(), runner.bubble_formula()


@pytest.mark.parametrize("m", [4, 6])
def test_in_flight_micro_batches_and_activation_memory(m):
    gpipe, formula = run_ranks(_accounting_body, 2, "gpipe", m, timeout=120)[0]
    f1b1, formula_1f1b = run_ranks(_accounting_body, 2, "1f1b", m, timeout=120)[0]
    assert formula == formula_1f1b == pytest.approx(1 / (m + 1))
    assert [s.peak_in_flight for s in gpipe] == [m, m]  # GPipe: every micro-batch's activations at once
    assert [s.peak_in_flight for s in f1b1] == [2, 1]  # 1F1B: at most p - stage in flight
    assert f1b1[0].peak_activation_bytes < gpipe[0].peak_activation_bytes
    for s in gpipe + f1b1:
        assert 0 < s.busy_s <= s.wall_s and 0.0 <= s.bubble < 1.0


def _bad_args_body():
    import llmpar
    from llmpar.pipeline import PipelineStageError, build_pipeline

    env = llmpar.init_distributed(pp=2)
    errors = []
    for kwargs in (dict(schedule="zb", micro_batches=2), dict(micro_batches=0), dict(micro_batches=1)):
        try:
            build_pipeline(GPT(_cfg(n_layer=2)), env.mesh, GPT.loss, verbose=False, **kwargs)
        except ValueError as err:
            errors.append(str(err))
    runner = build_pipeline(GPT(_cfg(n_layer=2)), env.mesh, GPT.loss, micro_batches=4, verbose=False)
    x, y = _batch(0, 0)
    try:
        runner.step(x[:3], y[:3])
    except PipelineStageError as err:
        errors.append(str(err))
    return errors


def test_bad_arguments_fail_on_every_rank_naming_the_argument():
    for errors in run_ranks(_bad_args_body, 2, timeout=120):
        assert "schedule='zb' is not one of" in errors[0]
        assert "micro_batches=0 must be a positive int" in errors[1]
        assert "micro_batches=1 must be >= pp=2" in errors[2]
        assert "has 3 rows, fewer than micro_batches=4" in errors[3]


class Bomb(torch.nn.Module):
    """Identity that raises on its ``when``-th call (counting the shape-inference call)."""

    def __init__(self, when):
        super().__init__()
        self.calls, self.when = 0, when

    def forward(self, x):
        self.calls += 1
        if self.calls == self.when:
            raise RuntimeError("BOOM in the bomb block")
        return x


def _failure_body():
    import llmpar
    from llmpar.pipeline import PipelineStageError, build_pipeline

    env = llmpar.init_distributed(pp=2, dp=2)
    coords = env.dims.coordinates(env.rank)
    when = 7 if coords["dp"] == 0 else 10**9  # only the stage-1 copy of dp rank 0 explodes, in step 2
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), Bomb(when), torch.nn.Linear(4, 4))
    runner = build_pipeline(
        model, env.mesh, lambda out, y: (out - y).pow(2).mean(), micro_batches=2, boundaries=[2], verbose=False
    )
    t0 = time.monotonic()
    for _ in range(3):
        try:
            runner.step(torch.randn(4, 4), torch.randn(4, 4))
        except PipelineStageError as err:
            return str(err), time.monotonic() - t0
    return "no error", 0.0


def test_stage_failure_fails_every_rank_with_that_traceback():
    try:
        outs = run_ranks(_failure_body, 4, timeout=60)
    finally:
        multirank.close_pools()  # the failed step leaves threads blocked in receives: start the next test afresh
    for msg, seconds in outs:
        assert "pipeline step failed on global rank 2, pp rank 1" in msg, msg
        assert "BOOM in the bomb block" in msg and "Traceback" in msg, msg
        assert seconds < 30
