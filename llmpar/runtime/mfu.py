"""Throughput in the terms people compare training runs by: tokens/s, achieved TFLOP/s per device and MFU.

FLOPs per token (training: forward + backward), PaLM's convention (Chowdhery et al. 2022, appendix B), as torchtitan
counts it::

    6 * N + 12 * n_layer * d_model * seq

``N``: the parameters that take part in matmuls: all of the model's (shared ones once; a ZeRO-3 param by its
``ds_numel``, a tensor-parallel shard times the tp degree) except embedding tables used only for lookups (token and
position embeddings; a table tied to the output head counts, the head multiplies by it). The attention term is the
score and value matmuls of every layer, not halved for causal masking (as PaLM, Megatron and torchtitan report; a
kernel that skips the masked half does about half of it). ``n_layer`` / ``d_model`` come from the model's ``config``
(llmpar's GPT: ``n_layer`` / ``d_model``; transformers: ``num_hidden_layers`` / ``hidden_size``); a model without them
gets ``6 N`` alone. ``seq``: the length of the sequences of the batch.

MFU = achieved FLOP/s per device / the device's peak: bf16 dense (no sparsity) tensor-core peaks of
:data:`PEAK_BF16_TFLOPS` matched from the CUDA device's name, ``LLMPAR_PEAK_TFLOPS`` when set (any device), on the
CPU a measured float32 matmul peak (:func:`cpu_matmul_tflops`, once per process). Megatron reports ~47% MFU on
large GPT runs, torchtitan 33-39% in bf16.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch
from torch import nn

ENV_PEAK = "LLMPAR_PEAK_TFLOPS"
# bf16 dense tensor-core peak per device, TFLOP/s (NVIDIA data sheets); matched in order, first substring wins
PEAK_BF16_TFLOPS = (
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
)


def _positive(value: Any, name: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = -1.0
    if not (out > 0 and out != float("inf")):
        raise ValueError(f"{name}={value!r} must be a positive finite number")
    return out


def peak_tflops(device: torch.device | str, environ: Any = os.environ) -> tuple[float | None, str]:
    """(peak TFLOP/s of one ``device``, where it came from); (None, reason) for a GPU not in the table."""
    if environ.get(ENV_PEAK, "").strip():
        return _positive(environ[ENV_PEAK].strip(), ENV_PEAK), ENV_PEAK
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return peak_for_name(name)
    return cpu_matmul_tflops(), f"measured fp32 matmul on {torch.get_num_threads()} CPU threads"


def peak_for_name(name: str) -> tuple[float | None, str]:
    """The table's bf16 dense peak for a device called ``name`` ("NVIDIA H100 80GB HBM3" -> 989)."""
    upper = name.upper()
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in upper:
            return tflops, f"{key} bf16 dense"
    return None, f"no bf16 peak known for {name!r} (set {ENV_PEAK})"


@functools.lru_cache(maxsize=None)
def cpu_matmul_tflops(n: int = 512, repeats: int = 5) -> float:
    """Best of ``repeats`` timed ``n x n`` float32 matmuls on the CPU, in TFLOP/s (measured once per process)."""
    g = torch.Generator().manual_seed(0)  # not torch's global RNG: the first log line must not move the training's
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)  # random stream (dropout after a resume)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / max(best, 1e-9) / 1e12


def matmul_params(module: nn.Module, tp: int = 1) -> int:
    """``N`` of the module docstring: parameters (shared once, ``ds_numel`` under ZeRO-3, tensor-parallel shards
    times ``tp``) less embedding tables no other module uses."""
    counted: dict[int, int] = {}
    lookup: set[int] = set()
    used: set[int] = set()
    for m in module.modules():
        for p in m.parameters(recurse=False):
            n = int(getattr(p, "ds_numel", p.numel())) * (tp if getattr(p, "tensor_model_parallel", False) else 1)
            counted[id(p)] = n
            (lookup if isinstance(m, nn.Embedding) else used).add(id(p))
    return sum(n for k, n in counted.items() if k not in lookup or k in used)


def attention_dims(module: nn.Module) -> tuple[int, int] | None:
    """(n_layer, d_model) from ``module.config`` (llmpar GPT or transformers names), None when it has neither."""
    cfg = getattr(module, "config", None)
    layers = next((getattr(cfg, k) for k in ("n_layer", "num_hidden_layers", "n_layers") if hasattr(cfg, k)), None)
    width = next((getattr(cfg, k) for k in ("d_model", "hidden_size", "n_embd") if hasattr(cfg, k)), None)
    return (int(layers), int(width)) if isinstance(layers, int) and isinstance(width, int) else None


