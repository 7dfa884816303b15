"""Pipeline pieces that need no ranks: the balanced cut, boundaries, schedule checks, bubble formula, blocks."""

import itertools
import random

import pytest
import torch
from torch import nn

from llmpar.models import GPT, GPTConfig
from llmpar.pipeline import balanced_boundaries, bubble_fraction, to_blocks
from llmpar.pipeline.partition import check_boundaries, stage_ranges
from llmpar.pipeline.schedules import check_schedule


def _max_stage(costs, cuts):
    return max(sum(costs[i] for i in r) for r in stage_ranges(cuts, len(costs)))


def _brute_force(costs, k):
    return min(_max_stage(costs, list(c)) for c in itertools.combinations(range(1, len(costs)), k - 1))


@pytest.mark.parametrize("seed", range(20))
def test_balanced_split_is_optimal_and_within_one_block(seed):
    rng = random.Random(seed)
    n = rng.randint(4, 10)
    k = rng.randint(2, min(4, n))
    costs = [rng.randint(1, 100) for _ in range(n)]
    cuts = balanced_boundaries(costs, k)
    assert len(cuts) == k - 1 and all(0 < a < b <= n for a, b in zip(cuts, cuts[1:] + [n]))
    best = _max_stage(costs, cuts)
    assert best == _brute_force(costs, k)
    assert best <= sum(costs) / k + max(costs)  # within one block of the ideal equal share


def test_balanced_split_of_gpt_by_params():
    model = GPT(GPTConfig(vocab_size=64, n_layer=6, n_head=2, d_model=16, seq_len=8))
    blocks = to_blocks(model)
    assert [n for n, _ in blocks] == ["embed"] + [f"blocks.{i}" for i in range(6)] + ["head"]
    params = [sum(p.numel() for p in b.parameters()) for _, b in blocks]
    assert sum(params) == model.num_params()
    for k in (2, 4):
        cuts = balanced_boundaries(params, k)
        assert _max_stage(params, cuts) == _brute_force(params, k)


def test_blocks_compute_the_model():
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, seq_len=8), dtype=torch.float64)
    x = torch.randint(0, 64, (3, 8))
    y = x
    for _, b in to_blocks(model):
        y = b(y)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)


def test_explicit_boundaries_are_checked():
    assert check_boundaries([2, 5], 8, 3) == [2, 5]
    with pytest.raises(ValueError, match="boundaries=\\[2\\] must list 2"):
        check_boundaries([2], 8, 3)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_boundaries([5, 2], 8, 3)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_boundaries([0, 2], 8, 3)
    with pytest.raises(TypeError, match="must hold ints"):
        check_boundaries([1.5, 3], 8, 3)
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 3"):
        balanced_boundaries([1, 1], 3)


def test_bubble_formula():
    assert bubble_fraction("1f1b", pp=4, micro_batches=4) == pytest.approx(3 / 7)
    assert bubble_fraction("gpipe", pp=4, micro_batches=16) == pytest.approx(3 / 19)
    assert bubble_fraction("interleaved_1f1b", pp=4, micro_batches=4, virtual_stages=2) == pytest.approx(3 / 11)
    assert bubble_fraction("1f1b", pp=1, micro_batches=8) == 0.0


def test_schedule_checks_name_the_argument():
    assert check_schedule("1F1B", pp=2, micro_batches=2, virtual_stages=1) == "1f1b"
    assert check_schedule("interleaved", pp=2, micro_batches=4, virtual_stages=2) == "interleaved_1f1b"
    with pytest.raises(ValueError, match="schedule='zb' is not one of"):
        check_schedule("zb", pp=2, micro_batches=4, virtual_stages=1)
    with pytest.raises(ValueError, match="micro_batches=0 must be a positive int"):
        check_schedule("gpipe", pp=2, micro_batches=0, virtual_stages=1)
    with pytest.raises(ValueError, match="micro_batches=2 must be >= pp=4"):
        check_schedule("1f1b", pp=4, micro_batches=2, virtual_stages=1)
    with pytest.raises(ValueError, match="needs virtual_stages >= 2"):
        check_schedule("interleaved_1f1b", pp=2, micro_batches=4, virtual_stages=1)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        check_schedule("gpipe", pp=2, micro_batches=4, virtual_stages=2)
    with pytest.raises(ValueError, match="micro_batches=5 does not work with interleaved"):
        check_schedule("interleaved_1f1b", pp=2, micro_batches=5, virtual_stages=2)


def test_to_blocks_rejects_unknown_models():
    with pytest.raises(TypeError, match="model is a Linear"):
        to_blocks(nn.Linear(2, 2))
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert [n for n, _ in to_blocks(seq)] == ["0", "1"]


def test_pipeline_does_not_import_the_demo_model():
    """A model enters a pipeline through its ``pipeline_blocks()`` hook (GPT has one); pipeline/ never imports
    llmpar.models' demo model: only the model anatomy (``llmpar.models.anatomy``, which says what a model's pipeline
    sequence is), and importing llmpar.pipeline loads no module of the demo model."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import llmpar.pipeline

    bad = []
    for path in sorted(Path(llmpar.pipeline.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            bad += [
                f"{path.name}:{node.lineno} imports {n}"
                for n in names
                if n.startswith("llmpar.models") and n != "llmpar.models.anatomy"
            ]
    assert not bad, bad
    code = (
        "import sys, llmpar.pipeline, llmpar.pipeline.stages, llmpar.pipeline.zero\n"
        "print(sorted(m for m in sys.modules if m.startswith('llmpar.models')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "['llmpar.models', 'llmpar.models.anatomy']", done.stdout
