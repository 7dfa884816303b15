"""The pipeline model of ``tests/checkpoint/test_checkpoint_ds_pipeline.py``, built with DeepSpeed's or llmpar's spec
classes (``layers(deepspeed.pipe)`` / ``layers(llmpar.pipe)``): a weight tied between the first and the last stage
(called as a module on stage 0, through a ``forward_fn`` on stage 1: DeepSpeed writes no layer file for that call), a
persistent buffer, a frozen param, callables and in-place activations, odd widths."""

import torch
import torch.nn as nn
import torch.nn.functional as F

D_IN, HIDDEN, CLASSES = 7, 13, 5


class Block(nn.Module):
    """x + norm(fc(x)) * scale; ``scale`` a persistent buffer; ``frozen``: the norm's bias does not train."""

    def __init__(self, width, frozen=False):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        if frozen:
            self.norm.bias.requires_grad_(False)
            with torch.no_grad():
                self.norm.bias.uniform_(-0.1, 0.1)

    def forward(self, x):
        return x + self.norm(self.fc(x)) * self.scale


def tied_head(embed, x):
    return F.linear(x, embed.weight.t())  # [.., HIDDEN] -> [.., D_IN]


def half(t):
    return t * 0.5


def layers(pipe):
    """The layer list (11 layers) with ``pipe``'s LayerSpec / TiedLayerSpec."""
    return [
        pipe.TiedLayerSpec("embed", nn.Linear, D_IN, HIDDEN, bias=False),
        nn.ReLU(inplace=True),
        pipe.LayerSpec(Block, HIDDEN, frozen=True),
        pipe.LayerSpec(nn.Linear, HIDDEN, HIDDEN),
        nn.ReLU(inplace=True),
        pipe.LayerSpec(nn.Linear, HIDDEN, HIDDEN),
        nn.Tanh(),
        pipe.LayerSpec(Block, HIDDEN),
        pipe.TiedLayerSpec("embed", nn.Linear, D_IN, HIDDEN, bias=False, forward_fn=tied_head),
        half,
        pipe.LayerSpec(nn.Linear, D_IN, CLASSES),
    ]


def batches(step, count, micro, seed=0):
    """``count`` (x, y) micro-batches of ``micro`` rows for optimizer step ``step``: random, learnable labels."""
    out = []
    for m in range(count):
        g = torch.Generator().manual_seed(1000 * seed + 100 * step + m)
        x = torch.randn(micro, D_IN, generator=g)
        out.append((x, (x[:, :CLASSES] * 3).argmax(dim=1)))
    return out


class Flat(nn.Module):
    """The same layers as one plain module under the PipelineModule's names (``2.fc.weight``,
    ``tied_modules.embed.weight``): what a DeepSpeed pipeline checkpoint loads into without a pipeline. ``pipe``:
    ``llmpar.pipe`` (its specs build the layers)."""

    def __init__(self, pipe):
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self.calls = []
        for i, spec in enumerate(layers(pipe)):
            if isinstance(spec, pipe.TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                self.calls.append(
                    module if spec.forward_fn is None else (lambda x, m=module, fn=spec.forward_fn: fn(m, x))
                )
                continue
            layer = spec.build() if isinstance(spec, pipe.LayerSpec) else spec
            if isinstance(layer, nn.Module):
                self.add_module(str(i), layer)
            self.calls.append(layer)

    def forward(self, x):
        for call in self.calls:
            x = call(x)
        return x
