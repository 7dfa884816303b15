"""Context parallelism (llmpar.context_parallel): sharding, Ulysses / ring / hybrid attention and the token mean,
against a float64 single-device reference (plain softmax over the whole sequence), on 2, 3 and 4 gloo ranks.

One multi-rank launch per world size runs every case (modes, odd lengths, causal + padding, GQA, dtypes, bad inputs,
the token mean), as the suite's budget asks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from llmpar.context_parallel import ContextParallel, SeqShard, layout, padded_length, shard_tensor
from llmpar.context_parallel.ring import RingStats
from llmpar.distributed import all_to_all_single, exchange

from multirank import run_ranks

# ----------------------------------------------------------------------------- reference


def reference_attention(q, k, v, *, causal: bool, valid: torch.Tensor | None) -> torch.Tensor:
    """Plain softmax attention in q's dtype over the whole sequence: q [B, Hq, S, D], k / v [B, Hkv, S, D],
    valid [B, S] bool; a row that sees no key gives 0."""
    B, Hq, S, D = q.shape
    g = Hq // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(D)
    vis = torch.ones(B, 1, S, S, dtype=torch.bool)
    if causal:
        vis = vis & torch.ones(S, S, dtype=torch.bool).tril()
    if valid is not None:
        vis = vis & valid[:, None, None, :]
    p = torch.softmax(s.masked_fill(~vis, -1e300), dim=-1) * vis.any(-1, keepdim=True)
    return p @ vv


# ----------------------------------------------------------------------------- single-process: sharding


@pytest.mark.parametrize(
    "mode,ring,uly,seq_len",
    [("ulysses", 1, 3, 37), ("ring", 4, 1, 61), ("ring", 3, 1, 5), ("hybrid", 2, 2, 37), ("hybrid", 3, 2, 61)],
)
def test_layout_covers_each_token_once_ascending(mode, ring, uly, seq_len):
    padded, table = layout(seq_len, mode, ring, uly)
    sp = ring * uly
    assert padded == padded_length(seq_len, mode, sp)
    assert padded >= seq_len and padded % (sp if mode == "ulysses" else 2 * sp) == 0
    assert padded - seq_len < (sp if mode == "ulysses" else 2 * sp)
    assert sorted(table.reshape(-1).tolist()) == list(range(padded))
    for row in table:
        assert bool((row[1:] > row[:-1]).all())
    if mode != "ulysses":  # zigzag: ring rank r's group holds chunks r and 2R-1-r; each group's set ascending
        chunk = padded // (2 * ring)
        for r, group in enumerate(table.view(ring, -1)):
            want = list(range(r * chunk, (r + 1) * chunk)) + list(
                range((2 * ring - 1 - r) * chunk, (2 * ring - r) * chunk)
            )
            assert group.tolist() == want
    else:
        assert table.reshape(-1).tolist() == list(range(padded))


def test_shard_tensor_pads_and_selects():
    shard = SeqShard(index=torch.tensor([1, 6, 7]), padded_len=8, seq_len=7)
    x = torch.randn(2, 7, 3, dtype=torch.float64, requires_grad=True)
    y = shard_tensor(x, shard, dim=1, pad_value=-5.0)
    assert torch.equal(y[:, :2], x[:, [1, 6]]) and bool((y[:, 2] == -5.0).all())
    y.sum().backward()
    assert x.grad[:, [1, 6]].eq(1).all() and x.grad[:, [0, 2, 3, 4, 5]].eq(0).all()
    labels = shard_tensor(torch.arange(7)[None], shard, dim=-1, pad_value=-100)
    assert labels.tolist() == [[1, 6, -100]]
    assert shard.valid.tolist() == [True, True, False]
    with pytest.raises(ValueError, match="seq_len=7"):
        shard_tensor(torch.zeros(2, 6), shard, dim=1)
    with pytest.raises(TypeError, match="SeqShard"):
        shard_tensor(x, (shard.index, 8, 7))
    with pytest.raises(TypeError, match="seq_len must be an int"):
        padded_length(7.0, "ring", 2)
    with pytest.raises(ValueError, match="mode='zigzag'"):
        layout(7, "zigzag", 2, 1)


def test_ring_stats_fraction():
    stats = RingStats(forward_compute_s=[3.0], forward_wait_s=[1.0], backward_compute_s=[4.0], backward_wait_s=[2.0])
    assert stats.exposed_fraction() == pytest.approx(0.3)
    stats.reset()
    assert stats.exposed_fraction() == 0.0


# ----------------------------------------------------------------------------- multi-rank


def _groups(world: int, mode: str, uly: int):
    """(ulysses_group, ring_group) for this rank; hybrid: Ulysses groups of adjacent ranks, ring groups across."""
    me = dist.get_rank()
    if mode == "ulysses":
        return dist.group.WORLD, None
    if mode == "ring":
        return None, dist.group.WORLD
    ring = world // uly
    mine = {}
    for i in range(ring):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(i * uly, (i + 1) * uly)))
        if me // uly == i:
            mine["u"] = g
    for j in range(uly):
        g = dist.new_group(list(range(j, world, uly)))
        if me % uly == j:
            mine["r"] = g
    return mine["u"], mine["r"]


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max |a - b| relative to max |scale| (default b; at least 1e-3, values here are O(1)): a shard is compared on
    the whole tensor's scale."""
    scale = b if scale is None else scale
    return float(
        (a.detach().double() - b.detach().double()).abs().max() / scale.detach().double().abs().max().clamp(min=1e-3)
    )


