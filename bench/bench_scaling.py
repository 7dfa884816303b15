"""Benchmark: the scaling picture. Step time and per-rank memory of the bench GPT against dp (1, 2, 4) and model size,
for torch DDP + fused AdamW, llmpar ZeRO-1/2/3, torch FSDP2 and DeepSpeed ZeRO-1/2/3 on CPU/gloo, with each
contender's memory next to the planner's estimate (``llmpar.planning.estimate_memory``) for the same model, dp, stage,
dtype and bucket size (issue #19 goal 6).

    python bench/bench_scaling.py          # 5M and 20M params, dp 1 2 4, every contender (15 min on 2 busy cores)
    python bench/bench_scaling.py --sizes 5M 20M 50M --repeats 8   # 50M: the timing job holds all 8 states at once
    python bench/bench_scaling.py --sizes 5M --dps 2 --cases ddp llmpar_s2 --no-write   # a quick look

Per (size, dp):
- step time: one torchrun job (``baselines.time_cases``) builds every contender and times them interleaved (order
  rotated every round, ranks lined up by a barrier, the slowest rank's time per repeat, the median over repeats);
  ``time_vs_ddp`` is the ratio to DDP in the same job. dp=4 runs 4 ranks on however many cores there are.
- memory: each contender in its own fresh ranks (forked from this process, which has imported torch, llmpar and
  DeepSpeed and run no torch op yet), ``--mem-steps`` steps; per column the max over ranks:
  ``state_mb``: the bytes of the live tensors the training state holds when the optimizer step of the last step
  begins (grads reduced, not yet freed; optimizer state allocated by the first step): every tensor reachable from
  Python (``gc``, after a collection; the smaller of two walks 0.1 s apart), each storage counted once, minus the
  same walk before the model was built, plus torch DDP's gradient buckets (held by its C++ reducer, read from its
  logging data). On a CPU run "device" and "host" are the same memory, so offloaded state counts too. Activations
  and in-flight communication buffers are gone by then. ``step_peak_rss_mb``: the peak RSS during the steps after
  the first over the RSS before them (activations, buckets, gathered params, transient grads, what the allocator
  keeps); ``peak_rss_over_start_mb``: the peak RSS of build + steps over the RSS just before the build.
- the planner: ``est_mb`` = ``estimate_memory(model, Layout(dp, zero_stage), precision, bucket_bytes)``'s model
  states (+ host bytes), the stage of each contender (DDP 0, FSDP2 3 with no persistent params);
  ``state_vs_est`` = state_mb / est_mb. For llmpar also ``held_mb`` (``ZeroOptimizer.memory_bytes()``, device +
  host) and ``est_err_pct`` = (est - state) / state, the goal being |err| <= 5%; ``buffers_mb`` (its staging and
  gathered peaks) next to the planner's ``est_buffers_mb``.
Results: bench/results/scaling.{md,json,png} (every column; figure: step time and state vs dp) and
scaling_memory.{md,json,png} (the memory columns; figure: state and state / estimate vs dp), figures drawn by
``scaling_plot.py`` (``--replot`` redraws them from scaling.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import (  # noqa: E402
    add_step_args,
    batch,
    ddp_step,
    deepspeed_step,
    fsdp2_step,
    gpt,
    llmpar_step,
    time_cases,
    torchrun,
    zero_config,
)

SIZES = {"5M": dict(d_model=256, n_layer=6), "20M": dict(d_model=512, n_layer=6), "50M": dict(d_model=640, n_layer=10)}
CASES = ("ddp", "llmpar_s1", "llmpar_s2", "llmpar_s3", "fsdp2", "deepspeed_s1", "deepspeed_s2", "deepspeed_s3")
EXTRA = ("llmpar_s0", "llmpar_s1_offload", "llmpar_s2_offload", "llmpar_s3_offload")  # --mem-only-cases
STAGE = {"ddp": 0, "fsdp2": 3}


def stage_of(case: str) -> int:
    return STAGE[case] if case in STAGE else int(case.split("_s")[1][0])


def offload_of(case: str) -> str:
    return "optimizer" if case.endswith("_offload") else "none"


def model_args(args: Any, size: str) -> SimpleNamespace:
    """What baselines.gpt / batch / zero_config read, for model ``size``."""
    return SimpleNamespace(
        **SIZES[size],
        n_head=args.n_head,
        seq=args.seq,
        micro=args.micro,
        bucket=args.bucket,
        bf16=args.bf16,
        cases=args.cases,
        warmup=args.warmup,
        repeats=args.repeats,
    )


def build(case: str, args: Any):
    """step() running one training step of ``case`` on this rank (the contenders of baselines.py)."""
    inp, tgt = batch(args)
    model = gpt(args)
    if case.startswith("llmpar"):
        cfg = zero_config(args, stage_of(case))
        if offload_of(case) != "none":
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        return llmpar_step(model, cfg, inp, tgt)
    if case.startswith("deepspeed"):
        return deepspeed_step(model, zero_config(args, stage_of(case)), inp, tgt)
    return ddp_step(model, args, inp, tgt) if case == "ddp" else fsdp2_step(model, args, inp, tgt)


# ----------------------------------------------------------------------------------------------- memory
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def live_tensor_bytes() -> int:
    """Bytes of the storages of every tensor reachable from Python, each storage once (wrapper subclasses such as
    DTensor hold no storage of their own: their local tensors are found themselves)."""
    sizes: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.device.type == "meta":
            continue
        try:
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        if ptr:
            key = (str(obj.device), ptr)
            sizes[key] = max(sizes.get(key, 0), storage.nbytes())
    return sum(sizes.values())


def _instances(cls: type) -> list[Any]:
    return [o for o in gc.get_objects() if issubclass(type(o), cls)]


def ddp_bucket_bytes() -> int:
    """Gradient buckets of every torch DDP module alive (its C++ reducer's, invisible to ``gc``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    total = 0
    for ddp in _instances(DDP):
        sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
        total += sum(int(s) for s in sizes.replace(" ", "").split(",") if s)
    return total


class StepProbe:
    """Walks the live tensors when an optimizer step begins, once armed: torch optimizers (DDP, FSDP2, DeepSpeed's
    inner torch AdamW) through the global step pre-hook, llmpar's ZeroOptimizer by wrapping its ``step``."""

    def __init__(self) -> None:
        self.armed = False
        self.bytes: int | None = None
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.handle = register_optimizer_step_pre_hook(lambda *_: self.fire())

    def fire(self) -> None:
        if self.armed:  # what is reachable, not garbage in reference cycles awaiting the collector; the smaller
            self.armed = False  # of two walks 0.1 s apart: buffers of a finished collective that gloo's worker thread
            walks = []  # has not let go of yet (seen under load) are no state
            for _ in range(2):
                gc.collect()
                walks.append(live_tensor_bytes())
                time.sleep(0.1)
            self.bytes = min(walks)

    def wrap(self, opt: Any) -> None:
        inner = opt.step

        def step(*a: Any, **k: Any) -> Any:
            self.fire()
            return inner(*a, **k)

        opt.step = step


def memory_rank(case: str, args: Any) -> dict[str, Any]:
    """One rank of the memory run of ``case`` (the process group is up): the state walk and the RSS peaks, see
    the module doc. The first step allocates the optimizer state; the peak of the later ones is the step's."""
    from llmpar.zero import ZeroOptimizer

    torch.manual_seed(0)
    gc.collect()
    base, rss0 = live_tensor_bytes(), _status_kb("VmRSS")
    step = build(case, args)
    probe = StepProbe()
    zero = _instances(ZeroOptimizer)
    for opt in zero:
        probe.wrap(opt)
    step()
    peak, rss1 = _status_kb("VmHWM"), _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM starts again from the current RSS
        f.write("5")
    for i in range(1, args.mem_steps):
        probe.armed = i == args.mem_steps - 1
        step()
    probe.handle.remove()
    hwm = _status_kb("VmHWM")
    out = {
        "state": (probe.bytes or 0) - base + ddp_bucket_bytes(),
        "peak_rss": (max(peak, hwm) - rss0) * 1024,
        "step_rss": (hwm - rss1) * 1024,
    }
    if zero:
        mem = zero[0].memory_bytes()
        out.update(held=mem["device"] + mem["host"], buffers=mem["staging_peak"] + mem.get("gathered_peak", 0))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, case: str, args: Any, path: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo")
        result = memory_rank(case, args)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        result, code = {"error": traceback.format_exc()}, 1
    with open(path, "w") as f:
        json.dump(result, f)
    os._exit(code)  # a forked child: no atexit handlers, no process-group teardown against dead peers


def memory_run(case: str, args: Any, world: int, tmp: Path, timeout: float = 600.0) -> dict[str, Any]:
    """``case`` on ``world`` fresh ranks forked from here; per key the max over ranks."""
    port, pids = _free_port(), []
    paths = [tmp / f"{case}_{world}_{r}.json" for r in range(world)]
    for rank, path in enumerate(paths):
        pid = os.fork()
        if pid == 0:
            _child(rank, world, port, case, args, str(path))
        pids.append(pid)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if os.waitpid(p, os.WNOHANG) == (0, 0)]
        time.sleep(0.05)
    for pid in pids:  # ours, still running past the deadline
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    results = [json.loads(p.read_text()) if p.exists() else {"error": "no result (timed out?)"} for p in paths]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit(f"memory run of {case} at dp={world} failed:\n{errors[0][-4000:]}")
    return {k: max(r[k] for r in results) for k in results[0]}


