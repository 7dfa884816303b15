"""``deepspeed.utils.groups`` for DeepSpeed scripts with mixture-of-experts layers: the expert-parallel and
expert-data-parallel process groups, created and looked up by name (``"ep_size_<ep>"``) as DeepSpeed does.

    from llmpar.utils import groups
    groups._create_expert_and_data_parallel(2)                 # collective over the job, as torch.new_group
    ep_group = groups._get_expert_parallel_group("ep_size_2")  # this rank's expert-parallel group
    moe = llmpar.moe.layer.MoE(..., ep_size=2); moe.set_deepspeed_parallelism()  # looks it up here

Layout (DeepSpeed's, world W, ep size e, pipeline stages of W / pp ranks):

- expert + data (default): expert-parallel groups are consecutive ranks ``[0, e), [e, 2e), ...``; expert-data-
  parallel groups stride by e inside a stage (``[i, i + e, i + 2e, ...]``);
- ``use_data_before_expert_parallel_=True``: the reverse (expert-data-parallel groups consecutive, expert-parallel
  groups strided);
- with ``mp_size > 1`` (tensor or sequence parallel, ``mp_mode`` "tp" / "sp"): the ranks of a stage ordered
  tensor-parallel lane by lane for "tp" (consecutive for "sp"), cut into expert-parallel groups of e, the expert-data-
  parallel groups taking position i of each.

This is DeepSpeed's per-process registry (``_GROUPS``), kept for the scripts that call it; llmpar's own layers take
their groups as arguments (``llmpar.moe.MoEBlock(ep_group=...)``, ``llmpar.ParallelDims``), and nothing inside
llmpar reads this module. Expert tensor parallelism (``_create_expert_data_and_model_parallel`` with a tensor-parallel
mpu) and AutoEP's folding specs are refused with a ValueError.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from llmpar.comm import get_global_rank, new_group

mpu: Any = None  # a Megatron-style mpu, set by the script or the engine (DeepSpeed's groups.mpu)
expert_tensor_parallel_world_size = 1
# name -> group / ranks for this rank, per kind: "ep", "ep_ranks", "edp", "edp_ranks"; "world": the world's clone
_GROUPS: dict[str, dict[str, Any]] = {"ep": {}, "ep_ranks": {}, "edp": {}, "edp_ranks": {}, "world": {}}


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed's deprecated ``groups.initialize``: refused as DeepSpeed refuses it."""
    raise RuntimeError(
        "groups.initialize() is deprecated (as in DeepSpeed): pass ep_size to llmpar.moe.layer.MoE(..., ep_size=...)"
    )


def _require_dist() -> None:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call llmpar.init_distributed() first")


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    return value


