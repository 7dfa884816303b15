"""Checkpoint reliability (issue #15), on the one-process fake engine of ``test_checkpoint_protocol`` (fast, no
process group) and in subprocesses that really exit:

* re-saving an existing tag, crashed at every instant of the publish (a ``BaseException`` the save does not catch:
  nothing after it runs, as if the process died), leaves a loadable checkpoint under ``latest`` and the tag;
* an async save never waited for is written and published when the script ends or the engine is collected;
* a failed save leaves no ``.tmp-*`` directory, and a crashed one is cleaned by the next successful save;
* a missing or unexpected param / buffer is an error naming it (``strict=False``: kept / ignored, with a warning);
* ``metadata.json`` is covered by a digest: an edited or truncated one is an error naming the file, on load and on
  consolidate; a checkpoint written before the digest (format 1) still loads.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint_format import downgrade
from test_checkpoint_protocol import FakeEngine, Tiny, _same

from llmpar.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from llmpar.checkpoint.consolidate import consolidated_state_dict

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parents[1]


class Crash(BaseException):
    """The process dies here: no ``except Exception`` cleanup runs, the disk stays as it is."""


def _crash_at(point: str):
    def hook(where: str) -> None:
        if where == point:
            raise Crash(where)

    return hook


def _points(engine: FakeEngine, tmp_path: Path) -> list[str]:
    seen: list[str] = []
    save_checkpoint(engine, tmp_path / "probe", fault_hook=seen.append)
    save_checkpoint(engine, tmp_path / "probe", fault_hook=seen.append)  # a re-save: the publish's every instant
    return list(dict.fromkeys(seen))


# ---------------------------------------------------------------------------------------------------- item 1
def test_resave_crash_between_the_renames_keeps_the_tag_loadable(tmp_path, monkeypatch):
    """The old publish moved TAG aside, then moved the new one in: dying in between left ``latest`` naming nothing."""
    old, new = FakeEngine(2), FakeEngine(3)
    save_checkpoint(old, tmp_path, tag="t")
    real = os.rename

    def rename(src, dst):  # the second rename of a re-save (the new copy moved in) never happens
        if (
            os.path.basename(os.fspath(src)).startswith(".tmp-")
            and not os.path.exists(dst)
            and any(n.startswith(".old-") for n in os.listdir(os.path.dirname(os.fspath(dst))))
        ):
            raise Crash("died between the renames")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(Crash):
        save_checkpoint(new, tmp_path, tag="t")
    monkeypatch.setattr(os, "rename", real)
    got = FakeEngine(9)
    load_checkpoint(got, tmp_path)  # latest names "t": the previous copy loads
    _same(old, got)
    save_checkpoint(new, tmp_path, tag="t")  # the next save of the tag keeps what it must, and ends clean
    load_checkpoint(got, tmp_path, tag="t")
    _same(new, got)
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]


@pytest.mark.parametrize("resave", [True, False], ids=["same-tag", "new-tag"])
def test_crash_at_every_instant_leaves_a_loadable_checkpoint(resave, tmp_path):
    probe = FakeEngine(1)
    points = _points(probe, tmp_path)
    assert {"before_write", "shard_written", "before_publish", "before_latest"} <= set(points), points
    for i, point in enumerate(points):
        root = tmp_path / f"p{i}"
        old, new = FakeEngine(2), FakeEngine(3)
        save_checkpoint(old, root, tag="t")
        fired = []
        crash = _crash_at(point)

        def hook(where: str) -> None:
            fired.append(where)
            crash(where)

        try:
            save_checkpoint(new, root, tag="t" if resave else "u", fault_hook=hook)
        except (Crash, CheckpointError):  # the writer (a thread under async) turns it into an error
            pass
        if point not in fired:
            assert not resave, point  # a re-save passes every instant; a new tag skips the old copy's
            continue
        got = FakeEngine(9)
        load_checkpoint(got, root)
        try:  # latest: the old one, or (crash after the new one was complete) the new one
            _same(old, got)
        except AssertionError:
            _same(new, got)
        load_checkpoint(got, root, tag="t")
        save_checkpoint(new, root, tag="t")
        load_checkpoint(got, root)
        _same(new, got)
        left = sorted(n for n in os.listdir(root) if n.startswith("."))
        assert left == [], (point, left)  # the next successful save cleaned what the crash left


# ---------------------------------------------------------------------------------------------------- item 2
_EXIT_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from test_checkpoint_protocol import FakeEngine
from llmpar.checkpoint import save_checkpoint
engine = FakeEngine(3)
def hook(point):
    if point == "before_write":
        time.sleep(1.0)  # still writing when the script ends
save_checkpoint(engine, {root!r}, async_save=True, client_state={{"pos": 5}}, fault_hook=hook)
print("script done", flush=True)
"""


