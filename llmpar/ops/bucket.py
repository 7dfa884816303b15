"""Gradient-bucket plumbing: pack many tensors into one flat buffer and unpack it back, with a scale and a dtype cast.

    pack_bucket:   flat[o_i : o_i + n_i] = cast(float32(tensors[i].flatten()) * scale),  o_i = n_0 + ... + n_{i-1}
    unpack_bucket: tensors[i][...]       = cast(float32(flat[o_i : o_i + n_i]) * scale)
One rounding per element: products are formed in float32 with the scale rounded to float32 (float64 data on the
torch path: in float64).
Shapes: tensors[i] any shape with n_i elements; flat: [>= sum n_i], 1-D. Elements past sum n_i are left alone.

Backends (see ``_dispatch``): CUDA extension (``torch.ops.llmpar.*``) -> Triton (``llmpar.kernels.bucket``) -> torch
(``torch.cat`` / ``torch._foreach_*``). The kernels take float32/float16/bfloat16 with one dtype per list; other
inputs (float64, mixed dtypes, strided outputs of unpack) use torch. Not differentiable: this moves gradients.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from llmpar.ops._dispatch import select_backend

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number (python float/int), got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _check_list(tensors: object, name: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name}[{i}] has dtype {t.dtype}; buckets hold floating-point tensors")
        if t.device != tensors[0].device:
            raise ValueError(
                f"{name}[{i}] is on {t.device} but {name}[0] is on {tensors[0].device}; one bucket lives on one device"
            )
    return tensors


def _check_flat(flat: object, name: str, tensors: list[torch.Tensor], list_name: str) -> int:
    """Checks the flat buffer against the list; returns the number of elements the list covers."""
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(flat).__name__}")
    if flat.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(flat.shape)}")
    if not flat.is_floating_point():
        raise TypeError(f"{name} has dtype {flat.dtype}; buckets are floating point")
    if tensors and flat.device != tensors[0].device:
        raise ValueError(f"{name} is on {flat.device} but {list_name} are on {tensors[0].device}")
    total = sum(t.numel() for t in tensors)
    if flat.numel() < total:
        raise ValueError(f"{name} has {flat.numel()} elements but {list_name} hold {total}")
    return total


def _kernel_unfit(list_dtypes: set[torch.dtype], flat: torch.Tensor, strided: bool) -> str | None:
    if len(list_dtypes) > 1:
        return f"the list mixes dtypes {sorted(map(str, list_dtypes))}"
    for dtype in (*list_dtypes, flat.dtype):
        if dtype not in KERNEL_DTYPES:
            return f"dtype {dtype} (kernels take float32, float16, bfloat16)"
    if not flat.is_contiguous():
        return "the flat buffer is not contiguous"
    if strided:
        return "some output tensors are not contiguous"
    return None


def _single_rounding(src: torch.dtype, dst: torch.dtype) -> bool:
    """True when copying src->dst and then multiplying in dst rounds once, like float32(x) * scale -> dst.

    Not for 16-bit dst, even from the same dtype: torch's CPU ``_foreach_mul_`` on bfloat16 / float16 tensors rounds
    the scale to their dtype first (~3% of elements one unit off the float32 product); those go through float32."""
    return dst in (torch.float32, torch.float64)


def _torch_pack(tensors: list[torch.Tensor], dst: torch.Tensor, scale: float) -> None:
    flats = [t.reshape(-1) for t in tensors]
    if scale == 1.0 or all(_single_rounding(t.dtype, dst.dtype) for t in tensors):
        torch.cat(flats, out=dst)
        if scale != 1.0:
            dst.mul_(scale)
        return
    wide = torch.float64 if dst.dtype == torch.float64 else torch.float32
    torch.cat(torch._foreach_mul([f.to(wide) for f in flats], scale), out=dst)


def _torch_unpack(flat: torch.Tensor, outs: list[torch.Tensor], total: int, scale: float) -> None:
    views = [
        v.view(o.shape) if v.is_contiguous() else v.reshape(o.shape)
        for v, o in zip(flat[:total].split([o.numel() for o in outs]), outs)
    ]
    direct = [scale == 1.0 or _single_rounding(flat.dtype, o.dtype) for o in outs]
    d_outs = [o for o, d in zip(outs, direct) if d]
    if d_outs:
        torch._foreach_copy_(d_outs, [v for v, d in zip(views, direct) if d])
        if scale != 1.0:
            torch._foreach_mul_(d_outs, scale)
    w_outs = [o for o, d in zip(outs, direct) if not d]
    if w_outs:
        w_views = [
            v.to(torch.float64 if o.dtype == torch.float64 else torch.float32)
            for v, o, d in zip(views, outs, direct)
            if not d
        ]
        torch._foreach_copy_(w_outs, torch._foreach_mul(w_views, scale))


def pack_bucket(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pack ``tensors`` back to back into a flat buffer, times ``scale``, cast to the buffer's dtype.

    out: [>= sum numel] 1-D buffer to write into; allocated when None (dtype ``dtype``, default: the promoted dtype of
    ``tensors``). Returns ``out``. Non-contiguous inputs are fine (the kernels then read a contiguous copy).
    """
    tensors = _check_list(tensors, "tensors")
    scale = _check_scale(scale)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if out is None:
        if not tensors and dtype is None:
            raise ValueError("tensors is empty: pass out= or dtype= to make an empty bucket")
        if dtype is None:
            dtype = tensors[0].dtype
            for t in tensors[1:]:
                dtype = torch.promote_types(dtype, t.dtype)
        device = tensors[0].device if tensors else None
        out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    elif dtype is not None and out.dtype != dtype:
        raise ValueError(f"dtype={dtype} disagrees with out.dtype={out.dtype}; pass one of them")
    total = _check_flat(out, "out", tensors, "tensors")
    if total == 0:
        return out
    unfit = _kernel_unfit({t.dtype for t in tensors}, out, strided=False)
    backend = select_backend(out.device, kernel_unfit=unfit, op="pack_bucket")
    with torch.no_grad():
        if backend == "torch":
            _torch_pack(tensors, out[:total], scale)
        else:
            srcs = [t.contiguous() for t in tensors if t.numel() > 0]
            if backend == "cuda":
                torch.ops.llmpar.pack_bucket(srcs, out, scale)
            else:
                from llmpar.kernels import bucket as triton_bucket

                triton_bucket.pack(srcs, out, scale)
    return out


def unpack_bucket(flat: torch.Tensor, tensors: Sequence[torch.Tensor], *, scale: float = 1.0) -> list[torch.Tensor]:
    """Copy consecutive slices of ``flat`` (times ``scale``) into ``tensors``, in place, casting to each one's dtype.

    flat: [>= sum numel] 1-D. tensors: the destinations, any shapes; strided ones are fine (torch path).
    Returns ``tensors`` as a list. The destinations must not overlap ``flat``.
    """
    outs = _check_list(tensors, "tensors")
    scale = _check_scale(scale)
    total = _check_flat(flat, "flat", outs, "tensors")
    if total == 0:
        return outs
    strided = any(not o.is_contiguous() for o in outs)
    unfit = _kernel_unfit({o.dtype for o in outs}, flat, strided=strided)
    backend = select_backend(flat.device, kernel_unfit=unfit, op="unpack_bucket")
    live = [o for o in outs if o.numel() > 0]
    with torch.no_grad():
        if backend == "torch":
            _torch_unpack(flat, live, total, scale)
        elif backend == "cuda":
            torch.ops.llmpar.unpack_bucket(flat, live, scale)
        else:
            from llmpar.kernels import bucket as triton_bucket

            triton_bucket.unpack(flat, live, scale)
    return outs
