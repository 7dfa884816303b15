"""``torch.distributed.pipelining.PipelineStage`` with a stopwatch and an activation meter.

Counts, per step: seconds spent computing forward and backward chunks, micro-batches in flight (forward done,
backward not yet) and, with ``track_memory``, the bytes of activations autograd holds for this stage (tensors saved
for backward, each storage counted once while any saved reference to it is alive).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage


class _Meter:
    """Live bytes of saved-for-backward storages; ``peak`` is the most seen at once."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def reset(self) -> None:
        self.peak = self.live

    def pack(self, t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.refs:
            self.refs[key] = 0
            self.sizes[key] = st.nbytes()
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        holder = _Held(t)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    @staticmethod
    def unpack(holder: Any) -> torch.Tensor:
        return holder.t


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class MeteredStage(PipelineStage):
    """A PipelineStage that records compute time, in-flight micro-batches and (optionally) activation bytes."""

    def __init__(self, *args: Any, track_memory: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.track_memory = track_memory
        self.meter = _Meter()
        self.reset_stats()

    def reset_stats(self) -> None:
        self.busy_s = 0.0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.meter.reset()

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            if self.track_memory:
                with torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack):
                    return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0
            self.in_flight -= 1