def test_async_save_never_waited_is_published_at_exit(tmp_path):
    script = _EXIT_SCRIPT.format(tests=str(TESTS), root=str(tmp_path))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "script done" in proc.stdout
    assert (tmp_path / "latest").read_text().strip() == "global_step3", (os.listdir(tmp_path), proc.stderr)
    assert "wait_checkpoint" in proc.stderr, proc.stderr  # the warning says what to do next time
    got = FakeEngine(9)
    _, client = load_checkpoint(got, tmp_path)
    assert client == {"pos": 5}
    _same(FakeEngine(3), got)
    print(f"exit publish: {time.perf_counter() - t0:.1f}s")


def test_async_save_of_a_collected_engine_is_published(tmp_path):
    engine = FakeEngine(4)

    def hook(point: str) -> None:
        if point == "before_write":
            time.sleep(0.3)

    save_checkpoint(engine, tmp_path, async_save=True, fault_hook=hook)
    del engine
    gc.collect()
    assert (tmp_path / "latest").read_text().strip() == "global_step4", os.listdir(tmp_path)
    got = FakeEngine(9)
    load_checkpoint(got, tmp_path)
    _same(FakeEngine(4), got)


# ---------------------------------------------------------------------------------------------------- item 3
# (a failed save deletes its own .tmp-TAG: test_checkpoint_protocol.test_fault_hook_is_per_call)


def test_a_crashed_save_is_cleaned_by_the_next_one(tmp_path, caplog):
    engine = FakeEngine(1)
    save_checkpoint(engine, tmp_path, tag="good")
    (tmp_path / ".tmp-partial").mkdir(parents=True)  # a rank died mid-write: some files, no side files
    (tmp_path / ".tmp-partial" / "dp000-tp00.shard").write_bytes(b"half a file")
    with pytest.raises(Crash):  # died right before the publish: a complete save nobody published
        save_checkpoint(engine, tmp_path, tag="unpublished", fault_hook=_crash_at("before_publish"))
    with pytest.raises(CheckpointError, match="never published"):
        load_checkpoint(FakeEngine(9), tmp_path, tag="unpublished")
    with caplog.at_level("WARNING", logger="llmpar"):
        load_checkpoint(FakeEngine(9), tmp_path)
    assert "llmpar checkpoint publish" in caplog.text and ".tmp-unpublished" in caplog.text
    with caplog.at_level("WARNING", logger="llmpar"):
        save_checkpoint(engine, tmp_path, tag="good")
    assert "never published" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["good", "latest"]


def test_publish_command_publishes_a_complete_unpublished_save(tmp_path):
    from llmpar.cli import main

    src = FakeEngine(3)
    save_checkpoint(src, tmp_path, tag="good")
    with pytest.raises(Crash):
        save_checkpoint(FakeEngine(4), tmp_path, tag="late", fault_hook=_crash_at("before_publish"))
    assert main(["checkpoint", "publish", str(tmp_path), "nothing"]) == 1
    assert main(["checkpoint", "publish", str(tmp_path), "late"]) == 0
    assert (tmp_path / "latest").read_text().strip() == "late"
    got = FakeEngine(9)
    load_checkpoint(got, tmp_path)
    _same(FakeEngine(4), got)


