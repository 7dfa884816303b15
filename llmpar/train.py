"""``llmpar train``: train the small GPT on the shipped text with data parallelism (2 CPU ranks by default).

    llmpar train                         # re-launches itself with torchrun on --nproc 2 ranks (gloo on CPU)
    torchrun --nproc_per_node 4 -m llmpar.cli train --steps 100

Gradient sync: with a dp group (every torchrun launch) the optimizer is ``llmpar.zero.ZeroOptimizer`` at stage 2:
gradient hooks reduce-scatter buckets of gradients during backward, each rank steps its fp32 partition with the
fused AdamW (clipping by the global norm inside), and the updated params are all-gathered. ``--tp N`` splits the model
over N ranks with ``llmpar.parallelize``; ZeRO then runs over the dp axis of the mesh (4 ranks, --tp 2: dp=2 x tp=2).
A single process without a group trains with plain AdamW.

Per step s (dp ranks r = 0..dp-1, batch B per rank, see llmpar.data.BatchLoader):
    x_r, y_r = loader.batch(s);  L_r = CE(model(x_r), y_r);  g = mean_r grad(L_r) = grad(mean_r L_r)
so N ranks with batch B train exactly like one process with batch N*B (tests/test_train.py checks this).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from llmpar.data import BatchLoader, ByteTokenizer, load_tokens
from llmpar.distributed import all_gather_flat, all_reduce, group_rank, group_size
from llmpar.distributed.collectives import Group
from llmpar.models import GPT, GPTConfig

logger = logging.getLogger("llmpar")

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MIN_DROP = 0.8  # the run fails unless final loss < MIN_DROP * first loss


@dataclass(kw_only=True)
class TrainConfig:
    """What ``llmpar train`` runs. ``batch_size`` is per dp rank; the global batch is ``batch_size * dp``."""

    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    seed: int = 0
    log_every: int = 10
    text: str = "shakespeare"
    dtype: str = "float32"
    tp: int = 1
    pp: int = 1
    micro_batches: int = 0  # pipeline micro-batches per step; 0: pp
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "n_layer", "n_head", "d_model", "log_every", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")
        if not self.lr > 0:
            raise ValueError(f"--lr={self.lr} must be positive")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps={self.warmup_steps} must be >= 0")
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype={self.dtype!r} is not one of {sorted(_DTYPES)}")

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(
            vocab_size=vocab_size, n_layer=self.n_layer, n_head=self.n_head, d_model=self.d_model,
            seq_len=self.seq_len, dropout=self.dropout,
        )

    def lr_at(self, step: int) -> float:
        """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""
        warm = min(self.warmup_steps, self.steps - 1)
        if step < warm:
            return self.lr * (step + 1) / warm
        frac = (step - warm) / max(1, self.steps - 1 - warm)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass(kw_only=True)
