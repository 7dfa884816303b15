"""accelerate + DeepSpeed scripts on llmpar's engine (``llmpar.integrations.accelerate``): one script in the shape of
accelerate's DeepSpeed example (tests/data/accelerate_script.py: DummyOptim / DummyScheduler or a torch optimizer and
schedule, accumulate, backward, clip_grad_norm_, save_state / load_state, gather_for_metrics, get_state_dict,
save_model), 2 CPU ranks, 3 epochs of 8 micro-batches of 4, gradient accumulation 2. One launch per ZeRO stage feeds
every assertion (tests/data/accelerate_driver.py): ZeRO-2 under torchrun with ``DeepSpeedPlugin(hf_ds_config=...)``,
ZeRO-3 under ``accelerate launch`` with an accelerate config naming DeepSpeed (the plugin read from the environment).
Each launch runs the script under llmpar's Accelerator, ``llmpar.initialize`` driven directly on the same per-rank
batches, and stock accelerate + DeepSpeed (which on CPU ranks counts one process and feeds every rank the unsharded
loader's batches; the script under llmpar is run on those same batches for that comparison)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")

from multirank import free_port, run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(DATA))
import accelerate_script  # noqa: E402

HAS_DS = importlib.util.find_spec("deepspeed") is not None

CONFIGS = {  # stage 2: the config's optimizer and schedule (DummyOptim / DummyScheduler); 3: a torch AdamW + LambdaLR
    2: {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": False},
    },
    3: {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    },
}


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2-torchrun", "zero3-accelerate-launch"])
def run(request, tmp_path_factory, ds_ext_dir):
    """{"stage", "tmp", "ranks": [rank 0's flows, rank 1's]} of one launch (see the module docstring)."""
    stage = request.param
    tmp = tmp_path_factory.mktemp(f"accelerate_z{stage}")
    cfg = tmp / "ds.json"
    cfg.write_text(json.dumps(CONFIGS[stage]))
    driver = [str(DATA / "accelerate_driver.py"), "--stage", str(stage), "--tmp", str(tmp)]
    if not HAS_DS:
        driver.append("--no-deepspeed")
    if stage == 3 and HAS_DS:  # accelerate's DeepSpeed launcher imports deepspeed
        acc = tmp / "accelerate.yaml"
        acc.write_text(
            f"compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
            f"  deepspeed_config_file: {cfg}\n  zero3_init_flag: false\nnum_machines: 1\n"
            f"num_processes: 2\nmachine_rank: 0\nmain_process_port: {free_port()}\nuse_cpu: true\n"
        )
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(acc), *driver]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            *driver,
            "--config",
            str(cfg),
        ]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "TORCH_EXTENSIONS_DIR": str(ds_ext_dir),
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stage {stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {"stage": stage, "tmp": tmp, "ranks": ranks}


def close(a, b, rtol: float) -> None:
    torch.testing.assert_close(
        torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), rtol=rtol, atol=0
    )


@pytest.mark.slow
def test_script_runs_on_llmpars_engine(run):
    """The script's Accelerator took DeepSpeed's route onto llmpar's engine (with cpu=True, where stock accelerate
    leaves DeepSpeed), sees 2 processes, and filled the config's "auto" values as accelerate does."""
    for r, flows in enumerate(run["ranks"]):
        rec = flows["llmpar"]
        assert rec["distributed_type"] == "DistributedType.DEEPSPEED" and rec["engine"] == "llmpar.runtime.engine"
        assert (rec["procs"], rec["rank"], rec["main"]) == (2, r, r == 0)
        cfg = rec["config"]
        assert (
            cfg["train_micro_batch_size_per_gpu"],
            cfg["gradient_accumulation_steps"],
            cfg["gradient_clipping"],
        ) == (4, 2, 1.0)
        assert cfg["zero_optimization"]["reduce_bucket_size"] == 24 * 24  # model.config.hidden_size = 24
        if run["stage"] == 2:  # DummyOptim(lr=3e-3, weight_decay=0.01), DummyScheduler(total 12, warmup 3)
            assert cfg["optimizer"]["params"]["lr"] == 3e-3 and cfg["optimizer"]["params"]["weight_decay"] == 0.01
            sched = cfg["scheduler"]["params"]
            assert (sched["warmup_max_lr"], sched["warmup_num_steps"], sched["total_num_steps"]) == (3e-3, 3, 6)
        else:
            z = cfg["zero_optimization"]
            assert (z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (518, 240)


@pytest.mark.slow
def test_losses_equal_llmpar_initialize(run):
    """Per rank, per micro-step: the script's losses, grad norms and lrs are those of llmpar.initialize driven directly
    on the batches the script read (each rank its own shard), and so are the final weights get_state_dict gives."""
    ranks = run["ranks"]
    for flows in ranks:
        ours, direct = flows["llmpar"], flows["direct"]
        assert len(ours["loss"]) == len(direct["loss"]) == 12
        close(ours["loss"], direct["loss"], rtol=1e-6)
        close(ours["grad_norm"][:6], direct["grad_norm"], rtol=1e-6)  # then 2 more: the epoch run again
        close(ours["lr"][:6], direct["lr"], rtol=1e-9)
        assert sum(ours["loss"][-4:]) < sum(ours["loss"][:4])  # and it trains
    assert ranks[0]["llmpar"]["loss"] != ranks[1]["llmpar"]["loss"]  # the ranks read different shards
    weights, direct = ranks[0]["llmpar"]["weights"], ranks[0]["direct"]["weights"]
    assert sorted(weights) == sorted(direct) == ["down.bias", "down.weight", "up.bias", "up.weight"]
    for k in direct:
        torch.testing.assert_close(weights[k], direct[k], rtol=1e-6, atol=1e-7)
    if run["stage"] == 3:  # gathered onto rank 0 only (DeepSpeed's rule)
        assert ranks[1]["llmpar"]["weights"] == {}
    else:
        assert all(torch.equal(ranks[1]["llmpar"]["weights"][k], weights[k]) for k in weights)


@pytest.mark.slow
def test_load_state_resumes_bitwise(run):
    """save_state after epoch 2, epoch 3, load_state, epoch 3 again: the same losses, bit for bit (params,
    optimizer moments, schedule and counters came back through the engine's checkpoint)."""
    for flows in run["ranks"]:
        for name in ("llmpar", "llmpar_same"):
            rec = flows[name]
            assert rec["resumed"] == rec["loss"][-len(rec["resumed"]) :]
    assert (run["tmp"] / "ckpt_llmpar" / "pytorch_model" / "metadata.json").is_file()


@pytest.mark.slow
def test_save_state_in_the_middle_of_an_accumulation(run):
    """The script saves every 3 optimizer steps with accelerate's examples' test, which also holds on the micro-steps
    after step N (and before the first step): those saves fall between the micro-steps of an accumulation. They are
    written as DeepSpeed writes them (no error), the log says once per save on rank 0 that the accumulated gradients
    are not in it, and training goes on unchanged (the losses equal DeepSpeed's, which saved at the same places:
    test_losses_equal_accelerate_deepspeed; a later load_state resumes bitwise: test_load_state_resumes_bitwise)."""
    for r, flows in enumerate(run["ranks"]):
        rec = flows["llmpar_same"]
        mid = [s for s, boundary in rec["saved"] if not boundary]
        assert mid[:3] == [0, 3, 6] and len(rec["saved"]) > len(mid) > 0
        said = [line for line in rec["log"] if "in the middle of a gradient accumulation" in line]
        assert len(said) == (len(mid) if r == 0 else 0)
        if r == 0:
            assert "without the accumulated gradients" in said[0]
        if "deepspeed" in flows:
            assert flows["deepspeed"]["saved"] == rec["saved"]  # stock accelerate + DeepSpeed saved there too
    for step in (0, 3):
        assert (run["tmp"] / "ckpt_same" / f"step_{step}" / "pytorch_model" / "metadata.json").is_file()


@pytest.mark.slow
def test_gather_for_metrics_reduce_and_save_model(run):
    """gather_for_metrics gives every rank the 11 eval samples once (the padding of the last batch dropped): their
    loss is the final model's on the whole eval set; reduce(mean) averages the ranks; save_model writes the weights."""
    from safetensors.torch import load_file

    ranks = run["ranks"]
    model = accelerate_script.Net().double()
    model.load_state_dict({k: v.double() for k, v in ranks[0]["direct"]["weights"].items()})
    x, y = accelerate_script.data(11, 2).tensors
    want = F.cross_entropy(model(x.double()), y).item()
    for flows in ranks:
        assert flows["llmpar"]["eval_n"] == 11
        close([flows["llmpar"]["eval_loss"]], [want], rtol=1e-5)
        close(
            [flows["llmpar"]["mean_loss"]],
            [(ranks[0]["llmpar"]["loss"][-1] + ranks[1]["llmpar"]["loss"][-1]) / 2],
            rtol=1e-6,
        )
    saved = load_file(str(run["tmp"] / "ckpt_llmpar" / "model" / "model.safetensors"))
    assert sorted(saved) == sorted(ranks[0]["llmpar"]["weights"])
    assert all(torch.equal(saved[k], ranks[0]["llmpar"]["weights"][k]) for k in saved)


@pytest.mark.slow
def test_losses_equal_accelerate_deepspeed(run):
    """The script under stock accelerate + DeepSpeed and under llmpar, every rank reading the same batches (what
    stock accelerate feeds on CPU ranks, where it counts one process): the same losses, grad norms, lrs, weights."""
    if not HAS_DS:
        pytest.skip("DeepSpeed is not installed")
    for flows in run["ranks"]:
        ours, theirs = flows["llmpar_same"], flows["deepspeed"]
        assert theirs["procs"] == 1 and ours["procs"] == 2  # stock accelerate's count on CPU ranks
        assert len(ours["loss"]) == len(theirs["loss"]) == 24
        close(ours["loss"], theirs["loss"], rtol=1e-5)
        close(ours["grad_norm"], theirs["grad_norm"], rtol=1e-4)
        close(ours["lr"], theirs["lr"], rtol=1e-9)
        assert theirs["resumed"] == theirs["loss"][-len(theirs["resumed"]) :]
    ours, theirs = run["ranks"][0]["llmpar_same"]["weights"], run["ranks"][0]["deepspeed"]["weights"]
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6)


