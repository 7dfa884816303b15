"""torch.compile over a single-process (ep=1) MoEBlock: the local dispatcher keeps the token counts a tensor (the
grouped GEMM's offsets, ``llmpar::moe_checked_counts`` for the routing check), so a routing change neither breaks
the graph nor recompiles it. The ep=2 case runs in tests/test_compile_tp.py's 2-rank job."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from llmpar.moe import MoEBlock

TOL = dict(rtol=1e-6, atol=1e-6)
STEPS = 10


def _twins(**kwargs):
    blocks = []
    for _ in range(2):
        torch.manual_seed(5)
        blocks.append(MoEBlock(6, 10, 4, 2, init_std=0.2, **kwargs))
    return blocks


def test_compiled_moe_block_trains_without_recompiles():
    """10 SGD steps on fresh tokens of odd shape (the routing changes each step): compiled (aot_eager) equal to eager
    at 1e-6 in fp32, no graph break, one graph from the first step on and no recompile."""
    torch._dynamo.reset()
    counters.clear()
    eager, model = _twins(shared_intermediate_size=5)
    compiled = torch.compile(model, backend="aot_eager")
    opts = [torch.optim.SGD(b.parameters(), lr=0.05) for b in (eager, model)]
    gen = torch.Generator().manual_seed(7)
    graphs, routed = [], set()
    for step in range(STEPS):
        x = torch.randn(3, 7, 6, generator=gen)
        outs = []
        for block, fn, opt in zip((eager, model), (eager, compiled), opts):
            opt.zero_grad()
            out = fn(x)
            (out.square().sum() + 0.1 * block.aux_loss).backward()
            opt.step()
            outs.append(out.detach())
        torch.testing.assert_close(outs[1], outs[0], **TOL, msg=lambda m: f"step {step} output: {m}")
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"step {step} {name}: {m}")
        assert torch.as_tensor(model.stats.sent).tolist() == eager.stats.sent, f"step {step}: stats"
        routed.add(tuple(eager.stats.sent))
        graphs.append(counters["stats"]["unique_graphs"])
    assert len(routed) > 1, f"the routing never changed: {routed}"
    assert dict(counters["graph_break"]) == {}, f"graph breaks: {dict(counters['graph_break'])}"
    assert graphs == [1] * STEPS, f"graphs after each step: {graphs} (a recompile)"
    assert sum(counters["recompiles"].values()) == 0, f"recompiled: {dict(counters['recompiles'])}"


def test_compiled_moe_block_refuses_nonfinite_routing():
    """A NaN in the input reaches the router: the compiled block raises the eager block's ValueError (the check is
    an op of the graph, run with the counts), after a clean step compiled the same graph."""
    torch._dynamo.reset()
    _, model = _twins()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 5, 6)
    compiled(x)
    x[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite logits .* for 1 of 10 tokens"):
        compiled(x)


def test_checked_counts_op():
    """llmpar::moe_checked_counts: schema, fake impl, a copy of the counts when the routing is finite."""
    counts = torch.tensor([3, 0, 5, 2])
    args = (counts, torch.tensor(0), 5)
    torch.library.opcheck(
        torch.ops.llmpar.moe_checked_counts.default, args, test_utils=("test_schema", "test_faketensor")
    )
    out = torch.ops.llmpar.moe_checked_counts(*args)
    assert torch.equal(out, counts) and out.data_ptr() != counts.data_ptr()
    with pytest.raises(ValueError, match="non-finite logits .* for 2 of 5 tokens"):
        torch.ops.llmpar.moe_checked_counts(counts, torch.tensor(2), 5)
