"""Tensor parallelism never returns silently wrong state (issue #15, items 8 and 9), on CPU/gloo ranks:

* a ParallelLMHead's split logits carry -inf in the padding columns, so ``vocab_parallel_cross_entropy`` without
  ``vocab_size`` equals F.cross_entropy over the real vocabulary (float64 reference, odd vocabularies, label smoothing),
  gradients included;
* a target id in the padding or out of range, and a token id outside a VocabParallelEmbedding's vocabulary, raise on
  every rank, also when only one rank holds the bad id (no rank left waiting);
* inputs of different shapes (same element count) on the tp ranks raise on every rank, naming the shapes; a layer
  checks a new shape once and remembers it.
"""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmpar.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TokenIdError,
    VocabParallelEmbedding,
    _agree,
    vocab_parallel_cross_entropy,
)

from multirank import multirank, run_ranks

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=1e-5, atol=2e-6)}
FAIL_WITHIN = 30.0  # seconds: a bad input on one rank must fail every rank well before this


def _close(got, want, what, dtype=torch.float64):
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _shard(t, dim=0):
    tp, rank = dist.get_world_size(), dist.get_rank()
    n = -(-t.shape[dim] // tp)
    padded = F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, n * tp - t.shape[dim]])
    return padded.narrow(dim, rank * n, n)


