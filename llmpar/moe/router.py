"""The router: which k of the E experts serve each token, and with what weight. Always computed in fp32.

For ``x: [T, H]`` and the router weight ``W: [E, H]``::

    logits = x W^T                                  (fp32 whatever x's dtype, fp64 for fp64: x, W cast up first)
    s      = softmax(logits)  or  sigmoid(logits)   ([T, E], score_func)
    choice = s + b                                  (b: the aux-loss-free expert bias, zero unless enabled)
    group limit (n_group > 1): the E experts form n_group groups of E / n_group consecutive experts; a group's score
           is the sum of its two best ``choice`` values (DeepSeek-V3; ``group_score="max"``: its best one,
           DeepSeek-V2); only the topk_group best groups stay in the running, the others' experts get -inf
    idx    = top-k of choice                        ([T, k], best first; force_balance: slot (t, j) takes expert
                                                     (t k + j) mod E, a round-robin that balances the load exactly)
    w      = s[t, idx]                              (the unbiased score: the bias only picks)
    w      = w / (sum_j w_j + 1e-20)                (route_norm: normalised top-k, Mixtral / Qwen3-MoE / DeepSeek-V3)
    w      = w * routed_scaling_factor

The auxiliary losses (:mod:`llmpar.moe.losses`) are computed when their coefficient is positive; ``aux_loss`` is
``aux_loss_coeff * L_aux + seq_aux_loss_coeff * L_seq + z_loss_coeff * L_z``, for the caller to add to its loss.

Aux-loss-free balancing (DeepSeek-V3): with ``expert_bias=True`` the router holds ``b: [E]`` (a buffer, saved with the
model, no gradient) and, in training mode, adds each forward's per-expert token counts into ``expert_load``.
:meth:`Router.update_expert_bias` (after the optimizer step) sums the load over a group (the data-parallel ranks) and
moves ``b_i += rate * sign(mean_j load_j - load_i)``: an overloaded expert is picked less often.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from llmpar.distributed import GroupRef, all_reduce
from llmpar.moe.losses import SCORE_FUNCS, aux_scores, load_balancing_loss, sequence_aux_loss, z_loss

GROUP_SCORES = ("top2_sum", "max")


@dataclass(kw_only=True)
class RouterConfig:
    """How a :class:`Router` scores and picks experts (see the module docstring for the math)."""

    score_func: str = "softmax"
    route_norm: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    force_balance: bool = False

    def check(self, num_experts: int, top_k: int) -> None:
        """Raise a ValueError naming the first argument that does not fit ``num_experts`` / ``top_k``."""
        _check_int("num_experts", num_experts, 1)
        _check_int("top_k", top_k, 1)
        if top_k > num_experts:
            raise ValueError(
                f"top_k={top_k} is larger than num_experts={num_experts}: a token picks top_k distinct experts"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r} is not one of {SCORE_FUNCS}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score={self.group_score!r} is not one of {GROUP_SCORES}")
        _check_int("n_group", self.n_group, 1)
        if num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} does not divide num_experts={num_experts}")
        _check_int("topk_group", self.topk_group, 1)
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} is larger than n_group={self.n_group}")
        if top_k > self.topk_group * (num_experts // self.n_group):
            raise ValueError(
                f"top_k={top_k} is larger than the {self.topk_group * (num_experts // self.n_group)} experts of the "
                f"topk_group={self.topk_group} groups a token may use (n_group={self.n_group}, {num_experts} experts)"
            )
        for name in (
            "routed_scaling_factor",
            "aux_loss_coeff",
            "seq_aux_loss_coeff",
            "z_loss_coeff",
            "bias_update_rate",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")
        if self.routed_scaling_factor == 0:
            raise ValueError("routed_scaling_factor=0 would zero every routed expert's output: use a positive factor")


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")


def route(
    logits: torch.Tensor, top_k: int, config: RouterConfig, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(idx [T, k] int64, w [T, k], s [T, E])`` from ``logits: [T, E]`` (computed in the logits' dtype; the
    :class:`Router` passes fp32). See the module docstring."""
    T, E = logits.shape
    s = torch.softmax(logits, dim=-1) if config.score_func == "softmax" else torch.sigmoid(logits)
    if config.force_balance:
        slots = torch.arange(T * top_k, device=logits.device).view(T, top_k)
        idx = slots % E
    else:
        choice = s.detach()
        if expert_bias is not None:
            choice = choice + expert_bias.to(choice.dtype)
        if config.n_group > 1:
            grouped = choice.view(T, config.n_group, E // config.n_group)
            if config.group_score == "max":
                group_scores = grouped.amax(dim=-1)
            else:
                group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = torch.topk(group_scores, config.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(E // config.n_group, dim=1), float("-inf"))
        idx = torch.topk(choice, top_k, dim=-1).indices
    w = s.gather(1, idx)
    if config.route_norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    if config.routed_scaling_factor != 1.0:
        w = w * config.routed_scaling_factor
    return idx, w, s


@dataclass
class Routing:
    """One forward's routing of T tokens to k of E experts.

    indices:   ``[T, k]`` int64, global expert ids, best first.
    weights:   ``[T, k]`` in the logits' dtype, differentiable (applied to the experts' outputs at the combine).
    logits:    ``[T, E]`` fp32 (fp64 for an fp64 input).
    nonfinite: ``[]`` int64 on the logits' device: how many tokens have a NaN / inf logit (the dispatcher turns a
               non-zero count into an error on every rank of the expert-parallel group).
    counts:    ``[E]`` int64, no gradient: how many of the T * k slots picked each expert.
    aux_losses: the unweighted losses that were computed (``"aux"``, ``"seq_aux"``, ``"z"``).
    aux_loss:  the weighted sum to add to the training loss (a zero connected to the graph when none is on).
    keep:      ``[T, k]`` bool or None: the slots a router that drops by itself kept (DeepSpeed's ``TopKGate``
               capacity, :mod:`llmpar.moe.legacy`); the dispatcher sends only those (None: every slot).
    """

    indices: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor
    nonfinite: torch.Tensor
    counts: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    aux_loss: torch.Tensor | None = None
    keep: torch.Tensor | None = None


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64: how many of ``ids`` (expert ids in ``[0, E)``) pick each expert. ``torch.bincount`` eagerly;
    traced (torch.compile) a scatter-add of fixed size E, as bincount's output size depends on the data."""
    if torch.compiler.is_compiling():
        return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    return torch.bincount(ids, minlength=num_experts)


class Router(nn.Module):
    """Top-k router: ``weight: [E, H]``; ``forward(x [T, H], seq_len) -> Routing``. ``seq_len`` cuts the T tokens
    into sequences for the sequence aux loss (default: one sequence)."""

    expert_bias: torch.Tensor | None
    expert_load: torch.Tensor | None

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        config: RouterConfig | None = None,
        *,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config = config if config is not None else RouterConfig()
        _check_int("hidden_size", hidden_size, 1)
        config.check(num_experts, top_k)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        with torch.no_grad():
            self.weight.normal_(0.0, init_std)
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
            self.register_buffer(
                "expert_load", torch.zeros(num_experts, device=device, dtype=torch.float32), persistent=False
            )
        else:
            self.expert_bias = self.expert_load = None

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> Routing:
        cfg = self.config
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for a float64 reference
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        idx, w, s = route(logits, self.top_k, cfg, self.expert_bias)
        with torch.no_grad():
            nonfinite = (~torch.isfinite(logits)).any(dim=-1).sum()
            counts = expert_counts(idx.reshape(-1), self.num_experts)
            if self.expert_load is not None and self.training:
                self.expert_load += counts.to(self.expert_load.dtype)
        losses: dict[str, torch.Tensor] = {}
        total = logits.sum() * 0.0
        if cfg.aux_loss_coeff > 0 or cfg.seq_aux_loss_coeff > 0:
            p = s if cfg.score_func == "softmax" else aux_scores(logits, cfg.score_func)
            if cfg.aux_loss_coeff > 0:
                losses["aux"] = load_balancing_loss(p, self.top_k)
                total = total + cfg.aux_loss_coeff * losses["aux"]
            if cfg.seq_aux_loss_coeff > 0:
                losses["seq_aux"] = sequence_aux_loss(p, self.top_k, seq_len or max(1, x.shape[0]))
                total = total + cfg.seq_aux_loss_coeff * losses["seq_aux"]
        if cfg.z_loss_coeff > 0:
            losses["z"] = z_loss(logits)
            total = total + cfg.z_loss_coeff * losses["z"]
        return Routing(
            indices=idx, weights=w, logits=logits, nonfinite=nonfinite, counts=counts, aux_losses=losses, aux_loss=total
        )

    @torch.no_grad()
    def update_expert_bias(self, group: "GroupRef | None" = None) -> torch.Tensor:
        """Aux-loss-free balancing step: sum ``expert_load`` over ``group`` (None: this rank's alone), move
        ``b_i += bias_update_rate * sign(mean_j load_j - load_i)``, clear the load; returns the load used. Every rank
        of ``group`` must call it (one all-reduce of E floats)."""
        if self.expert_bias is None or self.expert_load is None:
            raise ValueError("update_expert_bias needs a router built with RouterConfig(expert_bias=True)")
        load = self.expert_load.clone()
        if group is not None:
            all_reduce(load, group, what="MoE router expert load (aux-loss-free bias update)")
        self.expert_bias += self.config.bias_update_rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()
        return load

    def extra_repr(self) -> str:
        c = self.config
        return f"hidden={self.hidden_size}, experts={self.num_experts}, top_k={self.top_k}, score={c.score_func}"


__all__ = ["GROUP_SCORES", "Router", "RouterConfig", "Routing", "route"]
