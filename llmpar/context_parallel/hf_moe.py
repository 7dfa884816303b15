"""The router load-balancing loss of transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE) over a
context-parallel batch: the whole sequence's loss, not each rank's slice's.

transformers' ``load_balancing_loss_func`` over the router logits of ``L`` layers, each [T, E] (T = B * S tokens,
rows batch-major), with ``p = softmax(logits)`` and the top-k experts of each row:

    f_e = (number of top-k picks of expert e over the layers' real rows) / R,   R = L * (real tokens)
    P_e = (sum of p_e over the layers' real rows) / R
    aux = E * sum_e f_e * P_e

``f`` has no gradient (a count). Under context parallelism each cp rank holds the rows of its slice: the picks and
``R`` are summed over the cp ranks first (a no-grad all-reduce), so ``f`` is the whole sequence's; then this rank's
part ``c_r = E * sum_e f_e * (its sum of p_e) / R`` is differentiable in its own router logits, and
``aux = sum_r c_r``. Its value is summed over the cp ranks and its gradient is ``cp`` times this rank's part, as
``ContextParallel.token_mean`` does for the token loss (the gradient reduction then averages over dp * cp ranks).
Real rows: ``k_valid`` [B, S_local] (the shard's padding and masked tokens out), every row when None.

:class:`RouterLogits` records the router logits itself (a forward hook on each module of the router class the model
names in ``_can_record_outputs["router_logits"]``, kept by llmpar's swapped MoE blocks): the adapter runs the model
with ``output_router_logits=False``, since the model's own loss of them would read the adapter's empty 4-D attention
mask as its padding mask.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from llmpar.distributed.collectives import all_reduce


def router_aux_loss(
    router_logits: Sequence[torch.Tensor],
    k_valid: torch.Tensor | None,
    num_experts: int,
    top_k: int,
    cp: Any,
) -> torch.Tensor:
    """The whole sequence's load-balancing loss (module docstring), a 0-d float32 (float64 kept) tensor, the same
    value on every cp rank. ``router_logits``: one [B * S_local, E] tensor per MoE layer."""
    if not router_logits:
        raise ValueError("router_logits is empty: the model recorded no router output (output_router_logits)")
    first = router_logits[0]
    dtype = torch.promote_types(first.dtype, torch.float32)
    rows = first.shape[0]
    mask = torch.ones(rows, dtype=dtype, device=first.device) if k_valid is None else k_valid.reshape(-1).to(dtype)
    if mask.numel() != rows:
        raise ValueError(f"router logits have {rows} rows but the batch slice has {mask.numel()} tokens")
    picks = torch.zeros(num_experts, dtype=dtype, device=first.device)
    prob_sum = torch.zeros(num_experts, dtype=dtype, device=first.device)
    for logits in router_logits:
        if tuple(logits.shape) != (rows, num_experts):
            raise ValueError(f"router logits of shape {tuple(logits.shape)}, expected [{rows}, {num_experts}]")
        p = torch.softmax(logits.to(dtype), dim=-1)
        chosen = torch.topk(p.detach(), top_k, dim=-1).indices
        picks.scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        prob_sum = prob_sum + (p * mask[:, None]).sum(dim=0)
    counts = torch.cat([picks, (mask.sum() * len(router_logits)).reshape(1)]).detach()
    for group in cp.groups:
        all_reduce(counts, group, what="context-parallel router picks and rows")
    total = counts[-1].clamp(min=1.0)
    part = num_experts * (counts[:-1] / total * prob_sum / total).sum()
    # value sum_r part_r; gradient cp * (this rank's part): token_mean of part * cp over a count of cp
    return cp.token_mean(part * cp.size, 1)


class RouterLogits:
    """The router logits of an MoE causal LM's running forward, one [B * S_local, E] tensor per MoE layer (module
    docstring); ``experts``, ``top_k``, ``coef`` (``router_aux_loss_coef``) from the model."""

    def __init__(self, model: torch.nn.Module, experts: int, top_k: int, coef: float) -> None:
        self.experts, self.top_k, self.coef = experts, top_k, coef
        self._logits: list[torch.Tensor] | None = None
        spec = getattr(model, "_can_record_outputs", None) or {}
        spec = spec.get("router_logits")
        cls, self._index = getattr(spec, "target_class", spec), getattr(spec, "index", 0)
        found = [m for m in model.modules() if isinstance(cls, type) and isinstance(m, cls)]
        if not found:
            raise ValueError(f"{type(model).__name__}: found no router module ({spec!r}) whose logits to record")
        for m in found:
            m.register_forward_hook(self._record)

    @classmethod
    def of(cls, model: torch.nn.Module) -> RouterLogits | None:
        """The recorder of a transformers MoE causal LM (it has ``router_aux_loss_coef``), else None."""
        coef = getattr(model, "router_aux_loss_coef", None)
        if coef is None:
            return None
        experts, top_k = getattr(model, "num_experts"), getattr(model, "num_experts_per_tok")  # noqa: B009
        return cls(model, int(experts), int(top_k), float(coef))

    def _record(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._logits is not None:  # a recording forward (not a recomputation in backward, not generate)
            self._logits.append(output[self._index])

    def start(self) -> None:
        self._logits = []

    def stop(self) -> tuple[torch.Tensor, ...]:
        """The logits recorded since :meth:`start`; recording off."""
        out, self._logits = tuple(self._logits or ()), None
        return out

    def aux_loss(self, k_valid: torch.Tensor | None, cp: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(the whole sequence's load-balancing loss, the recorded logits); recording off."""
        logits = self.stop()
        return router_aux_loss(logits, k_valid, self.experts, self.top_k, cp), logits


__all__ = ["RouterLogits", "router_aux_loss"]
