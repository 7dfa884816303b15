"""Long context on CPU ranks: the longest sequence a small Llama-like model trains (forward + backward + AdamW step)
under a fixed per-rank activation-memory cap, plain (1 rank) vs context parallelism over sp = 2 and 4 ranks (gloo),
the planner's activation estimate next to each measurement, the ring's exposed-communication fraction, and the step
time of llmpar's Ulysses attention vs DeepSpeed's ``DistributedAttention`` (same model; DeepSpeed's all-to-alls around
the same local attention, ``llmpar.ops.attention.flash_attention``).

    python bench/bench_long_context.py                 # -> bench/results/long_context_cpu.{json,md,png}
    python bench/bench_long_context.py --quick         # a smaller sweep, for a look

Model: L layers of RMSNorm -> q/k/v (rotary by global position) -> causal attention -> o; RMSNorm -> SwiGLU MLP,
tied-free head; every configuration (plain included) uses the sequence-tiled loss and MLP
(``llmpar.context_parallel.tiled``), so what changes between them is only the sequence each rank holds. The model is
built here on the ``ContextParallel`` object (its ``shard`` / ``attention`` / ``token_mean``) rather than through
``llmpar.initialize``: the bench controls the step, so the measurement holds nothing but the step.

Memory, measured honestly on CPU: each configuration runs in fresh processes (one per rank) with glibc's mmap
threshold fixed at 64 KiB, so every tensor above it is its own mapping, returned to the system when freed. Per length:
the resident set before the step is the base (parameters, gradients kept allocated, AdamW states (per-parameter
updates, no whole-model temporaries): one warm-up step made them), the
kernel's peak-RSS mark is reset (``/proc/self/clear_refs``), one step runs, and peak RSS - base is the step's
activation peak (everything the step allocates: saved activations, transients, communication buffers). The reported
figure is the max over ranks. A length "trains under the cap" when that peak is <= the cap.
"""

from __future__ import annotations

