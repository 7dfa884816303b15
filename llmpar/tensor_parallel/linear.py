"""Column- and row-parallel linear layers (Megatron-Core style) with overlapped communication.

``ColumnParallelLinear``: ``W: [out/tp, in]``, ``b: [out/tp]``; ``x: [..., in]`` (replicated) -> ``y: [..., out/tp]``
(or ``[..., out]`` with ``gather_output``), optionally ``y = act(x W^T + b)`` (``activation=``, elementwise, so each
rank applies it to its slice: an MLP up-projection is one fused op). Under ``sequence_parallel`` the input is this
rank's dim-0 shard
``[s/tp, ..., in]`` and the output covers the whole sequence ``[s, ..., out/tp]``.

``RowParallelLinear``: ``W: [out, in/tp]``, ``b: [out]`` added once after the reduction; ``x: [..., in/tp]``
(``input_is_parallel``, else ``[..., in]`` and scattered here) -> ``y: [..., out]`` summed over ranks, or this rank's
dim-0 shard ``[s/tp, ..., out]`` under ``sequence_parallel``.

``ParallelLMHead``: a column-parallel vocabulary projection whose vocabulary is padded up to a multiple of tp; the
padded columns are dropped on ``gather_output``, and hold -inf in a split output (so that a softmax, and
:func:`vocab_parallel_cross_entropy`, see only the real vocabulary and a target id there is caught).

Every rank of the group must get an input of the same shape: a shape not seen before is compared across the group once
(one small all-gather, ``_agree.ShapeGuard``), then remembered by the layer.

Under torch.compile the layers trace as plain products around functional collectives (``_traceable``: no graph
break, no ProcessGroup in an autograd ``ctx``); the chunked overlap (``comm_chunks``, ``overlap_grad_comm``) is the
eager path's, and the shape agreement is left to the always-on checks of the embedding and the loss (a graph's
shapes are fixed when it is traced).

On CUDA tensors (or with ``LLMPAR_BACKEND=triton|cuda``) the local products run through ``llmpar.ops.gemm``
(cuBLASLt / Triton, bias and activation in the GEMM's epilogue, fused backward); on CPU by default plain torch.

Initialisation is single-device identical: by default the full weight is drawn exactly as ``nn.Linear(in, out)``
on the same device would draw it (same RNG calls), and each rank keeps its slice; ``init_method(full_weight)``
replaces the weight draw (bias then starts at zero, as in Megatron). Every rank must hold the same RNG state.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmpar.distributed.collectives import GroupRef
from llmpar.ops.gemm import ACTIVATIONS, _act_torch, linear_act
from llmpar.tensor_parallel import _traceable
from llmpar.tensor_parallel._agree import ShapeGuard
from llmpar.tensor_parallel._overlap import _ColumnParallelMatmul, _RowParallelMatmul, fused_path
from llmpar.tensor_parallel._utils import Group, check_positive, divide, pad_to_multiple, resolve_tp_group, tp_size_rank
from llmpar.tensor_parallel.comm import gather_from_tensor_region, scatter_to_tensor_region

InitMethod = Callable[[torch.Tensor], object]
_SKIP_INIT = object()  # from_linear: allocate only, the caller copies the weights in


def _master_linear(in_f: int, out_f: int, bias: bool, init_method, device, dtype):
    """The full ``[out, in]`` weight (and ``[out]`` bias) a single-device layer would hold."""
    if init_method is None:
        ref = nn.Linear(in_f, out_f, bias=bias, device=device, dtype=dtype)
        return ref.weight.detach(), (ref.bias.detach() if bias else None)
    w = torch.empty(out_f, in_f, device=device, dtype=dtype)
    with torch.no_grad():
        init_method(w)
    return w, (torch.zeros(out_f, device=device, dtype=dtype) if bias else None)


def _tag(p: nn.Parameter, dim: int | None) -> nn.Parameter:
    """Mark a parameter as split over tp along ``dim`` (None: replicated). Read by grad-norm / checkpoint code."""
    p.tensor_model_parallel = dim is not None  # type: ignore[attr-defined]
    p.partition_dim = dim  # type: ignore[attr-defined]
    return p


def _check_chunks(comm_chunks: int) -> int:
    return check_positive("comm_chunks", comm_chunks)


def _from_linear(cls, linear: nn.Linear, group: Group, kwargs: dict):
    """Build a ``cls`` layer holding this rank's slice of ``linear`` (shared by the column and row layers)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
    w = linear.weight
    layer = cls(
        linear.in_features,
        linear.out_features,
        linear.bias is not None,
        group=group,
        init_method=_SKIP_INIT,
        device=w.device,
        dtype=w.dtype,
        **kwargs,
    )
    layer.load_full_(w.detach(), None if linear.bias is None else linear.bias.detach())
    return layer


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with the rows of ``W`` (output features) split across the ranks of ``group``.

    Args:
        group: the tensor-parallel ProcessGroup, a 1-D DeviceMesh, or a mesh with a ``"tp"`` axis.
        gather_output: all-gather the output to ``[..., out]`` on every rank.
        sequence_parallel: input is this rank's dim-0 shard; it is all-gathered (in ``comm_chunks`` pieces,
            overlapped with the matmul) and the input gradient is reduce-scattered back.
        comm_chunks: pieces the sequence all-gather is cut into (1 = no forward overlap).
        overlap_grad_comm: launch the input-gradient collective asynchronously and compute ``dW`` meanwhile.
        reduce_input_grad: False returns this rank's *partial* input gradient, for callers that reduce it once
            for several column layers sharing one input (e.g. q, k, v after one ``copy_to_tensor_region``).
        activation: applied to the output, one of ``llmpar.ops.ACTIVATIONS`` (none, gelu_tanh, gelu_erf, silu,
            relu); fused into the GEMM's epilogue on the fused path.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Group,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        comm_chunks: int = 1,
        overlap_grad_comm: bool = True,
        reduce_input_grad: bool = True,
        activation: str = "none",
        init_method: InitMethod | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = GroupRef(resolve_tp_group(group))  # by name: see GroupRef
        self.tp, self.tp_rank = tp_size_rank(self.group)
        self.in_features = check_positive("in_features", in_features)
        self.out_features = check_positive("out_features", out_features)
        self.padded_out_features = self._padded_out(out_features)
        self.out_features_per_rank = self.padded_out_features // self.tp
        self.gather_output = bool(gather_output)
        self.sequence_parallel = bool(sequence_parallel)
        self.comm_chunks = _check_chunks(comm_chunks)
        self.overlap_grad_comm = bool(overlap_grad_comm)
        if sequence_parallel and not reduce_input_grad:
            raise ValueError(
                "reduce_input_grad=False cannot be combined with sequence_parallel=True "
                "(the input gradient must be reduce-scattered back to the sequence shards)"
            )
        self.reduce_input_grad = bool(reduce_input_grad)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; use one of {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self._shapes = ShapeGuard(type(self).__name__)
        shape = (self.out_features_per_rank, in_features)
        self.weight = _tag(nn.Parameter(torch.empty(shape, device=device, dtype=dtype)), 0)
        self.bias = _tag(nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype)), 0) if bias else None
        if init_method is not _SKIP_INIT:
            w, b = _master_linear(in_features, out_features, bias, init_method, device, dtype)
            self.load_full_(w, b)

    def _padded_out(self, out_features: int) -> int:
        divide(out_features, self.tp, "out_features")
        return out_features

    def _output_bias(self) -> torch.Tensor | None:
        return self.bias

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's rows of a full ``[out, in]`` weight (and ``[out]`` bias) into the layer."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight has shape {tuple(weight.shape)}, expected [out, in] = "
                f"[{self.out_features}, {self.in_features}]"
            )
        pad = self.padded_out_features - self.out_features
        rows = slice(self.tp_rank * self.out_features_per_rank, (self.tp_rank + 1) * self.out_features_per_rank)
        self.weight.copy_(F.pad(weight, (0, 0, 0, pad))[rows])
        if self.bias is not None:
            if bias is None:
                raise ValueError("the layer has a bias but bias=None was given")
            self.bias.copy_(F.pad(bias, (0, pad))[rows])

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: Group, **kwargs) -> "ColumnParallelLinear":
        """A column-parallel layer holding this rank's slice of ``linear``'s weights (``linear`` is not changed)."""
        return _from_linear(cls, linear, group, kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1 and not torch.compiler.is_compiling():  # first: with the shapes equal on every rank, the
            self._shapes.check(x.shape, self.group)  # checks below decide alike everywhere (see _agree: not traced)
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"input of shape {tuple(x.shape)} does not end in in_features={self.in_features} "
                f"({type(self).__name__})"
            )
        if self.sequence_parallel and x.dim() < 2:
            raise ValueError(f"sequence_parallel needs an input of shape [s/tp, ..., in], got {tuple(x.shape)}")
        fused, act = fused_path(x), self.activation
        if self.tp == 1:
            y = linear_act(x, self.weight, self.bias, act=act) if fused else F.linear(x, self.weight, self.bias)
        elif torch.compiler.is_compiling():  # functional collectives, one graph (_traceable)
            y = _traceable.column_linear(
                x,
                self.weight,
                self._output_bias(),
                self.group,
                sequence_parallel=self.sequence_parallel,
                reduce_input_grad=self.reduce_input_grad,
                act=act if fused else "none",
                fused=fused,
            )
        else:
            y = _ColumnParallelMatmul.apply(
                x,
                self.weight,
                self._output_bias(),
                self.group,
                self.sequence_parallel,
                self.comm_chunks,
                self.overlap_grad_comm,
                self.reduce_input_grad,
                act if fused else "none",
                fused,
            )
        if not fused and act != "none":
            y = _act_torch(y, act)
        if self.gather_output:
            y = gather_from_tensor_region(y, self.group)
            if self.padded_out_features != self.out_features:
                y = y[..., : self.out_features]
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}, comm_chunks={self.comm_chunks}"
            + (f", activation={self.activation}" if self.activation != "none" else "")
        )


