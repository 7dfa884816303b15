"""``parallelize(model, mesh, plan)``: swap a model's ``nn.Linear`` / ``nn.Embedding`` for tensor-parallel layers.

A plan maps module-name patterns (``fnmatch``; ``"self_attn.q_proj"`` matches any name equal to it or ending in
``".self_attn.q_proj"``) to one of

* ``"column"``     -> :class:`ColumnParallelLinear` (output features split; output stays split),
* ``"row"``        -> :class:`RowParallelLinear` (input features split; output summed),
* ``"embedding"``  -> :class:`VocabParallelEmbedding`,
* ``"vocab_head"`` -> :class:`ParallelLMHead` (vocabulary padded to a multiple of tp; output gathered to the full
  vocabulary unless ``gather_logits=False``, then feed it to :func:`vocab_parallel_cross_entropy`).

The module that owns column layers (an attention or an MLP) gets its head-count attributes
(:func:`llmpar.models.anatomy.head_counts`) divided by tp, after
checking that every column split holds whole heads. Everything is validated before the first module is replaced,
so a plan that does not fit raises the same error on every rank, naming the module.

``sequence_parallel=True`` shards dim 0 of the activations between the blocks (the batch for batch-first models,
which partitions the tokens just as well; it must divide by tp): the embedding reduce-scatters, each module owning
column layers all-gathers its input once in a forward pre-hook (its column layers then return partial input
gradients, reduce-scattered by that gather's backward), row layers reduce-scatter, and the gradients of all
parameters outside the parallel layers (norms, position embeddings) are all-reduced over tp by hooks.
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from llmpar.distributed.collectives import GroupRef
from llmpar.models.anatomy import family, head_counts
from llmpar.models.anatomy import name_matches as _matches
from llmpar.tensor_parallel._utils import Group, check_positive, resolve_tp_group, tp_size_rank
from llmpar.tensor_parallel.comm import all_reduce_sum, gather_from_sequence_region
from llmpar.tensor_parallel.embedding import VocabParallelEmbedding
from llmpar.tensor_parallel.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

KINDS = ("column", "row", "embedding", "vocab_head")

LLAMA_PLAN: dict[str, str] = {
    "embed_tokens": "embedding",
    "self_attn.q_proj": "column",
    "self_attn.k_proj": "column",
    "self_attn.v_proj": "column",
    "self_attn.o_proj": "row",
    "mlp.gate_proj": "column",
    "mlp.up_proj": "column",
    "mlp.down_proj": "row",
    "lm_head": "vocab_head",
}
"""Llama / Mistral / Qwen2-style names (HuggingFace ``transformers``)."""

GPT_PLAN: dict[str, str] = {
    "tok_emb": "embedding",
    "attn.qkv": "column",
    "attn.proj": "row",
    "mlp.fc": "column",
    "mlp.proj": "row",
    "lm_head": "vocab_head",
}
"""llmpar's GPT (``llmpar.models.gpt``) and nanoGPT-style names (``qkv`` laid out head-major)."""

DEFAULT_PLANS: dict[str, dict[str, str]] = {"llama": LLAMA_PLAN, "gpt": GPT_PLAN}
_HIDDEN_KWARGS = ("hidden_states", "x", "hidden_state", "input")


def _pick_default_plan(model: nn.Module) -> dict[str, str]:
    fam = family(model)  # the layout family, by module names (llmpar.models.anatomy)
    if fam is not None:
        return DEFAULT_PLANS[fam]
    raise ValueError(
        f"no default tensor-parallel plan fits {type(model).__name__} (known: Llama-style "
        f"'self_attn.q_proj', GPT-style 'attn.qkv' names); pass plan={{pattern: kind}}"
    )


def _check_module(name: str, module: nn.Module, kind: str, tp: int) -> None:
    want = nn.Embedding if kind == "embedding" else nn.Linear
    if type(module) is not want:
        raise TypeError(
            f"module {name!r} is a {type(module).__name__}, but the plan makes it {kind!r}, which "
            f"needs an {want.__name__}"
        )
    if kind == "column" and module.out_features % tp:
        raise ValueError(f"module {name!r}: out_features {module.out_features} is not divisible by tp={tp}")
    if kind == "row" and module.in_features % tp:
        raise ValueError(f"module {name!r}: in_features {module.in_features} is not divisible by tp={tp}")


