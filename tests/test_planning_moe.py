"""The planner on mixtures of experts: parameter counts (tiny Hugging Face MoE models, published presets), expert vs
dense model states per rank at each ZeRO stage, all-to-all bytes, the suggested ep, and ``llmpar plan --ep``.

Expected numbers are counted by hand in the test (or taken from instantiated models and published totals), never
from the planner's own output.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from llmpar.planning import Hardware, Layout, ModelSpec, PlanRequest, estimate_comm, estimate_memory, evaluate, plan
from llmpar.planning import cli as planning_cli
from llmpar.planning.moe import ep_choices, stage_table
from llmpar.planning.presets import load_model

# h=8, 2 heads (head_dim 4), 2 layers of 4 experts of width 6, top-2, untied, RMSNorm, no biases, vocab 10:
#   per layer: attention 4 h h = 256, norms 2 h = 16, router E h = 32, experts E 3 h I = 576  -> 880
#   embedding V h = 80, final norm 8, head V h = 80                                            -> total 1928
TINY = ModelSpec(
    name="tiny-moe",
    n_layers=2,
    hidden=8,
    n_heads=2,
    vocab=10,
    seq_len=16,
    gated_mlp=True,
    norm="rmsnorm",
    bias=False,
    tied_embeddings=False,
    learned_positions=False,
    num_experts=4,
    top_k=2,
    moe_intermediate=6,
)
ROUTED, DENSE = 2 * 576, 1928 - 2 * 576  # 1152, 776


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="llmpar")
    planning_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _hf_models() -> list[tuple[str, object]]:
    transformers = pytest.importorskip("transformers")
    tiny = dict(vocab_size=61, hidden_size=24, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)
    return [
        (
            "mixtral",
            transformers.MixtralForCausalLM(
                transformers.MixtralConfig(
                    **tiny, intermediate_size=20, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
                )
            ),
        ),
        (
            "qwen3_moe",
            transformers.Qwen3MoeForCausalLM(
                transformers.Qwen3MoeConfig(
                    **tiny,
                    intermediate_size=40,
                    moe_intermediate_size=10,
                    num_key_value_heads=2,
                    head_dim=8,  # 4 heads x 8 != hidden 24
                    num_experts=4,
                    num_experts_per_tok=2,
                )
            ),
        ),
        (
            "deepseek_v3",
            transformers.DeepseekV3ForCausalLM(
                transformers.DeepseekV3Config(
                    **tiny,
                    intermediate_size=40,
                    moe_intermediate_size=10,
                    num_key_value_heads=4,
                    n_routed_experts=8,
                    num_experts_per_tok=2,
                    n_shared_experts=1,
                    first_k_dense_replace=1,
                    q_lora_rank=12,
                    kv_lora_rank=8,
                    qk_rope_head_dim=4,
                    qk_nope_head_dim=6,
                    v_head_dim=5,
                    n_group=2,
                    topk_group=1,
                )
            ),
        ),
    ]


def test_counts_match_instantiated_hf_moe_models() -> None:
    """Mixtral (GQA), Qwen3-MoE (head_dim != h / heads, q/k norms) and DeepSeek-V3 (latent attention, a first dense
    layer, a shared expert, 8 routed): the spec read from each config counts the model's parameters exactly, its
    routed experts exactly (the ``.experts.`` tensors) and the active ones as the total less (E - k) / E of them."""
    for name, model in _hf_models():
        spec = ModelSpec.from_dict(model.config.to_dict())  # type: ignore[attr-defined]
        total = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)  # type: ignore[attr-defined]
        assert (spec.num_params(), spec.expert_params()) == (total, routed), name
        e, k = spec.num_experts, spec.top_k
        assert spec.active_params() == total - routed * (e - k) // e, name
        assert spec.stage_split(tp=1, pp=1, ep=2) == (total - routed, routed // 2), name
    assert spec.moe_layers == 2 and spec.shared_intermediate == 10 and spec.kv_channels is None  # DeepSeek's


@pytest.mark.parametrize(
    "name,total,active",
    [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("deepseek-v3", 671e9, 37e9)],
)
def test_moe_presets_match_published_counts(name: str, total: float, active: float) -> None:
    """The model cards' totals and activated parameters (DeepSeek-V3 without its multi-token prediction module)."""
    spec = load_model(name)
    assert spec.num_params() == pytest.approx(total, rel=0.003)
    assert spec.active_params() == pytest.approx(active, rel=0.02)


def test_tiny_spec_hand_count() -> None:
    assert (TINY.num_params(), TINY.expert_params()) == (1928, ROUTED)
    assert TINY.matmul_params() == 1928 - 80 - ROUTED // 2  # no input lookup, half the routed experts idle
    # pp=2: stage 0 = embedding + layer 0 (960), stage 1 = layer 1 + norm + head (968): the busiest
    assert TINY.params_per_rank(pp=2) == 968 and TINY.stage_split(pp=2, ep=4) == (968 - 576, 576 // 4)
    lead = replace(TINY, n_layers=4, first_dense_layers=1, ffn_hidden=20)  # layer 0 dense: 3 h f = 480 (+ 272)
    assert lead.num_params() == 80 + 88 + (256 + 16 + 480) + 3 * 880 and lead.moe_layers == 3


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_and_dense_states_per_rank(stage: int) -> None:
    """fp32 (4 + 4 + 8 B/param), dp=4, ep=2: the dense 776 params shard over dp=4, each rank's 2 of the 4 experts
    (576 params) over edp=2 -- the ZeRO paper's per-stage bytes, each part on its own group."""
    shard = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}[stage]  # bytes kept whole, bytes sharded
    want_dense = DENSE * (shard[0] + shard[1] / 4)
    want_experts = ROUTED / 2 * (shard[0] + shard[1] / 2)
    lay = Layout(dp=4, ep=2, zero_stage=stage)
    mem = estimate_memory(TINY, lay, precision="fp32", persistence_threshold=0)
    assert mem.experts == pytest.approx(want_experts) and mem.dense == pytest.approx(want_dense)
    req = PlanRequest(model=TINY, gpus=4, hardware=_hw(1e9), precision="fp32", reserve_bytes=0)
    row = stage_table(req, lay)[stage]
    assert row["experts"] == pytest.approx(want_experts) and row["zero_stage"] == stage
    assert row["dense"] == pytest.approx(DENSE * (shard[0] + shard[1] / 4) + (4 * 0 if stage < 3 else 4 * DENSE))


