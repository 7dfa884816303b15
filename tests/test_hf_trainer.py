"""transformers.Trainer on llmpar: the same Trainer script (tests/data/hf_trainer_script.py, tiny Llama / Qwen2 from
configs, vocab 67, a DeepSpeed config with "auto" values) run by Trainer + DeepSpeed and by llmpar's Trainer (one
import changed), 2 CPU ranks, 20 optimizer steps, gradient accumulation 2, clipping, WarmupDecayLR or the Trainer's own
schedule: the per-step losses agree to 1e-5 (relative). Also: tp 2 x dp 2 against DeepSpeed at dp 2, a bitwise resume
from a Trainer checkpoint, the saved model reloaded by ``from_pretrained`` with DeepSpeed's logits, and the config's
"auto" filling and its errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from llmpar.integrations.hf_auto import fill_auto, tensor_parallel_size  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "data" / "hf_trainer_script.py"
sys.path.insert(0, str(SCRIPT.parent))
import hf_trainer_script  # noqa: E402
from multirank import free_port  # noqa: E402


def run(backend: str, tmp: Path, ext: Path, *flags: str, nproc: int = 2, tag: str = "") -> dict:
    """The script's record ({"loss": [...], "grad_norm": [...], "lr": [...], "final": dir}) for ``backend``."""
    name = f"{backend}{tag}"
    out = tmp / f"{name}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TORCH_EXTENSIONS_DIR": str(ext)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(SCRIPT), "--backend", backend, "--output-dir", str(tmp / name), "--out", str(out),
           *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{backend} {flags} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def assert_same_losses(ours: dict, theirs: dict, steps: int = 20, rtol: float = 1e-5) -> None:
    """Per-step losses within ``rtol`` (fp32: 1e-5), the same lrs, grad norms within 10 rtol."""
    assert len(ours["loss"]) == len(theirs["loss"]) == steps
    torch.testing.assert_close(torch.tensor(ours["loss"], dtype=torch.float64),
                               torch.tensor(theirs["loss"], dtype=torch.float64), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(ours["lr"], dtype=torch.float64),
                               torch.tensor(theirs["lr"], dtype=torch.float64), rtol=1e-9, atol=0)
    torch.testing.assert_close(torch.tensor(ours["grad_norm"], dtype=torch.float64),
                               torch.tensor(theirs["grad_norm"], dtype=torch.float64), rtol=10 * rtol, atol=0)
    assert sum(ours["loss"][-5:]) < sum(ours["loss"][:5])  # and it trains


