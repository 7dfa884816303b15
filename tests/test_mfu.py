"""Tokens/s, achieved TFLOP/s and MFU: the FLOP count against a hand-computed model, the engine's steps_per_print line
on a fake clock, the device peak table, and ``llmpar train``'s summary."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import llmpar
from llmpar.runtime import mfu

V, D, LAYERS = 37, 12, 3


class _Tiny(nn.Module):
    """Token embedding [V, D] (lookup only), a [D, D] linear with bias, an output head [V, D] without bias."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.config = SimpleNamespace(n_layer=LAYERS, hidden_size=D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def test_matmul_params_by_hand():
    assert mfu.matmul_params(_Tiny()) == D * D + D + V * D  # the embedding table is a lookup: left out
    assert mfu.matmul_params(_Tiny(tie=True)) == D * D + D + V * D  # tied to the head: counted once
    m = _Tiny()
    m.mid.weight.tensor_model_parallel = True  # a tp shard: the whole of it is tp times this
    m.head.weight.ds_numel = 5 * V * D  # a ZeRO-3 param: ds_numel, not the (here unchanged) local numel
    assert mfu.matmul_params(m, tp=2) == 2 * D * D + D + 5 * V * D
    assert mfu.attention_dims(m) == (LAYERS, D) and mfu.attention_dims(nn.Linear(2, 2)) is None
    assert mfu.flops_per_token(100, 7, (LAYERS, D)) == 6 * 100 + 12 * LAYERS * D * 7
    assert mfu.flops_per_token(100, 7, None) == 600


def test_batch_tokens():
    assert mfu.batch_tokens((torch.zeros(3, 11, dtype=torch.long),), {}) == (33, 11)
    assert mfu.batch_tokens((), {"input_ids": torch.zeros(2, 5, dtype=torch.long)}) == (10, 5)
    assert mfu.batch_tokens((torch.randn(4, 9, 6),), {}) == (36, 9)  # float [batch, seq, features]: one per row
    assert mfu.batch_tokens((torch.randn(4, 33),), {}) == (4, 1)
    assert mfu.batch_tokens(("text",), {}) == (0, 0)


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_table(name, peak):
    assert mfu.peak_for_name(name)[0] == peak


def test_peak_from_env_and_cpu(monkeypatch):
    assert mfu.peak_tflops("cpu", {"LLMPAR_PEAK_TFLOPS": "1.5"}) == (1.5, "LLMPAR_PEAK_TFLOPS")
    measured, source = mfu.peak_tflops("cpu", {})
    assert measured > 0 and "measured" in source and mfu.cpu_matmul_tflops() == measured  # cached per process
    for bad in ("0", "-3", "fast", "inf"):
        with pytest.raises(ValueError, match=f"LLMPAR_PEAK_TFLOPS='{bad}' must be a positive finite number"):
            mfu.Throughput({"LLMPAR_PEAK_TFLOPS": bad})


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_engine_line_against_a_hand_computed_example(monkeypatch, caplog):
    """Two optimizer steps of 2 micro-batches [3, 11] on a fake clock: 132 tokens in 0.75 s; the line's tokens/s,
    TFLOP/s and MFU against the formula with N counted by hand, then a second window that restarts."""
    monkeypatch.setenv("LLMPAR_PEAK_TFLOPS", "0.0002")
    torch.manual_seed(0)
    model = _Tiny().double()
    engine, *_ = llmpar.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 3,
            "gradient_accumulation_steps": 2,
            "steps_per_print": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
    )
    clock = engine.throughput.clock = _Clock(100.0)
    g = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.INFO, logger="llmpar"):
        for step in range(4):
            for micro in range(2):
                engine.backward(engine(torch.randint(0, V, (3, 11), generator=g)).square().mean())
                if micro == 1:
                    clock.t += 0.375 if step < 2 else 0.5  # the step's time, before its end is reported
                engine.step()
        with torch.no_grad():
            engine.eval()(torch.randint(0, V, (3, 11)))  # not training: not counted
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step=")]
    assert len(lines) == 2, lines
    fpt = 6 * (D * D + D + V * D) + 12 * LAYERS * D * 11
    for line, seconds in zip(lines, (0.75, 1.0)):
        tps = 2 * 2 * 3 * 11 / seconds
        achieved = tps * fpt / 1 / 1e12
        assert re.fullmatch(
            r"step=\d+, skipped=0, lr=\[.*\], mom=\[.*\], grad_norm=\S+, tokens/s=\S+, "
            r"TFLOP/s/device=\S+, MFU=\S+%",
            line,
        ), line
        assert f"tokens/s={tps:.0f}, TFLOP/s/device={achieved:.4g}, MFU={100 * achieved / 0.0002:.3g}%" in line, line
    from llmpar.distributed.flight import RECORDER

    assert RECORDER.step == engine.global_steps == 4  # the engine stamps its step on the flight recorder's entries
    engine.set_tokens_per_step(1000)
    assert engine.throughput.tokens_per_step == 1000
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"set_tokens_per_step\(tokens={bad!r}\): expected a positive int"):
            engine.set_tokens_per_step(bad)
    engine.destroy()


