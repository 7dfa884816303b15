"""Faults between the ranks of a tensor-parallel group or a pipeline fail every rank with a clear error, quickly, and
leave the ranks usable (CPU/gloo ranks):

* tp ranks given inputs of different element counts (the embedding, the vocab-parallel loss) raise a ValueError naming
  each rank's shape on every rank; before, the shape check rode inside the input-sized reduction and gloo aborted the
  process (SIGABRT: "Received data size doesn't match expected size");
* an out-of-range target through ``model.loss`` of a tensor-parallel GPT, on one rank only or on all, raises on every
  rank naming the target and the vocabulary size; before, ``F.cross_entropy`` raised on that rank and the others
  waited in the backward's collectives;
* a pipeline engine's data iterator running out on one rank raises on every rank of the engine, naming the rank, the
  step and the micro-batches it expected; before, a bare ``StopIteration`` there and a hang everywhere else.
"""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from multirank import run_ranks

FAIL_WITHIN = 20.0  # seconds: every rank must have raised well before this
_SHAPES = r"different shapes \(group rank 0 \({}\), group rank 1 \({}\)"


def _timed(fn, exc, match):
    start = time.monotonic()
    with pytest.raises(exc, match=match) as err:
        fn()
    return time.monotonic() - start, err.value


# ---------------------------------------------------------------- inputs of different element counts
def _numel_body(sp: bool):
    """Embedding and loss with one rank's input of another element count: a ValueError naming both shapes on every
    rank, then (nothing half done) the same layer on agreeing inputs still equals the float64 reference."""
    from llmpar.tensor_parallel import VocabParallelEmbedding, _agree, vocab_parallel_cross_entropy

    g = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    V, d = 67, 5
    ref = nn.Embedding(V, d, dtype=torch.float64)
    emb = VocabParallelEmbedding.from_embedding(ref, group=g, sequence_parallel=sp)
    good, short = (2 * tp, 3), (tp, 3)  # dim 0 divisible by tp for sequence parallelism
    ids = torch.randint(0, V, good)
    times = []
    t, err = _timed(
        lambda: emb(ids[: short[0]] if rank == tp - 1 else ids),
        ValueError,
        r"VocabParallelEmbedding: the ranks of the tensor-parallel group got inputs of different shapes",
    )
    times.append(t)
    assert f"group rank 0 {good}" in str(err) and f"group rank {tp - 1} {short}" in str(err)
    want = ref(ids)
    out = emb(ids)
    n = want.shape[0] // tp
    torch.testing.assert_close(out, want[rank * n : (rank + 1) * n] if sp else want, rtol=1e-12, atol=1e-12)

    logits = torch.randn(7 if rank == 0 else 6, 11, dtype=torch.float64)
    target = torch.randint(0, 11 * tp, logits.shape[:1])
    t, err = _timed(
        lambda: vocab_parallel_cross_entropy(logits, target, g),
        ValueError,
        r"vocab_parallel_cross_entropy: the ranks of the tensor-parallel group got inputs of "
        + _SHAPES.format("7, 11", "6, 11"),
    )
    times.append(t)
    same = torch.Generator().manual_seed(4)  # the same logits and targets on every rank
    full = torch.randn(6, 11 * tp, dtype=torch.float64, generator=same)
    target = torch.randint(0, 11 * tp, (6,), generator=same)
    got = vocab_parallel_cross_entropy(full[:, rank * 11 : (rank + 1) * 11], target, g)
    torch.testing.assert_close(got, F.cross_entropy(full, target), rtol=1e-12, atol=1e-12)

    # the accelerator path (device-side asserts, no host read; on CPU the assert raises a RuntimeError): a rank meeting
    # a new ids shape reads the exchanged shapes and names them, a rank on a shape it knows asserts; neither aborts
    original = _agree.host_checks
    _agree.host_checks = lambda t: False
    try:
        emb(ids)
        if rank == 0:
            with pytest.raises(RuntimeError, match="different shapes on the tp ranks"):
                emb(ids)
        else:
            with pytest.raises(ValueError, match=_SHAPES.format(f"{good[0]}, 3", f"{short[0]}, 3")):
                emb(ids[: short[0]])
    finally:
        _agree.host_checks = original
    return times


@pytest.mark.parametrize("sp", [False, True])
def test_inputs_of_different_element_counts_raise_on_every_rank_naming_the_shapes(sp):
    times = run_ranks(_numel_body, 2, sp, timeout=60)
    assert max(max(t) for t in times) < FAIL_WITHIN


