"""8- and 4-bit AdamW states under ZeRO 0-3 (``llmpar/zero/lowbit_state.py``) on 2 CPU/gloo ranks == a single-process
loop of the same low-bit step with the same blocking.

ZeRO blocks the quantized moments along each flat *unit* (blocks never straddle ranks, and do not depend on dp), so the
single-process reference steps each unit's concatenated params as one tensor (``lowbit.adamw_lowbit_step``), with the
units the ZeRO optimizer reports in ``describe()``. One pool job runs every configuration (stages 0-3, int8/int4,
fp32 / bf16 / fp16 params, offload, gradient accumulation, clipping, fp16 loss scaling with a skipped step).
A second job checks every step where it happens against the low-bit torch step on the gradients it received, with
stochastic rounding (``stochastic_rounding``: seeded per unit shard) and ZeRO++ compression (qwZ, qgZ with error
feedback; hpZ on four ranks in a third job), and compares low-bit and fp32-state runs under the same compression.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from llmpar.distributed.collectives import CommCounter
from llmpar.ops import lowbit as L
from llmpar.zero import GatheredParameters, OptimizerConfig, ZeroConfig, ZeroOptimizer
from llmpar.zero.loss_scale import LossScaler

from multirank import run_ranks

MICRO, STEPS, GAS, CLIP, LR, WD = 3, 3, 2, 0.5, 1e-2, 0.1
BETAS = (0.9, 0.95)

CONFIGS = {  # name: (stage, state_precision, dtype, offload, bucket)
    "s0-int8": (0, "int8", torch.float32, False, 700),
    "s1-int8": (1, "int8", torch.float32, False, 700),
    "s2-int4": (2, "int4", torch.float32, False, 300),
    "s2-int8-bf16": (2, "int8", torch.bfloat16, False, 700),
    "s1-int8-offload": (1, "int8", torch.float32, True, 700),
    "s3-int8": (3, "int8", torch.float32, False, 700),
    "s3-int4-offload": (3, "int4", torch.float32, True, 700),
    "s2-int8-fp16": (2, "int8", torch.float16, False, 700),
}


class Net(torch.nn.Module):
    """Odd sizes (params straddle blocks, units and shards), a frozen layer, an unused param."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(9, 31)
        self.frozen = torch.nn.Linear(31, 31)
        self.frozen.requires_grad_(False)
        self.b = torch.nn.Linear(31, 23)
        self.c = torch.nn.Linear(23, 5)
        self.unused = torch.nn.Parameter(torch.randn(11))
        self.to(dtype)

    def forward(self, x):
        h = torch.tanh(self.frozen(torch.tanh(self.a(x))))
        return self.c(torch.tanh(self.b(h)))