def _attention_case(cp: ContextParallel, case: dict) -> None:
    seq_len, B, Hq, Hkv, D = case["seq_len"], case["B"], case["Hq"], case["Hkv"], case["D"]
    causal, dtype = case["causal"], case["dtype"]
    gen = torch.Generator().manual_seed(case["seed"])  # the same full data on every rank
    q = torch.randn(B, Hq, seq_len, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, seq_len, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, seq_len, D, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, Hq, seq_len, D, generator=gen, dtype=torch.float64)
    valid = None
    if case["padding"]:  # left padding of batch row 0 over its first 60% (some rank sees only padding keys)
        valid = torch.rand(B, seq_len, generator=gen) > 0.2
        valid[0, : int(0.6 * seq_len)] = False
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_in, causal=causal, valid=valid)
    ref.backward(dout)

    shard = cp.shard(seq_len, "cpu")
    real = shard.valid
    mine = shard.index[real]
    local = [shard_tensor(t, shard, dim=2).to(dtype).requires_grad_() for t in (q, k, v)]
    # pad_value=True: the keys added to reach padded_len must be masked by position, whatever k_valid says
    lvalid = None if valid is None else shard_tensor(valid, shard, dim=1, pad_value=True)
    with cp.batch(shard, lvalid):
        out = cp.attention(*local, causal=causal, **cp.attention_kwargs())
    out.backward(shard_tensor(dout, shard, dim=2).to(dtype))
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    name = f"{cp!r} {case}"
    assert out.dtype == dtype and bool(torch.isfinite(out).all()), name
    for got, want, what in (
        (out, ref, "out"),
        (local[0].grad, ref_in[0].grad, "dq"),
        (local[1].grad, ref_in[1].grad, "dk"),
        (local[2].grad, ref_in[2].grad, "dv"),
    ):
        assert bool(torch.isfinite(got).all()), f"{what} not finite: {name}"
        if mine.numel():
            err = _rel(got[:, :, real], want[:, :, mine], want)
            assert err <= tol, f"{what} rel err {err:.2e} > {tol}: {name}"
    for t in local[1:]:  # keys added to reach padded_len are never seen: no gradient
        assert bool((t.grad[:, :, ~real] == 0).all()), name


def _grad_parity_case(cp: ContextParallel, seed: int) -> None:
    """The cp ranks' parameter gradients, from token_mean(grad_factor=1), sum to the single-device gradient of the
    full-sequence mean loss; token_mean's default factor is sp."""
    seq_len, B, H, D = 23, 2, 12, 6
    gen = torch.Generator().manual_seed(seed)
    q, k, v, c = (torch.randn(B, H, seq_len, D, generator=gen, dtype=torch.float64) for _ in range(4))
    labels_ok = torch.rand(B, seq_len, generator=gen) > 0.3  # tokens that count in the loss
    w_ref = torch.randn(D, generator=gen, dtype=torch.float64).requires_grad_()
    w = w_ref.detach().clone().requires_grad_()
    per_tok = (reference_attention(q * w_ref, k, v, causal=True, valid=None) * c).sum((1, 3))  # [B, S]
    ref_loss = per_tok[labels_ok].sum() / labels_ok.sum()
    ref_loss.backward()

    shard = cp.shard(seq_len, "cpu")
    ql, kl, vl, cl = (shard_tensor(t, shard, dim=2) for t in (q, k, v, c))
    ok = shard_tensor(labels_ok, shard, dim=1, pad_value=False)
    out = cp.attention(ql * w, kl, vl, shard=shard)
    local_tok = (out * cl).sum((1, 3))
    loss = cp.token_mean(local_tok[ok].sum(), int(ok.sum()), grad_factor=1.0)
    assert _rel(loss, ref_loss) < 1e-12, (cp, float(loss), float(ref_loss))
    loss.backward()
    total = w.grad.clone()
    for g in cp.groups:
        dist.all_reduce(total, group=g.get())
    assert _rel(total, w_ref.grad) < 1e-10, cp
    x = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    cp.token_mean(x * 2, 3).backward()
    assert float(x.grad) == pytest.approx(2 * cp.size / (3 * cp.size))


