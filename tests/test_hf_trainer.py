"""transformers.Trainer on llmpar: the same Trainer script (tests/data/hf_trainer_script.py, tiny Llama / Qwen2 from
configs, vocab 67, a DeepSpeed config with "auto" values) run by Trainer + DeepSpeed and by llmpar's Trainer (one
import changed), 2 CPU ranks, 20 optimizer steps, gradient accumulation 2, clipping, WarmupDecayLR or the Trainer's own
schedule: the per-step losses agree to 1e-5 (relative). Also: tp 2 x dp 2 against DeepSpeed at dp 2, a bitwise resume
from a Trainer checkpoint, the saved model reloaded by ``from_pretrained`` with DeepSpeed's logits, and the config's
"auto" filling and its errors. Under ZeRO-3: evaluation during training, ``evaluate`` / ``predict`` / ``generate``
after it (equal to DeepSpeed's and to the plain model's), ``evaluate`` before ``train`` on a model that
``from_config`` built sharded because the TrainingArguments carry a ZeRO-3 config, and ``from_config`` /
``from_pretrained`` builds sharded that way (equal to the plain builds)."""

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

import llmpar  # noqa: E402
import llmpar.zero  # noqa: E402
from llmpar.integrations.transformers.auto import fill_auto  # noqa: E402
from llmpar.runtime.config import Blocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "data" / "hf_trainer_script.py"
sys.path.insert(0, str(SCRIPT.parent))
import hf_trainer_script  # noqa: E402

from multirank import free_port, run_ranks  # noqa: E402
from reference_runs import References  # noqa: E402


def run(backend: str, tmp: Path, ext: Path, *flags: str, nproc: int = 2, tag: str = "") -> dict:
    """The script's record ({"loss": [...], "grad_norm": [...], "lr": [...], "final": dir}) for ``backend``."""
    name = f"{backend}{tag}"
    out = tmp / f"{name}.json"
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "TORCH_EXTENSIONS_DIR": str(ext),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(SCRIPT),
        "--backend",
        backend,
        "--output-dir",
        str(tmp / name),
        "--out",
        str(out),
        *flags,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{backend} {flags} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def assert_same_losses(ours: dict, theirs: dict, steps: int = 20, rtol: float = 1e-5) -> None:
    """Per-step losses within ``rtol`` (fp32: 1e-5), the same lrs, grad norms within 10 rtol."""
    assert len(ours["loss"]) == len(theirs["loss"]) == steps
    torch.testing.assert_close(
        torch.tensor(ours["loss"], dtype=torch.float64),
        torch.tensor(theirs["loss"], dtype=torch.float64),
        rtol=rtol,
        atol=0,
    )
    torch.testing.assert_close(
        torch.tensor(ours["lr"], dtype=torch.float64),
        torch.tensor(theirs["lr"], dtype=torch.float64),
        rtol=1e-9,
        atol=0,
    )
    torch.testing.assert_close(
        torch.tensor(ours["grad_norm"], dtype=torch.float64),
        torch.tensor(theirs["grad_norm"], dtype=torch.float64),
        rtol=10 * rtol,
        atol=0,
    )
    assert sum(ours["loss"][-5:]) < sum(ours["loss"][:5])  # and it trains


def logits(model_dir: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = hf_trainer_script.Tokens(n=3, seq=9).x
    with torch.no_grad():
        return model(input_ids=ids).logits


def plain_eval_loss(model) -> float:
    """The Trainer's eval loss of the script's eval set, computed by the plain model: the mean of the per-batch
    mean losses (batches of 4 consecutive samples, 2 per rank at dp 2)."""
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=b, labels=b).loss.double() for b in hf_trainer_script.EVAL.x.split(4)]
    return float(torch.stack(losses).mean())