def groups(net):
    named = list(net.named_parameters())
    return [
        {"params": [(n, p) for n, p in named if p.dim() >= 2]},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def batch(step, micro, n, dtype):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(n, 9, generator=g).to(dtype), torch.randn(n, 5, generator=g).to(dtype)


def loss_fn(net, x, y):
    return ((net(x).float() - y.float()) ** 2).mean()


def flat(net):
    return torch.cat([p.detach().double().flatten() for p in net.parameters()])


def zero_body(names):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names:
        stage, sp, dtype, offload, bucket = CONFIGS[name]
        net = Net(dtype)
        cfg = OptimizerConfig(type={"int8": "AdamW8bit", "int4": "AdamW4bit"}[sp], lr=LR, betas=BETAS, weight_decay=WD)
        scaler = LossScaler(loss_scale=256.0) if dtype == torch.float16 else None
        opt = ZeroOptimizer(
            groups(net),
            cfg,
            dist.group.WORLD,
            module=net if stage == 3 else None,
            zero_config=ZeroConfig(
                stage=stage,
                reduce_bucket_size=bucket,
                allgather_bucket_size=bucket,
                offload_optimizer={"device": "cpu" if offload else "none"},
            ),
            max_grad_norm=CLIP,
            grad_accum_dtype=torch.float32 if dtype != torch.float32 else None,
            loss_scaler=scaler,
        )
        losses, skipped = [], None
        for s in range(STEPS + (1 if scaler is not None else 0)):
            overflow = scaler is not None and s == 1  # an inf gradient on rank 1: the step is skipped everywhere
            before = {k: t.clone() for b in opt.buffers for k, t in b.state.items()} if overflow else None
            total = torch.zeros((), dtype=torch.float64)
            for m in range(GAS):
                x, y = batch(len(losses) if not overflow else 99, m, MICRO * world, dtype)
                x, y = x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]
                opt.set_gradient_accumulation_boundary(m == GAS - 1)
                loss = loss_fn(net, x, y) / GAS
                if overflow and rank == 1 and m == 0:
                    loss = loss * float("inf")
                (scaler.scale_loss(loss) if scaler is not None else loss).backward()
                total += loss.detach().double()
            applied = bool(opt.step())
            if overflow:
                after = {k: t for b in opt.buffers for k, t in b.state.items()}
                skipped = (not applied) and all(torch.equal(before[k], after[k]) for k in before)
                continue
            assert applied, f"{name}: step {s} skipped"
            dist.all_reduce(total)
            losses.append(total.item() / world)
        if stage == 3:
            with GatheredParameters(None, opt):
                params = flat(net)
        else:
            params = flat(net)
        out[name] = dict(
            losses=losses,
            params=params,
            mem=opt.memory_bytes(),
            layout=opt.describe()["buffers"],
            skipped=skipped,
            sd_keys=sorted(opt.state_dict()["buffers"][0]["state"]),
        )
        opt.destroy()
    return out


def zero_body_torch_path(names):
    """zero_body with the torch path forced (the ground truth here; the kernels: test_lowbit_kernels.py)."""
    old = os.environ.get("LLMPAR_BACKEND")
    os.environ["LLMPAR_BACKEND"] = "torch"
    try:
        return zero_body(names)
    finally:
        if old is None:
            os.environ.pop("LLMPAR_BACKEND", None)
        else:
            os.environ["LLMPAR_BACKEND"] = old


def reference(name, layout):
    """Single process: full batch, clip, then the low-bit step over each ZeRO unit's concatenated params."""
    stage, sp, dtype, offload, bucket = CONFIGS[name]
    bits = {"int8": 8, "int4": 4}[sp]
    net = Net(dtype)
    byname = dict(net.named_parameters())
    wd_of = {n: (WD if p.dim() >= 2 else 0.0) for n, p in byname.items()}
    units = []  # (param names, master flat, state, step)
    for buf in layout:
        pnames = [p["name"] for p in buf["params"]]
        for u in buf["units"]:
            names = [pnames[i] for i in u["params"]]
            master = torch.cat([byname[n].detach().float().flatten() for n in names])
            units.append((names, master, L.new_state(master.numel(), bits), torch.zeros(())))
    trainable = [p for p in net.parameters() if p.requires_grad]
    losses = []
    for s in range(STEPS):
        total = 0.0
        for m in range(GAS):
            x, y = batch(s, m, MICRO * 2, dtype)
            loss = loss_fn(net, x, y) / GAS
            loss.backward()
            total += loss.item()
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = {n: p.grad.float() for n, p in byname.items() if p.requires_grad}
        norm = torch.stack([g.double().norm() for g in grads.values()]).norm()
        coef = min(1.0, CLIP / (float(norm) + 1e-6))
        for names, master, st, step in units:
            g = torch.cat([grads[n].flatten() for n in names]) * coef
            L.adamw_lowbit_step(
                [master],
                [g],
                [st["m_codes"]],
                [st["m_scale"]],
                [st["v_codes"]],
                [st["v_scale"]],
                [step],
                None,
                bits=bits,
                lr=LR,
                beta1=BETAS[0],
                beta2=BETAS[1],
                eps=1e-8,
                weight_decay=wd_of[names[0]],
            )
            at = 0
            with torch.no_grad():
                for n in names:
                    p = byname[n]
                    p.copy_(master[at : at + p.numel()].view(p.shape))
                    at += p.numel()
        net.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, flat(net)


