"""A small GPT (GPT-2 style, pre-LN) used by the demo, the tests and the benchmarks.

Shapes (B = batch, T = tokens <= seq_len, d = d_model, V = vocab_size, h = n_head, hd = d / h):

    idx [B, T] (int64) -> tok_emb + pos_emb -> x [B, T, d]
    for each block:  x = x + attn(ln1(x));  x = x + mlp(ln2(x))
    ln_f -> lm_head -> logits [B, T, V]

Module names are stable so that a tensor-parallel plan can match them by pattern, and ``pipeline_blocks()`` gives
the sequence a pipeline split cuts (``embed``, ``blocks.0`` ... ``blocks.{n-1}``, ``head``: :class:`GPTEmbedding`,
the blocks, :class:`GPTHead`, sharing the model's modules):

    tok_emb                 nn.Embedding  W: [V, d]            (vocab-parallel: split rows)
    pos_emb                 nn.Embedding  W: [seq_len, d]      (replicated)
    blocks.{i}.ln1 / ln2    nn.LayerNorm  [d]                  (replicated)
    blocks.{i}.attn.qkv     nn.Linear     W: [3 d, d]          (column-parallel: split rows, whole heads per rank)
    blocks.{i}.attn.proj    nn.Linear     W: [d, d]            (row-parallel: split columns)
    blocks.{i}.mlp.fc       nn.Linear     W: [d_ff, d]         (column-parallel)
    blocks.{i}.mlp.proj     nn.Linear     W: [d, d_ff]         (row-parallel)
    ln_f                    nn.LayerNorm  [d]
    lm_head                 nn.Linear     W: [V, d], no bias   (column-parallel over the vocabulary)

The qkv output is laid out head-major, ``[h, 3, hd]`` (per head: q, then k, then v), so that a contiguous split of
its rows into ``tp`` chunks gives each rank whole heads with their own q, k and v. The attention module reads the
number of heads it holds from the qkv output width, so a column-split qkv with ``3 d / tp`` rows just works.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmpar.distributed.agree import raise_if_any_failed
from llmpar.distributed.collectives import all_reduce, group_size
from llmpar.distributed.errors import TokenIdError


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of the GPT. ``d_ff`` defaults to ``4 * d_model``.

    ``tie_embeddings`` is off by default: a pipeline split puts ``tok_emb`` and ``lm_head`` on different stages.
    """

    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    d_ff: int | None = None
    seq_len: int = 128
    dropout: float = 0.0
    tie_embeddings: bool = False
    bias: bool = True
    ln_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} must be a positive integer")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if not isinstance(self.d_ff, int) or self.d_ff < 1:
            raise ValueError(f"GPTConfig.d_ff={self.d_ff!r} must be a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")
        if self.init_std <= 0:
            raise ValueError(f"GPTConfig.init_std={self.init_std} must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention(is_causal=True)``.

    x: [B, T, d] -> qkv(x): [B, T, h_local * 3 * hd] -> per head q, k, v: [B, h_local, T, hd]
    -> SDPA -> [B, T, h_local * hd] -> proj -> [B, T, d]
    ``h_local = n_head`` here, ``n_head / tp`` once ``qkv``/``proj`` are replaced by column/row-parallel layers.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor, cp_batch: tuple | None = None) -> torch.Tensor:
        """``cp_batch``: ``(cp, shard, k_valid)`` when x holds this rank's tokens of a sequence split by context
        parallelism (``GPT.forward`` passes it): attention over the whole sequence through ``cp.attention``."""
        B, T, _ = x.shape
        qkv = self.qkv(x)
        width = qkv.shape[-1]
        if width % (3 * self.head_dim):
            raise ValueError(f"qkv output width {width} is not a multiple of 3 * head_dim = {3 * self.head_dim}")
        local_heads = width // (3 * self.head_dim)
        q, k, v = qkv.view(B, T, local_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        if cp_batch is not None:
            cp, shard, k_valid = cp_batch
            y = cp.attention(q, k, v, shard=shard, k_valid=k_valid, causal=True)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        return self.proj(y.transpose(1, 2).reshape(B, T, local_heads * self.head_dim))


class MLP(nn.Module):
    """x: [B, T, d] -> fc: [B, T, d_ff] -> GELU -> proj: [B, T, d]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.d_ff is not None
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``; x: [B, T, d]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cp_batch: tuple | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), cp_batch) if cp_batch is not None else self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


IGNORE_INDEX = -100  # F.cross_entropy's default: targets holding it are left out of the mean


def lm_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int | None = None,
    group: Any = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean next-token cross-entropy. logits: [B, T, V], targets: [B, T] (int64) -> scalar (fp32 or wider); targets
    equal to ``IGNORE_INDEX`` (-100) are left out. ``reduction="sum"``: their sum instead (context parallelism).

    A target outside ``[0, V)`` (other than -100) raises a :class:`TokenIdError` (a ValueError and an IndexError)
    naming it and ``V`` on CPU; on an accelerator ``F.cross_entropy``'s device-side assert fires. ``vocab_size``: the
    V the logits must have (a model's loss passes its own; split vocab-parallel logits are refused, they need
    ``llmpar.vocab_parallel_cross_entropy``). ``group``: the tensor-parallel group whose ranks compute this same loss
    (a model split by ``llmpar.parallelize``): a bad target on any of its ranks then raises on every one of them (CPU:
    one 1-element all-reduce per call, the message gathered only on failure; accelerators: a 1-element all-reduce and a
    device-side assert, no host sync), instead of one rank raising while the others wait in the backward.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on [B, T]")
    if targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"targets must hold integer class ids, got dtype {targets.dtype}")
    V = logits.shape[-1]
    if vocab_size is not None and V != vocab_size:
        raise ValueError(
            f"GPT.loss: logits have {V} classes, the model's vocab_size={vocab_size}: GPT.loss takes the "
            "full-vocabulary logits; split vocab-parallel logits (parallelize(..., gather_logits=False)) "
            "go to llmpar.vocab_parallel_cross_entropy(logits, targets, group)"
        )
    _check_targets(targets, V, group)
    flat = logits.reshape(-1, V)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    if reduction not in ("mean", "sum"):
        raise ValueError(f'reduction={reduction!r} must be "mean" or "sum"')
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction=reduction)


def _check_targets(targets: torch.Tensor, V: int, group: Any) -> None:
    """Raise (CPU) / assert (accelerators) on every rank of ``group`` if any rank holds a target outside [0, V)."""
    bad = ((targets < 0) | (targets >= V)) & (targets != IGNORE_INDEX)
    cpu = targets.device.type == "cpu"
    if group is None or group_size(group) == 1:
        if cpu and bool(bad.any()):  # elsewhere F.cross_entropy's device-side assert
            raise _target_error(targets[bad], V)
        return
    if cpu:
        where = f" on global rank {dist.get_rank()}"
        raise_if_any_failed(
            _target_error(targets[bad], V, where) if bool(bad.any()) else None,
            group,
            what="GPT.loss",
            types=(TokenIdError,),
        )
        return
    flag = bad.any().to(torch.int32).reshape(1)
    all_reduce(flag, group, op="max")
    torch._assert_async(
        flag[0] == 0, f"GPT.loss: a target id outside the vocabulary [0, {V}) on a rank of the tensor-parallel group"
    )


def _target_error(bad: torch.Tensor, V: int, where: str = "") -> TokenIdError:
    ids = sorted(set(bad.tolist()))
    return TokenIdError(
        f"GPT.loss: target id(s) {ids[:8]}{' ...' if len(ids) > 8 else ''}{where} outside the "
        f"vocabulary of {V} classes: targets must be in [0, {V}) or {IGNORE_INDEX} (ignored)"
    )


class _StaticOrBound:
    """A function that is static on the class (``GPT.loss(logits, y)``) and bound on a model (``model.loss``: then
    ``bound(model, ...)``)."""

    def __init__(self, static: Callable[..., Any], bound: Callable[..., Any]) -> None:
        self.static, self.bound = static, bound
        self.__doc__ = bound.__doc__

    def __get__(self, obj: Any, owner: Any = None) -> Callable[..., Any]:
        return self.static if obj is None else self.bound.__get__(obj, owner)


class GPTEmbedding(nn.Module):
    """ids [B, T] (int) -> dropout(tok_emb(ids) + pos_emb(arange(T))): [B, T, d]. Shares ``gpt``'s modules."""

    def __init__(self, gpt: "GPT") -> None:
        super().__init__()
        self.tok_emb = gpt.tok_emb
        self.pos_emb = gpt.pos_emb
        self.drop = gpt.drop
        self.seq_len = gpt.config.seq_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, tokens], got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than seq_len={self.seq_len}")
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))


