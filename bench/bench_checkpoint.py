"""Benchmark: sharded checkpoint save and load of a ~50M-param GPT at dp=2 on CPU/gloo, ZeRO stage 2 (fp32 AdamW),
llmpar ``engine.save_checkpoint/load_checkpoint`` vs DeepSpeed's on the same model and config, side by side in one run.

    python bench/bench_checkpoint.py                       # launches torchrun itself (2 ranks)
    python bench/bench_checkpoint.py --repeats 5 --dir /some/fast/disk

Timing: every case once per repeat (order rotated), ranks lined up by a barrier, the slowest rank's time kept,
median over repeats (``harness.measure_distributed`` per call). Every save writes a new tag, as training does; before
each timed call (untimed) the checkpoints but each library's last are deleted and ``os.sync()`` flushes the page cache,
so no case pays for another's leftovers (DeepSpeed's unsynced dirty pages written back during the next case, deleted
blocks discarded at the next journal commit, i.e. the next fsync); ``--same-tag``: one tag re-saved, nothing flushed
(the first results' method). Both engines take one training step first. ``async_save=True`` row: the time
save_checkpoint blocks (host snapshot), the rest (writes + publish) as seen by a ``wait_checkpoint`` called at once,
and their sum. Bytes per rank: its ``wchar`` delta (``/proc/self/io``) over its last save, and the sizes of the files it
wrote. The model state (trainable params + fp32 exp_avg + exp_avg_sq + module buffers) must be in llmpar's files
once (overhead = index, RNG states, padding, metadata: <= max(1 MiB, 0.2%)). llmpar hashes every byte (sha256 per
4 MiB block, checked on load for every block a rank reads), fsyncs every file and publishes by rename; DeepSpeed does
neither: its save time is that of the page cache. DeepSpeed: CPU accelerator, ``torch_adam``, no shared-memory comm op.
Profile (``profile_save_ms`` / ``profile_load_ms``): ``--repeats`` more saves and loads with timers around llmpar's
phases (median per rank, then the slowest rank; "of which": nested in the phase before).
Results: bench/results/checkpoint_dp2.{md,json}.

    python bench/bench_checkpoint.py --reshard             # tp=2 checkpoint: load at tp=2 vs resharded to tp=1 x dp=2

``--reshard``: the cost of tensor-parallel resharding on load (each rank reads the saved tp ranks' shards that overlap
its slice, so a tp=1 rank reads both); bench/results/checkpoint_reshard_tp.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": args.bucket,
            "allgather_bucket_size": args.bucket,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
        },
        "steps_per_print": 10**9,
    }


def _model(args, vocab=256):
    from llmpar.models import GPT, GPTConfig

    return GPT(
        GPTConfig(vocab_size=vocab, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, seq_len=args.seq),
        seed=0,
    )


def _wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def _model_state_bytes(model: torch.nn.Module) -> int:
    """Params (their dtype) + fp32 exp_avg and exp_avg_sq of the trainable ones + module buffers."""
    n = sum(p.numel() * p.element_size() + (2 * p.numel() * 4 if p.requires_grad else 0) for p in model.parameters())
    return n + sum(b.numel() * b.element_size() for b in model.buffers())


def _train_step(engine, inp, tgt) -> None:
    loss = engine.module.loss(engine(inp), tgt)
    engine.backward(loss)
    engine.step()


def _ds_rank_files(ckpt: Path, rank: int) -> list[Path]:
    """The files DeepSpeed's rank ``rank`` writes at dp=2, stage 2: model states (dp rank 0) + its optimizer shard."""
    out = sorted(ckpt.glob(f"zero_pp_rank_{rank}_*"))
    if rank == 0:
        out += sorted(ckpt.glob("mp_rank_*_model_states.pt"))
    return out


def _phases() -> tuple[list, list]:
    """(label, owner, attribute) of llmpar's save and load phases, timed by wrapping them (the profile pass only)."""
    from llmpar.checkpoint import blockfile, blockwrite, files, load, plan, publish, save, shards

    agree = ("agreements (waiting for the slowest rank)", files, "agree_all")
    return (
        [
            ("snapshot (views or host copies, tag agreement)", save, "_prepare"),
            ("rank file: write + sha256 + fsync", blockwrite, "write"),
            ("of which waiting for the hash threads", blockfile.Hasher, "close"),
            ("fsync (every file)", os, "fsync"),
            ("publish (rank 0: metadata.json, renames, latest, old copy deleted)", publish, "publish"),
            ("of which deleting the replaced copy", shutil, "rmtree"),
            agree,
        ],
        [
            ("open: resolve, metadata.json, agreement", load, "_open"),
            ("check sizes + index sha256", shards.RankFiles, "check"),
            ("sha256 of this rank's share of the blocks read", shards.RankFiles, "verify_mine"),
            ("copy into the engine", plan, "apply"),
            agree,
        ],
    )