@pytest.fixture(scope="module")
def zero_runs():
    return run_ranks(zero_body_torch_path, 2, list(CONFIGS), timeout=300)


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("LLMPAR_BACKEND", "torch")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero_lowbit_matches_single_process(zero_runs, name):
    r0, r1 = zero_runs[0][name], zero_runs[1][name]
    assert torch.equal(r0["params"], r1["params"]), "dp ranks drifted apart"
    ref_losses, ref_params = reference(name, r0["layout"])
    _, sp, dtype, _, _ = CONFIGS[name]
    assert not torch.allclose(ref_params, flat(Net(dtype))), "training moved the params"
    diff = (r0["params"] - ref_params).abs()
    if dtype == torch.float32:
        # the same math and blocks; ZeRO sums the grads in another order, so a few codes can flip at ties
        torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
        assert float(diff.max()) <= 2 * LR, float(diff.max())
        assert int((diff > 1e-5).sum()) <= max(3, diff.numel() // 100), int((diff > 1e-5).sum())
    else:  # 16-bit params: bf16/fp16 gradients and rounding
        torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref_losses), rtol=3e-2, atol=1e-2)
        assert float(diff.mean()) < 2e-3, float(diff.mean())
    if dtype == torch.float16:
        assert r0["skipped"] and r1["skipped"], "an inf gradient skips the step on every rank, state untouched"
    assert {"m_codes", "m_scale", "v_codes", "v_scale"} <= set(r0["sd_keys"])
    for buf in r0["layout"]:
        assert buf["mode"] == sp
        assert (
            all(u["padded"] // 2 % L.BLOCK[{"int8": 8, "int4": 4}[sp]] == 0 for u in buf["units"]) or buf["shards"] == 1
        )


def test_zero_lowbit_state_bytes(zero_runs):
    """Optimizer-state bytes per rank, measured from the tensors: 8-bit ~2 B + scales per element of the partition,
    4-bit ~1 B (vs 8 B for fp32 moments)."""
    for name, bytes_per in (("s1-int8", 2 + 8 / 256), ("s2-int4", 1 + 8 / 128)):
        r = zero_runs[0][name]
        partition = sum(b["partition"] for b in r["layout"])
        assert r["mem"]["optimizer_state"] == pytest.approx(bytes_per * partition, rel=1e-9)
        assert r["mem"]["optimizer_state"] <= (0.3 if name == "s1-int8" else 0.2) * 8 * partition
        # the planner counts the same bytes per element (here of the padded units: this tiny net is mostly padding)
        from llmpar.planning.memory import model_state_bytes

        padded = sum(b["total"] for b in r["layout"])
        plan = model_state_bytes(padded, dp=2, zero_stage=CONFIGS[name][0], precision=CONFIGS[name][1])
        assert plan["optimizer"] == pytest.approx(r["mem"]["optimizer_state"], rel=1e-9)


# ------------------------------------------------------------------------------------------------- checkpoints

T, ROWS = 8, 8


def _engine(stage, typ="AdamW8bit", bucket=700):
    import llmpar
    from llmpar.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=67, n_layer=2, n_head=4, d_model=16, seq_len=T), seed=0, dtype=torch.float32)
    cfg = {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": typ, "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "stage3_param_persistence_threshold": 100},
    }
    engine, *_ = llmpar.initialize(model=model, config=cfg)
    return engine, model


def _train_step(engine, model, s):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + s)
    d = torch.randint(0, 67, (ROWS, T + 1), generator=g)
    n = ROWS // world
    x, y = d[rank * n : (rank + 1) * n, :-1], d[rank * n : (rank + 1) * n, 1:]
    loss = model.loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    t = loss.detach().reshape(1).clone()
    dist.all_reduce(t)
    return float(t) / world


def _states(engine):
    return [{k: t.clone() for k, t in b.state.items()} for b in engine.optimizer.buffers]


