"""Expert parallelism inside pipeline stages: ``llmpar.initialize`` with a ``"pipeline"`` block and
``"expert_parallel": {"autoep_size": 2}`` on 4 ranks (pp=2 x dp=2, ep=2 folded over each stage's dp ranks) trains like
one process (FusedAdamW, clipping) at ZeRO-1 and ZeRO-2 -- the second with routers carrying an aux loss, a z-loss and
an aux-loss-free expert bias, which reach the backward inside their stage: losses, every rank's params (its slice of
the experts) and the router biases within 1e-9 in float64; what does not compose is refused on every rank."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from zero_helpers import reference_loop

from llmpar.moe import MoEBlock, RouterConfig

from multirank import run_ranks

H, INTER, E, OUT, MICRO, GAS, STEPS, CLIP = 8, 6, 4, 5, 3, 2, 4, 0.5
# Adam moves a near-zero gradient element by up to lr: with eps = 1e-8 a 1e-15 difference in the summation order of
# an expert's few tokens' gradients becomes ~lr / eps x 1e-15 = 2e-9 per step; the run with aux losses and expert
# biases (whose routing leaves experts a few tokens) takes a larger eps so that the comparison stays at 1e-9
EPS_BALANCED = 1e-5


def _model(router: RouterConfig | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    kw = dict(router=router or RouterConfig(), dtype=torch.float64)
    return nn.Sequential(
        OrderedDict(
            inp=nn.Linear(H, H, dtype=torch.float64),
            moe1=MoEBlock(H, INTER, E, 2, shared_intermediate_size=4, **kw),
            moe2=MoEBlock(H, INTER, E, 2, **kw),
            out=nn.Linear(H, OUT, dtype=torch.float64),
        )
    )


def _data(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One dp rank's rows of a step: GAS micro-batches of MICRO rows of 7 tokens (odd shapes, random)."""
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(MICRO * GAS, 7, H, generator=g, dtype=torch.float64), torch.randn(
        MICRO * GAS, 7, OUT, generator=g, dtype=torch.float64
    )


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


def _config(stage: int, eps: float = 1e-8) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.1, "eps": eps}},
        "zero_optimization": {"stage": stage},
        "pipeline": {"stages": 2, "partition": [2]},  # stage 0: inp, moe1; stage 1: moe2, out
        "expert_parallel": {"enabled": True, "autoep_size": 2},
    }


def _balanced() -> RouterConfig:
    """Aux loss, z-loss and an aux-loss-free expert bias: what reaches an earlier stage's router only by the layer."""
    return RouterConfig(aux_loss_coeff=0.05, z_loss_coeff=0.01, expert_bias=True, bias_update_rate=0.05)


def _reference_per_rank(ref: nn.Sequential) -> list[float]:
    """One process, each dp rank's micro-batches in turn (the aux losses are per rank's tokens, as in the engine):
    backward of (loss + the layers' aux losses) / (GAS x dp), FusedAdamW with clipping, then each layer's bias step
    on the load of the whole step."""
    from llmpar.optim import FusedAdamW

    opt = FusedAdamW(ref.parameters(), lr=2e-2, weight_decay=0.1, eps=EPS_BALANCED)
    blocks = [b for b in ref.modules() if isinstance(b, MoEBlock)]
    losses = []
    for s in range(STEPS):
        parts, total = [_data(s, r) for r in range(2)], 0.0
        for m in range(GAS):
            rows = slice(m * MICRO, (m + 1) * MICRO)
            for x, y in parts:
                loss = _loss(ref(x[rows]), y[rows])
                ((loss + sum(b.aux_loss for b in blocks)) / (2 * GAS)).backward()
                total += loss.item() / (2 * GAS)
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), CLIP)
        opt.step()
        opt.zero_grad()
        for b in blocks:
            if b.router.expert_bias is not None:
                b.update_expert_bias()
        losses.append(total)
    return losses


def _body() -> dict[str, float]:
    import llmpar

    errs: dict[str, float] = {}
    for stage, router in ((1, None), (2, _balanced())):
        model = _model(router)
        config = _config(stage, 1e-8 if router is None else EPS_BALANCED)
        engine, *_ = llmpar.initialize(model=model, config=config, loss_fn=_loss)
        dp_rank = engine.mesh["dp"].get_local_rank()
        assert all(b.ep_size == 2 for b in model.modules() if isinstance(b, MoEBlock))
        losses = [float(engine.train_batch(*_data(s, dp_rank))) for s in range(STEPS)]
        ref = _model(router)
        if router is None:
            groups = [{"params": list(ref.named_parameters())}]

            def batch(s: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
                parts = [_data(s, r) for r in range(2)]
                rows = slice(m * MICRO, (m + 1) * MICRO)
                return torch.cat([p[0][rows] for p in parts]), torch.cat([p[1][rows] for p in parts])

            want = reference_loop(ref, groups, STEPS, GAS, batch, lambda net, x, y: _loss(net(x), y), CLIP)
        else:
            want = _reference_per_rank(ref)
            held = {id(b) for sm in engine.runner.split.modules for b in sm.modules()}
            ref_blocks = dict(ref.named_modules())
            moved = [bool(b.router.expert_bias.abs().sum() > 0) for b in ref.modules() if isinstance(b, MoEBlock)]
            assert any(moved), moved  # the reference's bias steps did move a bias
            for name, b in model.named_modules():
                if isinstance(b, MoEBlock) and id(b) in held:  # this rank's stage's routers: the bias steps
                    err = (b.router.expert_bias - ref_blocks[name].router.expert_bias).abs().max().item()
                    errs[f"zero{stage}.{name}.expert_bias"] = err
        errs[f"zero{stage}.loss"] = max(abs(a - b) for a, b in zip(losses, want))
        mine = {id(p) for sm in engine.runner.split.modules for p in sm.parameters()}
        sd, n = ref.state_dict(), E // 2
        for name, p in model.named_parameters():
            if id(p) not in mine:
                continue  # the other stage's
            full = sd[name]
            if ".experts." in name:
                lo = engine.runner.split.modules[0].get_submodule(name.split(".")[0]).experts.first_expert
                full = full[lo : lo + n]
            errs[f"zero{stage}.{name}"] = (p.detach() - full).abs().max().item()
        assert len([k for k in errs if k.startswith(f"zero{stage}.")]) > 4
    return errs


def test_ep2_in_each_of_two_stages_follows_one_process():
    bad = {}
    for rank, errs in enumerate(run_ranks(_body, 4, timeout=300)):
        bad[rank] = {k: f"{v:.1e}" for k, v in errs.items() if not v <= 1e-9}
    assert not any(bad.values()), bad


def _refusals() -> list[str]:
    import llmpar

    out = []
    for change, model in (
        ({"pipeline": {"stages": 2, "partition": [3]}}, _model()),  # stage 1: out only, no MoE layer
        ({"expert_parallel": {"enabled": True, "autoep_size": 4}}, _model()),  # 2 dp ranks per stage
    ):
        try:
            llmpar.initialize(model=model, config={**_config(1), **change}, loss_fn=_loss)
        except ValueError as err:
            out.append(str(err))
    return out


def test_what_does_not_compose_is_refused_on_every_rank():
    for errors in run_ranks(_refusals, 4, timeout=120):
        assert len(errors) == 2, errors
        assert "a pipeline stage holds no MoE layer" in errors[0]
        assert "ep=4 does not divide the 2 data-parallel ranks of each stage" in errors[1]
