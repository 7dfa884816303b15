"""The configuration reference (``docs/configuration.md``), generated from the code that reads the config.

Every block llmpar reads is a typed dataclass (``runtime/blocks.py``, ``zero/config.py``, ``runtime/schedules.py``,
``runtime/resume.py``, ``runtime/monitor.py``): its keys, defaults and docstring come from there, a key's trailing
source comment becomes its note. DeepSpeed's keys that llmpar accepts without acting on them, or refuses, come from
the rule tables of ``runtime/ds_keys.py``. So the page cannot drift: ``tests/test_docs.py`` checks the committed page
equals ``render()``, and ``python -m llmpar.runtime.reference > docs/configuration.md`` (``make docs``) rewrites it.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import sys
import tokenize
from typing import Any

from llmpar.runtime import blocks, ds_keys, expert_block
from llmpar.runtime.compile import CompileConfig
from llmpar.runtime.config import _VALID
from llmpar.runtime.monitor import WandbConfig, WriterConfig
from llmpar.runtime.resume import CheckpointConfig
from llmpar.runtime.schedules import SchedulerConfig
from llmpar.zero.config import OffloadConfig, OptimizerConfig, ZeroConfig

# the top-level keys that are a single value, not a block (each block has its own section below); a key in
# config._VALID missing from here and from BLOCKS fails tests/test_docs.py, so a new key cannot go undocumented
SCALARS: dict[str, str] = {
    "train_batch_size": "micro batch x accumulation x dp; give any two of the three (DeepSpeed's arithmetic)",
    "train_micro_batch_size_per_gpu": "rows per forward on one data-parallel rank (default 1 when nothing is given)",
    "gradient_accumulation_steps": "micro steps per optimizer step; the loss is scaled by 1/accumulation",
    "gradient_clipping": "max global gradient norm (0: off); clipped inside the fused step",
    "steps_per_print": "optimizer steps between the engine's lr / grad-norm / MFU log lines (default 10)",
    "sequence_parallel_size": 'DeepSpeed\'s Ulysses degree: the same as "context_parallel": {"size": N, "mode": '
    '"ulysses"}',
    "bfloat16": 'DeepSpeed\'s alias of "bf16"',
}

# (JSON path, the dataclass it becomes, the keys as written in JSON when they differ from the fields)
BLOCKS: list[tuple[str, type, list[str] | None]] = [
    ("zero_optimization", ZeroConfig, None),
    ("zero_optimization.offload_optimizer / offload_param", OffloadConfig, None),
    ("optimizer", OptimizerConfig, None),
    ("scheduler", SchedulerConfig, None),
    ("bf16", None, None),  # type: ignore[list-item]
    ("fp16", blocks.Fp16Config, None),
    ("activation_checkpointing", blocks.ActivationCheckpointingConfig, None),
    ("pipeline", blocks.PipelineConfig, blocks._PIPELINE_KEYS),
    ("tensor_parallel", blocks.TensorParallelConfig, ["size", "autotp_size"]),
    ("context_parallel", blocks.ContextParallelConfig, None),
    (
        "expert_parallel",
        blocks.ExpertParallelConfig,
        [f.name for f in dataclasses.fields(blocks.ExpertParallelConfig) if f.name != "overrides"],
    ),
    ("checkpoint", CheckpointConfig, None),
    ("compile", CompileConfig, None),
    ("tensorboard", WriterConfig, None),
    ("csv_monitor", WriterConfig, None),
    ("wandb", WandbConfig, None),
]
_EXTRA = {  # what a block's JSON shape adds to its dataclass
    "optimizer": '`{"type": ..., "params": {...}}`: `type` is AdamW, Adam (AdamW: DeepSpeed\'s default '
    "`adam_w_mode`), AdamW8bit or AdamW4bit; the other keys go under `params`.",
    "scheduler": '`{"type": ..., "params": {...}}`; the params each type takes: '
    + "; ".join(f"{t}: {', '.join(f'`{p}`' for p in ps)}" for t, ps in blocks._SCHEDULER_PARAMS.items())
    + ".",
    "bf16": '`{"enabled": true}`: bfloat16 params with fp32 masters (the optimizer\'s `precision` "auto" picks '
    "fp32_master).",
    "tensor_parallel": "`autotp_size` is DeepSpeed's AutoTP spelling of `size` (`0`, its default, means off); "
    "`llmpar.parallelize` splits the model.",
    "activation_checkpointing": "The block's presence turns it on (`enabled` is not a key).",
    "compile": "`engine.compile()` compiles the model (see docs/compile.md); older DeepSpeed's `enabled` (false "
    "only), `backend` and `kwargs` are accepted without effect.",
    "expert_parallel": "`preset_model` is one of "
    + ", ".join(f"`{p}`" for p in expert_block.PRESETS)
    + ". Also kept as given, for locating the MoE layers of a model being swapped: "
    + ", ".join(f"`{k}`" for k in expert_block._LOCATORS)
    + ". `engine.backward(loss)` adds the MoE layers' weighted aux losses when `add_aux_loss` (see docs/moe.md).",
    "zero_optimization": "Also accepted: `gather_16bit_weights_on_model_save` (DeepSpeed's field name) and "
    "`stage3_gather_fp16_weights_on_model_save` for `stage3_gather_16bit_weights_on_model_save`.",
}


def _field_comments(cls: type) -> dict[str, str]:
    """A dataclass field's trailing ``# comment`` in its class source, by field name."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    last_name, last_line = None, -1
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string in names:
            last_name, last_line = tok.string, tok.start[0]
        elif tok.type == tokenize.COMMENT and tok.start[0] == last_line and last_name:
            out[last_name] = tok.string.lstrip("# ").strip()
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if dataclasses.is_dataclass(value) or value is None:
        return "null" if value is None else "off"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"