def ckpt_body(path):
    old = os.environ.get("LLMPAR_BACKEND")
    os.environ["LLMPAR_BACKEND"] = "torch"
    try:
        a, ma = _engine(2)
        for s in range(2):
            _train_step(a, ma, s)
        a.save_checkpoint(path, tag="t2")
        saved = _states(a)
        tail = [_train_step(a, ma, s) for s in range(2, 4)]
        after = _states(a)
        b, mb = _engine(2)
        b.load_checkpoint(path, tag="t2")
        loaded_exact = all(torch.equal(x[k], y[k]) for x, y in zip(saved, _states(b)) for k in x)
        tail_b = [_train_step(b, mb, s) for s in range(2, 4)]
        same_after = all(torch.equal(x[k], y[k]) for x, y in zip(after, _states(b)) for k in x)
        # other units (stage 3 cuts one unit per module): the moments are re-quantized in the new blocks
        c, mc = _engine(3)
        c.load_checkpoint(path, tag="t2")
        tail_c = [_train_step(c, mc, s) for s in range(2, 4)]
        kinds = sorted({k for bufs in a.optimizer.checkpoint_layout() for k in bufs["state_keys"]})
        modes = sorted({bf.mode for e in (a, b, c) for bf in e.optimizer.buffers})
        return dict(
            tail=tail,
            tail_b=tail_b,
            tail_c=tail_c,
            loaded_exact=loaded_exact,
            same_after=same_after,
            kinds=kinds,
            modes=modes,
            live_keys=sorted(saved[0]),
        )
    finally:
        if old is None:
            os.environ.pop("LLMPAR_BACKEND", None)
        else:
            os.environ["LLMPAR_BACKEND"] = old


def test_checkpoint_restores_lowbit_state_bitwise(tmp_path):
    outs = run_ranks(ckpt_body, 2, str(tmp_path), timeout=300)
    for r in outs:
        assert r["modes"] == ["int8"] and r["live_keys"] == ["m_codes", "m_scale", "v_codes", "v_scale"]
        assert r["kinds"] == ["exp_avg", "exp_avg_sq", "params"], "the seam shows float32 moments"
        assert r["loaded_exact"], "codes and scales re-quantized from the saved float32 moments exactly"
        assert r["tail_b"] == r["tail"] and r["same_after"], "the resumed run continues bitwise"
        torch.testing.assert_close(torch.tensor(r["tail_c"]), torch.tensor(r["tail"]), rtol=2e-3, atol=0)


# ------------------------------------------------- stochastic rounding and compressed communication (one pool job)
# Every step of these runs is checked where it happens: the ZeRO step over each unit shard equals
# ``lowbit.adamw_lowbit_step`` applied to clones of what it read (the reduced gradients as they arrived, quantized or
# not; the params; the codes, scales and step counts), bitwise. With compression (ZeRO++ qwZ / qgZ) the low-bit run and
# the fp32-state run of the same layout (``align=256``: the same units, hence the same quantization blocks on the wire)
# receive bitwise the same first reduced gradients, and then drift apart by the low-bit error only.

COMP = dict(zero_quantized_weights=True, zero_quantized_gradients=True, stage3_param_persistence_threshold=0)
QGEF = dict(zero_quantized_gradients=True, zero_quantized_gradients_error_feedback=True)
STEP_CASES = {  # name: (stage, type, zero_config extras, stochastic_rounding, seed)
    "s2-int8-sr": (2, "AdamW8bit", {}, True, 0),
    "s2-int8-sr-again": (2, "AdamW8bit", {}, True, 0),
    "s2-int8-sr-seed1": (2, "AdamW8bit", {}, True, 1),
    "s2-int8-nearest": (2, "AdamW8bit", {}, False, 0),
    "s3-int4-sr-offload": (3, "AdamW4bit", {"offload_optimizer": {"device": "cpu"}}, True, 0),
    "s3-int8-comp": (3, "AdamW8bit", COMP, False, 0),
    "s3-int4-comp-sr": (3, "AdamW4bit", COMP, True, 0),
    "s3-fp32-comp": (3, "AdamW", COMP, False, 0),
    "s3-int8-plain": (3, "AdamW8bit", {"stage3_param_persistence_threshold": 0}, False, 0),
    "s3-fp32-plain": (3, "AdamW", {"stage3_param_persistence_threshold": 0}, False, 0),
    "s2-int4-qgef": (2, "AdamW4bit", QGEF, False, 0),
    "s2-fp32-qgef": (2, "AdamW", QGEF, False, 0),
    "s2-int4-plain": (2, "AdamW4bit", {}, False, 0),
    "s2-fp32-plain": (2, "AdamW", {}, False, 0),
}
HPZ_CASES = {  # 4 ranks as two nodes of two: hpZ's secondary shards + qwZ + qgZ (two-level)
    "s3-int8-hpz": (3, "AdamW8bit", dict(COMP, zero_hpz_partition_size=2, stage3_max_reuse_distance=0), False, 0),
    "s3-int4-hpz-sr": (3, "AdamW4bit", dict(COMP, zero_hpz_partition_size=2, stage3_max_reuse_distance=0), True, 0),
}