def _token_mean_cases(cp: ContextParallel) -> None:
    gen = torch.Generator().manual_seed(7)
    sums = torch.randn(cp.size, dtype=torch.float64, generator=gen)
    counts = torch.randint(0, 9, (cp.size,), generator=gen)
    counts[0] = 0  # a rank with no real token
    x = sums[cp.rank].clone().requires_grad_()
    loss = cp.token_mean(x, torch.tensor(int(counts[cp.rank])))
    assert float(loss) == pytest.approx(float(sums.sum() / counts.sum()), rel=1e-12)
    loss.backward()
    assert float(x.grad) == pytest.approx(cp.size / float(counts.sum()), rel=1e-12)
    y = torch.tensor(0.0, requires_grad=True)  # no real token anywhere: 0, never NaN
    zero = cp.token_mean(y, 0)
    zero.backward()
    assert float(zero) == 0.0 and math.isfinite(float(y.grad))


def _bad_inputs(cp: ContextParallel) -> None:
    """Every rank raises the same error locally, before any collective (the next case would hang otherwise)."""
    shard = cp.shard(19, "cpu")
    S = shard.local_len
    ok = torch.randn(1, 4, S, 8)
    if cp.ulysses_size > 1:
        heads = 3 if cp.ulysses_size != 3 else 4
        with pytest.raises(ValueError, match=rf"query heads {heads} \(kv heads 1\).*u={cp.ulysses_size}"):
            cp.attention(torch.randn(1, heads, S, 8), torch.randn(1, 1, S, 8), torch.randn(1, 1, S, 8), shard=shard)
    with pytest.raises(ValueError, match=f"S_local={S + 1}"):
        cp.attention(torch.randn(1, 4, S + 1, 8), torch.randn(1, 4, S + 1, 8), torch.randn(1, 4, S + 1, 8), shard=shard)
    with pytest.raises(ValueError, match="k_valid must be a bool tensor"):
        cp.attention(ok, ok, ok, shard=shard, k_valid=torch.ones(1, S))
    with pytest.raises(ValueError, match=r"must both be \[1, kv_heads"):
        cp.attention(ok, ok[..., :4], ok, shard=shard)
    with pytest.raises(ValueError, match="was not made by this"):
        cp.attention(ok, ok, ok, shard=SeqShard(index=torch.arange(S), padded_len=S, seq_len=S))
    with pytest.raises(TypeError, match="shard must be a SeqShard"):
        cp.attention(ok, ok, ok, shard=None)
    with pytest.raises(RuntimeError, match="outside `with cp.batch"):
        cp.attention_kwargs()
    with pytest.raises(ValueError, match="scale must be a finite number"):
        cp.attention(ok, ok, ok, shard=shard, scale=float("nan"))
    with pytest.raises(ValueError, match="same size, a multiple of the group size"):
        all_to_all_single(torch.empty(cp.size + 1), torch.empty(cp.size + 1), dist.group.WORLD)
    with pytest.raises(ValueError, match="contiguous"):
        exchange([(torch.empty(4, 4).t(), 0)], [], dist.group.WORLD)
    with pytest.raises(ValueError, match="peer=9"):
        exchange([], [(torch.empty(3), 9)], dist.group.WORLD)
    with pytest.raises(ValueError, match="grad_factor"):
        cp.token_mean(torch.tensor(1.0), 1, grad_factor=0.0)
    with pytest.raises(ValueError, match="non-negative whole number"):
        cp.token_mean(torch.tensor(1.0), torch.tensor(-1))
    with pytest.raises(ValueError, match="mode='ring' takes no ulysses_group"):
        ContextParallel("ring", ring_group=dist.group.WORLD, ulysses_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="mode='hybrid' needs ring_group"):
        ContextParallel("hybrid", ulysses_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="mode='stripes'"):
        ContextParallel("stripes", ring_group=dist.group.WORLD)