def _doc(cls: type | None) -> str:
    doc = inspect.getdoc(cls) if cls is not None else None
    return " ".join(doc.split()) if doc else ""


def _block_section(path: str, cls: type | None, keys: list[str] | None) -> list[str]:
    lines = [f"### `{path}`", ""]
    doc = _doc(cls)
    if doc:
        lines += [doc, ""]
    if path in _EXTRA:
        lines += [_EXTRA[path], ""]
    if cls is None:
        return lines
    comments = _field_comments(cls)
    lines += ["| key | default | note |", "|---|---|---|"]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in keys or [n for n in fields if not (cls is OptimizerConfig and n == "type")]:
        f = fields.get(name)
        default = _default(f) if f is not None else "`0` (off)"
        lines.append(f"| `{name}` | {default} | {comments.get(name, '')} |")
    return lines + [""]


def _show(value: Any) -> str:
    return f"`{ds_keys._show(value)}`"


def _rule(rule: Any) -> str:
    if isinstance(rule, ds_keys.Inert):
        return "accepted, any value: tunes something llmpar does not have"
    if isinstance(rule, ds_keys.Default):
        why = "" if rule.reason == "not supported" else f": {rule.reason}"
        return f"accepted at {', '.join(_show(v) for v in rule.values)}; another value is refused{why}"
    if isinstance(rule, ds_keys.Disabled):
        return f'accepted when off (`"enabled": false`); refused when on: {rule.reason}'
    if isinstance(rule, ds_keys.Absent):
        return f"accepted only as `null`; refused otherwise: {rule.reason}"
    if isinstance(rule, ds_keys.Renamed):
        target = ".".join(rule.path)
        value = f" = {_show(rule.value)}" if rule.value is not None else ""
        return f"DeepSpeed's older spelling: read as `{target}`{value} when true"
    raise TypeError(f"unknown rule {rule!r}")


def _rule_rows(table: dict[str, Any], where: str) -> list[str]:
    rows = []
    for key, rule in table.items():
        name = f"{where}.{key}" if where else key
        if isinstance(rule, dict):
            rows += _rule_rows(rule, name)
        else:
            rows.append(f"| `{name}` | {_rule(rule)} |")
    return rows


def render() -> str:
    """The whole page, as Markdown."""
    missing = [k for k in _VALID if k not in SCALARS and k not in {p for p, _, _ in BLOCKS}]
    if missing:
        raise ValueError(f"config keys without a reference entry in llmpar/runtime/reference.py: {missing}")
    out = [
        "# Configuration reference",
        "",
        "<!-- generated by `python -m llmpar.runtime.reference` from the code that reads the config: do not edit -->",
        "",
        "`llmpar.initialize(model=..., config=...)` takes a DeepSpeed JSON config (a dict or a path) as it is. Every "
        "key below is read once, on every rank, before any collective: a value out of its range, of the wrong type, "
        "or one llmpar does not support is a `ValueError` / `TypeError` naming the key, the value and what is "
        "accepted; an unknown key is an error naming the nearest valid one; configs that differ between ranks are "
        "an error on every rank.",
        "",
        "## Top-level keys",
        "",
        "| key | meaning |",
        "|---|---|",
    ]
    out += [f"| `{k}` | {SCALARS[k]} |" for k in _VALID if k in SCALARS]
    out += ["", "## Blocks", ""]
    for path, cls, keys in BLOCKS:
        out += _block_section(path, cls, keys)
    out += [
        "## DeepSpeed keys llmpar accepts without acting on them, or refuses",
        "",
        "From `llmpar/runtime/ds_keys.py`. Real configs carry many keys that change nothing in llmpar (a "
        "disabled monitor, NVMe tuning without NVMe, a DeepSpeed default); each is accepted at the values that "
        'change nothing, and any other value is an error `"key"=value: not supported: why (accepted: ...)`.',
        "",
        "| key | rule |",
        "|---|---|",
    ]
    out += _rule_rows(ds_keys.TOP, "")
    for where, table in (
        ("zero_optimization", ds_keys.ZERO),
        ("zero_optimization.offload_*", ds_keys.OFFLOAD),
        ("bf16", ds_keys.BF16),
        ("fp16", ds_keys.FP16),
        ("optimizer.params", ds_keys.OPTIMIZER_PARAMS),
        ("pipeline", ds_keys.PIPELINE),
        ("expert_parallel", ds_keys.EXPERT_PARALLEL),
    ):
        out += _rule_rows(table, where)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
