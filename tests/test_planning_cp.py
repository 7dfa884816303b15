"""The planner's long-context terms (llmpar.planning.context / cp_plan): activation bytes by sequence, cp and mode,
tiled loss / MLP and recompute, hand-computed on a tiny shape; model states over dp x cp; the context-parallel
traffic; ``llmpar plan --seq-len`` recommending context parallelism only when nothing else fits; refused inputs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from llmpar.planning import cli as plan_cli
from llmpar.planning.context import activation_breakdown, cp_traffic
from llmpar.planning.memory import Layout, estimate_memory
from llmpar.planning.model_spec import ModelSpec
from llmpar.planning.planner import PlanRequest

# S = 10 tokens, cp = 2 -> s = 5 per rank; h = 8, 4 heads of 2, 2 KV heads (k = 4), f = 16 plain MLP, V = 100
TINY = ModelSpec(n_layers=2, hidden=8, n_heads=4, n_kv_heads=2, vocab=100, seq_len=10, ffn_hidden=16)


def test_activation_breakdown_by_hand() -> None:
    ring = activation_breakdown(TINY, Layout(cp=2, cp_mode="ring"), seq_len=10)
    # per layer (2-byte elements): norms 4 s h = 160, q k v out s (2h + 2k) = 120, MLP 2 s f = 160 -> 880 bytes
    assert ring.tokens == 5 and ring.kept == 2 * 880
    assert ring.workspace == 8 * 5 * 4 * 2  # k / v blocks in flight + dk / dv: 8 s k
    assert ring.loss == 8 * 5 * 100  # fp32 logits + log-softmax of 5 tokens
    assert ring.peak == 1760 + 4000
    uly = activation_breakdown(TINY, Layout(cp=2, cp_mode="ulysses"), seq_len=10)
    assert uly.kept == 1760 and uly.workspace == 2 * 5 * (8 + 2 * 4) * 2  # local q, k, v + their all-to-all copies
    # Ulysses over 4 with 2 KV heads: each rank keeps one whole KV head of the full sequence: k' = 4 x 2 = 8
    uly4 = activation_breakdown(TINY, Layout(cp=4, cp_mode="ulysses"), seq_len=12)
    assert uly4.tokens == 3 and uly4.kept == 2 * ((4 * 3 * 8 + 3 * (16 + 16)) * 2 + 2 * 3 * 16 * 2)
    tiled = activation_breakdown(TINY, Layout(cp=2, cp_mode="ring", tiled=True, tile=3), seq_len=10)
    # the MLP's 320 bytes go; the loss keeps 4 s of lse + one 3-token tile of logits and probabilities
    assert tiled.kept == 2 * 560 and tiled.loss == 4 * 5 + 8 * 3 * 100 and tiled.peak == 1120 + 2420
    full = activation_breakdown(TINY, Layout(cp=2, cp_mode="ring", activation_checkpointing="full"), seq_len=10)
    assert full.kept == 2 * 5 * 8 * 2 and full.rebuilt == 880 and full.peak == 160 + max(4000, 880 + 320)
    plain = activation_breakdown(TINY, Layout(tiled=True, tile=4), seq_len=10)  # cp = 1, tiled only
    assert plain.tokens == 10 and plain.workspace == 2 * 4 * 16 * 2
    # the torch attention path (query tiles of 4 rows), fp32, next to the ring's buffers: 4 a s (5 d + 3 min(4, s))
    torch_path = activation_breakdown(TINY, Layout(cp=2, cp_mode="ring"), seq_len=10, q_chunk=4)
    assert torch_path.workspace == 320 + 4 * 4 * 5 * (5 * 2 + 3 * 4)
    # hybrid u=2 x r=2 over 12 tokens: s = 3, a ring step sees s u = 6 keys of a / u = 2 heads (d = 2)
    hyb = activation_breakdown(TINY, Layout(cp=4, cp_mode="hybrid", ulysses_size=2), seq_len=12, q_chunk=4)
    assert hyb.workspace == 2 * 3 * (8 + 8) * 2 + 8 * 3 * 4 * 2 + 4 * 2 * 6 * (5 * 2 + 3 * 4)


def test_activations_fall_with_cp_and_gated_mlp_counts_four() -> None:
    spec = ModelSpec(n_layers=4, hidden=64, n_heads=8, vocab=128, seq_len=8192, gated_mlp=True, ffn_hidden=176)
    parts = [
        activation_breakdown(spec, Layout(cp=cp, cp_mode="ring", tiled=True, tile=64), seq_len=8192)
        for cp in (1, 2, 4, 8)
    ]
    for a, b in zip(parts, parts[1:]):
        assert a.kept == 2 * b.kept  # every kept term is per token
        assert 1.5 < a.peak / b.peak <= 2.0  # a layer's ring buffers (8 s k) and the loss tile stay
    g = activation_breakdown(spec, Layout(cp=2, cp_mode="ring"), seq_len=8192)
    assert g.kept == 4 * ((4 * 4096 * 64 + 4096 * (128 + 128)) * 2 + 4 * 4096 * 176 * 2)


def test_model_states_shard_over_dp_times_cp() -> None:
    spec = ModelSpec(n_layers=2, hidden=64, n_heads=4, vocab=512, seq_len=256)
    psi = spec.params_per_rank()
    lay = Layout(dp=2, cp=4, cp_mode="ring", zero_stage=3)
    mem = estimate_memory(spec, lay, precision="fp32", persistence_threshold=0)
    assert lay.world_size == 8
    assert mem.params == pytest.approx(4 * psi / 8) and mem.optimizer == pytest.approx(8 * psi / 8)
    act = activation_breakdown(spec, lay, seq_len=256, act_bytes=4).peak
    assert mem.activations == act


def test_cp_traffic_by_hand() -> None:
    uly, ring = cp_traffic(TINY, Layout(cp=2, cp_mode="ulysses"), seq_len=10, micro_batches=3)
    # 2 (u-1)/u s (2h + 2k') e per layer and micro-batch: 2 x 1/2 x 5 x 24 x 2 = 240, x 2 layers x 3
    assert (uly, ring) == (240 * 6, 0.0)
    uly, ring = cp_traffic(TINY, Layout(cp=2, cp_mode="ring"), seq_len=10)
    assert (uly, ring) == (0.0, 6 * 1 * 5 * 4 * 2 * 2)  # 6 (r-1) s k e x 2 layers
    hyb = Layout(cp=4, cp_mode="hybrid", ulysses_size=2)
    uly, ring = cp_traffic(TINY, hyb, seq_len=12)  # s = 3; ring on u's output: 6 tokens of k' / 2 = 2
    assert uly == 2 * 0.5 * 3 * 24 * 2 * 2 and ring == 6 * 1 * 6 * 2 * 2 * 2


def _plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    rc = args.func(args)
    return rc, capsys.readouterr().out


def test_plan_recommends_context_parallelism_when_nothing_else_fits(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-mem", "40GB", "--seq-len", "131072"]
    rc, out = _plan(base + ["--context-parallel", "off"], capsys)
    assert rc == 1  # no layout of tp / pp / dp / ZeRO / offload / recompute holds 131072 tokens in 38 GB
    rc, out = _plan(base + ["--json", "--top", "50"], capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["fits"] and "without context parallelism" in doc["message"]
    layouts = [row["layout"] for row in doc["layouts"]]
    assert all(lay["cp"] > 1 or lay["tiled"] for lay in layouts)
    assert {lay["cp_mode"] for lay in layouts if lay["cp"] > 1} >= {"ring", "ulysses"}
    assert all(row["memory"]["total"] <= 38e9 for row in doc["layouts"])
    rc, out = _plan(base, capsys)
    assert rc == 0 and "cp=" in out and "ZeRO over dp x cp" in out
    # a sequence that fits without it: auto plans as before, no cp layouts
    rc, out = _plan(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-mem", "80GB", "--json"], capsys)
    assert rc == 0 and all(
        row["layout"]["cp"] == 1 and not row["layout"]["tiled"] for row in json.loads(out)["layouts"]
    )


def test_refused_long_context_inputs() -> None:
    with pytest.raises(ValueError, match="cp_mode='zigzag'; accepted: 'ulysses', 'ring', 'hybrid'"):
        Layout(cp=2, cp_mode="zigzag")
    with pytest.raises(ValueError, match="ulysses_size < cp dividing cp=8, got ulysses_size=3"):
        Layout(cp=8, cp_mode="hybrid", ulysses_size=3)
    with pytest.raises(ValueError, match="needs pp=1"):
        Layout(cp=2, pp=2)
    with pytest.raises(ValueError, match="cp=0 must be a positive integer"):
        Layout(cp=0)
    with pytest.raises(ValueError, match="tile=0 must be a positive integer"):
        Layout(tiled=True, tile=0)
    with pytest.raises(ValueError, match="context_parallel='maybe'; accepted"):
        PlanRequest(model=TINY, gpus=2, hardware=plan_cli.load_gpu("h100"), context_parallel="maybe")


def test_estimate_against_the_bench_measurement() -> None:
    """The planner's activation peak vs the peak the long-context bench measured (bench/results/long_context_cpu.json:
    RSS of each rank in fresh processes, fp32, torch attention path) for plain, Ulysses and ring at every length it
    ran: within 25 %. The estimate is recomputed here from the recorded shape, so a formula change is checked too."""
    path = Path(__file__).resolve().parents[1] / "bench" / "results" / "long_context_cpu.json"
    if not path.is_file():
        pytest.skip("run bench/bench_long_context.py first")
    record = json.loads(path.read_text())
    meta = record["meta"]
    shape = meta["shape"]
    modes = set()
    for row in record["rows"]:
        spec = ModelSpec(
            n_layers=shape["n_layers"],
            hidden=shape["hidden"],
            n_heads=shape["n_heads"],
            n_kv_heads=shape["n_kv_heads"],
            vocab=shape["vocab"],
            seq_len=row["seq"],
            ffn_hidden=shape["ffn_hidden"],
            gated_mlp=True,
        )
        mode = "ulysses" if row["mode"] == "plain" else row["mode"]
        lay = Layout(cp=row["sp"], cp_mode=mode, tiled=True, tile=meta["tile"])
        est = activation_breakdown(spec, lay, seq_len=row["seq"], act_bytes=4, q_chunk=meta["q_chunk"]).peak
        measured = row["peak_mib"] * 2**20
        assert 0.8 <= measured / est <= 1.25, (row, est / 2**20)
        modes.add(row["mode"])
    assert modes == {"plain", "ulysses", "ring"}