# ---------------------------------------------------------------- item 8: loss over a padded vocabulary
def _loss_parity_body(V: int, smoothing: float, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    g = dist.group.WORLD
    torch.manual_seed(V)
    d, shape = 9, (3, 5)
    ref = nn.Linear(d, V, bias=True, dtype=torch.float64)
    x = torch.randn(*shape, d, dtype=torch.float64)
    target = torch.randint(0, V, shape)
    target[0, 1], target[1, 2], target[2, 4] = -100, V - 1, 0  # ignored, last real id, first id
    xr = x.clone().requires_grad_()
    want = F.cross_entropy(ref(xr).reshape(-1, V), target.reshape(-1), label_smoothing=smoothing, reduction="none")
    want.sum().backward()

    head = ParallelLMHead.from_linear(ref, group=g).to(dtype)
    xp = x.to(dtype).requires_grad_()
    logits = head(xp)
    tp = dist.get_world_size()
    real = min(max(V - dist.get_rank() * logits.shape[-1], 0), logits.shape[-1])
    assert torch.isneginf(logits[..., real:]).all() and torch.isfinite(logits[..., :real]).all()
    per_tok = vocab_parallel_cross_entropy(logits, target, g, label_smoothing=smoothing, reduction="none")
    _close(per_tok.reshape(-1), want.detach(), f"per-token loss V={V} tp={tp}", dtype)
    mean = vocab_parallel_cross_entropy(logits, target, g, label_smoothing=smoothing)
    _close(mean, want.detach().sum() / (target != -100).sum(), "mean loss", dtype)
    per_tok.sum().backward()
    _close(xp.grad, xr.grad, "input grad", dtype)
    _close(head.weight.grad, _shard(ref.weight.grad), "head weight grad (padded rows: zero)", dtype)
    _close(head.bias.grad, _shard(ref.bias.grad), "head bias grad", dtype)
    # vocab_size= still works and agrees; so does a gathered head (padding dropped, no -inf)
    explicit = vocab_parallel_cross_entropy(
        logits.detach(), target, g, label_smoothing=smoothing, vocab_size=V, reduction="none"
    )
    _close(explicit, per_tok.detach(), "vocab_size= given", dtype)
    gathered = ParallelLMHead.from_linear(ref, group=g, gather_output=True)(x)
    _close(gathered, ref(x), "gathered logits", torch.float64)


@pytest.mark.parametrize("world_size", (1, 2, 4))
@pytest.mark.parametrize("V,smoothing", [(67, 0.0), (67, 0.1), (5, 0.3), (1001, 0.0)])
def test_loss_without_vocab_size_equals_cross_entropy_over_the_real_vocabulary(world_size, V, smoothing):
    for dtype in ("float64", "float32"):
        run_ranks(_loss_parity_body, world_size, V, smoothing, dtype)


def _bad_target_body(V: int, bad_id: int, only_rank: int | None, smoothing: float):
    g = dist.group.WORLD
    torch.manual_seed(0)
    head = ParallelLMHead(7, V, bias=False, group=g)
    logits = head(torch.randn(4, 3, 7))
    target = torch.randint(0, V, (4, 3))
    if only_rank is None or dist.get_rank() == only_rank:
        target[2, 1] = bad_id
    start = time.monotonic()
    with pytest.raises(TokenIdError, match=r"vocab_parallel_cross_entropy: target .*\[0, \d+\)") as err:
        vocab_parallel_cross_entropy(logits, target, g, label_smoothing=smoothing)
    assert isinstance(err.value, ValueError) and isinstance(err.value, IndexError)
    return time.monotonic() - start, str(err.value)


@pytest.mark.parametrize("world_size", (2, 4))
def test_target_in_the_padding_or_out_of_range_raises_on_every_rank(world_size):
    V = 67  # padded to 68 (tp 2, 4): id 67 is a padding column
    for bad_id, smoothing in [(67, 0.0), (67, 0.1), (68, 0.0), (10**6, 0.0), (-1, 0.0)]:
        results = run_ranks(_bad_target_body, world_size, V, bad_id, None, smoothing, timeout=60)
        assert all(f"{bad_id}" in msg for _, msg in results), results
        if bad_id == 67:
            assert all("real vocabulary of 67 classes" in msg for _, msg in results)
    for only in (0, world_size - 1):  # one rank only: the others must raise too, not wait
        results = run_ranks(_bad_target_body, world_size, V, 10**6, only, 0.0, timeout=60)
        assert all(f"on tp group rank(s) [{only}]" in msg for _, msg in results), results
        assert max(t for t, _ in results) < FAIL_WITHIN


# ---------------------------------------------------------------- item 8: embedding ids outside the vocabulary
def _embedding_body(sp: bool, bad_id: int | None, only_rank: int | None):
    g = dist.group.WORLD
    tp = dist.get_world_size()
    torch.manual_seed(1)
    V, d = 67, 5
    ref = nn.Embedding(V, d, dtype=torch.float64)
    emb = VocabParallelEmbedding.from_embedding(ref, group=g, sequence_parallel=sp)
    ids = torch.randint(0, V, (4 * tp if sp else 5, 3))
    ids[0, 0], ids[1, 2] = V - 1, 0
    if bad_id is None:  # parity, forward and backward
        out = emb(ids)
        want = ref(ids)
        _close(out, _shard(want) if sp else want, "embedding output")
        w = torch.randn_like(want)
        (out * (_shard(w) if sp else w)).sum().backward()
        (want * w).sum().backward()
        _close(emb.weight.grad, _shard(ref.weight.grad), "embedding grad")
        return 0.0
    if only_rank is None or dist.get_rank() == only_rank:
        ids[2, 1] = bad_id
    start = time.monotonic()
    with pytest.raises(IndexError, match=rf"token ids outside \[0, {V}\)") as err:
        emb(ids)
    assert isinstance(err.value, TokenIdError) and isinstance(err.value, ValueError)
    if only_rank is None or dist.get_rank() == only_rank:
        assert str(bad_id) in str(err.value)
    return time.monotonic() - start


@pytest.mark.parametrize("world_size", (1, 2, 4))
@pytest.mark.parametrize("sp", [False, True])
def test_embedding_matches_and_out_of_range_ids_raise_on_every_rank(world_size, sp):
    run_ranks(_embedding_body, world_size, sp, None, None)
    for bad_id in (67, 68, 500, -1):  # 67 (and 68 at tp 4) is a padding row of the split table
        run_ranks(_embedding_body, world_size, sp, bad_id, None)
    if world_size > 1:
        times = run_ranks(_embedding_body, world_size, sp, 10**5, world_size - 1, timeout=60)
        assert max(times) < FAIL_WITHIN


# ---------------------------------------------------------------- item 9: inputs of different shapes
def _shape_body(layer_kind: str, sp: bool):
    g = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(2)
    if layer_kind == "embedding":
        layer = VocabParallelEmbedding(67, 4, group=g, sequence_parallel=sp)
        make = lambda shape: torch.randint(0, 67, shape)  # noqa: E731
    elif layer_kind == "column":
        layer = ColumnParallelLinear(8, 4 * tp, group=g, sequence_parallel=sp)
        make = lambda shape: torch.randn(*shape, 8)  # noqa: E731
    else:
        layer = RowParallelLinear(4 * tp, 8, group=g, sequence_parallel=sp)
        make = lambda shape: torch.randn(*shape, 4)  # noqa: E731
    good, swapped = (tp, 3 * tp), (3 * tp, tp)  # dim 0 divisible by tp for sequence parallelism
    if layer_kind == "embedding":  # checked on every call: a shape agreed before changes nothing
        layer(make(good))
    # (a linear layer checks a shape new to it: a rank reusing an agreed shape would skip the check; see _agree)
    shape = swapped if rank == tp - 1 else good
    name = type(layer).__name__
    with pytest.raises(
        ValueError,
        match=rf"{name}: the ranks of the tensor-parallel group got inputs of different "
        r"shapes \(group rank 0 .*group rank \d+ \(",
    ) as err:
        layer(make(shape))
    assert str(tuple(make(swapped).shape)) in str(err.value) and str(tuple(make(good).shape)) in str(err.value)


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize(
    "layer_kind,sp",
    [("embedding", False), ("embedding", True), ("column", False), ("column", True), ("row", False), ("row", True)],
)
def test_inputs_of_different_shapes_raise_on_every_rank_naming_them(world_size, layer_kind, sp):
    run_ranks(_shape_body, world_size, layer_kind, sp, timeout=60)


def _loss_shape_body():
    g = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    logits = torch.randn(24, 5)
    target = torch.randint(0, 5 * tp, (24,))
    vocab_parallel_cross_entropy(logits, target, g)
    shape = (6, 4) if rank == 1 else (4, 6)
    with pytest.raises(
        ValueError,
        match=r"vocab_parallel_cross_entropy: the ranks of the tensor-parallel group got "
        r"inputs of different shapes \(group rank 0 \(4, 6, 5\), group rank 1 "
        r"\(6, 4, 5\)",
    ):
        vocab_parallel_cross_entropy(logits.view(*shape, 5), target.view(shape), g)


@multirank(2, 4)
def test_loss_on_logits_of_different_shapes_raises_on_every_rank():
    _loss_shape_body()


def _guard_counts_body():
    g = dist.group.WORLD
    calls = []
    original = _agree.check_same_shape
    _agree.check_same_shape = lambda *a, **k: (calls.append(a[0]), original(*a, **k))[1]
    try:
        fc = ColumnParallelLinear(8, 2 * dist.get_world_size(), group=g)
        for shape in [(4, 6), (4, 6), (4, 6), (3, 8), (4, 6), (3, 8)]:
            fc(torch.randn(*shape, 8))
    finally:
        _agree.check_same_shape = original
    return [tuple(c) for c in calls]


@multirank(2)
def test_a_layer_checks_each_new_shape_once():
    assert _guard_counts_body() == [(4, 6, 8), (3, 8, 8)]


def _model_later_step_body():
    """Shapes agreed on steps 1-2; on step 3 one rank's batch has another shape: the embedding (always on) catches it
    before any linear layer (whose cache would skip the check on the ranks that kept the old shape)."""
    from llmpar.models.gpt import GPT, GPTConfig
    from llmpar.tensor_parallel import parallelize

    g = dist.group.WORLD
    model = parallelize(
        GPT(GPTConfig(vocab_size=67, n_layer=1, n_head=4, d_model=16, seq_len=8)), g, gather_logits=False
    )
    idx = torch.randint(0, 67, (4, 4), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        assert torch.isfinite(vocab_parallel_cross_entropy(model(idx), idx, g))
    with pytest.raises(
        ValueError,
        match=r"VocabParallelEmbedding: .*different shapes \(group rank 0 \(4, 4\), "
        r"group rank 1 \(2, 8\)",
    ):
        model(idx.view(2, 8) if dist.get_rank() == 1 else idx)  # same element count, other shape


@multirank(2, 4)
def test_a_model_catches_a_shape_change_on_a_later_step():
    _model_later_step_body()


# ---------------------------------------------------------------- accelerator path, exercised on CPU
def _device_path_body():
    """The checks taken on accelerators (device-side asserts, no host read) fire on every rank too; on CPU the
    assert raises a RuntimeError where a GPU would stop on a device-side assert."""
    g = dist.group.WORLD
    original = _agree.host_checks
    _agree.host_checks = lambda t: False
    try:
        head = ParallelLMHead(5, 67, group=g)
        logits = head(torch.randn(6, 5))
        target = torch.randint(0, 67, (6,))
        loss = vocab_parallel_cross_entropy(logits, target, g, label_smoothing=0.1)  # good input: no assert
        target[3] = 67 if dist.get_world_size() > 1 else 10**6
        with pytest.raises(RuntimeError, match="vocab_parallel_cross_entropy"):
            vocab_parallel_cross_entropy(logits, target, g)
        bad = target.clone()
        if dist.get_rank() == 0:
            bad[1] = 10**6
        with pytest.raises(RuntimeError, match=r"outside \[0, \d+\)"):
            vocab_parallel_cross_entropy(logits, bad, g)
        emb = VocabParallelEmbedding(67, 4, group=g)
        emb(torch.randint(0, 67, (3, 4)))
        if dist.get_world_size() > 1:
            ids = torch.randint(0, 67, (3, 4))
            if dist.get_rank() == 0:
                ids[0, 0] = 67
            with pytest.raises(RuntimeError, match=r"token ids outside \[0, 67\)"):
                emb(ids)
            with pytest.raises(ValueError, match="different shapes"):  # a new shape: read once, clear error
                emb(torch.randint(0, 67, (4, 3) if dist.get_rank() == 0 else (2, 6)))
        return float(loss)
    finally:
        _agree.host_checks = original


@multirank(1, 2, 4)
def test_accelerator_checks_assert_on_every_rank():
    _device_path_body()
