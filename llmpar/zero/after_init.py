"""Between an ``llmpar.zero.Init`` block and ``llmpar.initialize``: what the user does to the params still counts.

    with llmpar.zero.Init():
        model = LlamaForCausalLM(cfg)
    model.load_state_dict(torch.load("ckpt.pt"))      # recorded: the engine starts from these values
    nn.init.zeros_(model.lm_head.bias)                # recorded too (as p.zero_(), p.data.normal_(), p[0].fill_(1))
    engine, *_ = llmpar.initialize(model=model, config=...)

The params a block leaves are meta tensors (no memory), so a write into one would do nothing. At the end of the
block each becomes a :class:`DeferredParameter` (an ``nn.Parameter`` whose ``__torch_function__`` is below): every
torch call taking one runs inside its block's recording again (``deferred.py``'s ``Recorder`` and ``Looks``), so an
in-place op on it -- through the param, a view, ``.data``, ``nn.init``, ``load_state_dict``'s ``copy_``, a
``model.to(dtype)`` -- is appended to the log of its storage and replayed by ZeRO-3 when it materialises the
param, after the ops of the block: nothing is dropped. What the recording cannot replay is refused where it runs
(``DeferredInitError``, as in the block). Tensors such a call returns that view recorded storage (a view of a
param, ``.data``, ``p * 2``) are :class:`DeferredTensor` s, recorded the same way.

Real tensors read by these writes (a loaded state dict) are kept by reference, not copied (a state dict on every
rank is not doubled); each is checked at ``initialize``: one changed in place since (its version moved) is an
error naming the param, as the values written are gone. ``p.is_meta`` stays True (llmpar and user code can tell
the model is unmaterialised), except to ``torch.nn.init`` (whose ``trunc_normal_`` / ``orthogonal_`` skip meta
tensors) and to ``Module._load_from_state_dict`` (which would warn that the copy is a no-op): to them the param
looks as in a plain build, as inside the block.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_map

from llmpar.zero.deferred import Looks, Recorder

__all__ = ["DeferredParameter", "DeferredTensor", "REC_ATTR", "watch"]

REC_ATTR = "_llmpar_recorder"  # on each DeferredParameter / DeferredTensor: the Recorder of its block
_LOOKS_REAL_TO = frozenset({"torch.nn.init", "torch.nn.modules.module"})  # torch code that skips meta tensors


def _recorder(args: tuple, kwargs: dict) -> Recorder | None:
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, (DeferredParameter, DeferredTensor)):
            rec = x.__dict__.get(REC_ATTR)
            if rec is not None:
                return rec
    return None


def _wrap(out: Any, rec: Recorder) -> Any:
    """Tensors of ``out`` that view recorded storage, as DeferredTensors (those already watched: as they are)."""

    def one(t: Any) -> Any:
        if (
            not isinstance(t, torch.Tensor)
            or isinstance(t, (DeferredParameter, DeferredTensor))
            or rec.key_of(t) is None
        ):
            return t
        w = t.as_subclass(DeferredTensor)
        w.__dict__[REC_ATTR] = rec
        return w

    return tree_map(one, out)


def _handle(func: Any, args: tuple, kwargs: dict | None) -> Any:
    """A torch call taking a watched tensor: run inside its block's recording (module docstring)."""
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():
        rec = _recorder(args, kwargs)
        name = getattr(func, "__name__", "")
        prop = getattr(getattr(func, "__self__", None), "__name__", "") if name == "__get__" else ""
        if (
            rec is None
            or name in ("__set__", "__repr__", "__format__", "__str__", "__hash__")
            or (name == "__get__" and prop not in ("data", "is_meta"))
        ):
            return func(*args, **kwargs)  # metadata: as the meta tensor has it
        if prop == "is_meta":
            if sys._getframe(2).f_globals.get("__name__") in _LOOKS_REAL_TO:
                return False  # to nn.init and load_state_dict the param looks as in a plain build
            return func(*args, **kwargs)
        if prop == "data":
            return _wrap(func(*args, **kwargs), rec)
        if rec.busy:  # a call made by the recording itself
            return func(*args, **kwargs)
        if rec in _get_current_dispatch_mode_stack():  # already recording (``init.recording``)
            return _wrap(func(*args, **kwargs), rec)
        looks = Looks(rec)
        rec.by_reference = True
        rec.__enter__()
        looks.__enter__()
        try:
            out = func(*args, **kwargs)
        finally:
            looks.__exit__(None, None, None)
            rec.__exit__(None, None, None)
            rec.by_reference = False
            rec.scratch.clear()
        return _wrap(out, rec)


class DeferredParameter(torch.nn.Parameter):
    """A param an ``llmpar.zero.Init`` block left on the meta device: torch calls on it are recorded (module
    docstring). ZeRO-3 swaps it for a plain ``nn.Parameter`` when it materialises the model."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _handle(func, args, kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        """A copy recorded as a ``clone`` of this param as it is now: a DeferredParameter of the same block, its
        recipe and ``init_fn`` carried over, so a copied model materialises as the original would."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            data = self.clone()  # recorded: a new storage, replayed from this one
        rec = self.__dict__.get(REC_ATTR)
        with torch._C.DisableTorchFunctionSubclass():
            out = torch.Tensor._make_subclass(DeferredParameter, data, self.requires_grad)
            for name, value in self.__dict__.items():
                if hasattr(value, "recorder") and hasattr(value, "block") and rec is not None:
                    ref = rec.ref(out)  # the recipe (init.Deferred) of the copy: from the clone on
                    value = type(value)(rec, ref, ref)
                out.__dict__[name] = value
        memo[id(self)] = out
        return out


class DeferredTensor(torch.Tensor):
    """A view of recorded storage handed out after the block (``p.data``, ``p[0]``, ``p.t()``): recorded too."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _handle(func, args, kwargs)


def watch(p: torch.nn.Parameter, rec: Recorder) -> None:
    """Make ``p`` (a recorded meta param at the end of its block) a :class:`DeferredParameter` of ``rec``."""
    if type(p) is torch.nn.Parameter:
        p.__class__ = DeferredParameter
    if isinstance(p, DeferredParameter):
        p.__dict__[REC_ATTR] = rec
