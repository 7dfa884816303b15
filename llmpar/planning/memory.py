"""Per-rank memory: model states under ZeRO stages 0-3 (Rajbhandari et al. 2020), activations (Korthikanti et al.
2022) and communication buffers.

Model states. With psi parameters on a rank's (tp, pp) shard and dp data-parallel ranks, a precision mode stores
P bytes of parameters, G of gradients and K of optimizer state (fp32 master copy, Adam m and v) per parameter:

    mode          P  G   K   total   what
    fp32          4  4   8   16      fp32 params/grads, fp32 m, v (no master copy)
    fp32_master   2  2  12   16      bf16 params/grads, fp32 master + m + v (the ZeRO paper's K = 12)
    bf16_sr       2  2   4    8      bf16 params/grads/m/v, stochastic rounding instead of a master copy
    bf16_kahan    2  2   6   10      bf16 params/grads/m/v + a bf16 Kahan compensation buffer
    int8          4  4   2.03  10.03 fp32 params/grads, 8-bit m, v + a float32 scale per 256 (AdamW8bit)
    int4          4  4   1.06   9.06 fp32 params/grads, 4-bit m, v + a float32 scale per 128 (AdamW4bit)
    int8_master   2  2   6.03  10.03 bf16 params/grads, fp32 master + 8-bit m, v (+ scales)
    int4_master   2  2   5.06   9.06 bf16 params/grads, fp32 master + 4-bit m, v (+ scales)
    (low-bit states: ``llmpar.ops.lowbit``; each moment takes bits/8 B + 4 B per block of 256 / 128 elements)

    stage 0: (P + G + K) psi        stage 1: (P + G) psi + K psi / dp
    stage 2: P psi + (G + K) psi / dp   stage 3: (P + G + K) psi / dp + P psi_persist

For psi = 7.5e9, dp = 64, fp32_master: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB; as dp grows the savings over stage 0 tend
to 16/4 = 4x, 16/2 = 8x and dp. Stage 3 keeps its small params (``stage3_param_persistence_threshold``: biases,
norms, small matrices: psi_persist) gathered on every rank, next to their shards. G is 4 when low-precision grads
accumulate in fp32 (``grad_accum_fp32``: llmpar does so under gradient accumulation). CPU offload (``"optimizer"``)
runs the step on the host in fp32 whatever the mode: an fp32 master (fp32 params get one too: the copy the host
steps), fp32 m and v and the reduced gradient partition in fp32, 16 psi / dp of host memory; the device keeps P psi
(stage 3: P psi / dp) and, below stage 2, its gradient accumulator G psi. ``"optimizer+params"`` (stage 3) moves the
parameter shards to the host as well. These are the bytes llmpar's ZeroOptimizer holds (``memory_bytes()``), up to
the padding of each unit to a multiple of dp x 16 elements (``tests/test_planning_vs_runtime.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .context import activation_breakdown
from .layout import (  # noqa: F401  (Layout and its modes: importable from here as before)
    CHECKPOINT_MODES,
    OFFLOAD_MODES,
    Layout,
    check_choice,
    check_degree,
)
from .model_spec import ModelSpec, count_params
from .zeropp import dp_nodes, zeropp_state_bytes

# low-bit states: bytes of m + v per parameter (codes + one float32 scale per block; llmpar.ops.lowbit's BLOCK)
LOWBIT_MOMENT_BYTES: dict[str, float] = {"int8": 2 * (1 + 4 / 256), "int4": 2 * (0.5 + 4 / 128)}
# mode -> (param bytes P, grad bytes G, optimizer bytes K) per parameter
PRECISION_BYTES: dict[str, tuple[int, int, float]] = {
    "fp32": (4, 4, 8),
    "fp32_master": (2, 2, 12),
    "bf16_sr": (2, 2, 4),
    "bf16_kahan": (2, 2, 6),
    "int8": (4, 4, LOWBIT_MOMENT_BYTES["int8"]),
    "int4": (4, 4, LOWBIT_MOMENT_BYTES["int4"]),
    "int8_master": (2, 2, 4 + LOWBIT_MOMENT_BYTES["int8"]),
    "int4_master": (2, 2, 4 + LOWBIT_MOMENT_BYTES["int4"]),
}
_MASTER_MODES = ("fp32_master", "int8_master", "int4_master")
HOST_STEP_BYTES = 16  # offload: fp32 master + fp32 m, v + the fp32 gradient partition, per param, over dp


def host_step_bytes(precision: str) -> float:
    """Host bytes per parameter (over dp) of the offloaded step: fp32 master + gradient partition + m, v (fp32, or
    the low-bit codes and scales)."""
    moments = LOWBIT_MOMENT_BYTES.get(precision.removesuffix("_master"))
    return HOST_STEP_BYTES if moments is None else 8 + moments


PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold's default (llmpar's and DeepSpeed's)
ACT_BYTES = 2  # bf16 activations


@dataclass(kw_only=True, frozen=True)
class MemoryEstimate:
    """Bytes one rank holds on its GPU (and on the host, with offload)."""

    psi_rank: float  # parameters on this rank's (tp, pp) shard, before ZeRO
    params: float
    grads: float
    master: float
    optimizer: float
    activations: float
    buffers: float
    cpu: float  # host bytes of this rank (offload)
    zeropp: float = 0.0  # hpZ secondary shard + qgZ error-feedback residuals (``zeropp.zeropp_state_bytes``)
    experts: float = 0.0  # GPU model-state bytes of the routed experts (a part of params .. optimizer)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def dense(self) -> float:
        """GPU model-state bytes of everything but the routed experts."""
        return self.model_states - self.experts

    @property
    def total(self) -> float:
        """GPU bytes: model states + activations + communication buffers + ZeRO++ state."""
        return self.model_states + self.activations + self.buffers + self.zeropp

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "model_states": self.model_states, "dense": self.dense, "total": self.total}


def model_state_bytes(
    psi: float,
    *,
    dp: int = 1,
    zero_stage: int = 0,
    precision: str = "fp32_master",
    offload: str = "none",
    persistent: float = 0.0,
    grad_accum_fp32: bool = False,
) -> dict[str, float]:
    """Per-rank GPU and CPU bytes of params / grads / master / optimizer for ``psi`` parameters (see module doc);
    ``persistent``: elements stage 3 keeps gathered on every rank (``ModelSpec.small_params``).

    Returns keys params, grads, master, optimizer (GPU) and cpu (host)."""
    check_choice("precision", precision, list(PRECISION_BYTES))
    check_choice("zero_stage", zero_stage, (0, 1, 2, 3))
    check_choice("offload", offload, OFFLOAD_MODES)
    check_degree("dp", dp)
    if psi < 0 or not 0 <= persistent <= psi:
        raise ValueError(f"psi={psi!r} must be >= 0 and persistent={persistent!r} in [0, psi]")
    p, g, k = PRECISION_BYTES[precision]
    g = max(g, 4) if grad_accum_fp32 else g
    master_k = 4 if precision in _MASTER_MODES else 0
    params = p * psi / (dp if zero_stage >= 3 else 1)
    grads = g * psi / (dp if zero_stage >= 2 else 1)
    master = master_k * psi / (dp if zero_stage >= 1 else 1)
    optimizer = (k - master_k) * psi / (dp if zero_stage >= 1 else 1)
    cpu = 0.0
    if offload != "none":
        # the host step's fp32 master, m, v and gradient partition; from stage 2 on the device keeps no gradients
        cpu += host_step_bytes(precision) * psi / dp
        master = optimizer = 0.0
        if zero_stage >= 2:
            grads = 0.0
    if offload == "optimizer+params":
        cpu += params + grads
        params = grads = 0.0
    if zero_stage == 3:  # the persistent params' gathered copies stay on the device
        params += p * persistent
    return {"params": params, "grads": grads, "master": master, "optimizer": optimizer, "cpu": cpu}


def zero_savings(*, stage: int, dp: int, precision: str = "fp32_master") -> float:
    """Stage-0 model-state bytes over stage-``stage`` bytes (the paper's 4x / 8x / N_d as dp grows)."""
    base = model_state_bytes(1.0, dp=dp, zero_stage=0, precision=precision)
    staged = model_state_bytes(1.0, dp=dp, zero_stage=stage, precision=precision)
    return sum(base.values()) / sum(staged.values())


def activation_bytes_per_layer(
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    n_heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    checkpointing: str = "none",
) -> float:
    """Activation bytes one layer keeps for backward (Korthikanti et al. 2022, bf16, s = seq, b = micro-batch,
    h = hidden, a = heads, t = tp), derived for a GPT block with 4h MLP and dropout; an estimate for others:

        no parallelism:            s b h (34 + 5 a s / h)
        tp, no sequence parallel:  s b h (10 + 24 / t + 5 a s / (h t))
        tp + sequence parallel:    s b h (34 + 5 a s / h) / t
        selective recompute:       drop the 5 a s / h attention-score term
        full recompute:            2 s b h (/ t with sequence parallel): only each layer's input
    """
    check_choice("checkpointing", checkpointing, CHECKPOINT_MODES)
    s, b, h, a, t = seq_len, micro_batch, hidden, n_heads, tp
    sbh = s * b * h
    if checkpointing == "full":
        return 2.0 * sbh / (t if sequence_parallel else 1)
    attn = 0.0 if checkpointing == "selective" else 5.0 * a * s / h
    if sequence_parallel:
        return sbh * (34.0 + attn) / t
    return sbh * (10.0 + 24.0 / t + attn / t)


def estimate_memory(
    model: ModelSpec | Any,
    layout: Layout,
    *,
    precision: str = "fp32_master",
    micro_batch: int = 1,
    seq_len: int | None = None,
    micro_batches_in_flight: int | None = None,
    bucket_bytes: float = 100e6,
    activation_spec: ModelSpec | None = None,
    persistence_threshold: int = PERSISTENCE_THRESHOLD,
    grad_accum_fp32: bool = False,
    gpus_per_node: int | None = None,
    attention_q_chunk: int | None = None,
) -> MemoryEstimate:
    """Per-rank memory of ``model`` (a ``ModelSpec`` or an ``nn.Module``) trained with ``layout``.

    - model states: ``model_state_bytes`` on the busiest (tp, pp) shard (``ModelSpec.params_per_rank``; for a
      module, psi / (tp pp)); a mixture of experts splits it (``ModelSpec.stage_split``): the routed experts, E / ep
      of each MoE layer, shard over edp = dp cp / ep and the rest over dp cp (``experts``: their GPU bytes); at
      ZeRO-3 with the tensors of at most ``persistence_threshold`` elements kept gathered
      (``ModelSpec.small_params``; for a module, its params that small);
    - activations: per layer as in ``activation_bytes_per_layer``, x layers per stage x micro-batches in flight
      (1F1B: the first stage holds min(pp, m) of them; default pp), plus 4 s b V / t bytes of fp32 logits on the
      last stage; with full recompute, one more layer's full activations while it is recomputed;
    - buffers: two gradient buckets of ``bucket_bytes`` when dp > 1, and at ZeRO-3 the gathered layers in
      parameter precision: two (current + prefetched), or K + 1 when ``stage3_max_reuse_distance`` keeps K layers
      gathered from forward to backward (at most all of them);
    - zeropp (the layout's ZeRO++ options): hpZ's secondary shard, P (psi - psi_persist) / k, held from forward to
      backward (persistent params are not gathered through it), and with qgZ error feedback a float32 residual of
      every gradient, 4 psi, + 4 psi / k' when the reduction runs in two levels (k' = hpZ's k, else the dp ranks of
      a node: ``gpus_per_node`` / tp; None: one node).
    Activations are bf16 (doubled for fp32 params: ``precision`` "fp32", "int8", "int4"). With ``layout.cp > 1``
    or ``layout.tiled`` they are ``context.activation_breakdown(...).peak`` instead (flash-style attention;
    ``attention_q_chunk``: the torch attention path's score tile, None for a fused kernel), and the model states
    shard over dp x cp.
    For an ``nn.Module`` the activations come from ``activation_spec`` (zero without one).
    """
    check_degree("micro_batch", micro_batch)
    spec = model if isinstance(model, ModelSpec) else activation_spec
    if isinstance(model, ModelSpec):
        psi_rank: float = model.params_per_rank(tp=layout.tp, pp=layout.pp)
        small: float = model.small_params(persistence_threshold, tp=layout.tp, pp=layout.pp)
    else:
        psi_rank = count_params(model) / (layout.tp * layout.pp)
        small = sum(p.numel() for p in model.parameters() if p.numel() <= persistence_threshold) / (
            layout.tp * layout.pp
        )
    routed = 0.0
    if isinstance(model, ModelSpec) and model.num_experts:
        if model.num_experts % layout.ep:
            raise ValueError(f"ep={layout.ep} does not divide num_experts={model.num_experts} of model {model.name!r}")
        dense, routed = model.stage_split(tp=layout.tp, pp=layout.pp, ep=layout.ep)
        psi_rank, small = dense + routed, min(small, dense)  # the routed experts shard over edp, never persist
    elif layout.ep > 1:
        raise ValueError(f"ep={layout.ep} needs a model with experts (num_experts > 0)")
    shard = dict(
        zero_stage=layout.zero_stage, precision=precision, offload=layout.offload, grad_accum_fp32=grad_accum_fp32
    )
    states = model_state_bytes(
        psi_rank - routed,
        dp=layout.dp * layout.cp,
        persistent=small if layout.zero_stage == 3 else 0.0,
        **shard,  # type: ignore[arg-type]
    )
    expert_states = model_state_bytes(routed, dp=layout.dp * layout.cp // layout.ep, **shard)  # type: ignore[arg-type]
    states = {k: v + expert_states[k] for k, v in states.items()}
    p_bytes = PRECISION_BYTES[precision][0]
    activations = 0.0
    buffers = 2.0 * min(bucket_bytes, PRECISION_BYTES[precision][1] * psi_rank) if layout.dp > 1 else 0.0
    if spec is not None:
        spec.check_layout(tp=layout.tp, pp=layout.pp)
        s = seq_len or spec.seq_len
        in_flight = layout.pp if micro_batches_in_flight is None else min(layout.pp, micro_batches_in_flight)
        check_degree("micro_batches_in_flight", in_flight)
        common = dict(
            seq_len=s,
            micro_batch=micro_batch,
            hidden=spec.hidden,
            n_heads=spec.n_heads,
            tp=layout.tp,
            sequence_parallel=layout.sequence_parallel,
        )
        per_layer = activation_bytes_per_layer(**common, checkpointing=layout.activation_checkpointing)
        layers = spec.n_layers // layout.pp
        recompute = activation_bytes_per_layer(**common) if layout.activation_checkpointing == "full" else 0.0
        logits = 4.0 * s * micro_batch * spec.vocab / layout.tp
        first = in_flight * layers * per_layer + recompute
        last = layers * per_layer + recompute + logits
        activations = max(first, last) if layout.pp > 1 else layers * per_layer + recompute + logits
        activations *= 2.0 if p_bytes == 4 else 1.0  # the formula counts 2-byte activations (fp32 params: 4)
        if layout.cp > 1 or layout.tiled:
            activations = activation_breakdown(
                spec,
                layout,
                seq_len=s,
                micro_batch=micro_batch,
                act_bytes=4 if p_bytes == 4 else 2,
                q_chunk=attention_q_chunk,
            ).peak
        if layout.zero_stage == 3:
            kept = spec.stage3_kept_layers(layout.stage3_max_reuse_distance, tp=layout.tp, pp=layout.pp)
            buffers += max(2, min(layers, kept + 1)) * p_bytes * spec.layer_params(layout.tp, ep=layout.ep)
    per_node = (
        None
        if gpus_per_node is None
        else dp_nodes(tp=layout.tp, dp=layout.dp, pp=layout.pp, gpus_per_node=gpus_per_node)[0]
    )
    zeropp = zeropp_state_bytes(layout, psi_rank, psi_rank - small, p_bytes, per_node)
    experts = sum(v for k, v in expert_states.items() if k != "cpu")
    return MemoryEstimate(
        psi_rank=psi_rank, activations=activations, buffers=buffers, zeropp=zeropp, experts=experts, **states
    )
