"""Gradient hooks and bucketed reduction for ZeRO stages 0-2 (the backward half of :class:`ZeroOptimizer`).

Every trainable param gets a post-accumulate-grad hook. When the last param of a unit (see ``layout.py``) has its
gradient, the unit's grads are packed (one fused ``pack_bucket``, times 1/dp, cast) and reduced asynchronously while
backward goes on (``overlap_comm``; otherwise the reduction is waited for at once):

    stage 0: pack into the full accumulator unit ``[padded]``; at the accumulation boundary all-reduce it in place
    stage 1: same accumulator; at the boundary reduce-scatter it, this rank's reduced shard written back in place
             (offload_optimizer: copied out to the host partition instead, as each unit's reduction lands)
    stage 2: pack into a staging bucket, reduce-scatter it straight into (or add it to) the partition accumulator
             ``[partition]`` at every micro-step; the param grads and the bucket are freed at once

A callback queued on the autograd engine runs at the end of each backward: it flushes units some of whose params got
no gradient (unused params count as zero, as in DeepSpeed), waits for every reduction and finishes the accumulation.
Ranks must see the same set of used params (the units are reduced in readiness order, which must match across ranks).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from llmpar.distributed.collectives import (
    CommCounter,
    Group,
    GroupRef,
    Handle,
    all_reduce,
    reduce_scatter_flat,
    reduce_scatter_scratch_numel,
    reduce_scatter_uses_exchange,
)
from llmpar.ops.bucket import pack_bucket
from llmpar.zero.compressed import GradQuantizer
from llmpar.zero.layout import FlatLayout
from llmpar.zero.scratch import ScratchPool


@dataclass(kw_only=True)
class FlatBuffer:
    """One buffer key's tensors: the layout, the params (views into ``flat``), partition state and accumulator."""

    key: tuple
    group_index: int
    tp_split: bool
    layout: FlatLayout
    params: list[torch.nn.Parameter]
    mode: str
    flat: torch.Tensor  # [total] params, dtype of the params
    grad: torch.Tensor  # stage 0/1: [total] accumulator; stage 2: [partition]
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [partition]
    steps: list[torch.Tensor] = field(default_factory=list)  # one float32 scalar per unit
    pending: list[int] = field(default_factory=list)  # per unit: params still to deliver a grad this backward
    seen: list[set] = field(default_factory=list)
    shard: torch.Tensor | None = None  # stage 3: this rank's [partition] of the params (host pool under offload_param)
    frozen: bool = False  # stage 3 frozen params: sharded and gathered, never reduced or stepped (no grad, no state)
    host_grad: torch.Tensor | None = None  # stage 1 + offload_optimizer: [partition] on the host, the reduced grads


class _WeakHook:
    """The param hook, holding its reducer weakly: params -> hook -> reducer -> params would be a reference cycle that
    outlives the process group until the interpreter's last collection (and can abort the exit on gloo)."""

    def __init__(self, reducer: "GradReducer") -> None:
        self._ref = weakref.ref(reducer)

    def __call__(self, p: torch.Tensor) -> None:
        reducer = self._ref()
        if reducer is not None:
            reducer._hook(p)