def _check_heads(owner_name: str, owner: nn.Module, columns: list[tuple[str, nn.Linear]], tp: int) -> dict[str, int]:
    """New head-count attribute values for ``owner``; raises if a split would cut a head."""
    updates = {}
    for attr, value in head_counts(owner).items():
        if value % tp:
            raise ValueError(f"module {owner_name!r}: {attr}={value} is not divisible by tp={tp}")
        updates[attr] = value // tp
    head_dim = getattr(owner, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        for cname, lin in columns:
            per_rank = lin.out_features // tp
            if per_rank % head_dim:
                raise ValueError(
                    f"module {cname!r}: {lin.out_features} output features split over tp={tp} give "
                    f"{per_rank} per rank, not a whole number of heads of head_dim={head_dim}"
                )
    return updates


def _gather_hook(group):
    def hook(module, args, kwargs):
        if args:
            return (gather_from_sequence_region(args[0], group), *args[1:]), kwargs
        for key in _HIDDEN_KWARGS:
            if key in kwargs:
                return args, {**kwargs, key: gather_from_sequence_region(kwargs[key], group)}
        raise ValueError(
            f"sequence_parallel: cannot find the hidden-state input of {type(module).__name__} "
            f"(no positional argument and none of {_HIDDEN_KWARGS})"
        )

    return hook


def parallelize(
    model: nn.Module,
    mesh: Group,
    plan: Mapping[str, str] | None = None,
    *,
    sequence_parallel: bool = False,
    comm_chunks: int = 1,
    overlap_grad_comm: bool = True,
    gather_logits: bool = True,
) -> nn.Module:
    """Replace ``model``'s layers in place following ``plan`` (default: picked from the module names).

    Args:
        mesh: the tensor-parallel ProcessGroup, a 1-D DeviceMesh, or a mesh with a ``"tp"`` axis.
        plan: ``{name pattern: "column" | "row" | "embedding" | "vocab_head"}``; first matching pattern wins.
        comm_chunks: chunks of the row layers' forward reduction (1 = no forward overlap).
        gather_logits: the vocab head returns the full ``[..., V]`` logits (else this rank's ``[..., V_pad/tp]``).
    Returns ``model``. Every rank must call it with the same model (same seed) and plan.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    group = GroupRef(resolve_tp_group(mesh, argument="mesh"))  # hooks below keep it: by name, see GroupRef
    tp, _ = tp_size_rank(group)
    check_positive("comm_chunks", comm_chunks)
    plan = dict(_pick_default_plan(model) if plan is None else plan)
    for pattern, kind in plan.items():
        if kind not in KINDS:
            raise ValueError(f"plan[{pattern!r}] = {kind!r} is not one of {KINDS}")

    chosen: list[tuple[str, nn.Module, str]] = []
    used = set()
    for name, module in model.named_modules():
        for pattern, kind in plan.items():
            if name and _matches(name, pattern):
                _check_module(name, module, kind, tp)
                chosen.append((name, module, kind))
                used.add(pattern)
                break
    unused = [p for p in plan if p not in used]
    if unused:
        raise ValueError(f"plan entries {unused} match no module of {type(model).__name__}")

    owners: dict[str, list[tuple[str, nn.Linear]]] = {}
    for name, module, kind in chosen:
        if kind == "column":
            owners.setdefault(name.rpartition(".")[0], []).append((name, module))  # type: ignore[arg-type]
    head_updates = {o: _check_heads(o, model.get_submodule(o), cols, tp) for o, cols in owners.items()}

    # ---- everything validated: replace
    new_by_old: dict[int, nn.Module] = {}  # id(old module) -> its replacement
    for name, module, kind in chosen:
        if kind == "column":
            new: nn.Module = ColumnParallelLinear.from_linear(
                module, group=group, overlap_grad_comm=overlap_grad_comm, reduce_input_grad=not sequence_parallel
            )
        elif kind == "row":
            new = RowParallelLinear.from_linear(
                module, group=group, sequence_parallel=sequence_parallel, comm_chunks=comm_chunks
            )
        elif kind == "embedding":
            new = VocabParallelEmbedding.from_embedding(module, group=group, sequence_parallel=sequence_parallel)
        else:
            new = ParallelLMHead.from_linear(
                module,
                group=group,
                gather_output=gather_logits,
                sequence_parallel=sequence_parallel,
                overlap_grad_comm=overlap_grad_comm,
            )
        new_by_old[id(module)] = new
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, new)
    _retie(chosen, new_by_old)
    for owner, updates in head_updates.items():
        for attr, value in updates.items():
            setattr(model.get_submodule(owner), attr, value)
    if sequence_parallel and tp > 1:
        for owner in owners:
            model.get_submodule(owner).register_forward_pre_hook(_gather_hook(group), with_kwargs=True)
        _reduce_replicated_grads(model, group)
    return model


def _retie(chosen: list[tuple[str, nn.Module, str]], new_by_old: dict[int, nn.Module]) -> None:
    """Keep an embedding and a vocab head that shared one weight sharing the new (identically split) weight."""
    embeddings = {id(m.weight): new_by_old[id(m)] for _, m, k in chosen if k == "embedding"}
    for _, module, kind in chosen:
        if kind == "vocab_head" and id(module.weight) in embeddings:
            head, emb = new_by_old[id(module)], embeddings[id(module.weight)]
            head.weight = emb.weight  # same [V_pad/tp, d] rows on this rank


def _reduce_replicated_grads(model: nn.Module, group) -> None:
    parallel = {
        id(p)
        for m in model.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))
        for p in m.parameters()
    }
    seen = set()
    for p in model.parameters():
        if id(p) in parallel or id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        p.sequence_parallel = True  # type: ignore[attr-defined]
        p.register_hook(lambda g: all_reduce_sum(g, group))


__all__ = ["parallelize", "LLAMA_PLAN", "GPT_PLAN", "DEFAULT_PLANS", "KINDS"]
