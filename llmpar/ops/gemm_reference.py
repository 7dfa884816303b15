"""The math of the fused linear (``gemm.py``) in plain torch: the activations (``ACTIVATIONS``: a name's position is
its integer code in the Triton kernel, llmpar.kernels.gemm.ACTS, and in csrc/), each activation and its derivative as
torch computes them (the torch backend), act' in float32 with the kernels' own formulas, and the references of the
CUDA ops ``llmpar::linear_lt``, ``llmpar::linear_lt_aux`` and ``llmpar::bias_act_backward`` (their CPU kernels,
``_references.py``; tests compare the GPU kernels with them).

    z = x @ W^T + b;  y = act(z) (+ residual);  dY' = dY * act'(z)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("none", "gelu_tanh", "gelu_erf", "silu", "relu")


def act_torch(z: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if act == "gelu_erf":
        return F.gelu(z)
    if act == "silu":
        return F.silu(z)
    if act == "relu":
        return F.relu(z)
    return z


def act_grad_torch(g: torch.Tensor, z: torch.Tensor, act: str) -> torch.Tensor:
    """g * act'(z), as torch autograd computes it (g cast to z's dtype first)."""
    g = g.to(z.dtype)
    if act == "gelu_tanh":
        return torch.ops.aten.gelu_backward(g, z, approximate="tanh")
    if act == "gelu_erf":
        return torch.ops.aten.gelu_backward(g, z)
    if act == "silu":
        return torch.ops.aten.silu_backward(g, z)
    if act == "relu":
        return torch.ops.aten.threshold_backward(g, z, 0)
    return g


def act_grad_f32(z: torch.Tensor, act: str) -> torch.Tensor:
    """act'(z) in float32 with the formulas of the kernels (Triton ``_act_grad``, csrc/bias_act_kernels.cu)."""
    z = z.float()
    if act == "gelu_tanh":
        t = torch.tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * 0.7978845608028654 * (1 + 0.134145 * z * z)
    if act == "gelu_erf":
        return 0.5 * (1 + torch.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * torch.exp(-0.5 * z * z)
    if act == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if act == "relu":
        return (z > 0).float()
    return torch.ones_like(z)


def bias_act_backward_reference(grad: torch.Tensor, pre: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The math of ``llmpar::bias_act_backward`` in torch: (dY * act'(z) in pre's dtype, its fp32 column sums)."""
    gp = grad.float() * act_grad_f32(pre, ACTIVATIONS[act])
    return gp.to(pre.dtype), gp.sum(0)


def linear_lt_reference(x, weight, bias, act: int, residual):
    """The math of ``llmpar::linear_lt`` in torch: fp32 accumulate, act, residual, one rounding to x's dtype."""
    z = x.float() @ weight.float().t() + (bias.float() if bias is not None else 0)
    y = act_torch(z, ACTIVATIONS[act])
    return (y + residual.float() if residual is not None else y).to(x.dtype)


def linear_lt_aux_reference(x, weight, bias):
    """The math of ``llmpar::linear_lt_aux`` in torch: (gelu_tanh(z), z), both rounded to x's dtype."""
    z = x.float() @ weight.float().t() + (bias.float() if bias is not None else 0)
    return F.gelu(z, approximate="tanh").to(x.dtype), z.to(x.dtype)
