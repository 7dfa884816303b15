"""Hugging Face causal LMs (Llama, Qwen2, Mistral; the MoE Mixtral, Qwen2-MoE, Qwen3-MoE) with context parallelism,
no model code copied.

Attention: llmpar's context-parallel attention is registered in transformers' attention-function registry
(``AttentionInterface``) under the name ``"llmpar_cp"``, and :meth:`HFCausalLMAdapter.prepare` switches the model's
``config._attn_implementation`` to it and hands every attention module the ``ContextParallel`` object. The models call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, attention_mask, scaling=..., dropout=...,
sliding_window=...)`` with q: [B, Hq, S_local, D], k / v: [B, Hkv, S_local, D] already rotary-embedded (rotary from the
global position ids the adapter passes); on a sharded batch the function ignores HF's mask (the adapter passes an empty
4-D one, which transformers' mask builders return as it is) and returns ``cp.attention(q, k, v, shard=...,
k_valid=..., causal=True, scale=scaling)`` as [B, S_local, Hq, D]. The batch's ``(shard, k_valid)`` reaches it as
the forward keyword ``llmpar_cp_batch`` (transformers hands a forward's keywords down to the attention function, and
activation checkpointing replays them when it recomputes a layer in backward, after ``cp.batch`` has closed), else
``cp.current``. Outside ``cp.batch`` (``evaluate`` / ``generate`` on whole sequences) it is transformers' SDPA
attention with HF's own mask (the registered mask builder is SDPA's), so a prepared model still runs unsharded.

Batch (:meth:`HFCausalLMAdapter.shard_call`), over this rank's :class:`SeqShard` (global token indices ``index``,
sequence padded to ``padded_len``): ``labels`` [B, S] are shifted on the full sequence first
(``shift[:, i] = labels[:, i + 1]``, -100 at the end; a given ``shift_labels`` is used as it is), then
``input_ids`` / ``inputs_embeds`` / ``attention_mask`` / ``position_ids`` / shifted labels are padded to
``padded_len`` (pad ids 0, labels -100, mask False) and this rank's columns taken. ``position_ids`` default to the
global indices, so rotary follows each rank's slice. Keys are valid where the attention mask is 1 and the token is
not padding (``k_valid`` [B, S_local]). The model runs without labels (its own loss would shift the local slice);
``finish`` computes ``loss_sum`` = the sum of cross entropies (float32, float64 kept) over this rank's labels != -100
and returns the output with ``loss = cp.token_mean(loss_sum, count)``: the full-sequence mean over real tokens.
Where the head's weight is whole on the rank (ZeRO 0-2, no tensor parallelism) the loss is sequence-tiled
(``llmpar.context_parallel.tiled.tiled_lm_loss`` on the base model's final hidden states, ``tiled_chunk`` tokens
at a time; the head runs on no position, ``logits_to_keep`` empty, so the output's logits are [B, 0, V] and the
[B, S_local, V] logits never exist); otherwise (ZeRO-3, a vocab-parallel head, ``tiled_chunk=None``) it is the
cross entropy of the model's local logits, and ``out.logits`` is this rank's [B, S_local, V] slice (zigzag under
ring). For the whole sequence's logits set ``engine.adapter.gather_logits = True`` on every rank: the loss is then
the local logits' (no tiling) and ``out.logits`` the [B, S, V] logits of every position in order, all-gathered over
the cp ranks (``ContextParallel.gather_sequence``; detached: for metrics, the gradient flows through ``out.loss``;
with a vocab-parallel head each tp rank's vocabulary slice). With the
Trainer's ``num_items_in_batch`` (the accumulated batch's token count over all ranks, each cp rank counting the same
batch) the loss is ``token_mean * global_count * cp.size / num_items_in_batch`` (transformers' sum / items,
multiplied back by its world size as for tensor-parallel replicas). MoE models with ``output_router_logits`` (config
or call): the loss adds ``router_aux_loss_coef`` times the whole sequence's load-balancing loss, also the output's
``aux_loss`` (``llmpar.context_parallel.hf_moe``); the experts run on the rank's tokens (spread over ep ranks or not).

Refused with a message (every rank, before any collective): a KV cache, ``logits_to_keep``, a 4-D mask, attention
dropout, packed sequences (``position_ids`` restarting in a row without an attention mask), a sliding window shorter
than the sequence (Mistral / Qwen2: a window >= the sequence length is plain causal attention and runs), a model type
outside those above (DeepSeek-V3's latent attention and gpt-oss's attention sinks named as such).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F

from llmpar.context_parallel.hf_moe import RouterLogits
from llmpar.context_parallel.shard import shard_tensor
from llmpar.context_parallel.tiled import tiled_lm_loss
from llmpar.distributed.collectives import all_reduce
from llmpar.models import anatomy

ATTN_NAME = "llmpar_cp"
TILED_CHUNK = 2048  # tokens per tile of the sequence-tiled loss
BATCH_KEY = "llmpar_cp_batch"  # the forward keyword carrying (shard, k_valid) down to the attention function
SUPPORTED = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe")
REFUSED = {"deepseek_v3": "its multi-head latent attention", "gpt_oss": "its attention sinks"}  # model type -> why
_SEQ_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "shift_labels")


def cp_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``(out [B, S, Hq, D], None)``. Inside ``cp.batch``: the context-
    parallel attention over the whole sequence; otherwise transformers' SDPA attention with ``attention_mask``."""
    cp = getattr(module, "_llmpar_cp", None)
    current = kwargs.pop(BATCH_KEY, None)  # the forward's (shard, k_valid), also there when a block is recomputed
    if current is None and cp is not None:
        current = cp.current
    if current is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if isinstance(attention_mask, torch.Tensor) and attention_mask.numel() == 0:  # the sharded path's marker
            raise RuntimeError(
                "llmpar context-parallel attention got a sharded batch without its shard: call the "
                "model through the engine (adapter.shard_call)"
            )
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if cp is None:
        raise RuntimeError(
            f"{type(module).__name__} got a sharded batch but was not prepared for context "
            "parallelism (HFCausalLMAdapter.prepare attaches the ContextParallel to each attention)"
        )
    shard, k_valid = current
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported with context parallelism: set the model "
            "config's attention_dropout to 0"
        )
    if sliding_window is not None and sliding_window < shard.seq_len:
        raise ValueError(
            f"sliding_window={sliding_window} is shorter than the sequence ({shard.seq_len} tokens): "
            "context parallelism runs full causal attention; use sequences of at most the window"
        )
    out = cp.attention(
        query, key, value, shard=shard, k_valid=k_valid, causal=getattr(module, "is_causal", True), scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"llmpar_cp"`` with transformers' attention functions and mask builders (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_NAME, cp_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _window(config: Any) -> int | None:
    """The model's sliding window if any layer uses one (Mistral: ``sliding_window``; Qwen2: ``use_sliding_window``
    and layer types), else None."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if getattr(config, "model_type", "") in ("qwen2", "qwen2_moe"):
        if not getattr(config, "use_sliding_window", False):
            return None
        types = getattr(config, "layer_types", None)
        if types is not None and "sliding_attention" not in types:
            return None
    return int(window)


class HFCausalLMAdapter:
    """The context-parallel adapter of a transformers causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
    ``MistralForCausalLM``); see the module docstring."""

    def __init__(self, tiled_chunk: int | None = TILED_CHUNK) -> None:
        self.names: list[str] = []  # forward's positional parameter names
        self.window: int | None = None
        self.tiled_chunk = tiled_chunk  # tokens per tile of the loss; None: the model's logits
        self.gather_logits = False  # True: out.logits is the whole sequence's [B, S, V] (gathered, detached)
        self._head: torch.nn.Module | None = None
        self._hidden: list[torch.Tensor] = []  # the base model's output of the running forward (tiled loss)
        self.config: Any = None
        self.routers: RouterLogits | None = None  # an MoE model's router logits (its load-balancing loss)

    # ---- once per model ----
    def prepare(self, model: torch.nn.Module, cp: Any) -> None:
        """Route the model's attention through ``cp``: register ``"llmpar_cp"``, set it as the config's attention
        implementation, attach ``cp`` to every attention module."""
        config = getattr(model, "config", None)
        kind = getattr(config, "model_type", None)
        if kind not in SUPPORTED or not type(model).__name__.endswith("ForCausalLM"):
            why = f" (context parallelism does not run {REFUSED[kind]})" if kind in REFUSED else ""
            raise ValueError(
                f"context parallelism supports the transformers causal LMs of type {', '.join(SUPPORTED)} "
                f"(LlamaForCausalLM, ...); got {type(model).__name__} (model_type={kind!r}){why}"
            )
        if getattr(config, "attention_dropout", 0.0):
            raise ValueError(
                f"{type(model).__name__}: attention_dropout={config.attention_dropout} is not supported "
                "with context parallelism (set it to 0)"
            )
        modules = [m for _, m in anatomy.attention_modules(model)]  # the model anatomy's rule
        layers = getattr(config, "num_hidden_layers", None)
        if not modules or (layers is not None and len(modules) != layers):
            raise ValueError(
                f"{type(model).__name__}: found {len(modules)} attention modules for {layers} layers; "
                "cannot route every one through context parallelism"
            )
        register()
        config._attn_implementation = ATTN_NAME
        for m in modules:
            object.__setattr__(m, "_llmpar_cp", cp)  # a plain reference, never a registered submodule
        head = anatomy.output_head(model)
        self._head = head[1] if head is not None else None
        base = getattr(model, "base_model", None)
        if base is not None and base is not model:
            base.register_forward_hook(self._keep_hidden)
        else:
            self._head = None  # no separate base model to take the hidden states from: the model's logits
        params = inspect.signature(model.forward).parameters.values()
        self.names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.window = _window(config)
        self.config = config
        self.routers = RouterLogits.of(model)

    def _keep_hidden(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._hidden:  # a tiled-loss forward is running: its final hidden states [B, S_local, d]
            self._hidden[0] = output["last_hidden_state"] if isinstance(output, dict) else output[0]

    def _tiles(self) -> bool:
        """The loss is tiled when the head's weight is whole on this rank (not a ZeRO-3 shard, not split over tp)
        and has no bias."""
        head = self._head
        weight = getattr(head, "weight", None)
        return (
            self.tiled_chunk is not None
            and weight is not None
            and getattr(head, "bias", None) is None
            and not hasattr(weight, "ds_numel")
            and not getattr(weight, "tensor_model_parallel", False)
        )

    # ---- every forward ----
    def shard_call(self, cp: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, Callable[[Any], Any]]:
        """This rank's slice of the batch (see the module docstring), inside ``cp.batch``; ``finish(output)`` leaves
        ``cp.batch`` and returns the output with the full-sequence loss."""
        if len(args) > len(self.names):
            raise TypeError(f"forward takes {len(self.names)} positional arguments, got {len(args)}")
        kw = dict(zip(self.names, args))
        for name, value in kwargs.items():
            if name in kw:
                raise TypeError(f"forward got argument {name!r} twice (positionally and by keyword)")
            kw[name] = value
        for name in ("cache", "past_key_values"):
            if kw.get(name) is not None:
                raise ValueError(f"{name}: a KV cache is not supported with context parallelism (training forward)")
        if kw.get("logits_to_keep", 0) not in (0, None):
            raise ValueError(f"logits_to_keep={kw['logits_to_keep']!r} is not supported with context parallelism")
        ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
        if (ids is None) == (embeds is None):
            raise ValueError("give exactly one of input_ids / inputs_embeds")
        lead = ids if ids is not None else embeds
        if not isinstance(lead, torch.Tensor) or lead.dim() != (2 if ids is not None else 3):
            raise ValueError(
                f"input_ids must be [batch, seq] (inputs_embeds [batch, seq, hidden]), got "
                f"{type(lead).__name__} {tuple(getattr(lead, 'shape', ()))}"
            )
        B, S = lead.shape[:2]
        for name in ("attention_mask", "position_ids", "labels", "shift_labels"):
            t = kw.get(name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != S or t.shape[0] not in (1, B):
                raise ValueError(
                    f"{name} must be [batch={B}, seq={S}] with context parallelism (a 2-D padding mask, "
                    f"not a 4-D one), got {type(t).__name__} {tuple(getattr(t, 'shape', ()))}"
                )
        pos = kw.get("position_ids")
        if pos is not None and kw.get("attention_mask") is None and S > 1 and not bool((pos.diff(dim=1) == 1).all()):
            raise ValueError(
                "position_ids restart inside a row and there is no attention_mask: transformers reads "
                "that as packed sequences (attention kept within each), which context parallelism does "
                "not run; give one sequence per row (padding masked by attention_mask)"
            )
        if self.window is not None and self.window < S:
            raise ValueError(
                f"sliding_window={self.window} is shorter than the sequence ({S} tokens): context "
                "parallelism runs full causal attention; use sequences of at most the window"
            )
        device = lead.device
        shard = cp.shard(S, device)
        labels = kw.pop("shift_labels", None)
        given = kw.pop("labels", None)
        if labels is None and given is not None:
            labels = torch.cat([given[:, 1:], given.new_full((given.shape[0], 1), -100)], dim=1)
        items = kw.pop("num_items_in_batch", None)
        mask = kw.pop("attention_mask", None)
        out: dict[str, Any] = {k: v for k, v in kw.items() if k not in _SEQ_KEYS}
        if ids is not None:
            out["input_ids"] = shard_tensor(ids, shard, 1, 0)
        else:
            out["inputs_embeds"] = shard_tensor(embeds, shard, 1, 0.0)
        idx = shard.index.to(device)
        out["position_ids"] = shard_tensor(pos, shard, 1, 0) if pos is not None else idx[None].expand(B, -1)
        valid = (idx < S)[None].expand(B, -1)
        if mask is not None:
            valid = valid & shard_tensor(mask.to(device).bool(), shard, 1, False).expand(B, -1)
        k_valid = None if mask is None and shard.padded_len == S else valid.contiguous()
        # a 4-D (empty) mask: transformers' mask builders return it as it is, never materialising [S_local]^2
        out["attention_mask"] = torch.ones(B, 1, 0, 0, dtype=torch.bool, device=device)
        out["use_cache"] = False
        out[BATCH_KEY] = (shard, k_valid)  # kwargs reach every attention call, recomputations in backward included
        local = shard_tensor(labels.to(device), shard, 1, -100).expand(B, -1) if labels is not None else None
        tiled = local is not None and self._tiles() and not self.gather_logits
        gather = self.gather_logits
        if tiled:  # the head runs on no position; the loss is taken from the hidden states a tile at a time
            out["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=device)
            self._hidden[:] = [None]
        on = kw.get("output_router_logits", getattr(self.config, "output_router_logits", False))
        routers = self.routers if on else None
        as_tuple = routers is not None and out.get("return_dict") is False  # a ModelOutput inside, given as tuple
        if routers is not None:  # recorded by the adapter (llmpar.context_parallel.hf_moe)
            out["return_dict"], out["output_router_logits"] = True, False
            routers.start()

        def loss_of(output: Any) -> Any:
            return with_aux(output).to_tuple() if as_tuple else with_aux(output)

        def with_aux(output: Any) -> Any:
            aux = None
            if routers is not None:  # the whole sequence's load-balancing loss
                aux, output["router_logits"] = routers.aux_loss(k_valid, cp)
                output["aux_loss"] = aux
            hidden = self._hidden[0] if tiled else None
            self._hidden.clear()
            if local is None:
                return _with_full_logits(output, cp, shard) if gather else output
            if tiled:
                loss_sum, count = tiled_lm_loss(hidden, self._head.weight, local.contiguous(), chunk=self.tiled_chunk)
            else:
                logits = output["logits"] if isinstance(output, dict) else output[0]
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32, float64 kept
                loss_sum = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), local.reshape(-1), ignore_index=-100, reduction="sum"
                )
                count = (local != -100).sum()
            loss = cp.token_mean(loss_sum, count)
            if items is not None:
                loss = _per_item(loss, count, items, cp)
            if aux is not None and routers is not None:
                loss = loss + routers.coef * aux.to(loss.dtype)
            if gather:
                output = _with_full_logits(output, cp, shard)
            if isinstance(output, dict):
                return type(output)(loss=loss, **{k: v for k, v in output.items() if k != "loss"})
            return (loss, *output)

        return (), out, _Finish(cp, shard, k_valid, loss_of, self._drop)

    def _drop(self) -> None:
        """Forget what a failed forward left (hidden states, router logits)."""
        self._hidden.clear()
        if self.routers is not None:
            self.routers.stop()


def _with_full_logits(output: Any, cp: Any, shard: Any) -> Any:
    """``output`` with its logits [B, S_local, V] replaced by the whole sequence's [B, S, V] (``gather_logits``)."""
    if isinstance(output, dict):
        output["logits"] = cp.gather_sequence(output["logits"], shard)
        return output
    return (cp.gather_sequence(output[0], shard), *output[1:])