def _layout(
    world: int, ep: int, pp: int, mp: int, mp_mode: str, data_first: bool
) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) as lists of global ranks (see the module docstring)."""
    if world % pp or (world // pp) % ep:
        raise ValueError(
            f"the {world} ranks in {pp} pipeline stage(s) of {world // max(pp, 1)} ranks cannot be cut into "
            f"expert-parallel groups of ep_size={ep}: ep_size must divide the ranks per stage"
        )
    stride = world // pp
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    for start in range(0, world, stride):
        stage = list(range(start, start + stride))
        if mp <= 1:
            if data_first:
                width = stride // ep
                edp_groups += [stage[i * width : (i + 1) * width] for i in range(ep)]
                ep_groups += [stage[i::width] for i in range(width)]
            else:
                ep_groups += [stage[i * ep : (i + 1) * ep] for i in range(stride // ep)]
                edp_groups += [stage[i::ep] for i in range(ep)]
            continue
        if data_first:
            raise ValueError("use_data_before_expert_parallel_=True is not supported with mp_size > 1 (as DeepSpeed)")
        if mp_mode == "tp":
            stage = [stage[g * mp + lane] for lane in range(mp) for g in range(stride // mp)]
        elif mp_mode != "sp":
            raise ValueError(f"mp_mode={mp_mode!r} is not one of ('tp', 'sp')")
        groups = [stage[g * ep : (g + 1) * ep] for g in range(stride // ep)]
        ep_groups += groups
        edp_groups += [[g[pos] for g in groups] for pos in range(ep)]
    return ep_groups, edp_groups


def _create_expert_and_data_parallel(
    expert_parallel_size_: int,
    mp_size: int | None = None,
    pp_size: int | None = None,
    mp_mode: str = "tp",
    use_data_before_expert_parallel_: bool = False,
    folding_spec: Any = None,
) -> None:
    """Create the ``"ep_size_<e>"`` expert-parallel and expert-data-parallel groups (a collective over the whole job:
    every rank calls it with the same arguments); a second call for the same name does nothing."""
    _require_dist()
    ep = _check_size("expert_parallel_size_", expert_parallel_size_)
    if folding_spec is not None:
        raise ValueError("AutoEP folding specs are not supported: llmpar's expert parallelism is ParallelDims(ep=...)")
    mp = _check_size("mp_size", 1 if mp_size is None else mp_size)
    if pp_size is None:
        pp_size = 1 if mpu is None else int(getattr(mpu, "get_pipeline_model_parallel_world_size", lambda: 1)())
    pp = _check_size("pp_size", pp_size)
    name = f"ep_size_{ep}"
    if name in _GROUPS["ep"]:
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_groups, edp_groups = _layout(world, ep, pp, mp, mp_mode, use_data_before_expert_parallel_)
    for kind, table in (("edp", edp_groups), ("ep", ep_groups)):  # every rank creates every group, in one order
        for ranks in table:
            group = new_group(ranks)
            if rank in ranks:
                _GROUPS[kind][name], _GROUPS[f"{kind}_ranks"][name] = group, list(ranks)


def _create_expert_data_and_model_parallel(
    expert_parallel_size_: int, mpu: Any, use_data_before_expert_parallel_: bool = False
) -> None:
    """Expert tensor parallelism: provided for a model-parallel size of 1 only (then the same as
    :func:`_create_expert_and_data_parallel`)."""
    tp = 1 if mpu is None else int(mpu.get_tensor_model_parallel_world_size())
    if tp != 1:
        raise ValueError(
            f"expert tensor parallelism (tensor-parallel size {tp}) is not provided: build the MoE layer with "
            "enable_expert_tensor_parallelism=False (experts unsplit), or use llmpar.moe.MoEBlock"
        )
    _create_expert_and_data_parallel(
        expert_parallel_size_, use_data_before_expert_parallel_=use_data_before_expert_parallel_
    )


def _lookup(kind: str, group_name: str) -> Any:
    table = _GROUPS[kind]
    if group_name not in table:
        what = "expert parallel" if kind.startswith("ep") else "expert data parallel"
        raise KeyError(
            f"{what} group {group_name!r} is not initialized (known: {sorted(table)}): call "
            "groups._create_expert_and_data_parallel(ep_size) or moe.set_deepspeed_parallelism() first"
        )
    return table[group_name]


def _get_expert_parallel_group(group_name: str) -> Any:
    return _lookup("ep", group_name)


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return _lookup("ep_ranks", group_name)


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return _GROUPS["ep"]


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _lookup("edp", group_name)


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return _lookup("edp_ranks", group_name)


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return _GROUPS["edp"]


def _get_max_expert_size() -> int | None:
    sizes = [int(name.split("_")[2]) for name in _GROUPS["ep"]]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_parallel_world_size(group_name: str) -> int:
    _require_dist()
    return dist.get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    _require_dist()
    return dist.get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """Global rank of local rank 0 of this rank's expert-parallel group (DeepSpeed's arithmetic)."""
    size = _get_expert_parallel_world_size(group_name)
    return (dist.get_rank() // size) * size


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    _require_dist()
    return dist.get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    _require_dist()
    return dist.get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    return get_global_rank(_get_expert_data_parallel_group(group_name), 0)


def _get_expert_model_parallel_world_size() -> int:
    return expert_tensor_parallel_world_size


def _clone_world_group() -> Any:
    """A group of every rank (DeepSpeed keeps one because ``get_global_rank`` does not take the WORLD group)."""
    _require_dist()
    if "world" not in _GROUPS["world"]:
        _GROUPS["world"]["world"] = new_group(list(range(dist.get_world_size())))
    return _GROUPS["world"]["world"]


def _get_data_parallel_group() -> Any:
    _require_dist()
    if mpu is not None:
        return mpu.get_data_parallel_group()
    return _clone_world_group()


def _get_data_parallel_group_ranks() -> list[int]:
    _require_dist()
    if mpu is not None:
        return list(mpu.get_data_parallel_group_ranks())
    return list(range(dist.get_world_size()))


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size(group=_get_data_parallel_group())


def _get_data_parallel_rank() -> int:
    return dist.get_rank(group=_get_data_parallel_group())


def _get_broadcast_src_rank() -> int:
    return get_global_rank(_get_data_parallel_group(), 0)


def _get_model_parallel_world_size() -> int:
    return 1 if mpu is None else int(mpu.get_model_parallel_world_size())


def _get_sequence_parallel_world_size() -> int:
    getter = getattr(mpu, "get_sequence_parallel_world_size", None)
    return 1 if getter is None else int(getter())


def _get_sequence_data_parallel_world_size() -> int:
    getter = getattr(mpu, "get_sequence_data_parallel_world_size", None)
    return _get_data_parallel_world_size() if getter is None else int(getter())


def _reset() -> None:
    """Forget every group (tests, and a script that destroys and re-creates the process group)."""
    for table in _GROUPS.values():
        table.clear()
