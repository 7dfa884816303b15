"""What bench_zero.py and bench_zero3.py share: the bench GPT and its batch, one training step of each contender
(llmpar.initialize, deepspeed.initialize, torch DDP + ZeroRedundancyOptimizer, torch FSDP2 ``fully_shard``) built
from the same model and config, and the torchrun launcher.

Each ``*_step`` returns ``step()`` running forward + backward + optimizer step on this rank's batch. DeepSpeed runs
with its CPU accelerator, ``torch_adam`` (its CPU Adam needs a C++ build) and without its JIT-built shared-memory comm
op: gloo carries every byte for every contender.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable

import torch

Step = Callable[[], None]


def zero_config(args: Any, stage: int, overlap_param_gather: bool = False) -> dict:
    """The DeepSpeed config every ZeRO contender runs (``overlap_param_gather``: llmpar's stage 1/2 option)."""
    zero = {
        "stage": stage,
        "reduce_bucket_size": args.bucket,
        "allgather_bucket_size": args.bucket,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
    }
    if overlap_param_gather:
        zero["overlap_param_gather"] = True
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "zero_optimization": zero,
        "bf16": {"enabled": args.bf16},
        "steps_per_print": 10**9,
    }


def add_step_args(
    p: Any, *, n_head: int = 8, micro: int = 2, bucket: int = 5_000_000, warmup: int = 2, repeats: int = 8
) -> None:
    """The flags every GPT training-step benchmark (bench_zero, bench_zero3, bench_scaling) takes: model heads and
    batch (``--n-head --seq --micro``), ZeRO bucket size, ``--bf16``, timing (``--warmup --repeats``)."""
    p.add_argument("--n-head", type=int, default=n_head)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=micro)
    p.add_argument("--bucket", type=int, default=bucket, help="reduce/allgather bucket size in elements")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--repeats", type=int, default=repeats)


def gpt(args: Any):
    from llmpar.models import GPT, GPTConfig

    return GPT(
        GPTConfig(vocab_size=256, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, seq_len=args.seq),
        seed=0,
    )


def batch(args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets): ``args.micro`` random sequences seeded by the rank."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, 256, (args.micro, args.seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _engine_step(engine: Any, inp: torch.Tensor, tgt: torch.Tensor) -> Step:
    def step() -> None:
        loss = engine.module.loss(engine(inp), tgt)
        engine.backward(loss)
        engine.step()

    return step


