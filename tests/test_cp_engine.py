"""Context parallelism through llmpar.initialize: the llmpar GPT split along the sequence (Ulysses, ring, hybrid;
with dp, ZeRO 2 / 3, tp, gradient accumulation, activation checkpointing, padding) trains exactly as the unsplit model
on one process (float64: losses, every reduced gradient and the grad norms to 1e-10), and bad configs fail on every
rank with a message naming the key."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import llmpar
from llmpar.models import GPT, GPTConfig
from llmpar.optim import FusedAdamW
from llmpar.runtime.config import Blocks
from llmpar.runtime.logs import describe

from multirank import run_ranks

CFG = dict(vocab_size=61, n_layer=2, n_head=4, d_model=32, seq_len=16)
T, MICRO, GAS, STEPS, LR, WD, CLIP = 13, 2, 2, 2, 1e-2, 0.1, 0.5


def batch(step: int, micro: int, dp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full micro-batch of all dp ranks ([dp * MICRO, T]): ids, next-token targets (a few -100), and a right-padding
    mask; at (step 1, micro 0) every row is short, so the ranks holding the sequence's tail hold padding only."""
    g = torch.Generator().manual_seed(100 * step + micro)
    n = dp * MICRO
    x = torch.randint(0, CFG["vocab_size"], (n, T + 1), generator=g)
    idx, targets = x[:, :-1], x[:, 1:].clone()
    targets[torch.rand(n, T, generator=g) < 0.15] = -100
    lengths = (
        torch.randint(2, 5, (n,), generator=g)
        if (step, micro) == (1, 0)
        else torch.randint(T - 5, T + 1, (n,), generator=g)
    )
    mask = torch.arange(T)[None] < lengths[:, None]
    return idx, targets, mask


def _config(cp: dict, stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage},
        "context_parallel": cp,
        **extra,
    }


def mismatched_batches(engine, dp: int, dp_rank: int) -> list[str]:
    """The errors of three forwards where the last cp rank of each group is fed otherwise than the others: other rows
    of the same shape (a sampler over the global rank), a shorter sequence (a ragged last batch), fewer rows."""
    cp = engine.context_parallel
    idx, targets, mask = batch(0, 0, dp)
    rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
    odd = cp.rank == cp.size - 1
    tries = (
        [(idx.roll(1, 0) if odd else idx)[rows], targets[rows], mask[rows]],
        [idx[rows, : T - odd], targets[rows, : T - odd], mask[rows, : T - odd]],
        [idx[rows][: MICRO - odd], targets[rows][: MICRO - odd], mask[rows][: MICRO - odd]],
    )
    errors = []
    for i, t, m in tries:
        try:
            engine(i, t, attention_mask=m)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


def check_mismatch_errors(outs: list[dict], world: int, cp: int) -> None:
    """Every rank raised, naming every cp rank of its group with its global rank and shapes, and the loader fix."""
    dp = world // cp
    for rank, out in enumerate(outs):
        first = rank - rank % cp
        same, shorter, fewer = out["mismatch"]
        for err in (same, shorter, fewer):
            assert err.startswith(f"context-parallel batch: the {cp} cp ranks of a group were fed"), err
            assert (
                f"num_replicas=engine.dp_world_size, rank=engine.dp_rank) (here dp size {dp}, dp rank "
                f"{rank // cp})" in err
            ), err
        assert "the same shapes but different contents (arg0 differ)" in same, same
        last = f"cp rank {cp - 1} (global rank {first + cp - 1}): arg0 [{MICRO}, {T - 1}], arg1 [{MICRO}, {T - 1}]"
        assert "different tensor shapes" in shorter and last in shorter, shorter
        assert (
            f"cp rank 0 (global rank {first}): arg0 [{MICRO}, {T}], arg1 [{MICRO}, {T}], attention_mask "
            f"[{MICRO}, {T}]" in shorter
        ), shorter
        assert f"(global rank {first + cp - 1}): arg0 [{MICRO - 1}, {T}]" in fewer, fewer


