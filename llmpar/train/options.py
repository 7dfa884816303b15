"""What ``llmpar train`` runs: :class:`TrainOptions` (the command's flags) and the DeepSpeed config they build.

The command is a thin layer over ``llmpar.initialize``: every setting that changes how the model trains (batch,
accumulation, optimizer, LR schedule, clipping, ZeRO stage, offload, bf16, tensor and pipeline degrees) lives in one
DeepSpeed-style config dict, either built from the flags by :func:`build_config` or read from ``--config ds.json``.
The options that stay outside that dict describe the run and the model: steps, the GPT's shape, the text, the seed,
the model dtype (float32 / float64; bf16 is the config's), logging.

Flags -> config (``llmpar train --print-config`` shows it)::

    train_micro_batch_size_per_gpu = --batch-size          (sequences per dp rank per micro step)
    gradient_accumulation_steps    = --grad-accum          (default 1; with --pp: pipeline micro-batches, default pp)
    optimizer      AdamW, lr --lr, betas (0.9, 0.95), weight_decay --weight-decay (matrices only: llmpar train passes
                   param groups; under --pp the pipeline engine splits the model itself and decays every param)
    scheduler      WarmupCosineLR (DeepSpeed's formula), linear warm-up over --warmup-steps, cosine to
                   cos_min_ratio=0.1 of --lr at total_num_steps = --steps
    gradient_clipping --grad-clip (0: off);  steps_per_print --print-every
    zero_optimization {stage: --zero (default 2; 1 with --pp, pipelines run 0-2), offload_optimizer cpu: --offload}
    bf16 {enabled: --bf16 or --dtype bfloat16};  pipeline {stages, schedule, micro_batches} when --pp > 1;
    tensor_parallel {size} when --tp > 1

With ``--config`` the file decides all of that: giving one of the flags above as well is an error naming the config
key to edit instead (no silent override); the run/model flags (--steps, --seq-len, --n-layer, ...) still apply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from llmpar.models import GPTConfig
from llmpar.runtime.config import Blocks, read_config

MODEL_DTYPES = ("float32", "float64", "bfloat16")  # bfloat16 means the config's bf16 (fp32 master weights)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
BETAS = (0.9, 0.95)

# flags that change training -> the config key that decides them under --config
CONFIG_FLAGS: dict[str, str] = {
    "batch_size": "train_micro_batch_size_per_gpu",
    "grad_accum": "gradient_accumulation_steps",
    "lr": "optimizer.params.lr",
    "weight_decay": "optimizer.params.weight_decay",
    "warmup_steps": "scheduler.params.warmup_num_steps",
    "min_lr_ratio": "scheduler.params.cos_min_ratio",
    "grad_clip": "gradient_clipping",
    "zero": "zero_optimization.stage",
    "offload": "zero_optimization.offload_optimizer",
    "bf16": "bf16.enabled",
    "tp": "tensor_parallel.size",
    "pp": "pipeline.stages",
    "schedule": "pipeline.schedule",
    "print_every": "steps_per_print",
}


def flag(name: str) -> str:
    """The command-line spelling of an option: ``grad_accum`` -> ``--grad-accum``."""
    return "--" + name.replace("_", "-")


@dataclass(kw_only=True)
class TrainOptions:
    """The flags of ``llmpar train``. ``batch_size`` is per dp rank and micro step; ``zero=None`` picks 2 (1 with
    ``pp > 1``), ``grad_accum=None`` picks 1 (``pp`` with ``pp > 1``)."""

    # the run and the model (outside the DeepSpeed config)
    steps: int = 300
    seq_len: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    seed: int = 0
    text: str = "shakespeare"
    dtype: str = "float32"
    log_every: int = 10
    # training: these build the DeepSpeed config
    batch_size: int = 16
    grad_accum: int | None = None
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    zero: int | None = None
    offload: bool = False
    bf16: bool = False
    tp: int = 1
    pp: int = 1
    schedule: str | None = None  # None: 1f1b
    print_every: int = 100

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "seq_len",
            "n_layer",
            "n_head",
            "d_model",
            "log_every",
            "batch_size",
            "tp",
            "pp",
            "print_every",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag(name)}={value!r} must be a positive integer")
        if self.grad_accum is not None and (not isinstance(self.grad_accum, int) or self.grad_accum < 1):
            raise ValueError(f"--grad-accum={self.grad_accum!r} must be a positive integer")
        if not self.lr > 0:
            raise ValueError(f"--lr={self.lr} must be positive")
        for name in ("warmup_steps", "grad_clip", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{flag(name)}={getattr(self, name)} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"--dtype={self.dtype!r} is not one of {', '.join(MODEL_DTYPES)}")
        if self.dtype == "bfloat16":
            self.bf16 = True
        elif self.bf16 and self.dtype == "float64":
            raise ValueError("--bf16 and --dtype float64 contradict each other: give one")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.schedule is not None and self.pp == 1:
            raise ValueError(f"--schedule={self.schedule} is a pipeline schedule: it needs --pp > 1")
        if self.zero is None:
            self.zero = 1 if self.pp > 1 else 2
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero={self.zero!r} must be 0, 1, 2 or 3")
        if self.pp > 1 and self.zero == 3:
            raise ValueError(
                f"--zero 3 with --pp {self.pp}: pipelines run ZeRO stages 0, 1 or 2 (each stage's "
                "params are sharded over dp); use --zero 1 or 2"
            )
        if self.offload and self.zero < 1:
            raise ValueError(
                f"--offload needs --zero 1, 2 or 3 (CPU offload of the optimizer state), got --zero {self.zero}"
            )

    @property
    def model_dtype(self) -> str:
        """The dtype the GPT is built in: float64 or float32 (bf16 runs cast it inside ``initialize``)."""
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.grad_accum if self.grad_accum is not None else (self.pp if self.pp > 1 else 1)

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(
            vocab_size=vocab_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_model=self.d_model,
            seq_len=self.seq_len,
            dropout=self.dropout,
        )


def build_config(opts: TrainOptions) -> dict[str, Any]:
    """The DeepSpeed config the flags describe (a pure function: no ranks, no dp; see the module docstring)."""
    gas = opts.gradient_accumulation_steps
    zero: dict[str, Any] = {"stage": opts.zero}
    if opts.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": opts.batch_size,
        "gradient_accumulation_steps": gas,
        "steps_per_print": opts.print_every,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": opts.lr, "betas": list(BETAS), "eps": 1e-8, "weight_decay": opts.weight_decay},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "warmup_type": "linear",
                "warmup_num_steps": max(1, opts.warmup_steps),
                "total_num_steps": opts.steps,
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": opts.min_lr_ratio,
            },
        },
        "gradient_clipping": opts.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": opts.bf16},
    }
    if opts.pp > 1:
        config["pipeline"] = {"stages": opts.pp, "schedule": opts.schedule or "1f1b", "micro_batches": gas}
    if opts.tp > 1:
        config["tensor_parallel"] = {"size": opts.tp}
    return config


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a DeepSpeed JSON config with the runtime's reader (a missing file or bad JSON is a ValueError naming it)."""
    return read_config(os.fspath(path))


