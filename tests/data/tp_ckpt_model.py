"""The tensor-parallel model of ``tests/checkpoint/test_checkpoint_ds_mp.py``, written by hand in Megatron's convention:
a replicated input layer, a column-parallel ``up`` (weight and bias split on dim 0), a row-parallel ``down`` (weight
split on dim 1, bias replicated, added after the all-reduce), a replicated head; and :class:`MPU`, the model-parallel
unit DeepSpeed takes (``deepspeed.initialize(..., mpu=MPU(tp))``) so that it saves one ``mp_rank_TT`` file set per
tensor-parallel rank. :class:`Full` is the same function unsplit, under the same names."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

D_IN, HIDDEN, FFN, CLASSES = 7, 11, 10, 5


class MPU:
    """Tensor-parallel groups of ``tp`` consecutive ranks, data-parallel groups across them."""

    def __init__(self, tp):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        self.tp_groups = [dist.new_group(list(range(i * tp, (i + 1) * tp))) for i in range(self.dp)]
        self.dp_ranks = [list(range(t, world, tp)) for t in range(tp)]
        self.dp_groups = [dist.new_group(r) for r in self.dp_ranks]
        self.tp_rank, self.dp_rank = rank % tp, rank // tp

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_groups[self.dp_rank]

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_groups[self.tp_rank]

    def get_data_parallel_group_ranks(self):
        return self.dp_ranks[self.tp_rank]


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class TP(nn.Module):
    """The model split over ``mpu``'s tensor-parallel group (its rank's shards)."""

    def __init__(self, mpu):
        super().__init__()
        self.mpu, tp = mpu, mpu.tp
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN // tp)
        self.down = nn.Linear(FFN // tp, HIDDEN, bias=False)
        self.down_bias = nn.Parameter(torch.zeros(HIDDEN))
        self.out = nn.Linear(HIDDEN, CLASSES)
        for p in (self.up.weight, self.up.bias, self.down.weight):  # Megatron's mark: DeepSpeed's gradient norm
            p.tensor_model_parallel = True  # sums these over the tp ranks, the others once

    def load_full(self, full):
        """This rank's shards of ``full`` (a :class:`Full`)."""
        t, tp = self.mpu.tp_rank, self.mpu.tp
        c = FFN // tp
        with torch.no_grad():
            for m in ("inp", "out"):
                getattr(self, m).load_state_dict(getattr(full, m).state_dict())
            self.up.weight.copy_(full.up.weight[t * c : (t + 1) * c])
            self.up.bias.copy_(full.up.bias[t * c : (t + 1) * c])
            self.down.weight.copy_(full.down.weight[:, t * c : (t + 1) * c])
            self.down_bias.copy_(full.down_bias)

    def forward(self, x):
        group = self.mpu.get_model_parallel_group()
        h = torch.tanh(self.inp(x))
        y = _Reduce.apply(self.down(F.gelu(self.up(_Copy.apply(h, group)))), group)
        return self.out(h + y + self.down_bias)


class Full(nn.Module):
    """The same function unsplit, the same param names and full shapes."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)
        self.down_bias = nn.Parameter(torch.randn(HIDDEN) * 0.1)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(h + self.down(F.gelu(self.up(h))) + self.down_bias)


def batch(step, rows=6, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(rows, D_IN, generator=g)
    return x, (x[:, :CLASSES] * 3).argmax(dim=1)


def forget_mpu():
    """DeepSpeed keeps the mpu of its last ``initialize`` in module globals (``deepspeed.utils.groups``): a later
    engine built without one in the same process (the tests' rank pool) would still see tp=2 and fail. Forget it."""
    from deepspeed.utils import groups

    groups.mpu = groups._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = groups._MPU_TENSOR_MODEL_PARALLEL_RANK = None