@contextlib.contextmanager
def _timers(phases, totals: dict[str, float]):
    """Wrap each phase's function so that its time adds up in ``totals[label]``; restored on exit."""
    undo = []
    for label, owner, attr in phases:
        fn = getattr(owner, attr)

        def timed(*a, _fn=fn, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, functools.wraps(fn)(timed))
        undo.append((owner, attr, fn))
    try:
        yield
    finally:
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)


def _profile(call, phases, repeats: int, pg, settle) -> str:
    """``repeats`` calls with the phases timed: "label median ms" of the slowest rank, and the total."""
    import torch.distributed as dist

    per: list[dict[str, float]] = []
    for _ in range(repeats):
        totals: dict[str, float] = {}
        settle()
        dist.barrier(pg)
        with _timers(phases, totals):
            t0 = time.perf_counter()
            call()
            totals["total"] = time.perf_counter() - t0
        per.append(totals)
    labels = ["total"] + [label for label, _, _ in phases]
    med = torch.tensor([sorted(p.get(k, 0.0) for p in per)[repeats // 2] for k in labels], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=pg)
    return "; ".join(f"{k} {v * 1e3:.0f}" for k, v in zip(labels, med.tolist()))


class _Dir:
    """One library's save directory: a new tag per save (``--same-tag``: one); ``tag``: the last one saved."""

    def __init__(self, path: Path, same_tag: bool) -> None:
        self.path, self.same_tag, self.tag, self.saves = path, same_tag, "bench", 0

    def new_tag(self) -> str:
        self.saves += 1
        self.tag = "bench" if self.same_tag else f"bench{self.saves}"
        return self.tag

    def prune(self, rank: int) -> None:
        """Rank 0: delete every checkpoint but the last."""
        for p in self.path.iterdir() if rank == 0 and not self.same_tag and self.path.is_dir() else ():
            if p.is_dir() and p.name != self.tag:
                shutil.rmtree(p)


def _interleaved(cases: dict, settle, pg, warmup: int, repeats: int) -> dict:
    """{name: Timing}: ``harness.measure_distributed`` per call, cases interleaved, ``settle()`` (untimed) first."""
    from harness import Timing, measure_distributed

    names = list(cases)
    for _ in range(max(warmup, 1)):  # at least once: the loads read what the saves wrote
        for name in names:
            settle()
            cases[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            settle()
            times[name] += measure_distributed(cases[name], group=pg, warmup=0, repeats=1).times_s
    return {name: Timing(name=name, times_s=t) for name, t in times.items()}


def run(args) -> None:
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    import llmpar
    from llmpar.checkpoint import files as ckfiles

    from harness import write_results

    dist.init_process_group("gloo")
    pg, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    root = Path(args.dir)
    x = torch.randint(0, 256, (args.micro, args.seq + 1), generator=torch.Generator().manual_seed(rank))
    inp, tgt = x[:, :-1], x[:, 1:]

    model = _model(args)
    state_bytes = _model_state_bytes(model)
    n_params = sum(p.numel() for p in model.parameters())
    ours, *_ = llmpar.initialize(model=model, config=_config(args))
    _train_step(ours, inp, tgt)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    cfg = _config(args)
    cfg["optimizer"]["params"]["torch_adam"] = True
    ds_model = _model(args)
    theirs, *_ = deepspeed.initialize(model=ds_model, model_parameters=ds_model.parameters(), config=cfg)
    _train_step(theirs, inp, tgt)

    written: dict[str, int] = {}
    mine, other = _Dir(root / "llmpar", args.same_tag), _Dir(root / "deepspeed", args.same_tag)

    def settle() -> None:  # untimed: no dirty pages or deleted blocks left for the next case's writes and fsyncs
        mine.prune(rank), other.prune(rank)
        if not args.same_tag:
            os.sync()

    def timed_write(name, fn):
        def call():
            before = _wchar()
            fn()
            written[name] = _wchar() - before

        return call

    def save_ours(**kw):
        return ours.save_checkpoint(str(mine.path), tag=mine.new_tag(), **kw)

    cases = {
        "llmpar_save": timed_write("llmpar_save", save_ours),
        "deepspeed_save": timed_write(
            "deepspeed_save", lambda: theirs.save_checkpoint(str(other.path), tag=other.new_tag())
        ),
        "llmpar_load": lambda: ours.load_checkpoint(str(mine.path), tag=mine.tag),
        "deepspeed_load": lambda: theirs.load_checkpoint(str(other.path), tag=other.tag),
    }
    timings = _interleaved(cases, settle, pg, args.warmup, args.repeats)
    # async save: the blocking part (host snapshot + tmp dir agreement), then wait_checkpoint called at once
    blocking, rest = [], []
    for _ in range(args.repeats):
        settle()
        dist.barrier(pg)
        t0 = time.perf_counter()
        save_ours(async_save=True)
        blocking.append(time.perf_counter() - t0)
        ours.wait_checkpoint()
        rest.append(time.perf_counter() - t0 - blocking[-1])
    slowest = torch.tensor([blocking, rest, [b + r for b, r in zip(blocking, rest)]], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    async_blocking_ms, async_rest_ms, async_total_ms = (float(v.median()) * 1e3 for v in slowest)
    save_phases, load_phases = _phases()
    profile_save = _profile(save_ours, save_phases, args.repeats, pg, settle)
    profile_load = _profile(
        lambda: ours.load_checkpoint(str(mine.path), tag=mine.tag), load_phases, args.repeats, pg, settle
    )

    # bytes per rank: wchar deltas of the last save and the sizes of the files each rank wrote
    meta_files = json.loads((mine.path / mine.tag / ckfiles.METADATA).read_text())["files"]
    mine_ours = sum(e["bytes"] for e in meta_files.values() if e["dp_rank"] == rank)
    if rank == 0:
        mine_ours += (mine.path / mine.tag / ckfiles.METADATA).stat().st_size
    mine_ds = sum(p.stat().st_size for p in _ds_rank_files(other.path / other.tag, rank))
    local = torch.tensor([written["llmpar_save"], written["deepspeed_save"], mine_ours, mine_ds], dtype=torch.float64)
    everyone = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    if rank == 0:
        per_rank = torch.stack(everyone)  # [world, 4]
        ds_files = sorted(p.name for p in (other.path / other.tag).iterdir())
        rows = []
        for lib, col_w, col_f in (("llmpar", 0, 2), ("deepspeed", 1, 3)):
            total = int(per_rank[:, col_f].sum())
            rows.append(
                {
                    "library": lib,
                    "save_median_ms": round(timings[f"{lib}_save"].median_s * 1e3, 1),
                    "save_min_ms": round(timings[f"{lib}_save"].min_s * 1e3, 1),
                    "load_median_ms": round(timings[f"{lib}_load"].median_s * 1e3, 1),
                    "load_min_ms": round(timings[f"{lib}_load"].min_s * 1e3, 1),
                    "file_bytes_per_rank": [int(v) for v in per_rank[:, col_f]],
                    "wchar_bytes_per_rank": [int(v) for v in per_rank[:, col_w]],
                    "file_bytes_total": total,
                    "total_over_model_state": round(total / state_bytes, 4),
                    "overhead_bytes": total - state_bytes,
                }
            )
        ours_row = rows[0]
        # fixed framing (index, RNG states, metadata.json: tens of KB) + padding; a duplicated tensor: >= 1/3 of it
        no_dup = 0 <= ours_row["overhead_bytes"] <= max(1 << 20, 0.002 * state_bytes)
        rows.insert(
            1,
            {
                "library": "llmpar async_save=True",
                "save_median_ms": round(async_blocking_ms, 1),
                "wait_checkpoint_median_ms": round(async_rest_ms, 1),
                "async_total_median_ms": round(async_total_ms, 1),
                "file_bytes_total": ours_row["file_bytes_total"],
            },
        )
        for row in rows:
            row["save_vs_deepspeed"] = round(row["save_median_ms"] / rows[-1]["save_median_ms"], 3)
            if "load_median_ms" in row:
                row["load_vs_deepspeed"] = round(row["load_median_ms"] / rows[-1]["load_median_ms"], 3)
        meta = {
            "model": f"GPT d_model={args.d_model} n_layer={args.n_layer} ({n_params / 1e6:.1f}M params), fp32, "
            f"AdamW, ZeRO stage 2, dp={world}",
            "model_state_bytes": f"{state_bytes} (params + exp_avg + exp_avg_sq + buffers)",
            "llmpar_no_duplication": f"{no_dup}: files across ranks = {ours_row['total_over_model_state']} x the "
            f"model state (overhead {ours_row['overhead_bytes']} bytes)",
            "deepspeed_files": ", ".join(ds_files),
            "note": "llmpar sha256-hashes every byte (per 4 MiB block, verified on load), fsyncs every file and "
            "publishes by rename; DeepSpeed does neither. Times: the slowest rank's, repeats interleaved, "
            + (
                "one tag re-saved"
                if args.same_tag
                else "a new tag per save, os.sync() (untimed) before every timed call"
            ),
            "profile_save_ms": profile_save,
            "profile_load_ms": profile_load,
            "repeats": args.repeats,
            "threads_per_rank": torch.get_num_threads(),
            "dir": str(root),
            "load_average": f"{os.getloadavg()[0]:.1f} (1 min, at the end: other work shares the machine)",
            "deepspeed": deepspeed.__version__,
        }
        print(json.dumps({"rows": rows, "meta": meta}, indent=1))
        if not no_dup:
            print(f"FAIL: llmpar wrote {ours_row['file_bytes_total']} bytes for {state_bytes} bytes of model state")
        if not args.no_write:
            write_results("checkpoint_dp2", rows, meta)
    del cases
    ours = theirs = None  # drop the engines (not `del`: the closures above read these names)
    gc.collect()
    dist.destroy_process_group()


def run_reshard(args) -> None:
    """``--reshard``: load time of a tp=2 checkpoint at the same layout (tp=2) and resharded to tp=1 x dp=2 (every
    split param rebuilt from both saved tp ranks' shards, vocabulary padding dropped), same ranks, same model."""
    import torch.distributed as dist

    import llmpar

    from harness import compare_distributed, write_results

    dist.init_process_group("gloo")
    root, world = Path(args.dir), dist.get_world_size()
    cfg = _config(args)
    engines = {}
    for tp in (world, 1):
        env = llmpar.init_distributed(tp=tp)
        model = _model(args, vocab=257)  # odd vocabulary: padded to a multiple of tp
        if tp > 1:
            llmpar.parallelize(model, env.mesh["tp"])
        dp = env.mesh["dp"].size()
        cfg["train_micro_batch_size_per_gpu"], cfg["train_batch_size"] = args.micro * world // dp, args.micro * world
        engines[tp], *_ = llmpar.initialize(model=model, config=cfg, mesh=env.mesh)
        if tp > 1:
            x = torch.randint(0, 257, (args.micro * world, args.seq + 1), generator=torch.Generator().manual_seed(0))
            _train_step(engines[tp], x[:, :-1], x[:, 1:])
            engines[tp].save_checkpoint(str(root / "tp"), tag="bench")
    cases = {
        f"load_at_tp{tp}": (lambda e=e: e.load_checkpoint(str(root / "tp"), tag="bench")) for tp, e in engines.items()
    }
    timings = compare_distributed(cases, warmup=args.warmup, repeats=args.repeats)
    if dist.get_rank() == 0:
        n_params = sum(p.numel() for p in _model(args, vocab=257).parameters())
        same = timings[f"load_at_tp{world}"].median_s
        rows = [
            {
                "load": f"saved tp={world} x dp=1, loaded at tp={tp} x dp={world // tp}",
                "median_ms": round(timings[f"load_at_tp{tp}"].median_s * 1e3, 1),
                "min_ms": round(timings[f"load_at_tp{tp}"].min_s * 1e3, 1),
                "vs_same_layout": round(timings[f"load_at_tp{tp}"].median_s / same, 3),
            }
            for tp in engines
        ]
        meta = {
            "model": f"GPT d_model={args.d_model} n_layer={args.n_layer} vocab=257 ({n_params / 1e6:.1f}M "
            "params), fp32, AdamW, ZeRO stage 2",
            "repeats": args.repeats,
            "dir": str(root),
        }
        print(json.dumps({"rows": rows, "meta": meta}, indent=1))
        if not args.no_write:
            write_results("checkpoint_reshard_tp", rows, meta)
    del engines, cases
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layer", type=int, default=7)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--bucket", type=int, default=5_000_000, help="reduce/allgather bucket size in elements")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir, removed after)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument(
        "--same-tag",
        action="store_true",
        help="re-save one tag, no page-cache flush between the cases (the method of the first results)",
    )
    p.add_argument(
        "--reshard",
        action="store_true",
        help="time a tp=nproc checkpoint loaded at tp=nproc and tp=1 instead (no DeepSpeed)",
    )
    args = p.parse_args()
    if "RANK" in os.environ:
        (run_reshard if args.reshard else run)(args)
        return
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="llmpar-bench-ckpt-")
    argv = [a for a in sys.argv[1:]] + ([] if args.dir else ["--dir", tmp])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
        __file__,
        *argv,
    ]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    print(out.stdout)


if __name__ == "__main__":
    main()
