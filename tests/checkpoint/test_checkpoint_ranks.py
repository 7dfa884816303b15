"""Checkpoint reliability across ranks (issue #15) on CPU/gloo: ranks that would load or save different tags fail
on every rank naming each rank's choice; a 2-layer checkpoint into a 1-layer model (and back) is an error naming the
params on every rank, ``strict=False`` loads what matches; a re-save of a tag that fails between its renames rolls
back; an async save pending when the engine is collected, or when the processes exit without waiting, is published.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import GPT_CFG, _config, _engine, _train

import llmpar
from llmpar.checkpoint import CheckpointError, save_checkpoint
from llmpar.models import GPT, GPTConfig

from multirank import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _attempt(fn, *args, **kwargs):
    """(error message or None, seconds) of ``fn(*args, **kwargs)``."""
    t0 = time.perf_counter()
    try:
        fn(*args, **kwargs)
        return None, time.perf_counter() - t0
    except CheckpointError as e:
        return str(e), time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------- item 5
def tags_body(root, mode):
    engine, model = _engine(2)
    _train(engine, model, 0, 1)
    engine.save_checkpoint(root, tag="a")
    _train(engine, model, 1, 2)
    engine.save_checkpoint(root, tag="b")
    fresh, _ = _engine(2, seed=5)
    rank = dist.get_rank()
    if mode == "load":
        err, seconds = _attempt(fresh.load_checkpoint, root, tag="a" if rank == 0 else "b")
    elif mode == "latest":  # tag=None on one rank, the tag `latest` names on the other: the same checkpoint
        err, seconds = _attempt(fresh.load_checkpoint, root, tag=None if rank == 0 else "b")
    else:
        err, seconds = _attempt(engine.save_checkpoint, root, tag="x" if rank == 0 else "y")
    return err, seconds, fresh.global_steps, sorted(os.listdir(root))


@pytest.mark.parametrize("mode", ["load", "latest", "save"])
def test_ranks_with_different_tags_fail_on_every_rank(mode, tmp_path):
    outs = run_ranks(tags_body, 2, str(tmp_path), mode, timeout=120)
    for rank, (err, seconds, steps, listing) in enumerate(outs):
        print(f"{mode} rank {rank}: {seconds:.3f}s: {err}")
        if mode == "latest":
            assert err is None and steps == 2
            continue
        assert err is not None, f"rank {rank} did not fail"
        assert "different" in err and "dp rank 0" in err and "dp rank 1" in err, err
        assert ("global_step" not in err) if mode == "load" else ("'x'" in err and "'y'" in err), err
        if mode == "load":
            assert f"{tmp_path}/a" in err and f"{tmp_path}/b" in err and steps == 0, err
        assert listing == ["a", "b", "latest"], listing  # nothing half-saved left behind


# ---------------------------------------------------------------------------------------------------- item 4
def _gpt_engine(stage, n_layer, seed):
    model = GPT(GPTConfig(**{**GPT_CFG, "n_layer": n_layer}), seed=seed)
    engine, *_ = llmpar.initialize(model=model, config=_config(stage, dist.get_world_size()))
    return engine, model


def strict_body(root, stage, saved_layers, loaded_layers):
    engine, model = _gpt_engine(stage, saved_layers, 1)
    _train(engine, model, 0, 2)
    engine.save_checkpoint(root)
    other, omodel = _gpt_engine(stage, loaded_layers, 3)

    def params(e, m):  # stage 3: the whole params, gathered to rank 0 (a stage-3 module holds placeholders)
        return e.module_state_dict() if stage == 3 else {n: p.detach().clone() for n, p in m.named_parameters()}

    before = params(other, omodel)
    err, seconds = _attempt(other.load_checkpoint, root)
    after = params(other, omodel)
    unchanged = all(torch.equal(t, before[n]) for n, t in after.items())
    other.load_checkpoint(root, strict=False)
    full, mine = params(engine, model), params(other, omodel)
    same = sorted(n for n in mine if n in full and torch.equal(mine[n], full[n]))
    kept = sorted(n for n in mine if n not in full and torch.equal(mine[n], before[n]))
    _train(other, omodel, 2, 3)  # and it trains on
    return err, seconds, unchanged, same, kept, other.global_steps


@pytest.mark.parametrize(
    "stage, saved, loaded", [(2, 2, 1), (3, 2, 1), (2, 1, 2)], ids=["s2-2into1", "s3-2into1", "s2-1into2"]
)
def test_a_checkpoint_of_another_model_is_an_error_naming_the_params(stage, saved, loaded, tmp_path):
    outs = run_ranks(strict_body, 2, str(tmp_path), stage, saved, loaded, timeout=180)
    for rank, (err, seconds, unchanged, same, kept, steps) in enumerate(outs):
        print(f"rank {rank}: {seconds:.3f}s: {err}")
        assert err is not None and "blocks.1.attn.qkv.weight" in err, (rank, err)
        assert ("in no rank's model" if saved > loaded else "are not in") in err, err
        assert unchanged  # nothing was modified before the error
        if rank == 0:  # strict=False: what matches is loaded, the rest kept
            assert "blocks.0.attn.qkv.weight" in same and "lm_head.weight" in same, same
            if saved < loaded:
                assert "blocks.1.attn.qkv.weight" in kept, kept
        assert steps == 3


# ---------------------------------------------------------------------------------------------------- item 1
def resave_body(root):
    engine, model = _engine(2)
    _train(engine, model, 0, 1)
    engine.save_checkpoint(root, tag="t")
    _train(engine, model, 1, 2)

    def hook(where):
        if where == "old_moved_aside":
            raise OSError("simulated disk error between the renames")

    err, _ = _attempt(save_checkpoint, engine, root, tag="t", fault_hook=hook)
    fresh, _ = _engine(2, seed=5)
    fresh.load_checkpoint(root)
    return err, fresh.global_steps, sorted(os.listdir(root))


def test_a_resave_failing_between_the_renames_rolls_back(tmp_path):
    for rank, (err, steps, listing) in enumerate(run_ranks(resave_body, 2, str(tmp_path), timeout=120)):
        assert err is not None and ("simulated disk error" in err or "rank 0 failed publishing" in err), err
        assert steps == 1 and listing == ["latest", "t"], (rank, steps, listing)


# ---------------------------------------------------------------------------------------------------- item 2
def collected_body(root):
    engine, model = _engine(3)
    _train(engine, model, 0, 2)
    release = threading.Event()

    def hook(where):
        if where == "before_write":
            assert release.wait(60)

    save_checkpoint(engine, root, async_save=True, client_state={"pos": 2}, fault_hook=hook)
    release.set()
    del engine, model
    gc.collect()  # the engine goes with its save pending: written and published without collectives
    dist.barrier()
    fresh, _ = _engine(3, seed=5)
    _, client = fresh.load_checkpoint(root)
    return client, fresh.global_steps


def test_async_save_of_a_collected_engine_is_published_by_rank_0(tmp_path):
    for client, steps in run_ranks(collected_body, 2, str(tmp_path), timeout=120):
        assert client == {"pos": 2} and steps == 2
    assert (tmp_path / "latest").read_text().strip() == "global_step2"


_WORKER = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = [{tests!r}, {helpers!r}]
    rank, fail = int(os.environ["RANK"]), {fail!r}
    from test_checkpoint import _engine, _train
    import torch.distributed as dist
    dist.init_process_group("gloo")
    engine, model = _engine(2)
    _train(engine, model, 0, 2)
    def hook(where):
        if where == "before_write":
            time.sleep(0.5 + rank)  # rank 1 finishes writing after rank 0 reached the exit
        if where == "shard_written" and fail and rank == 1:
            raise OSError("simulated disk full")
    from llmpar.checkpoint import save_checkpoint
    save_checkpoint(engine, {root!r}, async_save=True, fault_hook=hook)
    print("rank", rank, "leaves without waiting", flush=True)
""")