class ParallelLMHead(ColumnParallelLinear):
    """Column-parallel projection onto a vocabulary of ``out_features`` that need not divide by tp.

    ``W: [V_pad/tp, in]`` with ``V_pad = ceil(V / tp) * tp``; padded rows are zero. Output ``[..., V]`` when
    gathered, else ``[..., V_pad/tp]`` with -inf in the padding columns (``>= V``): they come from a bias of -inf there,
    added with the product (the GEMM's bias epilogue, or addmm), and pass no gradient back. Feed it to
    :func:`vocab_parallel_cross_entropy`, which then knows the real vocabulary; a softmax / argmax of it never picks a
    padding column.
    """

    def _padded_out(self, out_features: int) -> int:
        return pad_to_multiple(out_features, self.tp)

    def _output_bias(self) -> torch.Tensor | None:
        """The bias with -inf on this rank's padding columns (none unless the output stays split)."""
        valid = min(max(self.out_features - self.vocab_start, 0), self.out_features_per_rank)
        if self.gather_output or valid == self.out_features_per_rank:
            return self.bias
        real = self.bias[:valid] if self.bias is not None else self.weight.new_zeros(valid)
        return F.pad(real, (0, self.out_features_per_rank - valid), value=float("-inf"))

    @property
    def vocab_size(self) -> int:
        return self.out_features

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.out_features_per_rank