def _per_item(loss: torch.Tensor, count: torch.Tensor, items: Any, cp: Any) -> torch.Tensor:
    """The Trainer's normalisation, ``sum / num_items_in_batch``, from ``loss = sum / global_count`` (the gradient
    factor of ``token_mean`` kept): ``loss * global_count / num_items_in_batch``. ``num_items_in_batch`` counts the
    batch once per cp rank when the Trainer gathers it over every process, which its world-size factor undoes."""
    total = count.detach().to(torch.float64).reshape(1)
    for group in cp.groups:
        all_reduce(total, group, what="context-parallel token count")
    items = torch.as_tensor(items, dtype=torch.float64, device=total.device).reshape(-1)[0]
    if not bool(items > 0):
        return loss * 0.0  # no label in the accumulated batch: 0, as token_mean gives, never NaN
    return loss * (total[0] / items).to(loss.dtype)


class _Finish:
    """``finish`` of :meth:`HFCausalLMAdapter.shard_call`: enters ``cp.batch`` when built, leaves it on ``close()``
    (the engine calls it when the forward raised; ``on_fail`` drops what the forward left) or on the call, which
    returns ``loss_of(output)``."""

    def __init__(
        self,
        cp: Any,
        shard: Any,
        k_valid: torch.Tensor | None,
        loss_of: Callable[[Any], Any],
        on_fail: Callable[[], None],
    ) -> None:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(cp.batch(shard, k_valid))
        self._loss_of, self._on_fail = loss_of, on_fail

    def close(self) -> None:
        self._stack.close()
        self._on_fail()

    def __call__(self, output: Any) -> Any:
        self._stack.close()
        return self._loss_of(output)


def adapter(model: torch.nn.Module) -> HFCausalLMAdapter:
    """The adapter for a transformers causal LM (``adapter_for`` calls this for ``PreTrainedModel``)."""
    return HFCausalLMAdapter()


__all__ = ["ATTN_NAME", "HFCausalLMAdapter", "adapter", "cp_attention", "register"]