# ---- what the Accelerator refuses: an error naming the fix, on every rank, before any collective ----
def _error_cases(tmp: str) -> dict[str, str]:
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    from llmpar.integrations.accelerate import Accelerator, DeepSpeedPlugin, DummyOptim

    out: dict[str, str] = {}

    def catch(name, fn):
        try:
            fn()
            out[name] = "no error"
        except (ValueError, TypeError, RuntimeError, FileNotFoundError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
    }
    loader = DataLoader(accelerate_script.data(12, 3), batch_size=3)
    try:
        catch("fp8", lambda: Accelerator(mixed_precision="fp8", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg)))
        catch(
            "two_plugins",
            lambda: Accelerator(
                deepspeed_plugins={"a": DeepSpeedPlugin(hf_ds_config=cfg), "b": DeepSpeedPlugin(hf_ds_config=cfg)}
            ),
        )
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), cpu=True)
        model = accelerate_script.Net()
        catch("backward_first", lambda: acc.backward(model(torch.ones(2, 13)).sum()))
        catch("dummy_optim_without_block", lambda: acc.prepare(model, DummyOptim(model.parameters()), loader))
        catch("no_loader", lambda: acc.prepare(model, torch.optim.AdamW(model.parameters())))
        acc.deepspeed_plugin.deepspeed_config["tensor_parallel"] = {"autotp_size": 2}
        catch("tensor_parallel", lambda: acc.prepare(model, torch.optim.AdamW(model.parameters()), loader))
        del acc.deepspeed_plugin.deepspeed_config["tensor_parallel"]
        engine, _, dl = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
        x, y = next(iter(dl))
        acc.backward(F.cross_entropy(engine(x), y))
        catch("clip_other_max_norm", lambda: acc.clip_grad_norm_(engine.parameters(), 0.5))
        catch("clip_norm_type", lambda: acc.clip_grad_norm_(engine.parameters(), 1.0, norm_type=1))
        out["norm"] = repr(acc.clip_grad_norm_(engine.parameters(), 1.0))
        catch("load_state_without_checkpoint", lambda: acc.load_state(tmp))
        catch("second_model", lambda: acc.prepare(accelerate_script.Net(), loader))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return out


