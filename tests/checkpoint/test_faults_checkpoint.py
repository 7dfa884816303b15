"""Checkpoint tags and ``metadata.json`` under a fault campaign (bad input, not crashes):

* a tag with leading / trailing whitespace or a newline (``"a "``, ``"step\\n"``) is refused at save naming it, and
  ``latest`` is read exactly: a ``latest`` naming ``"a "`` is an error, never a silent load of the older ``a``;
* a tag with path syntax or a control character (NUL, ``/``, ``..``, ``\\``, ``.``, empty, absolute, tab, DEL) is a
  ValueError naming it, for save and load alike, on every rank, before any collective (no agreement, no wait for a
  pending async save);
* a ``metadata.json`` with a valid digest but bad contents (``"engine": null``, ``"optimizer": {}``, wrong types,
  missing fields, zero or negative sizes) is a CheckpointError naming the field and the file, raised before anything
  of the engine is modified (checked against a copy), also by ``consolidate``;
* re-saving a tag whose directory is a symlink replaces the link with a real directory (the link's target, the
  previous copy, is left as it is): no ``.old-TAG`` left behind, no cleanup warning at later saves.

Single-process cases use the fake engine of ``test_checkpoint_protocol`` (no process group); one 2-rank run on
CPU/gloo checks the refusals on every rank of a real ZeRO engine.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint_protocol import FakeEngine, _same

from llmpar.checkpoint import CheckpointError, load_checkpoint, metacheck, save_checkpoint, wait_checkpoint
from llmpar.checkpoint import files as ckfiles
from llmpar.checkpoint.consolidate import consolidated_state_dict
from llmpar.checkpoint.pending import pending
from llmpar.runtime import engine_ckpt

from multirank import run_ranks


def _no_collective(*args, **kwargs):
    raise AssertionError("a checkpoint collective ran before the bad tag was refused")


@pytest.fixture
def no_collectives(monkeypatch):
    """Every agreement of ``llmpar.checkpoint`` (save, load, the engine's wrappers) goes through these two."""
    monkeypatch.setattr(ckfiles, "agree_tensor", _no_collective)
    monkeypatch.setattr(ckfiles, "all_reduce", _no_collective)


# ---------------------------------------------------------------------------------------------------- item 1
@pytest.mark.parametrize("tag", ["a ", " a", "step\n", "a\r", "\ta"])
def test_a_tag_with_surrounding_whitespace_is_refused_at_save(tag, tmp_path):
    src = FakeEngine(2)
    save_checkpoint(src, tmp_path, tag="a")
    with pytest.raises(ValueError, match=re.escape(repr(tag))) as err:
        save_checkpoint(FakeEngine(3), tmp_path, tag=tag)
    assert "whitespace" in str(err.value) or "printable" in str(err.value), str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]  # nothing written, latest untouched
    got = FakeEngine(9)
    load_checkpoint(got, tmp_path)
    _same(src, got)


def test_latest_is_read_exactly(tmp_path, caplog):
    """``latest`` naming ``"b "`` (an older llmpar wrote such tags) once loaded ``b`` silently: now an error naming
    the file; a ``latest`` without its newline (DeepSpeed writes none) or with ``\\r\\n`` still loads."""
    older, newer = FakeEngine(2), FakeEngine(3)
    save_checkpoint(older, tmp_path, tag="b")
    save_checkpoint(newer, tmp_path, tag="c")
    os.rename(tmp_path / "c", tmp_path / "b ")  # what save(tag="b ") published before the tag was refused
    (tmp_path / "latest").write_text("b \n")
    with pytest.raises(CheckpointError, match=re.escape(repr("b "))) as err:
        load_checkpoint(FakeEngine(9), tmp_path)
    assert str(tmp_path / "latest") in str(err.value), str(err.value)
    for text in ("b", "b\n", "b\r\n"):
        (tmp_path / "latest").write_text(text)
        got = FakeEngine(9)
        path, _ = load_checkpoint(got, tmp_path)
        assert path == str(tmp_path / "b")
        _same(older, got)
    (tmp_path / "latest").write_text("b\n\n")  # two lines: not a tag
    with pytest.raises(CheckpointError, match="latest"):
        load_checkpoint(FakeEngine(9), tmp_path)


def test_save_latest_false_puts_latest_back_byte_for_byte(tmp_path):
    """``engine.save_checkpoint(save_latest=False)`` read ``latest`` stripped and wrote it back with a newline."""
    save_checkpoint(FakeEngine(2), tmp_path, tag="a")
    (tmp_path / "latest").write_bytes(b"a")  # as DeepSpeed writes it: no newline
    engine_ckpt.save(FakeEngine(3), tmp_path, "b", None, False, False, False)
    assert (tmp_path / "latest").read_bytes() == b"a" and (tmp_path / "b" / "metadata.json").is_file()