def _run_two(root: Path, fail: bool) -> list[subprocess.CompletedProcess]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = _WORKER.format(
        tests=str(ROOT / "tests" / "checkpoint"), helpers=str(ROOT / "tests"), root=str(root), fail=fail
    )
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "LLMPAR_CKPT_EXIT_WAIT_S": "30",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", script],
                env=env,
                cwd=str(ROOT),
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.parametrize("fail", [False, True], ids=["written", "rank1-fails"])
def test_async_save_pending_when_the_ranks_exit(fail, tmp_path):
    outs = _run_two(tmp_path, fail)
    for rank, p in enumerate(outs):
        assert "leaves without waiting" in p.stdout, (rank, p.stdout, p.stderr[-3000:])
    print(outs[0].stderr[-2000:])
    if not fail:
        assert (tmp_path / "latest").read_text().strip() == "global_step2", (os.listdir(tmp_path), outs[0].stderr)
        assert "published now" in outs[0].stderr and "wait_checkpoint" in outs[0].stderr
        assert sorted(os.listdir(tmp_path / "global_step2")) == [
            "dp000-tp00.shard",
            "dp001-tp00.shard",
            "metadata.json",
        ]
    else:
        assert not (tmp_path / "latest").exists()
        assert "NOT published" in outs[0].stderr and "simulated disk full" in outs[0].stderr, outs[0].stderr