class GPTHead(nn.Module):
    """x [B, T, d] -> lm_head(ln_f(x)): logits [B, T, V]. Shares ``gpt``'s modules."""

    def __init__(self, gpt: "GPT") -> None:
        super().__init__()
        self.ln_f = gpt.ln_f
        self.lm_head = gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """The GPT. ``GPT(cfg, seed=s)`` gives the same weights for the same ``s`` on any device and dtype
    (drawn in fp32 on a CPU generator, then cast), so single-device and parallel runs start equal."""

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.to(device=device, dtype=dtype)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 init: N(0, init_std) weights, residual projections scaled by 1/sqrt(2 n_layer), zero biases,
        LayerNorm (1, 0). Deterministic in ``seed`` and independent of device and dtype."""
        cfg = self.config
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        for name, p in self.named_parameters():  # registration order: deterministic
            module_name, leaf = name.rsplit(".", 1)
            owner = module_name.rsplit(".", 1)[-1]
            if isinstance(self.get_submodule(module_name), nn.LayerNorm):
                p.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                p.zero_()
            else:
                std = resid_std if owner == "proj" else cfg.init_std
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """idx: [B, T] token ids (int64), T <= seq_len -> logits [B, T, V]. ``position_ids``: [T] or [B, T] (default
        ``arange(T)``). Prepared for context parallelism (``llmpar.context_parallel.adapters``) and inside
        ``cp.batch``, idx holds this rank's tokens and attention runs over the whole sequence."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, tokens], got shape {tuple(idx.shape)}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype}")
        T = idx.shape[1]
        if T > self.config.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.config.seq_len}")
        pos = torch.arange(T, device=idx.device) if position_ids is None else position_ids
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        cp = self.__dict__.get("context_parallel")  # a plain attribute set by the adapter, never a submodule
        current = cp.current if cp is not None else None
        batch = (cp, *current) if current is not None else None  # passed on, so a block's recompute sees it too
        for block in self.blocks:
            x = block(x, batch) if batch is not None else block(x)
        return self.lm_head(self.ln_f(x))

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        """The model as the sequence of blocks a pipeline split cuts (``llmpar.pipeline.blocks.to_blocks``):
        ``embed`` (ids [B, T] -> x [B, T, d]), ``blocks.{i}`` (x -> x), ``head`` (x -> logits [B, T, V]). The
        blocks hold this model's own modules, so tied weights stay shared and tensor-parallel plans still match."""
        return [
            ("embed", GPTEmbedding(self)),
            *((f"blocks.{i}", b) for i, b in enumerate(self.blocks)),
            ("head", GPTHead(self)),
        ]

    def _model_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of this model's logits (:func:`lm_loss`): the logits must cover the model's
        vocabulary, and under tensor parallelism (the model split by ``llmpar.parallelize``) a bad target on any rank
        of the tp group raises on every rank. ``GPT.loss(logits, targets)`` on the class: :func:`lm_loss` alone."""
        return lm_loss(logits, targets, vocab_size=self.config.vocab_size, group=self.tp_group())

    loss = _StaticOrBound(lm_loss, _model_loss)

    def tp_group(self) -> Any:
        """The tensor-parallel group of this model's parallel layers (the first module holding a ``group`` of more
        than one rank), or None when it is not split."""
        for m in self.modules():
            if getattr(m, "tp", 1) > 1 and getattr(m, "group", None) is not None:
                return m.group
        return None

    def num_params(self, *, exclude_embeddings: bool = False) -> int:
        """Parameter count (shared tensors once); optionally without the token and position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.pos_emb.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.tok_emb.weight.numel()
        return n

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations. idx: [B, T0] -> [B, T0 + max_new_tokens]; the context is cut to
        the last ``seq_len`` tokens; ``temperature=0`` is greedy."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.seq_len :])[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
