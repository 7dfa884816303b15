"""Building a model too big for one rank: record its construction, let ZeRO-3 materialise it shard by shard.

    torch.manual_seed(s)
    with llmpar.zero.Init():                      # params on the meta device: no parameter memory at all
        model = LlamaForCausalLM(cfg)             # (or any torch module)
    engine, opt, _, _ = llmpar.initialize(model=model, config={... "zero_optimization": {"stage": 3}})
    # every param and buffer now equals (torch.equal) what `torch.manual_seed(s); LlamaForCausalLM(cfg)` gives

Inside the block every tensor the model's code makes lives on the meta device (though Python code sees it as the
CPU tensor of a plain build: ``is_meta`` False, so ``trunc_normal_`` / ``orthogonal_`` run), and every op that makes
or writes one is recorded (``deferred.py``; replayed by ``replay.py``): the constructors' ``reset_parameters``,
transformers' ``_init_weights`` pass (it runs: the block is not a meta device context), ``weight[padding_idx]
.zero_()``, ``nn.Parameter(torch.randn(n) * 0.02)``. Random ops save their generator's state and draw for real on a
thrown-away scratch tensor, so the generators end the block where a plain build leaves them. At the end of the
block buffers (and other tensor attributes of the modules built) are replayed for real (small: rotary ``inv_freq``,
masks); params stay on meta, each carrying its recipe.

ZeroOptimizer (stage 3) then, for one sharding unit at a time (``stage3.py``), allocates that unit's params, replays
each one's recorded ops (from the last one that rewrote it whole), copies this rank's slice into its shard, and frees
them: no rank ever holds more than one unit's full params (``ZeroOptimizer.init_peak_numel`` records the most; a
replay also holds the temporaries of one param's recipe, e.g. the ``randn`` of ``randn(n) * 0.02``). Every rank
replays the same recording: the dp ranks must have built the model from the same random state (checked: a
mismatch is an error on every rank). Cost: the block draws what a plain build draws (about its time; memory: one
scratch tensor the size of the largest param); materialising replays each param's last full init once per rank
(a ~53M-param Llama on CPU: block 0.50 s vs plain build 0.49 s, replay 0.29 s).

Between the block and ``initialize`` the params are still recorded (``after_init.py``): ``model.load_state_dict(sd)``,
``p.zero_()``, ``p.data[i].fill_(v)``, ``nn.init.*_(p)``, a ``model.to(dtype)`` are appended to their recordings and
replayed after the block's ops, so the engine starts from what a plain build given the same calls holds (the loaded
tensors are held by reference until then, not copied; one changed in place before initialize is an error).

``Init(init_fn=f)``: after a unit's params got their recorded values, ``f(unit)`` runs on them (under
``torch.no_grad``, the CPU generator seeded with ``seed`` and the unit's index, the same on every rank) and may
overwrite them (what was written after the block is replayed after it: it came later); only the unit's own params
have storage then (others: 0 bytes). A meta param with no recording (built under ``torch.device("meta")`` rather
than ``Init``) needs ``init_fn``; without it initialize refuses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from llmpar.distributed.agree import check_same_on_ranks
from llmpar.zero.after_init import watch
from llmpar.zero.deferred import Looks, Recorder
from llmpar.zero.replay import Kept, Ref, Replayer, covers, needed_ops, view_of

InitFn = Callable[[nn.Module], None]
_INIT_FN = "_llmpar_init_fn"  # attribute naming the init_fn on params built inside an Init(init_fn=...) block
_DEFERRED = "_llmpar_deferred"  # attribute on each param built inside an Init block: its Deferred recipe


@dataclasses.dataclass(frozen=True)
class Deferred:
    """How to rebuild one param: its recording, its Ref (storage, version, geometry) now, and ``block``, its Ref at
    the end of the block (the same unless something was written into it afterwards, ``after_init.py``)."""

    recorder: Recorder
    ref: Ref
    block: Ref

    def now(self, p: torch.Tensor, name: str) -> "Deferred":
        """This recipe for ``p`` as it is now: the ops recorded on it after the block (``after_init.py``) included.
        Refused, naming ``name``: a param whose storage is no longer recorded (swapped for another meta tensor), or
        one written from a tensor changed in place since (its values are gone)."""
        with torch._C.DisableTorchFunctionSubclass():
            if self.recorder.key_of(p) is None:
                raise ValueError(
                    f"param {name} {tuple(p.shape)} built inside llmpar.zero.Init was replaced after the "
                    "block by a meta tensor with no recorded values: write into the param (in place, "
                    "load_state_dict) or assign a real tensor"
                )
            ref = self.recorder.ref(p)
        storages = self.recorder.storages
        if any(
            isinstance(x, Kept) and x.changed() for k, i in needed_ops(storages, [ref]) for x in storages[k].log[i].flat
        ):
            raise ValueError(
                f"param {name}: a tensor written into it after the llmpar.zero.Init block (e.g. by "
                "load_state_dict) was changed in place before llmpar.initialize read it: keep the "
                "tensors you load unchanged until initialize (or load a .clone())"
            )
        return Deferred(self.recorder, ref, self.block)

    @property
    def written_after(self) -> bool:
        """Something was recorded on the param after the block (a write, a cast by ``model.to``)."""
        return self.ref != self.block

    def value(self) -> torch.Tensor:
        """The param as a plain build would have made it (dtype and device of the build; a fresh replay)."""
        return Replayer(self.recorder).value(self.ref)

    def replay_into(self, p: torch.Tensor, *, at_block: bool = False) -> None:
        """``p`` (allocated, same shape) takes the recorded values (``at_block``: those at the end of the block):
        rebuilt in its own storage when it can be, else replayed apart and copied (cast to ``p``'s dtype and
        device, as ``model.to`` after a plain build)."""
        ref = self.block if at_block else self.ref
        if tuple(p.shape) != ref.size:
            raise ValueError(
                f"a param recorded by llmpar.zero.Init as {ref.size} is now {tuple(p.shape)}: "
                "reshape params inside the Init block, not after it"
            )
        v = Replayer(self.recorder).value(ref, into=p)
        if v.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
            p.copy_(v)

    def replay_after(self, p: torch.Tensor) -> None:
        """``p`` holds the param as at the end of the block, as modified since by ``init_fn``: what was recorded
        on it after the block is replayed on top of these values (so a state dict loaded after the block wins
        over ``init_fn``, as it came later)."""
        rec, b = self.recorder, self.block
        s = rec.storages[b.key]
        base = torch.empty(s.nbytes, dtype=torch.uint8, device=s.device).untyped_storage()
        if not covers(view_of(base, b, s.device), s.nbytes):  # p views part of its storage: the rest replayed
            base = Replayer(rec).storage_copy(b)
        view_of(base, b, s.device).copy_(p)
        v = Replayer(rec, base={b.key: (b.version, base)}).value(self.ref, into=p)
        if v.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
            p.copy_(v)


_Self = TypeVar("_Self", bound="Init")  # __enter__ returns the instance itself, of a subclass too


class Init:
    """Context: modules built inside it get recorded meta params (see the module docstring).

    Params registered inside the block carry their recipe (and ``init_fn`` when given) as attributes, carried over
    to their replacements, so the model built here is materialised with them even if other models are built in
    between: no state outside the params. A block inside another block records into the outer one."""

    def __init__(self, init_fn: InitFn | None = None) -> None:
        self.init_fn = init_fn
        self._recorder: Recorder | None = None
        self._looks: Looks | None = None
        self._hooks: list[Any] = []
        self._params: dict[int, nn.Parameter] = {}
        self._modules: dict[int, nn.Module] = {}

    def __enter__(self: _Self) -> _Self:
        outer = any(isinstance(m, Recorder) for m in _get_current_dispatch_mode_stack())
        self._recorder = None if outer else Recorder()
        init_fn, params, modules = self.init_fn, self._params, self._modules

        def on_param(module: nn.Module, name: str, param: Any) -> None:
            if param is not None:
                if init_fn is not None:
                    setattr(param, _INIT_FN, init_fn)
                params[id(param)], modules[id(module)] = param, module

        def on_buffer(module: nn.Module, name: str, buf: Any) -> None:
            modules[id(module)] = module

        self._hooks = [
            nn.modules.module.register_module_parameter_registration_hook(on_param),
            nn.modules.module.register_module_buffer_registration_hook(on_buffer),
        ]
        if self._recorder is not None:
            self._looks = Looks(self._recorder)
            self._recorder.__enter__()
            self._looks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        rec, self._recorder, self._hooks = self._recorder, None, []
        params, modules = list(self._params.values()), list(self._modules.values())
        self._params, self._modules = {}, {}
        if rec is not None:
            assert self._looks is not None
            self._looks.__exit__(*exc)
            self._looks = None
            rec.__exit__(*exc)
            if exc[0] is None:
                _finish(rec, params, modules)


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[None]:
    """Inside: the block that built ``model`` records again, so that code changing an unmaterialised model (a
    tensor-parallel split, ``llmpar.parallelize``, run by ``llmpar.initialize``) makes recorded meta params: a
    tensor made there is a recorded meta tensor, a slice of a param copied into it is recorded, and every new param
    registered gets its recipe (replaying it replays the param it was sliced from, one param at a time, and keeps
    the slice). Nothing happens for a model with no recorded params (or params of several blocks)."""
    recs = {
        id(d.recorder): d.recorder for d in (getattr(p, _DEFERRED, None) for p in model.parameters()) if d is not None
    }
    if len(recs) != 1:
        yield
        return
    rec = next(iter(recs.values()))
    new: dict[int, nn.Parameter] = {}

    def on_param(module: nn.Module, name: str, param: Any) -> None:
        if param is not None:
            new[id(param)] = param

    hook = nn.modules.module.register_module_parameter_registration_hook(on_param)
    looks = Looks(rec)
    rec.__enter__()
    looks.__enter__()
    try:
        yield
    finally:
        looks.__exit__(None, None, None)
        rec.__exit__(None, None, None)
        hook.remove()
        rec.scratch.clear()
    for p in new.values():
        if not hasattr(p, _DEFERRED) and rec.key_of(p) is not None:
            ref = rec.ref(p)
            setattr(p, _DEFERRED, Deferred(rec, ref, ref))
            watch(p, rec)


@torch.no_grad()
def _finish(rec: Recorder, params: list[nn.Parameter], modules: list[nn.Module]) -> None:
    """End of a block: params get their recipes; buffers and other tensor attributes of the modules are replayed."""
    keep = []
    for p in params:
        if rec.key_of(p) is not None:
            keep.append(rec.ref(p))
            setattr(p, _DEFERRED, Deferred(rec, keep[-1], keep[-1]))
            watch(p, rec)  # what is written into it until initialize is recorded too (``after_init.py``)
    replay, done = Replayer(rec), {}

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            done[id(t)] = replay.value(rec.ref(t))
            done[id(t)].__dict__.update(t.__dict__)
        return done[id(t)]

    rec.scratch.clear()
    for m in modules:
        for name, b in list(m._buffers.items()):
            if b is not None and rec.key_of(b) is not None:
                m._buffers[name] = real(b)
        for name, v in list(vars(m).items()):
            if not isinstance(v, nn.Parameter) and rec.key_of(v) is not None:
                m.__dict__[name] = real(v)
    rec.prune(keep)


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _empty_like_meta(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype on ``device`` holding no memory (storage resized to 0)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.untyped_storage().resize_(0)
    return out


def replace_meta_params(model: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Swap every meta param of ``model`` for a same-shaped param on ``device`` with no storage (tied params stay
    tied; recipe and init_fn carried over); buffers move to ``device``. Returns id(old param) -> new param. A meta
    param with neither a recording nor an init_fn, or a meta buffer, is refused: it has no values to give."""
    mapping: dict[int, nn.Parameter] = {}
    for mname, mod in model.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = mapping.get(id(p))
            if new is None:
                if not hasattr(p, _DEFERRED) and not hasattr(p, _INIT_FN):
                    raise ValueError(
                        f"param {_qual(mname, name)} {tuple(p.shape)} is on the meta device but was not "
                        "built inside llmpar.zero.Init (a torch.device('meta') block, or made after "
                        "the Init block): ZeRO-3 has no values for it; build the model inside `with "
                        "llmpar.zero.Init():` or give Init(init_fn=...)"
                    )
                new = mapping[id(p)] = nn.Parameter(_empty_like_meta(p, device), requires_grad=p.requires_grad)
                if hasattr(p, _INIT_FN):
                    setattr(new, _INIT_FN, getattr(p, _INIT_FN))
                if hasattr(p, _DEFERRED):  # with what was written into it since the block
                    setattr(new, _DEFERRED, getattr(p, _DEFERRED).now(p, _qual(mname, name)))
            mod._parameters[name] = new
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_meta:
                raise ValueError(
                    f"buffer {_qual(mname, name)} {tuple(buf.shape)} is on the meta device with no "
                    "values (not built inside llmpar.zero.Init): build the model inside `with "
                    "llmpar.zero.Init():`, which gives buffers their values at the end of the block"
                )
            if buf is not None:
                mod._buffers[name] = buf.to(device)
    return mapping


