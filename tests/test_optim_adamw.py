"""llmpar.optim.FusedAdamW as a torch.optim.Optimizer: parity with torch.optim.AdamW, clipping, skip on non-finite
grads, param groups, state_dict round trips (also from torch's AdamW), LR schedulers, precision modes' state."""

from __future__ import annotations

import copy

import pytest
import torch

from llmpar.optim import FusedAdamW, state_dtypes

SHAPES = [(7, 5), (5,), (4097,), (1,), (3, 41)]


def make_params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) + 0.01).to(dtype)) for s in SHAPES]


def set_grads(params, step, scale=1.0, skip=()):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = None if i in skip else (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def groups(params, lr=1e-2):
    return [{"params": params[:2], "lr": lr, "weight_decay": 0.0}, {"params": params[2:], "weight_decay": 0.1}]


def assert_close_list(a, b, **kw):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach(), y.detach(), **kw)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_matches_torch_adamw_fp32(max_grad_norm):
    ours, ref = make_params(), make_params()
    opt = FusedAdamW(groups(ours), lr=3e-3, betas=(0.8, 0.99), eps=1e-6, max_grad_norm=max_grad_norm)
    tor = torch.optim.AdamW(groups(ref), lr=3e-3, betas=(0.8, 0.99), eps=1e-6, foreach=False)
    for step in range(6):
        skip = (1,) if step == 2 else ()  # a param without grad is left alone
        set_grads(ours, step, scale=3.0, skip=skip)
        set_grads(ref, step, scale=3.0, skip=skip)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref, max_grad_norm)
        opt.step()
        tor.step()
        opt.zero_grad()
        assert all(p.grad is None for p in ours)
    assert_close_list(ours, ref, rtol=2e-6, atol=1e-7)
    for p, q in zip(ours, ref):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][k], tor.state[q][k].to(opt.state[p][k].dtype), rtol=2e-6, atol=1e-7)
    if max_grad_norm is not None:
        assert opt.last_grad_norm is not None and opt.last_grad_norm.dim() == 0


@pytest.mark.parametrize("precision", ["fp32_master", "bf16_sr", "bf16_kahan"])
def test_low_precision_modes_track_fp32(precision):
    """Over 20 steps the bf16 params stay within a few bf16 ulps of an fp32 AdamW on the same (bf16) grads (SR: a
    random walk of one ulp per write, so ~sqrt(steps) ulps)."""
    ours, ref = make_params(torch.bfloat16), make_params()
    with torch.no_grad():
        for p, q in zip(ours, ref):
            q.copy_(p.float())
    opt = FusedAdamW(ours, lr=1e-2, precision=precision)
    tor = torch.optim.AdamW(ref, lr=1e-2)
    for step in range(20):
        set_grads(ours, step)
        for p, q in zip(ours, ref):
            q.grad = p.grad.float()
        opt.step()
        tor.step()
    for p, q in zip(ours, ref):
        err = (p.float() - q).abs().max().item()
        ulps = 3 * 20**0.5 if precision == "bf16_sr" else 4
        assert err <= ulps * 2.0**-8 * q.abs().max().item(), f"{precision}: drift {err}"
    want = state_dtypes(precision, torch.bfloat16)
    state = opt.state[ours[2]]
    assert {k: v.dtype for k, v in state.items() if k != "step"} == want
    assert state["step"].dtype == torch.float32 and state["step"].item() == 20
    if precision == "fp32_master":
        assert torch.equal(ours[2], state["master"].bfloat16())


def test_auto_precision_and_bytes_per_param():
    bytes_per = {}
    for precision, dtype in (
        ("auto", torch.float32),
        ("auto", torch.bfloat16),
        ("bf16_sr", torch.bfloat16),
        ("bf16_kahan", torch.bfloat16),
    ):
        p = torch.nn.Parameter(torch.randn(11).to(dtype))
        opt = FusedAdamW([p], precision=precision)
        p.grad = torch.randn_like(p)
        opt.step()
        bytes_per[(precision, dtype)] = sum(t.element_size() for k, t in opt.state[p].items() if k != "step")
    assert bytes_per == {
        ("auto", torch.float32): 8,
        ("auto", torch.bfloat16): 12,
        ("bf16_sr", torch.bfloat16): 4,
        ("bf16_kahan", torch.bfloat16): 6,
    }


def test_nonfinite_grad_skips_step_with_clipping():
    ps = make_params()
    opt = FusedAdamW(ps, lr=1e-2, max_grad_norm=1.0)
    set_grads(ps, 0)
    opt.step()
    before = [p.detach().clone() for p in ps]
    state = copy.deepcopy(opt.state_dict()["state"])
    set_grads(ps, 1)
    ps[3].grad[0] = float("nan")
    opt.step()
    assert_close_list(ps, before, rtol=0, atol=0)
    assert not torch.isfinite(opt.last_grad_norm)
    for i, p in enumerate(ps):
        for k, v in state[i].items():
            assert torch.equal(opt.state[p][k], v), f"state {k} of param {i} changed on a skipped step"