def test_refusals_name_the_fix(tmp_path):
    got = run_ranks(_error_cases, 2, str(tmp_path))
    assert got[0].keys() == got[1].keys()
    for r in (0, 1):
        e = got[r]
        assert e["fp8"].startswith("ValueError") and "fp8" in e["fp8"]
        assert e["two_plugins"].startswith("ValueError") and "one DeepSpeedPlugin" in e["two_plugins"]
        assert e["backward_first"].startswith("RuntimeError") and "prepare" in e["backward_first"]
        assert (
            e["dummy_optim_without_block"].startswith("ValueError")
            and '"optimizer" block' in e["dummy_optim_without_block"]
        )
        assert e["no_loader"].startswith("ValueError") and "train_micro_batch_size_per_gpu" in e["no_loader"]
        assert e["tensor_parallel"].startswith("ValueError") and "autotp_size" in e["tensor_parallel"]
        assert (
            e["clip_other_max_norm"].startswith("ValueError")
            and "gradient_clipping=1.0" in e["clip_other_max_norm"]
            and '"gradient_clipping": 0.5' in e["clip_other_max_norm"]
        )
        assert e["clip_norm_type"].startswith("ValueError") and "norm_type=2" in e["clip_norm_type"]
        assert float(e["norm"]) > 0
        assert (
            e["load_state_without_checkpoint"].startswith("FileNotFoundError")
            and "pytorch_model" in e["load_state_without_checkpoint"]
        )
        assert e["second_model"].startswith("ValueError") and "one model" in e["second_model"]


