"""Faults found by a fault campaign on the ZeRO side and the config, each a test that failed before its fix:

- every numeric config key is bounded, a value out of range refused naming the key and the range (an fp16
  ``initial_scale_power`` of 128 gave an infinite float32 scale, 1024 an OverflowError naming no key);
- ``eps`` 0 (params NaN after the first step) is refused in the config, in param groups and in ``FusedAdamW``;
- one non-finite gradient no longer poisons the qgZ error-feedback residuals: the skipped step resets them and
  training goes on as it does without error feedback;
- a write to a param of a model built under ``llmpar.zero.Init`` between the block and ``initialize``
  (``load_state_dict``, an in-place init) takes effect in the engine instead of being dropped.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmpar.optim import FusedAdamW
from llmpar.runtime import Config
from llmpar.zero import LossScaler
from llmpar.zero.config import OptimizerConfig, param_groups

BASE = {"train_batch_size": 8}
I64 = 2**63 - 1


def _with(path: str, value):
    """BASE with ``value`` at the dotted ``path`` (blocks created as needed; fp16 enabled when touched)."""
    cfg = {**BASE}
    parts = path.split(".")
    block = cfg
    for part in parts[:-1]:
        block = block.setdefault(part, {})
    block[parts[-1]] = value
    if parts[0] == "optimizer":
        cfg["optimizer"]["type"] = "AdamW"
    if parts[0] == "zero_optimization":
        cfg["zero_optimization"].setdefault("stage", 3)
    if parts[0] == "fp16":
        cfg["fp16"]["enabled"] = True
    return cfg


# (key, values refused, a value at the edge that is accepted, what the error says is accepted)
BOUNDS = [
    ("fp16.initial_scale_power", [128, 1024, 65, -1], 64, "<= 64"),
    ("fp16.loss_scale", [2.0**65, 1e300, 1e-30, -1.0], 2.0**64, "2**64"),
    ("fp16.loss_scale_window", [2**63, 0], I64, "<= 2**63 - 1"),
    ("fp16.hysteresis", [2**63, 0], I64, "<= 2**63 - 1"),
    ("fp16.min_loss_scale", [0.0, 2.0**17, 1e300], 2.0**16, "2**16"),  # with the default initial_scale_power 16
    ("zero_optimization.reduce_bucket_size", [2**63, 1e30, 0], I64, "<= 2**63 - 1"),
    ("zero_optimization.allgather_bucket_size", [2**63, 0], I64, "<= 2**63 - 1"),
    ("zero_optimization.stage3_prefetch_bucket_size", [2**64, -1], I64, "<= 2**63 - 1"),
    ("zero_optimization.stage3_param_persistence_threshold", [2**64, -1], 0, "<= 2**63 - 1"),
    ("zero_optimization.stage3_max_live_parameters", [2**64], I64, "<= 2**63 - 1"),
    ("zero_optimization.stage3_max_reuse_distance", [2**64], I64, "<= 2**63 - 1"),
    ("zero_optimization.sub_group_size", [2**64], I64, "<= 2**63 - 1"),
    ("gradient_clipping", [1e39, 1e-40, -1.0], 1e38, "3.40282e+38"),
    ("steps_per_print", [2**63, 0], I64, "<= 2**63 - 1"),
    ("optimizer.params.lr", [1e39, -1.0], 3e38, "3.40282e+38"),
    ("optimizer.params.weight_decay", [1e39, -0.5], 0.0, "3.40282e+38"),
    ("optimizer.params.eps", [0, 0.0, 1e-40, 1e39, -1e-8], 1.2e-38, "must be > 0 and finite"),
    ("optimizer.params.betas", [[0.9, 1.0], [-0.1, 0.9]], [0.0, 0.999999], "< 1"),
]


@pytest.mark.parametrize("key, bad, edge, accepted", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_numeric_config_keys_are_bounded_naming_the_key_and_the_range(key, bad, edge, accepted):
    for value in bad:
        with pytest.raises(ValueError) as info:
            Config.from_deepspeed(_with(key, value), dp=2)
        msg = str(info.value)
        assert f'"{key}"' in msg and accepted in msg, (value, msg)
    Config.from_deepspeed(_with(key, edge), dp=2)  # the edge of the range is taken


def test_initial_scale_power_at_the_bound_gives_a_finite_float32_scale_and_above_is_refused_by_the_scaler():
    scaler = LossScaler(initial_scale_power=64)
    assert torch.isfinite(scaler.scale) and float(scaler.scale) == 2.0**64
    assert torch.isfinite(scaler.inv_scale().to(torch.float32)) and float(scaler.inv_scale()) > 0
    for power in (128, 1024):  # was: an infinite float32 scale / OverflowError naming no key
        with pytest.raises(ValueError, match=r'"fp16.initial_scale_power"=\d+ must be >= 0 and <= 64'):
            LossScaler(initial_scale_power=power)
    with pytest.raises(ValueError, match=r'"fp16.min_loss_scale"=64.0 .*2\*\*5'):
        LossScaler(initial_scale_power=5, min_loss_scale=64.0)  # a floor above the start would raise the scale


# ------------------------------------------------------------------------------------------------------ eps
def _params():
    g = torch.Generator().manual_seed(4)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]


@pytest.mark.parametrize("eps", [0, 0.0, 1e-45, -1e-8, math.inf, math.nan])
def test_eps_zero_or_out_of_range_is_refused_everywhere_naming_it(eps):
    with pytest.raises(ValueError, match=r"eps.*must be (> 0 and )?(a )?finite"):
        Config.from_deepspeed(_with("optimizer.params.eps", eps), dp=2)
    with pytest.raises(ValueError, match=r'"optimizer.params.eps"=.* must be'):
        OptimizerConfig(eps=eps)
    with pytest.raises(ValueError, match=r"^eps=.* must be > 0 and finite"):
        FusedAdamW(_params(), eps=eps)
    opt = FusedAdamW(_params()[:1])
    with pytest.raises(ValueError, match=r"param group: eps=.* must be > 0 and finite"):
        opt.add_param_group({"params": _params()[1:], "eps": eps})
    with pytest.raises(ValueError, match=r"param group 1: eps=.* must be > 0 and finite"):
        param_groups([{"params": _params()[:1]}, {"params": _params()[1:], "eps": eps}], OptimizerConfig())


def test_the_smallest_accepted_eps_keeps_params_finite_where_grads_are_zero():
    """eps 0 made every element with a zero gradient NaN at the first step; the smallest eps taken does not."""
    ps = _params()
    opt = FusedAdamW(ps, eps=1.2e-38, weight_decay=0.0)
    for p in ps:
        g = torch.randn(p.shape, dtype=torch.float64).to(p.dtype)
        g.view(-1)[::2] = 0.0  # unused rows / padding: v stays 0 there
        p.grad = g
    before = [p.detach().clone() for p in ps]
    opt.step()
    for p, b in zip(ps, before):
        assert torch.isfinite(p).all()
        assert torch.equal(p.detach().view(-1)[::2], b.view(-1)[::2])  # zero grad, no decay: unchanged


# ------------------------------------------------------------------------------------ qgZ error feedback
GPT_SMALL = dict(vocab_size=64, n_layer=2, n_head=4, d_model=32, seq_len=16)
EF_STEPS, EF_BAD = 6, 1  # the step whose gradient is non-finite on rank 1


def _ef_run(fp16: bool, feedback: bool) -> dict:
    """6 steps at ZeRO-2 with quantized gradients; at step EF_BAD rank 1's loss is multiplied by inf (fp32: NaN / inf
    gradients) or 1e30 (fp16: an overflow at any scale)."""
    import torch.distributed as dist

    import llmpar
    from llmpar.models import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 5000,
            "zero_quantized_gradients": True,
            "zero_quantized_gradients_error_feedback": feedback,
        },
    }
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_SMALL))
    engine, opt, _, _ = llmpar.initialize(model=model, config=cfg)
    losses = []
    for s in range(EF_STEPS):
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randint(0, 64, (4 * world, 17), generator=g)[4 * rank : 4 * (rank + 1)]
        loss = model.loss(engine(x[:, :-1]), x[:, 1:])
        bad = s == EF_BAD and rank == 1
        engine.backward(loss * (1e30 if fp16 else float("inf")) if bad else loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    q = opt.reducer.quantizer
    residuals = list(q.residual.values()) + list(q.residual2.values())
    return {
        "losses": losses,
        "skipped": opt.skipped_steps,
        "scale": opt.loss_scale,
        "finite": all(bool(torch.isfinite(r).all()) for r in residuals),
        "held": q.residual_numel(),
    }


def ef_body():
    return {(fp16, fb): _ef_run(fp16, fb) for fp16 in (False, True) for fb in (False, True)}


def test_a_non_finite_gradient_does_not_poison_error_feedback():
    """Before: the residual took the NaN, was never reset, and every later step was skipped (fp32: only a warning;
    fp16: the scale halved at every step down to DeepSpeed's 'overflow at every scale'). Now the skipped step resets
    the residuals and the run goes on like the same run without error feedback (close: quantization differs)."""
    from multirank import run_ranks

    for out in run_ranks(ef_body, 2, timeout=240):
        for fp16 in (False, True):
            plain, fed = out[(fp16, False)], out[(fp16, True)]
            assert plain["skipped"] == 1 and fed["skipped"] == 1, (fp16, plain["skipped"], fed["skipped"])
            assert fed["finite"] and fed["held"] > 0
            assert fed["scale"] == plain["scale"]
            after = slice(EF_BAD + 1, None)
            assert all(math.isfinite(v) for v in fed["losses"][after])
            rel = max(abs(a - b) / a for a, b in zip(plain["losses"][after], fed["losses"][after]))
            assert rel < 0.01, (fp16, rel, plain["losses"], fed["losses"])


def test_on_a_device_the_residuals_are_masked_without_reading_the_flag():
    """The CUDA path (the flag stays on the device): residuals zeroed in place on a skip, kept otherwise."""
    from llmpar.zero.compressed import GradQuantizer

    q = GradQuantizer(split=None, bits=4, block=16, error_feedback=True, counter=None)
    g = torch.Generator().manual_seed(3)
    q.residual[(0, 0)] = torch.randn(37, generator=g)
    q.residual[(0, 1)] = torch.full((5,), float("nan"))
    q.residual2[(0, 0)] = torch.randn(11, generator=g)
    kept = {k: v.clone() for k, v in q.residual.items()}
    q.mask_residuals(torch.tensor(False))
    assert torch.equal(q.residual[(0, 0)], kept[(0, 0)]) and torch.isnan(q.residual[(0, 1)]).all()
    q.mask_residuals(torch.tensor(True))
    assert all(not r.any() for r in list(q.residual.values()) + list(q.residual2.values()))
    assert q.reset_if_skipped(torch.tensor(0.0)) is False and q.residual  # host flag, no skip: kept
    assert q.reset_if_skipped(torch.tensor(1.0)) is True and not q.residual and not q.residual2


# ------------------------------------------------------------------------- writes after a zero.Init block
def _writes(model, sd):
    """What users do between the block and initialize: load a state dict, then a few in-place inits."""
    from torch import nn

    model.load_state_dict(sd)
    with torch.no_grad():
        model.head.bias.zero_()
        model.head.weight.data[1].fill_(0.25)  # through .data and a view
        model.body[0].weight.view(-1)[::3].mul_(-1.5)
    nn.init.trunc_normal_(model.body[2].weight, std=0.05)  # a random init: draws as a plain build does
    nn.init.normal_(model.body[2].bias, std=0.3)


def _make():
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 9))
            self.head = nn.Linear(9, 5)

        def forward(self, x):
            return self.head(self.body(x))

    return Net()


def init_writes_body():
    import torch.distributed as dist

    import llmpar
    import llmpar.zero

    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    g = torch.Generator().manual_seed(11)
    sd = {k: torch.randn(v.shape, generator=g, dtype=torch.float64).float() for k, v in _make().state_dict().items()}
    runs = {}
    for sharded in (False, True):
        torch.manual_seed(5)
        with llmpar.zero.Init(enabled=sharded):
            model = _make()
        meta = all(p.is_meta for p in model.parameters())
        _writes(model, {k: v.clone() for k, v in sd.items()})
        rng = torch.random.get_rng_state()
        engine, *_ = llmpar.initialize(model=model, config=cfg)
        with llmpar.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        x = torch.randn(2, 3, 13, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
        losses = []
        for xb in x.float():
            loss = engine(xb).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[sharded] = dict(meta=meta, params=params, rng=rng, losses=losses)
    # init_fn (as the sharded from_pretrained's checkpoint reader) runs when a unit is materialised; what was written
    # after the block came later and wins over it. In bf16: initialize's own model.to() casts are replayed too
    with llmpar.zero.Init(init_fn=lambda unit: [p.fill_(0.125) for p in unit.parameters(recurse=False)]):
        model = _make()
    model.load_state_dict({"head.weight": sd["head.weight"]}, strict=False)
    with torch.no_grad():
        model.head.bias.zero_()
    engine = llmpar.initialize(model=model, config={**cfg, "bf16": {"enabled": True}})[0]  # held: owns the params
    with llmpar.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        runs["init_fn"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return runs, sd


def test_writes_after_a_zero_init_block_take_effect_in_the_engine():
    """Before: the params outside the block were meta tensors, so load_state_dict reported 'All keys matched' and
    copied nothing, and in-place inits did nothing: the engine trained from the recorded random init. Now every
    write is recorded and replayed: the engine starts from exactly what a plain build + the same writes gives."""
    from multirank import run_ranks

    for runs, sd in run_ranks(init_writes_body, 2, timeout=120):
        plain, sharded = runs[False], runs[True]
        assert sharded["meta"] and not plain["meta"]
        assert torch.equal(plain["params"]["body.0.bias"], sd["body.0.bias"])  # the reference loaded it
        for name, want in plain["params"].items():
            assert torch.equal(sharded["params"][name], want), name
        assert torch.equal(sharded["rng"], plain["rng"])  # the random init after the block drew as a plain one
        assert sharded["losses"] == plain["losses"]
        got = runs["init_fn"]
        assert all(p.dtype == torch.bfloat16 for p in got.values())
        assert torch.equal(got["head.weight"], sd["head.weight"].bfloat16())
        assert not got["head.bias"].any()
        for name in ("body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"):
            assert (got[name] == 0.125).all(), name


def test_a_loaded_tensor_changed_before_initialize_or_a_swapped_param_is_refused_naming_the_param():
    """Loaded tensors are held by reference (no copy of the state dict): one changed in place before initialize
    reads it has lost the values written, which is an error naming the param, as is a param swapped for an empty
    meta tensor."""
    import llmpar.zero
    from llmpar.zero.init import replace_meta_params
    from llmpar.zero.replay import Kept

    with llmpar.zero.Init():
        model = _make()
    sd = {k: torch.randn(v.shape) for k, v in model.state_dict().items()}
    model.load_state_dict(sd)
    rec = model.head.weight.__dict__["_llmpar_recorder"]
    held = [x.tensor for s in rec.storages.values() for op in s.log for x in op.flat if isinstance(x, Kept)]
    assert any(t.data_ptr() == sd["head.weight"].data_ptr() for t in held)  # by reference, not a copy
    sd["head.weight"].add_(1.0)
    with pytest.raises(ValueError, match=r"param head\.weight: a tensor written into it .* changed in place"):
        replace_meta_params(model, torch.device("cpu"))

    with llmpar.zero.Init():
        model = _make()
    model.body[2].weight.data = torch.empty(9, 11, device="meta")
    with pytest.raises(ValueError, match=r"param body\.2\.weight \(9, 11\) .* replaced after the block"):
        replace_meta_params(model, torch.device("cpu"))


def test_a_deep_copy_after_the_block_materialises_as_the_original_and_its_writes_stay_its_own():
    import copy

    import llmpar.zero
    from llmpar.zero.init import _DEFERRED, replace_meta_params

    torch.manual_seed(8)
    ref = _make()
    torch.manual_seed(8)
    with llmpar.zero.Init():
        model = _make()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.head.weight.fill_(2.0)
    for m in (model, twin):
        replace_meta_params(m, torch.device("cpu"))
    for (name, p), (_, q), (_, r) in zip(model.named_parameters(), twin.named_parameters(), ref.named_parameters()):
        assert torch.equal(getattr(p, _DEFERRED).value(), r), name
        want = torch.full_like(r, 2.0) if name == "head.weight" else r
        assert torch.equal(getattr(q, _DEFERRED).value(), want), name
