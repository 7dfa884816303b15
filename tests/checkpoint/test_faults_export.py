"""Exports and conversions into a directory under a fault campaign: a process killed at any instant, a full disk,
an output directory that is not empty.

* ``convert --to hf`` (the streamed DeepSpeed path) and ``consolidate`` into an existing export directory, the
  process SIGKILLed before each of its renames / removals in turn: the directory holds the old export or the new
  one, byte for byte, never a mix (it was 26 old + 4 new tensors that ``from_pretrained`` loaded without a word);
* a non-empty output directory is refused naming it and ``--overwrite``, untouched; with ``--overwrite`` it is
  replaced whole (a stale ``config.json``, another dp's rank files gone), for every ``--to``;
* ``write_hf_model`` in place (``save_hf_model``), failing after its first new shard: no old weight file or index left;
* a full disk (``ENOSPC``, injected into the writes) during ``convert --to deepspeed``: a CheckpointError naming the
  file and the cause (was torch's ``inline_container`` RuntimeError), no ``.part`` and no new directory left, the
  target as it was.

One small llmpar checkpoint (a single-process engine) and hand-made DeepSpeed ZeRO-3 ones are the sources.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_hf_load import write_zero3

from llmpar.checkpoint import consolidate, convert
from llmpar.checkpoint.files import CheckpointError

# a child converting into OUT with os.replace / os.rename / os.remove / shutil.rmtree / the directory exchange
# counted; it SIGKILLs itself right before call K (K=0: never, it prints the count)
CHILD = r"""
import os, shutil, signal, sys
from llmpar.checkpoint import consolidate, convert, publish
mode, src, out, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
calls = [0]
def counted(fn):
    def call(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return call
os.replace, os.rename, os.remove = counted(os.replace), counted(os.rename), counted(os.remove)
if os.environ.get("NO_EXCHANGE"):  # a file system without renameat2's exchange: two renames
    publish._exchange = lambda a, b: False
shutil.rmtree, publish._exchange = counted(shutil.rmtree), counted(publish._exchange)
if mode == "stream":
    convert.convert(src, out, max_shard_size="2KB", overwrite=True)
else:
    consolidate.consolidate(src, out, max_shard_size="3KB", overwrite=True)
print(calls[0])
"""


# the children above are forked from one server that has imported llmpar once (a fresh interpreter per kill instant
# spent ~2.5 s of CPU on Python, torch and llmpar starting): each request is one JSON line (argv, env, the working
# directory, the file for the child's output); the reply, the child's exit code (-signal when killed)
SERVER = r"""
import json, os, sys, traceback
from llmpar.checkpoint import consolidate, convert, publish  # what CHILD imports, before any fork
child = compile(json.loads(sys.stdin.readline()), "<child>", "exec")
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(req["cwd"])
            os.environ.update(req["env"])
            sys.argv = ["-c", *req["argv"]]
            exec(child, {"__name__": "__main__"})
            sys.stdout.flush()
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)), flush=True)
"""


@pytest.fixture(scope="module")
def child_server():
    """Runs CHILD with the given arguments in a child forked from :data:`SERVER`: (exit code, its output)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    proc.stdin.write(json.dumps(CHILD) + "\n")

    def run(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
        log = cwd / f".child-{argv[-1]}.log"
        proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "env": env, "log": str(log)}) + "\n")
        reply = proc.stdout.readline()
        assert reply, f"the child server exited (code {proc.poll()})"
        text = log.read_text()
        log.unlink()
        return json.loads(reply), text

    yield run
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    finally:
        proc.kill()


def _tree(path: Path) -> dict[str, bytes] | None:
    """{relative path: bytes} of every file under ``path`` (None when it does not exist)."""
    if not path.is_dir():
        return None
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def llmpar_ckpt(tmp_path_factory):
    """An llmpar checkpoint of the demo GPT (ZeRO-2, one process) after 2 steps on random tokens."""
    import llmpar
    from llmpar.models import GPT, GPTConfig

    root = tmp_path_factory.mktemp("src")
    model = GPT(GPTConfig(vocab_size=37, n_layer=1, n_head=2, d_model=8, seq_len=8), seed=5)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = llmpar.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randint(0, 37, (2, 9), generator=g)
        engine.backward(engine.module.loss(engine(x[:, :-1]), x[:, 1:]))
        engine.step()
    engine.save_checkpoint(str(root / "ck"))
    return str(root / "ck")


def _zero3(d: Path, shift: float) -> str:
    g = torch.Generator().manual_seed(7)
    params = {
        "emb.weight": torch.randn(31, 7, generator=g),
        "h.0.w": torch.randn(19, 7, generator=g),
        "h.0.b": torch.randn(19, generator=g),
        "h.1.w": torch.randn(7, 19, generator=g),
    }
    write_zero3(str(d / "global_step1"), {n: t + shift for n, t in params.items()}, 3)
    return str(d)