def logits(model_dir: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = hf_trainer_script.Tokens(n=3, seq=9).x
    with torch.no_grad():
        return model(input_ids=ids).logits


CASES = {  # id: script flags (fp32 unless --bf16)
    "llama-z2": ["--model", "llama", "--stage", "2"],
    "llama-z2-bf16": ["--model", "llama", "--stage", "2", "--bf16"],
    "qwen2-z2-offload": ["--model", "qwen2", "--stage", "2", "--offload"],
    "llama-z3-untied-hf-schedule": ["--model", "llama", "--stage", "3", "--untied", "--hf-schedule"],
    "qwen2-z3-offload": ["--model", "qwen2", "--stage", "3", "--offload"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_trainer_matches_deepspeed(case, tmp_path, ds_ext_dir):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    theirs = run("deepspeed", tmp_path, ds_ext_dir, *CASES[case])
    ours = run("llmpar", tmp_path, ds_ext_dir, *CASES[case])
    # bf16: both run bf16 params with fp32 masters and fp32 accumulation; the sums round differently (4.4e-5 seen)
    bf16 = "--bf16" in CASES[case]
    assert_same_losses(ours, theirs, rtol=1e-3 if bf16 else 1e-5)
    # the model saved by trainer.save_model() loads with from_pretrained and computes DeepSpeed's logits
    tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits(ours["final"]), logits(theirs["final"]), **tol)


@pytest.mark.slow
def test_trainer_on_a_zero_init_build_matches_deepspeed(tmp_path, ds_ext_dir):
    """The model built inside llmpar.zero.Init() (never whole on a rank) trains as DeepSpeed trains the plain build
    of the same seed: the same weights, the same losses."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    flags = ["--model", "llama", "--stage", "3"]
    theirs = run("deepspeed", tmp_path, ds_ext_dir, *flags)
    ours = run("llmpar", tmp_path, ds_ext_dir, *flags, "--zero-init")
    assert_same_losses(ours, theirs)
    torch.testing.assert_close(logits(ours["final"]), logits(theirs["final"]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_trainer_tensor_parallel_matches_deepspeed(tmp_path, ds_ext_dir):
    """tp 2 x dp 2 (4 ranks; a tensor-parallel group reads the same batches) against DeepSpeed at dp 2: the
    same global batch, the same losses."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    theirs = run("deepspeed", tmp_path, ds_ext_dir, "--stage", "2")
    ours = run("llmpar", tmp_path, ds_ext_dir, "--stage", "2", "--tp", "2", nproc=4)
    assert_same_losses(ours, theirs)
    torch.testing.assert_close(logits(ours["final"]), logits(theirs["final"]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_trainer_resumes_bitwise(tmp_path, ds_ext_dir):
    """20 steps saving at 10, then a new run resumed from checkpoint-10: steps 11-20 are bitwise the same, and the
    checkpoint's sharded part consolidates to the weights its from_pretrained part holds."""
    flags = ["--model", "qwen2", "--stage", "3", "--save-steps", "10"]
    whole = run("llmpar", tmp_path, ds_ext_dir, *flags)
    ckpt = tmp_path / "llmpar" / "checkpoint-10"
    assert (ckpt / "config.json").is_file() and (ckpt / "latest").is_file() and (ckpt / "trainer_state.json").is_file()
    resumed = run("llmpar", tmp_path, ds_ext_dir, *flags, "--resume", str(ckpt), tag="-resumed")
    assert resumed["step"] == list(range(11, 21))
    assert resumed["loss"] == whole["loss"][10:]
    assert resumed["grad_norm"] == whole["grad_norm"][10:]
    assert torch.equal(logits(resumed["final"]), logits(whole["final"]))
    consolidated = tmp_path / "consolidated"
    proc = subprocess.run([sys.executable, "-m", "llmpar.cli", "checkpoint", "consolidate", str(ckpt),
                           str(consolidated)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(logits(str(consolidated)), logits(str(ckpt)))


# ---- the config's "auto" values (single process) ----
@pytest.fixture(autouse=True)
def _environment_restored():
    """transformers / accelerate write torchrun's variables (RANK, ...) into os.environ when they find a process
    group already up in this process (an earlier test's world of one): put the environment back after each test,
    so that later tests (``llmpar train``'s launcher reads RANK) see the session's own."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=2e-3, warmup_steps=3, weight_decay=0.01, max_grad_norm=0.5, report_to=[],
                use_cpu=True, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _model():
    return hf_trainer_script.build_model("llama", tie=True)


def test_fill_auto_fills_from_the_arguments(tmp_path):
    cfg = hf_trainer_script.ds_config(3, False, 1, False)
    out = fill_auto(cfg, _args(tmp_path), model=_model(), num_training_steps=50, dp=3)
    assert out["train_micro_batch_size_per_gpu"] == 4 and out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 4 * 2 * 3 and out["gradient_clipping"] == 0.5
    assert out["optimizer"]["params"] == {"lr": 2e-3, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.01,
                                          "torch_adam": True}
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 3,
                                          "total_num_steps": 50}
    z = out["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == \
        (32 * 32, int(0.9 * 32 * 32), 320)
    assert out["bf16"]["enabled"] is False and out["fp16"]["enabled"] is False
    assert cfg["train_batch_size"] == "auto"  # the caller's dict is left alone


def test_fill_auto_names_every_mismatch(tmp_path):
    cfg = {"gradient_accumulation_steps": 3, "train_micro_batch_size_per_gpu": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}}
    with pytest.raises(ValueError) as e:
        fill_auto(cfg, _args(tmp_path), model=_model(), num_training_steps=10, dp=2)
    msg = str(e.value)
    assert "gradient_accumulation_steps=3" in msg and "optimizer.params.lr=0.001" in msg and "bf16" in msg
    assert "train_micro_batch_size_per_gpu" not in msg  # equal values pass


def test_fill_auto_refuses_what_it_cannot_fill(tmp_path):
    with pytest.raises(ValueError, match=r"\"auto\" is not filled for \['zero_optimization.sub_group_size'\]"):
        fill_auto({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, _args(tmp_path), model=_model(),
                  num_training_steps=10, dp=1)
    with pytest.raises(ValueError, match="no hidden_size"):
        fill_auto({"zero_optimization": {"reduce_bucket_size": "auto"}}, _args(tmp_path),
                  model=torch.nn.Linear(2, 2), num_training_steps=10, dp=1)
    with pytest.raises(TypeError, match="config must be a dict"):
        fill_auto("ds.json", _args(tmp_path), model=_model(), num_training_steps=10, dp=1)
    with pytest.raises(ValueError, match="tensor_parallel.size must be a positive int"):
        tensor_parallel_size({"tensor_parallel": {"autotp_size": 0}})
    assert tensor_parallel_size({"tensor_parallel": {"autotp_size": 2}}) == 2 and tensor_parallel_size({}) == 1


def test_trainer_needs_its_config_once(tmp_path):
    from llmpar.integrations.transformers import Trainer, TrainingArguments

    with pytest.raises(ValueError, match="deepspeed= or llmpar_config="):
        TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, deepspeed={}, llmpar_config={})
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, deepspeed={"a": 1})
    assert args.deepspeed is None and args.llmpar_config == {"a": 1}  # transformers never sees it
    plain = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="needs a DeepSpeed config"):
        Trainer(model=_model(), args=plain, train_dataset=hf_trainer_script.Tokens())
    with pytest.raises(ValueError, match="tensor_parallel.size=3 does not divide the 1 processes"):
        Trainer(model=_model(), args=plain, train_dataset=hf_trainer_script.Tokens(),
                llmpar_config={"tensor_parallel": {"autotp_size": 3}})


def test_zero_init_is_reachable_after_import_llmpar():
    """``llmpar.zero.Init`` / ``GatheredParameters`` as DeepSpeed scripts write them, with only ``import llmpar``
    (a fresh interpreter: nothing imported llmpar.zero before)."""
    code = ("import llmpar, sys; assert 'llmpar.zero' not in sys.modules; "
            "print(llmpar.zero.Init.__name__, llmpar.zero.GatheredParameters.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["Init", "GatheredParameters"]
