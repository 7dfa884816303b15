"""DeepSpeed's legacy GShard-style MoE (``deepspeed.moe.sharded_moe``): its top-k gate with capacity dropping, and
the user's expert module replicated per local expert, moved by llmpar's dispatchers (:mod:`llmpar.moe.dispatch`).

The gate (:class:`TopKGate`), for ``x: [S, M]`` and ``wg: [E, M]`` (everything in fp32, fp64 for fp64)::

    logits = x wg^T,  g = softmax(logits)                                   [S, E]
    cf     = capacity_factor in training, eval_capacity_factor in eval
    C      = max(ceil(k cf S / E), min_capacity)    (the k cf product and the ceil in fp32, as DeepSpeed)

- k = 1: expert ``argmax g`` (``noisy_gate_policy="RSample"``: argmax of logits + Gumbel noise, in training;
  ``"Jitter"``: x scaled by U(0.99, 1.01) per element first, in training); ``used_token`` (0 / 1 per token) drops
  the tokens it zeroes. ``L_aux = E sum_e mean_t(g_te) mean_t(m_te)`` with m the one-hot choice. Over capacity, each
  expert keeps the C tokens ``torch.topk`` picks from its one-hot column (``use_rts=True``: the column times
  U(0, 1) noise, Random Token Selection); kept weight ``g_t,e`` (not renormalised).
- k = 2: first ``argmax g``, second the argmax of the logits without the first (``top2_2nd_expert_sampling``: plus
  Gumbel noise, in training and eval). Positions: every first choice in token order, then every second choice; a
  slot is kept when its position in its expert is < C. ``L_aux = E^2 mean_e(mean_t g_te * mean_t m1_te)``. The kept
  weights are renormalised: ``w_j = g_j / max(sum_kept g, eps)``.
- k > 2: the top-k of g; each expert keeps its C slots of highest g (``topk``); ``L_aux = E^2 / k mean_e(mean_t
  g_te mean_t m_te)`` (m: all k choices); kept weights renormalised as for k = 2.

With ``drop_tokens=False`` nothing is dropped. ``exp_counts: [E]`` counts the choices before dropping. DeepSpeed then
pads each expert to C rows and exchanges ``[E, C, M]`` buffers; here the kept slots travel as they are (the layer's
output is the same: a padded row is never read back), ``out_t = sum_j w_tj expert_{e_tj}(x_t)`` summed in fp32 in
slot order, dropped slots contributing zero. The random draws (Gumbel, U) use the default generator in DeepSpeed's
order and shapes, so a seeded run draws the same noise as DeepSpeed's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmpar.distributed import group_size
from llmpar.moe.dispatch import Dispatcher, make_dispatcher
from llmpar.moe.router import Routing

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


def _capacity(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    """``max(ceil(S / E * factor), min_capacity)`` with the product in fp32, as DeepSpeed computes it."""
    cap = torch.ceil(torch.tensor(factor, dtype=torch.float32) * (num_tokens / num_experts))
    return max(int(cap), int(min_capacity))


def _top1(g, logits, cap, used, drop_tokens, use_rts, noisy):
    S, E = g.shape
    idx = torch.argmax(noisy if noisy is not None else g, dim=1)
    mask = F.one_hot(idx, E)
    if used is not None:
        mask = mask * used.view(-1, 1)  # a float used_token makes the mask (and exp_counts) float, as DeepSpeed's
    counts = mask.sum(0)
    l_aux = torch.sum(g.mean(0) * mask.to(g.dtype).mean(0)) * E
    ranked = mask * torch.rand(mask.shape, device=g.device) if use_rts else mask
    keep = mask.sum(1) > 0
    if drop_tokens:
        top = torch.topk(ranked, k=min(cap, S), dim=0).indices
        keep = (mask * torch.zeros_like(mask).scatter_(0, top, 1)).sum(1) > 0
    w = g.gather(1, idx.view(-1, 1))
    return idx.view(-1, 1), w, keep.view(-1, 1), counts, l_aux


def _top2(g, logits, cap, drop_tokens, sampling):
    E = g.shape[1]
    idx1 = torch.argmax(g, dim=1)
    mask1 = F.one_hot(idx1, E)
    if sampling:
        logits = logits + torch.distributions.gumbel.Gumbel(
            torch.tensor(0.0, device=g.device), torch.tensor(1.0, device=g.device)
        ).rsample(logits.shape).to(logits.dtype)
    idx2 = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(idx2, E)
    pos1 = (torch.cumsum(mask1, 0) - 1).gather(1, idx1.view(-1, 1)).view(-1)
    pos2 = (torch.cumsum(mask2, 0) - 1 + mask1.sum(0, keepdim=True)).gather(1, idx2.view(-1, 1)).view(-1)
    l_aux = torch.mean(g.mean(0) * mask1.to(g.dtype).mean(0)) * E * E
    counts = (mask1 + mask2).sum(0)
    keep = torch.stack([pos1, pos2], 1) < cap if drop_tokens else torch.ones(g.shape[0], 2, dtype=torch.bool)
    keep = keep.to(g.device)
    idx = torch.stack([idx1, idx2], 1)
    gk = g.gather(1, idx) * keep.to(g.dtype)
    denom = torch.clamp(gk[:, 0] + gk[:, 1], min=torch.finfo(g.dtype).eps)
    return idx, gk / denom.view(-1, 1), keep, counts, l_aux


def _topk(g, k, cap, drop_tokens):
    S, E = g.shape
    top_g, idx = torch.topk(g, k=k, dim=1)
    mask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, idx, True)
    counts = mask.sum(0)
    l_aux = torch.mean(g.mean(0) * mask.to(g.dtype).mean(0)) * E * E / k
    if drop_tokens:
        ranked = torch.zeros_like(g).scatter(1, idx, top_g)
        chosen = torch.topk(ranked, k=min(cap, S), dim=0, sorted=False).indices
        mask &= torch.zeros_like(g, dtype=torch.bool).scatter_(0, chosen, True)
    gm = g * mask
    gm = gm / torch.clamp(gm.sum(-1, keepdim=True), min=torch.finfo(g.dtype).eps)
    return idx, gm.gather(1, idx), mask.gather(1, idx), counts, l_aux


class TopKGate(nn.Module):
    """DeepSpeed's ``TopKGate`` (see the module docstring): ``wg`` is ``nn.Linear(model_dim, num_experts,
    bias=False)``; ``forward(x [S, M], used_token [S] or None) -> Routing`` with ``keep`` (the kept slots),
    ``counts`` (exp_counts) and ``aux_loss`` (l_aux)."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r} is not one of {NOISY_GATE_POLICIES}")
        for name, value in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a number > 0")
        if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 0:
            raise ValueError(f"min_capacity={min_capacity!r} must be an int >= 0")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.num_experts = k, num_experts
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens, self.use_rts = drop_tokens, use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> Routing:
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        if self.noisy_gate_policy == "Jitter" and self.training:
            noise = torch.distributions.uniform.Uniform(
                torch.tensor(1.0 - 1e-2, device=x.device), torch.tensor(1.0 + 1e-2, device=x.device)
            ).rsample(xf.shape)
            xf = xf * noise.to(dtype)
        logits = F.linear(xf, self.wg.weight.to(dtype))
        S, E = logits.shape
        noisy = None
        if self.k == 1 and self.noisy_gate_policy == "RSample" and self.training:
            gumbel = torch.distributions.gumbel.Gumbel(
                torch.tensor(0.0, device=x.device), torch.tensor(1.0, device=x.device)
            )
            noisy = logits + gumbel.rsample(logits.shape).to(dtype)
        g = torch.softmax(logits, dim=1)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        cap = _capacity(S, E, cf * self.k if self.k > 1 else cf, self.min_capacity)
        if self.k == 1:
            if S < self.min_capacity:
                raise ValueError(
                    f"the MoE layer got {S} tokens, fewer than min_capacity={self.min_capacity} (as DeepSpeed's "
                    "top-1 gate requires): set min_capacity=0 or pass more tokens"
                )
            used = None if used_token is None else used_token.reshape(-1).to(x.device)
            idx, w, keep, counts, l_aux = _top1(g, logits, cap, used, self.drop_tokens, self.use_rts, noisy)
        elif self.k == 2:
            idx, w, keep, counts, l_aux = _top2(g, logits, cap, self.drop_tokens, self.top2_2nd_expert_sampling)
        else:
            idx, w, keep, counts, l_aux = _topk(g, self.k, cap, self.drop_tokens)
        with torch.no_grad():
            nonfinite = (~torch.isfinite(logits)).any(dim=-1).sum()
        return Routing(
            indices=idx,
            weights=w,
            logits=logits,
            nonfinite=nonfinite,
            counts=counts.detach(),
            aux_loss=l_aux,
            keep=keep,
        )


