"""A DeepSpeed pipeline training script, as users write them: a PipelineModule of LayerSpecs / TiedLayerSpecs, plain
modules and a callable, in-place ReLUs on both sides of the stage boundary, the config without a "pipeline" block,
``training_data=`` and ``engine.train_batch()`` with no argument, then ``engine.eval_batch(iter)``.

Run it with DeepSpeed, or with llmpar by changing one line (``import deepspeed`` -> ``import llmpar as deepspeed``):

    torchrun --nproc_per_node 2 tests/data/pipe_script.py OUT.json [STEPS] [PARTITION]

Rank 0 writes {"train": [loss per step], "eval": loss, "parts": [...]} to OUT.json.
"""

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed

D_IN, HIDDEN, CLASSES, MICRO, GAS, SAMPLES = 12, 32, 5, 4, 4, 96


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + self.norm(self.fc(x))


def tied_head(embed, x):
    return F.linear(x, embed.weight.t())  # the input projection, transposed: [.., HIDDEN] -> [.., D_IN]


def main():
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    partition = sys.argv[3] if len(sys.argv) > 3 else "parameters"
    deepspeed.init_distributed()
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, D_IN, generator=g)
    y = (x[:, :CLASSES] * 3).argmax(dim=1)  # learnable labels
    data = torch.utils.data.TensorDataset(x, y)

    layers = [
        deepspeed.pipe.TiedLayerSpec("embed", nn.Linear, D_IN, HIDDEN, bias=False),
        nn.ReLU(inplace=True),
        deepspeed.pipe.LayerSpec(Block, HIDDEN),
        deepspeed.pipe.LayerSpec(nn.Linear, HIDDEN, HIDDEN),
        nn.ReLU(inplace=True),
        deepspeed.pipe.LayerSpec(nn.Linear, HIDDEN, HIDDEN),
        nn.ReLU(inplace=True),
        deepspeed.pipe.LayerSpec(Block, HIDDEN),
        deepspeed.pipe.TiedLayerSpec("embed", nn.Linear, D_IN, HIDDEN, bias=False, forward_fn=tied_head),
        lambda t: t * 0.5,
        deepspeed.pipe.LayerSpec(nn.Linear, D_IN, CLASSES),
    ]
    net = deepspeed.pipe.PipelineModule(
        layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2, partition_method=partition
    )
    # ZeRO-1: DeepSpeed's pipeline clips by the whole model's gradient norm there (without ZeRO its fp32 path counts
    # stage 0's gradients alone); the norm is above 1 in the first steps, so the clipping acts
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 1000,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], config=config, training_data=data
    )
    losses = [float(engine.train_batch()) for _ in range(steps)]
    eval_data = iter([(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, MICRO * GAS, MICRO)])
    eval_loss = float(engine.eval_batch(eval_data))
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"train": losses, "eval": eval_loss, "parts": [int(b) for b in net.partitions()]}, f)


if __name__ == "__main__":
    main()