def assert_evaluation_matches(ours: dict, theirs: dict) -> None:
    """The ZeRO-3 run's evaluations equal DeepSpeed's and the plain model's (the saved final model)."""
    plain = transformers.AutoModelForCausalLM.from_pretrained(ours["final"], dtype=torch.float32)
    assert [s for s, _ in ours["eval_steps"]] == [s for s, _ in theirs["eval_steps"]] == [10, 20]
    torch.testing.assert_close(
        torch.tensor([v for _, v in ours["eval_steps"]], dtype=torch.float64),
        torch.tensor([v for _, v in theirs["eval_steps"]], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    want = plain_eval_loss(plain)
    for got in (ours["eval_final"], ours["predict_loss"], theirs["eval_final"]):
        assert got == pytest.approx(want, rel=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(
            torch.tensor(ours["predict_logits"]),
            plain(input_ids=hf_trainer_script.EVAL.x[:2]).logits,
            rtol=1e-4,
            atol=1e-5,
        )
        generated = plain.generate(hf_trainer_script.PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert ours["generated"] == generated.tolist() == theirs["generated"]


CASES = {  # id: script flags (fp32 unless --bf16)
    "llama-z2": ["--model", "llama", "--stage", "2"],
    "llama-z2-bf16": ["--model", "llama", "--stage", "2", "--bf16"],
    "qwen2-z2-offload": ["--model", "qwen2", "--stage", "2", "--offload"],
    "llama-z3-untied-hf-schedule": [
        "--model",
        "llama",
        "--stage",
        "3",
        "--untied",
        "--hf-schedule",
        "--eval",
        "--resize",
    ],
    "qwen2-z3-offload": ["--model", "qwen2", "--stage", "3", "--offload", "--resize"],
}
# what llmpar's run of a case also does, so that one launch feeds several tests (a launch costs ~25-50 s here):
# the ZeRO-3 eval case builds its model by from_config under the script's own subclass of transformers'
# TrainingArguments carrying the ZeRO-3 config (sharded), resizes it (--resize, both backends) and evaluates before
# training; the ZeRO-3 offload case builds its tied model sharded too, resizes it, and saves at step 10 for the resume
# test
EXTRA = {
    "llama-z3-untied-hf-schedule": ["--auto-build", "--eval-first", "--stock-args"],
    "qwen2-z3-offload": ["--auto-build", "--save-steps", "10"],
}


def _deepspeed_record(case: str, flags: list[str], tmp: Path, ext: Path) -> dict:
    """The script's record of a case under Trainer + DeepSpeed, with the logits of the model it saved in place of the
    model's folder (``"logits"``: on ``Tokens(n=3, seq=9)``)."""
    assert flags == CASES[case]
    record = run("deepspeed", tmp, ext, *flags)
    record["logits"] = logits(record.pop("final")).tolist()
    return record


def _same_deepspeed_runs(case: str, live: dict, golden: dict) -> None:
    """DeepSpeed's live run of a case against its golden file: the checks (and tolerances) the tests apply."""
    bf16 = "--bf16" in CASES[case]
    assert_same_losses(live, golden, rtol=1e-3 if bf16 else 1e-5)
    tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(live["logits"]), torch.tensor(golden["logits"]), **tol)
    assert [s for s, _ in live["eval_steps"]] == [s for s, _ in golden["eval_steps"]]
    assert [v for _, v in live["eval_steps"]] == pytest.approx([v for _, v in golden["eval_steps"]], rel=1e-5)
    assert (live.get("eval_final") is None) == (golden.get("eval_final") is None)
    if live.get("eval_final") is not None:
        assert live["eval_final"] == pytest.approx(golden["eval_final"], rel=1e-5)
    assert (live.get("generated"), live["sharded_build"]) == (golden.get("generated"), golden["sharded_build"])


# DeepSpeed's runs of the cases: llama-z2 (also the tensor-parallel test's reference) runs live every time and is
# checked against its golden file; the others are read from tests/golden/hf_trainer/ (`make golden`), or run live
# where DeepSpeed's, torch's, transformers' or accelerate's version is not the goldens'
REFERENCES = References(
    "hf_trainer",
    run=_deepspeed_record,
    cases=CASES,
    live={"llama-z2"},
    sources=["tests/data/hf_trainer_script.py"],
    packages=("deepspeed", "torch", "transformers", "accelerate"),
    same=_same_deepspeed_runs,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ds_ext_dir):
    """``runs(backend, *flags, nproc=2, tag="")``: the script's record, each distinct launch run once per module;
    DeepSpeed's records are the cases' references (REFERENCES: live or golden), with ``"logits"`` for the model."""
    cache: dict = {}

    def get(backend: str, *flags: str, nproc: int = 2, tag: str = "") -> dict:
        key = (backend, flags, nproc, tag)
        if key not in cache:
            tmp = tmp_path_factory.mktemp("hf_trainer")
            if backend == "deepspeed":
                case = next(c for c, f in CASES.items() if tuple(f) == flags)
                cache[key] = REFERENCES.get(case, tmp, ds_ext_dir)
            else:
                cache[key] = run(backend, tmp, ds_ext_dir, *flags, nproc=nproc, tag=tag)
        return cache[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_trainer_matches_deepspeed(case, runs):
    theirs = runs("deepspeed", *CASES[case])
    ours = runs("llmpar", *CASES[case], *EXTRA.get(case, []))
    # bf16: both run bf16 params with fp32 masters and fp32 accumulation; the sums round differently (4.4e-5 seen)
    bf16 = "--bf16" in CASES[case]
    assert_same_losses(ours, theirs, rtol=1e-3 if bf16 else 1e-5)
    # the model saved by trainer.save_model() loads with from_pretrained and computes DeepSpeed's logits
    tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits(ours["final"]), torch.tensor(theirs["logits"]), **tol)
    if "--eval" in CASES[case]:  # evaluated every 10 steps (no crash: ZeRO-3 params read outside a gather are
        assert_evaluation_matches(ours, theirs)  # empty, never freed memory), then evaluate / predict / generate


@pytest.mark.slow
def test_trainer_on_a_sharded_build_matches_deepspeed(runs):
    """``AutoModelForCausalLM.from_config`` after the script's TrainingArguments (a subclass of transformers' own:
    only the Trainer import changed) with a ZeRO-3 config builds the model inside llmpar.zero.Init (never whole on a
    rank), as transformers does for DeepSpeed; ``resize_token_embeddings`` on it ("add a pad token") works as on the
    plain model; evaluate() before train() builds the engine and gives the plain resized model's loss; it then trains
    as DeepSpeed trains the plain build of the same seed, resized the same way (the ZeRO-3 eval case's launches:
    test_trainer_matches_deepspeed checks the losses and the weights)."""
    case = "llama-z3-untied-hf-schedule"
    theirs = runs("deepspeed", *CASES[case])
    ours = runs("llmpar", *CASES[case], *EXTRA[case])
    assert ours["sharded_build"] and not theirs["sharded_build"]
    # the script's TrainingArguments subclass transformers' own; its deepspeed= went to llmpar (DeepSpeed untouched)
    assert ours["args_class"] == "ScriptArguments" and not ours["args_deepspeed"]
    torch.manual_seed(0)
    plain = hf_trainer_script.build_model("llama", False)
    hf_trainer_script.add_pad_token(plain)  # what the script did to the sharded build (--resize)
    assert ours["eval_first"] == pytest.approx(plain_eval_loss(plain), rel=1e-5)
    assert_same_losses(ours, theirs)


@pytest.mark.slow
def test_trainer_tensor_parallel_matches_deepspeed(runs):
    """tp 2 x dp 2 (4 ranks; a tensor-parallel group reads the same batches) against DeepSpeed at dp 2 (the llama-z2
    case's run): the same global batch, the same losses."""
    theirs = runs("deepspeed", *CASES["llama-z2"])
    ours = runs("llmpar", *CASES["llama-z2"], "--tp", "2", nproc=4)
    assert_same_losses(ours, theirs)
    torch.testing.assert_close(logits(ours["final"]), torch.tensor(theirs["logits"]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_trainer_resumes_bitwise(runs, tmp_path):
    """20 steps saving at 10, then a new run resumed from checkpoint-10: steps 11-20 are bitwise the same, and the
    checkpoint's sharded part consolidates to the weights its from_pretrained part holds."""
    flags = [*CASES["qwen2-z3-offload"], *EXTRA["qwen2-z3-offload"]]  # the offload case's llmpar run
    whole = runs("llmpar", *flags)
    ckpt = Path(whole["final"]).parent / "checkpoint-10"
    assert (ckpt / "config.json").is_file() and (ckpt / "latest").is_file() and (ckpt / "trainer_state.json").is_file()
    resumed = runs("llmpar", *flags, "--resume", str(ckpt), tag="-resumed")
    assert resumed["step"] == list(range(11, 21))
    assert resumed["loss"] == whole["loss"][10:]
    assert resumed["grad_norm"] == whole["grad_norm"][10:]
    assert torch.equal(logits(resumed["final"]), logits(whole["final"]))
    consolidated = tmp_path / "consolidated"
    proc = subprocess.run(
        [sys.executable, "-m", "llmpar.cli", "checkpoint", "consolidate", str(ckpt), str(consolidated)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(logits(str(consolidated)), logits(str(ckpt)))


# ---- HF builds sharded by llmpar's TrainingArguments (2 ranks, in process) ----
def _zero3_config(stage: int = 3) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _whole(model, opt=None) -> dict:
    """Params and persistent buffers by name (gathered under ZeRO-3), every buffer also as ``buffer:<name>``."""
    state = model.state_dict() if opt is None else llmpar.zero.consolidated_state_dict(model, opt, rank0_only=False)
    return {**state, **{f"buffer:{n}": b.clone() for n, b in model.named_buffers()}}


def _differ(got: dict, model) -> list[str]:
    want = {**model.state_dict(), **{f"buffer:{n}": b for n, b in model.named_buffers()}}
    return sorted(n for n in want if n not in got or not torch.equal(got[n], want[n].detach()))


def sharded_builds_body(tmp: str) -> dict:
    import copy
    import gc

    from llmpar.integrations.transformers import TrainingArguments
    from llmpar.integrations.transformers.zero3 import is_llmpar_zero3_enabled

    auto = transformers.AutoModelForCausalLM
    out = {"before": is_llmpar_zero3_enabled()}
    torch.manual_seed(0)
    saved = hf_trainer_script.build_model("qwen2", tie=False)
    with torch.no_grad():  # trained-looking weights, not what a fresh build draws
        for p in saved.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    path = os.path.join(tmp, "saved")
    if torch.distributed.get_rank() == 0:
        saved.save_pretrained(path)
    torch.distributed.barrier()
    args = TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True, deepspeed=_zero3_config())
    out["on"] = is_llmpar_zero3_enabled()
    torch.manual_seed(0)
    built = auto.from_config(hf_trainer_script.model_config("qwen2", tie=False))
    loaded = auto.from_pretrained(path)
    out["meta"] = [all(p.is_meta for p in m.parameters()) for m in (built, loaded)]
    whole, info = auto.from_pretrained(path, output_loading_info=True)  # an argument the sharded path does not take
    out["fallback_meta"] = any(p.is_meta for p in whole.parameters())
    out["fallback_differ"] = _differ(_whole(whole), saved)
    torch.manual_seed(1)
    tied = auto.from_config(hf_trainer_script.model_config("llama", tie=True))
    # "add a pad token": resized before initialize (recorded, then replayed by ZeRO-3) as the plain models are
    for model, seed, how in (
        (built, 5, dict(new_num_tokens=70)),
        (loaded, 6, dict(pad_to_multiple_of=8)),
        (tied, 7, dict(new_num_tokens=69, mean_resizing=False)),
    ):
        torch.manual_seed(seed)
        model.resize_token_embeddings(**how)
    out["resized_meta"] = [all(p.is_meta for p in m.parameters()) for m in (built, loaded, tied)]
    out["resized_vocab"] = [m.config.vocab_size for m in (built, loaded, tied)]
    torch.manual_seed(0)
    plain = hf_trainer_script.build_model("qwen2", tie=False)
    torch.manual_seed(1)
    plain_tied = hf_trainer_script.build_model("llama", tie=True)
    saved_resized = copy.deepcopy(saved)
    for model, seed, how in (
        (plain, 5, dict(new_num_tokens=70)),
        (saved_resized, 6, dict(pad_to_multiple_of=8)),
        (plain_tied, 7, dict(new_num_tokens=69, mean_resizing=False)),
    ):
        torch.manual_seed(seed)
        model.resize_token_embeddings(**how)
    for key, model, ref in (
        ("config", built, plain),
        ("pretrained", loaded, saved_resized),
        ("tied", tied, plain_tied),
    ):
        engine, opt, _, _ = llmpar.initialize(model=model, config=_zero3_config())
        out[f"{key}_differ"] = _differ(_whole(model, opt), ref)
        out[f"{key}_peak"] = (opt.init_peak_numel, sum(p.numel() for p in ref.parameters()))
        if key == "tied":
            out["tied_shared"] = model.lm_head.weight is model.model.embed_tokens.weight
            try:
                model.resize_token_embeddings(80)
            except ValueError as e:
                out["resize_after_initialize"] = str(e)
    stage2 = TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True, deepspeed=_zero3_config(2))
    out["off_by_stage2"] = not is_llmpar_zero3_enabled()
    del args, stage2
    gc.collect()
    out["off"] = not is_llmpar_zero3_enabled() and not any(
        p.is_meta for p in auto.from_config(hf_trainer_script.model_config("qwen2", tie=False)).parameters()
    )
    return out


def test_hf_builds_are_sharded_under_zero3_arguments(tmp_path):
    """After llmpar's TrainingArguments with a ZeRO-3 config (while they are alive, until a later config without
    ZeRO-3), ``from_config`` and ``from_pretrained`` build on the meta device (llmpar.zero.Init) and ZeRO-3 gives the
    plain build's / the checkpoint's values, one unit at a time; a from_pretrained call the sharded path does not take
    is built whole by transformers. ``resize_token_embeddings`` on those models before initialize (mean resizing,
    ``pad_to_multiple_of``, a tied LM head) gives the plain resize of the plain build; after it, a clear error."""
    for out in run_ranks(sharded_builds_body, 2, str(tmp_path), timeout=180):
        assert not out["before"] and out["on"] and out["meta"] == [True, True]
        assert out["config_differ"] == [] and out["pretrained_differ"] == [] and out["tied_differ"] == []
        assert out["resized_meta"] == [True, True, True] and out["resized_vocab"] == [70, 72, 69]
        assert out["tied_shared"] and "resize it before" in out["resize_after_initialize"]
        for peak, psi in (out["config_peak"], out["pretrained_peak"], out["tied_peak"]):
            assert 0 < peak < psi / 2  # at most one unit whole at a time
        assert not out["fallback_meta"] and out["fallback_differ"] == []
        assert out["off_by_stage2"] and out["off"]


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
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=2e-3,
        warmup_steps=3,
        weight_decay=0.01,
        max_grad_norm=0.5,
        report_to=[],
        use_cpu=True,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-7,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _model():
    return hf_trainer_script.build_model("llama", tie=True)


def test_fill_auto_fills_from_the_arguments(tmp_path):
    cfg = hf_trainer_script.ds_config(3, False, 1, False)
    out = fill_auto(cfg, _args(tmp_path), model=_model(), num_training_steps=50, dp=3)
    assert out["train_micro_batch_size_per_gpu"] == 4 and out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 4 * 2 * 3 and out["gradient_clipping"] == 0.5
    assert out["optimizer"]["params"] == {
        "lr": 2e-3,
        "betas": [0.8, 0.95],
        "eps": 1e-7,
        "weight_decay": 0.01,
        "torch_adam": True,
    }
    assert out["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 2e-3,
        "warmup_num_steps": 3,
        "total_num_steps": 50,
    }
    z = out["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (
        32 * 32,
        int(0.9 * 32 * 32),
        320,
    )
    assert out["bf16"]["enabled"] is False and out["fp16"]["enabled"] is False
    assert cfg["train_batch_size"] == "auto"  # the caller's dict is left alone


def test_fill_auto_names_every_mismatch(tmp_path):
    cfg = {
        "gradient_accumulation_steps": 3,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
    }
    with pytest.raises(ValueError) as e:
        fill_auto(cfg, _args(tmp_path), model=_model(), num_training_steps=10, dp=2)
    msg = str(e.value)
    assert "gradient_accumulation_steps=3" in msg and "optimizer.params.lr=0.001" in msg and "bf16" in msg
    assert "train_micro_batch_size_per_gpu" not in msg  # equal values pass


def test_fill_auto_refuses_what_it_cannot_fill(tmp_path):
    with pytest.raises(ValueError, match=r"\"auto\" is not filled for \['zero_optimization.sub_group_size'\]"):
        fill_auto(
            {"zero_optimization": {"stage": 3, "sub_group_size": "auto"}},
            _args(tmp_path),
            model=_model(),
            num_training_steps=10,
            dp=1,
        )
    with pytest.raises(ValueError, match="no hidden_size"):
        fill_auto(
            {"zero_optimization": {"reduce_bucket_size": "auto"}},
            _args(tmp_path),
            model=torch.nn.Linear(2, 2),
            num_training_steps=10,
            dp=1,
        )
    with pytest.raises(TypeError, match="config must be a dict"):
        fill_auto("ds.json", _args(tmp_path), model=_model(), num_training_steps=10, dp=1)

    def tp(config: dict) -> int:  # the degree the Trainer asks the runtime's parser for, "auto" values left alone
        return Blocks.parallel_of({**config, "train_batch_size": "auto"}).tensor_parallel.size

    with pytest.raises(ValueError, match='"tensor_parallel.autotp_size"=-1 must be >= 0'):
        tp({"tensor_parallel": {"autotp_size": -1}})
    assert tp({"tensor_parallel": {"autotp_size": 2}}) == 2 and tp({}) == 1
    assert tp({"tensor_parallel": {"autotp_size": 0}}) == 1  # DeepSpeed's default: off


def test_trainer_needs_its_config_once(tmp_path):
    from llmpar.integrations.transformers import Trainer, TrainingArguments

    with pytest.raises(ValueError, match="deepspeed= or llmpar_config="):
        TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, deepspeed={}, llmpar_config={})
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, deepspeed={"a": 1})
    assert args.deepspeed is None and args.llmpar_config == {"a": 1}  # transformers never sees it
    # a script's own subclass of transformers' TrainingArguments: its deepspeed= goes to llmpar too (DeepSpeed is
    # never configured), and llmpar's Trainer takes the arguments as they are
    stock = hf_trainer_script.ScriptArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, deepspeed={"train_micro_batch_size_per_gpu": 2}
    )
    assert stock.deepspeed is None and stock.llmpar_config == {"train_micro_batch_size_per_gpu": 2}
    assert stock.deepspeed_plugin is None and not hasattr(stock, "hf_deepspeed_config")
    trainer = Trainer(model=_model(), args=stock, train_dataset=hf_trainer_script.Tokens())
    assert not trainer.is_deepspeed_enabled and trainer.llmpar_config == {"train_micro_batch_size_per_gpu": 2}
    plain = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="needs a DeepSpeed config"):
        Trainer(model=_model(), args=plain, train_dataset=hf_trainer_script.Tokens())
    with pytest.raises(ValueError, match="tensor_parallel.size=3 does not divide the 1 processes"):
        Trainer(
            model=_model(),
            args=plain,
            train_dataset=hf_trainer_script.Tokens(),
            llmpar_config={"tensor_parallel": {"autotp_size": 3}},
        )


def test_zero_init_is_reachable_after_import_llmpar():
    """``llmpar.zero.Init`` / ``GatheredParameters`` as DeepSpeed scripts write them, with only ``import llmpar``
    (a fresh interpreter: nothing imported llmpar.zero before)."""
    code = (
        "import llmpar, sys; assert 'llmpar.zero' not in sys.modules; "
        "print(llmpar.zero.Init.__name__, llmpar.zero.GatheredParameters.__name__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["Init", "GatheredParameters"]


def test_fill_auto_takes_a_multimodal_models_text_hidden_size(tmp_path):
    """The Trainer's "auto" bucket sizes are accelerate's (one rule, ``llmpar.integrations.buckets``), a
    ``text_config``'s hidden size included."""
    from types import SimpleNamespace

    from llmpar.integrations.buckets import bucket_sizes

    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(text_config=SimpleNamespace(hidden_size=24))
    keys = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    cfg = {"zero_optimization": {"stage": 3, **dict.fromkeys(keys, "auto")}}
    out = fill_auto(cfg, _args(tmp_path), model=model, num_training_steps=10, dp=1)
    assert {f"zero_optimization.{k}": out["zero_optimization"][k] for k in keys} == bucket_sizes(24)
    assert bucket_sizes(24) == dict(zip((f"zero_optimization.{k}" for k in keys), (576, 518, 240)))
