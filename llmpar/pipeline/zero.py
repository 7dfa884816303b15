"""ZeRO over the dp axis of a pipeline: each pp rank's :class:`~llmpar.zero.ZeroOptimizer` shards its stages' params.

    runner = build_pipeline(model, env.mesh, GPT.loss, micro_batches=8, dp_group=None)   # ZeRO reduces, not the runner
    opt = zero_optimizer(runner, OptimizerConfig(lr=3e-4), stage=1, max_grad_norm=1.0)
    for x, y in batches:
        loss = runner.step(x, y)   # all micro-batches accumulate locally (stage 2: reduce-scattered per micro-batch)
        opt.step()                 # stage 0/1: reduce over dp, tied grads summed over pp, global norm, AdamW
        opt.zero_grad()

The global gradient norm is that of the whole unsplit model: partition sums over dp, tensor-parallel shards summed
over tp, the stages' sums added over pp, and a weight tied between stages (embedding and head) counted once (the copy
on the lowest stage). Tied weights: every copy receives the sum over pp of the copies' reduced gradients, so the
copies, updated by different optimizers on the same gradient, stay equal (``tied.sync_tied_zero``, which the runner
calls; re-exported here).
"""

from __future__ import annotations

from typing import Any, Sequence

from llmpar.pipeline.runner import PipelineRunner
from llmpar.pipeline.tied import sync_tied_zero
from llmpar.zero.config import ZeroConfig
from llmpar.zero.optimizer import ZeroOptimizer


def zero_optimizer(
    runner: PipelineRunner,
    optimizer_config: Any = None,
    *,
    stage: int | None = None,
    dp_group: Any = "split",
    param_groups: Sequence[dict] | None = None,
    zero_config: ZeroConfig | None = None,
    **kwargs: Any,
) -> ZeroOptimizer:
    """A ZeroOptimizer over ``runner.parameters()`` on the split's dp group (``dp_group=`` to override), with the
    split's tp and pp groups for the global norm and tied copies skipped there; attached to the runner
    (:meth:`PipelineRunner.attach_zero`). ``kwargs`` go to ZeroOptimizer (``max_grad_norm``, ...). The stage is
    ``zero_config.stage``, or ``stage=`` (default 1) without a zero_config (:meth:`ZeroConfig.resolve`).

    ``param_groups``: optimizer groups over this rank's params (dicts with ``"params"``, bare or ``(name, param)``,
    and per-group ``lr`` / ``betas`` / ``eps`` / ``weight_decay``); together they must hold exactly
    ``runner.parameters()``. A group may be empty on this stage: every pp rank keeps the same groups. Default: one
    group with the optimizer config's values. Params are named ``stage{s}.{name in the stage module}``."""
    if not isinstance(runner, PipelineRunner):
        raise TypeError(f"runner must be a PipelineRunner, got {type(runner).__name__}")
    zcfg = ZeroConfig.resolve(stage, zero_config, default_stage=1, where="zero_optimizer")
    if zcfg.stage == 3:
        raise ValueError("stage=3: ZeRO-3 does not run inside pipeline stages; use stage 0, 1 or 2")
    for key in ("tp_group", "pp_group", "norm_skip", "module"):
        if key in kwargs:
            raise TypeError(f"zero_optimizer sets {key} from the runner's split; do not pass it")
    split = runner.split
    if isinstance(dp_group, str):
        if dp_group != "split":
            raise ValueError(f"dp_group={dp_group!r}: pass 'split' (the split's dp group) or a group")
        dp_group = split.dp_group
    if dp_group is None:
        raise ValueError("the split has no dp group (mesh without a 'dp' axis): pass dp_group=")
    names = stage_param_names(runner)
    params: Any = [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(runner.parameters())]
    if param_groups is not None:
        params = _own_groups(runner, param_groups, names)
    opt = ZeroOptimizer(
        params,
        optimizer_config,
        dp_group,
        zero_config=zcfg,
        tp_group=split.tp_group,
        pp_group=split.pp_group if split.pp > 1 else None,
        norm_skip=runner.tied_duplicates,
        **kwargs,
    )
    runner.attach_zero(opt)
    return opt


def stage_param_names(runner: PipelineRunner) -> dict[int, str]:
    """{id(param): ``stage{s}.{name in the stage module}``} of this rank's params."""
    split = runner.split
    return {id(p): f"stage{s}.{n}" for m, s in zip(split.modules, split.stage_indices) for n, p in m.named_parameters()}


def _own_groups(runner: PipelineRunner, groups: Sequence[dict], names: dict[int, str]) -> list[dict]:
    """``groups`` checked to hold exactly this rank's params, each named as the optimizer names it."""
    mine = {id(p) for p in runner.parameters()}
    out, seen = [], set()
    for gi, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"param_groups[{gi}] must be a dict with a 'params' entry")
        items = []
        for item in g["params"]:
            p = item[1] if isinstance(item, tuple) else item
            if id(p) not in mine:
                raise ValueError(
                    f"param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} that is not a param "
                    "of this pipeline rank (runner.parameters())"
                )
            seen.add(id(p))
            items.append((names[id(p)], p))
        out.append({**g, "params": items})
    missing = [names.get(id(p), "?") for p in runner.parameters() if id(p) not in seen]
    if missing:
        raise ValueError(f"param_groups leaves out {len(missing)} params of this pipeline rank: {missing[:5]}")
    return out


__all__ = ["stage_param_names", "sync_tied_zero", "zero_optimizer"]
