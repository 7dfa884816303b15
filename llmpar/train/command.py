"""``llmpar train``: train the small GPT on the shipped text through ``llmpar.initialize``, the engine user code gets.

    llmpar train                                    # 2 CPU ranks (re-launches itself under torchrun): dp=2, ZeRO-2
    llmpar train --nproc 4 --pp 2 --tp 2 --zero 1   # pp=2 x tp=2 pipeline engine, ZeRO-1 inside each stage
    llmpar train --nproc 4 --tp 2 --bf16 --offload  # dp=2 x tp=2, bf16 with fp32 masters, optimizer on the CPU
    llmpar train --config ds.json                   # your DeepSpeed JSON instead of the training flags
    llmpar train --print-config                     # the DeepSpeed config the flags build, then exit
    torchrun --nproc_per_node 4 -m llmpar.cli train --steps 100
    llmpar launch --launcher slurm --num_nodes 2 --num_gpus 4 --module llmpar.cli train   # srun: each task a rank

The training flags build one DeepSpeed config (batch, accumulation, AdamW, WarmupCosineLR, clipping, ZeRO stage and
offload, bf16, "pipeline", "tensor_parallel"); ``llmpar.initialize`` turns it into the engine, which reduces the
gradients, clips, schedules the LR and steps. This command only builds the GPT, feeds each dp rank its rows of the
step's batch, and reports. ``--config`` reads a user's config instead; then the training flags must not be given
(an error names the config key to edit); --steps and the model flags still apply.

Per step (micro batch B = train_micro_batch_size_per_gpu, G = gradient_accumulation_steps, dp ranks): each dp rank
reads B * G rows; the step's mean loss over all dp * B * G rows is reported. So N dp ranks with batch B train exactly
like one process with batch N * B (tests/test_train.py checks this). The run passes if the final loss (mean of the
last ~5% of steps) is below 80% of the first step's; exit status 0 PASS, 3 FAIL, 2 bad flags or config.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist

from llmpar.launcher_env import discover
from llmpar.train.loop import ConfigError, format_summary, train
from llmpar.train.options import MODEL_DTYPES, SCHEDULES, TrainOptions, check_layout, degrees, flag, resolve

logger = logging.getLogger("llmpar")

# option names (TrainOptions fields) the parser fills; every flag defaults to None, so "given" means "not None"
_OPTION_FLAGS = (
    "steps",
    "seq_len",
    "n_layer",
    "n_head",
    "d_model",
    "seed",
    "text",
    "dtype",
    "log_every",
    "batch_size",
    "grad_accum",
    "lr",
    "weight_decay",
    "warmup_steps",
    "grad_clip",
    "zero",
    "offload",
    "bf16",
    "tp",
    "pp",
    "schedule",
    "print_every",
)
_OTHER_FLAGS = ("config", "device", "sample", "json")  # not --nproc: torchrun's parser would call it ambiguous


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train`` to the ``llmpar`` command."""
    parser = subparsers.add_parser(
        "train",
        help="train the small GPT on the shipped text through llmpar.initialize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = TrainOptions()

    def opt(name: str, help: str, **kw: Any) -> None:
        default = kw.pop("shown", getattr(d, name, None))
        t.add_argument(flag(name), dest=name, default=None, help=f"{help} (default {default})", **kw)

    parser.add_argument(
        "--nproc", type=int, default=2, help="ranks to launch with torchrun when not already under it (default 2)"
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="DS.JSON",
        help="a DeepSpeed JSON config for llmpar.initialize; the training flags below (batch, optimizer, "
        "schedule, clipping, ZeRO, bf16, tp, pp) must then not be given",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the DeepSpeed config this command line runs, and exit"
    )
    g = parser.add_argument_group("run and model (also with --config)")
    for name, kind, text in (
        ("steps", int, "optimizer steps"),
        ("seq_len", int, "tokens per sequence"),
        ("n_layer", int, "transformer blocks"),
        ("n_head", int, "attention heads"),
        ("d_model", int, "hidden size"),
        ("seed", int, "weights and batches seed"),
        ("log_every", int, "steps between progress-bar updates"),
    ):
        g.add_argument(flag(name), dest=name, type=kind, default=None, help=f"{text} (default {getattr(d, name)})")
    g.add_argument("--text", default=None, help=f"shipped text to train on (default {d.text})")
    g.add_argument(
        "--dtype",
        default=None,
        choices=MODEL_DTYPES,
        help="model dtype; bfloat16 is the config's bf16 (fp32 master weights) (default float32)",
    )
    g.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu uses gloo, cuda uses nccl")
    g.add_argument("--sample", type=int, default=200, help="characters to sample after training (0: none)")
    g.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON to PATH")
    t = parser.add_argument_group("training: these build the DeepSpeed config (not with --config)")
    opt("batch_size", "train_micro_batch_size_per_gpu: sequences per dp rank per micro step", type=int)
    opt(
        "grad_accum",
        "gradient_accumulation_steps; with --pp the pipeline micro-batches per step",
        type=int,
        shown="1, or pp with --pp",
    )
    t.add_argument("--micro-batches", dest="grad_accum", type=int, default=None, help="same as --grad-accum")
    opt("lr", "AdamW peak learning rate (linear warm-up, cosine decay to 0.1 x lr)", type=float)
    opt("weight_decay", "AdamW weight decay (on matrices)", type=float)
    opt("warmup_steps", "WarmupCosineLR warm-up steps", type=int)
    opt("grad_clip", "gradient_clipping: max global gradient norm, 0 for none", type=float)
    opt("zero", "zero_optimization.stage, 0-3 (pipelines: 0-2)", type=int, shown="2, or 1 with --pp")
    opt("offload", "zero_optimization.offload_optimizer to the CPU (stage 1, 2 or 3)", action="store_true")
    opt("bf16", "bf16.enabled: bfloat16 model, fp32 master weights", action="store_true")
    opt("tp", "tensor-parallel degree; the ranks are pp x dp x tp", type=int)
    opt("pp", "pipeline-parallel degree (stages)", type=int)
    opt("schedule", "pipeline schedule", choices=SCHEDULES, shown="1f1b")
    opt("print_every", "steps_per_print: the engine logs lr and grad norm every N steps", type=int)
    parser.set_defaults(func=main)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _OPTION_FLAGS if getattr(args, k, None) is not None}


