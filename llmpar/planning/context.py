"""Long-context activation memory and traffic: context parallelism over cp ranks (Ulysses all-to-all, ring attention,
hybrid), the sequence-tiled loss and MLP (``llmpar.context_parallel.tiled``) and activation checkpointing.

Per rank, with S the sequence, s = ceil(S / cp) its tokens, b the micro-batch, h hidden, f the MLP width, k = KV
heads x head_dim, t = tp (``/t*``: divided by t with tensor sequence parallelism only), e bytes per activation
element, the elements one layer keeps for backward (attention is flash-style: q, k, v, out and the per-row lse, never
the S x S scores):

    norms' inputs and outputs     4 s b h /t*
    q, k, v, attention output     s b (2h + 2k') / t        k' = k (ring); Ulysses over u ranks keeps full-sequence
                                                            k / u per rank, at least one head: max(k, u head_dim)
    MLP intermediates             n_f s b f / t             n_f = 4 gated (gate, up, act, product), 2 plain
    tiled MLP                     the intermediates are not kept (one slice of ``tile`` tokens rebuilt in backward)
    full recompute                s b h /t* per layer (its input), plus one layer rebuilt during its backward

Ulysses holds the full sequence for h / u heads inside attention, the same element count as s tokens of all heads;
ring holds s tokens and passes k / v blocks. Transient, inside one layer, the larger of attention's and the MLP's:

    attention, the sum of what applies:
      Ulysses   the local q, k, v (held by the caller during the call) and their all-to-all send copies:
                                                                        2 s b (h + 2k') / t
      ring      the k / v block computed and the one arriving, and in backward the travelling dk / dv: 8 s b k_r / t
      torch attention path (``q_chunk`` rows per score tile; None = a fused kernel, no workspace), fp32:
                keys and values upcast and repeated to the query heads, dq / dk / dv accumulators, and three
                score-sized tiles alive at once (forward: s, s - lse, p; backward: p, dout v^T - delta, ds):
                4 b a_r s_k (5 d + 3 min(q_chunk, s_k))      a_r = a / (t u), s_k = s u (the block one step sees)
    tiled MLP   one slice's intermediates:                              n_f min(tile, s) b f / t

The loss: untiled, fp32 logits and their log-softmax for every token, 8 s b V / t bytes; tiled, the fp32 lse of every
token and one tile's logits and probabilities: 4 s b + 8 min(tile, s) b V / t.

    peak = layers x kept + max(loss, rebuilt layer + workspace)

Traffic per layer and micro-batch (bytes a rank sends): Ulysses all-to-alls of q, k, v forward and of out, and their
gradients in backward: 2 (u-1)/u s b (2h + 2k') e / t; ring: k, v blocks forward, k, v and dk, dv backward, over r-1
steps: 6 (r-1) s_r b k_r e / t (s_r, k_r: the ring's block: hybrid runs it on u's output, s u tokens of k / u);
full recompute adds one more forward's share. Ulysses' all-to-alls are exposed; the ring's transfers overlap the
block computation, so only what exceeds the rank's attention compute (12 h S FLOPs per token and layer, fwd + bwd)
is exposed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

CP_MODES = ("ulysses", "ring", "hybrid")
DEFAULT_TILE = 4096  # tokens per tile of the tiled loss and MLP


@dataclass(kw_only=True, frozen=True)
class ActivationBreakdown:
    """Activation bytes of one rank (module doc): ``kept`` by all the layers of a stage, ``rebuilt`` (full
    recompute: one layer's kept activations rebuilt in its backward), ``workspace`` (the largest transient inside a
    layer) and ``loss``."""

    kept: float
    rebuilt: float
    workspace: float
    loss: float
    tokens: int  # s, tokens on this rank

    @property
    def peak(self) -> float:
        return self.kept + max(self.loss, self.rebuilt + self.workspace)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "peak": self.peak}


def split_cp(layout: Any) -> tuple[int, int]:
    """(u, r): the Ulysses and ring degrees of a layout's context parallelism."""
    cp, mode = layout.cp, layout.cp_mode
    if cp == 1:
        return 1, 1
    if mode == "ulysses":
        return cp, 1
    if mode == "ring":
        return 1, cp
    return layout.ulysses_size, cp // layout.ulysses_size


def _kv_width(spec: Any, u: int) -> int:
    head_dim = spec.hidden // spec.n_heads
    return max(spec.n_kv_heads * head_dim, u * head_dim)