def cp_body(cp: dict, stage: int, extra: dict, grads: bool, mismatch: bool = False) -> dict:
    """Train STEPS x GAS micro-steps; return the losses, grad norms and (``grads``) this rank's pieces of every
    reduced gradient at the first step's boundary, with the engine's dp / cp view (``mismatch``: and the errors of
    :func:`mismatched_batches` after training)."""
    model = GPT(GPTConfig(**CFG), seed=3, dtype=torch.float64)
    engine, opt, _, _ = llmpar.initialize(model=model, config=_config(cp, stage, **extra))
    dp, dp_rank = engine.dp_world_size, engine.dp_rank
    out = {
        "dp": dp,
        "cp": engine.context_parallel.size,
        "losses": [],
        "norms": [],
        "pieces": {},
        "describe": describe(engine, dist.get_world_size()),
        "sampler": engine.deepspeed_io(list(range(8))).sampler.num_replicas,
    }
    for s in range(STEPS):
        for m in range(GAS):
            idx, targets, mask = batch(s, m, dp)
            rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
            loss = engine(idx[rows], targets[rows], attention_mask=mask[rows])
            engine.backward(loss)
            out["losses"].append(loss.item())
            if grads and s == 0 and m == GAS - 1:
                opt.reduce_gradients()
                out["pieces"] = {
                    n: [(a, z, v.clone()) for v, a, z in opt.grad_pieces(p)] for n, p in model.named_parameters()
                }
            engine.step()
        out["norms"].append(engine.get_global_grad_norm())
    if grads and stage < 3:  # which ranks write the 16-bit model: one, with every weight (torch.save recorded)
        written, save = [], torch.save
        torch.save = lambda obj, path: written.append(sorted(obj))
        try:
            engine.save_16bit_model(tempfile.mkdtemp())
        finally:
            torch.save = save
        out["written"] = written
    if mismatch:
        out["mismatch"] = mismatched_batches(engine, dp, dp_rank)
    engine.destroy()
    return out


def reference(dp: int) -> dict:
    """The same training on one process: each dp slice's mean over its real targets, averaged over dp and GAS."""
    model = GPT(GPTConfig(**CFG), seed=3, dtype=torch.float64)
    opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=WD)
    out = {"losses": [], "norms": [], "grads": {}}
    for s in range(STEPS):
        for m in range(GAS):
            idx, targets, mask = batch(s, m, dp)
            targets = targets.masked_fill(~mask, -100)
            total = 0.0
            for d in range(dp):
                rows = slice(d * MICRO, (d + 1) * MICRO)
                loss = F.cross_entropy(model(idx[rows]).flatten(0, 1), targets[rows].flatten(), ignore_index=-100)
                (loss / (GAS * dp)).backward()
                out["losses"].append((d, loss.item()))
                total += loss.item()
        if s == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return out


def check(outs: list[dict], world: int, cp: int, *, grads: bool = True) -> None:
    dp = world // cp // (outs[0].get("tp", 1))
    ref = reference(dp)
    full = {n: torch.full((g.numel(),), float("nan"), dtype=torch.float64) for n, g in ref["grads"].items()}
    for rank, out in enumerate(outs):
        assert (out["dp"], out["cp"], out["sampler"]) == (dp, cp, dp), (rank, out["dp"], out["cp"])
        d = rank // (world // dp)  # dp is outside cp and tp on the mesh
        want = [loss for dd, loss in ref["losses"] if dd == d]
        f64 = dict(dtype=torch.float64)
        torch.testing.assert_close(
            torch.tensor(out["losses"], **f64),
            torch.tensor(want, **f64),
            rtol=1e-10,
            atol=1e-12,
            msg=f"losses on rank {rank}",
        )
        torch.testing.assert_close(
            torch.tensor(out["norms"], **f64),
            torch.tensor(ref["norms"], **f64),
            rtol=1e-10,
            atol=1e-12,
            msg=f"grad norms on rank {rank}",
        )
        for n, pieces in out["pieces"].items():
            for a, z, v in pieces:
                full[n][a:z] = v.reshape(-1)
    if "written" in outs[0]:
        assert [w for out in outs for w in out["written"]] == [sorted(ref["grads"])], "one rank writes every weight"
    if grads:
        for n, g in ref["grads"].items():
            assert not full[n].isnan().any(), f"no rank holds part of {n}'s gradient"
            torch.testing.assert_close(full[n].view_as(g), g, rtol=1e-10, atol=1e-13, msg=f"gradient of {n}")


@pytest.mark.parametrize(
    "cp, stage, world",
    [
        ({"size": 2, "mode": "ulysses"}, 2, 2),
        ({"size": 2, "mode": "ring"}, 3, 4),  # dp=2 x cp=2: ZeRO-3 over the dp x cp group
    ],
)
def test_cp2_matches_single_process(cp, stage, world):
    """And cp ranks fed different batches (rows, sequence lengths, row counts) are refused on every rank."""
    outs = run_ranks(cp_body, world, cp, stage, {}, True, True, timeout=120)
    check(outs, world, cp["size"])
    check_mismatch_errors(outs, world, cp["size"])


def ring3_body() -> dict:
    """Ring over 3 ranks (sequence 13 padded to 18); first a Ulysses config whose heads (4) do not split over 3."""
    try:
        llmpar.initialize(model=GPT(GPTConfig(**CFG), dtype=torch.float64), config=_config({"size": 3}, 2))
        error = None
    except ValueError as e:
        error = str(e)
    out = cp_body({"size": 3, "mode": "ring"}, 2, {}, True)
    out["error"] = error
    return out


