"""Model anatomy: the one place that says what a model's blocks, attention, MLPs and embeddings are.

The pipeline split (:func:`pipeline_sequence`), ZeRO-3's sharding units (:func:`shard_units`), activation
checkpointing (:func:`blocks`), the tensor-parallel plans (:func:`family`, :func:`head_counts`) and the
context-parallel adapters (:func:`attention_modules`, :func:`output_head`) ask here; nothing here knows about
parallelism. A model may answer for itself: ``pipeline_blocks()`` (llmpar's ``GPT``, ``llmpar.pipe.PipelineModule``),
``get_input_embeddings()`` / ``get_output_embeddings()`` (transformers).

The rules, and where the finders they replace differed (each difference kept where the question differs):

* **Blocks** (:func:`blocks`): the elements holding params of the outermost ``nn.ModuleList`` / ``nn.Sequential``
  containers, the model itself included when it is an ``nn.Sequential`` (a transformer's layers: ``blocks.{i}``,
  ``model.layers.{i}``); a list nested inside a block (an MoE layer's experts) belongs to that block. A model with
  none answers with its own modules among ``pipeline_blocks()``. A module held by two containers is one block, under
  its first name (activation checkpointing listed it twice; ZeRO-3 once). No finder reads transformers'
  ``_no_split_modules``: for the supported families it names exactly the ``ModuleList`` elements.
* **Shard units** (:func:`shard_units`): ZeRO-3 gathers at a finer grain than blocks: the root, the elements with
  params of *every* container at any depth except the root (a nested list's elements are units inside their
  block's unit), and the root's own children with params that are not containers (embeddings, final norm, head).
* **Pipeline sequence** (:func:`pipeline_sequence`): modules that, applied one after another, compute the model, so
  param-less children count (an activation between layers) and a bare ``ModuleList`` model is refused (it does not
  say how its layers connect): ``pipeline_blocks()``, else an ``nn.Sequential``'s children.
* **Family** (:func:`family`): by module names, first match wins: ``*self_attn.q_proj`` is the Llama layout
  (Llama, Qwen2, Mistral; the MoE Mixtral, Qwen2-MoE, Qwen3-MoE too), ``*attn.qkv`` llmpar's GPT (the
  tensor-parallel default plans are named after these).
* **Attention** (:func:`attention_modules`): a module with an int ``head_dim`` and either an int head count
  (:data:`HEAD_ATTRS`: llmpar's ``CausalSelfAttention`` has ``n_head``) or transformers' ``is_causal`` + ``config``
  (transformers >= 4.48 dropped ``num_heads`` from its attention modules); the context-parallel transformers adapter
  routes these modules through context parallelism (``llmpar/context_parallel/hf.py``).
* **MLP** (:func:`mlp_modules`): a block's child named ``mlp``, ``feed_forward`` or ``ffn``.
* **Embeddings** (:func:`input_embeddings`, :func:`output_head`): the model's own answer (transformers), else the
  ``nn.Embedding`` modules outside the blocks and the ``lm_head`` module.
"""

from __future__ import annotations

import fnmatch

from torch import nn

Named = list[tuple[str, nn.Module]]

# attributes holding a head count, in the spellings of llmpar, transformers and Megatron-style models
HEAD_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_head",
    "n_heads",
    "n_kv_heads",
)
# family -> the module-name pattern that marks it (fnmatch, matched as the whole name or its dotted end)
FAMILY_MARKERS: dict[str, str] = {"llama": "self_attn.q_proj", "gpt": "attn.qkv"}
MLP_NAMES = ("mlp", "feed_forward", "ffn")
_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _inside(name: str, taken: Named) -> bool:
    return any(name == n or name.startswith(n + ".") for n, _ in taken)


def container_elements(model: nn.Module, *, outermost: bool, include_root: bool) -> Named:
    """(name, module) of the elements holding params of the model's ``nn.ModuleList`` / ``nn.Sequential``
    containers, in registration order, each module once. ``outermost``: not those inside an element already taken;
    ``include_root``: the model's own children too when it is a container."""
    out: Named = []
    seen: set[int] = set()
    for name, m in model.named_modules():
        if outermost and _inside(name, out):
            continue
        if isinstance(m, _CONTAINERS) and (include_root or m is not model):
            for child_name, child in m.named_children():
                if id(child) not in seen and _has_params(child):
                    seen.add(id(child))
                    out.append((_join(name, child_name), child))
    return out


