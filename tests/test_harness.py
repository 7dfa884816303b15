"""The multi-rank harness itself: results come back per rank, errors carry the failing rank's traceback, a hang
becomes a failure naming the stuck rank within its timeout, and ranks are reused between tests."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from multirank import RankFailure, RankTimeout, multirank, run_ranks


def _whoami(tag):
    return (tag, dist.get_rank(), dist.get_world_size(), int(os.environ["RANK"]), os.getpid())


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_results_come_back_in_rank_order(world_size):
    out = run_ranks(_whoami, world_size, "x")
    assert [o[:4] for o in out] == [("x", r, world_size, r) for r in range(world_size)]
    assert len({o[4] for o in out}) == world_size  # distinct processes


def test_ranks_are_reused_between_tests():
    first = [o[4] for o in run_ranks(_whoami, 2, "a")]
    second = [o[4] for o in run_ranks(_whoami, 2, "b")]
    assert first == second


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    return dist.get_rank()


def test_error_reports_failing_rank_traceback():
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_one, 2, timeout=30)
    msg = str(info.value)
    assert "rank(s) [1]" in msg and "ValueError: rank one is unhappy" in msg and "_raise_on_rank_one" in msg


def _error_then_collective():
    # rank 0 raises before the all-reduce that rank 1 waits in: must fail fast, not wait for the timeout
    if dist.get_rank() == 0:
        raise RuntimeError("rank zero fails before the collective")
    dist.all_reduce(torch.ones(1))


def test_error_while_others_block_fails_fast():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_error_then_collective, 2, timeout=60)
    assert time.monotonic() - t0 < 30
    assert "rank zero fails before the collective" in str(info.value)


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(3600)  # a deliberate hang
    return "done"


def test_hanging_rank_fails_within_timeout_naming_it():
    run_ranks(_whoami, 2, "before")  # a started pool with this module imported: the timeout below is the body's only
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_hang_on_rank_one, 2, timeout=2.5)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 20, elapsed
    assert "rank(s) [1] still running" in msg and "rank(s) [0] finished" in msg
    assert "_hang_on_rank_one" in msg  # the stuck rank's stack, dumped by faulthandler
    # the next test gets a fresh, working pool
    assert run_ranks(_whoami, 2, "after")[1][:2] == ("after", 1)


def _collective_hang():
    if dist.get_rank() == 0:
        dist.recv(torch.empty(1), src=1)  # rank 1 never sends
    return "ok"


def test_collective_hang_fails_within_timeout():
    run_ranks(_whoami, 2, "before")  # as above: rank 1 returns within the short timeout even on a busy machine
    with pytest.raises(RankTimeout, match=r"rank\(s\) \[0\] still running"):
        run_ranks(_collective_hang, 2, timeout=2.5)


@multirank(2, 4)
def test_decorated_body_sees_its_world():
    assert dist.get_world_size() in (2, 4)
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    n = dist.get_world_size()
    assert t.item() == n * (n - 1) / 2


def test_lambda_body_is_rejected():
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(lambda: None, 1)


def test_cleanup_reply_ahead_of_a_slower_result_is_kept():
    """A fast rank's cleanup reply can reach the parent while a slower rank's large result is still in the pipe: the
    cleanup collect must count it (dropping it cost the collect its whole timeout, then the pool). Replies fed in that
    order to a pool's collect, as run() makes them: the task's, then the cleanup's, which has both ranks at once."""
    import queue

    import multirank

    pool = multirank._Pool.__new__(multirank._Pool)
    pool.world_size, pool.procs, pool.task_id, pool.early, pool.alive = 2, [], 7, [], True
    pool.results = queue.Queue()
    for reply in (
        (7, 1, "ok", "small"),
        (("cleanup", 7), 1, "ok", False),
        (6, 0, "ok", "stale"),
        (7, 0, "ok", "large"),
        (("cleanup", 7), 0, "ok", False),
    ):
        pool.results.put(reply)
    assert pool._collect(7, 5.0, "body") == {0: ("ok", "large"), 1: ("ok", "small")}
    start = time.monotonic()
    assert pool._collect(("cleanup", 7), 5.0, "body cleanup") == {0: ("ok", False), 1: ("ok", False)}
    assert time.monotonic() - start < 1.0 and pool.early == []