# ---------------------------------------------------------------------------------------------- planner
def planner_estimate(case: str, args: Any, world: int) -> dict[str, float]:
    """The planner's per-rank model states (+ host bytes) and buffers for ``case``'s stage, dtype and bucket."""
    from llmpar.planning import Layout, estimate_memory

    with torch.device("meta"):
        model = gpt(args)
    est = estimate_memory(
        model,
        Layout(dp=world, zero_stage=stage_of(case), offload=offload_of(case)),
        precision="fp32_master" if args.bf16 else "fp32",
        bucket_bytes=args.bucket * (2 if args.bf16 else 4),
        **({"persistence_threshold": 0} if case == "fsdp2" else {}),
    )
    return {"est": est.model_states + est.cpu, "est_buffers": est.buffers, "params": int(est.psi_rank)}


# ----------------------------------------------------------------------------------------------- timing
def timing_rank(args: Any) -> None:
    """One rank of the timing job of one size (under torchrun): every case, interleaved; rank 0 prints the rows."""
    margs = model_args(args, args.size)

    def report(timings: dict, world: int, n_params: int) -> None:
        base = timings.get("ddp")
        rows = [
            {
                "case": c,
                **timings[c].row(),
                "time_vs_ddp": timings[c].median_s / base.median_s if base is not None else float("nan"),
            }
            for c in args.cases
            if c in timings
        ]
        print("ROWS " + json.dumps(rows), flush=True)

    time_cases(margs, lambda case, a: build(case, a), report)