class TrainResult:
    """What a run produced. ``losses[s]`` is the global (dp-averaged) loss of step s."""

    losses: list[float]
    tokens_per_s: float
    wall_s: float
    mem_mb: list[float]  # peak memory of each dp rank, in dp-rank order
    mem_kind: str
    dp: int
    n_params: int
    sample: str = ""
    config: dict = field(default_factory=dict)

    @property
    def first_loss(self) -> float:
        return self.losses[0]

    @property
    def final_loss(self) -> float:
        """Mean of the last ~5% of the steps' losses (at least 1, at most 10)."""
        k = max(1, min(10, len(self.losses) // 20))
        return sum(self.losses[-k:]) / k

    @property
    def fell(self) -> bool:
        return self.final_loss < MIN_DROP * self.first_loss

    def summary(self) -> dict:
        out = asdict(self)
        out.update(first_loss=self.first_loss, final_loss=self.final_loss, fell=self.fell, min_drop=MIN_DROP)
        return out


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """This process's peak memory in MiB: CUDA max allocated on a GPU, else max RSS (getrusage, KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "max RSS"


def _gather_scalar(value: float, group: Group | None, device: torch.device) -> list[float]:
    if group is None:
        return [value]
    t = torch.tensor([value], dtype=torch.float64, device=device)
    out = torch.empty(group_size(group), dtype=torch.float64, device=device)
    all_gather_flat(out, t, group)
    return out.tolist()


def _sync_grads(params: list[torch.nn.Parameter], loss: torch.Tensor, group: Group | None) -> float:
    """Average the gradients (and the loss) over ``group`` in one all-reduce; returns the global loss."""
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1).to(params[0].grad.dtype)])
    if group is not None and group_size(group) > 1:
        all_reduce(flat, group, op="avg")
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
    return float(flat[-1])


def _param_groups(model: GPT, cfg: TrainConfig) -> list[dict]:
    """Weight decay on matrices only; (name, param) pairs so ZeRO can name them."""
    named = list(model.named_parameters())
    return [{"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def _global_loss(loss: torch.Tensor, group: Group) -> float:
    """The dp-averaged loss (one small all-reduce)."""
    t = loss.detach().reshape(1).clone()
    if group_size(group) > 1:
        all_reduce(t, group, op="avg")
    return float(t)


def _make_zero(model: GPT, cfg: TrainConfig, dp_group: Group, tp_group: Group | None):
    """ZeRO stage 2 over the dp group: reduce-scattered grads, partitioned fp32 state, all-gathered params."""
    from llmpar.zero import OptimizerConfig, ZeroConfig, ZeroOptimizer

    return ZeroOptimizer(_param_groups(model, cfg), OptimizerConfig(lr=cfg.lr, betas=(0.9, 0.95)), dp_group,
                         stage=2, zero_config=ZeroConfig(stage=2, overlap_comm=True, reduce_bucket_size=1 << 20),
                         tp_group=tp_group if tp_group is not None and group_size(tp_group) > 1 else None,
                         max_grad_norm=cfg.grad_clip if cfg.grad_clip > 0 else None)


def _make_optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), foreach=True)


def train(
    cfg: TrainConfig,
    *,
    dp_group: Group | None = None,
    tp_group: Group | None = None,
    mesh: Any = None,
    device: torch.device | str = "cpu",
    progress: bool = False,
    sample_chars: int = 0,
) -> tuple[GPT, TrainResult]:
    """Train the GPT of ``cfg`` on the shipped text; ``dp_group=None`` trains on this process alone.

    With ``tp_group`` (size > 1) the model's linears and embeddings are split over it by ``llmpar.parallelize``;
    tensor-parallel peers read the same batch (the loader is indexed by the dp rank only).

    Every rank of ``dp_group`` must call this with the same ``cfg``. Returns the trained model and the run's numbers.
    """
    device = torch.device(device)
    dp = group_size(dp_group) if dp_group is not None else 1
    dp_rank = group_rank(dp_group) if dp_group is not None else 0
    show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
    if cfg.dropout > 0:
        torch.manual_seed(cfg.seed * 7919 + dp_rank)  # dropout masks differ per rank, as they would with DDP

    tokenizer = ByteTokenizer()
    loader = BatchLoader(
        tokens=load_tokens(cfg.text), batch_size=cfg.batch_size, seq_len=cfg.seq_len,
        dp_rank=dp_rank, dp_size=dp, seed=cfg.seed,
    )
    model = GPT(cfg.model_config(tokenizer.vocab_size), seed=cfg.seed, device=device, dtype=_DTYPES[cfg.dtype])
    n_params = model.num_params()  # of the whole model, before any split
    tp = group_size(tp_group) if tp_group is not None else 1
    runner = None
    if cfg.pp > 1:  # stages over the mesh's pp axis, tensor-parallel inside each; grads averaged over dp
        from llmpar.pipeline import build_pipeline

        if mesh is None:
            raise ValueError(f"--pp={cfg.pp} needs mesh= (the [pp, dp, tp] mesh of llmpar.init_distributed)")
        runner = build_pipeline(model, mesh, model.loss, micro_batches=cfg.micro_batches or cfg.pp,
                                schedule=cfg.schedule, dp_group=dp_group, verbose=show)
        stage_model = torch.nn.ModuleList(runner.split.modules)  # this rank's stages, for the optimizer
    elif tp > 1:
        from llmpar.tensor_parallel import parallelize

        parallelize(model, tp_group)
    params = runner.parameters() if runner is not None else [p for p in model.parameters() if p.requires_grad]
    zero = _make_zero(model, cfg, dp_group, tp_group) if dp_group is not None and runner is None else None
    opt = zero if zero is not None else _make_optimizer(stage_model if runner is not None else model, cfg)
    tokens_per_step = cfg.batch_size * cfg.seq_len * dp

    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, desc=f"train dp={dp} tp={tp}", unit="step", dynamic_ncols=True, file=sys.stderr,
                   mininterval=0.5)
    losses: list[float] = []
    mem: list[float] = []
    t_start = time.perf_counter()
    t_after_first = t_start
    model.train()
    for step in range(cfg.steps):
        x, y = (t.to(device, non_blocking=True) for t in loader.batch(step))
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        opt.zero_grad(set_to_none=zero is not None)
        if runner is None:
            loss = model.loss(model(x), y)
            loss.backward()
        if runner is not None:  # pipeline: all micro-batches through the stages, plain AdamW on this rank's stages
            losses.append(runner.step(x, y))  # the dp-averaged loss; grads averaged over dp, tied ones over pp
            if cfg.grad_clip > 0:
                runner.clip_grad_norm_(cfg.grad_clip)  # norm of the whole model (over pp and tp)
            opt.step()
        elif zero is not None:  # ZeRO-2: grads were reduce-scattered during backward; clipping is inside step()
            losses.append(_global_loss(loss, dp_group))
            zero.step()
        else:  # one process: plain AdamW
            losses.append(_sync_grads(params, loss, dp_group))
            if cfg.grad_clip > 0 and tp > 1:
                from llmpar.tensor_parallel import clip_grad_norm_

                clip_grad_norm_(params, cfg.grad_clip, tp_group)  # the norm of the unsplit model, same on every rank
            elif cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
        if step == 0:
            t_after_first = time.perf_counter()  # the first step pays for warm-up; tokens/s leaves it out
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            mem_group = dist.group.WORLD if dist.is_initialized() and dp * tp * cfg.pp > 1 else None  # every rank's memory
            mem = _gather_scalar(peak_memory_mb(device)[0], mem_group, device)
            if bar is not None:
                elapsed = time.perf_counter() - t_after_first
                tps = tokens_per_step * step / elapsed if step > 0 and elapsed > 0 else float("nan")
                bar.set_postfix_str(
                    f"loss {losses[-1]:.3f} | {tps:,.0f} tok/s | mem " + " ".join(f"{m:.0f}" for m in mem) + " MiB"
                )
        if bar is not None:
            bar.update(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_end = time.perf_counter()
    if bar is not None:
        bar.close()
    timed = t_end - t_after_first
    tps = tokens_per_step * (cfg.steps - 1) / timed if cfg.steps > 1 and timed > 0 else tokens_per_step / (t_end - t_start)

    text = ""
    if sample_chars > 0 and dp_rank == 0 and runner is None:  # with pp a rank holds only its stages
        model.eval()
        prompt = tokenizer.encode("\n").view(1, -1).to(device)
        gen = torch.Generator().manual_seed(cfg.seed)
        text = tokenizer.decode(model.generate(prompt, sample_chars, temperature=0.8, generator=gen)[0, 1:].cpu())
        model.train()
    result = TrainResult(
        losses=losses, tokens_per_s=tps, wall_s=t_end - t_start, mem_mb=mem, mem_kind=peak_memory_mb(device)[1],
        dp=dp, n_params=n_params, sample=text, config=asdict(cfg),
    )
    return model, result


def format_summary(r: TrainResult) -> str:
    verdict = (
        f"PASS: loss fell from {r.first_loss:.3f} to {r.final_loss:.3f} ({100 * r.final_loss / r.first_loss:.0f}% of start)"
        if r.fell
        else f"FAIL: loss went from {r.first_loss:.3f} to {r.final_loss:.3f}, "
        f"not below {100 * MIN_DROP:.0f}% of start"
    )
    mem = ", ".join(f"rank {i}: {m:.0f} MiB" for i, m in enumerate(r.mem_mb))
    lines = [
        "",
        f"== llmpar train: GPT {r.n_params / 1e6:.2f}M params, dp={r.dp}, tp={r.config.get('tp', 1)}, pp={r.config.get('pp', 1)}, {len(r.losses)} steps ==",
        f"first loss      {r.first_loss:.4f}",
        f"final loss      {r.final_loss:.4f}  (mean of the last {max(1, min(10, len(r.losses) // 20))} steps)",
        f"throughput      {r.tokens_per_s:,.0f} tokens/s (all ranks, after step 1)",
        f"peak memory     {mem}  ({r.mem_kind})",
        f"wall time       {r.wall_s:.1f} s",
    ]
    if r.sample:
        lines += ["sample          " + r.sample.replace("\n", "\n                ")]
    lines.append(verdict)
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train the small GPT on the shipped text (data parallel)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainConfig()
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch with torchrun when not already under it (default 2)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per dp rank per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (warm-up, then cosine decay)")
    p.add_argument("--n-layer", type=int, default=d.n_layer)
    p.add_argument("--n-head", type=int, default=d.n_head)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress-bar updates")
    p.add_argument("--text", default=d.text, help="shipped text to train on")
    p.add_argument("--dtype", default=d.dtype, choices=sorted(_DTYPES))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu uses gloo, cuda uses nccl")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree; the ranks are pp x dp x tp")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (stages)")
    p.add_argument("--micro-batches", type=int, default=0, help="pipeline micro-batches per step (default: pp)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b"),
                   help="pipeline schedule")
    p.add_argument("--sample", type=int, default=200, help="characters to sample after training (0: none)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON to PATH")
    p.set_defaults(func=main)


_CONFIG_FLAGS = ("steps", "batch_size", "seq_len", "lr", "n_layer", "n_head", "d_model", "seed", "log_every",
                 "text", "dtype", "tp", "pp", "micro_batches", "schedule")
_OTHER_FLAGS = ("device", "sample", "json")  # not --nproc: torchrun's parser would call it ambiguous


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{k: getattr(args, k) for k in _CONFIG_FLAGS})


def _relaunch(args: argparse.Namespace) -> int:
    """Run this same command on ``args.nproc`` local ranks through PyTorch's launcher (torch.distributed.run)."""
    argv = []
    for k in _CONFIG_FLAGS + _OTHER_FLAGS:
        value = getattr(args, k)
        if value is not None:
            argv += [f"--{k.replace('_', '-')}", str(value)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           "-m", "llmpar.cli", "train", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    logger.info("launching %d ranks: %s", args.nproc, " ".join(cmd))
    return subprocess.call(cmd, env=env)


def _setup_logging(rank: int) -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``llmpar train``: validate, re-launch under torchrun if needed, train, summarise."""
    under_torchrun = "RANK" in os.environ
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    _setup_logging(int(os.environ.get("RANK", "0")))
    try:
        cfg = _config_from_args(args)
        if args.nproc < 1:
            raise ValueError(f"--nproc={args.nproc} must be >= 1")
        world = int(os.environ.get("WORLD_SIZE", args.nproc if not under_torchrun else 1))
        if world % (cfg.tp * cfg.pp):
            raise ValueError(f"--pp={cfg.pp} x --tp={cfg.tp} does not divide the {world} ranks; the ranks are "
                             "pp x dp x tp")
        if world % cfg.tp:
            raise ValueError(f"--tp={cfg.tp} does not divide the {world} ranks; the ranks are dp x tp")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available; use --device cpu")
    except ValueError as err:
        print(f"llmpar train: error: {err}", file=sys.stderr)
        return 2
    if not under_torchrun and args.nproc > 1:
        return _relaunch(args)

    import llmpar

    env = llmpar.init_distributed(backend="nccl" if args.device == "cuda" else "gloo", tp=cfg.tp, pp=cfg.pp)
    try:
        assert env.mesh is not None
        dp_group = env.mesh["dp"] if env.world_size > 1 else None
        tp_group = env.mesh["tp"] if cfg.tp > 1 else None
        if env.is_main:
            logger.info("llmpar train: %d rank(s), backend %s, device %s, %d threads/rank",
                        env.world_size, env.backend, env.device, torch.get_num_threads())
        _, result = train(cfg, dp_group=dp_group, tp_group=tp_group, mesh=env.mesh, device=env.device, progress=True, sample_chars=args.sample)
        if env.is_main:
            logger.info(format_summary(result))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result.summary(), f, indent=2)
                logger.info("summary written to %s", args.json)
        return 0 if result.fell else 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
