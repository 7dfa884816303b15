"""ZeRO-3 under torch.compile (``llmpar.zero.compile``): each leaf unit's forward compiled in place, the gathers and
releases in the eager hooks between the regions. One 2-rank CPU/gloo job, cases looped inside it: bad arguments
refused on every rank; the demo GPT (tied embeddings, per-param persistence, units re-gathered for backward, one block
recomputed in backward by activation checkpointing, one frozen) trained 12 steps under ``aot_eager`` equal to eager
ZeRO-3 (losses, gathered weights; fp32 1e-6) with no graph break and no recompile after warm-up (an evaluation forward
in it), with eager's gather / prefetch / free order; one small inductor case."""

import torch
import torch.distributed as dist
from torch import nn
from zero_helpers import GPT_CFG, gpt_batch

from llmpar.models import GPT, GPTConfig
from llmpar.runtime.activations import checkpoint_blocks
from llmpar.zero import OptimizerConfig, ZeroConfig, ZeroOptimizer, consolidated_state_dict
from llmpar.zero.compile import compile_stage3, compiled_regions, uncompile_stage3

from multirank import run_ranks

STEPS, WARMUP, MICRO = 12, 2, 2
LOGGED = 4  # a step after the gather order was recorded: its gather / wait / free log is compared
GPT_REGIONS = ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "lm_head"]


class Block(nn.Module):
    """x [B, 13] -> x + proj(gelu(fc(x))): the small inductor case's unit."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(13, 29), nn.Linear(29, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(nn.functional.gelu(self.fc(x)))


def _gpt() -> GPT:
    return GPT(GPTConfig(**{**GPT_CFG, "n_layer": 4}, tie_embeddings=True), seed=1)


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(Block(), Block())


def _optimizer(model: nn.Module, stage: int = 3) -> ZeroOptimizer:
    zc = ZeroConfig(
        stage=stage,
        reduce_bucket_size=700,
        overlap_comm=True,
        stage3_param_persistence_threshold=16,  # the norms and d-sized biases stay gathered, inside the regions too
        stage3_prefetch_bucket_size=5000,
        stage3_max_reuse_distance=0,  # freed after forward, gathered again for backward: saved tensors re-read
    )
    return ZeroOptimizer(
        model.named_parameters(),
        OptimizerConfig(lr=1e-2, weight_decay=0.1),
        dist.group.WORLD,
        zero_config=zc,
        module=model,
        max_grad_norm=0.3,
    )


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    r = dist.get_rank()
    if kind == "gpt":
        x, y = gpt_batch(step, MICRO * dist.get_world_size())
    else:
        g = torch.Generator().manual_seed(step)
        x, y = (
            torch.randn(MICRO * dist.get_world_size(), 13, generator=g),
            torch.randn(MICRO * dist.get_world_size(), 13, generator=g),
        )
    return x[r * MICRO : (r + 1) * MICRO], y[r * MICRO : (r + 1) * MICRO]


def _train(kind: str, backend: str | None, steps: int) -> dict:
    """``steps`` ZeRO-3 steps of the GPT (``kind="gpt"``) or the small MLP, compiled with ``backend`` (None: eager);
    per step the loss and dynamo's counts; the log of step ``LOGGED``; the gathered weights at the end."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _gpt() if kind == "gpt" else _mlp()
    if kind == "gpt":
        model.blocks[2].requires_grad_(False)  # a frozen unit: its input wrapped (eager) to free it after backward
    opt = _optimizer(model)
    if kind == "gpt":
        checkpoint_blocks(model, first=1)  # blocks.0 recomputed in backward (its region: the checkpointed forward)
    wrapped = model[0].forward if kind == "mlp" else model.blocks[0].__dict__["forward"]
    if backend == "whole":  # the model compiled whole: ZeRO-3's hooks are graph breaks, run eagerly
        model.compile(backend="aot_eager")
    elif backend is not None:
        compile_stage3(opt, model, backend, {"fullgraph": False})  # a graph break would be counted, not raised
    out: dict = {"losses": [], "graphs": [], "breaks": [], "regions": compiled_regions(model)}
    for step in range(steps):
        x, y = _batch(kind, step)
        opt.stage3.log = [] if step == LOGGED else None
        pred = model(x)
        loss = model.loss(pred, y) if kind == "gpt" else nn.functional.mse_loss(pred, y)
        loss.backward()
        assert opt.step()
        opt.zero_grad()
        if step == LOGGED:
            out["log"], out["order"] = opt.stage3.log, list(opt.stage3.trace["fwd"])
        if step == WARMUP - 1 and kind == "gpt":  # an evaluation in the warm-up: its graphs cached beside training's
            model.eval()
            with torch.no_grad():
                out["eval"] = model(x)
            model.train()
        out["losses"].append(loss.item())
        out["graphs"].append((counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]))
        out["breaks"].append(sum(counters["graph_break"].values()))
    out["calls_captured"] = counters["stats"]["calls_captured"]
    out["weights"] = consolidated_state_dict(model, opt, rank0_only=False)
    out["live"] = opt.stage3.live_numel - sum(opt.stage3._numel(k) for k in opt.stage3.persistent)
    if backend not in (None, "whole"):  # compiling again starts from the eager forwards; uncompiling gives them back
        compile_stage3(opt, model, backend, None)
        block = model.blocks[1] if kind == "gpt" else model[0]
        out["recompiled_from_eager"] = block._llmpar_eager_forward[0].__func__ is type(block).forward
        uncompile_stage3(model)
        first = model[0] if kind == "mlp" else model.blocks[0]
        out["uncompiled"] = (
            compiled_regions(model) == [] and "forward" not in block.__dict__ and first.forward == wrapped
        )
    torch._dynamo.reset()
    return out


