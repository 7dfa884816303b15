"""``llmpar.optim.grad_norm``: the one whole-model gradient norm (shared by tensor_parallel.clip_grad_norm_,
PipelineRunner.clip_grad_norm_, ZeroOptimizer and FusedAdamW) against ``torch.nn.utils.clip_grad_norm_`` of the
unsplit model in float64, on fresh random grads of odd shapes in mixed dtypes, spread over the ranks the way the
parallel parts spread them: tensor-parallel shards (summed over tp), replicated grads (counted once), disjoint dp
partitions (summed over dp), pipeline stages (summed over pp) and a weight tied between the first and last stage
(counted once). Runs at tp=2, pp=2, dp=2 on 2 ranks and every pair of them on 4."""

from __future__ import annotations

import pytest
import torch

from llmpar.optim.grad_norm import clip_grad_norm_, clip_grads_, global_grad_norm, param_grads

from multirank import multirank

SHAPES = [(5, 7), (123,), (3, 41), (4097,), (1,), (9, 13), (2, 3, 7), (37,), (17, 5)]
SPLIT = {0, 2, 5, 7}  # tensor-parallel along dim 0 (uneven shards; (37,) on 4 ranks too)
TIED = 3  # held by the first and the last stage; the last stage's copy is the duplicate
MIXED = (torch.float32, torch.bfloat16, torch.float64, torch.float16)
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-14),
    torch.float32: dict(rtol=2e-6, atol=1e-7),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-4),
    torch.float16: dict(rtol=2e-3, atol=1e-5),
}
NORM_RTOL = {"float64": 1e-12, "mixed": 2e-6}  # float32 accumulation for the non-float64 grads
_READS = ("item", "__float__", "__int__", "__bool__", "tolist", "__index__")


def _tol(dtype: torch.dtype, kind: str) -> dict:
    """A clipped grad's tolerance: its dtype's, or the norm's (the coefficient's error) when that is larger."""
    tol = TOL[dtype]
    return dict(rtol=max(tol["rtol"], NORM_RTOL[kind]), atol=tol["atol"])


def _dtypes(kind: str) -> list[torch.dtype]:
    return [torch.float64 if kind == "float64" else MIXED[i % len(MIXED)] for i in range(len(SHAPES))]


def _unsplit_grads(kind: str, seed: int = 0) -> list[torch.Tensor]:
    """The whole model's grads: random (never zero), each its own scale, rounded to its dtype."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in zip(SHAPES, _dtypes(kind)):
        scale = float(torch.empty(()).uniform_(0.1, 3.0, generator=g))
        out.append((torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype))
    return out


def _reference(grads: list[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch.nn.utils.clip_grad_norm_ of the unsplit model in float64: (norm, clipped grads)."""
    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.float64)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.double().clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm, [p.grad for p in params]


def _stages(pp: int, layout: str) -> list[list[int]]:
    """Param indices per stage: "spread" round-robin, "front" all on stage 0 (the last stage holds only the tied
    copy, so its ranks count nothing)."""
    stages = [[i for i in range(len(SHAPES)) if (i % pp if layout == "spread" else 0) == s] for s in range(pp)]
    if pp > 1:
        stages[0] = sorted(set(stages[0]) | {TIED})
        stages[-1] = sorted(set(stages[-1]) | {TIED})
    return stages


def _pieces(t: torch.Tensor, i: int, tp: int, tp_rank: int, dp: int, dp_rank: int) -> tuple[torch.Tensor, slice]:
    """This rank's piece of grad ``i``: its tp shard (dim 0) when split, then its dp partition of that, flattened;
    and where the piece sits in the flattened tp shard."""
    shard = torch.tensor_split(t, tp, dim=0)[tp_rank] if i in SPLIT else t
    flat = shard.reshape(-1)
    bounds = torch.tensor_split(torch.arange(flat.numel()), dp)[dp_rank]
    where = slice(int(bounds[0]), int(bounds[-1]) + 1) if bounds.numel() else slice(0, 0)
    return flat[where].clone(), where


def _no_host_reads():
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def refuse(*_a, **_k):
        raise AssertionError("a host read of a tensor inside the grad norm / clip")

    for name in _READS:
        setattr(torch.Tensor, name, refuse)
    return saved


def _restore(saved):
    for name, fn in saved.items():
        setattr(torch.Tensor, name, fn)


