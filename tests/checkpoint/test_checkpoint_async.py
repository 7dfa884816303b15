"""Async checkpoint save on CPU/gloo ranks: the files are written by a thread from a host snapshot while training goes
on (the writer is held until the training after the save is done, so the live state has moved on), the publish comes
at ``wait_checkpoint``, and the checkpoint loads and resumes bitwise; a writer failure on one rank is an error on
every rank at the next wait, the previous checkpoint stays ``latest``, and the next save works."""

import os
import threading

import pytest
import torch.distributed as dist
from test_checkpoint import _engine, _train

from llmpar.checkpoint import files as ckfiles
from llmpar.checkpoint import save_checkpoint
from llmpar.checkpoint.pending import pending

from multirank import run_ranks


def _hold_writer(release: threading.Event, fail_rank: int | None = None):
    def hook(where):
        if where == "before_write":
            assert release.wait(60), "writer thread was never released"
        if where == "shard_written" and dist.get_rank() == fail_rank:
            raise OSError("simulated disk full in the writer thread")

    return hook


def async_resume_body(stage, k, root):
    engine, model = _engine(stage)
    ref = _train(engine, model, 0, k)
    release = threading.Event()
    path = save_checkpoint(
        engine, root, client_state={"data_pos": k}, async_save=True, fault_hook=_hold_writer(release)
    )
    job = pending(engine)
    assert job is not None and not job.done.is_set()  # returned before anything was written
    ref += _train(engine, model, k, 2 * k)  # training goes on: params, moments, RNG, counters all move
    assert not os.path.exists(os.path.join(root, "latest"))  # nothing published yet
    release.set()
    published = engine.wait_checkpoint()
    assert published == path and pending(engine) is None and engine.wait_checkpoint() is None
    fresh, fmodel = _engine(stage, seed=7)
    _, client = fresh.load_checkpoint(root)
    assert client == {"data_pos": k} and fresh.global_steps == k
    return ref[k:], _train(fresh, fmodel, k, 2 * k), os.path.basename(path)


@pytest.mark.parametrize("stage", [2, 3])
def test_async_save_resumes_bitwise(stage, tmp_path):
    for rank, (ref, resumed, tag) in enumerate(run_ranks(async_resume_body, 2, stage, 2, str(tmp_path), timeout=120)):
        assert tag == "global_step2"
        assert ref == resumed, f"rank {rank}: {ref} != {resumed}"
    assert (tmp_path / "latest").read_text().strip() == "global_step2"


def async_failure_body(root):
    engine, model = _engine(2)
    _train(engine, model, 0, 1)
    engine.save_checkpoint(root, tag="good")
    release = threading.Event()
    save_checkpoint(engine, root, tag="bad", async_save=True, fault_hook=_hold_writer(release, fail_rank=1))
    _train(engine, model, 1, 2)
    release.set()
    try:
        engine.wait_checkpoint()
        raised = None
    except ckfiles.CheckpointError as e:
        raised = str(e)
    assert pending(engine) is None
    with open(os.path.join(root, "latest")) as f:
        latest_after_failure = f.read().strip()
    # the next save (async again, published by the load) works
    engine.save_checkpoint(root, tag="next", async_save=True)
    path, _ = engine.load_checkpoint(root)
    return raised, latest_after_failure, os.path.basename(path)


def test_async_writer_failure_raises_on_every_rank(tmp_path):
    for rank, (raised, latest, loaded) in enumerate(run_ranks(async_failure_body, 2, str(tmp_path), timeout=120)):
        assert raised is not None, f"rank {rank} did not raise"
        assert ("simulated disk full" in raised) if rank == 1 else ("another rank failed" in raised), (rank, raised)
        assert latest == "good" and loaded == "next"
    assert not (tmp_path / "bad").exists()


def test_async_save_argument_is_checked():
    from llmpar.checkpoint import save_checkpoint

    with pytest.raises(TypeError, match="async_save"):
        save_checkpoint(object(), "x", async_save="yes")
