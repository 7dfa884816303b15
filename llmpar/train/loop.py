"""The run of ``llmpar train``: the demo GPT on the shipped text, trained by the engine ``llmpar.initialize`` returns.

    model = GPT(...)
    engine = llmpar.initialize(model=model, config=config, model_parameters=groups)[0]   # mesh, split, ZeRO
    with a "pipeline" block:  loss = engine.train_batch(x, y)          # x, y: [micro * gas, T], this dp rank's rows
    without:                  gas x (loss = model.loss(engine(x_i), y_i); engine.backward(loss); engine.step())

Gradient reduction, clipping, the LR schedule, ZeRO, offload and bf16 are the engine's; this file only feeds batches
and reports. Per step s, dp rank r reads rows [r * micro * gas, (r + 1) * micro * gas) of the step's global batch
(``llmpar.data.BatchLoader``), so N dp ranks with micro batch B train like one process with micro batch N * B (the
engine averages gradients over dp); the reported loss is the step's mean over all its rows (one all-reduce over dp).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from llmpar.data import BatchLoader, ByteTokenizer, load_tokens
from llmpar.distributed import all_gather_flat, all_reduce
from llmpar.models import GPT
from llmpar.runtime import mfu
from llmpar.train.options import TrainOptions, build_config, check_layout, degrees

logger = logging.getLogger("llmpar")

MIN_DROP = 0.8  # the run fails unless final loss < MIN_DROP * first loss


class ConfigError(ValueError):
    """``llmpar.initialize`` rejected the DeepSpeed config (the same on every rank: no collective is left hanging)."""


@dataclass(kw_only=True)
class TrainResult:
    """What a run produced. ``losses[s]`` is the global (dp-averaged) loss of step s."""

    losses: list[float]
    tokens_per_s: float
    wall_s: float
    mem_mb: list[float]  # peak memory of every rank, in global rank order
    mem_kind: str
    dp: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    dtype: str = "float32"
    engine: str = "Engine"
    micro_batch: int = 1
    grad_accum: int = 1
    n_params: int = 0
    tflops_per_device: float = 0.0  # tokens_per_s x FLOPs per token / ranks (llmpar.runtime.mfu's count)
    peak_tflops: float | None = None  # one device's peak (None: unknown, peak_source says why)
    peak_source: str = ""
    sample: str = ""
    config: dict = field(default_factory=dict)  # {"deepspeed": the config initialize got, "options": the rest}

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

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: achieved / peak TFLOP/s per device (None when the peak is unknown)."""
        return self.tflops_per_device / self.peak_tflops if self.peak_tflops else None

    def summary(self) -> dict:
        out = asdict(self)
        out.update(
            first_loss=self.first_loss, final_loss=self.final_loss, fell=self.fell, min_drop=MIN_DROP, mfu=self.mfu
        )
        return out


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """This process's peak memory in MiB: CUDA max allocated on a GPU, else max RSS (getrusage, KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "max RSS"


def _gather_memory(device: torch.device) -> list[float]:
    """Every rank's peak memory (MiB), in global rank order (a collective over the whole job)."""
    value = peak_memory_mb(device)[0]
    if dist.get_world_size() == 1:
        return [value]
    out = torch.empty(dist.get_world_size(), dtype=torch.float64, device=device)
    all_gather_flat(out, torch.tensor([value], dtype=torch.float64, device=device), dist.group.WORLD)
    return out.tolist()


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Weight decay on matrices only (the config's ``weight_decay``), none on biases and norms; (name, param) pairs
    so ZeRO can name them in checkpoints."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [(n, p) for n, p in named if p.dim() >= 2]},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def _initialize(model: GPT, config: dict) -> Any:
    """The engine ``llmpar.initialize`` builds for ``config``: it makes the mesh of the pipeline / tensor_parallel
    blocks and splits the model (stages, tensor-parallel layers) itself."""
    import llmpar

    try:
        return llmpar.initialize(model=model, config=config, model_parameters=param_groups(model))[0]
    except (ValueError, TypeError) as err:
        raise ConfigError(f"llmpar.initialize rejected the config: {err}") from err


def _micro_steps(engine: Any, x: torch.Tensor, y: torch.Tensor, gas: int) -> torch.Tensor:
    """One optimizer step of the plain engine: ``gas`` micro-batches; returns this rank's mean loss (float64)."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    cp = getattr(engine, "context_parallel", None)  # the engine shards the batch and computes the loss itself
    for xi, yi in zip(x.chunk(gas), y.chunk(gas)):
        loss = engine(xi, yi) if cp is not None else GPT.loss(engine(xi), yi)
        engine.backward(loss)
        engine.step()
        total += loss.detach().to(torch.float64)
    return total / gas


def train(
    opts: TrainOptions,
    config: dict | None = None,
    *,
    backend: str | None = None,
    progress: bool = False,
    sample_chars: int = 0,
) -> tuple[Any, TrainResult]:
    """Train the GPT of ``opts`` with the engine of ``config`` (default: :func:`build_config` of ``opts``).

    Joins (or adopts) the job through ``llmpar.init_distributed``; a plain process is a world of one. Every rank must
    call this with the same arguments. Returns the engine and the run's numbers (complete on global rank 0).
    """
    import llmpar

    config = build_config(opts) if config is None else config
    pp, tp = degrees(config)
    env = llmpar.init_distributed(backend=backend)  # the default group: initialize builds the mesh it needs
    check_layout(opts, pp=pp, tp=tp, world=env.world_size)
    device = env.device
    show = progress and env.is_main
    tokenizer = ByteTokenizer()
    model = GPT(
        opts.model_config(tokenizer.vocab_size), seed=opts.seed, device=device, dtype=getattr(torch, opts.model_dtype)
    )
    n_params = model.num_params()  # of the whole model, before any split
    per_token = mfu.flops_per_token(mfu.matmul_params(model), opts.seq_len, mfu.attention_dims(model))
    engine = _initialize(model, config)
    dp, dp_rank, dp_group = engine.dp_world_size, engine.dp_rank, engine.optimizer.dp_group
    if opts.dropout > 0:
        torch.manual_seed(opts.seed * 7919 + dp_rank)  # dropout masks differ per dp rank, as they would with DDP
    pipeline = engine.config.pipeline is not None
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    stage = engine.zero_optimization_stage()
    bf16 = engine.bfloat16_enabled()
    loader = BatchLoader(
        tokens=load_tokens(opts.text),
        batch_size=micro * gas,
        seq_len=opts.seq_len,
        dp_rank=dp_rank,
        dp_size=dp,
        seed=opts.seed,
    )
    tokens_per_step = micro * gas * dp * opts.seq_len

    bar, redirect = None, contextlib.nullcontext()
    if show:
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        bar = tqdm(
            total=opts.steps,
            desc=f"train dp={dp} tp={tp} pp={pp} zero={stage}",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=0.5,
        )
        redirect = logging_redirect_tqdm(loggers=[logger])  # the engine's steps_per_print lines above the bar
    losses: list[float] = []
    mem: list[float] = []
    t_start = time.perf_counter()
    t_after_first = t_start
    engine.train()
    with redirect:
        for step in range(opts.steps):
            x, y = (t.to(device, non_blocking=True) for t in loader.batch(step))
            if pipeline:
                losses.append(float(engine.train_batch(x, y)))  # already the mean over dp
            else:
                loss = _micro_steps(engine, x, y, gas).reshape(1)
                if dp > 1:
                    all_reduce(loss, dp_group, op="avg")
                losses.append(float(loss))
            if step == 0:
                t_after_first = time.perf_counter()  # the first step pays for warm-up; tokens/s leaves it out
            if (step + 1) % opts.log_every == 0 or step + 1 == opts.steps:
                mem = _gather_memory(device)
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
    tps = (
        tokens_per_step * (opts.steps - 1) / timed
        if opts.steps > 1 and timed > 0
        else tokens_per_step / (t_end - t_start)
    )
    peak, peak_source = mfu.peak_tflops(device)
    text = (
        _sample(engine.module, tokenizer, opts.seed, sample_chars, device)
        if sample_chars > 0 and not pipeline and (dp_rank == 0 or stage == 3)
        else ""
    )
    result = TrainResult(
        losses=losses,
        tokens_per_s=tps,
        wall_s=t_end - t_start,
        mem_mb=mem,
        mem_kind=peak_memory_mb(device)[1],
        dp=dp,
        tp=tp,
        pp=pp,
        zero_stage=stage,
        dtype="bfloat16" if bf16 else opts.model_dtype,
        engine=type(engine).__name__,
        micro_batch=micro,
        grad_accum=gas,
        n_params=n_params,
        sample=text,
        tflops_per_device=tps * per_token / env.world_size / 1e12,
        peak_tflops=peak,
        peak_source=peak_source,
        config={"deepspeed": config, "options": asdict(opts)},
    )
    return engine, result


def _sample(model: GPT, tokenizer: ByteTokenizer, seed: int, chars: int, device: torch.device) -> str:
    """``chars`` bytes sampled after a newline (temperature 0.8). Every rank holding a piece of the model calls it:
    tp peers together, and under ZeRO-3 all dp ranks (their forward gathers the params)."""
    model.eval()
    prompt = tokenizer.encode("\n").view(1, -1).to(device)
    gen = torch.Generator().manual_seed(seed)
    text = tokenizer.decode(model.generate(prompt, chars, temperature=0.8, generator=gen)[0, 1:].cpu())
    model.train()
    return text


def format_summary(r: TrainResult) -> str:
    """The end-of-run report: losses, throughput, memory per rank, sample and the PASS/FAIL verdict."""
    verdict = (
        f"PASS: loss fell from {r.first_loss:.3f} to {r.final_loss:.3f} ({100 * r.final_loss / r.first_loss:.0f}% of "
        "start)"
        if r.fell
        else f"FAIL: loss went from {r.first_loss:.3f} to {r.final_loss:.3f}, not below {100 * MIN_DROP:.0f}% of start"
    )
    mem = ", ".join(f"rank {i}: {m:.0f} MiB" for i, m in enumerate(r.mem_mb))
    offload = "offload_optimizer" in r.config.get("deepspeed", {}).get("zero_optimization", {})
    lines = [
        "",
        f"== llmpar train: GPT {r.n_params / 1e6:.2f}M params, dp={r.dp}, tp={r.tp}, pp={r.pp}, "
        f"ZeRO-{r.zero_stage}{' + offload' if offload else ''}, {r.dtype}, {len(r.losses)} steps ==",
        f"engine          llmpar.initialize -> {r.engine}: micro batch {r.micro_batch} x accumulation {r.grad_accum} "
        f"x dp {r.dp} = {r.micro_batch * r.grad_accum * r.dp} sequences/step",
        f"first loss      {r.first_loss:.4f}",
        f"final loss      {r.final_loss:.4f}  (mean of the last {max(1, min(10, len(r.losses) // 20))} steps)",
        f"throughput      {r.tokens_per_s:,.0f} tokens/s (all ranks, after step 1), {r.tflops_per_device:.4g} TFLOP/s "
        "per device"
        + (
            f", MFU {100 * r.mfu:.3g}% of {r.peak_tflops:.4g} TFLOP/s ({r.peak_source})"
            if r.mfu is not None
            else f" (MFU: {r.peak_source})"
        ),
        f"peak memory     {mem}  ({r.mem_kind})",
        f"wall time       {r.wall_s:.1f} s",
    ]
    if r.sample:
        lines += ["sample          " + r.sample.replace("\n", "\n                ")]
    lines.append(verdict)
    return "\n".join(lines)


__all__ = ["ConfigError", "MIN_DROP", "TrainResult", "format_summary", "param_groups", "peak_memory_mb", "train"]