@pytest.mark.parametrize("precision", ["fp32", "fp32_master", "bf16_sr", "bf16_kahan"])
def test_state_dict_round_trip(precision):
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    a = make_params(dtype)
    opt_a = FusedAdamW(groups(a), lr=1e-2, precision=precision, seed=5)
    for step in range(3):
        set_grads(a, step)
        opt_a.step()
    sd = copy.deepcopy(opt_a.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = FusedAdamW(groups(b), lr=0.5, precision=precision, seed=5)  # lr comes back from the state_dict
    opt_b.load_state_dict(sd)
    for p, q in zip(a, b):
        for k, v in opt_a.state[p].items():
            assert opt_b.state[q][k].dtype == v.dtype and torch.equal(opt_b.state[q][k], v), k
    for step in range(3, 5):
        set_grads(a, step)
        set_grads(b, step)
        opt_a.step()
        opt_b.step()
    assert_close_list(a, b, rtol=0, atol=0)  # bit-identical continuation (also the stochastic roundings)


def test_loads_torch_adamw_state_dict_and_scheduler():
    a, b = make_params(), make_params()
    tor = torch.optim.AdamW(a, lr=1e-2, fused=True)
    for step in range(3):
        set_grads(a, step)
        tor.step()
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    ours = FusedAdamW(b, lr=1e-2)
    ours.load_state_dict(copy.deepcopy(tor.state_dict()))
    sched_t = torch.optim.lr_scheduler.CosineAnnealingLR(tor, T_max=10)
    sched_o = torch.optim.lr_scheduler.CosineAnnealingLR(ours, T_max=10)
    for step in range(3, 7):
        set_grads(a, step)
        set_grads(b, step)
        tor.step()
        ours.step()
        sched_t.step()
        sched_o.step()
        assert ours.param_groups[0]["lr"] == pytest.approx(tor.param_groups[0]["lr"])
    assert_close_list(a, b, rtol=2e-6, atol=1e-7)


def test_tensor_lr():
    a, b = make_params(), make_params()
    ours = FusedAdamW(a, lr=torch.tensor(1e-2))
    tor = torch.optim.AdamW(b, lr=1e-2)
    for step in range(3):
        set_grads(a, step)
        set_grads(b, step)
        ours.step()
        tor.step()
    assert_close_list(a, b, rtol=2e-6, atol=1e-7)


def test_bad_arguments_name_themselves():
    ps = make_params()
    with pytest.raises(ValueError, match="precision='fp16' is not a mode"):
        FusedAdamW(ps, precision="fp16")
    with pytest.raises(TypeError, match="has dtype torch.float32; precision='bf16_sr' takes torch.bfloat16"):
        FusedAdamW(ps, precision="bf16_sr")
    with pytest.raises(ValueError, match="lr=-1 must be >= 0"):
        FusedAdamW(ps, lr=-1)
    with pytest.raises(ValueError, match=r"betas=\(0.9, 1.0\) must be two numbers in \[0, 1\)"):
        FusedAdamW(ps, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="max_grad_norm=0 must be a positive"):
        FusedAdamW(ps, max_grad_norm=0)
    opt = FusedAdamW(ps[:1])
    with pytest.raises(TypeError, match="precision='bf16_kahan' takes torch.bfloat16"):
        opt.add_param_group({"params": ps[1:], "precision": "bf16_kahan"})


def test_precision_checks_are_the_ops_ones(monkeypatch):
    """FusedAdamW validates precision and param dtypes with llmpar.ops.adamw's table and checks, not a copy: a mode
    added to (or a dtype removed from) ops' MODES is what the optimizer accepts."""
    from llmpar.ops import adamw as ops_adamw

    ps = make_params()
    with pytest.raises(
        ValueError,
        match=r"precision='fp16' is not a mode; use 'auto' or one of fp32, fp32_master, "
        r"bf16_sr, bf16_kahan$",
    ):
        FusedAdamW(ps, precision="fp16")
    with pytest.raises(ValueError, match="precision='auto' is not a mode; use one of fp32, "):
        ops_adamw.check_precision("auto")  # the op itself takes no "auto"
    opt = FusedAdamW(ps[:1])
    with pytest.raises(ValueError, match="precision='fp16' is not a mode"):
        opt.add_param_group({"params": [], "precision": "fp16"})
    monkeypatch.setitem(ops_adamw.MODES, "fp32_plain", ops_adamw.MODES["fp32"])
    FusedAdamW(ps, precision="fp32_plain")
    monkeypatch.setitem(
        ops_adamw.MODES, "fp32", ops_adamw.ModeSpec(param_dtypes=(torch.float64,), moment_dtype=None, extra=None)
    )
    with pytest.raises(
        TypeError,
        match=r"a parameter of shape \(7, 5\) has dtype torch.float32; precision='fp32' "
        r"takes torch.float64 params",
    ):
        FusedAdamW(ps, precision="fp32")
