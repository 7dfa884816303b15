"""CPU offload for ZeRO: where each kind of tensor lives, and the optimizer step on the host.

    offload_optimizer {device: cpu}: the gradient partition, fp32 master and moments live on the host; reduced grads
        are copied out as each unit's reduce-scatter finishes (during backward), the step runs there with
        ``adamw_step(precision="fp32")`` on the masters (torch's fused, vectorised, multi-threaded CPU AdamW kernel),
        and the updated masters are copied back into the params' dtype (round to nearest: fp32_master's rounding).
    offload_param {device: cpu} (stage 3): the parameter shards live on the host; a gather copies the unit's shard in
        before its all-gather (the prefetch overlaps it with the previous unit's compute).

Host memory is pinned when ``pin_memory`` is set and CUDA is there. On a CPU-only run host and device are the same
memory, so "offload" only moves those tensors to a separate pool: :class:`Placement` records which pool each kind
is in, and ``ZeroOptimizer.memory_bytes()`` reports bytes per pool.
"""
from __future__ import annotations

import torch

from llmpar.ops.adamw import adamw_step
from llmpar.zero.config import OffloadConfig

KINDS = ("params", "grads", "master", "optimizer_state")


class Placement:
    """Pool ("device" or "host") of each tensor kind, and allocation in it."""

    def __init__(self, device: torch.device, *, offload_optimizer: OffloadConfig, offload_param: OffloadConfig) -> None:
        self.device = torch.device(device)
        self.host = torch.device("cpu")
        opt = "host" if offload_optimizer.enabled else "device"
        self.where = {"params": "host" if offload_param.enabled else "device", "grads": opt, "master": opt,
                      "optimizer_state": opt}
        self.pin = {"params": offload_param.pin_memory, "grads": offload_optimizer.pin_memory,
                    "master": offload_optimizer.pin_memory, "optimizer_state": offload_optimizer.pin_memory}
        self.offload_optimizer = offload_optimizer.enabled
        self.offload_param = offload_param.enabled

    def zeros(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.where[kind] == "device":
            return torch.zeros(numel, dtype=dtype, device=self.device)
        t = torch.zeros(numel, dtype=dtype, device=self.host)
        if self.pin[kind] and torch.cuda.is_available():
            t = t.pin_memory()
        return t


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The host step's dtype: float64 params keep float64, everything else steps in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def host_step(shards: list[torch.Tensor], masters: list[torch.Tensor], grads: list[torch.Tensor],
              exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *,
              lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              gscale: torch.Tensor | None, found_inf: torch.Tensor | None, skipped: bool) -> None:
    """AdamW on the host masters, then the params' shards (device or host, any float dtype) take the new values."""
    host = masters[0].device if masters else torch.device("cpu")
    adamw_step(masters, grads, exp_avgs, exp_avg_sqs, steps, precision="fp32", lr=lr, beta1=beta1, beta2=beta2,
               eps=eps, weight_decay=weight_decay, gscale=None if gscale is None else gscale.to(host),
               found_inf=None if found_inf is None else found_inf.to(host))
    if not skipped:
        for dst, src in zip(shards, masters):
            dst.copy_(src, non_blocking=dst.device.type != "cpu")