import argparse
import gc
import os
import queue as queue_mod
import sys
import time
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by glibc at process start (the ranks' processes)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmpar.context_parallel import ContextParallel, shard_tensor  # noqa: E402
from llmpar.context_parallel.tiled import tiled_lm_loss, tiled_mlp  # noqa: E402
from llmpar.ops.attention import Q_CHUNK, flash_attention  # noqa: E402

SHAPE = dict(n_layers=2, hidden=256, n_heads=4, n_kv_heads=4, ffn_hidden=688, vocab=2048)
TILE = 256
DS_PAIRS = 5  # alternating llmpar / DeepSpeed Ulysses steps
DS_SEQ = 1024  # their sequence (sp=2)


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    vals = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, kb = line.split()[:2]
            vals[key[:-1]] = int(kb) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def _rotary(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    inv = 1.0 / (10000 ** (torch.arange(d, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class _MLP(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.norm, self.gate, self.up = nn.RMSNorm(h), nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return self.down(F.silu(self.gate(y)) * self.up(y))


class _Block(nn.Module):
    def __init__(self, h: int, heads: int, f: int) -> None:
        super().__init__()
        self.heads, self.norm = heads, nn.RMSNorm(h)
        self.qkv, self.o, self.mlp = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False), _MLP(h, f)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, attn) -> torch.Tensor:
        B, S, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, S, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        o = attn(_rotary(q, pos), _rotary(k, pos), v)
        x = x + self.o(o.transpose(1, 2).reshape(B, S, h))
        return x + tiled_mlp(self.mlp, x, TILE)


class TinyLlama(nn.Module):
    def __init__(self, n_layers: int, hidden: int, n_heads: int, ffn_hidden: int, vocab: int, **_) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, n_heads, ffn_hidden) for _ in range(n_layers))
        self.norm, self.head = nn.RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def loss_sum(self, ids: torch.Tensor, labels: torch.Tensor, pos: torch.Tensor, attn):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x, pos, attn)
        return tiled_lm_loss(self.norm(x), self.head.weight, labels, chunk=TILE)


def _batch(S: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(S)
    ids = torch.randint(0, SHAPE["vocab"], (1, S), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)  # shifted before sharding
    return ids, labels


def _attention_fn(kind: str, cp: ContextParallel | None, shard, ds_layer=None):
    if cp is None:
        return lambda q, k, v: flash_attention(q, k, v, causal=True)
    if kind == "deepspeed":  # DeepSpeed's all-to-all around the same local attention; [s, b, h, d] layout

        def ds(q, k, v):
            t = [x.permute(2, 0, 1, 3).contiguous() for x in (q, k, v)]
            return ds_layer(*t, 1).permute(1, 2, 0, 3)  # batch_dim_idx=1

        return ds
    return lambda q, k, v: cp.attention(q, k, v, shard=shard)


def _step(model, opt, cp, S: int, kind: str = "llmpar", ds_layer=None) -> float:
    ids, labels = _batch(S)
    if cp is None:
        loss_sum, count = model.loss_sum(ids, labels, torch.arange(S), _attention_fn(kind, None, None))
        loss = loss_sum / count.clamp(min=1)
    else:
        shard = cp.shard(S, "cpu")
        pos = shard.index
        attn = _attention_fn(kind, cp, shard, ds_layer)
        loss_sum, count = model.loss_sum(
            shard_tensor(ids, shard), shard_tensor(labels, shard, pad_value=-100), pos, attn
        )
        loss = cp.token_mean(loss_sum, count, grad_factor=1.0)
    loss.backward()
    if cp is not None:  # the cp ranks' parts of the sample's gradient are summed
        for p in model.parameters():
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad(set_to_none=False)  # gradients are model states: kept allocated, in the base
    return float(loss.detach())


def _rank(rank: int, world: int, mode: str, lengths: list[int], port: int, queue, ds: bool) -> None:
    torch.set_num_threads(1 if world > 1 else 2)
    cp = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        g = dist.group.WORLD
        cp = ContextParallel(mode, ulysses_group=g) if mode == "ulysses" else ContextParallel(mode, ring_group=g)
    torch.manual_seed(0)
    model = TinyLlama(**SHAPE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # no whole-model temporaries
    _step(model, opt, cp, 16)  # AdamW states and gradients exist before the first measurement
    for S in lengths:
        gc.collect()
        if cp is not None:
            cp.ring_stats.reset()
            dist.barrier()
        base, _ = _rss()
        Path("/proc/self/clear_refs").write_text("5")
        t0 = time.perf_counter()
        loss = _step(model, opt, cp, S)
        dt = time.perf_counter() - t0
        peak = _rss()[1] - base
        exposed = cp.ring_stats.exposed_fraction() if cp is not None and mode == "ring" else None
        queue.put(dict(rank=rank, seq=S, peak=peak, step_s=dt, loss=loss, exposed=exposed))
    if ds and cp is not None and mode == "ulysses":
        try:
            import deepspeed
            from deepspeed.sequence.layer import DistributedAttention

            deepspeed.init_distributed(dist_backend="gloo")  # joins the process group already set up
        except Exception as exc:  # noqa: BLE001 - reported in the results instead
            for kind in ("llmpar", "deepspeed") * DS_PAIRS:
                queue.put(dict(rank=rank, seq=0, kind=kind, step_s=None, error=f"{type(exc).__name__}: {exc}"))
            DistributedAttention = None
    if ds and cp is not None and mode == "ulysses" and DistributedAttention is not None:
        local = lambda q, k, v, *a, **kw: flash_attention(  # noqa: E731  the local math llmpar's Ulysses runs
            q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), causal=True
        ).permute(2, 0, 1, 3)
        layer = DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=0)
        S = DS_SEQ
        for i, kind in enumerate(("llmpar", "deepspeed") * DS_PAIRS):
            dist.barrier()
            t0 = time.perf_counter()
            _step(model, opt, cp, S, kind=kind, ds_layer=layer)
            queue.put(dict(rank=rank, seq=S, kind=kind, i=i, step_s=time.perf_counter() - t0))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_config(world: int, mode: str, lengths: list[int], ds: bool = False) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + (os.getpid() + world * 7 + len(mode)) % 2000
    procs = [ctx.Process(target=_rank, args=(r, world, mode, lengths, port, queue, ds)) for r in range(world)]
    for p in procs:
        p.start()
    out, expected = [], world * (len(lengths) + (2 * DS_PAIRS if ds and world > 1 and mode == "ulysses" else 0))
    while len(out) < expected:
        try:
            out.append(queue.get(timeout=5))
        except queue_mod.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"a rank of sp={world} {mode} exited with {dead[0]} (its traceback is above)"
                ) from None
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a rank of sp={world} {mode} exited with {p.exitcode}")
    return out


