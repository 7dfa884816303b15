"""``zero_optimization.overlap_param_gather``: stages 1-2 launch the all-gather of the updated params at the end of
``step()`` and wait for each unit at the next forward. The run is bitwise the run without the option (same losses,
same params after every step), and everything that reads params waits first (``wait_params``, ``state_dict``,
``GatheredParameters``, a checkpoint save, the next step)."""

import pytest
import torch
import torch.distributed as dist
from zero_helpers import engine_micro_steps

import llmpar
from llmpar.models import GPT, GPTConfig

from multirank import run_ranks

STEPS = 5


def _config(stage, overlap):
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.7,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        # small units: several all-gathers per step, each waited by a different module's forward
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 2000,
            "allgather_bucket_size": 2000,
            "overlap_param_gather": overlap,
        },
    }


def _body(stage, overlap, tmp):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, n_layer=2, n_head=2, d_model=24, seq_len=9))
    engine, opt, _, _ = llmpar.initialize(model=model, config=_config(stage, overlap))
    assert (opt.deferred_gather is not None) == overlap
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, snapshots = [], []
    for step in range(STEPS):
        losses += engine_micro_steps(engine, model, g)
        if overlap:
            assert opt.deferred_gather.pending  # launched, not yet waited
        if step == 1:
            state = model.state_dict()  # waits: the whole updated params
            snapshots.append(torch.cat([t.flatten() for t in state.values()]))
        elif step == 2:
            opt.wait_params()
            snapshots.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        elif step == 3:
            with llmpar.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
                snapshots.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        elif step == 4:
            engine.save_checkpoint(str(tmp), tag=f"s{stage}{overlap}")
            snapshots.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    # one more step (its all-gather left in flight), then load the step-4 checkpoint over it: the load waits first,
    # so the late all-gather cannot land over the loaded params
    x = torch.randint(0, 61, (3, 10), generator=g)
    for _ in range(2):
        engine.backward(model.loss(engine(x[:, :-1]), x[:, 1:]))
        engine.step()
    engine.load_checkpoint(str(tmp), tag=f"s{stage}{overlap}")
    snapshots.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(snapshots[-1], snapshots[-2])
    return losses, snapshots


@pytest.mark.parametrize("stage", [1, 2])
def test_overlapped_param_gather_is_bitwise_the_plain_run(stage, tmp_path):
    plain = run_ranks(_body, 2, stage, False, tmp_path / "plain")
    overlapped = run_ranks(_body, 2, stage, True, tmp_path / "overlapped")
    for (l0, s0), (l1, s1) in zip(plain, overlapped):
        assert l0 == l1
        for a, b in zip(s0, s1):
            assert torch.equal(a, b)
    assert torch.equal(plain[0][1][-1], plain[1][1][-1])  # both ranks hold the same whole params


def test_overlap_param_gather_is_a_known_key():
    with pytest.raises(ValueError, match="overlap_param_gathr"):
        llmpar.initialize(
            model=torch.nn.Linear(2, 2),
            config={
                "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": 2, "overlap_param_gathr": True},
            },
        )


def _pipelined_body(stage, precision, one_call):
    """Three ZeRO steps on a GPT of several units; ``one_call``: the buffer stepped by one fused call and gathered
    after it (forced), else the default (one call per unit, each unit's gather launched before the next unit steps).
    Returns the params after each step and the order of the step / gather events."""
    from llmpar.zero import optimizer as zopt
    from llmpar.zero import param_gather
    from llmpar.zero import step as zstep
    from llmpar.zero.config import OptimizerConfig, ZeroConfig

    events = []
    step_fn, launch_fn, units_fn = zstep.adamw_step, param_gather._launch, zopt.ZeroOptimizer._step_units

    def adamw_step(*args, salts=None, **kw):
        events.append(("step", tuple(salts)))
        return step_fn(*args, salts=salts, **kw)

    def launch(opt, b, u):
        events.append(("gather", u))
        return launch_fn(opt, b, u)

    def step_units(self, b, grads, *, each, **kw):
        return units_fn(self, b, grads, each=each and not one_call, **kw)

    zstep.adamw_step, param_gather._launch, zopt.ZeroOptimizer._step_units = adamw_step, launch, step_units
    try:
        torch.manual_seed(0)
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        model = GPT(GPTConfig(vocab_size=61, n_layer=2, n_head=2, d_model=24, seq_len=9)).to(dtype)
        opt = zopt.ZeroOptimizer(
            model.named_parameters(),
            OptimizerConfig(lr=3e-3, weight_decay=0.1, precision=precision),
            dist.group.WORLD,
            module=model,
            max_grad_norm=0.5,
            seed=7,
            zero_config=ZeroConfig(stage=stage, reduce_bucket_size=1500, allgather_bucket_size=3000),
        )
        assert len(opt.buffers[0].layout.units) >= 4
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        snapshots = []
        for _ in range(3):
            x = torch.randint(0, 61, (3, 10), generator=g)
            model.loss(model(x[:, :-1]), x[:, 1:]).float().backward()
            assert opt.step()
            opt.zero_grad()
            snapshots.append(torch.cat([p.detach().float().flatten() for p in model.parameters()]))
        return snapshots, events
    finally:
        zstep.adamw_step, param_gather._launch, zopt.ZeroOptimizer._step_units = step_fn, launch_fn, units_fn


@pytest.mark.parametrize("stage,precision", [(2, "fp32"), (1, "fp32_master"), (2, "bf16_sr"), (2, "bf16_kahan")])
def test_step_gathers_each_unit_while_the_next_steps(stage, precision):
    """Each unit's all-gather is launched right after its own fused step, before the next unit is stepped, and the
    run is bitwise the run stepping the whole buffer in one call (the stochastic-rounding stream included)."""
    pipelined = run_ranks(_pipelined_body, 2, stage, precision, False)
    one_call = run_ranks(_pipelined_body, 2, stage, precision, True)
    for (s0, ev0), (s1, ev1) in zip(pipelined, one_call):
        for a, b in zip(s0, s1):
            assert torch.equal(a, b)
        first = ev0[: ev0.index(("step", (1,)))]  # events before unit 1 is stepped
        assert first == [("step", (0,)), ("gather", 0)]
        n = max(u for kind, u in ev0 if kind == "gather") + 1
        assert ev1[0] == ("step", tuple(range(n))) and ev1[1 : n + 1] == [("gather", u) for u in range(n)]
    assert not torch.equal(pipelined[0][0][0], pipelined[0][0][2])  # the steps moved the params
    assert torch.equal(pipelined[0][0][-1], pipelined[1][0][-1])  # both ranks hold the same whole params
