"""Benchmark: the expert-parallel MoE layer at ep=2 on CPU / gloo, forward + backward: how much of the step the
all-to-all leaves exposed, and tokens/s under balanced and skewed routing.

    python bench/bench_moe_ep.py                              # spawns 2 gloo ranks: the committed figures
    torchrun --nproc_per_node 2 bench/bench_moe_ep.py --tokens 4096
    python bench/bench_moe_ep.py --tokens 64 --hidden 32 --intermediate 16 --repeats 2 --no-write   # smoke run

The layer is :class:`llmpar.moe.MoEBlock` with Qwen3-MoE-like shapes (H 512, I 192, 16 experts, top-2, route_norm),
2048 tokens per rank, 8 experts per rank. Timed: ``out = block(x); out.backward(g)`` (input gradient included), one
thread per rank; ranks meet at a barrier before each timed call, repeats of the cases interleaved (the starting case
rotated each round), a repeat's time is the max over ranks, the figures are medians over repeats.

1. Exposed all-to-all, measured two ways in the same run:

   * timestamps: during the timed steps the dispatcher's exchanges are wrapped with ``perf_counter`` around every
     point where the rank waits for communication: the count exchange, the ``wait()`` of the asynchronous token
     dispatch (the shared experts run before it), the synchronous combine exchange and the two backward exchanges.
     ``exposed = sum of those waits`` on each rank; ``exposed_frac = exposed / step`` per rank and repeat, the median
     over repeats, the larger of the two ranks reported. Time an exchange spends while the rank computes (the
     dispatch in flight behind the shared experts) is not counted: it is hidden.
   * stand-in: the same step with the token exchanges replaced by a local copy of the same shapes (no
     communication; the count exchange, which fixes the shapes, stays real): ``standin_frac = (step - step_standin) /
     step``, the layer's time that the token exchange adds (``standin_frac_of_mins``: the same from the fastest
     repeats, the least disturbed on a shared machine).

   Both with no shared expert (Qwen3-MoE) and with a shared expert of width ``--shared`` (Qwen2-MoE / DeepSeek style,
   overlapped with the dispatch). Goal (issue 44): exposed all-to-all <= 30% of the layer at ep=2.

2. Imbalance: the ep=2 layer's tokens/s (both ranks' tokens / the step's median) under three routings, forced by
   replacing the router's top-k choice (``llmpar.moe.router.route``) for the timed steps: the router still computes
   its logits and softmax and the weights stay differentiable, only the chosen experts are fixed:

   * ``uniform``: slot (t, j) takes expert (t k + j) mod E (``RouterConfig(force_balance=True)``'s round robin);
   * ``zipf``: each token draws its k distinct experts with probability ~ 1 / rank^1.2 (expert 0 the most popular,
     so rank 0's experts are the busy ones), a fixed sample per rank;
   * ``one_hot``: every token's first choice is expert 0 (its second, top-k needing distinct experts, expert 1):
     every slot lands on rank 0.

   ``max_over_mean`` = max / mean tokens per expert over the 16 experts (both ranks' tokens), ``rank_load`` = the
   share of slots each rank's experts receive. Their ``exposed_frac`` (timestamps as in 1.) then also holds the
   time the lightly loaded rank waits in the exchanges for the busy one: the cost of the imbalance, not of the wire.

Results: bench/results/moe_ep_cpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llmpar.moe.alltoall as a2a  # noqa: E402
import llmpar.moe.router as router_mod  # noqa: E402
from llmpar.moe import MoEBlock, RouterConfig  # noqa: E402

from harness import markdown_table, write_results  # noqa: E402

_REAL_EXCHANGE = a2a.all_to_all_uneven
_REAL_COUNTS = a2a.AllToAllDispatcher._exchange_counts
_REAL_ROUTE = router_mod.route


class _Clock:
    """Seconds this rank spent waiting on the dispatcher's exchanges since the last reset."""

    waited = 0.0
    standin = False