def _checked_step(opt, sr):
    """``opt.step()``, and the same step by the low-bit torch reference on clones of its inputs: True when every
    unit shard's params, codes and scales come out bitwise equal (fp32-state buffers: not checked here)."""
    from llmpar.zero import lowbit_state

    opt.reduce_gradients()
    rank, todo = (opt.rank if opt.stage > 0 else 0), []
    for b in opt.buffers:
        bits = lowbit_state.bits_of(b.mode)
        if bits is not None:
            todo.append(
                (
                    b,
                    bits,
                    {k: t.clone() for k, t in b.state.items()},
                    [s.clone() for s in opt._shards(b)],
                    [g.float().clone() for g in opt._grads(b)],
                    [s.clone() for s in b.steps],
                )
            )
    opt.step()
    ok = True
    for b, bits, state, shards, grads, steps in todo:
        g, units = opt.param_groups[b.group_index], range(len(b.layout.units))
        views = [
            [lowbit_state.unit_view(b.layout, state[k], k, u, bits) for u in units] for k in lowbit_state.CODE_KEYS
        ]
        L.adamw_lowbit_step(
            shards,
            grads,
            *views,
            steps,
            None,
            bits=bits,
            lr=g["lr"],
            beta1=g["betas"][0],
            beta2=g["betas"][1],
            eps=g["eps"],
            weight_decay=g["weight_decay"],
            seed=opt.seed if sr else None,
            salts=[lowbit_state.sr_salt(b, u) for u in units] if sr else None,
            sr_offsets=[lowbit_state.sr_offset(b, u, rank) for u in units] if sr else None,
        )
        ok = ok and all(torch.equal(x, y) for x, y in zip(shards, opt._shards(b)))
        ok = ok and all(torch.equal(state[k], b.state[k]) for k in lowbit_state.CODE_KEYS)
    return ok


def step_checks_body(names):
    from llmpar.zero import lowbit_state

    os.environ["LLMPAR_BACKEND"] = "torch"
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names:
        stage, typ, zkw, sr, seed = {**STEP_CASES, **HPZ_CASES}[name]
        net = Net(torch.float32)
        cfg = OptimizerConfig(type=typ, lr=LR, betas=BETAS, weight_decay=WD, stochastic_rounding=sr)
        counter = CommCounter()
        opt = ZeroOptimizer(
            groups(net),
            cfg,
            dist.group.WORLD,
            module=net if stage == 3 else None,
            zero_config=ZeroConfig(stage=stage, reduce_bucket_size=700, **zkw),
            align=256,
            seed=seed,
            counter=counter,
        )
        exact, first_grads = [], None
        for s in range(STEPS):
            x, y = batch(s, 0, MICRO * world, torch.float32)
            loss_fn(net, x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]).backward()
            if s == 0:
                opt.reduce_gradients()
                first_grads = torch.cat([g.float().flatten() for b in opt.buffers for g in opt._grads(b)]).clone()
            exact.append(_checked_step(opt, sr))
        if stage == 3:
            with GatheredParameters(None, opt):
                params = flat(net)
        else:
            params = flat(net)
        codes = torch.cat(
            [b.state[k].float().flatten() for b in opt.buffers for k in lowbit_state.CODE_KEYS if k in b.state]
            or [torch.zeros(0)]
        )
        salts = (
            [lowbit_state.sr_salt(b, u) for b in opt.buffers for u in range(len(b.layout.units))]
            if lowbit_state.bits_of(opt.buffers[0].mode)
            else []
        )
        weights = opt.stage3.weights if opt.stage3 is not None else None
        # numpy arrays travel by value (torch tensors in a result would go through shared memory)
        out[name] = dict(
            exact=exact,
            calls=dict(counter.calls),
            params=params.numpy(),
            codes=codes.numpy(),
            first_grads=first_grads.numpy(),
            salts=salts,
            from_secondary=weights.from_secondary if weights is not None else 0,
            layout=[(u["offset"], u["padded"]) for b in opt.describe()["buffers"] for u in b["units"]],
        )
        opt.destroy()
    return out


