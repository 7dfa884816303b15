"""CPU offload for ZeRO: where each kind of tensor lives, and the optimizer step on the host.

    offload_optimizer {device: cpu}: the gradient partition, fp32 master and moments live on the host; reduced grads
        are copied out as each unit's reduce-scatter finishes (stages 2/3: during backward; stage 1: at the
        accumulation boundary, from the device accumulator, which stays there), the step runs there with
        ``cpu_adamw_step`` on the fp32 masters (llmpar's vectorised, multi-threaded C++ CPU AdamW; torch's fused one
        where the CPU extension is unavailable; float64 masters: ``adamw_step``), and the params take the updated
        masters in their dtype (round to nearest: fp32_master's rounding). The kernel writes that copy in the same
        pass: straight into the param shards when they are in host memory (CPU runs, offload_param), else into a
        pinned staging buffer of the params' dtype that is then one non-blocking memcpy to the device (no cast pass).
    offload_param {device: cpu} (stage 3): the parameter shards live on the host; a gather copies the unit's shard in
        before its all-gather (the prefetch overlaps it with the previous unit's compute).

Copies are issued early (:class:`Copier`): the reduced gradient shard goes out to the host as soon as its unit's
reduce-scatter has finished (the reducer polls its in-flight reductions at every gradient hook), and a prefetched
unit's host shard comes in right before its all-gather. On CUDA both run on a side stream (non_blocking, an event
recorded per copy-out; the host step waits for those events first); on a CPU-only run the code path is the same minus
streams.

Host memory is pinned when ``pin_memory`` is set and CUDA is there. On a CPU-only run host and device are the same
memory, so "offload" only moves those tensors to a separate pool: :class:`Placement` records which pool each kind
is in, and ``ZeroOptimizer.memory_bytes()`` reports bytes per pool.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from llmpar.distributed.collectives import CommCounter, Group, GroupRef, Handle, all_gather_flat
from llmpar.ops.adamw import adamw_step
from llmpar.ops.cpu_adam import OUT_DTYPES, cpu_adamw_step
from llmpar.zero.config import OffloadConfig

KINDS = ("params", "grads", "master", "optimizer_state")


class Placement:
    """Pool ("device" or "host") of each tensor kind, and allocation in it."""

    def __init__(self, device: torch.device, *, offload_optimizer: OffloadConfig, offload_param: OffloadConfig) -> None:
        self.device = torch.device(device)
        self.host = torch.device("cpu")
        opt = "host" if offload_optimizer.enabled else "device"
        self.where = {
            "params": "host" if offload_param.enabled else "device",
            "grads": opt,
            "master": opt,
            "optimizer_state": opt,
        }
        self.pin = {
            "params": offload_param.pin_memory,
            "grads": offload_optimizer.pin_memory,
            "master": offload_optimizer.pin_memory,
            "optimizer_state": offload_optimizer.pin_memory,
        }
        self.offload_optimizer = offload_optimizer.enabled
        self.offload_param = offload_param.enabled

    def zeros(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.where[kind] == "device":
            return torch.zeros(numel, dtype=dtype, device=self.device)
        t = torch.zeros(numel, dtype=dtype, device=self.host)
        if self.pin[kind] and torch.cuda.is_available():
            t = t.pin_memory()
        return t


class Copier:
    """Host <-> device copies issued as early as possible: on a side CUDA stream with recorded events on CUDA, in
    line on the CPU. ``copies_out`` / ``copies_in`` count them (for tests)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._events: list = []
        self.copies_out = self.copies_in = 0

    def _side(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (host) <- ``src`` (device) now; :meth:`sync` before the host reads ``dst``."""
        self.copies_out += 1
        if self.stream is None:
            dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._side():
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        src.record_stream(self.stream)
        self._events.append(event)

    def sync(self) -> None:
        """Wait for every copy-out issued so far (the host step reads them next)."""
        for event in self._events:
            event.synchronize()
        self._events.clear()

    def gather_from_host(
        self, full: torch.Tensor, src: torch.Tensor, group: Group | GroupRef, counter: CommCounter | None
    ) -> Handle:
        """Copy the host shard ``src`` in and all-gather it into ``full`` (both on the side stream on CUDA)."""
        self.copies_in += 1
        staged = torch.empty(src.numel(), dtype=full.dtype, device=full.device)
        with self._side():
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))  # ``full`` was just (re)allocated
            staged.copy_(src, non_blocking=self.stream is not None)
            handle = all_gather_flat(full, staged, group, async_op=True, counter=counter)
        assert handle is not None  # async_op=True: the collective's Handle
        if self.stream is not None:
            staged.record_stream(self.stream)
        return handle


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The host step's dtype: float64 params keep float64, everything else steps in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def host_step_buffer(
    b: Any,
    shards: list[torch.Tensor],
    grads: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gscale: torch.Tensor | None,
    found_inf: torch.Tensor,
) -> None:
    """AdamW on flat buffer ``b``'s host masters, then this rank's param shards (device or host, any float dtype)
    take the new values (a skipped step leaves the masters as they were, so copying them back changes nothing)."""
    units = range(len(b.layout.units))
    masters = [b.layout.shard_of_partition(b.state["master"], u) for u in units]
    host = masters[0].device if masters else torch.device("cpu")
    m, v = ([b.layout.shard_of_partition(b.state[name], u) for u in units] for name in ("exp_avg", "exp_avg_sq"))
    gscale_h, found_h = None if gscale is None else gscale.to(host), found_inf.to(host)
    if masters and masters[0].dtype == grads[0].dtype == torch.float32:
        outs, staged = _copy_outs(shards)
        if cpu_adamw_step(
            masters,
            grads,
            m,
            v,
            b.steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            gscale=gscale_h,
            found_inf=found_h,
            outs=outs,
        ):
            for dst, src in zip(shards, masters if outs is None else staged or []):
                dst.copy_(src, non_blocking=True)
            return
    else:
        adamw_step(
            masters,
            grads,
            m,
            v,
            b.steps,
            precision="fp32",
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            gscale=gscale_h,
            found_inf=found_h,
        )
    for dst, src in zip(shards, masters):  # (a skipped step: the masters as they were)
        dst.copy_(src, non_blocking=dst.device.type != "cpu")


def _copy_outs(shards: list[torch.Tensor]) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """Where the host step writes the new params (``outs`` of cpu_adamw_step), and the host tensors to copy into the
    shards afterwards: (the shards, None) when they live in host memory; (a pinned staging buffer, the same) for
    bf16/fp16 shards on a device; (None, None) otherwise (fp32 shards on a device take the masters directly)."""
    if not shards or shards[0].dtype not in OUT_DTYPES or not all(t.is_contiguous() for t in shards):
        return None, None
    if shards[0].device.type == "cpu":
        return shards, None
    if shards[0].dtype == torch.float32:
        return None, None
    # freed right after the copies are issued: the caching host allocator holds the block until they have run
    stage = torch.empty(sum(t.numel() for t in shards), dtype=shards[0].dtype, pin_memory=torch.cuda.is_available())
    views = list(stage.split([t.numel() for t in shards]))
    return views, views


def memory_bytes(opt: Any) -> dict[str, int]:
    """Bytes ZeroOptimizer ``opt`` holds persistently, by kind ("params", "grads", "master", "optimizer_state") and
    by pool ("device", "host"), measured from the tensors themselves. Stage 3: "params" counts the frozen params'
    shards too, "persistent" the always-gathered units, "gathered_peak" the most gathered at once; "staging_peak":
    the gradient staging buckets in flight at most. Stage 1 with offload_optimizer: the gradient accumulator on the
    device, its reduced partition on the host (both "grads")."""
    out = {"params": 0, "grads": 0, "master": 0, "optimizer_state": 0, "device": 0, "host": 0}
    where = opt.placement.where

    def add(kind: str, t: torch.Tensor, pool: str | None = None) -> None:
        n = t.numel() * t.element_size()
        out[kind] += n
        out[pool or where[kind]] += n

    for b in opt.buffers:
        add("params", b.shard if b.shard is not None else b.flat)
        if b.host_grad is not None:
            add("grads", b.grad, "device")
            add("grads", b.host_grad)
        else:
            add("grads", b.grad)
        for name, t in b.state.items():
            add("master" if name == "master" else "optimizer_state", t)
    size = max(b.flat.element_size() for b in opt.buffers)
    out["staging_peak"] = opt.reducer.staging_peak * size
    for b in opt.frozen_buffers:  # stage 3 frozen params: their shards
        add("params", b.shard)
    if opt.stage3 is not None:  # gathered units: persistent ones always, the others while in use
        persistent = sum(opt.stage3._numel(k) for k in opt.stage3.persistent) * size
        out["persistent"] = persistent
        out["device"] += persistent
        out["gathered_peak"] = opt.stage3.peak_live_numel * size
    return out