def _relaunch(args: argparse.Namespace) -> int:
    """Run this same command on ``args.nproc`` local ranks through PyTorch's launcher (torch.distributed.run)."""
    argv: list[str] = []
    for k in _OPTION_FLAGS + _OTHER_FLAGS:
        value = getattr(args, k)
        if value is True:
            argv.append(flag(k))
        elif value is not None and value is not False:
            argv += [flag(k), str(value)]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
        "-m",
        "llmpar.cli",
        "train",
        *argv,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    logger.info("launching %d ranks: %s", args.nproc, " ".join(cmd))
    with tempfile.TemporaryDirectory(prefix="llmpar-train-") as status:
        env[_STATUS_ENV] = status
        code = subprocess.call(cmd, env=env)
        return _ranks_status(status, args.nproc, code)


_STATUS_ENV = "LLMPAR_TRAIN_STATUS_DIR"  # set by _relaunch: each rank writes its exit status there


def _ranks_status(folder: str, nproc: int, launcher_code: int) -> int:
    """This command's exit status from its ranks' (torchrun exits 1 whenever a rank fails, whatever its status): a
    rank's 2 (bad flags or config) before a 3 (FAIL); the launcher's own status when a rank left none (it crashed)."""
    codes = []
    for rank in range(nproc):
        try:
            with open(os.path.join(folder, f"rank{rank}")) as f:
                codes.append(int(f.read()))
        except (OSError, ValueError):
            return launcher_code
    for wanted in (2, 3):
        if wanted in codes:
            return wanted
    return launcher_code if launcher_code else max(codes)


def _setup_logging(rank: int) -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def _error(err: BaseException) -> int:
    print(f"llmpar train: error: {err}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """Entry point of ``llmpar train``: validate, re-launch under torchrun if needed, train, summarise.

    Exit status: 0 PASS, 3 FAIL (the loss did not fall below 80% of its start), 2 a bad command line or config;
    re-launched on ``--nproc`` ranks, the ranks' status (a rank's 2 first), not torchrun's 1.
    The process group is torn down at the end only if this call created it."""
    code = _main(args)
    folder = os.environ.get(_STATUS_ENV)
    rank = os.environ.get("RANK")
    if folder and rank is not None and os.path.isdir(folder):
        with open(os.path.join(folder, f"rank{int(rank)}"), "w") as f:
            f.write(str(code))
    return code


def _main(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    try:  # started by torchrun, srun or mpirun (llmpar launch): a rank of that job, else this command launches
        launch = discover()
    except ValueError as err:
        return _error(err)
    under_launcher, rank = launch.source != "none", launch.rank
    _setup_logging(rank)
    try:
        if args.nproc < 1:
            raise ValueError(f"--nproc={args.nproc} must be >= 1")
        opts, config = resolve(_given(args), args.config)
        if args.print_config:
            if rank == 0:
                print(json.dumps(config, indent=2))
            return 0
        pp, tp = degrees(config)
        world = launch.world_size if under_launcher else args.nproc
        check_layout(opts, pp=pp, tp=tp, world=world, from_config=args.config is not None)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available; use --device cpu")
    except (ValueError, TypeError) as err:
        return _error(err)
    if not under_launcher and args.nproc > 1:
        return _relaunch(args)

    owns_group = not dist.is_initialized()
    try:
        try:
            _, result = train(
                opts,
                config,
                backend="nccl" if args.device == "cuda" else "gloo",
                progress=True,
                sample_chars=args.sample,
            )
        except ConfigError as err:  # raised alike on every rank
            return _error(err) if rank == 0 else 2
        if rank == 0:
            logger.info(format_summary(result))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result.summary(), f, indent=2)
                logger.info("summary written to %s", args.json)
        return 0 if result.fell else 3
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["main", "register"]
