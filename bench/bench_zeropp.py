"""Compressed ZeRO-3 communication (qwZ, hpZ, qgZ with / without error feedback) on the demo GPT: convergence, bytes
that cross between nodes per step, step time. dp=4 as two "nodes" of two ranks (two torchrun launchers with
``--nnodes 2`` on this machine: the ranks see torchrun's multi-node layout, ``LOCAL_WORLD_SIZE=2``).

    python bench/bench_zeropp.py --steps 300                 # writes bench/results/zeropp.md + zeropp.png

Every case trains the same GPT (``llmpar train``'s demo model and schedule: d_model 128, 2 layers, seq 128,
Shakespeare bytes, AdamW 3e-3 with warm-up + cosine, clipping 1.0) from the same seed on the same batches, through
``llmpar.initialize`` with a DeepSpeed config. All cases live in the same processes and step in turn (interleaved),
so their step times share the machine's noise. ZeRO-3 is set up as for a model bigger than the prefetch window
(``stage3_prefetch_bucket_size`` one block, small persistence threshold), so each block is gathered in forward and
again in backward: the 3 psi per step of the ZeRO papers. Cross-node bytes come from ``CommCounter`` (received from
the other node, direct form), in units of psi = one uncompressed fp32 all-gather of all params across the nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = {
    "zero3": {},
    "qwZ": {"zero_quantized_weights": True},
    "hpZ": {"zero_hpz_partition_size": 2},
    "qwZ+hpZ": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2},
    "qgZ": {"zero_quantized_gradients": True},
    "qgZ+EF": {"zero_quantized_gradients": True, "zero_quantized_gradients_error_feedback": True},
    "qwZ+qgZ+EF": {
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "zero_quantized_gradients_error_feedback": True,
    },
    "qwZ+hpZ+qgZ+EF": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 2,
        "zero_quantized_gradients": True,
        "zero_quantized_gradients_error_feedback": True,
    },
}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import llmpar
    from llmpar.data import ByteTokenizer, load_tokens
    from llmpar.data.loader import BatchLoader
    from llmpar.distributed.collectives import CommCounter
    from llmpar.models import GPT
    from llmpar.train.loop import param_groups
    from llmpar.train.options import TrainOptions, build_config

    torch.set_num_threads(1)
    llmpar.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    opts = TrainOptions(steps=args.steps, batch_size=args.batch_size, zero=3)
    tok = ByteTokenizer()
    runs = {}
    for name in args.cases:
        cfg = build_config(opts)
        cfg["zero_optimization"].update(
            {
                "stage3_prefetch_bucket_size": args.prefetch,
                "stage3_param_persistence_threshold": 1000,
                "reduce_bucket_size": 10**6,
                "overlap_comm": True,
                **CASES[name],
            }
        )
        model = GPT(opts.model_config(tok.vocab_size), seed=opts.seed)
        counter = CommCounter()
        engine = llmpar.initialize(model=model, config=cfg, model_parameters=param_groups(model), counter=counter)[0]
        runs[name] = dict(engine=engine, counter=counter, losses=[], times=[], cross=[], sent=[])
    n_params = sum(p.numel() for p in GPT(opts.model_config(tok.vocab_size), seed=opts.seed).parameters())
    loader = BatchLoader(
        tokens=load_tokens(opts.text),
        batch_size=opts.batch_size,
        seq_len=opts.seq_len,
        dp_rank=rank,
        dp_size=world,
        seed=opts.seed,
    )
    for step in range(args.steps):
        x, y = loader.batch(step)
        for _name, run in runs.items():
            engine, counter = run["engine"], run["counter"]
            counter.reset()
            dist.barrier()
            t0 = time.perf_counter()
            loss = GPT.loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            t = loss.detach().reshape(1).clone()
            dist.all_reduce(t)
            run["times"].append(time.perf_counter() - t0)
            run["losses"].append(t.item() / world)
            run["cross"].append(counter.total_cross_node_bytes() - counter.cross_node_bytes.get("all_reduce", 0))
            run["sent"].append(counter.total_bytes_sent())
        if rank == 0 and (step + 1) % 50 == 0:
            print(f"step {step + 1}: " + " ".join(f"{n} {r['losses'][-1]:.4f}" for n, r in runs.items()), flush=True)
    out = {}
    for name, run in runs.items():
        cross = torch.tensor(run["cross"][1:], dtype=torch.float64).mean().reshape(1)
        dist.all_reduce(cross)
        out[name] = dict(
            losses=run["losses"],
            step_s=statistics.median(run["times"][5:]),
            cross_per_step=cross.item() / world,
            sent_per_step=statistics.mean(run["sent"][1:]),
            extra_numel=(
                run["engine"].optimizer.reducer.quantizer.residual_numel()
                if run["engine"].optimizer.reducer.quantizer is not None
                else 0
            ),
        )
    if rank == 0:
        Path(args.json).write_text(
            json.dumps(
                dict(
                    cases=out,
                    n_params=n_params,
                    world=world,
                    steps=args.steps,
                    batch_size=args.batch_size,
                    prefetch=args.prefetch,
                )
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def launch(args: argparse.Namespace) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
    ]
    tail = [
        str(Path(__file__).resolve()),
        "--worker",
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--prefetch",
        str(args.prefetch),
        "--json",
        args.json,
        "--cases",
        *args.cases,
    ]
    procs = [subprocess.Popen(cmd + ["--node_rank", str(i)] + tail, env=env) for i in range(2)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a node failed: exit codes {codes}")
    return json.loads(Path(args.json).read_text())


def report(data: dict, args: argparse.Namespace, command: str) -> str:
    import torch

    psi_unit = data["n_params"] * 4 * (data["world"] - 2) / data["world"]  # one fp32 all-gather, across nodes
    base = data["cases"]["zero3"]
    tail = min(20, data["steps"])

    def final(c):
        return sum(c["losses"][-tail:]) / tail

    lines = [
        f"# ZeRO-3 compressed communication (ZeRO++ class), demo GPT, dp={data['world']} as 2 nodes x 2 ranks",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: 2-core CPU, gloo, torch {torch.__version__}; {time.strftime('%Y-%m-%d')}. "
        f"{data['n_params']:,} params, {data['steps']} steps, micro batch {data['batch_size']} x 4 ranks, "
        f"stage3_prefetch_bucket_size {data['prefetch']}. Loss: mean of the last {tail} steps (rel. to zero3). "
        "Cross-node: bytes each rank receives from the other node per step (CommCounter, direct form), in psi "
        "= one uncompressed fp32 all-gather of all params across nodes (plain ZeRO-3: 3). 'fp16 psi': the same "
        "bytes over the ZeRO++ papers' fp16 unit (params x 2 bytes x 1/2), the figure an fp16 run of the "
        "compressed cases would show (their codes do not depend on the params' dtype; an fp16 run's uncompressed "
        "collectives move half of fp32's, so plain ZeRO-3 is 3 fp16 psi there too; the uncompressed rows are left "
        "out of that column). Step time: median, interleaved; ratio to zero3.",
        "",
        "| case | final loss | vs zero3 | cross-node / step | psi (fp32) | fp16 psi (compressed) | step "
        "| vs zero3 | extra state / rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in data["cases"].items():
        fl = final(c)
        fp16 = f"{2 * c['cross_per_step'] / psi_unit:.3f}" if name in ("qwZ+qgZ+EF", "qwZ+hpZ+qgZ+EF") else "-"
        lines.append(
            f"| {name} | {fl:.4f} | {100 * (fl / final(base) - 1):+.2f}% | {c['cross_per_step'] / 1e6:.3f} MB "
            f"| {c['cross_per_step'] / psi_unit:.3f} | {fp16} "
            f"| {1e3 * c['step_s']:.1f} ms | {c['step_s'] / base['step_s']:.2f}x "
            f"| {4 * c['extra_numel'] / 1e6:.2f} MB |"
        )
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = data["cases"]["zero3"]["losses"]
    k = 10
    for name, c in data["cases"].items():
        rel = [(sum(c["losses"][i - k : i]) / k) / (sum(base[i - k : i]) / k) - 1 for i in range(k, len(base) + 1)]
        a.plot(range(k, len(base) + 1), [100 * r for r in rel], label=name)
    a.set_xlabel("step")
    a.set_ylabel("loss vs zero3, %, 10-step mean")
    a.legend(fontsize=8)
    psi_unit = data["n_params"] * 4 * (data["world"] - 2) / data["world"]
    names = list(data["cases"])
    b.bar(names, [data["cases"][n]["cross_per_step"] / psi_unit for n in names])
    b.set_ylabel("cross-node bytes / step (psi, fp32)")
    b.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--prefetch", type=int, default=200_000, help="stage3_prefetch_bucket_size (elements)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--json", default="/tmp/llmpar_zeropp.json")
    p.add_argument("--out", default=str(HERE / "results" / "zeropp.md"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if "zero3" not in args.cases:
        args.cases = ["zero3", *args.cases]
    data = launch(args)
    command = "python bench/bench_zeropp.py " + " ".join(
        a for a in sys.argv[1:] if not a.startswith("--json") and not a.startswith("--out")
    )
    text = report(data, args, command.strip())
    out = Path(args.out)
    out.write_text(text + f"\n![loss and bytes]({out.with_suffix('.png').name})\n")
    plot(data, out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
