"""DeepSpeed's module paths under llmpar: every ``from deepspeed.X import name`` line of DeepSpeed's example scripts
renames to ``from llmpar.X import name`` (or fails with an ImportError saying what to use instead);
``llmpar.accelerator.get_accelerator()`` (also ``llmpar.get_accelerator``) answers DeepSpeed's accelerator API on the
CPU; ``llmpar.runtime.utils.set_random_seed`` seeds as DeepSpeed's; the classes of
``llmpar.runtime.lr_schedules`` set the same lrs as DeepSpeed's, step for step."""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

import llmpar

# (DeepSpeed module path, names scripts import from it): each must exist under llmpar.<path>. The names DeepSpeed's
# example scripts use most (DeepSpeedExamples' training/ and DeepSpeed-Chat: `from deepspeed import get_accelerator`,
# `deepspeed.runtime.utils.set_random_seed`, the comm / utils / checkpointing / zero / pipe / ops.adam calls)
PROVIDED = [
    (
        "deepspeed",
        [
            "initialize",
            "add_config_arguments",
            "init_distributed",
            "DeepSpeedEngine",
            "PipelineEngine",
            "get_accelerator",
            "comm",
            "zero",
            "checkpointing",
            "utils",
            "ops",
            "pipe",
            "accelerator",
            "runtime",
            "PipelineModule",
            "__version__",
        ],
    ),
    ("deepspeed.accelerator", ["get_accelerator"]),
    ("deepspeed.accelerator.real_accelerator", ["get_accelerator"]),
    ("deepspeed.runtime.lr_schedules", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]),
    (
        "deepspeed.runtime.utils",
        ["set_random_seed", "see_memory_usage", "torch_memory_reserved", "torch_max_memory_reserved"],
    ),
    (
        "deepspeed.comm",
        [
            "get_rank",
            "get_world_size",
            "get_local_rank",
            "barrier",
            "all_reduce",
            "all_gather",
            "broadcast",
            "is_initialized",
            "new_group",
            "ReduceOp",
            "get_global_rank",
            "all_gather_into_tensor",
            "reduce_scatter",
            "destroy_process_group",
        ],
    ),
    (
        "deepspeed.utils",
        [
            "logger",
            "log_dist",
            "RepeatingLoader",
            "safe_get_full_fp32_param",
            "safe_get_full_grad",
            "safe_get_full_optimizer_state",
            "safe_set_full_fp32_param",
            "zero_to_fp32",
            "groups",
        ],
    ),
    ("deepspeed.utils.zero_to_fp32", ["get_fp32_state_dict_from_zero_checkpoint"]),
    ("deepspeed.ops.adam", ["FusedAdam", "DeepSpeedCPUAdam"]),
    ("deepspeed.pipe", ["PipelineModule", "LayerSpec", "TiedLayerSpec"]),
    ("deepspeed.zero", ["Init", "GatheredParameters", "register_external_parameter"]),
    (
        "deepspeed.checkpointing",
        ["checkpoint", "configure", "is_configured", "model_parallel_cuda_manual_seed", "get_cuda_rng_tracker"],
    ),
    ("deepspeed.runtime.engine", ["DeepSpeedEngine"]),
    ("deepspeed.moe.layer", ["MoE"]),
    (
        "deepspeed.moe.utils",
        [
            "split_params_into_different_moe_groups_for_optimizer",
            "is_moe_param",
            "has_moe_layers",
            "split_params_into_shared_and_expert_params",
            "split_params_grads_into_shared_and_expert_params",
            "is_moe_param_group",
            "configure_moe_param_groups",
        ],
    ),
    (
        "deepspeed.utils.groups",
        [
            "_create_expert_and_data_parallel",
            "_create_expert_data_and_model_parallel",
            "_get_expert_parallel_group",
            "_get_expert_parallel_group_ranks",
            "_get_expert_parallel_group_dict",
            "_get_expert_data_parallel_group",
            "_get_expert_data_parallel_group_ranks",
            "_get_expert_data_parallel_group_dict",
            "_get_max_expert_size",
            "_get_max_expert_size_name",
            "_get_max_expert_parallel_group",
            "_get_expert_parallel_world_size",
            "_get_expert_parallel_rank",
            "_get_expert_parallel_src_rank",
            "_get_expert_data_parallel_world_size",
            "_get_expert_data_parallel_rank",
            "_get_expert_broadcast_src_rank",
            "_get_expert_model_parallel_world_size",
            "_get_data_parallel_group",
            "_get_data_parallel_world_size",
            "_get_data_parallel_rank",
            "_get_model_parallel_world_size",
            "_clone_world_group",
            "mpu",
        ],
    ),
]
# DeepSpeed module paths without a counterpart: the ImportError names the path and says what to use
REFUSED = [
    ("deepspeed.moe.sharded_moe", "llmpar.moe.legacy"),
    ("deepspeed.profiling.flops_profiler", "torch.profiler"),
    ("deepspeed.monitor.monitor", "engine.monitor"),
    ("deepspeed.ops.lamb", "llmpar.ops.adam"),
    ("deepspeed.ops.transformer", "llmpar.ops.adam"),
    ("deepspeed.runtime.zero.partition_parameters", "llmpar.zero"),
    ("deepspeed.runtime.dataloader", "llmpar.utils.RepeatingLoader"),
    ("deepspeed.runtime.pipe.topology", "llmpar.pipe"),
    ("deepspeed.runtime.zero.stage3", "llmpar.zero"),
    ("deepspeed.runtime.activation_checkpointing.checkpointing", "llmpar.checkpointing"),
    ("deepspeed.inference", "eval mode"),
    ("deepspeed.compression.compress", "compression"),
    ("deepspeed.utils.timer", "perf_counter"),
    ("deepspeed.launcher.runner", "torchrun"),
    ("deepspeed.sequence.layer", '"context_parallel": {"mode": "ulysses"'),  # Ulysses: cp's mode, not "absent"
]