# ---------------------------------------------------------------------------------------------------- item 6
BAD_TAGS = [
    "a\0b",
    "",
    ".",
    "..",
    "../x",
    "x/..",
    "a/b",
    "/abs/x",
    "a\\b",
    "a\tb",
    "a\x7fb",
    "a\u200bb",
    "latest",
    "latest.tmp",
    ".tmp-x",
    "x" * 251,
]


@pytest.mark.parametrize("tag", BAD_TAGS, ids=[repr(t)[:16] for t in BAD_TAGS])
def test_a_tag_with_path_syntax_is_refused_before_any_collective(tag, tmp_path, no_collectives):
    src = FakeEngine(2)
    for call in (
        lambda: save_checkpoint(src, tmp_path, tag=tag),
        lambda: save_checkpoint(src, tmp_path, tag=tag, async_save=True),
        lambda: load_checkpoint(src, tmp_path, tag=tag),
        lambda: engine_ckpt.save(src, tmp_path, tag, None, False, False, False),  # engine.save_checkpoint
        lambda: engine_ckpt.load(src, tmp_path, tag, True, True, False, True),
    ):  # engine.load_checkpoint
        with pytest.raises(ValueError, match=re.escape(f"tag={tag!r}")):
            call()
    assert pending(src) is None
    assert not tmp_path.exists() or os.listdir(tmp_path) == []  # nothing created


@pytest.mark.parametrize("tag", [5, b"a", ["t"]])
def test_a_tag_of_the_wrong_type_is_a_type_error(tag, tmp_path, no_collectives):
    for call in (
        lambda: save_checkpoint(FakeEngine(2), tmp_path, tag=tag),
        lambda: load_checkpoint(FakeEngine(2), tmp_path, tag=tag),
    ):
        with pytest.raises(TypeError, match="tag"):
            call()


def test_a_bad_tag_is_refused_before_a_pending_save_is_waited_for(tmp_path, monkeypatch):
    """``wait_checkpoint`` (a collective) ran before the tag was looked at."""
    src = FakeEngine(2)
    save_checkpoint(src, tmp_path, tag="ok", async_save=True)
    job = pending(src)
    with monkeypatch.context() as m:
        m.setattr(ckfiles, "agree_tensor", _no_collective)
        for call in (
            lambda: save_checkpoint(src, tmp_path, tag="a\0b"),
            lambda: load_checkpoint(src, tmp_path, tag="../ok"),
        ):
            with pytest.raises(ValueError, match="tag="):
                call()
    assert pending(src) is job  # still pending, finished by the next call
    assert wait_checkpoint(src) == str(tmp_path / "ok")


# ---------------------------------------------------------------------------------------------------- item 9
def _edit(meta: dict, field: str, value) -> None:
    """Set ``field`` (dotted, list indices as numbers; ``value`` DELETE removes it) in ``meta``."""
    *parents, last = field.split(".")
    obj = meta
    for p in parents:
        obj = obj[int(p)] if isinstance(obj, list) else obj[p]
    key = int(last) if isinstance(obj, list) else last
    if value is DELETE:
        del obj[key]
    else:
        obj[key] = value


DELETE = object()
BAD_META = [  # (field, value, what the error names)
    ("engine", None, "engine"),
    ("optimizer", {}, "optimizer.skipped_steps"),
    ("optimizer.last_grad_norm", "big", "optimizer.last_grad_norm"),
    ("engine.global_steps", "7", "engine.global_steps"),
    ("engine.micro_steps", DELETE, "engine.micro_steps"),
    ("engine.global_samples", -4, "engine.global_samples"),
    ("param_groups.0.betas", 0.9, "param_groups[0].betas"),
    ("param_groups.0", None, "param_groups[0]"),
    ("param_groups", {}, "param_groups"),
    ("scheduler", 5, "scheduler"),
    ("dp", 0, "dp"),
    ("tp", 0, "tp"),
    ("tp", "1", "tp"),
    ("stage", 7, "stage"),
    ("pp", -1, "pp"),
    ("layout", DELETE, "layout"),
    ("layout.buffers", None, "layout.buffers"),
    ("layout.buffers.0.units.0.padded", 0, "layout.buffers[0].units[0].padded"),
    ("layout.buffers.0.units.1.padded", -12, "layout.buffers[0].units[1].padded"),
    ("layout.buffers.0.units.0.shard_offset", -1, "layout.buffers[0].units[0].shard_offset"),
    ("layout.buffers.0.params.0.shape", [-3, 4], "layout.buffers[0].params[0].shape"),
    ("layout.buffers.0.params.0.shape", [30, 4], "layout.buffers[0].params[0]"),
    ("layout.buffers.0.params.1.unit", 5, "layout.buffers[0].params[1].unit"),
    ("layout.buffers.0.params.0.name", None, "layout.buffers[0].params[0].name"),
    ("layout.buffers.0.steps", [1.0], "layout.buffers[0].steps"),
    ("layout.buffers.0.state_keys", ["exp_avg"], "layout.buffers[0].state_keys"),
    ("files.dp000-tp00.shard.bytes", "many", "files['dp000-tp00.shard'].bytes"),
    ("files", {"../../etc/passwd": {"bytes": 1, "sha256": "0" * 64}}, "files"),
    ("extras", {"running": 3}, "extras['running']"),
]