def test_ring_over_3_ranks_and_heads_not_divisible_by_ulysses():
    outs = run_ranks(ring3_body, 3, timeout=120)
    for out in outs:
        assert out["error"] and "n_head=4" in out["error"] and "Ulysses size 3" in out["error"], out["error"]
    check(outs, 3, 3)


def test_hybrid_2x2_with_activation_checkpointing():
    cp = {"size": 4, "mode": "hybrid", "ulysses_size": 2}
    outs = run_ranks(cp_body, 4, cp, 2, {"activation_checkpointing": {}}, True, timeout=120)
    assert "4 ranks (context parallel: cp=4 hybrid = ulysses 2 x ring 2) (dp=1 x tp=1" in outs[0]["describe"]
    check(outs, 4, 4)


def tp_body() -> dict:
    out = cp_body({"size": 2, "mode": "ulysses"}, 1, {"tensor_parallel": {"size": 2}}, False)
    out["tp"] = 2
    return out


def test_tp2_x_ulysses2():
    """4 ranks: tp=2 (heads 4 -> 2 per rank) x Ulysses 2 (-> 1); the tp-split gradients are compared by their norm."""
    check(run_ranks(tp_body, 4, timeout=120), 4, 2, grads=False)


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"context_parallel": {"size": 2, "mode": "zigzag"}}, "context_parallel.mode.*ulysses, ring, hybrid"),
        ({"context_parallel": {"size": 4, "mode": "hybrid"}}, 'needs "context_parallel.ulysses_size"'),
        ({"context_parallel": {"size": 4, "mode": "hybrid", "ulysses_size": 3}}, 'ulysses_size"=3 does not divide'),
        ({"context_parallel": {"size": 4, "mode": "ring", "ulysses_size": 2}}, 'ulysses_size"=2 is not valid'),
        ({"context_parallel": {"size": 2, "mode": "ring"}, "sequence_parallel_size": 2}, "disagree"),
        ({"context_parallel": {"size": 2}, "pipeline": {"stages": 2}}, "not supported with pipeline"),
        ({"context_parallel": {"size": 0}}, "context_parallel.size"),
        ({"context_parallel": {"sise": 2}}, 'did you mean "size"'),
    ],
)
def test_bad_context_parallel_configs(raw, match):
    with pytest.raises(ValueError, match=match):
        Blocks.parse(raw)


def test_sequence_parallel_size_is_ulysses():
    cp = Blocks.parse({"sequence_parallel_size": 4}).context_parallel
    assert (cp.size, cp.mode, cp.ulysses_size, cp.ring_size) == (4, "ulysses", 4, 1)
    cp = Blocks.parse({"context_parallel": {"size": 4, "mode": "hybrid", "ulysses_size": 2}}).context_parallel
    assert (cp.ulysses_size, cp.ring_size) == (2, 2)


def world_error_body() -> list[str]:
    mesh = llmpar.init_distributed(tp=1).mesh  # cp=1
    tries = [
        dict(config=_config({"size": 3, "mode": "ring"}, 1)),
        dict(config=_config({"size": 2}, 1), mesh=mesh),
        dict(config=_config({"size": 2}, 1), dp_group=mesh["dp"]),
    ]
    errors = []
    for kwargs in tries:
        try:
            llmpar.initialize(model=GPT(GPTConfig(**CFG)), **kwargs)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_sizes_and_groups_that_do_not_fit_fail_on_every_rank():
    for world, mesh, groups in run_ranks(world_error_body, 2, timeout=60):
        assert '"context_parallel.size"=3 does not divide the world size 2' in world, world
        assert '"context_parallel.size"=2 but mesh= has cp=1' in mesh, mesh
        assert "not dp_group= / tp_group=" in groups, groups