def _refusals() -> list[tuple[str, str]]:
    """Each bad argument's (exception type, message); nothing is compiled by any of them."""
    model = _gpt()
    opt = _optimizer(model)
    other = _gpt()
    stage2 = ZeroOptimizer(other.named_parameters(), None, dist.group.WORLD, stage=2)
    cases = [
        (opt, other, "aot_eager", None),  # not the module this optimizer partitions
        (opt, model, "no_such_backend", None),
        (opt, model, 7, None),
        (stage2, other, "aot_eager", None),
        (torch.optim.SGD(other.parameters(), lr=0.1), other, "aot_eager", None),
        (opt, model, "aot_eager", {"fullgrahp": True}),
        (opt, model, "aot_eager", "fullgraph"),
        (opt, model, "inductor", {"mode": "reduce-overhead"}),
        (opt, model, "inductor", {"options": {"triton.cudagraphs": True}}),
        (opt, model, "inductor", {"options": {"freezing": True}}),
    ]
    out = []
    for args in cases:
        try:
            compile_stage3(*args)
        except (TypeError, ValueError) as e:
            out.append((type(e).__name__, str(e)))
        else:
            out.append(("no error", ""))
    out.append(("compiled", repr(compiled_regions(model) + compiled_regions(other))))
    return out


def compile_body() -> dict:
    return {
        "refusals": _refusals(),
        "eager": _train("gpt", None, STEPS),
        "compiled": _train("gpt", "aot_eager", STEPS),
        "whole": _train("gpt", "whole", 3),
        "mlp_eager": _train("mlp", None, 3),
        "mlp_inductor": _train("mlp", "inductor", 3),
    }