@pytest.mark.parametrize(
    "field, value, named", BAD_META, ids=[f"{f}={'DELETE' if v is DELETE else str(v)[:12]}" for f, v, _ in BAD_META]
)
def test_bad_metadata_is_refused_naming_the_field_before_anything_changes(field, value, named, tmp_path):
    path = Path(save_checkpoint(FakeEngine(3), tmp_path, tag="t"))
    meta = json.loads((path / "metadata.json").read_text())
    if field.startswith("files.dp000"):  # the file name has dots
        meta["files"]["dp000-tp00.shard"]["bytes"] = value
    else:
        _edit(meta, field, value)
    metacheck.write_metadata(str(path), meta)  # a valid digest over the bad contents
    got = FakeEngine(9)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(got, tmp_path)
    seconds = time.perf_counter() - t0
    message = str(err.value)
    assert named in message and str(path / "metadata.json") in message, message
    _same(FakeEngine(9), got)  # params, moments, steps, counters, hyper-parameters: untouched
    assert got.optimizer.calls == [], got.optimizer.calls
    assert seconds < 5, seconds
    if not field.startswith(("engine", "optimizer", "param_groups", "scheduler")):  # what consolidate reads too
        with pytest.raises(CheckpointError) as err:
            consolidated_state_dict(str(path))
        assert named in str(err.value), str(err.value)


def test_metadata_is_checked_against_the_engines_counters_and_scheduler(tmp_path):
    """A counter or scheduler entry the engine holds as a number must be one in the checkpoint (else it failed
    after the params were loaded, in ``restore_counters`` / ``load_state_dict``)."""

    class Sched:
        def __init__(self) -> None:
            self.last_batch_iteration, self.loaded = 3, None

        def state_dict(self) -> dict:
            return {"last_batch_iteration": self.last_batch_iteration, "name": "warmup"}

        def load_state_dict(self, sd: dict) -> None:
            self.last_batch_iteration = sd["last_batch_iteration"] + 0

    src = FakeEngine(3)
    src.lr_scheduler = Sched()
    path = Path(save_checkpoint(src, tmp_path, tag="t"))
    meta = json.loads((path / "metadata.json").read_text())
    for sched, named in (
        ({"name": "warmup"}, "scheduler.last_batch_iteration"),
        ({"last_batch_iteration": "3"}, "scheduler.last_batch_iteration"),
        ([3], "scheduler"),
    ):
        metacheck.write_metadata(str(path), {**meta, "scheduler": sched})
        got = FakeEngine(9)
        got.lr_scheduler = Sched()
        with pytest.raises(CheckpointError, match=re.escape(named)):
            load_checkpoint(got, tmp_path)
        _same(FakeEngine(9), got)
        assert got.lr_scheduler.last_batch_iteration == 3
    metacheck.write_metadata(str(path), meta)
    got = FakeEngine(9)
    got.lr_scheduler = Sched()
    load_checkpoint(got, tmp_path)
    _same(src, got)


