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

from typing import Any

from llmpar.pipeline.runner import PipelineRunner
from llmpar.pipeline.tied import sync_tied_zero
from llmpar.zero.optimizer import ZeroOptimizer


def zero_optimizer(runner: PipelineRunner, optimizer_config: Any = None, *, stage: int = 1,
                   dp_group: Any = "split", **kwargs: Any) -> ZeroOptimizer:
    """A ZeroOptimizer over ``runner.parameters()`` on the split's dp group (``dp_group=`` to override), with the
    split's tp and pp groups for the global norm and tied copies skipped there; attached to the runner
    (:meth:`PipelineRunner.attach_zero`). ``kwargs`` go to ZeroOptimizer (``max_grad_norm``, ``zero_config``, ...)."""
    if not isinstance(runner, PipelineRunner):
        raise TypeError(f"runner must be a PipelineRunner, got {type(runner).__name__}")
    if stage == 3:
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
    names = {id(p): f"stage{s}.{n}" for m, s in zip(split.modules, split.stage_indices)
             for n, p in m.named_parameters()}
    params = [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(runner.parameters())]
    opt = ZeroOptimizer(params, optimizer_config, dp_group, stage=stage, tp_group=split.tp_group,
                        pp_group=split.pp_group if split.pp > 1 else None,
                        norm_skip=runner.tied_duplicates, **kwargs)
    runner.attach_zero(opt)
    return opt


__all__ = ["sync_tied_zero", "zero_optimizer"]