def estimate(world: int, mode: str, S: int) -> float:
    """The planner's activation peak for this model, layout and length (fp32, the torch attention path)."""
    from llmpar.planning.context import activation_breakdown
    from llmpar.planning.memory import Layout
    from llmpar.planning.model_spec import ModelSpec

    spec = ModelSpec(
        n_layers=SHAPE["n_layers"],
        hidden=SHAPE["hidden"],
        n_heads=SHAPE["n_heads"],
        n_kv_heads=SHAPE["n_kv_heads"],
        vocab=SHAPE["vocab"],
        seq_len=S,
        ffn_hidden=SHAPE["ffn_hidden"],
        gated_mlp=True,
        tied_embeddings=False,
        learned_positions=False,
        norm="rmsnorm",
        bias=False,
    )
    lay = Layout(cp=world, cp_mode=mode if world > 1 else "ulysses", tiled=True, tile=TILE)
    return activation_breakdown(spec, lay, seq_len=S, act_bytes=4, q_chunk=Q_CHUNK).peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-mib", type=float, default=128.0, help="per-rank activation cap in MiB (default 128)")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter lengths")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's DistributedAttention timing")
    args = ap.parse_args()
    # the attention's torch path costs S^2 on 2 shared cores: each configuration runs the lengths around its cap
    configs = [
        (1, "plain", [1024, 1536, 1792, 2048]),
        (2, "ulysses", [2048, 3072, 3584, 4096]),
        (4, "ulysses", [4096, 6144, 7168, 8192]),
        (4, "ring", [4096, 6144, 7168, 8192]),
    ]
    if args.quick:
        configs = [(w, m, lengths[:1]) for w, m, lengths in configs]
    cap = args.cap_mib * 2**20
    rows, timing = [], []
    for world, mode, lengths in configs:
        t0 = time.time()
        res = run_config(world, mode, lengths, ds=not args.no_deepspeed and world == 2)
        print(f"sp={world} {mode}: {time.time() - t0:.0f} s", flush=True)
        for S in lengths:
            at = [r for r in res if r["seq"] == S and "kind" not in r]
            peak = max(r["peak"] for r in at)
            est = estimate(world, "ulysses" if mode == "plain" else mode, S)
            ex = [r["exposed"] for r in at if r["exposed"] is not None]
            rows.append(
                dict(
                    config=f"sp={world} {mode}" if world > 1 else "plain",
                    sp=world,
                    mode=mode,
                    seq=S,
                    peak_mib=round(peak / 2**20, 1),
                    estimate_mib=round(est / 2**20, 1),
                    measured_over_estimate=round(peak / est, 3),
                    fits_cap=peak <= cap,
                    step_s=round(max(r["step_s"] for r in at), 2),
                    ring_exposed=round(max(ex), 3) if ex else None,
                )
            )
        timing += [r for r in res if "kind" in r]
    longest = {}
    for r in rows:
        if r["fits_cap"]:
            longest[r["config"]] = max(longest.get(r["config"], 0), r["seq"])
    plain = longest.get("plain")
    summary = {c: f"{s} ({s / plain:.2f}x plain)" if plain else str(s) for c, s in longest.items()}
    # between the two lengths around the cap, peak is ~linear in the sequence: where the line meets the cap
    reach = {}
    for c in dict.fromkeys(r["config"] for r in rows):
        pts = [(r["seq"], r["peak_mib"]) for r in rows if r["config"] == c]
        below = [p for p in pts if p[1] <= args.cap_mib]
        above = [p for p in pts if p[1] > args.cap_mib]
        if below and above:
            (s0, m0), (s1, m1) = max(below), min(above)
            reach[c] = s0 + (s1 - s0) * (args.cap_mib - m0) / (m1 - m0)
    if "plain" in reach:
        summary_i = {c: f"{v:.0f} ({v / reach['plain']:.2f}x plain)" for c, v in reach.items()}
    else:
        summary_i = {c: f"{v:.0f}" for c, v in reach.items()}
    meta = {
        "model": f"{SHAPE}, SwiGLU, rotary, fp32, tiled loss + MLP ({TILE} tokens)",
        "memory": "peak RSS - RSS before the step, fresh process per rank, MALLOC_MMAP_THRESHOLD_=65536, "
        "max over ranks",
        "cap": f"{args.cap_mib} MiB per rank",
        "longest length tried under the cap": summary,
        "where the measured peak crosses the cap (linear between the lengths around it)": summary_i,
        "estimate": "llmpar.planning.context.activation_breakdown (fp32, torch attention path)",
        "shape": dict(SHAPE),
        "tile": TILE,
        "q_chunk": Q_CHUNK,
    }
    ring_rows = [r for r in rows if r["mode"] == "ring"]
    if ring_rows:
        meta["ring exposed communication at the longest length"] = ring_rows[-1]["ring_exposed"]
    errors = [t["error"] for t in timing if t.get("error")]
    if errors:
        meta["ulysses step time vs DeepSpeed"] = f"not run: {errors[0]}"
    elif timing:
        steps: dict[tuple[str, int], float] = {}  # (kind, i) -> the slowest rank's seconds
        for t in timing:
            steps[t["kind"], t["i"]] = max(steps.get((t["kind"], t["i"]), 0.0), t["step_s"])
        m = {
            k: sorted(v for (kind, _), v in steps.items() if kind == k)[DS_PAIRS // 2] for k in ("llmpar", "deepspeed")
        }
        meta["ulysses step time (sp=2, seq %d)" % timing[0]["seq"]] = (
            f"llmpar {m['llmpar']:.2f} s, DeepSpeed DistributedAttention {m['deepspeed']:.2f} s "
            f"(DeepSpeed / llmpar {m['deepspeed'] / m['llmpar']:.2f}; median of {DS_PAIRS} alternating steps, "
            "slowest rank)"
        )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import write_results

    paths = write_results(
        "long_context_cpu",
        rows,
        meta,
        curve={
            "x": "seq",
            "y": ["peak_mib", "estimate_mib"],
            "group": "config",
            "logx": True,
            "title": f"per-rank activation peak vs sequence (cap {args.cap_mib} MiB)",
        },
    )
    print(f"longest under {args.cap_mib} MiB: {summary}; crossing: {summary_i}")
    print("\n".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