class GradReducer:
    """Owns the hooks and the in-flight reductions of a set of :class:`FlatBuffer`s."""

    def __init__(
        self,
        buffers: list[FlatBuffer],
        *,
        stage: int,
        dp_group: Group | GroupRef,
        dp: int,
        rank: int,
        overlap: bool,
        reduce_dtype_of: Callable[[FlatBuffer], torch.dtype],
        counter: CommCounter | None,
        inflight_budget: int = 0,
        copier: Any = None,
        quantizer: GradQuantizer | None = None,
        keep_scratch: bool = True,
    ) -> None:
        self.buffers = buffers
        self.stage = stage
        self.group = dp_group
        self.dp = dp
        self.scale = 1.0 / dp  # grads are averaged over dp (expert params: over all dp ranks, not edp: ``experts.py``)
        self.rank = rank if stage > 0 else 0  # stage 0 layouts have one shard
        self.overlap = overlap
        self.counter = counter
        self.reduce_dtype_of = reduce_dtype_of
        # gloo: reduce_scatter_flat runs as a direct exchange + local sum, holding the received chunks while in flight
        self.exchange = reduce_scatter_uses_exchange(dp_group, buffers[0].flat.device if buffers else "cpu")
        self.copier = copier  # offload_optimizer: offload.Copier taking each reduced shard out to the host
        self.quantizer = quantizer  # zero_quantized_gradients (stage 2/3): packed + quantized, codes reduce-scattered
        self.log: list[tuple[str, tuple[int, int]]] | None = None  # ("reduce" | "reduced", (buffer, unit)), tests
        self._bindex = {id(b): bi for bi, b in enumerate(buffers)}
        # with overlap: reductions in flight (not waited for during backward) while the staging they hold stays within
        # inflight_budget elements (DeepSpeed documents ~4.5 x reduce_bucket_size for its overlap_comm); at least one
        self.inflight_budget = inflight_budget
        self.boundary = True  # reduce at the end of this backward (stages 0/1)
        self.fresh = True  # the next backward overwrites the accumulators instead of adding
        self.reduced = False  # stages 0/1: the accumulators hold reduced grads waiting for step()
        self.micro_steps = 0  # backwards since the last step
        self.staging_peak = 0  # most staging elements held at once (stage 2), for memory reports
        self._armed = False
        # (handle, finish, elements held, key, scratch buffers given back to the pool once finished)
        self._inflight: deque[tuple[Handle, Callable[[], object] | None, int, tuple[int, int], list]] = deque()
        # staging, receive and landing buffers reused across units (CPU), and across steps when ``keep_scratch``
        # (stages 1/2; stage 3 holds nothing between steps: the pool is emptied after each backward)
        self.pool, self.keep_scratch = ScratchPool(), keep_scratch
        self._staging_live = 0
        self._where: dict[int, tuple[FlatBuffer, int]] = {}
        self.on_unit_reduced: Callable[[FlatBuffer, int], None] | None = None  # stage 3 frees the unit
        self.on_backward_end: Callable[[], None] | None = None
        for b in buffers:
            b.pending = [len(u.params) for u in b.layout.units]
            b.seen = [set() for _ in b.layout.units]
            self._where.update({id(p): (b, i) for i, p in enumerate(b.params)})
        self._hooks: list = []
        self.attach_hooks()

    def attach_hooks(self) -> None:
        """Register every param's post-accumulate-grad hook (at init, and again after :meth:`remove_hooks`)."""
        self._hooks = [p.register_post_accumulate_grad_hook(_WeakHook(self)) for b in self.buffers for p in b.params]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def reduce_after_backward(self) -> None:
        """A backward ran with the hooks removed (compiled autograd, ``llmpar.runtime.compile``): the params' ``.grad``
        hold its gradients; pack and reduce every unit now, in the layout's order (the same on every rank)."""
        self._check_open()
        self._end_backward()

    # --------------------------------------------------------------- backward
    def _hook(self, p: torch.Tensor) -> None:
        b, i = self._where[id(p)]
        self._poll()
        if not self._armed:
            self._check_open()
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        u = b.layout.slot(i).unit
        if i in b.seen[u]:
            raise RuntimeError(
                f"param {b.layout.slot(i).name!r} received its gradient twice in one backward "
                "(reentrant checkpointing or retain_graph?): ZeRO reduces each gradient once"
            )
        b.seen[u].add(i)
        b.pending[u] -= 1
        if b.pending[u] == 0:
            self._unit_ready(b, u)

    def _check_open(self) -> None:
        if self.reduced:
            raise RuntimeError(
                "backward() ran after the gradient-accumulation boundary was reduced but before "
                "step() or zero_grad(): call step() first, or mark earlier micro-steps with "
                "set_gradient_accumulation_boundary(False)"
            )

    def _unit_grads(self, b: FlatBuffer, u: int) -> list[torch.Tensor]:
        out = []
        for i in b.layout.units[u].params:  # a missing grad is zeros of the layout's shape (a released stage-3
            p = b.params[i]  # param is an empty tensor: ``views.py``)
            out.append(
                p.grad
                if p.grad is not None
                else torch.zeros(b.layout.slot(i).shape, dtype=b.layout.dtype, device=b.flat.device)
            )
            p.grad = None
        return out

    def _unit_ready(self, b: FlatBuffer, u: int) -> None:
        layout, unit = b.layout, b.layout.units[u]
        key = (self._bindex[id(b)], u)
        if self.log is not None:
            self.log.append(("reduce", key))
        grads = self._unit_grads(b, u)
        scale = self.scale
        if self.stage == 2 and self.quantizer is not None:
            self._reduce_quantized(b, u, grads, scale, key)
            return
        if self.stage == 2:
            staging = self.pool.take(unit.padded, self.reduce_dtype_of(b), b.flat.device)
            pack_bucket(grads, out=staging, scale=scale)
            staging[unit.numel :].zero_()
            del grads
            shard = layout.shard_of_partition(b.grad, u)
            if self.on_unit_reduced is not None:  # stage 3: the grads are packed, the gathered unit can go
                self.on_unit_reduced(b, u)
            if self.fresh and self.copier is None and shard.dtype == staging.dtype and shard.device == staging.device:
                bufs = [staging]
                self._launch(self._reduce_scatter(shard, staging, key, bufs), None, staging, key, bufs=bufs)
            else:  # another dtype / the host partition (offload_optimizer): copied out when the reduction lands
                tmp = self.pool.take(shard.numel(), staging.dtype, staging.device)
                bufs = [staging, tmp]
                h = self._reduce_scatter(tmp, staging, key, bufs)
                if not self.fresh:  # accumulate (after the copies-out of the first micro-step have landed)
                    finish = self._accumulate(shard, tmp)
                elif self.copier is not None:
                    finish = lambda: self.copier.to_host(shard, tmp)  # noqa: E731
                else:
                    finish = lambda: shard.copy_(tmp)  # noqa: E731
                self._launch(h, finish, staging, key, bufs=bufs)
            return
        region = layout.unit_view(b.grad, u)
        if self.fresh:
            pack_bucket(grads, out=region, scale=scale)
        else:
            packed = self.pool.take(unit.numel, region.dtype, region.device)
            region[: unit.numel].add_(pack_bucket(grads, out=packed, scale=scale))
            self.pool.give(packed)
        del grads
        if not self.boundary:
            return
        if self.stage == 0:
            handle = all_reduce(
                region,
                self.group,
                async_op=True,
                counter=self.counter,
                what=f"all-reduce of gradients, buffer {key[0]} unit {key[1]}",
            )
            assert handle is not None  # async_op=True: the collective's Handle
            self._launch(handle, None, None, key)
        else:
            self._reduce_shard(b, u, region, key)

    def _reduce_quantized(
        self, b: FlatBuffer, u: int, grads: list[torch.Tensor], scale: float, key: tuple[int, int]
    ) -> None:
        """Stage 2/3 with zero_quantized_gradients: pack + scale + quantize in one pass, reduce-scatter the codes;
        the sum lands in the partition accumulator (added after the first micro-step) or goes out to the host."""
        q, unit = self.quantizer, b.layout.units[u]
        assert q is not None
        wire = q.pack(key, grads, unit.padded, scale, b.flat.device)
        del grads
        shard = b.layout.shard_of_partition(b.grad, u)
        if self.on_unit_reduced is not None:  # stage 3: the grads are packed, the gathered unit can go
            self.on_unit_reduced(b, u)
        what = f"quantized reduce-scatter of gradients, buffer {key[0]} unit {key[1]}"
        held = q.held_elements(unit.padded, shard.dtype)
        if self.copier is None:  # summed straight into the accumulator
            self._launch(q.reduce(key, wire, shard, accumulate=not self.fresh, what=what), None, None, key, held)
            return
        tmp = torch.empty(shard.numel(), dtype=torch.float32, device=wire.device)
        finish = self._accumulate(shard, tmp) if not self.fresh else lambda: self.copier.to_host(shard, tmp)
        self._launch(q.reduce(key, wire, tmp, accumulate=False, what=what), finish, None, key, held)

    def _reduce_shard(self, b: FlatBuffer, u: int, region: torch.Tensor, key: tuple[int, int]) -> None:
        """Stage 1: reduce-scatter unit ``u``'s accumulator ``region`` into a landing buffer, then :meth:`_land`."""
        tmp = self.pool.take(region.numel() // self.dp, region.dtype, region.device)
        bufs = [tmp]
        self._launch(self._reduce_scatter(tmp, region, key, bufs), self._land(b, u, tmp), None, key, bufs=bufs)

    def _accumulate(self, shard: torch.Tensor, tmp: torch.Tensor) -> Callable[[], object]:
        """After a later micro-step's reduction: ``shard += tmp`` once the copies-out of the first micro-step (host
        partition, offload_optimizer) have landed."""

        def finish() -> None:
            if self.copier is not None:
                self.copier.sync()
            shard.add_(tmp.to(shard.device, shard.dtype))

        return finish

    def _land(self, b: FlatBuffer, u: int, tmp: torch.Tensor) -> Callable[[], object]:
        """Stage 1: where unit ``u``'s reduced shard ``tmp`` goes once its reduce-scatter has finished: back into the
        accumulator, or (offload_optimizer) out to the host partition the host step reads."""
        if b.host_grad is not None and self.copier is not None:
            host = b.layout.shard_of_partition(b.host_grad, u)
            return lambda: self.copier.to_host(host, tmp)
        mine = b.layout.shard_of_full(b.grad, u, self.rank)
        return lambda: mine.copy_(tmp)

    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, key: tuple[int, int], bufs: list[torch.Tensor]
    ) -> Handle:
        """Launch the reduce-scatter; on the exchange path (gloo) the received chunks go into a pooled buffer,
        appended to ``bufs`` (given back once the reduction has finished)."""
        scratch = None
        need = reduce_scatter_scratch_numel(input, self.group)
        if need:
            scratch = self.pool.take(need, input.dtype, input.device)
            bufs.append(scratch)
        what = f"reduce-scatter of gradients, buffer {key[0]} unit {key[1]}"
        handle = reduce_scatter_flat(
            output, input, self.group, async_op=True, counter=self.counter, what=what, scratch=scratch
        )
        assert handle is not None
        return handle

    def _launch(
        self,
        handle: Handle,
        finish: Callable[[], object] | None,
        staging: torch.Tensor | None,
        key: tuple[int, int],
        held: int = 0,
        bufs: Sequence[torch.Tensor] = (),
    ) -> None:
        if staging is not None:  # + the received chunks
            held = staging.numel() * (2 if self.exchange else 1)
        self._inflight.append((handle, finish, held, key, list(bufs)))
        self._staging_live += held
        self.staging_peak = max(self.staging_peak, self._staging_live)
        if not self.overlap:
            self.wait_all()
        while len(self._inflight) > 1 and self._staging_live > self.inflight_budget:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        handle, finish, held, key, bufs = self._inflight.popleft()
        handle.wait()
        if finish is not None:
            finish()
        for buf in bufs:  # CPU buffers only are pooled, and CPU copies out of them are done by now (Copier)
            self.pool.give(buf)
        self._staging_live -= held
        if self.log is not None:
            self.log.append(("reduced", key))

    def _poll(self) -> None:
        """Finish (copy out) the reductions that have landed, oldest first, without waiting for any."""
        while self._inflight and self._inflight[0][0].is_completed():
            self._wait_oldest()

    def wait_all(self) -> None:
        while self._inflight:
            self._wait_oldest()

    def _end_backward(self) -> None:
        """Runs once at the end of every backward that reached a ZeRO param."""
        self._armed = False
        for b in self.buffers:  # units with unused params: their missing grads are zeros
            for u, left in enumerate(b.pending):
                if left > 0:
                    self._unit_ready(b, u)
        self.wait_all()
        if not self.keep_scratch:
            self.pool.clear()
        if self.on_backward_end is not None:
            self.on_backward_end()
        for b in self.buffers:
            b.pending = [len(unit.params) for unit in b.layout.units]
            for s in b.seen:
                s.clear()
        self.micro_steps += 1
        self.fresh = False
        if self.stage < 2 and self.boundary:
            self.reduced = True

    def reduce_now(self) -> None:
        """Stages 0/1: reduce the accumulators now (step() after micro-steps all marked as not the boundary)."""
        if self.stage == 2 or self.reduced or self.micro_steps == 0:
            return
        boundary, self.boundary = self.boundary, True
        for b in self.buffers:
            for u in range(len(b.layout.units)):
                region = b.layout.unit_view(b.grad, u)
                key = (self._bindex[id(b)], u)
                if self.stage == 0:
                    what = f"all-reduce of gradients, buffer {key[0]} unit {key[1]}"
                    handle = all_reduce(region, self.group, async_op=True, counter=self.counter, what=what)
                    assert handle is not None  # async_op=True: the collective's Handle
                    self._launch(handle, None, None, key)
                else:
                    self._reduce_shard(b, u, region, key)
        self.wait_all()
        self.boundary = boundary
        self.reduced = True

    def ready_for_step(self) -> bool:
        """True when the accumulators hold reduced, averaged grads of at least one backward."""
        return self.micro_steps > 0 and (self.stage == 2 or self.reduced)

    def reset(self) -> None:
        """After step() / zero_grad(): the next backward starts a new accumulation."""
        self.wait_all()
        self.fresh = True
        self.reduced = False
        self.micro_steps = 0