# ---------------------------------------------------------------- model.loss of a tensor-parallel GPT
def _model_loss_body():
    from llmpar.models.gpt import GPT, GPTConfig
    from llmpar.tensor_parallel import TokenIdError, parallelize

    g = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    V = 67
    cfg = GPTConfig(vocab_size=V, n_layer=1, n_head=2, d_model=8, seq_len=7)
    ref = GPT(cfg, seed=1, dtype=torch.float64)
    model = parallelize(GPT(cfg, seed=1, dtype=torch.float64), g)
    idx = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(5))
    y = torch.roll(idx, -1, 1)
    y[1, 2] = -100  # ignored
    logits = model(idx)
    torch.testing.assert_close(
        model.loss(logits, y), F.cross_entropy(ref(idx).reshape(-1, V), y.reshape(-1)), rtol=1e-10, atol=1e-12
    )
    times = []
    for bad, only in [(V, tp - 1), (10**6, 0), (-1, None), (-7, tp - 1)]:
        yb = y.clone()
        if only is None or rank == only:
            yb[2, 4] = bad
        t, err = _timed(lambda: model.loss(logits, yb), TokenIdError, rf"GPT.loss: target .*\[0, {V}\)")
        times.append(t)
        assert isinstance(err, ValueError) and isinstance(err, IndexError)
        assert str(bad) in str(err) and f"vocabulary of {V}" in str(err), str(err)
    model.loss(logits, y).backward()  # the ranks are still in step: the backward's collectives meet
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    split = parallelize(GPT(cfg, seed=1, dtype=torch.float64), g, gather_logits=False)
    with pytest.raises(ValueError, match=rf"GPT.loss: logits have {-(-V // tp)} classes.*vocab_size={V}"):
        split.loss(split(idx), y)
    return times


def test_out_of_range_target_through_model_loss_raises_on_every_rank():
    times = run_ranks(_model_loss_body, 2, timeout=60)
    assert max(max(t) for t in times) < FAIL_WITHIN


def test_out_of_range_target_names_value_and_vocab_size_on_one_process():
    from llmpar.models.gpt import GPT, GPTConfig
    from llmpar.tensor_parallel import TokenIdError

    model = GPT(GPTConfig(vocab_size=13, n_layer=1, n_head=1, d_model=4, seq_len=5))
    idx = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    for bad in (13, -2):
        y = idx.clone()
        y[1, 3] = bad
        for loss in (model.loss, GPT.loss):  # bound to a model, or called on the class
            with pytest.raises(TokenIdError, match=rf"GPT.loss: target id\(s\) \[{bad}\] .*\[0, 13\)"):
                loss(logits, y)
    y = idx.clone()
    y[0, 0] = -100
    assert torch.equal(GPT.loss(logits, y), F.cross_entropy(logits.reshape(-1, 13), y.reshape(-1)))


# ---------------------------------------------------------------- a pipeline data iterator that runs out
PP_MICRO, PP_M, PP_T, PP_V = 2, 4, 6, 29


def _pairs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, PP_V, (PP_MICRO, PP_T), generator=g), torch.randint(0, PP_V, (PP_MICRO, PP_T), generator=g))
        for _ in range(n)
    ]


def _pipeline_data_body():
    """pp=4 on 4 ranks (ranks 1 and 2 run middle stages, which pull no data): the first stage's iterator runs out in
    step 2 (2 of 4 micro-batches), then the last stage's in an eval_batch: every rank raises, naming the rank, the
    step and the micro-batches; the engine then still trains on every rank."""
    import llmpar
    from llmpar.models import GPT, GPTConfig
    from llmpar.runtime.pipeline_engine import DataExhaustedError

    rank = dist.get_rank()
    model = GPT(GPTConfig(vocab_size=PP_V, n_layer=2, n_head=2, d_model=8, seq_len=PP_T), seed=0)
    engine, _, _, _ = llmpar.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": PP_MICRO,
            "steps_per_print": 10**6,
            "pipeline": {"stages": 4, "micro_batches": PP_M},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
    )
    short = rank == 0  # the first stage's data ends two micro-batches early
    it = iter(_pairs(2 * PP_M - (2 if short else 0), 7))
    assert torch.isfinite(engine.train_batch(data_iter=it))
    times = []
    t, err = _timed(
        lambda: engine.train_batch(data_iter=it),
        DataExhaustedError,
        r"train_batch: the data iterator ran out on global rank 0 \(pp stage 0\) in optimizer step 2 "
        rf"after 2 of the {PP_M} micro-batches train_batch pulls",
    )
    times.append(t)
    assert isinstance(err, StopIteration)  # a DeepSpeed loop ending on StopIteration still ends, on every rank
    assert engine.global_steps == 1
    last = rank == 3
    t, err = _timed(
        lambda: engine.eval_batch(iter(_pairs(PP_M - (1 if last else 0), 8))),
        DataExhaustedError,
        rf"eval_batch: the data iterator ran out on global rank 3 \(pp stage 3\) .*after {PP_M - 1} of "
        rf"the {PP_M} micro-batches eval_batch pulls",
    )
    times.append(t)
    x = torch.cat([p[0] for p in _pairs(PP_M, 9)])
    y = torch.cat([p[1] for p in _pairs(PP_M, 9)])
    assert torch.isfinite(engine.train_batch(x, y)) and engine.global_steps == 2
    return times


def test_a_pipeline_data_iterator_running_out_fails_every_rank_clearly():
    times = run_ranks(_pipeline_data_body, 4, timeout=120)
    assert max(max(t) for t in times) < FAIL_WITHIN