def test_context_parallel_window_counts_whole_sequences(monkeypatch):
    """Under context parallelism each forward sees 1/cp of a sequence: [3, 11] here with cp=4 is a 44-token sequence
    whose attention term is 12 L d 44; the tokens (local count times the dp x cp ranks) are the job's."""
    monkeypatch.setenv("LLMPAR_PEAK_TFLOPS", "0.0002")
    t = mfu.Throughput()
    t.clock = _Clock(10.0)
    t.seen((torch.zeros(3, 11, dtype=torch.long),), {})
    t.clock.t += 0.5
    t.steps = 1
    line = t.report(_Tiny(), tp=1, data_ranks=8, world=8, device=torch.device("cpu"), seq_scale=4)
    tps = 3 * 11 * 8 / 0.5
    achieved = tps * (6 * (D * D + D + V * D) + 12 * LAYERS * D * 44) / 8 / 1e12
    assert line == f"tokens/s={tps:.0f}, TFLOP/s/device={achieved:.4g}, MFU={100 * achieved / 0.0002:.3g}%"


def test_train_summary_reports_mfu():
    from llmpar.train.loop import TrainResult, format_summary

    r = TrainResult(
        losses=[3.0, 1.0],
        tokens_per_s=2500.0,
        wall_s=1.0,
        mem_mb=[1.0],
        mem_kind="rss",
        dp=1,
        tflops_per_device=0.125,
        peak_tflops=0.4,
        peak_source="LLMPAR_PEAK_TFLOPS",
    )
    assert r.mfu == 0.125 / 0.4 and r.summary()["mfu"] == r.mfu
    assert (
        f"throughput      2,500 tokens/s (all ranks, after step 1), 0.125 TFLOP/s per device, MFU "
        f"{100 * 0.125 / 0.4:.3g}% of 0.4 TFLOP/s (LLMPAR_PEAK_TFLOPS)"
    ) in format_summary(r)
    r.peak_tflops, r.peak_source = None, "no bf16 peak known for 'X'"
    assert r.mfu is None and "0.125 TFLOP/s per device (MFU: no bf16 peak known for 'X')" in format_summary(r)


@pytest.mark.parametrize("impl", ["transformers", "builtin"])
def test_bench_mfu_runs_at_toy_size(tmp_path, impl):
    """bench/bench_mfu.py (the GPU check's MFU command) end to end at toy size on CPU, so it cannot rot: both cases
    train the same model from the same weights on the same batches (first losses agree), report tokens/s, TFLOP/s and
    MFU, and the table + PNG land in --out."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if impl == "transformers":
        pytest.importorskip("transformers")
    script = Path(__file__).resolve().parents[1] / "bench" / "bench_mfu.py"
    proc = subprocess.run(
        # the builtin model also runs the compiled case (aot_eager: traced, no C++ compile in the suite)
        [sys.executable, str(script), "--toy", "--impl", impl, "--out", str(tmp_path)]
        + (["--compile", "--compile-backend", "aot_eager"] if impl == "builtin" else []),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "mfu_toy_cpu.json").read_text())
    torch_row, llmpar_row, *compiled = record["rows"]
    assert torch_row["case"].startswith("torch") and llmpar_row["case"].startswith("llmpar")
    assert len(compiled) == (impl == "builtin"), record["rows"]
    if compiled:  # the same weights and batches: engine.compile() changes no loss
        assert compiled[0]["case"] == "llmpar + engine.compile()" and "aot_eager" in record["meta"]["compile"]
        assert abs(compiled[0]["first_loss"] - llmpar_row["first_loss"]) < 1e-3, (compiled[0], llmpar_row)
    for row in (torch_row, llmpar_row, *compiled):
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["tflops_per_device"] >= 0 and row["mfu_pct"] > 0, row
    assert abs(torch_row["first_loss"] - llmpar_row["first_loss"]) < 0.05, (torch_row, llmpar_row)
    assert llmpar_row["speedup"] == pytest.approx(llmpar_row["tokens_per_s"] / torch_row["tokens_per_s"], rel=1e-2)
    assert impl in record["meta"]["model"] and "6 N + 12 n_layer d_model seq" in record["meta"]["flops_per_token"]
    assert (tmp_path / "mfu_toy_cpu.md").exists() and (tmp_path / "mfu_toy_cpu.png").exists()
