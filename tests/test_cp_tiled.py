"""Sequence-tiled loss and MLP (llmpar.context_parallel.tiled): float64 parity of values and gradients with the untiled
computation on odd shapes, no NaN without counted tokens, refused inputs, the vocab-parallel head on 2 ranks, and the
bytes autograd holds (counted through saved_tensors_hooks) falling with the tile."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmpar.context_parallel.tiled import TiledMLP, tiled_lm_loss, tiled_mlp

from multirank import multirank


class SavedBytes:
    """Peak bytes of the distinct storages autograd holds for backward while the context is open (forward and
    backward): each packed tensor is wrapped; the wrapper dies when autograd drops it. Tensors sharing storage
    with ``exclude`` (parameters, and their transposes a linear saves) are not counted."""

    def __init__(self, exclude=()) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [references, bytes]
        self.now = self.peak = 0

    def _pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.exclude:
            return t
        return _Held(t, self)

    @staticmethod
    def _unpack(held):
        return held.t if isinstance(held, _Held) else held

    def __enter__(self) -> "SavedBytes":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


class _Held:
    def __init__(self, t: torch.Tensor, owner: SavedBytes) -> None:
        self.t, self.owner = t, owner
        st = t.untyped_storage()
        self.key, nbytes = st.data_ptr(), st.nbytes()
        entry = owner.live.setdefault(self.key, [0, nbytes])
        if entry[0] == 0:
            owner.now += nbytes
            owner.peak = max(owner.peak, owner.now)
        entry[0] += 1

    def __del__(self) -> None:
        entry = self.owner.live[self.key]
        entry[0] -= 1
        if entry[0] == 0:
            self.owner.now -= entry[1]
            del self.owner.live[self.key]


def _loss_case(seed: int, B=3, S=37, d=19, V=53, ignore_frac=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, d, generator=g, dtype=dtype)
    w = torch.randn(V, d, generator=g, dtype=dtype) / d**0.5
    b = torch.randn(V, generator=g, dtype=dtype)
    y = torch.randint(0, V, (B, S), generator=g)
    y[torch.rand(B, S, generator=g) < ignore_frac] = -100
    return h, w, b, y


def _reference(h, w, b, y):
    return F.cross_entropy(F.linear(h, w, b).flatten(0, -2), y.flatten(), reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("with_bias,chunk", [(True, 10), (False, 7), (True, 1000)])
def test_tiled_loss_matches_cross_entropy_float64(with_bias, chunk):
    h, w, b, y = _loss_case(1 + chunk)
    b = b if with_bias else None
    leaves = [t.requires_grad_() for t in (h, w, b) if t is not None]
    loss, count = tiled_lm_loss(h, w, y, chunk=chunk, bias=b)
    grads = torch.autograd.grad(loss * 0.7, leaves)
    ref = _reference(h, w, b, y)
    ref_grads = torch.autograd.grad(ref * 0.7, leaves)
    assert int(count) == int((y != -100).sum())
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_tiled_loss_fp32_and_no_counted_token():
    h, w, b, y = _loss_case(5, dtype=torch.float32)
    h.requires_grad_()
    loss, _ = tiled_lm_loss(h, w, y, chunk=16, bias=b)
    torch.testing.assert_close(loss, _reference(h.double(), w.double(), b.double(), y).float(), rtol=1e-5, atol=0)
    y_none = torch.full_like(y, -100)
    loss, count = tiled_lm_loss(h, w, y_none, chunk=16, bias=b)
    (dh,) = torch.autograd.grad(loss, [h])
    assert int(count) == 0 and float(loss.detach()) == 0.0 and torch.isfinite(dh).all() and not dh.any()


def test_tiled_loss_refuses_bad_inputs():
    h, w, b, y = _loss_case(2)
    y[1, 4] = 53
    with pytest.raises(ValueError, match="labels hold 53.*vocab size 53"):
        tiled_lm_loss(h, w, y, chunk=8)
    with pytest.raises(ValueError, match="chunk=0"):
        tiled_lm_loss(h, w, y.clamp(0), chunk=0)
    with pytest.raises(ValueError, match="labels must be"):
        tiled_lm_loss(h, w, y[:, :5], chunk=8)
    with pytest.raises(ValueError, match="bias must be"):
        tiled_lm_loss(h, w, y.clamp(0), chunk=8, bias=b[:3])


@multirank(2)
def test_tiled_loss_vocab_parallel_two_ranks():
    rank = dist.get_rank()
    h, w, b, y = _loss_case(11, V=54)
    ref_leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    ref = _reference(*ref_leaves, y)
    ref.backward()
    rows = slice(27 * rank, 27 * (rank + 1))
    hl, wl, bl = h.clone().requires_grad_(), w[rows].clone().requires_grad_(), b[rows].clone().requires_grad_()
    loss, count = tiled_lm_loss(hl, wl, y, chunk=9, bias=bl, vocab_group=dist.group.WORLD)
    loss.backward()
    assert int(count) == int((y != -100).sum())
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(hl.grad, ref_leaves[0].grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(wl.grad, ref_leaves[1].grad[rows], rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(bl.grad, ref_leaves[2].grad[rows], rtol=1e-10, atol=1e-13)


def test_tiled_loss_holds_no_logits():
    h, w, b, y = _loss_case(3, B=2, S=64, d=8, V=512)
    h.requires_grad_()
    w.requires_grad_()
    with SavedBytes(exclude=[w]) as plain:
        _reference(h, w, None, y).backward()
    with SavedBytes(exclude=[w]) as tiled:
        tiled_lm_loss(h, w, y, chunk=16)[0].backward()
    logits_bytes = 2 * 64 * 512 * 8
    assert plain.peak >= logits_bytes  # log-softmax of every token is kept
    # tiled: hidden + labels + the per-token lse, nothing of size V
    assert tiled.peak <= h.numel() * 8 + y.numel() * 8 + 2 * 64 * 8
    assert tiled.peak < plain.peak / 10


class _MLP(nn.Module):
    def __init__(self, d: int, f: int, p: float = 0.0) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(d, f), nn.Linear(f, d), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


def test_tiled_mlp_matches_untiled_float64_and_hooks_fire_once():
    torch.manual_seed(0)
    mlp = _MLP(13, 29).double()
    x = torch.randn(3, 41, 13, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 41, 13, dtype=torch.float64)
    fired = {name: 0 for name, _ in mlp.named_parameters()}
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=name: fired.__setitem__(n, fired[n] + 1))
        for name, p in mlp.named_parameters()
    ]
    y = TiledMLP(mlp, 6)(x)
    y.backward(dy)
    got = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    for h in hooks:
        h.remove()
    assert set(fired.values()) == {1}  # one gradient per parameter per backward (ZeRO's reduction hook)
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    y_ref = mlp(x)
    y_ref.backward(dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-13, atol=1e-14)
    for g, p in zip(got, [x] + list(mlp.parameters())):
        torch.testing.assert_close(g, p.grad, rtol=1e-11, atol=1e-13)


def test_tiled_mlp_replays_dropout_and_plain_callables():
    mlp = _MLP(7, 11, p=0.4).double().train()
    x = torch.randn(2, 23, 7, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(4)
    y = tiled_mlp(mlp, x, 5)
    y.sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    torch.manual_seed(4)  # the same masks: one forward per slice in order
    ref = torch.cat([mlp(xc) for xc in x.split(5, 1)], 1)
    ref.sum().backward()
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    for g, p in zip(got, [x] + list(mlp.parameters())):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-14)
    w = torch.randn(7, 7, dtype=torch.float64, requires_grad=True)
    (dw,) = torch.autograd.grad(tiled_mlp(lambda t: torch.tanh(t @ w), x, 4, params=[w]).sum(), [w])
    torch.testing.assert_close(dw, torch.autograd.grad(torch.tanh(x @ w).sum(), [w])[0], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="position-wise"):
        tiled_mlp(lambda t: t.sum(1, keepdim=True), x, 4)
    with pytest.raises(ValueError, match="chunk=-1"):
        TiledMLP(mlp, -1)


def test_tiled_mlp_holds_one_slice_of_intermediates():
    mlp = _MLP(16, 64)
    x = torch.randn(2, 256, 16, requires_grad=True)
    params = list(mlp.parameters())
    with SavedBytes(exclude=params) as plain:
        mlp(x).sum().backward()
    with SavedBytes(exclude=params) as tiled:
        tiled_mlp(mlp, x, 32).sum().backward()
    x_bytes = x.numel() * 4
    slice_of_plain = (plain.peak - x_bytes) * 32 / 256
    assert plain.peak >= x_bytes + 2 * 2 * 256 * 64 * 4  # up(x) and gelu(up(x)) kept for every token
    assert tiled.peak <= x_bytes + 1.05 * slice_of_plain + x_bytes * 32 / 256
    assert tiled.peak < plain.peak / 3