class _TimedHandle:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def wait(self) -> None:
        t0 = time.perf_counter()
        if self.handle is not None:
            self.handle.wait()
        _Clock.waited += time.perf_counter() - t0


def _local_exchange(output: torch.Tensor, input: torch.Tensor) -> None:
    """The stand-in: rows copied locally into the output of the shape the real exchange fills (no communication)."""
    n = min(output.shape[0], input.shape[0])
    output[:n].copy_(input[:n])
    output[n:].zero_()


def _exchange(output, input, output_splits, input_splits, group, *, async_op=False, what=None):  # type: ignore[no-untyped-def]
    if _Clock.standin:
        _local_exchange(output, input)
        return _TimedHandle(None) if async_op else None
    if async_op:
        return _TimedHandle(_REAL_EXCHANGE(output, input, output_splits, input_splits, group, async_op=True, what=what))
    t0 = time.perf_counter()
    _REAL_EXCHANGE(output, input, output_splits, input_splits, group, what=what)
    _Clock.waited += time.perf_counter() - t0
    return None


def _counts(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    try:
        return _REAL_COUNTS(self, *args, **kwargs)
    finally:
        _Clock.waited += time.perf_counter() - t0


class _Forced:
    """Replacement for :func:`llmpar.moe.router.route` returning fixed expert ids (None: the real routing)."""

    idx: torch.Tensor | None = None

    @staticmethod
    def route(logits: torch.Tensor, top_k: int, config: RouterConfig, expert_bias: Any = None) -> Any:
        if _Forced.idx is None:
            return _REAL_ROUTE(logits, top_k, config, expert_bias)
        s = torch.softmax(logits, dim=-1)
        idx = _Forced.idx
        w = s.gather(1, idx)
        if config.route_norm:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w, s


def routings(tokens: int, experts: int, top_k: int, rank: int) -> dict[str, torch.Tensor]:
    """``[tokens, top_k]`` expert ids for the uniform, Zipf(1.2) and one-hot routings (see the module docstring)."""
    uniform = (torch.arange(tokens * top_k) % experts).view(tokens, top_k)
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
    gen = torch.Generator().manual_seed(100 + rank)
    zipf = torch.multinomial(p.expand(tokens, experts), top_k, replacement=False, generator=gen)
    one_hot = torch.arange(top_k).expand(tokens, top_k).contiguous()
    return {"uniform": uniform, "zipf": zipf, "one_hot": one_hot}


def _timed(cases: dict[str, Callable[[], None]], repeats: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Per case: ``step`` (max over ranks) and ``frac`` (exposed / step, max over ranks) per repeat."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    names = list(cases)
    local: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            dist.barrier()
            _Clock.waited = 0.0
            t0 = time.perf_counter()
            cases[name]()
            step = time.perf_counter() - t0
            local[name].append((step, _Clock.waited / step))
    out = {}
    for name in names:
        mine = torch.tensor(local[name], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        both = torch.stack(every)  # [ranks, repeats, 2]
        out[name] = {"step": both[..., 0].amax(0).tolist(), "frac": both[..., 1].amax(0).tolist()}
    return out


def _step(block: MoEBlock, x: torch.Tensor, g: torch.Tensor, standin: bool = False, idx: Any = None):
    def run() -> None:
        _Clock.standin, _Forced.idx = standin, idx
        try:
            x.grad = None
            block.zero_grad(set_to_none=True)
            block(x).backward(g)
        finally:
            _Clock.standin, _Forced.idx = False, None

    return run


def _block(args: argparse.Namespace, shared: int) -> MoEBlock:
    torch.manual_seed(0)  # the same weights on both ranks (each keeps its 8 experts)
    return MoEBlock(
        args.hidden,
        args.intermediate,
        args.experts,
        args.top_k,
        ep_group=dist.group.WORLD,
        router=RouterConfig(route_norm=True),
        shared_intermediate_size=shared,
        init_std=0.05,
    )


def _measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).requires_grad_()
    g = torch.randn(args.tokens, args.hidden, generator=gen)
    plain, shared = _block(args, 0), _block(args, args.shared)
    cases = {
        "no shared expert": _step(plain, x, g),
        "no shared expert, stand-in": _step(plain, x, g, standin=True),
        f"shared expert {args.shared}": _step(shared, x, g),
        f"shared expert {args.shared}, stand-in": _step(shared, x, g, standin=True),
    }
    t = _timed(cases, args.repeats, args.warmup)
    rows = []
    for name in (n for n in cases if not n.endswith("stand-in")):
        step = statistics.median(t[name]["step"])
        standin = statistics.median(t[f"{name}, stand-in"]["step"])
        rows.append(
            {
                "part": "exposed all-to-all",
                "case": name,
                "routing": "router",
                "step_ms": step * 1e3,
                "step_standin_ms": standin * 1e3,
                "exposed_frac": statistics.median(t[name]["frac"]),
                "standin_frac": (step - standin) / step,
                "standin_frac_of_mins": 1 - min(t[f"{name}, stand-in"]["step"]) / min(t[name]["step"]),
                "tokens_per_s": world * args.tokens / step,
            }
        )
    forced = routings(args.tokens, args.experts, args.top_k, rank)
    cases = {name: _step(plain, x, g, idx=idx) for name, idx in forced.items()}
    t = _timed(cases, args.repeats, args.warmup)
    for name, idx in forced.items():
        counts = torch.bincount(idx.reshape(-1), minlength=args.experts).to(torch.float64)
        dist.all_reduce(counts)
        per_rank = counts.view(world, -1).sum(1) / counts.sum()
        step = statistics.median(t[name]["step"])
        rows.append(
            {
                "part": "imbalance",
                "case": "no shared expert",
                "routing": name,
                "step_ms": step * 1e3,
                "exposed_frac": statistics.median(t[name]["frac"]),
                "tokens_per_s": world * args.tokens / step,
                "tokens_per_s_best": world * args.tokens / min(t[name]["step"]),
                "max_over_mean": float(counts.max() / counts.mean()),
                "rank_load": " / ".join(f"{v:.2f}" for v in per_rank.tolist()),
            }
        )
    return rows


def _run(args: argparse.Namespace, spawned: bool = False) -> None:
    dist.init_process_group("gloo")
    if spawned:  # started by ``python``, not torchrun: record that command in the results
        os.environ.pop("WORLD_SIZE")
    torch.set_num_threads(args.threads)
    a2a.all_to_all_uneven = _exchange  # type: ignore[assignment]
    a2a.AllToAllDispatcher._exchange_counts = _counts  # type: ignore[method-assign]
    router_mod.route = _Forced.route  # type: ignore[assignment]
    try:
        rows = _measure(args)
    finally:
        a2a.all_to_all_uneven = _REAL_EXCHANGE
        a2a.AllToAllDispatcher._exchange_counts = _REAL_COUNTS  # type: ignore[method-assign]
        router_mod.route = _REAL_ROUTE
    if dist.get_rank() == 0:
        print(markdown_table(rows))
        if not args.no_write:
            meta = {
                "ep": dist.get_world_size(),
                "backend": "gloo",
                "what": "MoEBlock forward + backward at ep=2, Qwen3-MoE-like shapes",
                "hidden": args.hidden,
                "intermediate": args.intermediate,
                "experts": args.experts,
                "top_k": args.top_k,
                "tokens_per_rank": args.tokens,
                "shared": args.shared,
                "threads_per_rank": args.threads,
                "repeats": args.repeats,
                "goal": "exposed all-to-all <= 30% of the layer at ep=2; tokens/s under uniform, Zipf, one-hot",
            }
            paths = write_results("moe_ep_cpu", rows, meta)
            print("wrote", ", ".join(str(p) for p in paths.values()))
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    _run(args, spawned=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=192)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--shared", type=int, default=768, help="width of the shared expert in the overlap case")
    p.add_argument("--ranks", type=int, default=2, help="ranks spawned when not under torchrun")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if "RANK" in os.environ:
        _run(args)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.ranks, port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