def _torch_step(model: Any, forward: Callable, opt: Any, inp: torch.Tensor, tgt: torch.Tensor) -> Step:
    def step() -> None:
        loss = model.loss(forward(inp), tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def llmpar_step(model: Any, cfg: dict, inp: torch.Tensor, tgt: torch.Tensor, fresh_buffers: bool = False) -> Step:
    """llmpar.initialize on ``cfg``; ``fresh_buffers``: the reduction's scratch pool not reusing (a fresh buffer for
    every staging bucket, received chunk and landing shard, as before the pool), to measure what the pool saves."""
    import llmpar
    from llmpar.zero.scratch import ScratchPool

    engine, opt, _, _ = llmpar.initialize(model=model, config=cfg)
    if fresh_buffers:
        opt.reducer.pool = ScratchPool(reuse=False)
    return _engine_step(engine, inp, tgt)


def deepspeed_step(model: Any, cfg: dict, inp: torch.Tensor, tgt: torch.Tensor) -> Step:
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    cfg = {**cfg, "optimizer": {**cfg["optimizer"], "params": {**cfg["optimizer"]["params"], "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return _engine_step(engine, inp, tgt)


def ddp_zero_redundancy_step(model: Any, args: Any, inp: torch.Tensor, tgt: torch.Tensor) -> Step:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.bf16:
        model.to(torch.bfloat16)
    ddp = DDP(model, bucket_cap_mb=args.bucket * 4 / 2**20)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    return _torch_step(model, ddp, opt, inp, tgt)


def ddp_step(model: Any, args: Any, inp: torch.Tensor, tgt: torch.Tensor) -> Step:
    """torch DDP (the same bucket size) + ``AdamW(fused=True)``: what a user would pick instead of ZeRO-1/2."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.bf16:
        model.to(torch.bfloat16)
    ddp = DDP(model, bucket_cap_mb=args.bucket * 4 / 2**20)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    return _torch_step(model, ddp, opt, inp, tgt)


def no_comm_step(model: Any, args: Any, inp: torch.Tensor, tgt: torch.Tensor) -> Step:
    """The compute floor: each rank trains its own copy with no collective at all (fwd + bwd + clipping + fused AdamW
    on every param); what any data-parallel step costs before it moves a byte."""
    if args.bf16:
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    return _torch_step(model, model, opt, inp, tgt)


def comm_only_step(model: Any, gathers: int, dtype: torch.dtype = torch.float32, all_reduce: bool = False) -> Step:
    """Only the bytes of a data-parallel step, as one flat collective each over all params (psi) in ``dtype``, moved
    the way llmpar moves them (``llmpar.distributed.collectives``: on gloo a direct point-to-point exchange):
    ``gathers`` all-gathers (ZeRO-3: 2, forward and backward; ZeRO-1/2: 1) and one reduce-scatter, or
    (``all_reduce``: DDP) one all-reduce. No compute: with the no_comm step, the floor of a step where nothing
    overlaps."""
    import torch.distributed as dist

    from llmpar.distributed.collectives import all_gather_flat, reduce_scatter_flat

    world = dist.get_world_size()
    n = -(-sum(p.numel() for p in model.parameters()) // world) * world
    full, shard = torch.empty(n, dtype=dtype), torch.randn(n // world).to(dtype)
    grads, mine = torch.randn(n).to(dtype), torch.empty(n // world, dtype=dtype)
    scratch = torch.empty((world - 1) * (n // world), dtype=dtype)  # received chunks, reused (as ZeRO's pool does)

    def step() -> None:
        if all_reduce:
            dist.all_reduce(grads)
            return
        for _ in range(gathers):
            all_gather_flat(full, shard, dist.group.WORLD)
        reduce_scatter_flat(mine, grads, dist.group.WORLD, scratch=scratch)

    return step


def no_comm_master_step(model: Any, inp: torch.Tensor, tgt: torch.Tensor) -> Step:
    """Like :func:`no_comm_step` for a bf16 model, with what ZeRO's bf16 step does per param: llmpar's FusedAdamW
    on fp32 masters (``fp32_master``), clipping included; ZeRO at dp=N runs this step on 1/N of the params."""
    from llmpar.optim import FusedAdamW

    model.to(torch.bfloat16)
    opt = FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, precision="fp32_master", max_grad_norm=1.0)

    def step() -> None:
        loss = model.loss(model(inp), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def fsdp2_step(model: Any, args: Any, inp: torch.Tensor, tgt: torch.Tensor) -> Step:
    from torch.distributed.fsdp import fully_shard

    if args.bf16:
        model.to(torch.bfloat16)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return _torch_step(model, model, opt, inp, tgt)


def torchrun(script: str, argv: list[str], nproc: int) -> str:
    """Run ``script argv`` on ``nproc`` local ranks (DeepSpeed on its CPU accelerator, one thread per rank unless
    OMP_NUM_THREADS says otherwise); returns its stdout, exits with its output on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script, *argv]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return out.stdout


def time_cases(args: Any, build: Callable[[str, Any], Step], report: Callable[[dict, int, int], None]) -> None:
    """The timing run of bench_zero / bench_zero3 (one rank of a torchrun job): gloo up, every case of ``args.cases``
    built by ``build(case, args)``, timed interleaved (``harness.compare_distributed``); rank 0 calls
    ``report(timings, world, n_params)``; the steps are freed while the process group is still up, then it goes down."""
    import gc

    import torch.distributed as dist

    from harness import compare_distributed

    dist.init_process_group("gloo")
    cases = {c: build(c, args) for c in args.cases}
    timings = compare_distributed(cases, group=dist.group.WORLD, warmup=args.warmup, repeats=args.repeats)
    if dist.get_rank() == 0:
        report(timings, dist.get_world_size(), sum(p.numel() for p in gpt(args).parameters()))
    del cases
    gc.collect()  # free the engines (and their hooks) while the process group is still up
    dist.destroy_process_group()
