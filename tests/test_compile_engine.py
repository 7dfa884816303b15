"""``engine.compile()`` and the ``"compile"`` block (``llmpar/runtime/compile.py``): the demo GPT compiled under ZeRO on
2 CPU ranks trains as eager does (fp32, 1e-6) with no graph break and no recompile after warm-up (10 micro-steps with
a changing LR and a checkpoint save + load among them; accumulation at stage 2, activation checkpointing and
overlap_param_gather at stage 1), compiled autograd included; DeepSpeed's block typed and checked."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from zero_helpers import GPT_CFG, gpt_batch

import llmpar
from llmpar.models import GPT, GPTConfig
from llmpar.runtime.compile import PASSES, CompileConfig, compile_block
from llmpar.runtime.config import Config

from multirank import run_ranks

WARM, STEPS, SAVE_AT, MICRO = 2, 12, 7, 2
DS_BLOCK = {  # every key of DeepSpeed 0.19's CompileConfig, none at its default
    "deepcompile": True,
    "autoep_non_moe": True,
    "free_activation": True,
    "free_activation_threshold": 123,
    "offload_activation": True,
    "offload_activation_pin_memory": False,
    "offload_opt_states": True,
    "double_buffer": False,
    "symmetric_memory": True,
    "debug_log": True,
    "offload_parameters": True,
    "sync_before_reduce": True,
    "sync_after_reduce": True,
    "sync_before_allgather": True,
    "sync_after_allgather": True,
    "keep_int_input_tensors": False,
    "keep_all_input_tensors": True,
    "passes": ["z1", "z3"],
}


def test_compile_block_takes_deepspeeds_keys_typed_and_names_them_in_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger="llmpar")
    cfg = Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "compile": dict(DS_BLOCK)}, dp=1)
    assert isinstance(cfg.compile, CompileConfig)
    assert {k: getattr(cfg.compile, k) for k in DS_BLOCK} == DS_BLOCK
    said = [r.getMessage() for r in caplog.records if '"compile"' in r.getMessage()]
    assert len(said) == 1 and "deepcompile=True" in said[0] and "passes=['z1', 'z3']" in said[0], said
    assert compile_block({}) == CompileConfig() == compile_block(None)
    older = {"enabled": False, "backend": "inductor", "kwargs": {}}  # DeepSpeed 0.14's block, off (accepted before)
    assert compile_block({**older, "passes": None}) == CompileConfig()
    assert set(PASSES) == {"z1", "z3", "autosp", "autotp"}
    from types import SimpleNamespace

    from llmpar.runtime.engine_api import DeepSpeedAPI

    engine = SimpleNamespace(config=cfg)  # DeepSpeed's queries read the typed block
    assert DeepSpeedAPI.is_deepcompile_enabled(engine) and not DeepSpeedAPI.is_deepcompile_active(engine)
    assert not DeepSpeedAPI.is_deepcompile_enabled(
        SimpleNamespace(config=Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1}, dp=1))
    )


@pytest.mark.parametrize(
    "block, error, words",
    [
        ({"deepcompile": "yes"}, TypeError, ['"compile.deepcompile" must be true or false', "'yes'"]),
        ({"passes": ["z2"]}, ValueError, ["unknown pass", "'z2'", "z1, z3, autosp, autotp"]),
        ({"passes": "z1"}, TypeError, ['"compile.passes" must be a list', "'z1'"]),
        ({"free_activation_threshold": -1}, ValueError, ["compile.free_activation_threshold", "-1"]),
        ({"deepcompil": True}, ValueError, ['unknown key "compile.deepcompil"', 'did you mean "deepcompile"']),
        ({"enabled": True}, ValueError, ['"compile.enabled"=true', "engine.compile("]),
        ({"backend": 3}, TypeError, ['"compile.backend" must be a string', "3"]),
        ([1], TypeError, ['"compile" must be a JSON object']),
    ],
)
def test_compile_block_bad_values_raise_naming_them(block, error, words):
    with pytest.raises(error) as e:
        Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "compile": block}, dp=1)
    assert all(w in str(e.value) for w in words), (str(e.value), words)


def _build(stage):
    model = GPT(GPTConfig(**GPT_CFG), seed=1)  # fp32
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2 if stage == 2 else 1,  # stage 2 reduce-scatters every micro-step
        "steps_per_print": 1000,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 30}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 700,
            "overlap_comm": True,
            "overlap_param_gather": stage == 1,  # waited for in front of the graph, not in hooks inside it
        },
        "compile": {"deepcompile": True},
    }
    if stage == 1:  # the blocks' forwards wrapped in torch.utils.checkpoint (non-reentrant): traced, no break
        cfg["activation_checkpointing"] = {}
    engine, *_ = llmpar.initialize(model=model, config=cfg)
    return engine, model


def _bad_arguments(engine, stage):
    """Each bad engine.compile argument raises naming it (no collective inside: every rank raises by itself)."""
    cases = [(dict(compiled_autograd_enabled=True), ValueError, "compiled autograd is not supported")] * (
        stage == 3
    ) + [
        (dict(backend="nope"), ValueError, "not a torch.compile backend"),
        (dict(backend=3), TypeError, "backend=3"),
        (dict(compile_kwargs={"fullgrph": True}), ValueError, "['fullgrph'] are not torch.compile arguments"),
        (dict(compile_kwargs=[1]), TypeError, "compile_kwargs=[1]"),
        (dict(compiled_autograd_enabled=1), TypeError, "compiled_autograd_enabled"),
    ]
    for kwargs, error, words in cases:
        try:
            engine.compile(**kwargs)
        except error as e:
            assert words in str(e), (kwargs, str(e))
        else:
            raise AssertionError(f"engine.compile({kwargs}) did not raise")
    assert not engine.is_compiled


def compile_body(stages, ckpt_dir, ca_stage):
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        for mode in ["eager", "compiled"] + (["compiled_autograd"] if stage == ca_stage else []):
            torch._dynamo.reset()
            counters.clear()
            engine, model = _build(stage)
            if mode != "eager":
                _bad_arguments(engine, stage)
                engine.compile(backend="aot_eager", compiled_autograd_enabled=mode == "compiled_autograd")
                engine.compile(backend="aot_eager", compiled_autograd_enabled=mode == "compiled_autograd")  # no-op
                assert engine.is_compiled, (stage, mode)
                # the config's DeepCompile block is read (deepcompile: true) and its passes never run here
                assert engine.is_deepcompile_enabled() and not engine.is_deepcompile_active(), (stage, mode)
            losses, lrs, warm = [], [], None
            for s in range(STEPS):
                if s == WARM:
                    warm = (counters["stats"]["unique_graphs"], counters["compiled_autograd"]["captures"])
                x, y = gpt_batch(s, MICRO * world)
                loss = model.loss(engine(x[rank * MICRO : (rank + 1) * MICRO]), y[rank * MICRO : (rank + 1) * MICRO])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                lrs.append(engine.get_lr()[0])
                if s == SAVE_AT and mode != "eager":  # a checkpoint round trip must not recompile anything
                    engine.save_checkpoint(f"{ckpt_dir}/{stage}_{mode}", tag="t")
                    engine.load_checkpoint(f"{ckpt_dir}/{stage}_{mode}", tag="t")
            engine.optimizer.wait_params()  # overlap_param_gather: the last step's gather
            out[(stage, mode)] = dict(
                losses=losses,
                lrs=lrs,
                params=[p.detach().clone() for p in model.parameters()],
                breaks=sum(counters["graph_break"].values()),
                graphs=counters["stats"]["unique_graphs"],
                captures=counters["compiled_autograd"]["captures"],
                warm=warm,
                tokens=engine.throughput.tokens,
                compile_s=engine.get_compile_time().get("_compile.compile_inner", 0.0),
            )
            engine.destroy()
    return out, _moe_losses(rank)


def _moe_losses(rank):
    """An expert-parallel model (ep=2, ZeRO-2) eager and under compiled autograd: the experts' own reducer (a nested
    ZeroOptimizer over the expert-data-parallel ranks) has its hooks detached too (were traced: queue_callback), and
    the forward is one graph (no break at the tokens' all-to-all)."""
    from test_moe_zero import _batch, _Net
    from torch._dynamo.utils import counters

    from llmpar.moe import RouterConfig

    losses = {}
    for mode in ("eager", "compiled_autograd", "compiled zero3"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-2}},
            "zero_optimization": {"stage": 3 if "zero3" in mode else 2},
            "expert_parallel": {"enabled": True, "autoep_size": 2},
        }
        engine, opt, _, _ = llmpar.initialize(model=_Net(None, RouterConfig(aux_loss_coeff=0.05)), config=cfg)
        assert opt.experts is not None
        if mode != "eager":  # ZeRO-3: the regions (compile_stage3) allow the all-to-all's data-dependent rows too
            engine.compile(backend="aot_eager", compiled_autograd_enabled=mode == "compiled_autograd")
        counters.clear()
        losses[mode] = []
        for s in range(3):
            x, y = _batch(s, rank)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses[mode].append(loss.item())
        # the tokens' all-to-all (a data-dependent row count) is traced: engine.compile allows such sizes at ep > 1
        losses[f"{mode} graph breaks"] = [float(sum(counters["graph_break"].values()))]
        engine.destroy()
    torch._dynamo.reset()
    return losses