def _run_modes(modes: list[tuple[str, int]], cases: list[dict]) -> dict:
    world = dist.get_world_size()
    stats = {}
    for mode, uly in modes:
        ug, rg = _groups(world, mode, uly)
        cp = ContextParallel(mode, ulysses_group=ug, ring_group=rg)
        assert cp.size == world and cp.rank == dist.get_rank()
        _bad_inputs(cp)
        for case in cases:
            if case.get("modes") and mode not in case["modes"]:
                continue
            _attention_case(cp, case)
        _grad_parity_case(cp, seed=world)
        _token_mean_cases(cp)
        if mode == "hybrid":  # ring groups that mix Ulysses ranks: refused on every rank
            me = dist.get_rank()
            bad_ring = [dist.new_group(r) for r in ([0, 3], [1, 2])][0 if me in (0, 3) else 1]
            with pytest.raises(ValueError, match="do not form a grid"):
                ContextParallel(mode, ulysses_group=ug, ring_group=bad_ring)
        cp.check_batch(37, "same ids")
        with pytest.raises(ValueError, match="cp ranks of a group were fed different tensor shapes"):
            cp.check_batch(37 + (cp.rank == cp.size - 1), "same ids")
        with pytest.raises(ValueError, match=r"same shapes but different contents \(fingerprint differ"):
            cp.check_batch(37, "same ids" if cp.rank else "other ids")
        stats[mode] = (
            len(cp.ring_stats.forward_wait_s),
            len(cp.ring_stats.backward_wait_s),
            cp.ring_stats.exposed_fraction(),
        )
    return stats


def _case(seq_len, Hq, Hkv, *, causal=True, padding=False, dtype=torch.float64, seed=0, modes=None, B=2, D=8):
    return dict(
        seq_len=seq_len, B=B, Hq=Hq, Hkv=Hkv, D=D, causal=causal, padding=padding, dtype=dtype, seed=seed, modes=modes
    )


@pytest.mark.parametrize("world", [2, 3, 4])
def test_context_parallel_attention_matches_single_device(world):
    heads = {2: (4, 2), 3: (6, 2), 4: (8, 2)}[world]  # GQA; with u = world > kv heads for 3 and 4 ranks
    cases = [
        _case(37, *heads, seed=1),  # odd length, causal
        _case(61, heads[0], heads[0], causal=False, padding=True, seed=2),  # non-causal, key padding
        _case(61, *heads, padding=True, dtype=torch.float32, seed=3),  # fp32, left padding, GQA
        _case(5, heads[0], 1, padding=True, seed=4),  # shorter than 2*sp: all-padding ranks
    ]
    modes = [("ulysses", world), ("ring", 1)] + ([("hybrid", 2)] if world == 4 else [])
    stats = run_ranks(_run_modes, world, modes, cases, timeout=120)
    for per_rank in stats:
        for mode, (fwd, bwd, frac) in per_rank.items():
            ring = {"ulysses": 1, "ring": world, "hybrid": world // 2}[mode]
            n_ring_calls = len(cases) + 1  # every case plus the gradient-parity one
            assert fwd == (ring * n_ring_calls if mode != "ulysses" else 0), (mode, fwd)
            assert bwd == ((ring + 1) * n_ring_calls if mode != "ulysses" else 0), (mode, bwd)
            assert 0.0 <= frac <= 1.0


def test_import_llmpar_sequence_points_to_context_parallel():
    """DeepSpeed's ``deepspeed.sequence`` (Ulysses) has its counterpart in llmpar: the ImportError of
    ``llmpar.sequence`` names ``llmpar.context_parallel`` as that counterpart, never "no counterpart" or "not
    provided"."""
    import importlib

    with pytest.raises(ImportError) as info:
        importlib.import_module("llmpar.sequence.layer")
    message = str(info.value)
    assert "DeepSpeed's deepspeed.sequence is llmpar.context_parallel in llmpar" in message, message
    assert 'ContextParallel.from_mesh(mesh, "ulysses")' in message, message
    assert "no counterpart" not in message and "not provided" not in message, message