@pytest.fixture(scope="module")
def step_runs():
    outs = run_ranks(step_checks_body, 2, list(STEP_CASES), timeout=300)
    return [
        {n: {k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in r.items()} for n, r in o.items()}
        for o in outs
    ]


@pytest.mark.parametrize("name", [n for n, c in STEP_CASES.items() if c[1] != "AdamW"])
def test_zero_lowbit_step_equals_reference_on_the_reduced_gradients(step_runs, name):
    """Every step at every rank: stochastic rounding (stage 2; stage 3 with offload), compressed communication
    (qwZ + qgZ at stage 3, qgZ with error feedback at stage 2) and both together."""
    zkw = STEP_CASES[name][2]
    for r in step_runs:
        assert r[name]["exact"] == [True] * STEPS, r[name]["exact"]
        assert bool(r[name]["calls"].get("all_gather_q")) == bool(zkw.get("zero_quantized_weights")), r[name]["calls"]
        assert bool(r[name]["calls"].get("all_to_all_q")) == bool(zkw.get("zero_quantized_gradients"))
    assert torch.equal(step_runs[0][name]["params"], step_runs[1][name]["params"]), "dp ranks drifted apart"


def hpz_body(names):
    """step_checks_body, its arrays reduced to digests (a small result)."""
    import hashlib

    out = step_checks_body(names)
    return {
        n: {k: hashlib.sha256(v.tobytes()).hexdigest() if hasattr(v, "tobytes") else v for k, v in r.items()}
        for n, r in out.items()
    }


def test_zero_lowbit_step_with_hpz_on_four_ranks():
    """hpZ (``zero_hpz_partition_size`` 2 of dp 4, ranks_per_node from it) with qwZ + two-level qgZ: each step of
    each rank equals the low-bit reference on the gradients it received; the ranks agree on the params."""
    outs = run_ranks(hpz_body, 4, list(HPZ_CASES), timeout=300)
    for name in HPZ_CASES:
        assert all(r[name]["exact"] == [True] * STEPS for r in outs), [r[name]["exact"] for r in outs]
        assert len({r[name]["params"] for r in outs}) == 1, "dp ranks drifted apart"
        assert all(r[name]["from_secondary"] > 0 for r in outs), "backward gathered from the secondary shards"
        assert all(r[name]["calls"].get("all_gather_q") and r[name]["calls"].get("all_to_all_q") for r in outs)


def test_zero_stochastic_rounding_is_seeded_and_differs_from_nearest(step_runs):
    r0 = step_runs[0]
    assert torch.equal(r0["s2-int8-sr"]["codes"], r0["s2-int8-sr-again"]["codes"]), "same seed: same codes"
    assert torch.equal(r0["s2-int8-sr"]["params"], r0["s2-int8-sr-again"]["params"])
    for other in ("s2-int8-sr-seed1", "s2-int8-nearest"):
        differ = (r0["s2-int8-sr"]["codes"] != r0[other]["codes"]).float().mean()
        assert 0.01 < float(differ) < 0.9, (other, float(differ))
    # one stream per unit, the same on every rank (each rank draws the counters of its shard's place in it)
    salts = step_runs[0]["s2-int8-sr"]["salts"]
    assert len(set(salts)) == len(salts) > 2 and salts == step_runs[1]["s2-int8-sr"]["salts"]


