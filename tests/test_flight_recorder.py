"""The flight recorder: every rank keeps its last collectives, and a collective that times out fails on every rank
with the rank that ran an extra collective, or the one that stopped, named with what it was doing.

Two scenarios in one 2-rank run, each on fresh gloo groups with a 2 s timeout: rank 1 runs an extra all-reduce (both
ranks then time out: rank 1 in the all-reduce rank 0 already paired with the extra one, rank 0 in another group that
rank 1 never reaches), and rank 1 skips an all-reduce (rank 0 times out; rank 1 publishes nothing). The extra
all-reduce goes through ``llmpar.comm`` (the ``deepspeed.comm`` drop-in), recorded like llmpar's own collectives."""

from __future__ import annotations

import datetime
import inspect
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks

TIMEOUT = datetime.timedelta(seconds=2)


def _line(marker: str) -> int:
    """The line of this file holding ``marker`` in a comment (the call site the recorder must name)."""
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}"))


def _flight_body(folder: str) -> dict:
    from llmpar.distributed import CollectiveError, all_reduce
    from llmpar.distributed.flight import RECORDER

    os.environ.update(LLMPAR_FLIGHT_DIR=folder, LLMPAR_FLIGHT_WAIT_S="1")
    RECORDER.configure(64)
    RECORDER.step = 7
    rank = dist.get_rank()
    g, h, g2 = (dist.new_group(timeout=TIMEOUT) for _ in range(3))
    x = torch.randn(5, generator=torch.Generator().manual_seed(rank))
    out: dict = {}
    from llmpar.distributed import all_to_all_single

    got = torch.empty(10)
    all_to_all_single(got, torch.arange(10.0) + 100 * rank, dist.group.WORLD, what="the all-to-all")  # recorded too
    from llmpar import comm

    comm.all_reduce(x.clone(), async_op=True).wait()  # deepspeed.comm's, asynchronous: done once waited for  # ASYNC
    dist.barrier()  # on the world (long timeout): the ranks start each scenario together, well inside the 2 s
    # 1. rank 1 runs one all-reduce more on g
    start = time.monotonic()
    try:
        all_reduce(x, g, what="the first all-reduce")
        if rank == 1:
            comm.all_reduce(x, group=g)  # EXTRA
        all_reduce(x, g, what="the common all-reduce")  # COMMON
        if rank == 0:
            all_reduce(x, h, what="the all-reduce on h")
    except CollectiveError as err:
        out["extra"] = (str(err), time.monotonic() - start)
    with open(os.path.join(folder, f"rank{rank}.json")) as f:
        out["record"] = json.load(f)
    # 2. rank 1 skips an all-reduce of g2 (as a rank stuck in its data loader would)
    dist.barrier()
    start = time.monotonic()
    all_reduce(x, g2, what="the last agreed all-reduce")  # AGREED
    if rank == 0:
        try:
            all_reduce(x, g2, what="the all-reduce rank 1 skips")
        except CollectiveError as err:
            out["stopped"] = (str(err), time.monotonic() - start)
    return out


