"""What a ZeRO-3 param is between its gathers: an empty tensor (as in DeepSpeed), never a view of freed memory.

While its unit is gathered a param's ``.data`` is its view into the unit's gathered ``[padded]`` tensor (``stage3.py``);
while the unit is released (its storage resized to 0 bytes) ``.data`` is an empty tensor of the param's dtype and
device, and the real shape is kept aside as ``param.ds_shape`` (a ``torch.Size``) and ``param.ds_numel``, the names
DeepSpeed uses. So whatever code outside a gather does with a param has a defined result instead of reading freed
memory: ``.sum()`` is 0, ``.clone()`` / ``.to()`` / ``.cpu()`` / ``.float()`` / ``state_dict()`` / ``torch.save`` give
empty tensors, ``p[0]`` raises IndexError, a matmul raises a shape error, ``module.to(device)`` moves nothing. Read
params whole inside ``llmpar.zero.GatheredParameters`` (or through ``engine.module_state_dict()``).

The view is made once per param and re-attached at every gather, so tensors autograd saved in forward (views of the
same storage) still see the values gathered again for backward. Cost: one ``.data`` assignment per param per gather
and per release (about a microsecond each on CPU).
"""

from __future__ import annotations

from typing import Hashable

import torch

__all__ = ["ParamViews", "shape_of"]


class ParamViews:
    """Per unit key: its params, each one's view into the unit's gathered tensor, and the empty stand-in it holds while
    the unit is released."""

    def __init__(self) -> None:
        self.units: dict[Hashable, list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]]] = {}

    def add(self, key: Hashable, param: torch.nn.Parameter, view: torch.Tensor) -> None:
        """Register ``param`` of unit ``key`` with its ``view`` (not attached yet: :meth:`gathered` does that)."""
        param.ds_shape = view.shape  # type: ignore[attr-defined]
        param.ds_numel = view.numel()  # type: ignore[attr-defined]
        self.units.setdefault(key, []).append((param, view, view.new_empty(0)))

    def gathered(self, key: Hashable) -> None:
        """Unit ``key``'s storage is allocated (its values landed or landing): its params are their views again."""
        for p, view, _ in self.units.get(key, ()):
            p.data = view

    def released(self, key: Hashable) -> None:
        """Unit ``key``'s storage is about to be or was freed: its params hold empty tensors."""
        for p, _, empty in self.units.get(key, ()):
            p.data = empty


def shape_of(param: torch.Tensor) -> torch.Size:
    """The param's full shape: ``ds_shape`` for a ZeRO-3 param (whatever its state), else its own shape."""
    shape = getattr(param, "ds_shape", None)
    return shape if isinstance(shape, torch.Size) else param.shape
