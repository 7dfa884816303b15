"""grad_norm (the global L2 norm of many gradients, float32, no host sync) vs the norm torch's clip_grad_norm_ takes
(``torch.nn.utils.get_total_norm``; the tests' reference, tests/test_grad_norm.py, is clip_grad_norm_ itself), on
grads of one dtype (fp32) and on bf16 grads.
"""

from __future__ import annotations

import torch
from suite_util import IMPLS, grid, once, require, run

from llmpar.ops import grad_norm

SIZES = {"cpu": [(1 << 20, 64), (1 << 23, 64)], "cuda": [(1 << 24, 200), (1 << 27, 200)]}  # (elements, tensors)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _ident(size: tuple[int, int]) -> str:
    return f"{size[0] / 2**20:g}Mx{size[1]}"


def _torch_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: what clip_grad_norm_ calls
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2)))


@once
def _grads(numel: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """n tensors of uneven sizes summing to about numel, random (never zero), each its own scale."""
    g = torch.Generator().manual_seed(0)
    sizes = ((torch.rand(n, generator=g) + 0.05) / 1.05 * 2 * numel / n).long() | 1
    return [(torch.randn(int(s), generator=g) * (i % 7 + 0.5)).to(dtype) for i, s in enumerate(sizes)]


@grid(SIZES, _ident, dtype=DTYPES, impl=IMPLS)
def test_grad_norm(benchmark, device, size, dtype, impl):
    require(impl, device, ("sum_squares",))
    grads = _grads(device, *size, DTYPES[dtype])
    fn = (lambda: _torch_norm(grads)) if impl == "torch" else (lambda: grad_norm(grads))
    run(benchmark, fn, device=device, group=f"grad_norm {dtype} {_ident(size)}", impl=impl)