class _NoCollectives:
    """Stands in for a ContextParallel where the adapter must refuse a batch before sharding it."""

    ulysses_size = 1

    def shard(self, *args):
        raise AssertionError("the batch was sharded before it was checked")


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (
            (torch.zeros(1, 17, dtype=torch.long), torch.zeros(1, 17, dtype=torch.long)),
            {},
            ValueError,
            "sequence of 17 tokens is longer than the model's seq_len=16",
        ),
        ((torch.zeros(1, 5, dtype=torch.long),), {}, TypeError, "call engine\\(idx, targets\\)"),
        ((torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)), {}, ValueError, "must have idx's"),
        ((torch.zeros(1, 5), torch.zeros(1, 5, dtype=torch.long)), {}, TypeError, "integer token ids"),
        (
            (torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)),
            {"attention_mask": torch.ones(5)},
            ValueError,
            "attention_mask must be a \\[batch=1, tokens=5\\]",
        ),
        ((torch.zeros(1, 5, dtype=torch.long),), {"labels": 1}, TypeError, "unexpected argument 'labels'"),
    ],
)
def test_gpt_adapter_refuses_bad_batches_before_sharding(args, kwargs, error, match):
    from llmpar.context_parallel.adapters import adapter_for

    model = GPT(GPTConfig(**CFG))
    adapter = adapter_for(model)
    adapter.prepare(model, _NoCollectives())
    with pytest.raises(error, match=match):
        adapter.shard_call(_NoCollectives(), args, kwargs)
    with pytest.raises(TypeError, match="no adapter shards its batch"):
        adapter_for(torch.nn.Linear(2, 2))


def test_a_prepared_gpt_called_outside_a_sharded_batch_is_the_plain_gpt():
    from llmpar.context_parallel.adapters import adapter_for

    class _Idle(_NoCollectives):
        current = None

    plain, prepared = GPT(GPTConfig(**CFG), seed=5), GPT(GPTConfig(**CFG), seed=5)
    adapter_for(prepared).prepare(prepared, _Idle())
    idx = torch.randint(0, CFG["vocab_size"], (2, 11))
    torch.testing.assert_close(prepared(idx), plain(idx), rtol=0, atol=0)
    assert "context_parallel" not in dict(prepared.named_modules()) and not any(
        "context_parallel" in k for k in prepared.state_dict()
    )


TRAIN = dict(
    steps=4,
    batch_size=2,
    seq_len=16,
    n_layer=2,
    n_head=2,
    d_model=16,
    lr=1e-2,
    warmup_steps=1,
    log_every=2,
    dtype="float64",
    grad_accum=2,
)


def train_body() -> tuple[torch.Tensor, list[float]]:
    from llmpar.train import TrainOptions, build_config
    from llmpar.train.loop import train

    opts = TrainOptions(**TRAIN)
    config = {**build_config(opts), "context_parallel": {"size": 2, "mode": "ring"}}
    engine, result = train(opts, config)
    return torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]), result.losses


def test_llmpar_train_with_context_parallelism_equals_one_process():
    """``llmpar train``'s loop (a config with "context_parallel") on 2 ranks: the one process's losses and weights."""
    from llmpar.train import TrainOptions
    from llmpar.train.loop import train

    (p0, losses0), (p1, losses1) = run_ranks(train_body, 2, timeout=120)
    engine, single = train(TrainOptions(**TRAIN))
    ref = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    assert torch.equal(p0, p1) and losses0 == losses1
    torch.testing.assert_close(p0, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        torch.tensor(losses0, dtype=torch.float64),
        torch.tensor(single.losses, dtype=torch.float64),
        rtol=1e-10,
        atol=1e-12,
    )


def test_zero1_with_cpu_offload_under_ring():
    """ZeRO-1 with the optimizer state on the CPU (the offload step) over the dp x cp group: the same losses, grad
    norms and gradients as one process."""
    extra = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    check(run_ranks(cp_body, 2, {"size": 2, "mode": "ring"}, 1, extra, True, timeout=120), 2, 2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float64, torch.float32, torch.bfloat16])
def test_batch_digest_tells_batches_apart_whatever_its_chunking(dtype, monkeypatch):
    """The cp batch agreement's digest: equal for equal tensors, different for a row swap or one changed element
    (and -0.0 vs 0.0: the bits), the same when long tensors are taken in chunks."""
    from llmpar.context_parallel import batch_check

    g = torch.Generator().manual_seed(5)
    x = (
        torch.randint(0, 2, (3, 37), generator=g)
        if dtype == torch.bool
        else torch.randint(-50, 50, (3, 37), generator=g)
    ).to(dtype)
    if dtype.is_floating_point:
        x = x + torch.rand(3, 37, generator=g, dtype=torch.float64).to(dtype)
    whole = int(batch_check.digest(x))
    assert whole == int(batch_check.digest(x.clone()))
    changed = x.clone()
    changed[2, 11] = ~changed[2, 11] if dtype == torch.bool else changed[2, 11] + 1
    assert len({whole, int(batch_check.digest(x[[1, 0, 2]])), int(batch_check.digest(changed))}) == 3
    if dtype.is_floating_point:
        zero = torch.zeros(4, dtype=dtype)
        assert int(batch_check.digest(zero)) != int(batch_check.digest(-zero))
    monkeypatch.setattr(batch_check, "_CHUNK", 10)
    assert int(batch_check.digest(x)) == whole