# ---------------------------------------------------------------------------------------------------- item 10
def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("dangling", [False, True], ids=["link", "dangling-link"])
def test_resaving_a_symlinked_tag_replaces_the_link_and_leaves_no_old_copy(dangling, tmp_path, caplog):
    root, store = tmp_path / "ckpts", tmp_path / "archive"
    older, newer = FakeEngine(2), FakeEngine(3)
    save_checkpoint(older, root, tag="t")
    store.mkdir()
    shutil.move(str(root / "t"), str(store / "t"))
    os.symlink(store / "t", root / "t")  # the user moved the checkpoint elsewhere and linked it back
    if dangling:
        shutil.rmtree(store / "t")
    caplog.set_level(logging.WARNING, logger="llmpar")
    save_checkpoint(newer, root, tag="t")
    assert not (root / "t").is_symlink() and (root / "t" / "metadata.json").is_file()
    assert sorted(os.listdir(root)) == ["latest", "t"], os.listdir(root)
    if not dangling:  # the link's target is not ours: left as it was, still loadable
        assert (store / "t" / "metadata.json").is_file()
        got = FakeEngine(9)
        load_checkpoint(got, store, tag="t")
        _same(older, got)
    got = FakeEngine(9)
    load_checkpoint(got, root)
    _same(newer, got)
    save_checkpoint(FakeEngine(4), root, tag="u")  # a later save: nothing left to clean, no warning
    save_checkpoint(FakeEngine(4), root, tag="t")
    assert sorted(os.listdir(root)) == ["latest", "t", "u"], os.listdir(root)
    assert _warnings(caplog) == [], _warnings(caplog)


def test_a_symlinked_old_copy_left_by_an_older_save_is_unlinked_not_followed(tmp_path, caplog):
    """What an older llmpar left: ``.old-t`` a link; the next save removes the link (its target stays)."""
    root, store = tmp_path / "ckpts", tmp_path / "archive"
    save_checkpoint(FakeEngine(2), root, tag="t")
    save_checkpoint(FakeEngine(2), store, tag="t")
    os.symlink(store / "t", root / ".old-t")
    caplog.set_level(logging.WARNING, logger="llmpar")
    save_checkpoint(FakeEngine(3), root, tag="u")
    assert sorted(os.listdir(root)) == ["latest", "t", "u"] and (store / "t" / "metadata.json").is_file()
    assert _warnings(caplog) == [], _warnings(caplog)


# ---------------------------------------------------------------------------------------------------- 2 ranks
def ranks_body(root: str):
    import torch.distributed as dist
    from test_checkpoint import _engine, _train

    engine, model = _engine(2)
    _train(engine, model, 0, 1)
    engine.save_checkpoint(root, tag="a")
    auto = _auto_resume_on_ranks(engine, root + "_auto")
    refused: dict[str, tuple[str, str, float]] = {}
    real = ckfiles.agree_tensor, ckfiles.all_reduce
    ckfiles.agree_tensor = ckfiles.all_reduce = _no_collective
    try:
        for tag in ("a\0b", "step\n", "a ", "../a", "/abs", "."):
            for what, call in (
                ("save", lambda: engine.save_checkpoint(root, tag=tag)),
                ("load", lambda: engine.load_checkpoint(root, tag=tag)),
            ):
                t0 = time.perf_counter()
                try:
                    call()
                    refused[f"{what} {tag!r}"] = ("none", "", time.perf_counter() - t0)
                except BaseException as e:  # noqa: BLE001 - reported to the test
                    refused[f"{what} {tag!r}"] = (type(e).__name__, str(e), time.perf_counter() - t0)
    finally:
        ckfiles.agree_tensor, ckfiles.all_reduce = real
    path = os.path.join(root, "a")
    if dist.get_rank() == 0:
        meta = json.loads(Path(path, "metadata.json").read_text())
        metacheck.write_metadata(path, {**meta, "optimizer": {}})
    dist.barrier()
    fresh, fmodel = _engine(2, seed=5)
    before = {n: t.clone() for n, t in fmodel.state_dict().items()}
    t0 = time.perf_counter()
    try:
        fresh.load_checkpoint(root, tag="a")
        bad_meta = ("none", "", 0.0)
    except BaseException as e:  # noqa: BLE001
        bad_meta = (type(e).__name__, str(e), time.perf_counter() - t0)
    unchanged = all(torch.equal(t, before[n]) for n, t in fmodel.state_dict().items())
    return refused, bad_meta, unchanged, fresh.global_steps, sorted(os.listdir(root)), auto


def _auto_resume_on_ranks(engine, auto: str) -> tuple:
    """A checkpoint saved without ``latest``: an engine built with auto_resume there resumes from it on both ranks;
    with a copy at the same step beside it, both ranks refuse."""
    import torch.distributed as dist
    from test_checkpoint import GPT, GPT_CFG, GPTConfig, _config

    import llmpar

    engine.save_checkpoint(auto, save_latest=False)
    cfg = {**_config(2, 2), "checkpoint": {"auto_resume": auto}}
    resumed = llmpar.initialize(model=GPT(GPTConfig(**GPT_CFG), seed=5), config=cfg)[0]
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(auto, "global_step1"), os.path.join(auto, "copy"))
    dist.barrier()
    try:
        llmpar.initialize(model=GPT(GPTConfig(**GPT_CFG), seed=5), config=cfg)
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    return resumed.resumed_from, resumed.global_steps, refused