@pytest.mark.parametrize(
    "lowbit, fp32, plain_lowbit, plain_fp32",
    [
        ("s3-int8-comp", "s3-fp32-comp", "s3-int8-plain", "s3-fp32-plain"),
        ("s2-int4-qgef", "s2-fp32-qgef", "s2-int4-plain", "s2-fp32-plain"),
    ],
)
def test_zero_lowbit_under_compression_stays_within_the_lowbit_error(step_runs, lowbit, fp32, plain_lowbit, plain_fp32):
    """Compression does not see the state precision: at the same layout, the first reduced gradients of the low-bit
    and the fp32-state run are bitwise equal (and the first step, which reads zero moments, moves both alike). After
    the run the two differ on average by the low-bit error as it is without compression (within 2x), and no element
    by more than one Adam update (lr) or twice the largest plain low-bit difference: where qwZ rounds a weight the
    other way in the two runs, the elements it feeds may take a step of the other sign."""
    for r in step_runs:
        assert r[lowbit]["layout"] == r[fp32]["layout"]
        assert torch.equal(r[lowbit]["first_grads"], r[fp32]["first_grads"])
        assert not torch.equal(r[plain_lowbit]["first_grads"], r[lowbit]["first_grads"]), "compression was on"
    r0 = step_runs[0]
    d_comp = (r0[lowbit]["params"] - r0[fp32]["params"]).abs()
    d_plain = (r0[plain_lowbit]["params"] - r0[plain_fp32]["params"]).abs()
    assert float(d_plain.max()) > 0 and float(d_comp.max()) > 0, "the low-bit error is there to compare with"
    assert float(d_comp.mean()) <= 2 * float(d_plain.mean()), (float(d_comp.mean()), float(d_plain.mean()))
    assert float(d_comp.max()) <= max(LR, 2 * float(d_plain.max())), (float(d_comp.max()), float(d_plain.max()))


def test_stochastic_rounding_setting_is_checked():
    assert OptimizerConfig(type="AdamW4bit", stochastic_rounding=True).stochastic_rounding is True
    with pytest.raises(TypeError, match=r'"optimizer.params.stochastic_rounding" must be true or false, got \'yes\''):
        OptimizerConfig(type="AdamW8bit", stochastic_rounding="yes")
    with pytest.raises(ValueError, match=r'"optimizer.params.stochastic_rounding"=true applies to the 8- / 4-bit'):
        OptimizerConfig(type="AdamW", stochastic_rounding=True)


def test_stochastic_rounding_from_the_deepspeed_config():
    from llmpar.runtime.blocks import optimizer_block

    cfg = optimizer_block({"type": "AdamW8bit", "params": {"lr": 1e-3, "stochastic_rounding": True, "seed": 7}})
    assert cfg.stochastic_rounding and cfg.state_precision == "int8" and cfg.seed == 7
    with pytest.raises(TypeError, match="optimizer.params.stochastic_rounding"):
        optimizer_block({"type": "AdamW8bit", "params": {"stochastic_rounding": "true"}})
    with pytest.raises(TypeError, match="optimizer.params.seed"):
        optimizer_block({"type": "AdamW8bit", "params": {"seed": 1.5}})


def test_client_fused_adamw_brings_its_rounding_and_seed():
    """llmpar.initialize(optimizer=FusedAdamW(state_precision="int8", stochastic_rounding=True, seed=5)): the engine's
    ZeRO optimizer rounds the codes stochastically from seed 5 (it used to drop both)."""
    from llmpar.optim import FusedAdamW
    from llmpar.runtime.client import client_optimizer

    model = torch.nn.Linear(8, 4)
    for sr, sp in ((True, "int8"), (False, "int4"), (True, None)):
        opt = FusedAdamW(model.parameters(), lr=1e-3, state_precision=sp, stochastic_rounding=sr, seed=5)
        _, _, cfg = client_optimizer(model, opt, None, 0.0)
        assert cfg.seed == 5 and cfg.state_precision == sp
        assert cfg.stochastic_rounding == (sr and sp is not None)  # (fp32 states: the flag rounds nothing)


