"""gpt-oss's router and experts in llmpar's MoE block (:mod:`llmpar.moe.hf` swaps ``GptOssMLP`` with them).

gpt-oss differs from the SwiGLU experts of :class:`~llmpar.moe.experts.Experts` in three ways, reproduced here:

- the router has a bias and normalises after the top-k: ``logits = x W^T + b``, ``idx, top = topk(logits, k)``,
  ``w = softmax(top)`` (fp32, fp64 for fp64);
- the experts have biases and are stored transposed with gate and up interleaved:
  ``gate_up_proj [E, H, 2I]`` (columns 0, 2, 4, ... the gate, 1, 3, 5, ... the up), ``gate_up_proj_bias [E, 2I]``,
  ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``;
- the activation is a clamped SwiGLU: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
  ``a = (u + 1) * g * sigmoid(alpha g)``; ``y = a D + d``.

The experts run per local expert (a loop of matmuls on the rows the dispatcher sorted by expert), so an expert with
no rows still gets zero (not missing) gradients. The tensors keep transformers' names, so the swapped block's state
dict is the model's.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmpar.moe.experts import counts_list
from llmpar.moe.router import Router, Routing


class GptOssRouter(Router):
    """``weight [E, H]``, ``bias [E]``; ``forward(x [T, H]) -> Routing`` (see the module docstring)."""

    bias: nn.Parameter

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> Routing:
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.weight.to(dtype), self.bias.to(dtype))
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        w = torch.softmax(top, dim=1)
        with torch.no_grad():
            nonfinite = (~torch.isfinite(logits)).any(dim=-1).sum()
            counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts)
        return Routing(
            indices=idx, weights=w, logits=logits, nonfinite=nonfinite, counts=counts, aux_loss=logits.sum() * 0.0
        )


class GptOssExperts(nn.Module):
    """This rank's experts in gpt-oss's layout (see the module docstring); ``forward(x_sorted [N, H], counts)`` as
    :class:`~llmpar.moe.experts.Experts`."""

    gate_up_proj: nn.Parameter
    gate_up_proj_bias: nn.Parameter
    down_proj: nn.Parameter
    down_proj_bias: nn.Parameter

    def __init__(self, tensors: dict[str, torch.Tensor], alpha: float, limit: float) -> None:
        super().__init__()
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            t = tensors[name]
            self.register_parameter(name, t if isinstance(t, nn.Parameter) else nn.Parameter(t))
        self.alpha, self.limit = float(alpha), float(limit)

    def forward(self, x_sorted: torch.Tensor, counts: "Sequence[int] | torch.Tensor") -> torch.Tensor:
        sizes = counts_list(counts)
        outs = []
        for e, rows in enumerate(torch.split(x_sorted, sizes)):
            gate_up = rows @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate = gate_up[..., ::2].clamp(max=self.limit)
            up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            outs.append(act @ self.down_proj[e] + self.down_proj_bias[e])
        return torch.cat(outs) if outs else x_sorted

    def extra_repr(self) -> str:
        e, h, two_i = self.gate_up_proj.shape
        return f"{e} local experts, hidden={h}, intermediate={two_i // 2}, alpha={self.alpha}, limit={self.limit}"


def gpt_oss_parts(block: Any, first: int, count: int, ep_size: int) -> tuple[GptOssRouter, GptOssExperts]:
    """The router and this rank's experts ``[first, first + count)`` holding ``block``'s tensors (``GptOssMLP``):
    the Parameter objects themselves when ``ep_size`` is 1, copies of the slices otherwise."""
    hf_router, hf_experts = block.router, block.experts
    e, h = hf_router.weight.shape
    router = GptOssRouter(h, e, hf_router.top_k, device="meta")
    router.weight, router.bias = hf_router.weight, hf_router.bias
    tensors: dict[str, torch.Tensor] = {}
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        t = getattr(hf_experts, name)
        if ep_size > 1:
            t = nn.Parameter(t.detach()[first : first + count].clone(), requires_grad=t.requires_grad)
        t.expert_parallel, t.ep_size = True, ep_size  # as llmpar's experts are tagged
        tensors[name] = t
    return router, GptOssExperts(tensors, hf_experts.alpha, hf_experts.limit)


__all__ = ["GptOssExperts", "GptOssRouter", "gpt_oss_parts"]
