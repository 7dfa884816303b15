"""The mixture-of-experts layer: router + dispatcher + experts (+ shared experts), dropless by default.

``MoEBlock(hidden_size, intermediate_size, num_experts, top_k, ep_group=None, ...)`` maps ``x: [..., H]`` to
``[..., H]``::

    out_t = sum_j w_tj * expert_{idx_tj}(x_t)  [+ shared(x_t)]

with ``idx, w`` from the :class:`~llmpar.moe.router.Router` (fp32), the experts SwiGLU MLPs in transformers' packed
layout (:class:`~llmpar.moe.experts.Experts`), the weighing in fp32 (:mod:`llmpar.moe.slots`). With an
``ep_group`` of ep ranks each rank holds ``num_experts / ep`` experts and the tokens travel by all-to-all
(:mod:`llmpar.moe.alltoall`); every rank passes its own tokens (the group's ranks are data-parallel for everything
but the experts) and gets its own tokens' outputs. The shared experts run while the tokens are in flight.

With an ``etp_group`` (expert tensor parallelism, Megatron-Core's ``expert_tensor_parallel_size``) each expert's
intermediate dimension is split over its etp ranks (:mod:`llmpar.moe.expert_tp`): the ranks of one etp group sit at
the same ep rank, pass the same tokens (the attention's tensor-parallel ranks), exchange them over their own ep
groups (every ep group holds one etp rank's shards) and sum the experts' partial outputs over the etp group. The
router and shared experts are replicated over it. :func:`~llmpar.moe.expert_tp.expert_parallel_groups` builds both
groups. Without one, tensor-parallel ranks holding the same tokens each run whole experts (replicated over tp).

After each forward the layer exposes, for the training loop and logs:

- ``aux_loss``: the router's weighted auxiliary loss (add it to the training loss; zero when none is on) and
  ``aux_losses`` (the unweighted ones by name);
- ``tokens_per_expert``: ``[E]`` int64, this rank's slots per global expert (before capacity dropping);
- ``stats``: :class:`~llmpar.moe.slots.DispatchStats` (rows sent per expert, received per local expert, dropped).

Bad input is refused on every rank of the group before any exchange can hang: at construction (``num_experts`` not
divisible by ep, ``intermediate_size`` not divisible by etp, ``top_k`` > ``num_experts``, a bad router option;
arguments differing between ranks; an etp group whose ranks sit at different ep ranks), and at each
forward (an input of the wrong hidden size, or a router producing NaN / inf on any rank: the count exchange carries
each rank's status).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpar.distributed import GroupRef, check_same_on_ranks, group_rank, group_size, raise_if_any_failed
from llmpar.moe.dispatch import Dispatcher, make_dispatcher
from llmpar.moe.expert_tp import check_expert_tp
from llmpar.moe.experts import Experts, SharedExperts, _tag_expert
from llmpar.moe.router import Router, RouterConfig, _check_int
from llmpar.moe.slots import DispatchStats, check_capacity_factor


def _check_args(
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    ep: int,
    etp: int,
    router: RouterConfig,
    capacity_factor: float | None,
    shared_intermediate_size: int,
) -> None:
    _check_int("hidden_size", hidden_size, 1)
    _check_int("intermediate_size", intermediate_size, 1)
    _check_int("num_experts", num_experts, 1)
    _check_int("top_k", top_k, 1)
    _check_int("shared_intermediate_size", shared_intermediate_size, 0)
    if num_experts % ep:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel size ep={ep}: each rank of the "
            f"expert-parallel group holds num_experts / ep experts (use a multiple of {ep}, or another ep)"
        )
    check_expert_tp(intermediate_size, etp)
    router.check(num_experts, top_k)
    check_capacity_factor(capacity_factor)


def _agree(error: Exception | None, args: tuple, ep: tuple, etp: tuple) -> None:
    """Raise on every rank of the ep and etp groups when any failed its argument checks, when the arguments differ
    between them, or when the groups do not cross (the etp ranks must share their ep rank and ep size, the ep ranks
    their etp rank and etp size). ``ep`` / ``etp``: ``(group or None, size, rank)``."""
    groups = [g for g, size, _ in (ep, etp) if g is not None and size > 1]
    if not groups:
        if error is not None:
            raise error
        return
    raise_if_any_failed(error, groups, what="MoE layer arguments")
    mismatch: Exception | None = None
    for (g, size, _), (other, o_size, o_rank) in ((ep, etp), (etp, ep)):
        if g is None or size == 1:
            continue
        try:  # every rank runs every check (no rank leaves early while another waits in the next one)
            check_same_on_ranks(
                repr((args, o_size, o_rank)),
                g,
                what="MoE layer arguments" + ("" if other is None else " (and the position on the other group)"),
                hint="build the layer with the same arguments on every rank, the ranks of one etp group at one ep "
                "rank (llmpar.moe.expert_parallel_groups builds such groups)",
            )
        except ValueError as err:
            mismatch = mismatch or err
    raise_if_any_failed(mismatch, groups, what="MoE layer arguments")


class MoEBlock(nn.Module):
    """See the module docstring. ``router``: the routing options (:class:`~llmpar.moe.router.RouterConfig`);
    ``capacity_factor``: None (dropless) or the per-expert capacity factor; ``shared_intermediate_size``: width of
    the shared experts (0: none), ``shared_gate``: Qwen2-MoE's sigmoid gate on them; ``ep_group`` / ``etp_group``:
    the expert-parallel and expert-tensor-parallel groups (None: degree 1; module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        ep_group: Any = None,
        etp_group: Any = None,
        router: RouterConfig | None = None,
        capacity_factor: float | None = None,
        shared_intermediate_size: int = 0,
        shared_gate: bool = False,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        config = router if router is not None else RouterConfig()
        group = None if ep_group is None else GroupRef(ep_group)
        ep, rank = (1, 0) if group is None else (group_size(group.get()), group_rank(group.get()))
        etp_ref = None if etp_group is None else GroupRef(etp_group)
        etp, etp_rank = (1, 0) if etp_ref is None else (group_size(etp_ref.get()), group_rank(etp_ref.get()))
        args = (
            hidden_size,
            intermediate_size,
            num_experts,
            top_k,
            ep,
            etp,
            config,
            capacity_factor,
            shared_intermediate_size,
        )
        error: Exception | None = None
        try:
            _check_args(*args)
        except (TypeError, ValueError) as err:
            error = err
        _agree(error, args + (shared_gate,), (group, ep, rank), (etp_ref, etp, etp_rank))
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.ep_size, self.ep_rank, self.etp_size = ep, rank, etp
        self.router = Router(hidden_size, num_experts, top_k, config, init_std=init_std, device=device, dtype=dtype)
        self.experts = Experts(
            num_experts,
            hidden_size,
            intermediate_size,
            ep_size=ep,
            ep_rank=rank,
            etp_group=etp_ref,
            init_std=init_std,
            device=device,
            dtype=dtype,
        )
        self.shared_experts = (
            SharedExperts(
                hidden_size, shared_intermediate_size, gate=shared_gate, init_std=init_std, device=device, dtype=dtype
            )
            if shared_intermediate_size
            else None
        )
        self.capacity_factor = capacity_factor
        self.dispatcher: Dispatcher = make_dispatcher(num_experts, group, capacity_factor)
        self.aux_loss: torch.Tensor | None = None
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.tokens_per_expert: torch.Tensor | None = None
        self.stats: DispatchStats | None = None

    def _refusal(self, x: torch.Tensor) -> str | None:
        if not isinstance(x, torch.Tensor):
            return f"the MoE layer's input must be a torch.Tensor, got {type(x).__name__}"
        if x.dim() < 2 or x.shape[-1] != self.hidden_size:
            return f"the MoE layer's input {tuple(x.shape)} must be [..., hidden_size={self.hidden_size}]"
        if not x.is_floating_point():
            return f"the MoE layer's input must be floating point, got {x.dtype}"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        refusal = self._refusal(x)
        if refusal is not None:
            self.dispatcher.fail(refusal)  # raises here, and on every other rank of the group
        shape = x.shape
        flat = x.reshape(-1, self.hidden_size)
        routing = self.router(flat, seq_len=shape[-2] if x.dim() >= 3 else None)
        pending = self.dispatcher.dispatch_async(flat, routing)
        shared = self.shared_experts(flat) if self.shared_experts is not None else None
        x_local, counts, meta = pending.wait()
        y_local = self.experts(x_local, counts)
        out = self.dispatcher.combine(y_local, meta)
        if shared is not None:
            out = out + shared
        self.aux_loss, self.aux_losses = routing.aux_loss, routing.aux_losses
        self.tokens_per_expert, self.stats = routing.counts, meta.stats
        return out.view(shape)

    @torch.no_grad()
    def set_ep_group(self, ep_group: Any) -> None:
        """Spread a layer built with ``ep_group=None`` over ``ep_group`` (the hook ``llmpar.initialize`` calls with
        the config's expert-parallel group): keep this rank's ``num_experts / ep`` experts (global ids
        ``[rank * n, (rank + 1) * n)``, the slice a layer built with that group holds under the same seed), tag them
        with the ep size, and exchange tokens over the group from the next forward. The expert Parameters stay the
        same objects (their data cut to this rank's rows), so an optimizer's param list taken earlier still holds
        them; build the optimizer's state after this call. ``num_experts`` not divisible by ep is refused on every
        rank of the group."""
        group = GroupRef(ep_group)
        ep, rank = group_size(group.get()), group_rank(group.get())
        error: Exception | None = None
        if self.ep_size != 1:
            error = ValueError(
                f"set_ep_group: the layer is already spread over an expert-parallel group of {self.ep_size}"
            )
        elif self.num_experts % ep:
            error = ValueError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel size ep={ep}: each rank of "
                f"the expert-parallel group holds num_experts / ep experts (use a multiple of {ep}, or another ep)"
            )
        if ep > 1:
            raise_if_any_failed(error, group, what="MoE layer set_ep_group")
        elif error is not None:
            raise error
        if ep == 1:
            return
        ex, n = self.experts, self.num_experts // ep
        for name in ("gate_up_proj", "down_proj"):  # the same Parameter keeps only its rows: a client optimizer or
            full = getattr(ex, name)  # a parameter list made before initialize still holds the model's experts
            full.data = full.data[rank * n : (rank + 1) * n].clone()
            _tag_expert(full, ep)
        ex.ep_size, ex.ep_rank, ex.num_local_experts = ep, rank, n
        self.ep_size, self.ep_rank = ep, rank
        self.dispatcher = make_dispatcher(self.num_experts, group, self.capacity_factor)

    @torch.no_grad()
    def update_expert_bias(self, group: Any = None) -> torch.Tensor:
        """The router's aux-loss-free bias step (:meth:`~llmpar.moe.router.Router.update_expert_bias`): pass the
        group over which the load is summed (the data-parallel ranks, which include this layer's ep group)."""
        return self.router.update_expert_bias(None if group is None else GroupRef(group))

    def extra_repr(self) -> str:
        etp = f", etp={self.etp_size}" if self.etp_size > 1 else ""
        return f"experts={self.num_experts}, top_k={self.top_k}, ep={self.ep_size} (rank {self.ep_rank}){etp}"


__all__ = ["MoEBlock"]