def test_bad_tags_and_metadata_are_refused_on_every_rank(tmp_path):
    """... and auto_resume without ``latest`` resumes the same checkpoint on both ranks, or refuses on both."""
    outs = run_ranks(ranks_body, 2, str(tmp_path), timeout=120)
    for rank, (refused, bad_meta, unchanged, steps, listing, auto) in enumerate(outs):
        assert auto[:2] == (str(tmp_path) + "_auto/global_step1", 1), auto
        assert "2 complete checkpoints at step 1: ['copy', 'global_step1']" in auto[2], auto
        for call, (kind, message, seconds) in refused.items():
            print(f"rank {rank}: {call}: {kind} in {seconds:.4f}s: {message[:100]!r}")
            tag = call.split(" ", 1)[1]
            assert kind == "ValueError" and f"tag={tag}" in message, (rank, call, kind, message)
        kind, message, seconds = bad_meta
        print(f"rank {rank}: optimizer={{}}: {kind} in {seconds:.3f}s: {message[:200]}")
        assert kind == "CheckpointError" and "optimizer.skipped_steps" in message, (rank, kind, message)
        assert os.path.join(str(tmp_path), "a", "metadata.json") in message, message
        assert unchanged and steps == 0, (rank, unchanged, steps)
        assert listing == ["a", "latest"], listing


# ---------------------------------------------------------------------------------------------------- auto_resume
def _resumable(directory) -> "object":
    import llmpar

    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 1)).double()
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
        "zero_optimization": {"stage": 1},
    }
    if directory is not None:
        cfg["checkpoint"] = {"auto_resume": str(directory)}
    return llmpar.initialize(model=model, config=cfg)[0]


def _steps(engine, until: int, save_to=None) -> dict[int, str]:
    """Steps up to ``until`` on batches drawn from the step number; saves (no ``latest``) after steps 2 and 4."""
    losses = {}
    while engine.global_steps < until:
        g = torch.Generator().manual_seed(100 + engine.global_steps)
        x, y = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 1, generator=g, dtype=torch.float64)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses[engine.global_steps] = loss.item().hex()
        if save_to is not None and engine.global_steps in (2, 4):
            engine.save_checkpoint(str(save_to), save_latest=False)
    return losses


def test_auto_resume_without_latest_resumes_the_newest_complete_checkpoint_or_refuses(tmp_path, caplog):
    """Complete checkpoints and no ``latest`` (``save_latest=False``, deleted, a run stopped before its first
    ``latest``, copied in): auto_resume loads the newest by the step its metadata records, whatever the directory
    names say, and trains on to the uninterrupted losses (it started fresh at step 0 and re-saved over them); two at
    the same step, or one that cannot be read, are refused naming them, the directory left as it was. With a
    ``latest`` naming an older one, that one loads and the newer ones are named in a warning."""
    ref = _steps(_resumable(None), 6)
    d = tmp_path / "ck"
    _steps(_resumable(d), 4, save_to=d)
    assert sorted(os.listdir(d)) == ["global_step2", "global_step4"]  # no latest
    os.rename(d / "global_step4", d / "aaa")  # names that sort the other way
    os.rename(d / "global_step2", d / "zzz_step9")
    with caplog.at_level(logging.WARNING, logger="llmpar"):
        again = _resumable(d)
    assert again.resumed_from == str(d / "aaa") and again.global_steps == 4
    assert "has no 'latest': resuming from the newest complete checkpoint, aaa (step 4" in caplog.text
    assert _steps(again, 6) == {s: ref[s] for s in (5, 6)}
    (d / "latest").write_text("zzz_step9")  # latest names the older one: loaded, the newer one named in a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmpar"):
        assert _resumable(d).global_steps == 2
    assert "holds newer complete ones: ['aaa (step 4)']" in caplog.text, caplog.text
    (d / "latest").unlink()
    shutil.copytree(d / "aaa", d / "bbb")  # a copy at the same step: which one is not clear
    listing = sorted(os.listdir(d))
    with pytest.raises(CheckpointError, match=r"2 complete checkpoints at step 4: \['aaa', 'bbb'\]"):
        _resumable(d)
    shutil.rmtree(d / "bbb")
    (d / "zzz_step9" / "metadata.json").write_text('{"format": 3')
    with pytest.raises(CheckpointError, match=r"cannot be read: .*zzz_step9"):
        _resumable(d)
    assert sorted(os.listdir(d)) == [n for n in listing if n != "bbb"]  # nothing saved, moved or removed
