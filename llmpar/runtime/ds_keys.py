"""DeepSpeed keys llmpar has nothing to do for: accepted at their default or disabled value, an error naming what is
not supported otherwise. ``strip_inert(raw)`` returns the config without them (what the typed parsers then read).

Real configs carry many such keys (``"fp16": {"enabled": false}``, ``"prescale_gradients": false``, monitors with
``"enabled": false``, ``"allgather_partitions": true``, ...): refusing them made most of DeepSpeed's own example
configs fail. A rule per key says which values change nothing in llmpar:

    Default(v, ...)   the key's DeepSpeed default (or other values with the same effect in llmpar)
    Inert()           any value: the key tunes something llmpar does not have (an NVMe buffer, a timer printout)
    Disabled()        a block that is off (``"enabled": false``); its other keys are then irrelevant
    Absent()          a block that acts whenever it is there (no ``enabled`` switch): accepted only as null
    Renamed(path)     DeepSpeed's legacy spelling of a key llmpar supports: the value moves there

Anything else in the table is an error ``"<key>"=<value>: not supported: <reason>``. The keys llmpar acts on (the
monitors, ``checkpoint.load_universal`` / ``auto_resume``, ...) are not here: each is a typed block in ``Blocks``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from llmpar.zero.config import OPTIMIZER_TYPES


@dataclass(frozen=True)
class Default:
    values: tuple
    reason: str


@dataclass(frozen=True)
class Inert:
    pass


@dataclass(frozen=True)
class Disabled:
    reason: str


@dataclass(frozen=True)
class Absent:
    reason: str


@dataclass(frozen=True)
class Renamed:
    path: tuple[str, ...]  # where the value goes, e.g. ("offload_optimizer", "device") under zero_optimization
    value: Any = None  # the value written there when the old key is true (None: the old key's own value)


def _d(*values: Any, reason: str) -> Default:
    return Default(values, reason)


TOP: dict[str, Any] = {
    "wall_clock_breakdown": _d(False, reason="use the benchmarks in bench/ or torch.profiler"),
    "memory_breakdown": _d(False, reason="use llmpar.planning.estimate_memory or torch.cuda.memory_summary"),
    "dump_state": _d(False, reason="not supported"),
    "prescale_gradients": _d(False, reason="llmpar always divides by dp when packing the gradients"),
    "gradient_predivide_factor": _d(1.0, reason="llmpar divides the gradients by dp exactly once"),
    "gradient_allreduce_op": _d("mean", reason="gradients are averaged over dp"),
    "zero_allow_untested_optimizer": Inert(),
    "zero_force_ds_cpu_optimizer": Inert(),
    "disable_allgather": _d(False, reason="ZeRO always all-gathers the updated params"),
    "sparse_gradients": _d(False, reason="sparse gradients are not supported"),
    "communication_data_type": _d(None, reason="gradients are reduced in the params' dtype"),
    "seq_parallel_communication_data_type": Inert(),
    "vocabulary_size": Inert(),
    "use_data_before_expert_parallelism": _d(
        False, reason="the expert-parallel ranks are the inner (adjacent) data-parallel ranks"
    ),
    "disable_python_gc": Inert(),
    "log_level": Inert(),
    "timers": Inert(),
    "amp": Disabled("apex AMP is not supported; use bf16 or fp16"),
    "amp_enabled": _d(False, reason="apex AMP is not supported; use bf16 or fp16"),
    "torch_autocast": Disabled("torch autocast inside the engine is not supported; use bf16 or fp16"),
    "comet": Disabled("the comet monitor is not provided: use tensorboard, csv_monitor or wandb"),
    "monitor_config": Inert(),
    "comms_logger": Disabled(
        "DeepSpeed's per-collective log is not provided: pass initialize(counter="
        "llmpar.distributed.counter.CommCounter()) to count every collective's calls, volume "
        "and bytes, or use torch.profiler"
    ),
    "flops_profiler": Disabled(
        "DeepSpeed's FLOPs profiler is not provided: use torch.profiler.profile("
        "with_flops=True), or llmpar.planning for model FLOPs and memory"
    ),
    "autotuning": Disabled("use llmpar plan for layouts"),
    "elasticity": Disabled("elastic training is not supported (checkpoints reshard to any dp / tp / pp instead)"),
    "compression_training": Inert(),  # only acts through DeepSpeed's compression API, which scripts call themselves
    "data_efficiency": Disabled("data efficiency (curriculum, random-LTD) is not supported"),
    "curriculum_learning": Disabled("curriculum learning is not supported"),
    "progressive_layer_drop": Disabled("progressive layer drop is not supported"),
    "eigenvalue": Disabled("eigenvalue computation is not supported"),
    "quantize_training": Disabled("quantization-aware training is not supported"),
    "hybrid_engine": Disabled("the hybrid (RLHF) engine is not supported"),
    "nebula": Disabled("Nebula checkpointing is not supported (llmpar checkpoints are sharded and atomic)"),
    "aio": Inert(),  # NVMe offload settings: there is no NVMe offload to tune (an NVMe device is refused)
    "sparse_attention": Absent("sparse attention is not supported"),
    "dataloader_drop_last": _d(False, reason="not supported"),
    "checkpoint": {
        "tag_validation": _d(
            "Warn",
            "WARN",
            "warn",
            "Fail",
            "FAIL",
            "fail",
            "Ignore",
            "IGNORE",
            "ignore",
            reason="tag_validation is one of Warn, Fail, Ignore",
        ),  # llmpar agrees on tags (Fail)
        "use_node_local_storage": _d(False, reason="checkpoints are written to one shared directory"),
        "parallel_write": Inert(),
        "writer": Inert(),
    },
    "data_types": {
        "grad_accum_dtype": _d(
            None, "fp32", reason="gradients accumulate in fp32 (bf16 with accumulation) or the params' dtype"
        )
    },
}
ZERO: dict[str, Any] = {
    "allgather_partitions": _d(True, reason="llmpar always all-gathers the updated partitions"),
    "cpu_offload": Renamed(("offload_optimizer", "device"), "cpu"),
    "cpu_offload_params": Renamed(("offload_param", "device"), "cpu"),
    "cpu_offload_use_pin_memory": Renamed(("offload_optimizer", "pin_memory")),
    "round_robin_gradients": _d(False, reason="not supported"),
    "ignore_unused_parameters": _d(True, reason="unused params get zero gradients"),
    "legacy_stage1": _d(False, reason="not supported"),
    "elastic_checkpoint": Inert(),  # llmpar checkpoints load at any dp / tp / pp degree anyway
    "load_from_fp32_weights": _d(True, reason="llmpar restores the fp32 master when the checkpoint has one"),
    "use_multi_rank_bucket_allreduce": Inert(),
    "stage3_module_granularity_threshold": _d(0, reason="sharding units are modules (initialize(unit_policy=))"),
    "zero_quantized_nontrainable_weights": _d(
        False, reason="frozen weights are not stored quantized (zero_quantized_weights quantizes their all-gather)"
    ),
    "mics_shard_size": _d(-1, reason="MiCS is not supported"),
    "mics_hierarchical_params_gather": _d(False, reason="MiCS is not supported"),
    "memory_efficient_linear": Inert(),
    "pipeline_loading_checkpoint": _d(False, reason="not supported"),
    "override_module_apply": Inert(),
    "log_trace_cache_warnings": Inert(),
    "stage3_use_all_reduce_for_fetch_params": _d(False, reason="not supported"),
    "module_granularity_threshold": _d(0, reason="sharding units are modules (initialize(unit_policy=))"),
}
OFFLOAD: dict[str, Any] = {  # offload_optimizer / offload_param: NVMe tuning is inert without NVMe
    "buffer_count": Inert(),
    "buffer_size": Inert(),
    "max_in_cpu": Inert(),
    "pipeline_read": Inert(),
    "pipeline_write": Inert(),
    "fast_init": Inert(),
    "nvme_path": Inert(),
    "ratio": _d(1.0, reason="partial offload is not supported"),
}
BF16: dict[str, Any] = {
    "immediate_grad_update": Inert(),
    "check_grad_overflow": Inert(),
    "check_overflow": Inert(),
    "bf16_master_weights_and_grads": _d(False, reason="llmpar keeps fp32 masters with bf16 params"),
    "bf16_optimizer_states": _d(False, reason="llmpar keeps the optimizer states in fp32"),
}
FP16: dict[str, Any] = {
    "fp16_master_weights_and_grads": _d(False, reason="llmpar keeps fp32 masters with fp16 params"),
    "fp16_opt_level": Inert(),
}
OPTIMIZER_PARAMS: dict[str, Any] = {
    "amsgrad": _d(False, reason="AMSGrad is not supported"),
    "adam_w_mode": _d(
        True, reason="llmpar runs AdamW (decoupled weight decay); Adam with L2 regularisation is not supported"
    ),
    "bias_correction": _d(True, reason="not supported"),
    "torch_adam": Inert(),
    "fused": Inert(),
    "set_grad_none": Inert(),
    "cuda_aware": Inert(),
    "fp32_optimizer_states": _d(True, reason="optimizer states are fp32"),
}
PIPELINE: dict[str, Any] = {
    "pipe_partitioned": Inert(),
    "grad_partitioned": Inert(),
    "seed_layers": _d(False, reason="layers are built with the seed of the run"),
    "activation_checkpoint_interval": _d(0, reason='use the "activation_checkpointing" block'),
}
EXPERT_PARALLEL: dict[str, Any] = {  # DeepSpeed AutoEP's implementation switches: the math is the same in llmpar
    # (use_grouped_mm / disable_triton_grouped_mm choose the experts' GEMM backends: runtime/expert_block.py)
    "validate_folding_routing": Inert(),
    "async_split_plan": Inert(),
    "score_apply": _d("auto", "post", reason="the routing weights scale the expert outputs (after the experts)"),
    "combine_impl": Inert(),
    "row_weighting_impl": Inert(),
    "gate_up_impl": Inert(),
    "comm_num_sm": Inert(),
    "comm_qp_margin": Inert(),
    "comm_max_tokens_per_rank": Inert(),
}


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


def _apply(block: dict, table: dict[str, Any], where: str) -> None:
    """Remove ``block``'s keys that ``table`` accepts (in place), raising for the values it does not."""
    for key in [k for k in block if k in table]:
        rule, value, name = table[key], block[key], f"{where}.{key}" if where else key
        if isinstance(rule, dict):
            if isinstance(value, dict):
                _apply(value, rule, name)
                if not value:
                    del block[key]
            continue
        if isinstance(rule, Inert):
            del block[key]
        elif isinstance(rule, Default):
            if value not in rule.values or isinstance(value, bool) != isinstance(rule.values[0], bool):
                why = "" if rule.reason == "not supported" else f": {rule.reason}"
                raise ValueError(
                    f'"{name}"={_show(value)}: not supported{why} (accepted: '
                    f"{', '.join(_show(v) for v in rule.values)})"
                )
            del block[key]
        elif isinstance(rule, Disabled):
            if isinstance(value, dict) and value.get("enabled", False) is not False:
                raise ValueError(
                    f'"{name}.enabled"={_show(value.get("enabled"))}: not supported: {rule.reason} '
                    '(accepted: "enabled": false)'
                )
            if not isinstance(value, dict) and value not in (None, False):
                raise ValueError(f'"{name}"={_show(value)}: not supported: {rule.reason}')
            del block[key]
        elif isinstance(rule, Absent):
            if value is not None:
                raise ValueError(f'"{name}": not supported: {rule.reason}')
            del block[key]
        elif isinstance(rule, Renamed):
            del block[key]
            if value is False or value is None:
                continue
            target = block
            for part in rule.path[:-1]:
                target = target.setdefault(part, {})
            new = rule.value if rule.value is not None else value
            if rule.path[-1] in target and target[rule.path[-1]] != new:
                raise ValueError(f'"{name}" and "{where}.{".".join(rule.path)}" disagree: give one of them')
            target[rule.path[-1]] = new


def strip_inert(raw: dict) -> dict:
    """A copy of the config without the keys that change nothing in llmpar (module docstring); raises a
    ``ValueError`` naming the key for a value that would change something llmpar does not support."""
    out = copy.deepcopy(raw)
    _apply(out, TOP, "")
    sections = [("zero_optimization", ZERO), ("bf16", BF16), ("bfloat16", BF16), ("fp16", FP16), ("pipeline", PIPELINE)]
    sections.append(("expert_parallel", EXPERT_PARALLEL))
    for section, table in sections:
        if isinstance(out.get(section), dict):
            _apply(out[section], table, section)
    zero = out.get("zero_optimization")
    if isinstance(zero, dict):
        for key in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(key), dict):
                _apply(zero[key], OFFLOAD, f"zero_optimization.{key}")
    opt = out.get("optimizer")
    adam = isinstance(opt, dict) and str(opt.get("type", "")).lower() in OPTIMIZER_TYPES  # others: refused by type
    if adam and isinstance(opt.get("params"), dict):
        _apply(opt["params"], OPTIMIZER_PARAMS, "optimizer.params")
    return out


__all__ = ["strip_inert"]