def test_auto_bucket_sizes_are_one_rule_for_both_integrations(tmp_path):
    """accelerate's "auto" ZeRO bucket sizes and the Trainer's come from one rule (``llmpar.integrations.buckets``):
    the model's hidden size h, or its ``text_config``'s (a multimodal model, which accelerate's own copy of the rule
    did not read): reduce h*h, prefetch 0.9*h*h, persistence 10*h."""
    from types import SimpleNamespace

    from accelerate.utils import DeepSpeedPlugin

    from llmpar.integrations.accelerate.fill import hidden_size_autos

    keys = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    cfg = {"zero_optimization": {"stage": 3, **dict.fromkeys(keys, "auto")}, "train_micro_batch_size_per_gpu": 1}
    plugin = DeepSpeedPlugin(hf_ds_config=cfg)
    want = {f"zero_optimization.{k}": v for k, v in zip(keys, (24 * 24, int(0.9 * 24 * 24), 240))}
    for config in (SimpleNamespace(hidden_size=24), SimpleNamespace(text_config=SimpleNamespace(hidden_size=24))):
        model = torch.nn.Linear(2, 2)
        model.config = config
        assert hidden_size_autos(plugin, model) == want, config
    with pytest.raises(ValueError, match="does not have: give them integers"):
        hidden_size_autos(plugin, torch.nn.Linear(2, 2))