class ModuleExperts(nn.Module):
    """``num_local_experts`` deep copies of the user's expert module (``deepspeed_experts``, DeepSpeed's state-dict
    names). Each parameter is tagged as DeepSpeed tags it (``allreduce=False``, ``group_name``) and as llmpar's
    experts are (``expert_parallel``, ``ep_size``), and with ``expert_index = ("deepspeed_experts", i,
    num_local_experts)``: a gathered state dict names local expert i of ep rank r as global expert ``r n + i``.
    ``forward(x_sorted [N, M], counts)`` runs expert e on its ``counts[e]`` rows (a tuple output's first element) and
    returns the rows in the same order."""

    def __init__(self, expert: nn.Module, num_local_experts: int, group_name: str, ep_size: int) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for i, module in enumerate(self.deepspeed_experts):
            for p in module.parameters():
                p.expert_index = ("deepspeed_experts", i, num_local_experts)  # type: ignore[attr-defined]
                p.allreduce = False  # type: ignore[attr-defined]
                p.group_name = group_name  # type: ignore[attr-defined]
                p.expert_parallel = True  # type: ignore[attr-defined]
                p.ep_size = ep_size  # type: ignore[attr-defined]

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for chunk, expert in zip(torch.split(x_sorted, counts), self.deepspeed_experts):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class LegacyMoELayer(nn.Module):
    """DeepSpeed's ``MOELayer``: ``gate`` (a :class:`TopKGate`) and ``experts`` (:class:`ModuleExperts`, this rank's
    ``num_experts / ep_size``), the tokens moved by the local dispatcher or, once :meth:`set_ep_group` gave it a
    group of ep_size ranks, the all-to-all one. After a forward: ``l_aux`` and ``exp_counts`` (DeepSpeed's).
    ``edp_group``: the ranks holding the same experts (DeepSpeed's expert-data-parallel group), when known: ZeRO
    reduces and shards the experts over it under ``llmpar.initialize``."""

    def __init__(self, gate: TopKGate, experts: ModuleExperts, num_experts: int, ep_size: int) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.num_experts, self.ep_size = num_experts, ep_size
        self.num_local_experts = num_experts // ep_size
        self.ep_group: Any = None
        self.edp_group: Any = None
        self.dispatcher: Dispatcher | None = make_dispatcher(num_experts) if ep_size == 1 else None
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def set_ep_group(self, ep_group: Any, edp_group: Any = None) -> None:
        """Exchange tokens over ``ep_group`` (ep_size ranks); ``edp_group``: its expert-data-parallel group if known."""
        size = 1 if ep_group is None else group_size(ep_group)
        if size != self.ep_size:
            raise ValueError(
                f"the expert-parallel group has {size} ranks, the layer was built with ep_size={self.ep_size}"
            )
        self.ep_group, self.edp_group = ep_group, edp_group
        self.dispatcher = make_dispatcher(self.num_experts, ep_group)

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        if self.dispatcher is None:
            raise ValueError(
                f"the MoE layer has ep_size={self.ep_size} but no expert-parallel group: call "
                "moe.set_deepspeed_parallelism() (after groups._create_expert_and_data_parallel), or pass ep_group="
            )
        hidden = self.gate.wg.in_features
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != hidden or not x.is_floating_point():
            what = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            self.dispatcher.fail(f"the MoE layer's input {what} must be a floating-point tensor [..., {hidden}]")
        flat = x.reshape(-1, hidden)
        routing = self.gate(flat, used_token)
        x_local, counts, meta = self.dispatcher.dispatch_async(flat, routing).wait()
        y_local = self.experts(x_local, counts)
        out = self.dispatcher.combine(y_local, meta)
        self.l_aux, self.exp_counts = routing.aux_loss, routing.counts
        return out.view(x.shape)


def check_moe_args(hidden_size: object, num_experts: object, ep_size: object, k: object) -> None:
    """ValueError / TypeError naming the first of DeepSpeed MoE's sizes that is wrong."""
    for name, value in (("hidden_size", hidden_size), ("num_experts", num_experts), ("ep_size", ep_size), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if num_experts % ep_size:  # type: ignore[operator]
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    if k > num_experts:  # type: ignore[operator]
        raise ValueError(f"k={k} is larger than num_experts={num_experts}: a token picks k distinct experts")


__all__ = ["LegacyMoELayer", "ModuleExperts", "NOISY_GATE_POLICIES", "TopKGate", "check_moe_args"]
