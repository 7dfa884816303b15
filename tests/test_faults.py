"""Faults between ranks fail every surviving rank with llmpar's context, within the collective timeout, instead of a
bare gloo error or a half-hour hang: a rank that dies, a rank that stops, ranks whose step counts differ.

These run real processes outside the pooled harness (a dead rank must not take the pool down): ``_spawn`` starts
``world`` fresh processes (from the forkserver) joined with a short ``LLMPAR_TIMEOUT_S`` and collects what each returns
or raises."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

from multirank import free_port

TIMEOUT_S = 4.0


def _worker(rank: int, world: int, port: int, body: str, args: tuple, out) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LLMPAR_TIMEOUT_S=str(TIMEOUT_S),
        OMP_NUM_THREADS="1",
    )
    t0 = time.perf_counter()
    try:
        value = globals()[body](rank, *args)
        out.put((rank, "ok", value, time.perf_counter() - t0))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        out.put((rank, type(err).__name__, f"{err}\n{traceback.format_exc()}", time.perf_counter() - t0))
    finally:
        out.close()
        out.join_thread()
    os._exit(0)  # skip gloo's teardown of a broken group


def _spawn(
    body: str, world: int, *args, wait_s: float = 90.0, wait_for: tuple[int, ...] | None = None
) -> dict[int, tuple]:
    """Run ``body(rank, *args)`` on ``world`` fresh ranks; {rank: (status, value or message, seconds)} of those that
    reported. ``wait_for``: the ranks whose reports the test reads (default all); once they are in, the others are
    killed instead of waited for (a rank stuck on purpose, whose own outcome the test does not check)."""
    wanted = set(range(world) if wait_for is None else wait_for)
    # fresh processes from the forkserver (the rank pools of tests/multirank.py start it with torch imported): the
    # ranks share nothing with this process, and do not each spend seconds importing torch
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])  # as multirank's, if this is the first to start it
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, body, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + wait_s
    while not wanted <= set(results) and time.monotonic() < deadline:
        try:
            rank, status, value, seconds = out.get(timeout=1.0)
            results[rank] = (status, value, seconds)
        except Exception:  # noqa: BLE001 - queue.Empty: a rank that exits without reporting (died on purpose)
            if all(not p.is_alive() for p in procs):
                break
    for r, p in enumerate(procs):
        p.join(timeout=5 if r in wanted else 0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    return results


def _engine(stage: int = 2):
    import llmpar

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 17))
    engine, _, _, _ = llmpar.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 10**6,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 700},
        },
    )
    return engine


def _train(engine, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 33, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def dies_body(rank: int, stage: int):
    engine = _engine(stage)
    _train(engine, 2)
    if rank == 1:
        os._exit(17)  # the rank dies between two steps
    _train(engine, 1)


def stops_body(rank: int):
    engine = _engine(2)
    _train(engine, 1)
    if rank == 1:
        time.sleep(3 * TIMEOUT_S)  # stuck (a hung data loader), then it comes back too late
    _train(engine, 1)


def uneven_body(rank: int, tmpdir: str):
    engine = _engine(2)
    _train(engine, 3 if rank == 0 else 2)  # rank 1 one step short, then both save
    engine.save_checkpoint(tmpdir)


def _check_survivor(res: tuple, *must: str) -> float:
    status, message, seconds = res
    assert status == "CollectiveError", (status, message[-2000:])
    for text in must:
        assert text in message, (text, message[:2000])
    return seconds


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_that_dies_fails_the_others_with_context(stage):
    res = _spawn("dies_body", 2, stage)
    assert 1 not in res  # it died without reporting
    seconds = _check_survivor(res[0], "peer rank is gone", "engine.", "at optimizer step 2", "global rank 0")
    assert seconds < 60


def test_a_stopped_rank_fails_the_others_within_the_timeout():
    res = _spawn("stops_body", 2, wait_for=(0,))  # rank 1 sleeps 3 timeouts: its late return is not waited for
    seconds = _check_survivor(
        res[0],
        "did not take part within the collective timeout",
        "reduce-scatter of gradients, buffer 0 unit",
        "engine.backward() at optimizer step 1",
    )
    assert seconds < 20 * TIMEOUT_S


def test_uneven_step_counts_then_a_save_fail_instead_of_hanging(tmp_path):
    res = _spawn("uneven_body", 2, str(tmp_path))
    assert set(res) == {0, 1}
    failed = [r for r, (status, _, _) in res.items() if status != "ok"]
    assert failed, "uneven step counts and a save should not both succeed"
    for r in failed:
        status, message, seconds = res[r]
        assert status in ("CollectiveError", "CheckpointError"), (r, status, message[-2000:])
        assert "llmpar" in message or "checkpoint" in message
        assert seconds < 30 * TIMEOUT_S


def test_the_group_init_distributed_made_is_torn_down_at_exit(tmp_path):
    """Left to the interpreter's teardown, gloo aborted 2 of 10 runs of a plain ZeRO-2 script at exit ('terminate
    called without an active exception'); the group llmpar made is destroyed by an exit handler first."""
    import subprocess
    import sys

    script = tmp_path / "exit_check.py"
    script.write_text(
        "import atexit, torch, torch.distributed as dist\n"
        "atexit.register(lambda: print('torn down' if not dist.is_initialized() else 'still up', flush=True))\n"
        "import llmpar\n"
        "m = torch.nn.Linear(4, 4)\n"
        "e, *_ = llmpar.initialize(model=m, config={'train_micro_batch_size_per_gpu': 2,"
        " 'zero_optimization': {'stage': 2}})\n"
        "e.backward(e(torch.randn(2, 4)).pow(2).mean()); e.step()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "torn down", out.stdout