def blocks(model: nn.Module) -> Named:
    """The model's blocks (module docstring): outermost container elements with params, else its own modules among
    ``model.pipeline_blocks()``; [] when it has neither."""
    out = container_elements(model, outermost=True, include_root=True)
    if not out and callable(getattr(model, "pipeline_blocks", None)):
        own = {id(m) for m in model.modules()}
        out = [(n, b) for n, b in model.pipeline_blocks() if id(b) in own and b is not model]
    return out


def shard_units(model: nn.Module) -> Named:
    """ZeRO-3's default sharding units (module docstring), the root first then in module order."""
    inner = container_elements(model, outermost=False, include_root=False)
    chosen = {id(m) for _, m in inner}
    top = [
        (n, c)
        for n, c in model.named_children()
        if not isinstance(c, _CONTAINERS) and id(c) not in chosen and _has_params(c)
    ]
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    return [("", model)] + sorted(inner + top, key=lambda nm: order[id(nm[1])])


def pipeline_sequence(model: nn.Module) -> Named:
    """The model as an ordered list of ``(name, module)`` a pipeline split cuts (module docstring); a TypeError
    naming the model when it is neither an ``nn.Sequential`` nor has ``pipeline_blocks()``, a ValueError when empty."""
    seq: Named
    if callable(getattr(model, "pipeline_blocks", None)):
        seq = list(model.pipeline_blocks())
    elif isinstance(model, nn.Sequential):
        seq = list(model.named_children())
    else:
        raise TypeError(
            f"model is a {type(model).__name__}: pass an nn.Sequential or a module with a "
            "pipeline_blocks() method returning [(name, module), ...] (llmpar's GPT has one)"
        )
    if not seq:
        raise ValueError(f"model {type(model).__name__} has no blocks to split")
    for item in seq:
        if not (
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], nn.Module)
        ):
            raise TypeError(f"pipeline blocks must be (name, nn.Module) pairs, got {item!r}")
    return seq


def name_matches(name: str, pattern: str) -> bool:
    """``pattern`` (fnmatch) matches the whole module name or its dotted end (``self_attn.q_proj`` matches
    ``model.layers.0.self_attn.q_proj``): the rule of the family markers and of tensor-parallel plans."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def family(model: nn.Module) -> str | None:
    """The layout family whose marker (:data:`FAMILY_MARKERS`, in order) names one of the model's modules: "llama"
    or "gpt"; None when none does."""
    names = [n for n, _ in model.named_modules()]
    for fam, marker in FAMILY_MARKERS.items():
        if any(name_matches(n, marker) for n in names):
            return fam
    return None


def head_counts(module: nn.Module) -> dict[str, int]:
    """{attribute: value} of the module's int head-count attributes (:data:`HEAD_ATTRS`; bools are not counts)."""
    out = {}
    for attr in HEAD_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out[attr] = value
    return out


def is_attention(module: nn.Module) -> bool:
    """An attention module (module docstring): an int ``head_dim`` and a head count or transformers' markers."""
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):
        return False
    return bool(head_counts(module)) or (hasattr(module, "is_causal") and hasattr(module, "config"))


def attention_modules(model: nn.Module) -> Named:
    """(name, module) of every attention module, in module order."""
    return [(n, m) for n, m in model.named_modules() if is_attention(m)]


def mlp_modules(model: nn.Module) -> Named:
    """(name, module) of each block's MLP: its child named one of :data:`MLP_NAMES`."""
    return [(_join(n, c), child) for n, b in blocks(model) for c, child in b.named_children() if c in MLP_NAMES]


def input_embeddings(model: nn.Module) -> Named:
    """The input embeddings: the model's ``get_input_embeddings()`` (named where it sits), else every
    ``nn.Embedding`` outside the blocks (llmpar's GPT: ``tok_emb``, ``pos_emb``)."""
    own = getattr(model, "get_input_embeddings", None)
    if callable(own) and isinstance(emb := own(), nn.Module):
        return [(n, m) for n, m in model.named_modules() if m is emb][:1]
    taken = blocks(model)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and not _inside(n, taken)]


def output_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The output projection: the model's ``get_output_embeddings()`` (named where it sits), else its module named
    ``lm_head``; None when there is neither."""
    own = getattr(model, "get_output_embeddings", None)
    head = own() if callable(own) else None
    for n, m in model.named_modules():
        if (m is head) if isinstance(head, nn.Module) else (n.rpartition(".")[2] == "lm_head"):
            return n, m
    return None


__all__ = [
    "FAMILY_MARKERS",
    "HEAD_ATTRS",
    "MLP_NAMES",
    "attention_modules",
    "blocks",
    "container_elements",
    "family",
    "head_counts",
    "input_embeddings",
    "is_attention",
    "mlp_modules",
    "name_matches",
    "output_head",
    "pipeline_sequence",
    "shard_units",
]