def _renamed(path: str) -> str:
    return "llmpar" + path[len("deepspeed") :]


@pytest.mark.parametrize("path,names", PROVIDED, ids=[p for p, _ in PROVIDED])
def test_deepspeed_module_path_has_a_counterpart(path, names):
    module = importlib.import_module(_renamed(path))
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{_renamed(path)} lacks {missing}"


def test_the_names_are_deepspeeds():
    """Every name of PROVIDED is DeepSpeed's own (stock DeepSpeed has it under that path): the list is the renaming
    rule's, not ours."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    def resolve(path: str):  # a module, or an attribute of one (deepspeed.zero is deepspeed.runtime.zero's alias)
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError:
            parent, _, name = path.rpartition(".")
            return getattr(resolve(parent), name)

    missing = [f"{path}.{n}" for path, names in PROVIDED for n in names if not hasattr(resolve(path), n)]
    assert not missing


def test_set_random_seed_seeds_as_deepspeeds():
    """``llmpar.runtime.utils.set_random_seed`` leaves random, numpy and torch where DeepSpeed's leaves them (a seed
    above 2**32, which both reduce)."""
    import random

    import numpy as np

    from llmpar.runtime.utils import set_random_seed as ours

    with pytest.raises(TypeError, match="seed must be an int, got str"):
        ours("5")
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.utils import set_random_seed as theirs

    draws = []
    for seed_fn in (ours, theirs):
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        seed_fn(2**40 + 5)
        draws.append((random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()))
    assert draws[0] == draws[1]


def test_runtime_utils_names_what_it_does_not_provide():
    from llmpar.runtime import utils

    with pytest.raises(AttributeError, match='clip_grad_norm_.*"gradient_clipping"'):
        utils.clip_grad_norm_  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        utils.nothing_here  # noqa: B018


@pytest.mark.parametrize("path,hint", REFUSED, ids=[p for p, _ in REFUSED])
def test_deepspeed_module_path_without_counterpart_says_what_to_use(path, hint):
    with pytest.raises(ImportError) as info:
        importlib.import_module(_renamed(path))
    message = str(info.value)
    top = path.split(".")[1]
    assert f"deepspeed.{top}" in message and hint in message, message


def test_missing_private_module_is_not_intercepted():
    """Probing an optional llmpar module (``importlib.util.find_spec``) still answers None, not an error."""
    assert importlib.util.find_spec("llmpar.no_such_module_here") is None
    with pytest.raises(ModuleNotFoundError, match="No module named 'llmpar.no_such_module_here'$"):
        importlib.import_module("llmpar.no_such_module_here")


def test_attribute_access_as_deepspeed_scripts_use_it():
    """``import llmpar as deepspeed; deepspeed.accelerator.get_accelerator()`` / ``deepspeed.runtime.lr_schedules``."""
    code = (
        "import llmpar as deepspeed; acc = deepspeed.accelerator.get_accelerator(); "
        "from llmpar import get_accelerator; assert get_accelerator() is acc; "
        "deepspeed.runtime.utils.set_random_seed(1); "
        "print(acc.device_name(), deepspeed.runtime.lr_schedules.WarmupLR.__name__, "
        "deepspeed.get_accelerator().device_name())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "WarmupLR", "cpu"]


# ---------------------------------------------------------------------------------------------------- accelerator
_MEMORY_SCRIPT = """
import torch
from llmpar.accelerator import get_accelerator
acc = get_accelerator()
acc.reset_peak_memory_stats()
before, peak0 = acc.memory_allocated(), acc.max_memory_allocated()
assert 0 < before <= peak0 <= acc.total_memory(), (before, peak0)
big = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, touched
now = acc.memory_allocated()
assert now >= before + 32 * 2 ** 20, (before, now)
assert acc.max_memory_allocated() >= now, (acc.max_memory_allocated(), now)
print("ok")
"""


def test_cpu_accelerator_answers_deepspeeds_api(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    from llmpar.accelerator import get_accelerator

    acc = get_accelerator()
    assert acc is get_accelerator()
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.current_device() == 1 and acc.device_count() == 3
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert acc.is_bf16_supported() and torch.bfloat16 in acc.supported_dtypes()
    x = torch.randn(3)
    assert acc.on_accelerator(x) and acc.pin_memory(x) is x
    acc.set_device(1)
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed(7)
    a = torch.rand(4)
    acc.manual_seed_all(7)
    assert torch.equal(a, torch.rand(4))
    state = acc.get_rng_state()
    b = torch.rand(2)
    acc.set_rng_state(state)
    assert torch.equal(b, torch.rand(2))
    with acc.stream(acc.Stream()):
        e = acc.Event(enable_timing=True)
        e.record()
        e.synchronize()
    assert isinstance(acc.FloatTensor([1.0, 2.0]), torch.Tensor) and acc.LongTensor([1]).dtype == torch.long
    assert acc.available_memory() > 0
    # memory statistics: the process's resident set. Checked in a fresh process: in this long-lived one, a big
    # allocation may be served from pages an earlier test freed and the allocator kept, so the resident set need not
    # grow
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
    with pytest.raises(NotImplementedError, match="llmpar.ops"):
        acc.create_op_builder("FusedAdamBuilder")


def test_accelerator_choice_is_checked(monkeypatch):
    from llmpar.accelerator import get_accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'.*cuda or cpu"):
        get_accelerator()
    if not torch.cuda.is_available():
        monkeypatch.setenv("DS_ACCELERATOR", "cuda")
        with pytest.raises(ValueError, match="is_available"):
            get_accelerator()


# ---------------------------------------------------------------------------------------------------- lr_schedules
def _optimizer(seed: int) -> torch.optim.Optimizer:
    g = torch.Generator().manual_seed(seed)
    p = [torch.nn.Parameter(torch.randn(5, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]
    return torch.optim.AdamW([{"params": [p[0]], "lr": 3e-3}, {"params": [p[1]], "lr": 7e-4}])


SCHEDULES = [
    ("WarmupLR", dict(warmup_min_lr=1e-5, warmup_max_lr=[2e-3, 4e-3], warmup_num_steps=7)),
    ("WarmupLR", dict(warmup_num_steps=5, warmup_type="linear")),  # max lr: each group's own
    ("WarmupDecayLR", dict(total_num_steps=23, warmup_min_lr=[1e-5, 2e-5], warmup_num_steps=7)),
    ("WarmupCosineLR", dict(total_num_steps=23, warmup_min_ratio=0.1, warmup_num_steps=6, cos_min_ratio=0.01)),
    ("WarmupCosineLR", dict(total_num_steps=23, warmup_num_steps=6, warmup_type="linear")),
]


@pytest.mark.parametrize("name,kwargs", SCHEDULES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SCHEDULES)])
def test_lr_schedules_match_deepspeed(name, kwargs):
    """The same constructor call on DeepSpeed's class and on llmpar's: the same lrs for 30 steps, and a
    state_dict round trip resumes the sequence."""
    theirs_mod = pytest.importorskip("deepspeed.runtime.lr_schedules", reason="DeepSpeed is not installed")
    from llmpar.runtime import lr_schedules

    o1, o2 = _optimizer(0), _optimizer(0)
    theirs, ours = getattr(theirs_mod, name)(o1, **kwargs), getattr(lr_schedules, name)(o2, **kwargs)
    seen = []
    for t in range(30):
        a, b = [g["lr"] for g in o1.param_groups], [g["lr"] for g in o2.param_groups]
        assert all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-300) for x, y in zip(a, b)), (t, a, b)
        seen.append(b)
        if t == 12:
            resumed = getattr(lr_schedules, name)(_optimizer(1), **kwargs)
            resumed.load_state_dict(ours.state_dict())
            assert [g["lr"] for g in resumed.optimizer.param_groups] == b
        theirs.step()
        ours.step()
    assert len({tuple(s) for s in seen}) > 5  # the schedule moved


def test_lr_schedules_refuse_what_they_cannot_do():
    from llmpar.runtime.lr_schedules import LRRangeTest, OneCycle, WarmupDecayLR, WarmupLR

    with pytest.raises(NotImplementedError, match="OneCycle is not implemented.*OneCycleLR"):
        OneCycle(_optimizer(0), cycle_min_lr=1e-4, cycle_max_lr=1e-3)
    with pytest.raises(NotImplementedError, match="LRRangeTest"):
        LRRangeTest(_optimizer(0))
    with pytest.raises(ValueError, match=r"warmup_max_lr=\[0.1, 0.2, 0.3\] has 3 values.*2 param groups"):
        WarmupLR(_optimizer(0), warmup_max_lr=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(_optimizer(0), warmup_type="cubic")
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(_optimizer(0), warmup_num_steps=0)
    with pytest.raises(ValueError, match="total_num_steps"):
        WarmupDecayLR(_optimizer(0), total_num_steps=-3)
    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())


def test_lr_schedule_drives_the_engine_as_a_client_scheduler():
    """``WarmupDecayLR`` built on a client optimizer and given to ``initialize``: the engine's lrs follow it."""
    from llmpar.runtime.lr_schedules import WarmupDecayLR

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = WarmupDecayLR(opt, total_num_steps=9, warmup_max_lr=2e-3, warmup_num_steps=3, warmup_type="linear")
    engine, *_ = llmpar.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=sched,
        config={"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6},
    )
    ref = WarmupDecayLR(_optimizer(0), total_num_steps=9, warmup_max_lr=2e-3, warmup_num_steps=3, warmup_type="linear")
    for _ in range(6):
        assert engine.get_lr()[0] == pytest.approx(ref.get_lr()[0], rel=1e-12)
        loss = model(torch.randn(4, 7)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ref.step()
