"""vocab_parallel_cross_entropy on one rank (a gloo group of one: no communication, so the rows show the op's own
cost: the fp32 softmax it keeps for the backward, the checks) vs ``F.cross_entropy``, the tests' reference
(tests/test_tp_faults.py), forward and forward + backward. Logits [tokens, vocab]: fp32 on CPU, bf16 on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from suite_util import device_cases, run

from llmpar.tensor_parallel import vocab_parallel_cross_entropy

SIZES = {"cpu": [(512, 4096), (1024, 8192)], "cuda": [(8192, 50304), (8192, 128256)]}  # (tokens, vocab)
DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}
IMPLS = ("torch", "llmpar")  # no kernel of its own: torch ops on every device


def _ident(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def _inputs(device, size, grad):
    g = torch.Generator().manual_seed(0)
    tokens, vocab = size
    logits = (torch.randn(tokens, vocab, generator=g) * 2).to(DTYPE[device.type]).to(device)
    target = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    return logits.requires_grad_(grad), target


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("device,size", device_cases(SIZES, _ident))
def test_cross_entropy(benchmark, world1_group, device, size, backward, impl):
    logits, target = _inputs(device, size, backward)

    def loss():
        if impl == "torch":
            return F.cross_entropy(logits, target)
        return vocab_parallel_cross_entropy(logits, target, world1_group)

    def fn():
        if not backward:
            with torch.no_grad():
                return loss()
        logits.grad = None
        loss().backward()

    what = "fwd+bwd" if backward else "fwd"
    run(benchmark, fn, device=device, group=f"cross_entropy {what} {_ident(size)}", impl=impl, dtype=str(logits.dtype))
