"""``ZeroOptimizer.state_dict()`` / ``load_state_dict()`` (torch's optimizer API, DeepSpeed's ZeRO meaning: this
rank's shard) and ``destroy()``. ``ZeroOptimizer`` derives from :class:`OptimizerStateDict`.

    torch.save(engine.optimizer.state_dict(), f"opt_rank{rank}.pt")        # every rank its own shard
    engine.optimizer.load_state_dict(torch.load(f"opt_rank{rank}.pt"))     # every rank, same dp / stage / model

What a state dict holds (clones, on the tensors' own devices): per flat buffer this rank's partition of the params
and of every optimizer state (``exp_avg``, ``exp_avg_sq``, the fp32 ``master`` where there is one, ...) and the unit
step counts; the param groups' hyperparameters (lr, betas, eps, weight_decay: what a scheduler changed); the fp16
loss scaler; the skip count and the last grad norm; and the layout it was taken from. Stage 0 holds everything on
every rank; stages 1-3 hold 1/dp (DeepSpeed's optimizer state dicts are per rank too). Loading one restores all of it
exactly (the params from the saved partition: stages 1/2 all-gather the updated partitions, stage 3 re-gathers its
persistent units, so loading is collective over dp at stages 1-3); a state dict of another stage, dp degree, dp rank
or param layout is a ``ValueError`` on every rank before anything is modified. To change the layout (another dp,
stage, tp or pp), use ``engine.save_checkpoint`` / ``load_checkpoint``, which reshard. With experts spread over
expert-parallel ranks (``self.experts``, over the expert-data-parallel ranks) the dict holds that optimizer's own
state dict under ``"experts"``, checked and loaded with the rest.

``destroy()`` (what ``engine.destroy()`` calls): waits for communication in flight, removes every hook the optimizer
put on the params and modules, drops the gradients and optimizer states, and marks the optimizer destroyed (a later
``step`` / ``state_dict`` / ``load_state_dict`` raises ``RuntimeError``; a second ``destroy`` does nothing). Stages
0-2 leave the model a plain module holding the trained weights; stage 3 leaves each rank only its shards, so the
model's forward raises a ``RuntimeError`` saying so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmpar.distributed.agree import raise_if_any_failed

if TYPE_CHECKING:
    from llmpar.zero.grads import FlatBuffer

FORMAT = "llmpar.zero.optimizer_state/1"
_HYPER_SKIP = ("params", "names")


def _refuse_stage3_forward(module: nn.Module, args: Any) -> None:
    raise RuntimeError(
        "this model's params were partitioned by a ZeRO stage-3 engine that was destroyed "
        "(engine.destroy()): each rank holds only its shards. Take the full weights before destroy "
        "(engine.module_state_dict(), engine.save_16bit_model(), llmpar.zero.GatheredParameters)"
    )


class OptimizerStateDict:
    """Mixin for ``ZeroOptimizer`` (module docstring)."""

    buffers: list[FlatBuffer]
    stage: int
    dp: int
    rank: int
    param_groups: list[dict]
    loss_scaler: Any
    reducer: Any
    stage3: Any
    deferred_gather: Any
    plan: Any
    dp_group: Any
    counter: Any
    destroyed: bool = False

    if TYPE_CHECKING:

        def describe(self) -> dict: ...

        def wait_params(self) -> None: ...

        def _ckpt_rank(self) -> int: ...

        skipped_steps: int
        last_grad_norm: float | None

    def _check_alive(self, what: str) -> None:
        if self.destroyed:
            raise RuntimeError(
                f"optimizer.{what}() after destroy(): the optimizer released its state and hooks "
                "(engine.destroy()); build a new engine with llmpar.initialize"
            )

    def _partition(self, b: FlatBuffer) -> list[torch.Tensor]:
        """Views of this rank's partition of ``b``'s params, one per unit (stage 0: the whole buffer)."""
        if b.shard is not None:
            return [b.layout.shard_of_partition(b.shard, u) for u in range(len(b.layout.units))]
        return [b.layout.shard_of_full(b.flat, u, self._ckpt_rank()) for u in range(len(b.layout.units))]

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer (module docstring): a dict of clones, for ``torch.save``."""
        self._check_alive("state_dict")
        self.wait_params()
        if self.stage3 is not None:
            self.stage3.wait_all()
        buffers = [
            {
                "params": torch.cat([v.detach() for v in self._partition(b)]).clone(),
                "state": {k: t.detach().clone() for k, t in b.state.items()},
                "steps": torch.stack([s.detach().float().cpu() for s in b.steps]),
            }
            for b in self.buffers
        ]
        return {
            "format": FORMAT,
            "zero_stage": self.stage,
            "partition_count": self.dp if self.stage > 0 else 1,
            "dp_rank": self._ckpt_rank(),
            "layout": self.describe()["buffers"],
            "param_groups": [
                {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k not in _HYPER_SKIP}
                for g in self.param_groups
            ],
            "buffers": buffers,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "skipped_steps": self.skipped_steps,
            "last_grad_norm": self.last_grad_norm,
            **({"experts": experts.state_dict()} if (experts := getattr(self, "experts", None)) is not None else {}),
        }

    def _mismatch(self, sd: Any) -> str | None:
        """Why ``sd`` cannot be loaded on this rank (None: it can)."""
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            given = type(sd).__name__ if not isinstance(sd, dict) else f"a dict with keys {sorted(sd)[:8]}"
            return (
                f"load_state_dict takes a state dict of llmpar's ZeroOptimizer.state_dict() (format {FORMAT!r}), "
                f"got {given}"
            )
        parts, mine = sd["partition_count"], self.dp if self.stage > 0 else 1
        if (sd["zero_stage"], parts, sd["dp_rank"]) != (self.stage, mine, self._ckpt_rank()):
            return (
                f"the state dict is dp rank {sd['dp_rank']}'s shard of a ZeRO stage-{sd['zero_stage']} optimizer "
                f"over {parts} partitions; this is dp rank {self._ckpt_rank()} of stage {self.stage} over {mine}: "
                "load each rank's own state dict at the same stage and dp degree (engine.save_checkpoint / "
                "load_checkpoint reshard between layouts)"
            )
        if sd["layout"] != self.describe()["buffers"] or len(sd["param_groups"]) != len(self.param_groups):
            return (
                "the state dict was taken from an optimizer with other params or param groups (its flat layout "
                "differs): load it into the same model and param groups"
            )
        for i, (b, saved) in enumerate(zip(self.buffers, sd["buffers"])):
            views = self._partition(b)
            want = {
                "params": (sum(v.numel() for v in views), views[0].dtype),
                **{k: (t.numel(), t.dtype) for k, t in b.state.items()},
            }
            got = {
                "params": (saved["params"].numel(), saved["params"].dtype),
                **{k: (t.numel(), t.dtype) for k, t in saved["state"].items()},
            }
            if want != got:
                return f"buffer {i}: the state dict holds {got}, this optimizer {want} (another precision mode?)"
        experts = getattr(self, "experts", None)
        if (experts is None) != ("experts" not in sd):
            return (
                "the state dict was taken from an optimizer "
                + ("without" if experts is not None else "with")
                + " expert params spread over expert-parallel ranks (its 'experts' entry), this one "
                + ("has them" if experts is not None else "has none")
            )
        if experts is not None:
            why = experts._mismatch(sd["experts"])
            return None if why is None else f"its expert optimizer's part (over the expert-data-parallel ranks): {why}"
        return None

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of this rank (module docstring). Collective over dp at stages 1-3 (call it on
        every rank); any rank's mismatch raises ``ValueError`` on every rank before anything is modified."""
        self._check_alive("load_state_dict")
        try:
            why = self._mismatch(state_dict)
        except (KeyError, TypeError, AttributeError) as e:
            why = f"the state dict is incomplete or malformed ({type(e).__name__}: {e})"
        error = ValueError(f"optimizer.load_state_dict: {why}") if why else None
        if self.stage > 0 and self.dp > 1:
            raise_if_any_failed(error, self.dp_group, what="optimizer.load_state_dict failed on one rank")
        elif error is not None:
            raise error
        self.wait_params()
        if self.stage3 is not None:
            self.stage3.wait_all()
        for b, saved in zip(self.buffers, state_dict["buffers"]):
            at = 0
            for view in self._partition(b):
                view.copy_(saved["params"][at : at + view.numel()])
                at += view.numel()
            for k, t in b.state.items():
                t.copy_(saved["state"][k])
            for s, v in zip(b.steps, saved["steps"].tolist()):
                s.fill_(v)
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
        if self.loss_scaler is not None and state_dict["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.skipped_steps = state_dict["skipped_steps"]
        self.last_grad_norm = state_dict["last_grad_norm"]
        self._after_partition_load()
        experts = getattr(self, "experts", None)
        if experts is not None:  # checked above with the dense part, on every rank
            experts.load_state_dict(state_dict["experts"])

    def _after_partition_load(self) -> None:
        """Make the params whole again from the loaded partitions (collective over dp at stages 1-3)."""
        if self.stage3 is not None:
            self.stage3.release_all()
            self.stage3.regather_persistent()
        elif self.stage in (1, 2) and self.dp > 1:
            from llmpar.zero.param_gather import _launch

            handles = [_launch(self, b, u)[0] for b in self.buffers for u in range(len(b.layout.units))]
            for h in handles:
                h.wait()

    def destroy(self) -> None:
        """Release hooks, gradients and optimizer states (module docstring); idempotent."""
        if self.destroyed:
            return
        self.wait_params()
        experts = getattr(self, "experts", None)
        if experts is not None:  # the expert params' optimizer (``experts.py``)
            experts.destroy()
        self.reducer.wait_all()
        self.reducer.remove_hooks()
        self.reducer.pool.clear()
        if self.deferred_gather is not None:
            self.deferred_gather.remove()
            self.deferred_gather = None
        if self.stage3 is not None:
            self.stage3.wait_all()
            self.stage3.remove_hooks()
            self.plan.units[0][1].register_forward_pre_hook(_refuse_stage3_forward)
        for b in self.buffers:
            b.state.clear()
            b.grad = torch.empty(0, dtype=b.grad.dtype, device=b.grad.device)
            b.host_grad = None
            for p in b.params:
                p.grad = None
        self.destroyed = True


__all__ = ["FORMAT", "OptimizerStateDict"]
