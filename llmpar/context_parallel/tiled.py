"""Sequence-tiled loss and MLP: the two activations of a long sequence that are largest per token are held one tile
of tokens at a time, so activation memory falls with the tile instead of growing with the whole sequence.

``tiled_lm_loss(hidden, weight, labels, chunk=...)``: the causal-LM cross-entropy of ``hidden @ weight^T (+ bias)``
without ever holding the [tokens, V] logits. Tokens are taken ``chunk`` at a time (over the flattened [B * S] tokens);
forward keeps, for backward, only its inputs and the per-token log-sum-exp (4 bytes per token); backward recomputes
each tile's logits. With lse_i = log sum_v exp(z_iv), z = h W^T + b and target t_i:

    loss_sum = sum_{i: t_i != ignore} (lse_i - z_{i, t_i}),      count = #{i: t_i != ignore}
    dz_i = g (softmax(z_i) - onehot(t_i))  (0 for ignored rows),  dh = dz W,  dW = dz^T h,  db = sum_i dz_i

``labels`` are aligned with ``hidden`` (label[b, s] is the target of position s: shifted by the caller, as the
context-parallel adapters do before sharding so no label is lost at a shard boundary). Logits are computed in the
weight's dtype and reduced in float32 (float64 for float64 inputs). With ``vocab_group`` the head is vocab-parallel:
``weight`` [V / n, d] is rank r's rows [r V/n, (r+1) V/n) of the vocabulary, ``hidden`` is the same on every rank of the
group; the row max and sums are all-reduced per tile (forward only: backward uses the saved lse), and the gradient
of ``hidden`` is all-reduced over the group inside backward (do not put a copy-to-region before this function).

``tiled_mlp(fn, x, chunk)`` / ``TiledMLP``: a position-wise ``fn`` (an MLP: output position i depends only on input
position i) applied over ``chunk``-long slices of the sequence (dim 1). Forward runs without keeping fn's
intermediates; backward recomputes one slice at a time (with the RNG state of its forward, so dropout replays) and
hands the parameter gradients, summed over slices, back to autograd once, so a gradient hook (ZeRO's reduction)
fires once per parameter. At any time the MLP's intermediates of one slice are alive: ``chunk / S`` of the untiled
ones, at the price of one more forward of the MLP.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..distributed.collectives import all_reduce
from ..distributed.groups import group_rank, group_size


def _check_chunk(chunk: Any) -> int:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be a positive integer (tokens per tile)")
    return chunk


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_loss_inputs(hidden, weight, labels, bias) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must be floating point")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [V, d] with d = hidden.shape[-1]; got weight {tuple(weight.shape)}, "
            f"hidden {tuple(hidden.shape)}"
        )
    if labels.dtype not in (torch.int64, torch.int32) or tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must be int64/int32 of shape {tuple(hidden.shape[:-1])} (hidden without its last "
            f"dim), got {labels.dtype} {tuple(labels.shape)}"
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(
            f"bias must be a tensor of shape ({weight.shape[0]},), got "
            f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}"
        )


class _TiledLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, ignore_index: int, group):  # type: ignore[override]
        d = hidden.shape[-1]
        h = hidden.reshape(-1, d)
        t = labels.reshape(-1).long()
        n, vl = h.shape[0], weight.shape[0]
        size = 1 if group is None else group_size(group)
        start = 0 if group is None else group_rank(group) * vl
        valid = t != ignore_index
        bad = valid & ((t < 0) | (t >= vl * size))
        if bool(bad.any()):  # the same labels on every rank of the group: every rank raises
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"labels hold {int(t[i])} at flat token {i}: accepted are 0 <= label < vocab size "
                f"{vl * size} or ignore_index={ignore_index}"
            )
        acc = _acc(hidden.dtype)
        lse = torch.empty(n, dtype=acc, device=h.device)
        loss = torch.zeros((), dtype=acc, device=h.device)
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            z = torch.nn.functional.linear(h[r0:r1], weight, bias).to(acc)
            local = t[r0:r1] - start
            inside = valid[r0:r1] & (local >= 0) & (local < vl)
            zt = z.gather(1, local.clamp(0, vl - 1)[:, None])[:, 0] * inside
            m = z.max(dim=1).values
            if size > 1:
                all_reduce(m, group, op="max", what="tiled_lm_loss row max")
            se_t = torch.stack([torch.exp(z - m[:, None]).sum(1), zt])
            if size > 1:
                all_reduce(se_t, group, what="tiled_lm_loss row sums and target logits")
            lse[r0:r1] = m + torch.log(se_t[0])
            loss += ((lse[r0:r1] - se_t[1]) * valid[r0:r1]).sum()
        ctx.save_for_backward(hidden, weight, bias, t, lse)
        ctx.chunk, ctx.ignore_index, ctx.group, ctx.start, ctx.size = chunk, ignore_index, group, start, size
        count = valid.sum()
        ctx.mark_non_differentiable(count)
        return loss, count

    @staticmethod
    def backward(ctx, g, _count):  # type: ignore[override]
        hidden, weight, bias, t, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        d = hidden.shape[-1]
        h = hidden.reshape(-1, d)
        n, vl, acc = h.shape[0], weight.shape[0], lse.dtype
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        db = torch.zeros(vl, dtype=acc, device=weight.device) if need_b and bias is not None else None
        g = g.to(acc)
        for r0 in range(0, n, ctx.chunk):
            r1 = min(n, r0 + ctx.chunk)
            hc = h[r0:r1]
            p = torch.exp(torch.nn.functional.linear(hc, weight, bias).to(acc) - lse[r0:r1, None])
            tc = t[r0:r1]
            valid = tc != ctx.ignore_index
            local = tc - ctx.start
            inside = valid & (local >= 0) & (local < vl)
            rows = inside.nonzero()[:, 0]
            p[rows, local[rows]] -= 1.0
            p *= (valid.to(acc) * g)[:, None]
            if dh is not None:
                dh[r0:r1] = (p.to(weight.dtype) @ weight).to(dh.dtype)
            if dw is not None:
                dw += p.transpose(0, 1) @ hc.to(acc)
            if db is not None:
                db += p.sum(0)
        if dh is not None and ctx.size > 1:
            all_reduce(dh, ctx.group, what="tiled_lm_loss hidden gradient")
        return (
            None if dh is None else dh.view_as(hidden),
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def tiled_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk: int,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    vocab_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, count)``: the summed cross-entropy of ``hidden [..., d] @ weight[V, d]^T (+ bias [V])`` against
    ``labels [...]`` (aligned, ``ignore_index`` skipped) and the number of counted tokens (int64 tensor), with the
    logits held for ``chunk`` tokens at a time (module doc). ``loss_sum`` is differentiable w.r.t. hidden, weight and
    bias, in float32 (float64 for float64 inputs); ``loss_sum / count`` is the mean ``F.cross_entropy`` gives. No
    counted token: 0 and 0 (no NaN). A label outside [0, V) that is not ``ignore_index`` raises ValueError.
    ``vocab_group``: the process group of a vocab-parallel head (``weight`` is this rank's [V / n, d] rows)."""
    _check_loss_inputs(hidden, weight, labels, bias)
    _check_chunk(chunk)
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index={ignore_index!r} must be an int")
    return _TiledLMLoss.apply(hidden, weight, bias, labels, chunk, ignore_index, vocab_group)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk: int, dim: int, x, *params):  # type: ignore[override]
        ctx.fn, ctx.chunk, ctx.dim, ctx.rng, ctx.fn_params = fn, chunk, dim, [], params
        outs = []
        for xc in x.split(chunk, dim):
            ctx.rng.append(_rng_state(x.device))
            y = fn(xc)
            if not isinstance(y, torch.Tensor) or y.shape[dim] != xc.shape[dim]:
                got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                raise ValueError(
                    f"tiled_mlp: fn must be position-wise (one output per position along dim {dim}); "
                    f"a slice of shape {tuple(xc.shape)} gave {got}"
                )
            outs.append(y)
        ctx.save_for_backward(x)
        return torch.cat(outs, dim)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        params = ctx.fn_params
        want = [i for i, p in enumerate(params) if p.requires_grad]
        dparams: list[torch.Tensor | None] = [None] * len(params)
        dx = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        offset = 0
        for xc, dyc, (cpu_rng, dev_rng) in zip(x.split(ctx.chunk, ctx.dim), dy.split(ctx.chunk, ctx.dim), ctx.rng):
            xc = xc.detach().requires_grad_(dx is not None)
            devices = [x.device] if dev_rng is not None else []
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                torch.set_rng_state(cpu_rng)
                if dev_rng is not None:
                    torch.cuda.set_rng_state(dev_rng, x.device)
                yc = ctx.fn(xc)
            inputs = ([xc] if dx is not None else []) + [params[i] for i in want]
            grads = torch.autograd.grad(yc, inputs, dyc, allow_unused=True) if inputs else ()
            del yc
            if dx is not None:
                dx.narrow(ctx.dim, offset, xc.shape[ctx.dim]).copy_(grads[0])
                grads = grads[1:]
            for i, gp in zip(want, grads):
                if gp is not None:
                    dparams[i] = gp if dparams[i] is None else dparams[i] + gp
            offset += xc.shape[ctx.dim]
        return (None, None, None, dx, *dparams)


