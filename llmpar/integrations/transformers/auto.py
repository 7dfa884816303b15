"""A DeepSpeed config's ``"auto"`` values filled from ``transformers.TrainingArguments``, as the Trainer does for
DeepSpeed, and the values that are given checked against the arguments.

    config = fill_auto(read_config("ds.json"), args, model=model, num_training_steps=1000, dp=4)

Filled (and, when given as numbers, required to equal the argument, else one ValueError lists every mismatch):
``train_micro_batch_size_per_gpu`` (per_device_train_batch_size), ``gradient_accumulation_steps``,
``train_batch_size`` (micro batch x accumulation x dp: the data-parallel ranks, not the world when tensor parallelism
splits it), ``gradient_clipping`` (max_grad_norm), ``optimizer.params`` lr / betas (adam_beta1, adam_beta2) / eps
(adam_epsilon) / weight_decay, ``scheduler.params`` warmup_max_lr (learning_rate), warmup_num_steps (the arguments'
warmup, at least 1), total_num_steps (the run's optimizer steps), ``fp16.enabled`` / ``bf16.enabled``.
Filled only (never checked): ``scheduler.params.warmup_min_lr`` (0) and, from the model's ``config.hidden_size`` h,
``zero_optimization.reduce_bucket_size`` (h*h), ``stage3_prefetch_bucket_size`` (0.9 h*h),
``stage3_param_persistence_threshold`` (10 h) (``llmpar.integrations.buckets``, accelerate's rule too). An ``"auto"``
left anywhere else is an error naming its key. The parallel degrees the filling needs (dp) come from
``Blocks.parallel_of``.
"""

from __future__ import annotations

import copy
from typing import Any

from llmpar.integrations.buckets import BUCKET_KEYS, bucket_sizes, hidden_size

_HIDDEN_KEYS = tuple(k.rpartition(".")[2] for k in BUCKET_KEYS)


class _Filler:
    def __init__(self, config: dict) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def _node(self, key: str) -> tuple[dict | None, str]:
        *path, leaf = key.split(".")
        node: Any = self.config
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, leaf
        return (node if isinstance(node, dict) else None), leaf

    def fill(self, key: str, value: Any, arg: str | None = None) -> None:
        """``key`` = "auto" becomes ``value``; a given value must equal it when ``arg`` names the argument."""
        node, leaf = self._node(key)
        if node is None or leaf not in node:
            return
        given = node[leaf]
        if given == "auto":
            node[leaf] = value
        elif arg is not None and not _same(given, value):
            self.mismatches.append(f"- {key}={given!r} but TrainingArguments {arg}={value!r}")


def _same(given: Any, value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return (
            isinstance(given, (list, tuple))
            and len(given) == len(value)
            and all(_same(g, v) for g, v in zip(given, value))
        )
    if isinstance(value, bool) or isinstance(given, bool):
        return bool(given) == bool(value)
    if isinstance(value, (int, float)) and isinstance(given, (int, float)):
        return float(given) == float(value)
    return given == value


def _autos(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _autos(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if node == "auto" else []


def fill_auto(config: dict, args: Any, *, model: Any, num_training_steps: int, dp: int) -> dict:
    """A copy of ``config`` with its "auto" values filled from ``args`` (see the module docstring)."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (a DeepSpeed config), got {type(config).__name__}")
    f = _Filler(copy.deepcopy(config))
    mbs, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    f.fill("train_micro_batch_size_per_gpu", mbs, "per_device_train_batch_size")
    f.fill("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    f.fill("train_batch_size", mbs * gas * dp, f"per_device_train_batch_size x gradient_accumulation_steps x dp {dp}")
    f.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    f.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2")
    f.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0)
    f.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    f.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
    f.fill("scheduler.params.total_num_steps", num_training_steps, "the run's optimizer steps")
    f.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16")
    f.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16")
    zero = f.config.get("zero_optimization")
    if isinstance(zero, dict) and any(zero.get(k) == "auto" for k in _HIDDEN_KEYS):
        h = hidden_size(model)
        if h is None:
            raise ValueError(
                f'zero_optimization has "auto" in {[k for k in _HIDDEN_KEYS if zero.get(k) == "auto"]} '
                "but the model's config has no hidden_size to derive them from: give numbers"
            )
        for key, size in bucket_sizes(h).items():
            f.fill(key, size)
    if f.mismatches:
        raise ValueError(
            'the DeepSpeed config disagrees with the TrainingArguments (set these keys to "auto", or '
            "make them equal):\n" + "\n".join(f.mismatches)
        )
    left = _autos(f.config)
    if left:
        raise ValueError(
            f'"auto" is not filled for {left}: the Trainer fills only the keys listed in '
            "llmpar.integrations.transformers.auto; give numbers for these"
        )
    return f.config


__all__ = ["fill_auto"]
