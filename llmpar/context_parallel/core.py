"""ContextParallel: the sequence dimension split over sp ranks, and attention / loss that see the whole sequence.

    cp = ContextParallel("ring", ring_group=mesh["cp"])         # or "ulysses" (ulysses_group), "hybrid" (both)
    cp = ContextParallel.from_mesh(mesh, "hybrid", ulysses_size=2)   # the same over the [pp, dp, cp, tp] mesh's cp axis
    cp.check_batch(seq_len, digest)                             # optional: the cp ranks hold the same batch
    shard = cp.shard(seq_len, device)                           # this rank's tokens (see shard.py)
    x_local = shard_tensor(x, shard, dim=1)                     # ids, labels (pad_value=-100), masks ...
    with cp.batch(shard, k_valid):                              # what attention modules read during one forward
        out = cp.attention(q, k, v, **cp.attention_kwargs())    # q/k/v: this rank's [B, H, S_local, D]
    loss = cp.token_mean(loss_sum, count)                       # the full-sequence mean, on every rank

Modes: "ulysses" (all-to-all over heads, :mod:`.ulysses`), "ring" (k/v blocks passed around, :mod:`.ring`),
"hybrid" (Ulysses inside each group of adjacent ranks, ring across them: sp = ring_size * ulysses_size). cp ranks:
``cp_rank = ring_rank * ulysses_size + ulysses_rank``.

Validation in attention is local (shapes, heads, devices, the shard) and happens before any collective, so with the
same model and sequence length on every rank a bad input raises the same error on every rank instead of hanging a
peer; :meth:`ContextParallel.check_batch` (one fixed-size all-gather per cp group) catches ranks fed different
batches (the engine agrees on every call's tensors the same way, ``llmpar.context_parallel.batch_check``), and a hybrid
layout whose groups do not form a grid is refused at construction on every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any, Iterator

import torch

from llmpar.context_parallel._ring_op import ring_attention_traced
from llmpar.context_parallel.batch_check import agree_batch
from llmpar.context_parallel.loss import token_mean
from llmpar.context_parallel.ring import RingSpec, RingStats, ring_attention
from llmpar.context_parallel.shard import MODES, SeqShard, check_seq_len, layout
from llmpar.context_parallel.ulysses import gather_valid, heads_to_seq, kv_repeats, seq_to_heads
from llmpar.distributed.collectives import all_gather_flat, all_reduce, collective_device
from llmpar.distributed.dims import ParallelDims
from llmpar.distributed.groups import Group, GroupRef, as_group, group_rank, group_size
from llmpar.ops.attention import flash_attention


class ContextParallel:
    """Context parallelism over ``ulysses_group`` and / or ``ring_group`` (process groups or 1-D meshes).

    ``mode``: "ulysses" (ulysses_group only), "ring" (ring_group only) or "hybrid" (both; the Ulysses groups are the
    inner, adjacent ranks). ``size``: sp; ``rank``: this rank's cp rank; ``ring_stats``: per-step compute / wait
    seconds of the ring (:class:`~llmpar.context_parallel.ring.RingStats`)."""

    def __init__(
        self, mode: str, *, ulysses_group: Group | GroupRef | None = None, ring_group: Group | GroupRef | None = None
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not a context-parallel mode: expected one of {MODES}")
        needs = {"ulysses": (True, False), "ring": (False, True), "hybrid": (True, True)}[mode]
        for name, group, needed in (("ulysses_group", ulysses_group, needs[0]), ("ring_group", ring_group, needs[1])):
            if needed and group is None:
                raise ValueError(f"mode={mode!r} needs {name} (a process group or 1-D DeviceMesh), got None")
            if not needed and group is not None:
                raise ValueError(
                    f"mode={mode!r} takes no {name} (ulysses: ulysses_group only; ring: ring_group only; hybrid: both)"
                )
        self.mode = mode
        self.ulysses_group = None if ulysses_group is None else GroupRef(ulysses_group)
        self.ring_group = None if ring_group is None else GroupRef(ring_group)
        self.ulysses_size = 1 if ulysses_group is None else group_size(as_group(ulysses_group))
        self.ulysses_rank = 0 if ulysses_group is None else group_rank(as_group(ulysses_group))
        self.ring_size = 1 if ring_group is None else group_size(as_group(ring_group))
        self.ring_rank = 0 if ring_group is None else group_rank(as_group(ring_group))
        self.size = self.ulysses_size * self.ring_size
        self.rank = self.ring_rank * self.ulysses_size + self.ulysses_rank
        self.ring_stats = RingStats()
        if mode == "hybrid":
            self._check_grid()
        self._current: tuple[SeqShard, torch.Tensor | None] | None = None
        self._memo: dict = {}  # "positions": the last layout used (host and device); "valid": the batch's gathered
        # key mask (a fresh memo inside each batch(), the outer one restored after)

    @classmethod
    def from_mesh(cls, mesh: Any, mode: str, ulysses_size: int | None = None) -> "ContextParallel":
        """Context parallelism over the ``"cp"`` axis of ``mesh`` (the ``[pp, dp, cp, tp]`` mesh of
        ``llmpar.distributed.init_distributed(cp=...)``; for "ulysses" / "ring" also a mesh with only a cp axis).
        ``ulysses_size``: the Ulysses part of a "hybrid" axis (required there; it divides the cp degree): Ulysses over
        that many adjacent cp ranks, ring across (``ParallelDims.split_axis``); for "ulysses" it is the cp degree and
        for "ring" 1 when given. A collective for "hybrid" (its groups are built on every rank)."""
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if "cp" not in names:
            raise ValueError(
                f"mesh has axes {names}: expected a 'cp' axis (llmpar.distributed.init_distributed(cp=N).mesh)"
            )
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not a context-parallel mode: expected one of {MODES}")
        size = mesh["cp"].size()
        if ulysses_size is not None and (isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int)):
            raise TypeError(f"ulysses_size must be an int, got {type(ulysses_size).__name__} {ulysses_size!r}")
        if mode == "hybrid" and (ulysses_size is None or ulysses_size < 1 or size % ulysses_size):
            raise ValueError(
                f'mode="hybrid" needs ulysses_size= a divisor of the cp degree {size} (the Ulysses part), '
                f"got {ulysses_size}"
            )
        expected = {"ulysses": size, "ring": 1, "hybrid": ulysses_size}[mode]
        if ulysses_size is not None and ulysses_size != expected:
            raise ValueError(
                f"ulysses_size={ulysses_size} is not valid with mode={mode!r} over cp={size}: it is {expected}"
            )
        if mode == "ulysses":
            return cls("ulysses", ulysses_group=mesh["cp"].get_group())
        if mode == "ring":
            return cls("ring", ring_group=mesh["cp"].get_group())
        uly, ring = ParallelDims.from_mesh(mesh).split_axis("cp", ulysses_size)  # cp rank = ring * u + ulysses
        return cls("hybrid", ulysses_group=uly, ring_group=ring)

    def __repr__(self) -> str:
        return (
            f"ContextParallel(mode={self.mode!r}, size={self.size}, rank={self.rank}, "
            f"ulysses_size={self.ulysses_size}, ring_size={self.ring_size})"
        )

    def _check_grid(self) -> None:
        """Hybrid: every ring group must join ranks of one Ulysses rank (they hold the same head chunk) and every
        Ulysses group ranks of one ring rank; else raise on every rank (four two-int all-reduces, once)."""
        device = collective_device(self.ulysses_group)
        same = torch.tensor([self.ulysses_rank, -self.ulysses_rank], dtype=torch.int64, device=device)
        all_reduce(same, self.ring_group, op="max", what="context-parallel grid check")
        ring = torch.tensor([self.ring_rank, -self.ring_rank], dtype=torch.int64, device=device)
        all_reduce(ring, self.ulysses_group, op="max", what="context-parallel grid check")
        bad = torch.tensor([int(same[0] != -same[1]) + int(ring[0] != -ring[1])], dtype=torch.int64, device=device)
        for group in self.groups:
            all_reduce(bad, group, op="max", what="context-parallel grid check")
        if int(bad):
            raise ValueError(
                f"hybrid context parallelism: ulysses_group ({self.ulysses_size} ranks) and ring_group "
                f"({self.ring_size} ranks) do not form a grid: each ring group must join the ranks of "
                "one Ulysses rank across the Ulysses groups (e.g. Ulysses [0, 1], [2, 3]; ring [0, 2], "
                "[1, 3])"
            )

    @property
    def groups(self) -> list[GroupRef]:
        """The cp process groups (Ulysses first): together they span this rank's sp ranks."""
        return [g for g in (self.ulysses_group, self.ring_group) if g is not None]

    # ------------------------------------------------------------------ sharding
    def shard(self, seq_len: int, device: torch.device | str | None = None) -> SeqShard:
        """This rank's tokens of a ``seq_len``-token sequence (see :mod:`llmpar.context_parallel.shard`)."""
        check_seq_len(seq_len)
        padded, table = layout(seq_len, self.mode, self.ring_size, self.ulysses_size)
        return SeqShard(index=table[self.rank].to(device or "cpu"), padded_len=padded, seq_len=seq_len)

    def check_batch(self, seq_len: int, fingerprint: str = "") -> None:
        """Raise the same ValueError on every cp rank unless all of them hold a sequence of ``seq_len`` tokens (and
        the same ``fingerprint``, e.g. a digest of the batch's ids): the cp ranks of a group must be fed the same
        batch, else attention's exchanges hang (different lengths) or train on a mix of samples. For a loop of one's
        own: the engine's agreement (:func:`.batch_check.agree_batch`) on a [seq_len]-shaped stand-in and the
        fingerprint's sha256."""
        check_seq_len(seq_len)
        fp = torch.frombuffer(bytearray(hashlib.sha256(fingerprint.encode()).digest()), dtype=torch.int64)
        sequence = torch.ones((), dtype=torch.int8).expand(seq_len)  # only its shape counts
        agree_batch(self, (), {"sequence": sequence, "fingerprint": fp})

    def gather_sequence(self, x: torch.Tensor, shard: SeqShard, dim: int = 1) -> torch.Tensor:
        """The whole sequence of a tensor sharded along ``dim`` by ``shard`` (this rank's ``S_local`` positions,
        e.g. local logits [B, S_local, V]) -> [..., seq_len, ...] in sequence order on every cp rank, padding dropped;
        detached (for metrics and inspection: the loss is computed on the shards). All-gathers over each cp group in
        turn (collective: every cp rank calls it)."""
        self._check_shard(shard)
        if x.shape[dim] != shard.local_len:
            raise ValueError(f"x has {x.shape[dim]} positions along dim {dim} but the shard holds {shard.local_len}")
        out = x.detach().movedim(dim, 0).contiguous()  # [S_local, ...]
        for group in self.groups:  # Ulysses then ring: rows in cp-rank order
            size = group_size(as_group(group))
            buf = torch.empty((size * out.shape[0], *out.shape[1:]), dtype=out.dtype, device=out.device)
            all_gather_flat(buf.view(-1), out.view(-1), group, what="context-parallel gather of a sequence")
            out = buf
        _, table = layout(shard.seq_len, self.mode, self.ring_size, self.ulysses_size)
        full = torch.empty_like(out)
        full[table.reshape(-1).to(out.device)] = out
        return full[: shard.seq_len].movedim(0, dim)

    # ------------------------------------------------------------------ one forward's batch
    @contextlib.contextmanager
    def batch(self, shard: SeqShard, k_valid: torch.Tensor | None = None) -> Iterator[None]:
        """Within the block, :attr:`current` is ``(shard, k_valid)`` (what attention modules read); restored after."""
        self._check_shard(shard)
        previous, self._current = self._current, (shard, k_valid)
        saved, self._memo = self._memo, {}
        try:
            yield
        finally:
            self._current, self._memo = previous, saved

    @property
    def current(self) -> tuple[SeqShard, torch.Tensor | None] | None:
        """``(shard, k_valid)`` of the batch being run (inside :meth:`batch`), else None."""
        return self._current

    def attention_kwargs(self) -> dict:
        """``{"shard": ..., "k_valid": ...}`` of the current batch, for ``cp.attention(q, k, v, **...)``."""
        if self._current is None:
            raise RuntimeError(
                "context-parallel attention ran outside `with cp.batch(shard, k_valid):` (the model "
                "was prepared for context parallelism but called without a sharded batch)"
            )
        shard, k_valid = self._current
        return {"shard": shard, "k_valid": k_valid}

    # ------------------------------------------------------------------ attention
    def _check_shard(self, shard: SeqShard) -> None:
        if not isinstance(shard, SeqShard):
            raise TypeError(f"shard must be a SeqShard (from ContextParallel.shard), got {type(shard).__name__}")
        padded, _ = layout(shard.seq_len, self.mode, self.ring_size, self.ulysses_size)
        if shard.padded_len != padded or shard.local_len * self.size != padded:
            raise ValueError(
                f"shard (seq_len={shard.seq_len}, padded_len={shard.padded_len}, {shard.local_len} "
                f"tokens) was not made by this {self!r} (expected padded_len={padded}, "
                f"{padded // self.size} tokens per rank)"
            )

    def _check_qkv(self, q, k, v, shard: SeqShard, k_valid) -> tuple[int, int]:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be [batch, heads, S_local, head_dim], got shape {tuple(t.shape)}")
        B, Hq, S, D = q.shape
        Hkv = k.shape[1]
        if k.shape != v.shape or k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
            raise ValueError(
                f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [{B}, kv_heads, {S}, {D}] "
                f"to match q {tuple(q.shape)}"
            )
        for name, t in (("k", k), ("v", v), ("k_valid", k_valid)):
            if isinstance(t, torch.Tensor) and t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must share a device")
        if q.dtype != k.dtype or q.dtype != v.dtype or not q.is_floating_point():
            raise TypeError(f"q, k, v must share one floating-point dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if S != shard.local_len:
            raise ValueError(
                f"q has S_local={S} tokens but this rank's shard holds {shard.local_len} (seq_len="
                f"{shard.seq_len} padded to {shard.padded_len} over sp={self.size})"
            )
        if Hkv == 0 or Hq % Hkv:
            raise ValueError(f"query heads {Hq} must be a multiple of kv heads {Hkv}")
        if k_valid is not None and (
            not isinstance(k_valid, torch.Tensor) or k_valid.dtype != torch.bool or tuple(k_valid.shape) != (B, S)
        ):
            got = f"{k_valid.dtype} {tuple(k_valid.shape)}" if isinstance(k_valid, torch.Tensor) else type(k_valid)
            raise ValueError(f"k_valid must be a bool tensor of shape {(B, S)} ([batch, S_local]), got {got}")
        return Hq, Hkv

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        shard: SeqShard,
        k_valid: torch.Tensor | None = None,
        causal: bool = True,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attention of this rank's queries over the whole sequence's keys: ``q`` [B, Hq, S_local, D], ``k`` / ``v``
        [B, Hkv, S_local, D] (rotary already applied), ``k_valid`` [B, S_local] bool (False = a padding key; the
        tokens added to reach ``padded_len`` are masked whatever it says). Causal by global token index. Returns
        [B, Hq, S_local, D] in q's dtype, differentiable in q, k, v. Hq must be a multiple of the Ulysses size."""
        self._check_shard(shard)
        Hq, Hkv = self._check_qkv(q, k, v, shard, k_valid)
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
        ):
            raise ValueError(f"scale must be a finite number (default 1/sqrt(head_dim)), got {scale!r}")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        u = self.ulysses_size
        reps = kv_repeats(Hq, Hkv, u)
        groups, device_groups = self._positions(shard.seq_len, q.device)
        in_batch = self._current is not None and self._current[0] is shard and self._current[1] is k_valid
        if reps > 1:
            k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
        if u > 1:
            q = seq_to_heads(q, self.ulysses_group, u)
            k, v = seq_to_heads(torch.cat([k, v]), self.ulysses_group, u).chunk(2)  # one all-to-all for both
        valid = self._memo.get("valid") if in_batch else None
        if valid is None and k_valid is not None:  # the group's key mask: gathered once per batch
            valid = gather_valid(k_valid.to(torch.uint8), self.ulysses_group, u)
            if in_batch:
                self._memo["valid"] = valid
        if self.mode == "ulysses":
            pos, mask = device_groups[0], None
            if valid is not None or shard.padded_len > shard.seq_len:  # user padding, or tokens added to pad
                mask = (pos < shard.seq_len)[None].expand(q.shape[0], -1)
                mask = mask if valid is None else mask & valid.bool()
            # the group's tokens are 0..padded_len-1 in order, flash_attention's default positions: traced, one
            # tensor passed as both q_pos and k_pos is a graph break (an autograd Function's duplicate input)
            qk_pos = None if torch.compiler.is_compiling() else pos
            out = flash_attention(q, k, v, scale=scale, causal=causal, q_pos=qk_pos, k_pos=qk_pos, k_valid=mask)
        else:
            spec = RingSpec(
                group=self.ring_group,
                positions=groups,
                seq_len=shard.seq_len,
                causal=bool(causal),
                scale=scale,
                stats=self.ring_stats,
                device_positions=device_groups,
            )
            ring = ring_attention_traced if torch.compiler.is_compiling() else ring_attention  # traced: two ops
            out = ring(q.contiguous(), k.contiguous(), v.contiguous(), valid, spec)
        return heads_to_seq(out, self.ulysses_group, u)

    def _positions(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each Ulysses group's token set in rank order, [ring_size, u * S_local] on the CPU and on ``device``
        (kept for the batch: every layer asks for the same)."""
        cached = self._memo.get("positions")
        if cached is None or cached[0] != (seq_len, device):
            _, table = layout(seq_len, self.mode, self.ring_size, self.ulysses_size)
            groups = table.view(self.ring_size, -1)
            cached = self._memo["positions"] = ((seq_len, device), groups, groups.to(device))
        return cached[1], cached[2]

    # ------------------------------------------------------------------ loss
    def token_mean(
        self, loss_sum: torch.Tensor, count: torch.Tensor | int, *, grad_factor: float | None = None
    ) -> torch.Tensor:
        """The mean per-token loss over every cp rank's real tokens (see :func:`.loss.token_mean`); the gradient
        w.r.t. this rank's ``loss_sum`` is ``grad_factor / global_count``, ``grad_factor`` = sp by default (the
        gradient reduction then averages over dp * cp, which sums the cp ranks' parts of a sample)."""
        factor = float(self.size) if grad_factor is None else grad_factor
        return token_mean(loss_sum, count, self.groups, grad_factor=factor)


__all__ = ["ContextParallel"]