@pytest.mark.slow(
    reason="one 2-rank launch for every ZeRO stage eager / compiled (5 dynamo compiles), compiled autograd and an "
    "expert-parallel model: ~20 s on 2 cores"
)
def test_compiled_engine_trains_as_eager_at_every_zero_stage_without_graph_breaks_or_recompiles(tmp_path):
    stages = [0, 1, 2, 3]
    for rank, (out, moe) in enumerate(run_ranks(compile_body, 2, stages, str(tmp_path), 2, timeout=300)):
        torch.testing.assert_close(moe["compiled_autograd"], moe["eager"], rtol=1e-6, atol=1e-6, msg=f"rank {rank}")
        torch.testing.assert_close(moe["compiled zero3"], moe["eager"], rtol=1e-6, atol=1e-6, msg=f"rank {rank}")
        assert moe["compiled_autograd graph breaks"] == moe["compiled zero3 graph breaks"] == [0.0], (rank, moe)
        for (stage, mode), got in out.items():
            where = f"rank {rank}, ZeRO {stage}, {mode}"
            ref = out[(stage, "eager")]
            assert ref["graphs"] == 0 and got["lrs"][WARM] != got["lrs"][-1], where  # eager compiles nothing; lr moves
            torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-6, atol=1e-6, msg=where)
            for a, b in zip(got["params"], ref["params"]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=where)
            assert got["tokens"] == ref["tokens"] == STEPS * MICRO * GPT_CFG["seq_len"], where  # counted outside
            if mode == "eager":
                continue
            assert got["breaks"] == 0 and got["compile_s"] > 0, where  # get_compile_time: dynamo's seconds
            assert got["graphs"] >= 1 and (got["graphs"], got["captures"]) == got["warm"], (where, got)
            assert got["captures"] == (1 if mode == "compiled_autograd" else 0), (where, got)


def test_compile_refuses_a_pipeline_engine_before_compiling_anything():
    from types import SimpleNamespace

    from llmpar.runtime.compile import compile_engine

    module = torch.nn.Linear(3, 2)
    stand_in = SimpleNamespace(config=SimpleNamespace(zero=SimpleNamespace(stage=1)), module=module, runner=object())
    with pytest.raises(ValueError, match="compile the stages' blocks"):
        compile_engine(stand_in, backend="aot_eager")
    assert module._compiled_call_impl is None and not hasattr(stand_in, "_compiled")
