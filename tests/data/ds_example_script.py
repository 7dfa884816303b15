"""A DeepSpeed training script in the shape of DeepSpeedExamples' training scripts (bf16_master_weight/train.py,
cifar10_deepspeed.py, DeepSpeed-Chat): the accelerator API (``from deepspeed import get_accelerator``),
``deepspeed.runtime.utils`` (set_random_seed, see_memory_usage), a schedule from ``deepspeed.runtime.lr_schedules`` on
a client optimizer, ``deepspeed.initialize``, a train loop, the optimizer's state dict, ``save_checkpoint``,
``destroy``. It is run on
llmpar after the mechanical rename of tests/data/pipe_launch.py (``import deepspeed`` -> ``import llmpar as
deepspeed``, ``from deepspeed.X import`` -> ``from llmpar.X import``), with nothing else changed:

    torchrun --nproc_per_node 2 tests/data/pipe_launch.py llmpar tests/data/ds_example_script.py \
        --deepspeed --deepspeed_config CONFIG.json --steps 6 --out OUT.json --save_dir DIR

Rank 0 writes OUT.json: per optimizer step its own loss (the sum of ``engine.backward``'s returned loss / gas) and
the lr after the step, what the accelerator answered, and the checks the script made.
"""

import argparse
import json
import os

import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed import get_accelerator  # DeepSpeed-Chat's form (deepspeed.accelerator's, exported at the top)
from deepspeed.runtime.lr_schedules import WarmupDecayLR
from deepspeed.runtime.utils import see_memory_usage
from deepspeed.utils import log_dist


def main():
    parser = argparse.ArgumentParser(description="example")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save_dir", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    accel = get_accelerator()
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accel.set_device(local_rank)
    device = torch.device(accel.device_name(), local_rank)
    accel.manual_seed_all(1234)
    accel.reset_peak_memory_stats()
    deepspeed.runtime.utils.set_random_seed(4321)  # the pipeline example's seeding: random, numpy, torch
    seeded = torch.rand(2).tolist()

    model = nn.Sequential(nn.Linear(19, 32), nn.GELU(), nn.Linear(32, 7))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
    scheduler = WarmupDecayLR(
        optimizer, total_num_steps=args.steps, warmup_max_lr=2e-2, warmup_num_steps=2, warmup_type="linear"
    )
    engine, optimizer, _, scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler
    )
    see_memory_usage("after initialize", force=True)
    criterion = nn.CrossEntropyLoss()
    teacher = torch.randn(19, 7, generator=torch.Generator().manual_seed(7))  # the labels to learn, every rank's
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses, lrs = [], []
    for _ in range(args.steps):
        total = 0.0
        for _ in range(gas):
            x = torch.randn(micro, 19, generator=gen).to(device)
            y = (x @ teacher).argmax(1).to(device)
            loss = criterion(engine(x), y)
            total += float(engine.backward(loss))
            engine.step()
        accel.synchronize()
        losses.append(total)
        lrs.append(engine.get_lr()[0])

    state = engine.optimizer.state_dict()  # this rank's shard
    engine.optimizer.load_state_dict(state)
    engine.save_checkpoint(args.save_dir, client_state={"steps": args.steps})
    engine.monitor.write_events([("Train/Samples/script_event", 1.5, engine.global_samples)])
    log_dist(f"peak memory {accel.max_memory_allocated()} bytes", ranks=[0])
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "loss": losses,
                    "lr": lrs,
                    "device": str(device),
                    "device_name": accel.device_name(),
                    "backend": accel.communication_backend_name(),
                    "samples": engine.global_samples,
                    "train_batch_size": engine.train_batch_size(),
                    "peak": accel.max_memory_allocated(),
                    "state_keys": sorted(state),
                    "seeded": seeded,
                },
                f,
            )
    engine.destroy()
    engine.destroy()


if __name__ == "__main__":
    main()
