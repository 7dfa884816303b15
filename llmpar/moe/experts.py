"""The experts: SwiGLU MLPs stored packed in transformers' fused layout, and the shared experts.

Packed layout (transformers >= 5 ``gate_up_proj`` / ``down_proj``, so an HF checkpoint's experts are a slice along
dim 0)::

    gate_up_proj: [E_local, 2 I, H]   rows [0, I) the gate projection, rows [I, 2 I) the up projection
    down_proj:    [E_local, H, I]

Expert e maps its rows ``x_e: [n_e, H]`` to ``y_e = (silu(x_e G_e^T) * (x_e U_e^T)) D_e^T: [n_e, H]`` with
``[G_e; U_e] = gate_up_proj[e]`` and ``D_e = down_proj[e]``.

:func:`grouped_mlp` is the one seam through which every expert computation goes: it takes the tokens already sorted by
local expert (``counts[e]`` rows each, in expert order) and returns their outputs in the same order. It is a
grouped GEMM (``llmpar.ops.grouped_swiglu``: two ``llmpar::grouped_mm`` ops, the SwiGLU in the first one's
epilogue), whose backend is chosen as every op's is: on CPU (and wherever no kernel fits) it is the per-expert loop of
``torch.mm`` calls, equal bitwise to ``F.linear`` per expert under autograd; Triton or ``torch._grouped_mm`` on GPUs.
An expert with no rows still takes part, so its weights get a zero gradient rather than none. ``impl`` narrows the
backends (``llmpar.ops.grouped_gemm_backends``: "auto", "native" without Triton, "loop" the per-expert loop);
:class:`Experts` takes it from its ``grouped_mm_impl`` (``"expert_parallel"``'s ``use_grouped_mm`` /
``disable_triton_grouped_mm`` set it at ``initialize``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmpar.distributed import GroupRef, group_rank, group_size
from llmpar.moe.expert_tp import check_expert_tp, shard_intermediate
from llmpar.ops.grouped_gemm import grouped_swiglu
from llmpar.tensor_parallel.comm import copy_to_tensor_region, reduce_from_tensor_region


def counts_list(counts: "Sequence[int] | torch.Tensor") -> list[int]:
    """Rows per expert as Python ints (one host read of a tensor): what ``torch.split`` and the GEMMs take."""
    return [int(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]


def grouped_mlp(
    x_sorted: torch.Tensor,
    counts: "Sequence[int] | torch.Tensor",
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """SwiGLU experts over tokens sorted by expert: ``x_sorted: [N, H]`` (``counts[e]`` rows for local expert e, in
    order, ``sum(counts) = N``), ``gate_up: [E_local, 2I, H]``, ``down: [E_local, H, I]`` -> ``[N, H]``."""
    if torch.compiler.is_compiling() and isinstance(counts, torch.Tensor):  # no host read (grouped_swiglu checks)
        return grouped_swiglu(x_sorted, counts, gate_up, down, impl=impl)
    sizes = counts_list(counts)
    E, two_i, H = gate_up.shape
    if len(sizes) != E or any(c < 0 for c in sizes):
        raise ValueError(f"counts must hold {E} non-negative row counts (one per local expert), got {sizes}")
    if x_sorted.dim() != 2 or x_sorted.shape[1] != H or sum(sizes) != x_sorted.shape[0]:
        raise ValueError(
            f"x_sorted {tuple(x_sorted.shape)} must be [sum(counts)={sum(sizes)}, hidden={H}] for gate_up "
            f"{tuple(gate_up.shape)}"
        )
    if two_i % 2 or down.shape != (E, H, two_i // 2):
        raise ValueError(
            f"down {tuple(down.shape)} does not match gate_up {tuple(gate_up.shape)}: expected {(E, H, two_i // 2)}"
        )
    return grouped_swiglu(x_sorted, sizes, gate_up, down, impl=impl)


def _tag_expert(p: nn.Parameter, ep_size: int) -> nn.Parameter:
    """Mark a parameter as holding this rank's experts of an expert-parallel group of ``ep_size`` ranks (read by
    the optimizer / checkpoint code: such a parameter is reduced over the expert-data-parallel ranks only)."""
    p.expert_parallel = True  # type: ignore[attr-defined]
    p.ep_size = ep_size  # type: ignore[attr-defined]
    return p


class Experts(nn.Module):
    """This rank's ``E_local = num_experts / ep_size`` experts, global ids ``[ep_rank * E_local, (ep_rank + 1) *
    E_local)``. Initialisation draws the full ``[num_experts, ...]`` weights from the default generator (normal,
    ``init_std``) and keeps this rank's slice, so every ep size builds the same experts from the same seed.

    With an ``etp_group`` of etp ranks each expert's intermediate dimension is split over it
    (:mod:`llmpar.moe.expert_tp`: ``gate_up_proj: [E_local, 2I/etp, H]``, ``down_proj: [E_local, H, I/etp]``, the
    slice of the same full draw); the forward sums the partial outputs over the group. The parameters carry
    ``etp_size`` (1 when unsplit)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        ep_size: int = 1,
        ep_rank: int = 0,
        etp_group: object = None,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.etp_group = None if etp_group is None else GroupRef(etp_group)  # type: ignore[arg-type]
        etp, etp_rank = (1, 0) if self.etp_group is None else (group_size(self.etp_group), group_rank(self.etp_group))
        check_expert_tp(intermediate_size, etp)
        self.etp_size, self.etp_rank = etp, etp_rank
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size ep={ep_size}")
        self.num_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        self.num_local_experts = n = num_experts // ep_size
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        lo = ep_rank * n
        with torch.no_grad():
            gate_up = torch.empty(num_experts, 2 * intermediate_size, hidden_size, device=device, dtype=dtype)
            down = torch.empty(num_experts, hidden_size, intermediate_size, device=device, dtype=dtype)
            gate_up.normal_(0.0, init_std)
            down.normal_(0.0, init_std)
        gate_up, down = gate_up[lo : lo + n].clone(), down[lo : lo + n].clone()
        if etp > 1:
            gate_up, down = shard_intermediate(gate_up, down, etp, etp_rank)
        self.gate_up_proj = _tag_expert(nn.Parameter(gate_up), ep_size)
        self.down_proj = _tag_expert(nn.Parameter(down), ep_size)
        for p in (self.gate_up_proj, self.down_proj):
            p.etp_size = etp  # type: ignore[attr-defined]
        self.grouped_mm_impl = "auto"  # the grouped GEMM backends allowed (module docstring)

    @property
    def first_expert(self) -> int:
        """Global id of local expert 0."""
        return self.ep_rank * self.num_local_experts

    def forward(self, x_sorted: torch.Tensor, counts: "Sequence[int] | torch.Tensor") -> torch.Tensor:
        if self.etp_group is None:
            return grouped_mlp(x_sorted, counts, self.gate_up_proj, self.down_proj, impl=self.grouped_mm_impl)
        group = self.etp_group.get()  # the same rows on every rank of it; each holds I / etp of every expert
        x = copy_to_tensor_region(x_sorted, group)  # backward: the partial input gradients summed
        y = grouped_mlp(x, counts, self.gate_up_proj, self.down_proj, impl=self.grouped_mm_impl)
        return reduce_from_tensor_region(y, group)  # the partial outputs summed

    def extra_repr(self) -> str:
        return (
            f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} of {self.num_experts}, "
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size}"
            + (f" (split over etp={self.etp_size}, rank {self.etp_rank})" if self.etp_size > 1 else "")
        )


class SharedExperts(nn.Module):
    """Experts every token goes through (DeepSeek / Qwen2-MoE): one SwiGLU MLP of width ``intermediate_size`` (n
    shared experts of width I are one MLP of width n I), ``gate_proj`` / ``up_proj`` / ``down_proj`` as transformers
    names them; with ``gate=True`` its output is scaled per token by ``sigmoid(x w_g)`` (Qwen2-MoE's
    ``shared_expert_gate``)::

        shared(x) = [sigmoid(x w_g)] * down(silu(gate_proj(x)) * up_proj(x))
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        gate: bool = False,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)  # type: ignore[arg-type]
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)  # type: ignore[arg-type]
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)  # type: ignore[arg-type]
        self.gate = nn.Linear(hidden_size, 1, **kw) if gate else None  # type: ignore[arg-type]
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.gate is not None:
            y = torch.sigmoid(self.gate(x)) * y
        return y


__all__ = ["Experts", "SharedExperts", "grouped_mlp"]