def _qual(module_name: str, name: str) -> str:
    return f"{module_name}.{name}" if module_name else name


def materialize_unit(unit: nn.Module, owned: list[nn.Parameter], seed: int, index: int, init_fn: InitFn | None) -> None:
    """Give ``owned`` (storage-less params of one unit) real memory and their values: each one's recording replayed,
    then ``init_fn(unit)`` (seeded with ``seed`` and the unit's ``index``) when given (module docstring)."""
    for p in owned:
        p.untyped_storage().resize_(p.numel() * p.element_size())
    with torch.no_grad():
        for p in owned:
            d = getattr(p, _DEFERRED, None)
            if d is not None:
                d.replay_into(p, at_block=init_fn is not None)
        if init_fn is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 1_000_003 + index)
                init_fn(unit)
            for p in owned:  # written after the block (a loaded state dict): later than init_fn, so it wins
                d = getattr(p, _DEFERRED, None)
                if d is not None and d.written_after:
                    d.replay_after(p)


def check_same_recordings(opt: Any, params: list[nn.Parameter]) -> None:
    """Every dp rank replays its own recording: they must agree (same random states), or the shards would mix
    different models. One small all-gather."""
    recorders = {id(d.recorder): d.recorder for d in (getattr(p, _DEFERRED, None) for p in params) if d is not None}
    fingerprint = repr(sorted(r.fingerprint() for r in recorders.values()))
    check_same_on_ranks(
        fingerprint,
        opt.dp_group,
        what="llmpar.zero.Init: the data-parallel ranks built the model "
        "from different random states (or wrote different values into it after the block)",
        hint="seed every rank the same (torch.manual_seed(s)) before the Init block, and load the "
        "same state dict on every rank: each rank replays its own recording and keeps its slice",
    )


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
    """Meta-built model: one unit at a time, allocate its params, replay their init, keep this rank's slices."""
    assert opt.plan is not None
    where = {id(p): (b, i) for b in opt.buffers + opt.frozen_buffers for i, p in enumerate(b.params)}
    check_same_recordings(opt, [p for b in opt.buffers + opt.frozen_buffers for p in b.params])
    rank = opt._rank()
    for mi, (_, unit) in enumerate(opt.plan.units):
        owned = [p for p in opt.plan.needs[mi] if opt.plan.owner[id(p)] == mi and id(p) in opt._deferred]
        if not owned:
            continue
        init_fn = next((getattr(p, _INIT_FN) for p in owned if hasattr(p, _INIT_FN)), None)
        materialize_unit(unit, owned, opt.seed, mi, init_fn)
        opt.init_peak_numel = max(opt.init_peak_numel, sum(p.numel() for p in owned))
        for p in owned:
            if id(p) not in where:
                continue  # not a floating-point param: stays whole
            b, i = where[id(p)]
            u = b.layout.slot(i).unit
            mine = b.layout.shard_of_partition(b.shard, u)
            for j, a, z, at in b.layout.param_slices(u, rank):
                if j == i:
                    mine[at : at + z - a].copy_(p.detach().reshape(-1)[a:z])
        release_storage([p for p in owned if id(p) in where])
        for p in owned:
            if hasattr(p, _DEFERRED):
                delattr(p, _DEFERRED)  # the recording is freed with the last param holding it
    opt.refresh_master()
