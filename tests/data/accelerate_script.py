"""A training script in the shape of accelerate's DeepSpeed examples (examples/by_feature/deepspeed_with_config_support
.py): DummyOptim / DummyScheduler when the DeepSpeed config has those blocks, a torch optimizer and schedule when it
has not; accumulate, backward, clip_grad_norm_, save_state / load_state, gather_for_metrics, get_state_dict.
Under llmpar the one change is the import line (--backend llmpar).

    torchrun --nproc_per_node 2 accelerate_script.py --backend llmpar --config ds.json --ckpt /tmp/ckpt
    accelerate launch --config_file acc.yaml accelerate_script.py --backend llmpar --ckpt /tmp/ckpt   # plugin: env

``main`` returns the run's record (per micro-step losses of this rank, the grad norms and lrs of the optimizer steps,
the batches read, the last epoch run again after load_state, the gathered eval, the weights).
"""

import argparse
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(torch.nn.Module):
    def __init__(self, d_in: int = 13, hidden: int = 24, classes: int = 5):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden)  # "auto" bucket sizes come from it, as from a HF model
        self.up, self.down = torch.nn.Linear(d_in, hidden), torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def data(n: int, seed: int, batch: int = 1, repeat: int = 1):
    """n random samples; ``repeat``: each batch-sized chunk ``repeat`` times in a row (the ranks of a sharded loader
    then read the batches one unsharded loader reads)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 13, generator=g), torch.randint(0, 5, (n,), generator=g)
    if repeat > 1:
        x = x.view(-1, batch, 13).repeat_interleave(repeat, 0).reshape(-1, 13)
        y = y.view(-1, batch).repeat_interleave(repeat, 0).reshape(-1)
    return TensorDataset(x, y)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["llmpar", "accelerate"], required=True)
    ap.add_argument("--config", default="", help="DeepSpeed config (none: the plugin accelerate launch describes)")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--same-batches", action="store_true", help="every rank reads the unsharded loader's batches")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument(
        "--train-only",
        action="store_true",
        help="skip the gathered eval and save_model (stock "
        "accelerate on CPU ranks counts one process: its all-gather gets an output list of 1 for 2 "
        "ranks, and every rank is the main process)",
    )
    ap.add_argument(
        "--checkpointing-steps",
        type=int,
        default=0,
        help="save_state every N optimizer steps, as "
        "accelerate's examples do (their test also holds on the micro-steps after step N: saves there "
        "fall in the middle of a gradient accumulation)",
    )
    a = ap.parse_args(argv)
    if a.backend == "llmpar":
        from llmpar.integrations.accelerate import Accelerator, DeepSpeedPlugin, DummyOptim, DummyScheduler
    else:
        from accelerate import Accelerator, DeepSpeedPlugin
        from accelerate.utils import DummyOptim, DummyScheduler

    plugin = DeepSpeedPlugin(hf_ds_config=a.config) if a.config else None
    accelerator = Accelerator(gradient_accumulation_steps=2, deepspeed_plugin=plugin, cpu=a.cpu)
    procs, bs = accelerator.num_processes, 4
    torch.manual_seed(0)
    model = Net()
    train = DataLoader(data(32, 1, bs, procs if a.same_batches else 1), batch_size=bs, shuffle=False)
    evals = DataLoader(data(11, 2), batch_size=bs)
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    total = len(train) * a.epochs // accelerator.gradient_accumulation_steps
    opt_cls = DummyOptim if "optimizer" in ds_config else torch.optim.AdamW
    optimizer = opt_cls(model.parameters(), lr=3e-3, weight_decay=0.01)
    if "scheduler" in ds_config:
        scheduler = DummyScheduler(optimizer, total_num_steps=total, warmup_num_steps=3)
    else:  # accelerate steps it num_processes times per optimizer step: its unit is one process's step
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s / procs + 1) / 3))
    model, optimizer, train, evals, scheduler = accelerator.prepare(model, optimizer, train, evals, scheduler)
    rec = {"grad_norm": [], "lr": [], "batches": [], "config": dict(accelerator.deepspeed_config), "saved": []}
    completed_steps = 0

    def epoch():
        nonlocal completed_steps
        model.train()
        losses = []
        for x, y in train:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    rec["grad_norm"].append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    rec["lr"].append(scheduler.get_last_lr()[0])  # the next step's
            losses.append(loss.item())
            rec["batches"].append((x, y))
            if accelerator.sync_gradients:
                completed_steps += 1
            if a.checkpointing_steps and completed_steps % a.checkpointing_steps == 0:  # the examples' test
                accelerator.save_state(f"{a.ckpt}/step_{completed_steps}")
                rec["saved"].append((completed_steps, accelerator.sync_gradients))
        return losses

    rec["loss"] = [v for _ in range(a.epochs - 1) for v in epoch()]
    accelerator.save_state(a.ckpt)
    rec["loss"] += epoch()
    accelerator.load_state(a.ckpt)
    rec["resumed"] = epoch()
    model.eval()
    outs, ys = [], []
    for x, y in evals if not a.train_only else []:
        with torch.no_grad():
            out, y = accelerator.gather_for_metrics((model(x), y))
        outs.append(out)
        ys.append(y)
    if outs:
        rec["eval_loss"], rec["eval_n"] = F.cross_entropy(torch.cat(outs), torch.cat(ys)).item(), len(torch.cat(ys))
        rec["mean_loss"] = accelerator.reduce(torch.tensor(rec["loss"][-1]), "mean").item()
    weights = accelerator.get_state_dict(model)  # ZeRO-3: on rank 0 (DeepSpeed: None elsewhere)
    rec["weights"] = {k: v.clone() for k, v in (weights or {}).items()}
    if not a.train_only:
        accelerator.save_model(model, f"{a.ckpt}/model")  # model.safetensors, from the main process
    accelerator.wait_for_everyone()
    accelerator.print(f"last losses {rec['loss'][-4:]}")
    rec["procs"], rec["rank"], rec["main"] = procs, accelerator.process_index, accelerator.is_main_process
    rec["distributed_type"], rec["engine"] = str(accelerator.distributed_type), type(model).__module__
    return rec


if __name__ == "__main__":
    main()