# ---------------------------------------------------------------------------------------------------- item 6
def test_edited_metadata_is_an_error_naming_the_file(tmp_path):
    src = FakeEngine(3)
    path = save_checkpoint(src, tmp_path)
    meta_file = Path(path) / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["engine"]["global_steps"] = 1000
    meta_file.write_text(json.dumps(meta, indent=1))
    with pytest.raises(CheckpointError, match="metadata.json") as err:
        load_checkpoint(FakeEngine(9), tmp_path)
    assert str(meta_file) in str(err.value)
    with pytest.raises(CheckpointError, match="metadata.json"):
        consolidated_state_dict(path)


def test_truncated_metadata_is_an_error_naming_the_file(tmp_path):
    path = save_checkpoint(FakeEngine(3), tmp_path)
    meta_file = Path(path) / "metadata.json"
    meta_file.write_text(meta_file.read_text()[:84])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(FakeEngine(9), tmp_path)
    assert str(meta_file) in str(err.value), str(err.value)
    with pytest.raises(CheckpointError) as err:
        consolidated_state_dict(path)
    assert str(meta_file) in str(err.value), str(err.value)


def test_a_checkpoint_without_digest_format_1_still_loads(tmp_path):
    src = FakeEngine(3)
    path = save_checkpoint(src, tmp_path)
    downgrade(Path(path), 1)  # .pt rank files by torch.save, no digest
    assert "digest" not in json.loads((Path(path) / "metadata.json").read_text())
    got = FakeEngine(9)
    load_checkpoint(got, tmp_path)
    _same(src, got)
    assert sorted(consolidated_state_dict(path)) == ["b", "f", "running", "w"]


# ---------------------------------------------------------------------------------------------------- item 4
class Smaller(Tiny):
    """Tiny without its ``b`` param (a 1-layer model against a 2-layer checkpoint)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        del self.b


def _smaller(seed: int) -> FakeEngine:
    engine = FakeEngine(seed)
    engine.module = Smaller(seed)
    engine.optimizer.named = [("opt.w", engine.module.w)]
    engine.optimizer.exp_avg.pop("opt.b")
    return engine


def test_unexpected_param_is_an_error_naming_it(tmp_path):
    src = FakeEngine(3)
    save_checkpoint(src, tmp_path)
    dst = _smaller(9)
    w = dst.module.w.detach().clone()
    with pytest.raises(CheckpointError, match=r"\['b'\].*strict=False"):
        load_checkpoint(dst, tmp_path)
    assert torch.equal(dst.module.w, w) and dst.global_steps == 9  # nothing was modified
    load_checkpoint(dst, tmp_path, strict=False)
    assert torch.equal(dst.module.w, src.module.w) and dst.global_steps == 3


def test_missing_param_is_an_error_naming_it_strict_false_keeps_it(tmp_path):
    small = _smaller(3)
    save_checkpoint(small, tmp_path)
    dst = FakeEngine(9)
    b, b_avg = dst.module.b.detach().clone(), dst.optimizer.exp_avg["opt.b"].clone()
    with pytest.raises(CheckpointError, match=r"not in .*\['b'\]"):
        load_checkpoint(dst, tmp_path)
    load_checkpoint(dst, tmp_path, strict=False)
    assert torch.equal(dst.module.w, small.module.w) and torch.equal(dst.module.b, b)
    assert torch.equal(dst.optimizer.exp_avg["opt.b"], b_avg)


def test_missing_or_reshaped_buffer_is_an_error_naming_it(tmp_path):
    save_checkpoint(FakeEngine(3), tmp_path)
    dst = FakeEngine(9)
    dst.module.register_buffer("extra", torch.ones(3))
    with pytest.raises(CheckpointError, match="'extra'"):
        load_checkpoint(dst, tmp_path)
    dst = FakeEngine(9)
    dst.module.running = torch.zeros(7)
    with pytest.raises(CheckpointError, match="'running' has shape"):
        load_checkpoint(dst, tmp_path)
    load_checkpoint(dst, tmp_path, strict=False)  # skipped, with a warning
    assert torch.equal(dst.module.running, torch.zeros(7))


def test_strict_is_checked():
    with pytest.raises(TypeError, match="strict"):
        load_checkpoint(FakeEngine(1), "x", strict="yes")