def _mb(n: float) -> float:
    return round(n / 2**20, 2)


def run_size_dp(args: Any, size: str, world: int, tmp: Path, passthrough: list[str]) -> list[dict[str, Any]]:
    """Timing job, then a memory run per case, for one (size, dp): the rows."""
    rows: dict[str, dict[str, Any]] = {}
    if args.mode in ("all", "time"):
        out = torchrun(__file__, [*passthrough, "--size", size], world)
        line = [ln for ln in out.splitlines() if ln.startswith("ROWS ")][-1]
        for r in json.loads(line[5:]):
            rows[r["case"]] = {
                "size": size,
                "dp": world,
                "case": r["case"],
                "median_ms": round(r["median_ms"], 2),
                "iqr_ms": round(r["iqr_ms"], 2),
                "time_vs_ddp": round(r["time_vs_ddp"], 3),
            }
        print(f"[{size} dp={world}] timing done", flush=True)
    if args.mode in ("all", "memory"):
        margs = model_args(args, size)
        margs.mem_steps = args.mem_steps
        for case in [*args.cases, *args.mem_only_cases]:
            t0 = time.monotonic()
            mem = memory_run(case, margs, world, tmp)
            print(f"  {case} memory run {time.monotonic() - t0:.1f} s", flush=True)
            row = rows.setdefault(case, {"size": size, "dp": world, "case": case})
            row.update(
                state_mb=_mb(mem["state"]),
                step_peak_rss_mb=_mb(mem["step_rss"]),
                peak_rss_over_start_mb=_mb(mem["peak_rss"]),
            )
            if "held" in mem:
                row.update(held_mb=_mb(mem["held"]), buffers_mb=_mb(mem["buffers"]))
            print(f"[{size} dp={world}] {case}: {row}", flush=True)
    return list(rows.values())


def add_estimates(rows: list[dict[str, Any]], args: Any) -> None:
    """The planner's numbers next to the measured ones (after every fork: building a model runs torch ops)."""
    for row in rows:
        est = planner_estimate(row["case"], model_args(args, row["size"]), row["dp"])
        row["params"] = est["params"]
        row["est_mb"] = _mb(est["est"])
        if "state_mb" in row:
            row["state_vs_est"] = round(row["state_mb"] / row["est_mb"], 3)
            if row["case"].startswith("llmpar"):
                row["est_err_pct"] = round(100 * (row["est_mb"] - row["state_mb"]) / row["state_mb"], 2)
                row["est_vs_held_err_pct"] = round(100 * (row["est_mb"] - row["held_mb"]) / row["held_mb"], 2)
                row["est_buffers_mb"] = _mb(est["est_buffers"])