def test_a_timeout_names_the_rank_with_an_extra_collective_and_the_stopped_rank(tmp_path):
    res = run_ranks(_flight_body, 2, str(tmp_path), timeout=90)
    site = f"test_flight_recorder.py:{_line('EXTRA')}"
    for rank, out in enumerate(res):
        message, seconds = out["extra"]
        assert "did not take part within the collective timeout" in message, message
        # the extra all-reduce, by rank, description, call site and engine step, in every rank's error
        assert f"global rank 1 ran #2 all-reduce of 5 elements (float32) at {site}, step 7" in message, message
        assert (
            f"global rank 0 ran #2 the common all-reduce (float32) at test_flight_recorder.py:{_line('COMMON')}"
            in message
        ), message
        other = 1 - rank
        assert f"global rank {other} is {'ahead' if other == 1 else 'behind'} on group" in message, message
        assert f"global rank {other} failed in" in message, message
        assert f"records in {tmp_path}" in message, message
        assert seconds < 15, seconds
        record = out["record"]
        assert record["rank"] == rank and record["failed"]["state"] == "failed"
        whats = [e["what"] for e in record["entries"]]
        assert whats.count("all-reduce of 5 elements") == 1 + (rank == 1), whats  # the async one; rank 1's extra
        a2a = next(e for e in record["entries"] if e["op"] == "all_to_all")  # then llmpar.comm's on the world
        assert [
            (e["op"], e["state"], os.path.basename(e["site"]))
            for e in record["entries"]
            if e["group"] == a2a["group"] and e["seq"] == a2a["seq"] + 1
        ] == [("all_reduce", "done", f"test_flight_recorder.py:{_line('ASYNC')}")], record["entries"]
        assert [(e["what"], e["numel"], e["state"]) for e in record["entries"] if e["op"] == "all_to_all"] == [
            ("the all-to-all", 10, "done")
        ], record["entries"]
        assert all(
            e["step"] == 7 and e["dtype"] == "float32" and e["numel"] == 5
            for e in record["entries"]
            if e["op"] != "all_to_all"
        )
    assert (tmp_path / "rank0.json").exists() and (tmp_path / "rank1.json").exists()
    message, seconds = res[0]["stopped"]
    # rank 1's record from scenario 1 is older than the all-reduce it completed since: stale, not read as its answer
    assert "global rank 1 sent no flight record within 1s" in message, message
    assert "it has not joined #2 the all-reduce rank 1 skips (float32)" in message, message
    assert (
        f"its last collective there, completed with this rank: #1 the last agreed all-reduce (float32) at "
        f"test_flight_recorder.py:{_line('AGREED')}, step 7, done"
    ) in message, message
    assert seconds < 15, seconds
    assert "stopped" not in res[1]


def _summary(rank: int, groups: dict, failed: dict | None = None) -> dict:
    return {"rank": rank, "at": 0.0, "step": 0, "failed": failed, "groups": groups}


def _entry(seq: int, what: str, site: str, state: str = "done", numel: int = 5) -> dict:
    return {
        "seq": seq,
        "op": "all_reduce",
        "group": "g",
        "ranks": [0, 1, 2],
        "numel": numel,
        "dtype": "float32",
        "what": what,
        "step": 3,
        "site": site,
        "t0": 0.0,
        "t1": 0.0,
        "state": state,
    }


def test_diagnose_compares_records_without_ranks():
    from llmpar.distributed.flight import diagnose

    a = _entry(1, "grads", "/x/train.py:10")
    mine = _summary(
        0,
        {"g": {"ranks": [0, 1, 2], "seq": 2, "last": [a, _entry(2, "loss", "/x/train.py:12", "failed")]}},
        failed=_entry(2, "loss", "/x/train.py:12", "failed"),
    )
    other = _summary(
        1, {"g": {"ranks": [0, 1, 2], "seq": 2, "last": [a, _entry(2, "loss", "/x/train.py:12", "started", numel=9)]}}
    )
    lines = diagnose(mine, {1: other, 2: None}, 1.5)
    assert lines[0] == (
        "collective #2 on group g [0, 1, 2] differs: global rank 1 ran #2 loss (float32) at "
        "train.py:12, step 3, started; global rank 0 ran #2 loss (float32) at train.py:12, step 3, "
        "failed"
    )
    assert lines[1].startswith("global rank 2 sent no flight record within 1.5s")
    assert "its last collective there, completed with this rank: #1 grads (float32) at train.py:10" in lines[1]
    assert len(lines) == 2  # same counts: neither behind nor ahead


@pytest.mark.parametrize("value", ["-1", "ten", "2.5"])
def test_bad_recorder_size_names_the_variable(value):
    from llmpar.distributed.flight import env_size

    with pytest.raises(ValueError, match=f"LLMPAR_FLIGHT_RECORDER='{value}' must be a non-negative integer"):
        env_size({"LLMPAR_FLIGHT_RECORDER": value})
    assert env_size({"LLMPAR_FLIGHT_RECORDER": "0"}) == 0 and env_size({}) == 256


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_bad_wait_names_the_variable(value):
    from llmpar.distributed.flight import env_wait_s

    with pytest.raises(ValueError, match=f"LLMPAR_FLIGHT_WAIT_S='{value}' must be a finite number"):
        env_wait_s({"LLMPAR_FLIGHT_WAIT_S": value})


def test_off_records_nothing():
    from llmpar.distributed.flight import FlightRecorder

    recorder = FlightRecorder(0)
    assert recorder.start(None, "all_reduce", torch.ones(3), "x") is None and not recorder.entries
    with pytest.raises(ValueError, match="size=-2 must be an int >= 0"):
        FlightRecorder(-2)