def tiled_mlp(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    chunk: int,
    *,
    dim: int = 1,
    params: Iterable[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``fn(x)`` computed over ``chunk``-long slices of ``x`` along ``dim`` with recompute in backward (module doc).
    ``fn`` must be position-wise along ``dim``. Its parameters: ``fn.parameters()`` for an ``nn.Module``, else
    ``params`` (tensors ``fn`` reads that need gradients; a tensor fn reads but is not listed gets none)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_chunk(chunk)
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r} is not a dimension of x with shape {tuple(x.shape)}")
    dim = dim % x.dim()
    if params is None:
        params = fn.parameters() if isinstance(fn, nn.Module) else ()
    plist = list(params)
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in plist)):
        return torch.cat([fn(xc) for xc in x.split(chunk, dim)], dim)
    return _TiledMLP.apply(fn, chunk, dim, x, *plist)


class TiledMLP(nn.Module):
    """``mlp`` (a position-wise module, e.g. a transformer block's MLP) applied ``chunk`` positions at a time along
    ``dim`` with recompute (``tiled_mlp``). Its parameters stay ``mlp``'s (state-dict keys gain ``mlp.``)."""

    def __init__(self, mlp: nn.Module, chunk: int, *, dim: int = 1) -> None:
        super().__init__()
        self.mlp, self.chunk, self.dim = mlp, _check_chunk(chunk), dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_mlp(self.mlp, x, self.chunk, dim=self.dim)
