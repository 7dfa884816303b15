"""DeepSpeed's pipeline API under llmpar (``llmpar.pipe``): PipelineModule / LayerSpec / TiedLayerSpec cut as
DeepSpeed cuts them (its own ``_partition_layers`` is the reference, run without a process group), built lazily per
stage, ``train_batch()`` pulling ``training_data`` in order, ``eval_batch``, in-place activations at the stage
boundary, and a DeepSpeed pipeline script (``tests/data/pipe_script.py``) run under torchrun on 2 CPU ranks (pp=2)
with DeepSpeed and with ``import llmpar as deepspeed``: the same 30 losses (fp32, <= 1e-5 relative; DeepSpeed's run
of the "uniform" partition is a golden file, tests/golden/pipe_compat/, the "parameters" one runs live).
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llmpar.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from llmpar.pipeline.specs import partition_layers

from multirank import free_port, run_ranks
from reference_runs import References

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


class Block(nn.Module):
    def __init__(self, width, frozen_bias=False):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.fc.bias.requires_grad_(not frozen_bias)

    def forward(self, x):
        return torch.relu(self.fc(x))


def flatten(x):
    return x.flatten(1)


def _layers(spec, tied):
    """The same layer list with DeepSpeed's or llmpar's spec classes: specs, a frozen bias, modules, callables, a
    tied key used three times."""
    return [
        tied("emb", nn.Linear, 6, 24, bias=False),
        spec(Block, 24),
        nn.ReLU(),
        spec(nn.Linear, 24, 40),
        spec(Block, 40, frozen_bias=True),
        flatten,
        nn.Tanh(),
        spec(nn.Linear, 40, 24),
        spec(Block, 24),
        tied("emb", nn.Linear, 6, 24, bias=False, forward_fn=lambda m, x: x @ m.weight),
        spec(nn.Linear, 6, 6),
        lambda x: x * 2,
        tied("emb", nn.Linear, 6, 24, bias=False),
        spec(nn.LayerNorm, 24),
    ]


def _deepspeed_parts(layers, stages, method):
    """DeepSpeed's PipelineModule._partition_layers on a bare module: no process group needed."""
    from deepspeed.runtime.pipe.module import PipelineModule as DSModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    ds = DSModule.__new__(DSModule)
    nn.Module.__init__(ds)
    ds.num_stages, ds.global_rank, ds.loss_fn = stages, 0, None
    ds._topo = PipeDataParallelTopology(num_pp=stages, num_dp=1)
    ds._layer_specs, ds._num_layers = list(layers), len(layers)
    ds._partition_layers(method=method)
    return [int(p) for p in ds.parts]