class RowParallelLinear(nn.Module):
    """``y = sum_ranks x_r W_r^T + b`` with the columns of ``W`` (input features) split across ``group``.

    Args:
        input_is_parallel: the input is already this rank's ``[..., in/tp]`` shard (e.g. a column layer's output);
            otherwise it is ``[..., in]`` and split here.
        sequence_parallel: reduce-scatter the output along dim 0 instead of all-reducing it.
        comm_chunks: the tokens are cut into this many pieces; piece i's reduction overlaps piece i+1's matmul.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Group,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        comm_chunks: int = 1,
        init_method: InitMethod | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = GroupRef(resolve_tp_group(group))  # by name: see GroupRef
        self.tp, self.tp_rank = tp_size_rank(self.group)
        self.in_features = check_positive("in_features", in_features)
        self.out_features = check_positive("out_features", out_features)
        self.in_features_per_rank = divide(in_features, self.tp, "in_features")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (RowParallelLinear)")
        self.input_is_parallel = bool(input_is_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        self.comm_chunks = _check_chunks(comm_chunks)
        self._shapes = ShapeGuard(type(self).__name__)
        self.weight = _tag(
            nn.Parameter(torch.empty(out_features, self.in_features_per_rank, device=device, dtype=dtype)), 1
        )
        self.bias = _tag(nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)), None) if bias else None
        if init_method is not _SKIP_INIT:
            w, b = _master_linear(in_features, out_features, bias, init_method, device, dtype)
            self.load_full_(w, b)

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's columns of a full ``[out, in]`` weight (and the whole ``[out]`` bias)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight has shape {tuple(weight.shape)}, expected [out, in] = "
                f"[{self.out_features}, {self.in_features}]"
            )
        k = self.in_features_per_rank
        self.weight.copy_(weight[:, self.tp_rank * k : (self.tp_rank + 1) * k])
        if self.bias is not None:
            if bias is None:
                raise ValueError("the layer has a bias but bias=None was given")
            self.bias.copy_(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: Group, **kwargs) -> "RowParallelLinear":
        """A row-parallel layer holding this rank's slice of ``linear``'s weights (``linear`` is not changed)."""
        return _from_linear(cls, linear, group, kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1 and not torch.compiler.is_compiling():  # first: with the shapes equal on every rank, the
            self._shapes.check(x.shape, self.group)  # checks below decide alike everywhere (see _agree: not traced)
        want = self.in_features_per_rank if self.input_is_parallel else self.in_features
        if x.dim() < 1 or x.shape[-1] != want:
            what = "in_features/tp" if self.input_is_parallel else "in_features"
            raise ValueError(f"input of shape {tuple(x.shape)} does not end in {what}={want} (RowParallelLinear)")
        if self.sequence_parallel and (x.dim() < 2 or x.shape[0] % self.tp):
            raise ValueError(
                f"sequence_parallel needs input dim 0 divisible by tp={self.tp}, got input shape {tuple(x.shape)}"
            )
        fused = fused_path(x)
        if self.tp == 1:
            return linear_act(x, self.weight, self.bias) if fused else F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.group)
        if torch.compiler.is_compiling():
            return _traceable.row_linear(
                x, self.weight, self.bias, self.group, sequence_parallel=self.sequence_parallel, fused=fused
            )
        return _RowParallelMatmul.apply(
            x, self.weight, self.bias, self.group, self.sequence_parallel, self.comm_chunks, fused
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}, comm_chunks={self.comm_chunks}"
        )