@pytest.mark.parametrize("mode, exchange", [("stream", True), ("consolidate", True), ("stream", False)])
def test_a_convert_killed_at_any_instant_leaves_the_old_export_or_the_new_one(
    mode, exchange, llmpar_ckpt, tmp_path, child_server
):
    """(Without the exchange, a kill between its two renames leaves no target and the old export beside it: the next
    call into the target puts it back.)"""
    from llmpar.checkpoint import outdir

    if mode == "stream":  # a DeepSpeed ZeRO-3 source, streamed into safetensors shards; the old export: other values
        src, other = _zero3(tmp_path / "ds", 0.0), _zero3(tmp_path / "ds_other", 1.0)
        convert.convert(other, str(tmp_path / "old"), max_shard_size="1KB")
        convert.convert(src, str(tmp_path / "new"), max_shard_size="2KB")
    else:  # an llmpar checkpoint; the old export: bf16, one file
        src = llmpar_ckpt
        consolidate.consolidate(src, str(tmp_path / "old"), dtype="bf16")
        consolidate.consolidate(src, str(tmp_path / "new"), max_shard_size="3KB")
    old, new = _tree(tmp_path / "old"), _tree(tmp_path / "new")
    assert old != new and len(new) >= 3, sorted(new)  # several shards and an index

    def run(k: int) -> tuple[int, dict | None, str]:
        out = tmp_path / f"out{k}"
        shutil.copytree(tmp_path / "old", out)
        rc, text = child_server([mode, src, str(out), str(k)], tmp_path, {"NO_EXCHANGE": "" if exchange else "1"})
        return rc, _tree(out), text

    rc, tree, text = run(0)
    assert rc == 0 and tree == new, text
    count = int(text.split()[-1])
    # every instant once (the streamed DeepSpeed path); the other modes share its staging: the first instant, one
    # in the middle and the swap's; without the exchange: the swap's instants only
    if not exchange:
        ks = list(range(count - 2, count + 1))
    else:
        ks = list(range(1, count + 1)) if mode == "stream" else sorted({1, count // 2, *range(count - 2, count + 1)})
    results = [run(k) for k in ks]
    seen, put_back = [], 0
    for k, (rc, tree, text) in zip(ks, results):
        assert rc == -signal.SIGKILL, (k, rc, text)
        if tree is None and not exchange:  # between the two renames: put back by the next call
            put_back += 1
            assert [n for n in os.listdir(tmp_path) if n.startswith(f".out{k}.old-")], os.listdir(tmp_path)
            outdir.check_target(str(tmp_path / f"out{k}"), True)
            tree = _tree(tmp_path / f"out{k}")
        assert tree == old or tree == new, (
            f"killed before file operation {k} of {count}: the directory holds "
            f"{sorted(tree or {})}, neither the old export {sorted(old)} nor the new one {sorted(new)}"
        )
        seen.append("old" if tree == old else "new")
    assert "old" in seen and seen == sorted(seen, reverse=True), seen  # old until the swap, new after it
    assert put_back == (0 if exchange else 1), put_back
    # what the killed converts left beside the targets is removed by the next convert into them
    for k in ks:
        convert.convert(
            src, str(tmp_path / f"out{k}"), max_shard_size="2KB", overwrite=True
        ) if mode == "stream" else consolidate.consolidate(
            src, str(tmp_path / f"out{k}"), max_shard_size="3KB", overwrite=True
        )
        assert _tree(tmp_path / f"out{k}") == new
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], os.listdir(tmp_path)


def test_a_non_empty_output_directory_is_refused_unless_overwrite(llmpar_ckpt, tmp_path, capsys):
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed
    from llmpar.cli import main

    src = llmpar_ckpt
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "another"}')
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    for call in (
        lambda: consolidate.consolidate(src, str(out)),
        lambda: convert.convert(src, str(out)),
        lambda: convert.convert(src, str(out), to="deepspeed"),
        lambda: convert.convert(src, str(out), to="universal"),
        lambda: convert.convert(src, str(out), to="dcp"),
    ):
        with pytest.raises(
            ValueError,
            match=rf"output directory {out} is not empty \(it holds config.json, "
            r"notes.txt\): pass overwrite=True \(--overwrite\)",
        ):
            call()
        assert _tree(out) == before
    assert main(["checkpoint", "convert", src, str(out)]) == 1
    assert "--overwrite" in capsys.readouterr().err and _tree(out) == before
    assert main(["checkpoint", "consolidate", src, str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # the stale config.json and the notes are gone
    with pytest.raises(ValueError, match="holds the checkpoint read"):
        convert.convert(src, os.path.dirname(src), overwrite=True)
    with pytest.raises(TypeError, match="overwrite='yes' must be a bool"):
        convert.convert(src, str(tmp_path / "x"), overwrite="yes")
    # --to deepspeed at dp=3, then at dp=2 into the same directory: only the dp=2 files, which read back as such
    ds = tmp_path / "ds"
    assert main(["checkpoint", "convert", src, str(ds), "--to", "deepspeed", "--dp", "3"]) == 0
    assert main(["checkpoint", "convert", src, str(ds), "--to", "deepspeed", "--dp", "2"]) == 1
    assert main(["checkpoint", "convert", src, str(ds), "--to", "deepspeed", "--dp", "2", "--overwrite"]) == 0
    (tag,) = [d for d in os.listdir(ds) if d != "latest"]
    assert sorted(os.listdir(ds / tag)) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert open_deepspeed(str(ds / tag), validate=False).dp == 2
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], os.listdir(tmp_path)


def test_a_full_disk_during_convert_to_deepspeed_is_named_and_leaves_nothing(
    llmpar_ckpt, tmp_path, monkeypatch, capsys
):
    from llmpar.checkpoint.formats.deepspeed import files as ds_files
    from llmpar.cli import main

    src, out = llmpar_ckpt, tmp_path / "ds"
    convert.convert(src, str(out), to="deepspeed", dp=3)
    before = _tree(out)
    real_open, wrote = open, [0]

    class Full:  # a file on a disk that fills up after 4 KiB
        def __init__(self, f):
            self.f = f

        def write(self, data):
            wrote[0] += len(memoryview(data).cast("B"))
            if wrote[0] > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    monkeypatch.setattr(ds_files, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False)
    with pytest.raises(CheckpointError) as info:
        convert.convert(src, str(out), to="deepspeed", dp=2, overwrite=True)
    msg = str(info.value)
    assert f"convert: cannot write {out}/global_step2/" in msg and "No space left on device (ENOSPC)" in msg, msg
    assert f"{out} is as it was" in msg and "inline_container" not in msg
    assert _tree(out) == before and sorted(os.listdir(tmp_path)) == ["ds"]  # no .part, no new directory beside
    wrote[0] = 0
    assert main(["checkpoint", "convert", src, str(tmp_path / "other"), "--to", "deepspeed"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith(f"llmpar checkpoint convert: convert: cannot write {tmp_path / 'other'}/")
        and "ENOSPC" in err
        and "Traceback" not in err
    ), err
    assert sorted(os.listdir(tmp_path)) == ["ds"]
    # written directly (not through convert): the .part removed, the OSError names the file
    wrote[0] = 0
    with pytest.raises(OSError, match="No space left on device") as info:
        ds_files.save_pickled({"t": torch.randn(5000)}, str(tmp_path / "f.pt"))
    assert info.value.filename == str(tmp_path / "f.pt") and info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["ds"]


def test_an_in_place_export_interrupted_after_its_first_shard_leaves_no_loadable_mix(tmp_path, monkeypatch):
    """``write_hf_model`` into an existing export (``engine.save_hf_model``'s path, which keeps the directory's
    other files): a failure after its first new shard leaves no old weight file and no index, so nothing loads a mix
    (it replaced shard by shard under the old index); the other files stay."""
    from llmpar.checkpoint.formats.hf import files as hf_files

    g = torch.Generator().manual_seed(5)
    old = {f"w{i}": torch.randn(9, 11, generator=g) for i in range(4)}
    new = {n: t + 1 for n, t in old.items()}
    hf_files.write_hf_model(str(tmp_path), old, config={"model_type": "x"}, max_shard_size="400B")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 4
    real, calls = hf_files._write_tensors, [0]

    def fail_after_one(path, tensors, fmt):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.EIO, "stopped")
        real(path, tensors, fmt)

    monkeypatch.setattr(hf_files, "_write_tensors", fail_after_one)
    with pytest.raises(OSError, match="stopped"):
        hf_files.write_hf_model(str(tmp_path), new, config={"model_type": "x"}, max_shard_size="400B")
    left = sorted(os.listdir(tmp_path))
    assert left == ["config.json", "model-00001-of-00004.safetensors", "tokenizer.json"], left
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(tmp_path / "model-00001-of-00004.safetensors"))["w0"], new["w0"])


def test_a_write_error_on_a_bytes_path_is_named_under_the_output_directory(tmp_path):
    """An OSError raised on a bytes path (``e.filename`` is bytes) is named like one on a str path; it raised
    TypeError (bytes.startswith(str)) while the error was being named."""
    from llmpar.checkpoint.outdir import _named

    tmp, out = tmp_path / ".out.tmp", tmp_path / "out"
    tmp.mkdir()
    for filename in (os.fsencode(tmp / "a.bin"), str(tmp / "a.bin")):
        err = _named(OSError(errno.ENOSPC, "No space left on device", filename), str(tmp), str(out), "convert")
        assert isinstance(err, CheckpointError)
        assert f"cannot write {out / 'a.bin'}" in str(err) and "ENOSPC" in str(err)