@pytest.mark.parametrize(
    "method", ["parameters", "uniform", "type:linear", "TYPE:Block", "type:block|tanh", "type:^(flatten|<lambda>)$"]
)
@pytest.mark.parametrize("stages", [1, 2, 3, 5, 13, 16])
def test_partition_matches_deepspeed(method, stages):
    """The same parts, and the same draws from the random generator (``parameters`` builds every spec once)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from deepspeed.runtime.pipe import LayerSpec as DSSpec
    from deepspeed.runtime.pipe import TiedLayerSpec as DSTied

    torch.manual_seed(0)
    expected = _deepspeed_parts(_layers(DSSpec, DSTied), stages, method)
    ds_rng = torch.get_rng_state()
    torch.manual_seed(0)
    assert partition_layers(_layers(LayerSpec, TiedLayerSpec), stages, method) == expected
    assert torch.equal(torch.get_rng_state(), ds_rng)


def test_partition_errors():
    layers = _layers(LayerSpec, TiedLayerSpec)
    with pytest.raises(ValueError, match="no layer's class name matches 'conv'"):
        partition_layers(layers, 2, "type:Conv")
    with pytest.raises(ValueError, match="partition_method='profile' is not one of"):
        partition_layers(layers, 2, "profile")
    with pytest.raises(ValueError, match="num_stages=0 must be a positive int"):
        partition_layers(layers, 0, "uniform")
    with pytest.raises(TypeError, match="LayerSpec typename must be an nn.Module class"):
        LayerSpec(torch.relu)


# ---------------------------------------------------------------------------------------------- on 2 ranks (pp=2)

MICRO, GAS = 2, 4
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "steps_per_print": 1000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
}


class Recorded(nn.Linear):
    """A Linear that records the index it was built for (``built`` is per process: each rank its own)."""

    built: list = []

    def __init__(self, idx, *args):
        super().__init__(*args)
        Recorded.built.append(idx)


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :3] * 2).argmax(dim=1))


def lazy_body():
    Recorded.built.clear()
    layers = [LayerSpec(Recorded, i, 6, 6) for i in range(5)] + [nn.ReLU()]
    net = PipelineModule(layers=layers, num_stages=2, partition_method="uniform")
    return Recorded.built, net.partitions(), [n for n, _ in net.named_parameters()]


def test_layer_specs_are_built_by_their_stage_only():
    (built0, parts, names0), (built1, _, names1) = run_ranks(lazy_body, 2)
    assert parts == [0, 3, 6]
    assert (built0, built1) == ([0, 1, 2], [3, 4])
    assert names0 == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]  # DeepSpeed's names
    assert names1 == ["3.weight", "3.bias", "4.weight", "4.bias"]


def _inplace_layers():
    """Prebuilt modules (the same weights on every rank): stage 0 ends with an in-place ReLU, stage 1 starts with one
    (uniform: [0, 3, 6])."""
    torch.manual_seed(5)
    return [
        nn.Linear(6, 16),
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),
        nn.ReLU(inplace=True),
        nn.Linear(16, 3),
        nn.Tanh(),
    ]


def inplace_body(steps):
    import llmpar

    layers = _inplace_layers()
    reference = nn.Sequential(*copy.deepcopy(layers))
    for m in reference:  # in one process the second in-place ReLU would overwrite what the first saved for backward
        if hasattr(m, "inplace"):
            m.inplace = False
    net = PipelineModule(layers=layers, num_stages=2, partition_method="uniform", loss_fn=nn.CrossEntropyLoss())
    data = _data(MICRO * GAS * steps)
    engine, _, loader, _ = llmpar.initialize(model=net, config=CONFIG, training_data=data)
    losses = [float(engine.train_batch()) for _ in range(steps)]

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = []
    for s in range(steps):
        total = 0.0
        for i in range(GAS):
            x, y = data[(s * GAS + i) * MICRO : (s * GAS + i + 1) * MICRO]
            loss = nn.functional.cross_entropy(reference(x), y) / GAS
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad()
        expected.append(total)
    return losses, expected, net.partitions(), type(loader).__name__


def test_inplace_relu_at_the_stage_boundary_trains_like_one_process():
    for losses, expected, parts, loader in run_ranks(inplace_body, 2, 6):
        assert parts == [0, 3, 6] and loader == "RepeatingLoader"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def _tied_net(interval=0, model_loss=False, loss_fn=None):
    torch.manual_seed(11)
    layers = [
        TiedLayerSpec("emb", nn.Linear, 6, 12, bias=False),
        nn.ReLU(inplace=True),
        LayerSpec(nn.Linear, 12, 12),
        TiedLayerSpec("emb", nn.Linear, 6, 12, bias=False, forward_fn=lambda m, x: x @ m.weight),
        LayerSpec(nn.Linear, 6, 3),
    ] + ([lambda out: (out**2).mean()] if model_loss else [])
    loss_fn = None if model_loss else loss_fn or nn.CrossEntropyLoss()
    return PipelineModule(
        layers=layers,
        num_stages=2,
        loss_fn=loss_fn,
        partition_method="uniform",
        activation_checkpoint_interval=interval,
    )


def data_body(steps):
    """train_batch() on training_data == train_batch(iterator over the same micro-batches in order), the loader
    wrapping around; eval_batch: the batch's loss before a step, no gradient, no change, iterator untouched; tied
    weights equal across the stages from the start and after training."""
    import llmpar

    data = _data(MICRO * GAS * 2 + MICRO * 2)  # 2.5 steps of data: the third step wraps around
    a, _, _, _ = llmpar.initialize(model=_tied_net(), config=CONFIG, training_data=data)
    b, _, _, _ = llmpar.initialize(model=_tied_net(), config=CONFIG)
    tied = a.module.tied_modules["emb"].weight
    start = [tied.detach().clone()]
    dist.all_reduce(start[0])  # stage 0 + stage 1
    same_start = torch.equal(start[0], 2 * tied.detach())
    in_order = [data[i * MICRO : (i + 1) * MICRO] for i in range(len(data) // MICRO)]
    stream = iter(in_order * steps)
    loss_a = [float(a.train_batch()) for _ in range(steps)]
    loss_b = [float(b.train_batch(stream)) for _ in range(steps)]  # DeepSpeed's positional data_iter

    eval_batches = [data[i * MICRO : (i + 1) * MICRO] for i in range(GAS)]
    before = [p.detach().clone() for p in a.module.parameters()]
    kept = a.data_iterator
    ev = float(a.eval_batch(iter(eval_batches)))
    untouched = a.data_iterator is kept
    unchanged = all(torch.equal(p, q) for p, q in zip(a.module.parameters(), before))
    no_grad = all(p.grad is None or not p.grad.any() for p in a.module.parameters())
    train_loss = float(a.train_batch(iter(eval_batches)))  # the same batch, before its step
    end = tied.detach().clone()
    dist.all_reduce(end)
    return (
        loss_a,
        loss_b,
        same_start,
        torch.equal(end, 2 * tied.detach()),
        ev,
        train_loss,
        unchanged,
        no_grad,
        untouched and a.data_iterator is not kept,
        a.global_steps,
    )


def test_train_batch_pulls_training_data_in_order_and_eval_batch():
    for loss_a, loss_b, same_start, same_end, ev, train_loss, unchanged, no_grad, replaced, steps in run_ranks(
        data_body, 2, 4
    ):
        assert loss_a == loss_b and loss_a[-1] < loss_a[0]
        assert same_start and same_end
        assert ev == pytest.approx(train_loss, rel=1e-6)
        assert unchanged and no_grad
        assert replaced and steps == 5  # eval_batch leaves the iterator, train_batch(it) keeps it (DeepSpeed's)


def variants_body(steps):
    """activation_checkpoint_interval=2 trains as 0; without loss_fn the last layer's output is the loss."""
    import llmpar

    data = _data(MICRO * GAS * steps)
    out = []
    for net in (_tied_net(), _tied_net(interval=2), _tied_net(model_loss=True)):
        engine, _, _, _ = llmpar.initialize(model=net, config=CONFIG, training_data=data)
        out.append([float(engine.train_batch()) for _ in range(steps)])
    squares = _tied_net(loss_fn=lambda output, labels: (output**2).mean())
    engine, _, _, _ = llmpar.initialize(model=squares, config=CONFIG, training_data=data)
    out.append([float(engine.train_batch()) for _ in range(steps)])
    return out


