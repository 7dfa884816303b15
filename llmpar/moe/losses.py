"""The router's auxiliary losses, as pure functions of the router's fp32 logits / scores.

Notation: T tokens, E experts, k experts per token, ``p: [T, E]`` the per-token score distribution the losses read
(:func:`aux_scores`: the softmax, or the sigmoid normalised to sum to one over the experts), ``c_i`` the number of
the T * k token-expert slots that pick expert i.

- :func:`load_balancing_loss` (Switch Transformer; Mixtral / Qwen-MoE; Megatron-Core's ``aux_loss``)::

      L_aux = E * sum_i f_i * P_i,   f_i = c_i / (k T),   P_i = (1/T) sum_t p_ti

  ``f`` carries no gradient (counts), ``P`` does. A perfectly balanced router (``f_i = P_i = 1/E``) gives 1.
  transformers' ``load_balancing_loss_func`` leaves out the ``1/k`` (its value is ``k * L_aux``).

- :func:`sequence_aux_loss` (DeepSeek-V3's complementary sequence-wise balance loss; Megatron's ``seq_aux_loss``):
  the same loss computed within each sequence of S tokens and averaged over the B sequences::

      L_seq = (1/B) sum_b E * sum_i f_bi * P_bi,   f_bi = c_bi / (k S),   P_bi = (1/S) sum_{t in b} p_ti

- :func:`z_loss` (ST-MoE): ``L_z = (1/T) sum_t (log sum_i exp(logits_ti))^2``, keeping the logits small.

The counts ``c`` are those of the plain top-k of ``p`` (:func:`aux_counts`), as in Megatron-Core and DeepSeek-V3's
definition: the expert bias, group limits and forced balance change which experts serve a token, not what the loss
measures. With no token (T = 0) every loss is a zero connected to the graph.
"""

from __future__ import annotations

import torch

SCORE_FUNCS = ("softmax", "sigmoid")


def aux_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """``p: [T, E]``, rows summing to one: ``softmax(logits)``, or ``s / sum_j s_j`` with ``s = sigmoid(logits)``
    (computed in the logits' dtype)."""
    if score_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_func == "sigmoid":
        s = torch.sigmoid(logits)
        return s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    raise ValueError(f"score_func={score_func!r} is not one of {SCORE_FUNCS}")


def aux_counts(p: torch.Tensor, top_k: int) -> torch.Tensor:
    """``c: [..., E]``: how many of the top-``top_k`` choices of ``p: [..., T, E]`` pick each expert (float, no
    gradient), summed over the token dimension."""
    idx = torch.topk(p.detach(), top_k, dim=-1).indices
    one_hot = torch.zeros_like(p, dtype=p.dtype).scatter_(-1, idx, 1.0)
    return one_hot.sum(dim=-2)


def _zero(t: torch.Tensor) -> torch.Tensor:
    return t.sum() * 0.0


def load_balancing_loss(p: torch.Tensor, top_k: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    """``L_aux = E * sum_i c_i / (k T) * mean_t p_ti`` for ``p: [T, E]`` (see the module docstring); ``counts``
    defaults to :func:`aux_counts`."""
    T, E = p.shape
    if T == 0:
        return _zero(p)
    c = aux_counts(p, top_k) if counts is None else counts.to(p.dtype)
    return E * torch.sum(c / (top_k * T) * p.mean(dim=0))


def sequence_aux_loss(p: torch.Tensor, top_k: int, seq_len: int) -> torch.Tensor:
    """``L_seq``: :func:`load_balancing_loss` within each sequence of ``seq_len`` consecutive tokens of ``p: [T, E]``
    (T a multiple of ``seq_len``), averaged over the sequences."""
    T, E = p.shape
    if T == 0:
        return _zero(p)
    if seq_len < 1 or T % seq_len:
        raise ValueError(f"seq_len={seq_len} does not divide the {T} tokens into whole sequences")
    ps = p.view(T // seq_len, seq_len, E)
    c = aux_counts(ps, top_k)  # [B, E]
    per_seq = E * torch.sum(c / (top_k * seq_len) * ps.mean(dim=1), dim=-1)
    return per_seq.mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``L_z = mean_t logsumexp(logits_t)^2`` for ``logits: [T, E]``."""
    if logits.shape[0] == 0:
        return _zero(logits)
    return torch.logsumexp(logits, dim=-1).square().mean()


__all__ = ["SCORE_FUNCS", "aux_counts", "aux_scores", "load_balancing_loss", "sequence_aux_loss", "z_loss"]
