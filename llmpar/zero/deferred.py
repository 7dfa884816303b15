"""Deferred init by recording: what ``llmpar.zero.Init`` runs while a model is built, so that ZeRO-3 can later give
every param exactly the values a plain build would have given it, one param at a time.

Inside the block a TorchDispatchMode (:class:`Recorder`) sees every aten op:
- a factory op (``torch.empty``, ``randn``, ``arange``, ``ones``... no tensor input) runs on the meta device, and
  its output's storage becomes a *recorded storage* whose log starts with that op (its *producer*);
- an op reading recorded tensors and making a new one runs on meta too: another recorded storage whose producer
  names its inputs as :class:`Ref` (storage, version = length of its log when read, view geometry);
- an op writing into a recorded tensor (``normal_``, ``fill_``, ``copy_``, ``weight[pad].zero_()``...) is appended
  to the log of the storage it writes, with the view written (size, stride, offset) as its geometry;
- a view op needs no record: the meta view shares the meta storage and carries its geometry;
- a random op saves the state of the generator it draws from, then draws for real on a scratch tensor of the same
  size, stride, dtype and device (thrown away), so the generator advances exactly as in a plain build and every
  later draw (of this model or of the user's code after the block) is the plain build's;
- an op the meta device cannot run (``.item()``, data-dependent shapes), or one writing a real tensor from recorded
  ones, runs for real on replayed inputs: small real things stay real.
The recording and its replay (:class:`~llmpar.zero.replay.Replayer`) are in ``replay.py``.
"""

from __future__ import annotations

import sys
import zlib
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from llmpar.zero.replay import Kept, Op, Ref, Replayer, Storage, covers, geometry, needed_ops

__all__ = ["DeferredInitError", "Looks", "Recorder"]


class DeferredInitError(RuntimeError):
    """An op inside ``llmpar.zero.Init`` that a replay could not reproduce: refused where it runs."""


_META = torch.device("meta")
_FRESH = frozenset(
    {
        "normal_",
        "uniform_",
        "fill_",
        "zero_",
        "copy_",
        "random_",
        "exponential_",
        "cauchy_",
        "log_normal_",
        "geometric_",
        "bernoulli_",
    }
)  # rewrite every element of self without reading it
_REFUSED = frozenset({"set_", "resize_", "resize_as_", "_resize_output_", "swap_"})


def _refuse(what: str) -> DeferredInitError:
    """The error for an op the recording cannot replay, naming the module whose code ran it."""
    f: FrameType | None = sys._getframe(1)
    where = "outside any module's code"
    while f is not None:
        me = f.f_locals.get("self")
        if isinstance(me, torch.nn.Module):
            where = f"in {type(me).__name__}.{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})"
            break
        f = f.f_back
    return DeferredInitError(f"llmpar.zero.Init: {what} [{where}]")


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    raise _refuse(f"a random op on {device} is not supported (cpu and cuda generators are)")