def resolve(flags: dict[str, Any], config_path: str | os.PathLike | None = None) -> tuple[TrainOptions, dict[str, Any]]:
    """The options and the DeepSpeed config of a command line. ``flags``: the flags given (name -> value).

    Without ``config_path`` the flags build the config. With it, the file is the config, and a given flag that would
    change training (:data:`CONFIG_FLAGS`, or ``--dtype bfloat16``) is an error naming the key to edit instead."""
    if config_path is None:
        opts = TrainOptions(**flags)
        return opts, build_config(opts)
    clash = [name for name in flags if name in CONFIG_FLAGS]
    if flags.get("dtype") == "bfloat16":
        clash.append("dtype")
    if clash:
        keys = {**CONFIG_FLAGS, "dtype": "bf16.enabled"}
        given = ", ".join(f"{flag(n)} (config key {keys[n]})" for n in clash)
        raise ValueError(
            f"--config {config_path} decides how the model trains: {given} cannot be given with it; "
            "edit the config instead, or drop --config to build one from the flags"
        )
    config = load_config(config_path)
    opts = TrainOptions(**flags)
    return opts, config


def degrees(config: dict[str, Any]) -> tuple[int, int]:
    """(pp, tp) of a DeepSpeed config, as ``llmpar.initialize`` reads it (the whole config is checked here, before
    any rank starts: a bad key is the runtime's error naming it)."""
    return Blocks.parse(config).degrees


def check_layout(opts: TrainOptions, *, pp: int, tp: int, world: int, from_config: bool = False) -> None:
    """The degrees fit the ranks and the model; a ValueError naming the flag (or config key) otherwise."""
    pp_name, tp_name = ("pipeline.stages", "tensor_parallel.size") if from_config else ("--pp", "--tp")
    if world % (pp * tp):
        what = f"{tp_name}={tp}" if pp == 1 else f"{pp_name}={pp} x {tp_name}={tp}"
        raise ValueError(
            f"{what} does not divide the {world} ranks; the ranks are " + ("dp x tp" if pp == 1 else "pp x dp x tp")
        )
    if opts.n_head % tp:
        raise ValueError(f"--n-head={opts.n_head} is not divisible by {tp_name}={tp} (heads are split over tp)")
    if opts.n_layer < pp:
        raise ValueError(f"--n-layer={opts.n_layer} blocks cannot fill {pp_name}={pp} pipeline stages")


__all__ = [
    "CONFIG_FLAGS",
    "MODEL_DTYPES",
    "SCHEDULES",
    "TrainOptions",
    "build_config",
    "check_layout",
    "degrees",
    "flag",
    "load_config",
    "resolve",
]