def write(rows: list[dict[str, Any]], args: Any) -> None:
    from harness import RESULTS_DIR, write_results

    meta = {
        "models": ", ".join(
            f"{s}: GPT d_model={SIZES[s]['d_model']} n_layer={SIZES[s]['n_layer']} "
            f"n_head={args.n_head} vocab=256 seq={args.seq}"
            for s in args.sizes
        ),
        "batch": f"micro {args.micro} x seq {args.seq} per rank",
        "bf16": args.bf16,
        "bucket_elements": args.bucket,
        "mem_steps": args.mem_steps,
        "cores": f"{os.cpu_count()} (dp=4 oversubscribes them: 4 single-threaded ranks share the cores)",
        "state_mb": "live tensors (params, grads, optimizer state, flat/bucket buffers) when the optimizer step "
        "of the last step begins, max over ranks",
        "est_mb": "llmpar.planning.estimate_memory model states (+ host) for the case's stage, dtype, bucket",
        "goal": "llmpar |est_err_pct| <= 5",
    }
    write_results(
        "scaling",
        rows,
        meta,
        curve={
            "x": "dp",
            "y": ["median_ms"],
            "group": ["case", "size"],
            "logy": True,
            "title": "step time per rank vs dp",
        },
    )
    mem_rows = [
        {
            k: r[k]
            for k in (
                "size",
                "dp",
                "case",
                "params",
                "state_mb",
                "est_mb",
                "state_vs_est",
                "step_peak_rss_mb",
                "peak_rss_over_start_mb",
                "held_mb",
                "est_err_pct",
            )
            if k in r
        }
        for r in rows
        if "state_mb" in r
    ]
    write_results(
        "scaling_memory",
        mem_rows,
        meta,
        curve={
            "x": "dp",
            "y": ["state_vs_est"],
            "group": ["case", "size"],
            "title": "measured state / planner estimate, per rank",
        },
    )
    replot(RESULTS_DIR)


def replot(results: Path) -> None:
    """The figures (``scaling_plot.py``) in place of the harness's single-curve ones, from the written rows."""
    from scaling_plot import draw

    rows = json.loads((results / "scaling.json").read_text())["rows"]
    draw(rows, results / "scaling.png", ("time", "state"), "step time and per-rank state vs dp (CPU, gloo)")
    draw(rows, results / "scaling_memory.png", ("state", "ratio"), "per-rank state: measured vs the planner")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["5M", "20M"], choices=list(SIZES))
    p.add_argument("--dps", nargs="+", type=int, default=[1, 2, 4])
    add_step_args(p, warmup=1, repeats=5)
    p.add_argument(
        "--mem-steps",
        type=int,
        default=2,
        help="steps of a memory run (>= 2: the first allocates the optimizer state, the last is measured)",
    )
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES + EXTRA)
    p.add_argument(
        "--mem-only-cases",
        nargs="*",
        default=list(EXTRA),
        choices=EXTRA,
        help="more llmpar cases whose memory (not time) is measured: stage 0, optimizer offload",
    )
    p.add_argument("--mode", choices=("all", "time", "memory"), default="all")
    p.add_argument("--size", choices=list(SIZES), help=argparse.SUPPRESS)  # the timing job's size (under torchrun)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--replot", action="store_true", help="only redraw the figures from bench/results/scaling.json")
    args = p.parse_args()
    if args.replot:
        from harness import RESULTS_DIR

        replot(RESULTS_DIR)
        return
    if args.mem_steps < 2:
        p.error(f"--mem-steps {args.mem_steps}: at least 2 (the first step allocates the optimizer state)")
    if "RANK" in os.environ:
        timing_rank(args)
        return
    if any(c.startswith("deepspeed") for c in args.cases):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401 - imported once here, before the memory ranks fork
    import llmpar  # noqa: F401

    passthrough = [
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        "--n-head",
        str(args.n_head),
        "--seq",
        str(args.seq),
        "--micro",
        str(args.micro),
        "--bucket",
        str(args.bucket),
        *(["--bf16"] if args.bf16 else []),
        "--cases",
        *args.cases,
    ]
    import tempfile

    rows: list[dict[str, Any]] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for world in args.dps:
                rows += run_size_dp(args, size, world, Path(tmp), passthrough)
    add_estimates(rows, args)
    print(json.dumps(rows, indent=1))
    print(f"total {time.monotonic() - start:.0f} s")
    if not args.no_write:
        write(rows, args)


if __name__ == "__main__":
    main()