def engine_sr_body():
    """Two engines from {"type": "AdamW8bit", "params": {"stochastic_rounding": true, "seed": 3}}, one step each:
    their optimizers' seed and flag, and whether they stepped to the same codes."""
    import llmpar
    from llmpar.models import GPT, GPTConfig

    states, seen = [], []
    for _ in range(2):
        model = GPT(GPTConfig(vocab_size=67, n_layer=1, n_head=2, d_model=16, seq_len=T), seed=0, dtype=torch.float32)
        cfg = {
            "train_micro_batch_size_per_gpu": ROWS // 2,
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW8bit", "params": {"lr": 1e-2, "stochastic_rounding": True, "seed": 3}},
            "zero_optimization": {"stage": 2},
        }
        engine, *_ = llmpar.initialize(model=model, config=cfg)
        seen.append((engine.optimizer.seed, engine.optimizer.config.stochastic_rounding))
        _train_step(engine, model, 0)
        states.append(_states(engine))
    same = all(torch.equal(a[k], b[k]) for a, b in zip(*states) for k in a)
    return dict(seen=seen, same=same)


def sr_dp_body(cases):
    """Each rank: one ZeroOptimizer over dp=2 (the world) and one over dp=1 (a group of itself), identical nets and
    identical gradients on every rank (the dp=2 mean of two equal gradients is that gradient, exactly), stochastic
    rounding from seed 5; after 3 steps, each unit's codes gathered from the dp=2 shards and the dp=1 codes."""
    from llmpar.zero import lowbit_state

    os.environ["LLMPAR_BACKEND"] = "torch"
    rank = dist.get_rank()
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    out = {}
    for typ, stage, bucket in cases:
        runs = []
        for group in (dist.group.WORLD, solo):
            net = Net(torch.float32)
            cfg = OptimizerConfig(type=typ, lr=LR, betas=BETAS, weight_decay=WD, stochastic_rounding=True)
            opt = ZeroOptimizer(
                groups(net), cfg, group, seed=5, zero_config=ZeroConfig(stage=stage, reduce_bucket_size=bucket)
            )
            for s in range(3):
                x, y = batch(s, 0, 2 * MICRO, torch.float32)
                loss_fn(net, x, y).backward()
                opt.step()
                opt.zero_grad()
            units = []
            for b in opt.buffers:
                for u in range(len(b.layout.units)):
                    for key in lowbit_state.CODE_KEYS:
                        shard = lowbit_state.unit_view(b.layout, b.state[key], key, u, lowbit_state.bits_of(b.mode))
                        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
                        dist.all_gather(parts, shard.contiguous(), group=group)
                        units.append(torch.cat(parts).float().numpy())
            runs.append(dict(units=units, params=flat(net).numpy(), n_units=[len(b.layout.units) for b in opt.buffers]))
            opt.destroy()
        out[typ] = runs
    return out


def sr_body(cases):
    return dict(dp=sr_dp_body(cases), engine=engine_sr_body())


@pytest.fixture(scope="module")
def sr_runs():
    """One 2-rank job for the stochastic-rounding checks below."""
    return run_ranks(sr_body, 2, [("AdamW8bit", 2, 700), ("AdamW4bit", 1, 300)], timeout=300)


def test_engine_takes_stochastic_rounding_and_seed_from_the_config(sr_runs):
    """llmpar.initialize with {"type": "AdamW8bit", "params": {"stochastic_rounding": true, "seed": 3}}: the engine's
    ZeRO optimizer rounds the codes from seed 3, and a second engine built alike steps to the same codes."""
    for r in sr_runs:
        assert r["engine"]["seen"] == [(3, True), (3, True)] and r["engine"]["same"]


def test_zero_stochastic_rounding_does_not_depend_on_dp(sr_runs):
    """The same training with stochastic rounding at dp=2 and at dp=1: every unit's codes and scales agree bitwise
    (up to the dp=2 unit's extra padding at its end: zeros), and so do the params: each element draws the random
    number of its place in its unit, whichever shard holds it."""
    for typ, (dp2, dp1) in sr_runs[0]["dp"].items():
        assert dp2["n_units"] == dp1["n_units"] and sum(dp1["n_units"]) > 2, (typ, dp2["n_units"], dp1["n_units"])
        for a, b in zip(dp2["units"], dp1["units"]):
            assert len(a) >= len(b) and (a[: len(b)] == b).all(), typ
            assert (a[len(b) :] == (a[-1] if len(a) > len(b) else 0)).all(), "the padding holds the codes of 0"
        assert (dp2["params"] == dp1["params"]).all(), typ
