"""Every flow tests/test_accelerate.py compares, in one launch (torchrun or accelerate launch), one process per rank:

1. ``llmpar``: accelerate_script.py under llmpar's Accelerator (2 ranks, each its own shard of the data);
2. ``direct``: ``llmpar.initialize`` driven by a plain engine loop on the batches flow 1 read on this rank, with the
   config written out by hand (the values accelerate's "auto" filling must give), the same optimizer and schedule;
3. ``llmpar_same``: flow 1 with every rank reading the batches of one unsharded loader, and saving every 3 optimizer
   steps as accelerate's examples do (also between micro-steps); its llmpar log lines kept;
4. ``deepspeed``: the script under stock accelerate + DeepSpeed, which on CPU ranks sees one process (it reads the
   unsharded loader on every rank, as flow 3 does, and DeepSpeed averages over the 2 ranks), saving as flow 3.

    torchrun --nproc_per_node 2 accelerate_driver.py --stage 2 --config ds.json --tmp DIR
Writes DIR/rank{R}.pt: {flow: record} (tensors as they are).
"""

import argparse
import logging
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accelerate_script  # noqa: E402

SKIP = ("batches",)


class _LogLines(logging.Handler):
    """The llmpar log's lines (warnings and up), kept."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def direct(config_path: str, batches: list, stage: int) -> dict:
    """llmpar.initialize + engine(x) / backward / step on ``batches`` (this rank's), config filled by hand."""
    import json

    import llmpar
    from llmpar.zero.gather import consolidated_state_dict

    with open(config_path) as f:
        cfg = json.load(f)
    world = torch.distributed.get_world_size()
    cfg.update(
        train_micro_batch_size_per_gpu=4,
        gradient_accumulation_steps=2,
        train_batch_size=4 * 2 * world,
        gradient_clipping=1.0,
    )
    cfg["zero_optimization"].update(
        reduce_bucket_size=24 * 24,
        stage3_prefetch_bucket_size=int(0.9 * 24 * 24),
        stage3_param_persistence_threshold=240,
    )
    steps = len(batches) // 2  # optimizer steps (gradient accumulation 2)
    torch.manual_seed(0)
    model = accelerate_script.Net()
    kwargs = {}
    if "optimizer" in cfg:
        cfg["optimizer"]["params"].update(lr=3e-3, weight_decay=0.01)
        cfg["scheduler"]["params"].update(
            warmup_min_lr=0, warmup_max_lr=3e-3, warmup_num_steps=3, total_num_steps=steps
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        kwargs = dict(
            optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        )
    engine, _, _, sched = llmpar.initialize(model=model, config=cfg, **kwargs)
    assert engine.zero_optimization_stage() == stage
    rec = {"loss": [], "grad_norm": [], "lr": []}
    for x, y in batches:
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        rec["loss"].append(loss.item())
        if engine.micro_steps % 2 == 0:  # an optimizer step was just taken
            rec["grad_norm"].append(float(engine.get_global_grad_norm()))
            rec["lr"].append(sched.get_last_lr()[0])
    rec["weights"] = consolidated_state_dict(engine.module, engine.optimizer, rank0_only=False)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--config", default="", help="DeepSpeed config (none: accelerate launch's)")
    ap.add_argument("--tmp", required=True)
    ap.add_argument("--no-deepspeed", action="store_true", help="skip flow 4 (DeepSpeed is not installed)")
    a = ap.parse_args()
    config_path = a.config or os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
    base = ["--config", a.config] if a.config else []
    out: dict = {}
    out["llmpar"] = accelerate_script.main(["--backend", "llmpar", "--ckpt", f"{a.tmp}/ckpt_llmpar", "--cpu", *base])
    reset_accelerate()
    ran = out["llmpar"]["batches"][: len(out["llmpar"]["loss"])]
    out["direct"] = direct(config_path, ran, a.stage)
    warnings = _LogLines()
    logging.getLogger("llmpar").addHandler(warnings)
    out["llmpar_same"] = accelerate_script.main(
        ["--backend", "llmpar", "--ckpt", f"{a.tmp}/ckpt_same", "--same-batches", "--checkpointing-steps", "3", *base]
    )
    logging.getLogger("llmpar").removeHandler(warnings)
    out["llmpar_same"]["log"] = warnings.lines
    reset_accelerate()
    if not a.no_deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # else JIT-compiled with a C++ toolchain
        out["deepspeed"] = accelerate_script.main(
            [
                "--backend",
                "accelerate",
                "--ckpt",
                f"{a.tmp}/ckpt_ds",
                "--same-batches",
                "--train-only",
                "--checkpointing-steps",
                "3",
                *base,
            ]
        )
    for rec in out.values():
        for k in SKIP:
            rec.pop(k, None)
    torch.save(out, f"{a.tmp}/rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