def test_alltoall_and_expert_gradient_traffic() -> None:
    """ep axis: L 4 T k (ep-1)/ep h a = 2 x 4 x (16 x 3 micro-batches) x 2 x 3/4 x 8 x 2 bytes; dp axis at ZeRO-1:
    (G + P)(d-1)/d psi over dp for the dense params plus over edp for the rank's experts."""
    hw = _hw(1e9)
    comm = estimate_comm(TINY, Layout(dp=8, ep=4, zero_stage=1), hw, precision="fp32_master", micro_batches=3)
    assert comm["ep"].bytes == pytest.approx(2 * 4 * 48 * 2 * 0.75 * 8 * 2) and comm["ep"].link == "nvlink"
    assert comm["dp"].bytes == pytest.approx(4 * 7 / 8 * DENSE + 4 * 1 / 2 * ROUTED / 4)
    assert estimate_comm(TINY, Layout(dp=8, zero_stage=1), hw)["ep"].bytes == 0  # ep=1: every expert local


def _hw(mem: float, gpn: int = 8) -> Hardware:
    return Hardware(
        name="toy", mem_bytes=mem, peak_flops=1e12, intra_node_bw=1e11, inter_node_bw=1e10, gpus_per_node=gpn
    )


def test_suggested_ep_is_the_smallest_that_fits() -> None:
    """Per layout the planner keeps the smallest ep (dividing 4 experts and dp, tp ep inside a node) that fits; a
    budget between the ep=2 and ep=1 needs of the dp=8 ZeRO-1 layout makes that ep=2."""
    lay = Layout(dp=8, zero_stage=1, activation_checkpointing="full")
    probe = PlanRequest(model=TINY, gpus=8, hardware=_hw(1e9), precision="fp32", reserve_bytes=0, allow_offload=False)
    need = {e: evaluate(probe, replace(lay, ep=e)).memory.total for e in (1, 2, 4)}
    assert need[1] > need[2] > need[4]
    # states: 1152 x (8 + 8 / 8) at ep=1, 576 x (8 + 8 / 4) at ep=2; buckets: 2 x 4 B x the 576 experts fewer
    assert need[1] - need[2] == pytest.approx(ROUTED * 9 - ROUTED / 2 * 10 + 2 * 4 * ROUTED / 2)
    req = replace(probe, hardware=_hw((need[1] + need[2]) / 2))
    assert ep_choices(req, lay) == [1, 2, 4] and ep_choices(replace(req, hardware=_hw(1e9, gpn=2)), lay) == [1, 2]
    rows = {replace(r.layout, ep=1): r for r in plan(req).ranked}
    assert rows[lay].layout.ep == 2
    for key, row in rows.items():  # every kept ep is the smallest of its choices that fits
        smaller = [e for e in ep_choices(req, key) if e < row.layout.ep]
        assert not any(evaluate(req, replace(key, ep=e)).fits for e in smaller), key
    forced = plan(replace(req, ep=4)).ranked
    assert forced and {r.layout.ep for r in forced} == {4}


def test_plan_cli_reports_experts(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--top", "2", "--ep", "2"], capsys)
    assert rc == 0 and "12.9B active: 8 experts top-2 in 32 layers" in out
    assert "ep=2 [requested], edp=4): 4 experts per GPU" in out and "model states per GPU by ZeRO stage" in out
    rc, out, _ = run_cli(["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--top", "3", "--json"], capsys)
    doc = json.loads(out)
    moe, lay = doc["moe"], doc["layouts"][0]["layout"]
    assert rc == 0 and moe["ep"] == lay["ep"] and not moe["ep_requested"] and 128 % moe["ep"] == 0
    assert [r["zero_stage"] for r in moe["zero_stages"]] == [0, 1, 2, 3]
    layers = 48 // lay["pp"]  # of the busiest stage; 128 experts of 3 x 2048 x 768, 16 B each at ZeRO-0
    assert moe["zero_stages"][0]["experts"] == pytest.approx(16 * layers * 128 * 3 * 2048 * 768 / moe["ep"])
    tokens = 1024 * 4096 // lay["dp"] // lay["tp"]  # global batch 1024 sequences of 4096 over dp (and tp with SP)
    away = (moe["ep"] - 1) / moe["ep"]
    assert moe["alltoall_bytes_per_step"] == pytest.approx(layers * 4 * tokens * 8 * away * 2048 * 2)


def test_bad_moe_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "8", "--ep", "2"], capsys)
    assert rc == 2 and "ep=2 needs a mixture-of-experts model; llama-7b has no experts" in err
    rc, _, err = run_cli(["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--ep", "3"], capsys)
    assert rc == 2 and "ep=3 does not divide num_experts=8" in err
    with pytest.raises(ValueError, match="ep=3 does not divide dp x cp = 4"):
        Layout(dp=4, ep=3)
    with pytest.raises(ValueError, match="top_k=5 must be in"):
        replace(TINY, top_k=5)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelSpec.from_dict({**TINY.to_dict(), "mlp_only_layers": [0]})
