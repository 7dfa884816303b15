"""Reading a ZeRO-3 param outside its gather never touches freed memory (it used to crash the process: SIGSEGV).

Between gathers a sharded param is an empty tensor with its real shape kept as ``p.ds_shape`` / ``p.ds_numel``
(DeepSpeed's behaviour, ``llmpar/zero/views.py``): every common read has a defined result, nothing is corrupted by
it, the gather gives the param back whole, and training goes on exactly as a run without the reads. On one rank and
on two (gloo), one run per world size feeding every assertion."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zero_helpers import GPT_CFG, gpt_batch, single_gpt_losses

import llmpar
import llmpar.zero
from llmpar.models import GPT, GPTConfig

from multirank import run_ranks

STEPS = 2  # before the reads, and again after them
MICRO = 2


def _train(engine, model, steps, start, dp_rank, dp):
    losses = []
    for s in range(start, start + steps):
        x, y = gpt_batch(s, MICRO * dp)
        x, y = x[dp_rank * MICRO : (dp_rank + 1) * MICRO], y[dp_rank * MICRO : (dp_rank + 1) * MICRO]
        loss = model.loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / dp)
    return losses


def _gathered(model):
    with llmpar.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def reads_body():
    model = GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64)
    model.spare = nn.Linear(16, 5, dtype=torch.float64)  # never called: a unit with no grads (zeros, flushed)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 700, "stage3_param_persistence_threshold": 16},
    }
    engine, opt, _, _ = llmpar.initialize(model=model, config=cfg)
    rank, dp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = _train(engine, model, STEPS, 0, rank, dp)
    whole = _gathered(model)
    params = dict(model.named_parameters())
    released = sorted(n for n, p in params.items() if p.untyped_storage().nbytes() == 0)
    kept = sorted(set(params) - set(released))  # the persistent ones (norms, biases of <= 16 elements)
    out = {"released": released, "kept": kept}
    p = model.blocks[0].mlp.fc.weight  # a released one: each common read, one at a time
    reads = {
        "sum": lambda: p.sum().item() == 0.0,
        "clone": lambda: p.clone().shape == (0,),
        "to": lambda: p.to("cpu").shape == (0,) and p.to(torch.float32).dtype == torch.float32,
        "cpu": lambda: p.cpu().shape == (0,),
        "float": lambda: p.float().shape == (0,),
        "detach_numpy": lambda: p.detach().numpy().shape == (0,),
        "print": lambda: "[]" in repr(p) and "[]" in str(p),
        "slice": lambda: p[:3].shape == (0,),
        "mul": lambda: (p * 2).shape == (0,),
    }
    out["reads"] = {k: bool(f()) for k, f in reads.items()}
    errors = {}
    for name, f in {
        "index": lambda: p[0],
        "numpy": lambda: p.numpy(),
        "linear": lambda: F.linear(torch.randn(3, 16, dtype=torch.float64), p),
        "view": lambda: p.view(64, 16),
    }.items():
        try:
            f()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - which exception, checked by the test
            errors[name] = type(e).__name__
    out["errors"] = errors
    out["shape_kept"] = all(
        tuple(p.ds_shape) == tuple(whole[n].shape) and p.ds_numel == whole[n].numel() for n, p in params.items()
    )
    out["empty"] = all(params[n].numel() == 0 and params[n].shape == (0,) for n in released)
    sd = model.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf)
    out["state_dict"] = all(back[n].numel() == 0 for n in released) and all(
        torch.equal(back[n], whole[n]) for n in kept
    )
    model.to("cpu")  # what transformers' evaluation loop does (accelerate's prepare_model): moves nothing
    model.cpu()
    model.to(torch.float64)
    model.eval()
    model.train()
    out["deepcopy_empty"] = copy.deepcopy(model.blocks[0].mlp.fc).weight.numel() == 0
    after = _gathered(model)  # nothing the reads did reached the shards
    out["intact"] = sorted(after) == sorted(whole) and all(torch.equal(after[n], whole[n]) for n in whole)
    out["full_state"] = {
        n: v
        for n, v in llmpar.zero.consolidated_state_dict(model, opt, rank0_only=False).items()
        if n in whole and not torch.equal(v, whole[n])
    }
    out["losses"] = losses + _train(engine, model, STEPS, STEPS, rank, dp)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_reads_outside_a_gather_are_defined(world):
    ref = single_gpt_losses(GPT(GPTConfig(**GPT_CFG), seed=1, dtype=torch.float64), 2 * STEPS, MICRO * world)
    for out in run_ranks(reads_body, world, timeout=120):
        assert "blocks.0.mlp.fc.weight" in out["released"] and "spare.weight" in out["released"]
        assert "blocks.0.ln1.weight" in out["kept"]
        assert out["shape_kept"] and out["empty"]
        assert out["reads"] == {k: True for k in out["reads"]}
        assert out["errors"] == {
            "index": "IndexError",
            "numpy": "RuntimeError",
            "linear": "RuntimeError",
            "view": "RuntimeError",
        }
        assert out["state_dict"] and out["deepcopy_empty"]
        assert out["intact"] and out["full_state"] == {}
        # the reads changed nothing: the run goes on as one process trains the whole model
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref), rtol=1e-7, atol=1e-9)