def _written(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments ``func`` writes into (``Tensor(a!)`` in its schema)."""
    out: list[Any] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            x = args[i] if i < len(args) else kwargs.get(a.name)
            out.extend(x if isinstance(x, (list, tuple)) else [x])
    return [x for x in out if x is not None]


def _is_factory(func: Any, flat: list) -> bool:
    return not any(isinstance(x, torch.Tensor) for x in flat) and any(
        a.name == "device" for a in func._schema.arguments
    )


class Recorder(TorchDispatchMode):
    """The recording mode of one ``llmpar.zero.Init`` block (module docstring). ``storages``: key -> log."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, Storage] = {}
        self.busy = False  # inside __torch_dispatch__: Looks lets every property through
        self.scratch: dict[torch.device, torch.UntypedStorage] = {}  # what random draws are thrown into, reused
        self.by_reference = False  # after the block (``after_init.py``): real inputs kept, not copied (``Kept``)

    # ------------------------------------------------------------------ lookups
    def key_of(self, t: Any) -> int | None:
        """The recorded storage ``t`` views (None: not a tensor built in the block)."""
        if isinstance(t, torch.Tensor) and t.is_meta:
            k = t.untyped_storage()._cdata
            if k in self.storages:
                return k
        return None

    def ref(self, t: torch.Tensor) -> Ref:
        k = t.untyped_storage()._cdata
        return geometry(t, k, len(self.storages[k].log))

    def device_of(self, t: torch.Tensor) -> torch.device:
        return self.storages[t.untyped_storage()._cdata].device

    def fingerprint(self) -> int:
        """A checksum of the generator states a replay uses (after :meth:`prune`) and of a sample of every real
        tensor written after the block: equal on ranks whose replays give the same values (storages in creation
        order, the same on every rank)."""
        crc = 0
        for s in self.storages.values():
            for op in s.log:
                if op.rng is not None:
                    crc = zlib.crc32(op.rng[1].numpy().tobytes(), crc)
                for x in op.flat:  # values written after the block (a loaded state dict): a sample of each
                    if isinstance(x, Kept):
                        flat = x.tensor.detach().reshape(-1)
                        sample = flat[:: max(1, flat.numel() // 4096)].contiguous().view(torch.uint8)
                        crc = zlib.crc32(sample.cpu().numpy().tobytes(), crc)
        return crc

    def prune(self, keep: list[Ref]) -> None:
        """Keep only what replaying ``keep`` runs: other storages go, and the ops a replay skips (drawn over later,
        as a Linear's ``kaiming_uniform_`` under HF's ``normal_``) lose their inputs and generator states."""
        runs = needed_ops(self.storages, keep)
        for k, s in self.storages.items():
            for i, op in enumerate(s.log):
                if (k, i) not in runs:
                    op.flat, op.rng = [], None
        self.storages = {k: s for k, s in self.storages.items() if any((k, i) in runs for i in range(len(s.log)))}

    # -------------------------------------------------------------- recording
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.busy:  # llmpar's own work (a replay for Looks): not the model's
            return func(*args, **(kwargs or {}))
        self.busy = True
        try:
            return self._dispatch(func, args, kwargs or {})
        finally:
            self.busy = False

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        recorded = [x for x in flat if self.key_of(x) is not None]
        factory = not recorded and _is_factory(func, flat)
        if not recorded and not factory:
            return func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if any(isinstance(x, torch.Tensor) and x.is_meta and self.key_of(x) is None for x in flat):
            raise _refuse(
                f"{func} mixes a tensor built in the block with a meta tensor built outside it, whose "
                "values no plain build has: build both inside the block"
            )
        if recorded and name in _REFUSED:
            raise _refuse(
                f"{name} on a tensor built in the block is not supported (it replaces or resizes its "
                "storage, which a replay cannot follow): do it after llmpar.initialize, or outside the block"
            )
        written = _written(func, args, kwargs)
        lazy_w = [w for w in written if self.key_of(w) is not None]
        if lazy_w and len(written) != 1:
            raise _refuse(
                f"{func} writes into several tensors built in the block at once; only single-tensor "
                "writes (normal_, copy_, fill_, x[i].zero_()...) can be replayed"
            )
        if written and not lazy_w:  # writing real tensors from recorded ones: done for real
            return self._real(func, flat, spec)
        real_dev = next((x for x in flat if isinstance(x, torch.device) and x.type != "meta"), None)
        if real_dev is None:
            real_dev = self.device_of(recorded[0]) if recorded else torch.get_default_device()
        margs, mkwargs = tree_unflatten([_to_meta(x) for x in flat], spec)
        try:
            out = func(*margs, **mkwargs)
        except Exception as e:  # noqa: BLE001 - the meta device cannot run it: data-dependent
            if lazy_w:
                raise _refuse(
                    f"{func} into a tensor built in the block does not run on the meta device ({type(e).__name__}: {e})"
                ) from e
            return self._real(func, flat, spec)
        if not lazy_w and any(o is not None and not isinstance(o, torch.Tensor) for o in tree_flatten(out)[0]):
            return self._real(func, flat, spec)  # a Python value of the data: the meta one means nothing
        rng = (
            self._draw(func, flat, spec, real_dev, written) if torch.Tag.nondeterministic_seeded in func.tags else None
        )
        rec = [self._arg(x, real_dev) for x in flat]
        if lazy_w:
            t = lazy_w[0]
            k = t.untyped_storage()._cdata
            s = self.storages[k]
            target = next(i for i, x in enumerate(flat) if x is t)
            s.log.append(Op(func, rec, spec, self.ref(t), target, 0, rng, name in _FRESH and covers(t, s.nbytes)))
            return out
        if factory and "dtype" in (a.name for a in func._schema.arguments if a.kwarg_only):
            kw = dict(kwargs)
            if kw.get("dtype") is None:  # the default dtype of now, not of the replay's time
                kw["dtype"] = tree_flatten(out)[0][0].dtype
                rec, spec = tree_flatten((args, kw))
                rec = [self._arg(x, real_dev) for x in rec]
        for j, o in enumerate(tree_flatten(out)[0]):
            if not isinstance(o, torch.Tensor):
                continue
            k = o.untyped_storage()._cdata
            if k in self.storages:
                continue  # a view of a recorded storage
            if any(r.alias_info is not None for r in func._schema.returns):
                raise _refuse(f"view op {func} gave a tensor not aliasing its input on the meta device: not supported")
            self.storages[k] = Storage(o, real_dev, o.untyped_storage().nbytes(), [])
            self.storages[k].log.append(Op(func, rec, spec, geometry(o, k, 0), None, j, rng, True))
        return out

    def _arg(self, x: Any, real_dev: torch.device) -> Any:
        """An argument as recorded: a Ref for a recorded tensor, a copy of a real one, the real device for meta."""
        if self.key_of(x) is not None:
            return self.ref(x)
        if isinstance(x, torch.Tensor):
            return Kept(x, x._version) if self.by_reference else x.detach().clone()
        if isinstance(x, torch.device) and x.type == "meta":
            return real_dev
        return x

    def _real_flat(self, flat: list, written: list | None = None) -> list:
        """The arguments with recorded tensors replayed (written ones: scratch tensors of the same geometry)."""
        replay = Replayer(self)
        out = []
        for x in flat:
            if written is not None and any(x is w for w in written):
                out.append(self._scratch(x))
            elif self.key_of(x) is not None:
                out.append(replay.value(self.ref(x)))
            else:
                out.append(x)
        dev = next((self.device_of(x) for x in flat if self.key_of(x) is not None), torch.get_default_device())
        return [dev if isinstance(x, torch.device) and x.type == "meta" else x for x in out]

    def _scratch(self, t: torch.Tensor) -> torch.Tensor:
        """A real tensor of ``t``'s size, stride, dtype and device, in one storage reused by every draw (one
        allocation the size of the largest param, rather than one per param)."""
        dev = self.device_of(t)
        need = (1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride()))) * t.element_size() if t.numel() else 0
        st = self.scratch.get(dev)
        if st is None or st.nbytes() < need:
            st = self.scratch[dev] = torch.empty(need, dtype=torch.uint8, device=dev).untyped_storage()
        return torch.empty(0, dtype=t.dtype, device=dev).set_(st, 0, t.shape, t.stride())

    def _real(self, func: Any, flat: list, spec: Any) -> Any:
        with torch.no_grad():
            args, kwargs = tree_unflatten(self._real_flat(flat), spec)
            return func(*args, **kwargs)

    def _draw(self, func: Any, flat: list, spec: Any, device: torch.device, written: list) -> tuple:
        """A random op: the state of its generator, then the same draw for real, thrown away (module docstring)."""
        gen = next((x for x in flat if isinstance(x, torch.Generator)), None) or _default_generator(device)
        state = gen.get_state()
        with torch.no_grad():
            args, kwargs = tree_unflatten(self._real_flat(flat, written), spec)
            func(*args, **kwargs)
        return gen, state


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not x.is_meta:
        return x.detach().to(_META)
    if isinstance(x, torch.device):
        return _META
    if isinstance(x, torch.Generator):
        return None
    return x


class Looks(TorchFunctionMode):
    """The other half of the block: a recorded tensor *looks* like the real tensor it stands for to Python code
    (``is_meta`` False, ``device`` its real device), so code that skips meta tensors (``nn.init.trunc_normal_``,
    ``orthogonal_``, ``sparse_``, ``dirac_``) runs as in a plain build; ``tolist()`` /
    ``numpy()`` of one give the replayed values."""

    _READS = frozenset({"tolist", "numpy", "__array__"})

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.rec = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        rec = self.rec
        if rec.busy or not args or rec.key_of(args[0]) is None:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__":
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            device = rec.device_of(args[0])
            if prop == "is_meta":
                return False
            if prop == "device":
                return device
            if prop in ("is_cpu", "is_cuda"):
                return device.type == prop[3:]
        elif name == "get_device":
            device = rec.device_of(args[0])
            return device.index if device.type == "cuda" else -1
        elif name in self._READS:
            rec.busy = True
            try:
                with torch.no_grad():
                    return func(Replayer(rec).value(rec.ref(args[0])), *args[1:], **kwargs)
            finally:
                rec.busy = False
        return func(*args, **kwargs)