def test_checkpoint_interval_and_a_loss_computed_by_the_model():
    for plain, checkpointed, model_loss, loss_fn in run_ranks(variants_body, 2, 3):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-6, atol=0)
        torch.testing.assert_close(model_loss, loss_fn, rtol=1e-6, atol=0)


def errors_body():
    import llmpar

    out = []
    for config in [{**CONFIG, "pipeline": {"stages": 4}}, {**CONFIG, "tensor_parallel": {"size": 2}}]:
        try:
            llmpar.initialize(model=_tied_net(), config=config)
        except ValueError as e:
            out.append(str(e))
    engine, _, _, _ = llmpar.initialize(model=_tied_net(), config=CONFIG)
    try:
        engine.train_batch()
    except TypeError as e:
        out.append(str(e))
    try:
        engine.eval_batch(iter([]), return_logits=True)
    except ValueError as e:
        out.append(str(e))
    try:
        PipelineModule(layers=[nn.ReLU()], num_stages=2)
    except ValueError as e:
        out.append(str(e))
    return out


def test_errors_name_the_argument():
    for errors in run_ranks(errors_body, 2):
        assert len(errors) == 5, errors
        assert '"pipeline.stages"=4 but the PipelineModule has num_stages=2' in errors[0]
        assert '"tensor_parallel.size"=2: a PipelineModule runs without tensor parallelism' in errors[1]
        assert "train_batch needs (x, y), a data_iter, or training_data=" in errors[2]
        assert "return_logits=True" in errors[3]
        assert "leave stages [1] empty" in errors[4]


# ------------------------------------------------------------------------- the script, DeepSpeed vs llmpar


def _run_script(which, partition, tmp_path, steps, ext):
    out = tmp_path / f"{which}.json"
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": str(ext),
        "PYTHONPATH": str(ROOT),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(DATA / "pipe_launch.py"),
        which,
        str(DATA / "pipe_script.py"),
        str(out),
        str(steps),
        partition,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{which} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def _deepspeed_record(case: str, spec: dict, tmp: Path, ext: Path) -> dict:
    """DeepSpeed's run of the pipeline script with partition method ``case``: its parts, train and eval losses."""
    return _run_script("deepspeed", case, tmp, spec["steps"], ext)


def _same_record(case: str, live: dict, golden: dict) -> None:
    assert live["parts"] == golden["parts"]
    torch.testing.assert_close(
        torch.tensor(live["train"], dtype=torch.float64),
        torch.tensor(golden["train"], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    assert live["eval"] == pytest.approx(golden["eval"], rel=1e-5)


# DeepSpeed's runs: "parameters" runs live every time (checked against its golden file), "uniform" is read from
# tests/golden/pipe_compat/ (`make golden`), or runs live where DeepSpeed's version is not the golden's
REFERENCES = References(
    "pipe_compat",
    run=_deepspeed_record,
    cases={"parameters": {"steps": 30}, "uniform": {"steps": 30}},
    live={"parameters"},
    sources=["tests/data/pipe_script.py", "tests/data/pipe_launch.py"],
    packages=("deepspeed", "torch"),
    same=_same_record,
)


@pytest.mark.parametrize("partition", ["parameters", "uniform"])
def test_deepspeed_pipeline_script_runs_with_llmpar_and_matches(partition, tmp_path, ds_ext_dir):
    """parameters: [0, 5, 11], stage 0 ends with ReLU(inplace=True); uniform: [0, 6, 11], stage 1 starts with one."""
    theirs = REFERENCES.get(partition, tmp_path, ds_ext_dir)
    ours = _run_script("llmpar", partition, tmp_path, 30, ds_ext_dir)
    assert ours["parts"] == theirs["parts"] == ([0, 5, 11] if partition == "parameters" else [0, 6, 11])
    torch.testing.assert_close(
        torch.tensor(ours["train"], dtype=torch.float64),
        torch.tensor(theirs["train"], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    assert ours["eval"] == pytest.approx(theirs["eval"], rel=1e-5)
    assert ours["train"][-1] < 0.7 * ours["train"][0]
