"""Cutting a sequence of block costs into contiguous stages.

``balanced_boundaries(costs, k)`` minimises the largest stage cost ``max_s sum_{i in stage s} costs[i]`` over all
ways to cut ``n = len(costs)`` blocks into ``k`` non-empty contiguous stages (exact dynamic programme, O(k n^2)).
Boundaries are the index of the first block of stages 1..k-1: ``[3, 7]`` means stages 0-2, 3-6, 7-(n-1).

DeepSpeed's two partitioners, for ``PipelineModule`` (``specs.py``), return its ``parts`` instead: the ``k + 1`` stage
edges ``[0, b_1, ..., b_{k-1}, n]`` (stage s holds items ``parts[s]:parts[s + 1]``), with DeepSpeed's exact results:

* ``partition_uniform(n, k)``: ``n // k`` items each, the first ``n % k`` stages one more; with ``n <= k`` one item
  per stage and empty stages at the end;
* ``partition_balanced(w, k)``: minimises ``max_s W_s - min_s W_s`` (``W_s`` the stage's summed weight), not the
  largest stage alone; of equal costs the last candidate cut wins (so zero-weight items join the stage before a cut).
"""

from __future__ import annotations

from typing import Sequence


def check_boundaries(boundaries: Sequence[int], n_blocks: int, n_stages: int) -> list[int]:
    """Validate explicit boundaries (first block of each stage after the first); returns them as a list."""
    b = list(boundaries)
    if len(b) != n_stages - 1:
        raise ValueError(
            f"boundaries={b} must list {n_stages - 1} block indices (where stages 1..{n_stages - 1} "
            f"start) for {n_stages} stages"
        )
    for x in b:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"boundaries={b} must hold ints, got {type(x).__name__}")
    if any(not 0 < x < n_blocks for x in b) or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(
            f"boundaries={b} must be strictly increasing block indices in [1, {n_blocks - 1}] "
            f"(the model has {n_blocks} blocks)"
        )
    return b


def stage_ranges(boundaries: Sequence[int], n_blocks: int) -> list[range]:
    edges = [0, *boundaries, n_blocks]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def balanced_boundaries(costs: Sequence[float], n_stages: int) -> list[int]:
    """Boundaries minimising the most expensive stage (ties: the earliest cut)."""
    n = len(costs)
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages} must be >= 1")
    if n < n_stages:
        raise ValueError(f"cannot cut {n} blocks into {n_stages} non-empty stages")
    if any(c < 0 for c in costs):
        raise ValueError("block costs must be >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-stage cost of cutting blocks [0, i) into k stages; cut[k][i]: start of the last stage
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for s in range(k - 1, i):
                value = max(best[k - 1][s], prefix[i] - prefix[s])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, s
    bounds, i = [], n
    for k in range(n_stages, 1, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's uniform ``parts`` (module docstring)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's balanced ``parts`` (module docstring): the linear-partition dynamic programme over the cost
    ``max - min`` of the stage weights, ``O(k n^2)``, the same float64 sums and tie rule as DeepSpeed."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # for the first i items in j stages: the chosen (largest, smallest) stage weight, its cost, the last stage's start
    hi = [[inf] * (m + 1) for _ in range(n + 1)]
    lo = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    start = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                last = prefix[i] - prefix[k]
                top, bottom = max(hi[k][j - 1], last), min(lo[k][j - 1], last)
                c = top - bottom
                if cost[i][j] >= c:  # ``>=``, as DeepSpeed: the latest candidate of equal cost wins
                    cost[i][j], hi[i][j], lo[i][j], start[i][j] = c, top, bottom, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(start[parts[-1]][j])
    return parts[::-1]


__all__ = ["balanced_boundaries", "check_boundaries", "partition_balanced", "partition_uniform", "stage_ranges"]