REFUSED = [
    ("ValueError", "is not the model this optimizer's ZeRO-3 partitions (a GPT): pass the module given"),
    ("ValueError", "backend='no_such_backend' is not a registered torch.compile backend; registered: ["),
    ("TypeError", "backend must be a registered torch.compile backend name or a callable, got 7"),
    ("ValueError", "the optimizer runs ZeRO stage 2"),
    ("TypeError", "optimizer must be the stage-3 ZeroOptimizer partitioning module, got SGD"),
    ("ValueError", "compile_kwargs has ['fullgrahp']: torch.compile of a ZeRO-3 unit takes ['fullgraph'"),
    ("TypeError", "compile_kwargs must be a dict of torch.compile arguments or None, got 'fullgraph'"),
    ("ValueError", "compile_kwargs mode='reduce-overhead' records CUDA graphs"),
    ("ValueError", "compile_kwargs options['triton.cudagraphs']=True records CUDA graphs"),
    ("ValueError", "compile_kwargs options['freezing']=True folds the params into the graph as constants"),
    ("compiled", "[]"),
]


def _same_training(a: dict, b: dict, rtol: float, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=rtol, atol=atol)
    assert sorted(a["weights"]) == sorted(b["weights"])
    for name, w in a["weights"].items():
        torch.testing.assert_close(w, b["weights"][name], rtol=rtol, atol=atol, msg=name)


def test_zero3_regional_compile():
    for rank, out in enumerate(run_ranks(compile_body, 2, timeout=240)):
        for (kind, msg), (want_kind, want) in zip(out["refusals"], REFUSED, strict=True):
            assert kind == want_kind and want in msg, (rank, kind, msg, want)

        eager, comp = out["eager"], out["compiled"]
        assert comp["regions"] == GPT_REGIONS and eager["regions"] == []
        _same_training(comp, eager, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(comp["eval"], eager["eval"], rtol=1e-6, atol=1e-6)
        init = _gpt().state_dict()  # it trains: every weight moved (the frozen block's kept), not constants compared
        for n, w in eager["weights"].items():
            assert torch.equal(w, init[n]) if n.startswith("blocks.2.") else not torch.allclose(w, init[n], atol=1e-4)
        assert comp["calls_captured"] > 0 and comp["graphs"][0][0] > 0  # the regions ran compiled
        assert (
            comp["graphs"][0][0] <= 7
        )  # blocks.1 and 3 share one graph (frozen blocks.2 its own): no compile per block
        assert comp["breaks"] == [0] * STEPS
        assert comp["graphs"][WARMUP - 1 :] == [comp["graphs"][WARMUP - 1]] * (STEPS - WARMUP + 1)  # no recompile
        assert comp["live"] == eager["live"] == 0  # nothing left gathered but the persistent units
        assert comp["recompiled_from_eager"] and comp["uncompiled"]

        # gathers, prefetches and frees in eager's order; the next unit's gather is issued before the current unit
        # is waited for (prefetch), and units are freed after forward and gathered again for backward
        assert comp["log"] == eager["log"] and comp["order"] == eager["order"]
        log, order = comp["log"], comp["order"]
        for cur, nxt in zip(order, order[1:]):
            assert log.index(("gather", nxt)) < log.index(("wait", cur)), (cur, nxt, log)
        again = [k for k in dict.fromkeys(order) if log.count(("gather", k)) == 2]
        # pos_emb, blocks.0-2 (blocks.2 frozen: its own buffer); backward starts with the head (tied to tok_emb) and
        # blocks.3: those stay gathered
        assert again == [(0, 1), (0, 2), (0, 3), (1, 0)], log

        # model.compile() instead: it trains as eager does, each unit's gather / release hook a graph break
        whole = out["whole"]
        torch.testing.assert_close(torch.tensor(whole["losses"]), torch.tensor(eager["losses"][:3]), rtol=1e-6, atol=0)
        assert whole["breaks"][0] > 0 and whole["regions"] == []

        _same_training(out["mlp_inductor"], out["mlp_eager"], rtol=1e-6, atol=1e-6)
        assert out["mlp_inductor"]["regions"] == ["0", "1"]
        assert out["mlp_inductor"]["breaks"] == [0, 0, 0]
        assert out["mlp_inductor"]["graphs"][1:] == [out["mlp_inductor"]["graphs"][0]] * 2