def activation_breakdown(
    spec: Any,
    layout: Any,
    *,
    seq_len: int,
    micro_batch: int = 1,
    act_bytes: int = 2,
    q_chunk: int | None = None,
    layers: int | None = None,
) -> ActivationBreakdown:
    """Activation bytes of one rank for ``spec`` under ``layout`` (its tp, cp, cp_mode, tiled, tile,
    activation_checkpointing, sequence_parallel) at ``seq_len`` (module doc). ``layers``: the stage's layers
    (default all); ``q_chunk``: rows per score tile of the torch attention path (None: a fused kernel)."""
    S, b, h, t = seq_len, micro_batch, spec.hidden, layout.tp
    u, r = split_cp(layout)
    s = math.ceil(S / layout.cp)
    tsp = t if layout.sequence_parallel else 1
    k = spec.n_kv_heads * (h // spec.n_heads)
    kk = _kv_width(spec, u)
    n_f = 4 if spec.gated_mlp else 2
    f = spec.ffn_hidden
    e = act_bytes
    mlp = n_f * s * b * f / t * e
    full = (4 * s * b * h / tsp + s * b * (2 * h + 2 * kk) / t) * e + (0.0 if layout.tiled else mlp)
    ckpt = layout.activation_checkpointing == "full"
    per_layer = s * b * h / tsp * e if ckpt else full
    n_layers = spec.n_layers if layers is None else layers
    attn = 2 * s * b * (h + 2 * kk) / t * e if u > 1 else 0.0
    if r > 1:
        attn += 8 * s * b * (kk if u > 1 else k) / t * e
    if q_chunk is not None:
        a_r, s_k = spec.n_heads / (t * u), s * u
        attn += 4.0 * b * a_r * s_k * (5 * (h // spec.n_heads) + 3 * min(q_chunk, s_k))
    work = max(attn, n_f * min(layout.tile, s) * b * f / t * e if layout.tiled else 0.0)
    V = spec.vocab
    loss = 4.0 * s * b + 8.0 * min(layout.tile, s) * b * V / t if layout.tiled else 8.0 * s * b * V / t
    return ActivationBreakdown(
        kept=n_layers * per_layer, rebuilt=full if ckpt else 0.0, workspace=work, loss=loss, tokens=s
    )


def cp_traffic(
    spec: Any,
    layout: Any,
    *,
    seq_len: int,
    micro_batch: int = 1,
    micro_batches: int = 1,
    act_bytes: int = 2,
) -> tuple[float, float]:
    """(Ulysses bytes, ring bytes) one rank sends per step (module doc)."""
    u, r = split_cp(layout)
    s, b, h, t, e = math.ceil(seq_len / layout.cp), micro_batch, spec.hidden, layout.tp, act_bytes
    passes = 1.5 if layout.activation_checkpointing == "full" else 1.0  # another forward's share
    per = spec.n_layers * micro_batches * passes
    k = spec.n_kv_heads * (h // spec.n_heads)
    kk = _kv_width(spec, u)
    ulysses = 2 * (u - 1) / u * s * b * (2 * h + 2 * kk) * e / t * per if u > 1 else 0.0
    s_r, k_r = (s * u, kk / u) if u > 1 else (s, k)
    ring = 6 * (r - 1) * s_r * b * k_r * e / t * per if r > 1 else 0.0
    return ulysses, ring


def attention_seconds(spec: Any, layout: Any, *, seq_len: int, tokens_per_rank: float, flops_per_s: float) -> float:
    """Seconds of one rank's attention matmuls (12 h S FLOPs per token and layer, fwd + bwd, / tp): what the ring's
    transfers hide behind."""
    return 12.0 * spec.n_layers * spec.hidden * seq_len * tokens_per_rank / layout.tp / flops_per_s


def cp_words(layout: Any) -> str:
    """What a layout's context parallelism and tiling do, for the planner's explanation."""
    u, r = split_cp(layout)
    parts = []
    if layout.cp > 1:
        how = {
            "ulysses": f"Ulysses all-to-all over {u} (full sequence, heads / {u} inside attention)",
            "ring": f"ring attention over {r} (k/v blocks passed, overlapped with the blocks)",
            "hybrid": f"Ulysses over {u} inside, ring over {r} across",
        }[layout.cp_mode]
        parts.append(f"cp={layout.cp} {how}: sequence / {layout.cp} per rank, ZeRO over dp x cp")
    if layout.tiled:
        parts.append(f"tiled loss + MLP ({layout.tile} tokens per tile)")
    return "; ".join(parts)
