"""DeepSpeed's MoE checkpoints for ``test_checkpoint_ds_moe.py``: a small model with two legacy MoE layers trained
by DeepSpeed 0.19 on 2 CPU ranks (gloo), saved, and continued; the record holds the checkpoint's files and the
continuation's losses (``tests/golden/ds_moe/<case>.json``, ``make golden``).

The model is built from either MoE class (``deepspeed.moe.layer.MoE`` or ``llmpar.moe.layer.MoE``: the same
arguments and state-dict names); each global expert gets weights of its own (DeepSpeed deep-copies the expert).
"""

from __future__ import annotations

import base64
import os
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

H, INNER, E, IN, OUT, TOKENS = 8, 12, 4, 6, 3, 10
K, N = 2, 2  # steps before the save, steps both continue
TAG = f"global_step{K}"


def config(stage: int) -> dict:
    """The DeepSpeed config (llmpar's engine takes it without its "optimizer": the script's AdamW over the MoE
    groups is the client optimizer there)."""
    return {
        "train_micro_batch_size_per_gpu": TOKENS,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 2, "total_num_steps": 20, "warmup_max_lr": 2e-2, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(H, INNER), nn.GELU(), nn.Linear(INNER, H))


class Net(nn.Module):
    """input projection, a top-2 MoE (no dropping), tanh, a top-1 MoE (no dropping), head; loss: squared error
    plus the layers' l_aux."""

    def __init__(self, moe_cls: Any, ep: int, seed: int, num_experts: int = E) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(IN, H)
        self.moe0 = moe_cls(
            H, expert(), num_experts=num_experts, ep_size=ep, k=2, drop_tokens=False, top2_2nd_expert_sampling=False
        )
        self.moe1 = moe_cls(H, expert(), num_experts=num_experts, ep_size=ep, k=1, drop_tokens=False, use_rts=False)
        self.out = nn.Linear(H, OUT)

    def spread(self, ep_rank: int, seed: int) -> None:
        """Local expert i of ep rank r: the weights of global expert ``r * E_local + i`` (seeded by it)."""
        for li, layer in enumerate((self.moe0, self.moe1)):
            local = layer.deepspeed_moe.experts.deepspeed_experts
            for i, ex in enumerate(local):
                gen = torch.Generator().manual_seed(seed + 100 * li + ep_rank * len(local) + i)
                with torch.no_grad():
                    for p in ex.parameters():
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, a0, _ = self.moe0(self.inp(x))
        h, a1, _ = self.moe1(torch.tanh(h))
        return (self.out(h) - y).pow(2).mean() + 0.01 * (a0 + a1)


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, IN, generator=g), torch.randn(TOKENS, OUT, generator=g)


def train(engine: Any, steps: range, rank: int) -> list[float]:
    out = []
    for step in steps:
        loss = engine(*data(step, rank))
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def pack(folder: Path) -> dict[str, str]:
    """{file name: base64 of its zlib-compressed bytes} of every file of ``folder``."""
    return {f.name: base64.b64encode(zlib.compress(f.read_bytes(), 9)).decode() for f in sorted(folder.iterdir())}


def unpack(files: dict[str, str], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_bytes(zlib.decompress(base64.b64decode(text)))


def deepspeed_body(spec: dict, root: str, ext: str) -> dict | None:
    """On each of 2 ranks: DeepSpeed trains K steps at ZeRO ``spec["stage"]`` with the experts over
    ``spec["ep"]`` ranks, saves, trains N more. Rank 0 returns the record (files and every rank's losses)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["TORCH_EXTENSIONS_DIR"] = ext
    import deepspeed
    import deepspeed.ops
    import deepspeed.utils.groups as ds_groups
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's CPU comm op
    deepspeed.init_distributed(dist_backend="gloo")
    for table in (ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP):
        table.clear()  # a group of an earlier test in this pooled process is gone
    rank, ep = dist.get_rank(), spec["ep"]
    model = Net(MoE, ep, seed=5)
    model.spread(rank % ep, seed=40)
    params = split({"params": list(model.parameters()), "name": "params"})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config(spec["stage"]))
    before = train(engine, range(K), rank)
    engine.save_checkpoint(f"{root}/ds", client_state={"data_pos": 7})
    after = train(engine, range(K, K + N), rank)
    losses = [None, None]
    dist.all_gather_object(losses, (before, after))
    dist.barrier()
    if rank:
        return None
    return {"files": pack(Path(root) / "ds" / TAG), "before": [b for b, _ in losses], "after": [a for _, a in losses]}