def flops_per_token(n_params: int, seq: int, dims: tuple[int, int] | None) -> float:
    """``6 N + 12 n_layer d_model seq`` (training FLOPs per token; ``6 N`` when ``dims`` is None)."""
    return 6.0 * n_params + (12.0 * dims[0] * dims[1] * seq if dims is not None else 0.0)


def batch_tokens(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(tokens, sequence length) of a model call: the first tensor among ``input_ids`` / ``idx`` / the positional
    arguments; integer ids ``[batch, seq]`` count every element, float inputs ``[..., features]`` one token per row
    (seq: the next-to-last dim, 1 for a 1-D or 2-D float input)."""
    first = next((t for t in (kwargs.get("input_ids"), kwargs.get("idx"), *args) if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return 0, 0
    if first.is_floating_point() or first.is_complex():
        rows = first.numel() // max(first.shape[-1], 1)
        return rows, first.shape[-2] if first.dim() >= 3 else 1
    return first.numel(), first.shape[-1]


class Throughput:
    """Tokens and time between two progress lines of an engine. :meth:`seen` counts each training forward's batch
    on this rank; :meth:`report` turns the window into ``tokens/s=..., TFLOP/s/device=..., MFU=..%`` and starts the
    next one. ``tokens_per_step`` (``engine.set_tokens_per_step``): the job's tokens per optimizer step, instead of
    this rank's count times ``data_ranks``. ``clock``: seconds (``time.perf_counter``; the window's end is when the
    host reaches the step's end, not a device sync). A bad ``LLMPAR_PEAK_TFLOPS`` raises here, at the engine's
    start on every rank."""

    def __init__(self, environ: Any = os.environ) -> None:
        if environ.get(ENV_PEAK, "").strip():
            _positive(environ[ENV_PEAK].strip(), ENV_PEAK)
        self.clock = time.perf_counter
        self.tokens = 0
        self.seq = 0
        self.steps = 0
        self.t0: float | None = None
        self.tokens_per_step: int | None = None
        self.n_params: int | None = None

    def seen(self, args: tuple, kwargs: dict) -> None:
        if self.t0 is None:
            self.t0 = self.clock()
        tokens, seq = batch_tokens(args, kwargs)
        self.tokens += tokens
        self.seq = seq or self.seq

    def report(
        self, module: nn.Module, *, tp: int, data_ranks: int, world: int, device: torch.device, seq_scale: int = 1
    ) -> str:
        """The window's figures as text ("" when no step was timed), and a fresh window from now. ``seq_scale``: how
        many ranks share one sequence (context parallelism: each forward sees 1/cp of it, the attention term is
        that of the whole sequence)."""
        now = self.clock()
        steps, tokens, t0 = self.steps, self.tokens, self.t0
        self.tokens, self.steps, self.t0 = 0, 0, now
        if t0 is None or steps == 0 or now <= t0:
            return ""
        total = self.tokens_per_step * steps if self.tokens_per_step is not None else tokens * data_ranks
        if total == 0:
            return ""
        if self.n_params is None:
            self.n_params = matmul_params(module, tp)
        return format_throughput(
            total / (now - t0),
            flops_per_token(self.n_params, (self.seq or 1) * seq_scale, attention_dims(module)),
            world,
            device,
        )


def format_throughput(tokens_per_s: float, flops_per_tok: float, world: int, device: torch.device) -> str:
    """``tokens/s=12345, TFLOP/s/device=123.4, MFU=45.6%`` (without MFU when the device's peak is unknown)."""
    achieved = tokens_per_s * flops_per_tok / max(world, 1) / 1e12
    peak, _ = peak_tflops(device)
    rate = f"{tokens_per_s:.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.3g}"
    text = f"tokens/s={rate}, TFLOP/s/device={achieved:.4g}"
    return text + (f", MFU={100 * achieved / peak:.3g}%" if peak else "")


__all__ = [
    "ENV_PEAK",
    "PEAK_BF16_TFLOPS",
    "Throughput",
    "attention_dims",
    "batch_tokens",
    "cpu_matmul_tflops",
    "flops_per_token",
    "format_throughput",
    "matmul_params",
    "peak_for_name",
    "peak_tflops",
]
