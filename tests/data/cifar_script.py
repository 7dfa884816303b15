"""A DeepSpeed training script in the shape of DeepSpeed's cifar10 example: a small CNN on CIFAR-sized random images,
``--local_rank`` and ``deepspeed.add_config_arguments``, ``deepspeed.initialize(args=, model=, model_parameters=,
training_data=)``, the engine's ``training_dataloader``, ``engine(inputs)`` / ``engine.backward`` / ``engine.step``.

    torchrun --nproc_per_node 2 tests/data/pipe_launch.py deepspeed|llmpar tests/data/cifar_script.py \
        --deepspeed --deepspeed_config CONFIG.json --steps 30 --out OUT.json

Rank 0 writes the dp-mean loss of every optimizer step to OUT.json.
"""

import argparse
import json
import time

T0 = time.perf_counter()  # the script's start (after the launcher imported the library)

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class RandomImages(torch.utils.data.Dataset):
    """CIFAR-10-shaped samples (3 x 32 x 32, 10 classes), fixed by the seed: each image is its class's random
    prototype plus noise, so there is something to learn."""

    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        prototypes = torch.randn(10, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.x = prototypes[self.y] + torch.randn(n, 3, 32, 32, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    trainset = RandomImages(4096)
    engine, _, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )
    t_init = time.perf_counter() - T0
    criterion = nn.CrossEntropyLoss()
    gas = engine.gradient_accumulation_steps()
    losses, running = [], 0.0
    data = iter(trainloader)
    t_first = None
    while len(losses) < args.steps:
        inputs, labels = next(data)
        loss = criterion(engine(inputs.to(engine.device)), labels.to(engine.device))
        engine.backward(loss)
        engine.step()
        running += loss.item() / gas
        if engine.global_steps > len(losses):  # an optimizer step ended: its mean loss over the dp ranks
            t = torch.tensor([running], dtype=torch.float64)
            torch.distributed.all_reduce(t)
            losses.append(t.item() / torch.distributed.get_world_size())
            running = 0.0
            if t_first is None:
                t_first = time.perf_counter()  # steps after the first one are timed
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            step_s = (time.perf_counter() - t_first) / max(1, args.steps - 1)
            json.dump(
                {"loss": losses, "stage": engine.zero_optimization_stage(), "init_s": t_init, "step_s": step_s}, f
            )


if __name__ == "__main__":
    main()
