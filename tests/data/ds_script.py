"""A DeepSpeed training script, as users write them (DeepSpeed's tutorials' shape): ``--local_rank`` and
``deepspeed.add_config_arguments``, ``--deepspeed_config``, ``deepspeed.init_distributed``, a client torch AdamW with
param groups and a torch LR scheduler, ``training_data=`` and ``engine.training_dataloader``, gradient accumulation,
``deepspeed.checkpointing.checkpoint`` inside the model, ``deepspeed.comm``, ``log_dist``, the engine's accessors, and
a checkpoint saved, trained past and loaded back.

Run it with DeepSpeed, or with llmpar by changing one line (``import deepspeed`` -> ``import llmpar as deepspeed``):

    torchrun --nproc_per_node 2 tests/data/pipe_launch.py deepspeed|llmpar tests/data/ds_script.py \
        --deepspeed --deepspeed_config CONFIG.json --out OUT.json --ckpt DIR

Rank 0 writes what it saw to OUT.json (losses, lrs, grad norms, step flags, each rank's first batch, ...).
"""

import argparse
import gc
import json

import torch
import torch.nn as nn

import deepspeed

D_IN, HIDDEN, D_OUT, SAMPLES, STEPS, SAVE_AT = 6, 16, 3, 64, 6, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.mid = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN))
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + deepspeed.checkpointing.checkpoint(self.mid, h)  # recomputed in backward
        return self.out(self.norm(h))


class Data(torch.utils.data.Dataset):
    """Sample i: (x_i, y_i, i): a fixed random regression problem that remembers its index."""

    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, D_IN, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(D_IN, D_OUT, generator=g))

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def batch(step, micro, rank, size):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(size, D_IN, generator=g)
    return x, torch.tanh(x[:, :D_OUT] * 2)


def train(engine, steps, rank, micro_size, gas, seen):
    for step in steps:
        total = 0.0
        for micro in range(gas):
            x, y = batch(step, micro, rank, micro_size)
            seen["boundary"].append(engine.is_gradient_accumulation_boundary())
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            seen["applied"].append(engine.was_step_applied())
            total += loss.item() / gas
        t = torch.tensor([total])
        deepspeed.comm.all_reduce(t)
        seen["loss"].append(t.item() / deepspeed.comm.get_world_size())
        seen["lr"].append([float(lr) for lr in engine.get_lr()])
        seen["grad_norm"].append(float(engine.get_global_grad_norm()))
        seen["global_steps"].append(engine.global_steps)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    torch.manual_seed(0)
    model = Net()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-2, betas=(0.9, 0.95)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    engine, _, loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler, training_data=Data()
    )
    deepspeed.utils.log_dist(f"engine ready on {engine.world_size} ranks", ranks=[0])
    first = next(iter(loader))
    firsts = [None] * engine.world_size
    torch.distributed.all_gather_object(firsts, first[2].tolist())
    seen = {"boundary": [], "applied": [], "loss": [], "lr": [], "grad_norm": [], "global_steps": []}
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    train(engine, range(SAVE_AT), rank, micro, gas, seen)
    engine.save_checkpoint(args.ckpt, client_state={"step": SAVE_AT})
    train(engine, range(SAVE_AT, STEPS), rank, micro, gas, seen)
    path, client = engine.load_checkpoint(args.ckpt)
    resumed = {"boundary": [], "applied": [], "loss": [], "lr": [], "grad_norm": [], "global_steps": []}
    train(engine, range(client["step"], STEPS), rank, micro, gas, resumed)
    if rank == 0:
        out = {
            **seen,
            "resumed_loss": resumed["loss"],
            "resumed_lr": resumed["lr"],
            "first_batches": firsts,
            "loader_len": len(loader),
            "local_rank": args.local_rank,
            "world_size": engine.world_size,
            "dp_world_size": engine.dp_world_size,
            "global_rank": engine.global_rank,
            "device": str(engine.device),
            "bf16": engine.bfloat16_enabled(),
            "fp16": engine.fp16_enabled(),
            "clip": engine.gradient_clipping(),
            "steps_per_print": engine.steps_per_print(),
            "batch": [
                engine.train_batch_size(),
                engine.train_micro_batch_size_per_gpu(),
                engine.gradient_accumulation_steps(),
            ],
            "stage": engine.zero_optimization_stage(),
            "partition_gradients": engine.zero_optimization_partition_gradients(),
            "data_types": [str(t) for t in engine.get_data_types()],
            "monitor": engine.monitor.enabled,
            "scheduler_is_client": lr_scheduler is scheduler,
            "last_lr": scheduler.get_last_lr(),
        }
        with open(args.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
    gc.collect()  # the training objects gone, then the group: torch 2.13 + gloo can abort at exit otherwise
    deepspeed.comm.destroy_process_group()
