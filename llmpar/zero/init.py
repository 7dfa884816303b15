"""Building a model too big for one rank: construct it on the meta device, let ZeRO-3 materialise it shard by shard.

    with llmpar.zero.Init():                      # = torch.device("meta"): no parameter memory at all
        model = GPT(cfg)
    engine, opt, _, _ = llmpar.initialize(model=model, config={... "zero_optimization": {"stage": 3}})

ZeroOptimizer (stage 3) then, for one sharding unit at a time (``stage3.py``), allocates that unit's params, runs
``reset_parameters()`` of every submodule of the unit that has one (torch's default inits; the RNG seeded with
``seed`` and the unit's index, so every rank draws the same values), copies this rank's slice into its shard, and frees
them: no rank ever holds more than one unit's full params (``ZeroOptimizer.init_peak_numel`` records the most).
A model whose own init draws across the whole model (e.g. ``GPT.reset_parameters(seed)``) gets torch's per-module
init instead; pass ``init_fn(module)`` to :class:`Init` for another per-unit init.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]
_INIT_FN = "_llmpar_init_fn"  # attribute naming the init_fn on params built inside an Init(init_fn=...) block


class Init:
    """Context: modules built inside it live on the meta device (nothing allocated); see the module docstring.

    With ``init_fn`` every param registered inside the block carries it (an attribute of the meta param, carried over
    to its replacement), so the model built here is materialised with it even if other models are built in between:
    no state outside the params."""

    def __init__(self, init_fn: InitFn | None = None) -> None:
        self.init_fn = init_fn
        self._device = torch.device("meta")
        self._hook: Any = None

    def __enter__(self) -> "Init":
        self._device.__enter__()
        if self.init_fn is not None:
            init_fn = self.init_fn

            def tag(module: nn.Module, name: str, param: Any) -> None:
                if param is not None:
                    setattr(param, _INIT_FN, init_fn)

            self._hook = nn.modules.module.register_module_parameter_registration_hook(tag)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._device.__exit__(*exc)


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _empty_like_meta(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype on ``device`` holding no memory (storage resized to 0)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.untyped_storage().resize_(0)
    return out


def replace_meta_params(model: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Swap every meta param of ``model`` for a same-shaped param on ``device`` with no storage (tied params stay
    tied); meta buffers become real (small). Returns id(old param) -> new param."""
    mapping: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = mapping.get(id(p))
            if new is None:
                new = mapping[id(p)] = nn.Parameter(_empty_like_meta(p, device), requires_grad=p.requires_grad)
                if hasattr(p, _INIT_FN):
                    setattr(new, _INIT_FN, getattr(p, _INIT_FN))
            mod._parameters[name] = new
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
    return mapping


def materialize_unit(unit: nn.Module, owned: list[nn.Parameter], nested: set[int], seed: int, index: int,
                     init_fn: InitFn | None) -> int:
    """Give ``owned`` (storage-less params of one unit) real memory and their init values. Returns their numel."""
    for p in owned:
        p.untyped_storage().resize_(p.numel() * p.element_size())
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed * 1_000_003 + index)
        if init_fn is not None:
            init_fn(unit)
        else:
            stack = [unit]
            while stack:
                m = stack.pop()
                own = list(m.parameters(recurse=False))  # skip modules holding a param of another unit (tied)
                if hasattr(m, "reset_parameters") and own and all(q.untyped_storage().nbytes() > 0 for q in own):
                    m.reset_parameters()
                stack.extend(c for c in m.children() if id(c) not in nested)
    return sum(p.numel() for p in owned)


def release_storage(params: list[nn.Parameter]) -> None:
    for p in params:
        p.untyped_storage().resize_(0)


def remap_params(params: Any, mapping: dict[int, nn.Parameter]) -> list:
    """The user's params / (name, param) pairs / group dicts with meta params swapped for their replacements."""
    def one(item: Any) -> Any:
        if isinstance(item, tuple) and len(item) == 2:
            return (item[0], mapping.get(id(item[1]), item[1]))
        return mapping.get(id(item), item)

    out = []
    for item in params:
        if isinstance(item, dict) and "params" in item:
            out.append({**item, "params": [one(x) for x in item["params"]]})
        else:
            out.append(one(item))
    return out


@torch.no_grad()
def materialize_sharded(opt: Any) -> None:
    """Meta-built model: one unit at a time, allocate its params, init them, keep this rank's slices (init.py)."""
    assert opt.plan is not None
    where = {id(p): (b, i) for b in opt.buffers + opt.frozen_buffers for i, p in enumerate(b.params)}
    nested = {id(m) for _, m in opt.plan.units}
    rank = opt._rank()
    for mi, (_, unit) in enumerate(opt.plan.units):
        owned = [p for p in opt.plan.needs[mi] if opt.plan.owner[id(p)] == mi and id(p) in opt._deferred]
        if not owned:
            continue
        init_fn = next((getattr(p, _INIT_FN) for p in owned if hasattr(p, _INIT_FN)), None)
        n = materialize_unit(unit, owned, nested - {id(unit)}, opt.seed, mi, init_fn)
        opt.init_peak_numel = max(opt.init_peak_numel, n)
        for p in owned:
            if id(p) not in where:
                continue  # not a floating-point param: stays whole
            b, i = where[id(p)]
            u = b.layout.slot(i).unit
            mine = b.layout.shard_of_partition(b.shard, u)
            for j, a, z, at in b.layout.param_slices(u, rank):
                if j == i:
                    mine[at:at + z - a].copy_(p.detach().reshape(-1)[a:z])
        release_storage([p for p in owned if id(p) in where])
    opt.refresh_master()
