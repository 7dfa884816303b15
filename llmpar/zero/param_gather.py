"""ZeRO-1/2: the all-gather of the updated params after ``step()``, waited for at once or as late as possible.

After a stage-1/2 step each rank holds only its partition of the new params; an all-gather makes them whole again.
``step()`` steps one unit at a time and launches that unit's all-gather as soon as its shard is updated
(:func:`step_gather`), so the gathers of the first units run while the later ones are stepped. By default
(:class:`BoundedGather`) ``step()`` waits for them all before it returns. With
``zero_optimization.overlap_param_gather`` (the name Megatron-Core uses for the same option), :class:`DeferredGather`
takes the same launches but does not wait for them in ``step()``: it waits for each unit just before the first module
that holds one of its params runs forward (a forward pre-hook per such module), so the communication overlaps
whatever runs until then and the early layers of the next forward. Everything in llmpar that reads params waits
first (``ZeroOptimizer.wait_params``: the next step, a checkpoint save, the gathered state dict,
``GatheredParameters``, the module's ``state_dict()``). Code that reads ``param.data`` directly between ``step()``
and the next forward (an EMA of the weights, say) must call ``optimizer.wait_params()`` first: that is why the option
is off by default.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from llmpar.distributed.collectives import Handle, all_gather_flat


def _launch(opt: Any, b: Any, u: int) -> tuple[Handle, int]:
    out = b.layout.unit_view(b.flat, u)
    h = all_gather_flat(
        out,
        b.layout.shard_of_full(b.flat, u, opt.rank),
        opt.dp_group,
        async_op=True,
        counter=opt.counter,
        what=f"all-gather of updated params, unit {u} (step)",
    )
    assert h is not None  # async_op=True: the collective's Handle
    return h, out.numel()


class BoundedGather:
    """Unit all-gathers launched one by one, at most ``allgather_bucket_size`` elements in flight (the oldest is
    waited for first); :meth:`finish` waits for the rest (the default: params whole when ``step()`` returns)."""

    def __init__(self, opt: Any) -> None:
        self.opt, self.limit = opt, opt.zero_config.allgather_bucket_size
        self.inflight: list[tuple[Handle, int]] = []
        self.live = 0

    def unit_stepped(self, bi: int, u: int) -> None:
        self.inflight.append(_launch(self.opt, self.opt.buffers[bi], u))
        self.live += self.inflight[-1][1]
        while self.live > self.limit and len(self.inflight) > 1:
            h0, n0 = self.inflight.pop(0)
            h0.wait()
            self.live -= n0

    def finish(self) -> None:
        while self.inflight:
            self.inflight.pop(0)[0].wait()
        self.live = 0


class DeferredGather:
    """The all-gathers of one step, launched by ``step()`` (:meth:`unit_stepped`) and waited per unit by forward
    pre-hooks on ``module``'s submodules (or all at once by :meth:`wait_all`)."""

    def __init__(self, opt: Any, module: nn.Module) -> None:
        self.opt = opt
        self.pending: dict[tuple[int, int], Handle] = {}
        owner = {
            id(b.params[i]): (bi, u)
            for bi, b in enumerate(opt.buffers)
            for u, unit in enumerate(b.layout.units)
            for i in unit.params
        }
        self.hooks = []
        for m in module.modules():
            keys = sorted({owner[id(p)] for p in m.parameters(recurse=False) if id(p) in owner})
            if keys:
                self.hooks.append(m.register_forward_pre_hook(self._waiter(keys)))
        self.hooks.append(module.register_state_dict_pre_hook(lambda *args, **kwargs: self.wait_all()))

    def _waiter(self, keys: list[tuple[int, int]]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.pending:
                for key in keys:
                    h = self.pending.pop(key, None)
                    if h is not None:
                        h.wait()

        return hook

    def unit_stepped(self, bi: int, u: int) -> None:
        """Start unit ``u`` of buffer ``bi``'s all-gather (its shard was just stepped); a forward pre-hook waits."""
        self.pending[(bi, u)] = _launch(self.opt, self.opt.buffers[bi], u)[0]

    def finish(self) -> None:
        """The end of ``step()``: nothing to wait for here (the forward pre-hooks wait)."""

    def wait_all(self) -> None:
        while self.pending:
            self.pending.pop(next(iter(self.pending))).wait()

    def remove(self) -> None:
        self.wait_all()
        for h in self.hooks:
            h.remove()


def step_gather(opt: Any) -> BoundedGather | DeferredGather | None:
    """What a stage-1/2 ``step()`` hands each stepped unit to (``unit_stepped(bi, u)``, then ``finish()``): the
    deferred gather (``overlap_param_gather``) or a bounded one waited at the end of the step; None when there is
    nothing to gather (stage 0 or 3, one dp rank)."""
    if opt.stage not in (1, 2) or opt.dp == 1:
        return None
    deferred = getattr(opt, "deferred_gather", None)
    return deferred if deferred is not None else BoundedGather(opt)


__all__ = ["BoundedGather", "DeferredGather", "step_gather"]