def _check_layout(env, tp: int, pp: int, dp: int, kind: str, layout: str) -> None:
    coords = env.dims.coordinates(env.rank)
    tp_rank, pp_rank, dp_rank = coords["tp"], coords["pp"], coords["dp"]
    tp_group, dp_group, pp_group = (env.mesh[a].get_group() for a in ("tp", "dp", "pp"))
    grads = _unsplit_grads(kind, seed=11 * tp + 7 * pp + 3 * dp + (layout == "front"))
    for max_norm in (0.5, 1e6):  # clipping, and a coefficient of 1 (grads left exactly as they are)
        ref_norm, ref_clipped = _reference(grads, max_norm)
        mine = _stages(pp, layout)[pp_rank]
        repl, split, every, where = [], [], [], {}
        for i in mine:
            piece, at = _pieces(grads[i], i, tp, tp_rank, dp, dp_rank)
            every.append((i, piece))
            where[i] = at
            if i == TIED and pp > 1 and pp_rank == pp - 1:
                continue  # the duplicate copy: not counted again
            (split if i in SPLIT else repl).append(piece)
        before = [p.clone() for _, p in every]
        saved = _no_host_reads()
        try:
            norm = global_grad_norm(repl, split=split, tp_group=tp_group, dp_group=dp_group, pp_group=pp_group)
            clip_grads_([p for _, p in every], max_norm, norm)
        finally:
            _restore(saved)
        what = f"tp={tp} pp={pp} dp={dp} {kind} {layout} max_norm={max_norm}"
        assert norm.dtype == torch.float64 and norm.dim() == 0, what
        torch.testing.assert_close(norm, ref_norm, rtol=NORM_RTOL[kind], atol=0, msg=lambda m: f"{what}: {m}")
        for (i, piece), old in zip(every, before):
            if max_norm == 1e6:
                assert torch.equal(piece, old), (what, i)
                continue
            shard = torch.tensor_split(ref_clipped[i], tp, dim=0)[tp_rank] if i in SPLIT else ref_clipped[i]
            want = shard.reshape(-1)[where[i]]
            torch.testing.assert_close(
                piece.double(),
                want.to(piece.dtype).double(),
                **_tol(piece.dtype, kind),
                msg=lambda m: f"{what} grad {i} ({piece.dtype}): {m}",
            )
        if dp == 1:  # the params-level entry point (tp / runner): whole grads on the params, duplicates skipped
            params, dup = [], []
            for i in mine:
                shard = torch.tensor_split(grads[i], tp, dim=0)[tp_rank] if i in SPLIT else grads[i]
                p = torch.nn.Parameter(torch.zeros(shard.shape, dtype=shard.dtype))
                p.grad = shard.clone()
                if i in SPLIT:
                    p.tensor_model_parallel = True
                params.append(p)
                if i == TIED and pp > 1 and pp_rank == pp - 1:
                    dup.append(p)
            got = clip_grad_norm_(
                params + params[:1], max_norm, tp_group=env.mesh["tp"], pp_group=env.mesh["pp"], skip=dup
            )  # a param listed twice counts (and is clipped) once
            torch.testing.assert_close(got, norm, rtol=NORM_RTOL[kind], atol=0, msg=lambda m: f"{what}: {m}")
            for i, p in zip(mine, params):
                if max_norm != 1e6:
                    shard = torch.tensor_split(ref_clipped[i], tp, dim=0)[tp_rank] if i in SPLIT else ref_clipped[i]
                    torch.testing.assert_close(p.grad.double(), shard.to(p.dtype).double(), **_tol(p.dtype, kind))


@multirank(2, 4, timeout=240)
def test_norm_of_the_unsplit_model_over_tp_pp_dp():
    import torch.distributed as dist

    import llmpar

    world = dist.get_world_size()
    configs = [(2, 1, 1), (1, 2, 1), (1, 1, 2)] if world == 2 else [(2, 2, 1), (2, 1, 2), (1, 2, 2)]
    for tp, pp, dp in configs:
        env = llmpar.init_distributed(tp=tp, pp=pp)
        assert env.dims.dp == dp
        for kind in ("float64", "mixed"):
            for layout in ("spread", "front") if pp > 1 else ("spread",):
                _check_layout(env, tp, pp, dp, kind, layout)


# ------------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("kind", ["float64", "mixed"])
def test_single_process_matches_torch(kind):
    grads = _unsplit_grads(kind, seed=5)
    ref_norm, ref_clipped = _reference(grads, 0.25)
    norm = global_grad_norm(grads)
    assert norm.dtype == torch.float64 and norm.dim() == 0
    torch.testing.assert_close(norm, ref_norm, rtol=NORM_RTOL[kind], atol=0)
    split_half = global_grad_norm(grads[::2], split=grads[1::2])  # without a tp group the split ones are local too
    torch.testing.assert_close(split_half, norm, rtol=NORM_RTOL[kind], atol=0)
    clip_grads_(grads, 0.25, norm)
    for g, want in zip(grads, ref_clipped):
        torch.testing.assert_close(g.double(), want.to(g.dtype).double(), **_tol(g.dtype, kind))


def test_float64_grads_are_not_rounded_to_float32():
    g = torch.full((4097,), 1.0 + 2.0**-40, dtype=torch.float64)  # a float32 sum would lose the 2^-40
    want = (g.square().sum()).sqrt()
    assert global_grad_norm([g]).item() == pytest.approx(want.item(), rel=1e-15)
    assert global_grad_norm([g]).item() != pytest.approx(float(g.float().square().sum().sqrt()), rel=1e-14)


def test_non_finite_grads_give_a_non_finite_norm_and_torch_clipping():
    grads = [torch.randn(7, generator=torch.Generator().manual_seed(1)), torch.tensor([1.0, float("inf")])]
    norm = global_grad_norm(grads)
    assert torch.isinf(norm)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    ref = torch.nn.utils.clip_grad_norm_(params, 1.0)
    clip_grads_(grads, 1.0, norm)  # torch's: coefficient 0, so inf * 0 = nan, finite grads -> 0
    assert torch.isinf(ref)
    for g, p in zip(grads, params):
        torch.testing.assert_close(g, p.grad, equal_nan=True)


def test_param_grads_sorts_and_skips():
    a, b, c, d = (torch.nn.Parameter(torch.randn(3)) for _ in range(4))
    a.grad, b.grad, c.grad = torch.ones(3), torch.ones(3), torch.ones(3)
    b.tensor_model_parallel = True
    repl, split = param_grads([a, b, c, d, a], skip=[c])
    assert [id(g) for g in repl] == [id(a.grad)] and [id(g) for g in split] == [id(b.grad)]


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="grads must be an iterable of tensors"):
        global_grad_norm(torch.ones(3))
    with pytest.raises(TypeError, match=r"split\[0\] must be a floating-point tensor"):
        global_grad_norm([], split=[torch.ones(3, dtype=torch.int64)])
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="max_norm=.* must be a positive finite number"):
            clip_grads_([torch.ones(2)], bad, torch.ones(()))
    assert global_grad_norm([]).item() == 0.0  # nothing here: a zero on the CPU
