"""Faults between the ranks of a tensor-parallel group or a pipeline fail every rank with a clear error, quickly, and
leave the ranks usable (CPU/gloo ranks):

* tp ranks given inputs of different element counts (the embedding, the vocab-parallel loss) raise a ValueError naming
  each rank's shape on every rank; before, the shape check rode inside the input-sized reduction and gloo aborted the
  process (SIGABRT: "Received data size doesn't match expected size").
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
    from llmpar.tensor_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
    from llmpar.tensor_parallel import _agree

    g = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    V, d = 67, 5
    ref = nn.Embedding(V, d, dtype=torch.float64)
    emb = VocabParallelEmbedding.from_embedding(ref, group=g, sequence_parallel=sp)
    good, short = (2 * tp, 3), (tp, 3)  # dim 0 divisible by tp for sequence parallelism
    ids = torch.randint(0, V, good)
    times = []
    t, err = _timed(lambda: emb(ids[: short[0]] if rank == tp - 1 else ids), ValueError,
                    r"VocabParallelEmbedding: the ranks of the tensor-parallel group got inputs of different shapes")
    times.append(t)
    assert f"group rank 0 {good}" in str(err) and f"group rank {tp - 1} {short}" in str(err)
    want = ref(ids)
    out = emb(ids)
    n = want.shape[0] // tp
    torch.testing.assert_close(out, want[rank * n:(rank + 1) * n] if sp else want, rtol=1e-12, atol=1e-12)

    logits = torch.randn(7 if rank == 0 else 6, 11, dtype=torch.float64)
    target = torch.randint(0, 11 * tp, logits.shape[:1])
    t, err = _timed(lambda: vocab_parallel_cross_entropy(logits, target, g), ValueError,
                    r"vocab_parallel_cross_entropy: the ranks of the tensor-parallel group got inputs of "
                    + _SHAPES.format("7, 11", "6, 11"))
    times.append(t)
    same = torch.Generator().manual_seed(4)  # the same logits and targets on every rank
    full = torch.randn(6, 11 * tp, dtype=torch.float64, generator=same)
    target = torch.randint(0, 11 * tp, (6,), generator=same)
    got = vocab_parallel_cross_entropy(full[:, rank * 11:(rank + 1) * 11], target, g)
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
