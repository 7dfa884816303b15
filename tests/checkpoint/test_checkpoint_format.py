"""Checkpoint format 3: rank files in llmpar's block format (``llmpar/checkpoint/blockfile.py``, ``blockwrite.py``).

* round trip of every dtype (bf16, fp16, float64, ints, bool, complex), odd shapes, 0-element and 0-dim tensors,
  non-contiguous views and multi-piece records (``Concat``), across block boundaries, hashed inline or in a thread;
* a flipped byte anywhere (data, padding, index, header, trailer) and a truncated or extended file are errors naming
  the file; a reader verifies only the blocks it reads, each once;
* through the checkpoint code (the one-process fake engine): a corrupt or truncated rank file fails the load naming
  the file, before anything is modified; checkpoints of formats 2 and 1 (``.pt`` rank files by ``torch.save``) still
  load and consolidate;
* ZeRO's ``checkpoint_shard_views`` are the live buffers (a synchronous save copies nothing) and equal
  ``checkpoint_shards``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch
from test_checkpoint_protocol import FakeEngine, _same

from llmpar.checkpoint import CheckpointError, load_checkpoint, metacheck, save_checkpoint
from llmpar.checkpoint import blockfile as bf
from llmpar.checkpoint import blockwrite as bw
from llmpar.checkpoint import files as ckfiles
from llmpar.checkpoint.consolidate import consolidated_state_dict

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g, dtype=dtype)


def _obj(seed: int = 0) -> dict:
    shapes = [(5,), (123,), (4097,), (3, 7), (2, 3, 5), (0,), (4, 0), ()]
    tensors = {f"{str(dt)[6:]}_{i}": _rand(s, dt, seed + 10 * i) for dt in DTYPES for i, s in enumerate(shapes)}
    base = torch.randn(6, 9, generator=torch.Generator().manual_seed(seed))
    return {
        "tensors": tensors,
        "t_view": base.t(),
        "slice": base[1:4, 2:7],
        "none": None,
        "f": 1.5,
        "nan": float("nan"),
        "inf": -math.inf,
        "s": "text",
        "b": True,
        "i": 2**70,
        "list": [1, (2, 3), []],
        "concat": bf.Concat([base[0], base[2, 3:], torch.randn(0)]),
        "nested": {"x": {"y": [base[5]]}},
    }


def _check(got: dict, want: dict) -> None:
    for k, t in want["tensors"].items():
        g = got["tensors"][k]
        assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, t), k
    assert torch.equal(got["t_view"], want["t_view"]) and torch.equal(got["slice"], want["slice"])
    assert torch.equal(got["concat"], want["concat"].tensor()) and torch.equal(
        got["nested"]["x"]["y"][0], want["nested"]["x"]["y"][0]
    )
    assert got["none"] is None and got["f"] == 1.5 and math.isnan(got["nan"]) and got["inf"] == -math.inf
    assert (got["s"], got["b"], got["i"], got["list"]) == ("text", True, 2**70, [1, [2, 3], []])


@pytest.mark.parametrize("block, threads", [(bf.BLOCK, None), (64, 1), (100, 0), (4096, 3)])
def test_round_trip_every_dtype_and_shape(block, threads, tmp_path):
    want = _obj(1)
    info = bw.write(str(tmp_path / "f.shard"), want, block=block, threads=threads)
    assert info["bytes"] == (tmp_path / "f.shard").stat().st_size
    got = bf.load(str(tmp_path / "f.shard"), info)
    _check(got, want)
    got["tensors"]["float32_0"].add_(1)  # tensors of a file are writable (a private mapping), the file unchanged
    _check(bf.load(str(tmp_path / "f.shard"), info), want)


def test_reads_verify_only_the_blocks_they_touch(tmp_path):
    a, b = torch.arange(1000, dtype=torch.float32), torch.arange(1000, dtype=torch.float64)
    info = bw.write(str(tmp_path / "f.shard"), {"a": a, "b": b}, block=512)
    f = bf.BlockFile(str(tmp_path / "f.shard"), info)
    rec = f.value()
    assert torch.equal(rec["a"].read(10, 20), a[10:20]) and sum(f.verified) == 1  # elements 10-19: one block
    _, _, offset, nbytes = f.records[1]
    span = (offset + nbytes - 1 - 16) // 512 - (offset - 16) // 512 + 1  # the blocks b's bytes overlap
    assert torch.equal(bf.elements(rec["b"], 0, 1000), b) and sum(f.verified) == 1 + span
    with open(tmp_path / "f.shard", "r+b") as fh:  # corrupt b's last element: a still reads
        fh.seek(offset + 999 * 8)
        fh.write(b"\xff")
    f = bf.BlockFile(str(tmp_path / "f.shard"), info)
    assert torch.equal(f.value()["a"].tensor(), a)
    assert torch.equal(f.value()["b"].read(0, 900), b[:900])
    with pytest.raises(bf.CorruptFile, match="f.shard"):
        f.value()["b"].read(990, 1000)


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["header", "data", "padding", "index", "trailer", "last"])
def test_a_flipped_byte_anywhere_is_detected(where, tmp_path):
    path = tmp_path / "f.shard"
    info = bw.write(str(path), {"a": torch.randn(3), "b": torch.randn(100)}, block=64)
    f = bf.BlockFile(str(path), info)
    size = path.stat().st_size
    at = {
        "header": 9,
        "data": f.records[1][2] + 5,
        "padding": f.records[0][2] + 12 + 3,
        "index": f.data_end + 7,
        "trailer": size - 12,
        "last": size - 1,
    }[where]
    _flip(path, at)
    with pytest.raises(CheckpointError, match="f.shard.*corrupt"):
        bf.load(str(path), info)


@pytest.mark.parametrize("cut", [1, 20, 400, -7])
def test_a_truncated_or_extended_file_is_detected(cut, tmp_path):
    path = tmp_path / "f.shard"
    info = bw.write(str(path), {"a": torch.randn(300)}, block=256)
    data = path.read_bytes()
    path.write_bytes(data[:-cut] if cut > 0 else data + bytes(-cut))
    with pytest.raises(bf.CorruptFile, match="f.shard"):
        bf.load(str(path), info)
    with pytest.raises(bf.CorruptFile, match="f.shard"):  # without the recorded size: the structure says it
        bf.load(str(path))


def test_what_cannot_be_written_is_named(tmp_path):
    with pytest.raises(TypeError, match=r"obj\['x'\]\[1\]"):
        bw.write(str(tmp_path / "f.shard"), {"x": [1, object()]})
    with pytest.raises(TypeError, match="keys must be str"):
        bw.write(str(tmp_path / "f.shard"), {1: torch.zeros(1)})
    with pytest.raises(ValueError, match="one dtype"):
        bf.Concat([torch.zeros(1), torch.zeros(1, dtype=torch.float64)])


# ---------------------------------------------------------------------------------------------------- checkpoints
def downgrade(path: Path, fmt: int) -> None:
    """Rewrite checkpoint ``path`` (format 3) as llmpar wrote it in format ``fmt`` (2: ``.pt`` rank files by
    ``torch.save`` with their whole sha256, metadata digest; 1: the same without the digest)."""
    meta = json.loads((path / ckfiles.METADATA).read_text())
    out = {}
    for name, entry in meta["files"].items():
        if "index_sha256" not in entry:
            out[name] = entry
            continue
        obj = bf.load(str(path / name), entry)
        old = name.removesuffix(".shard") + ".pt"
        torch.save(obj, path / old)
        os.remove(path / name)
        digest, n = ckfiles.sha256_file(str(path / old))
        out[old] = {k: v for k, v in entry.items() if k not in ("index_sha256", "bytes")} | {
            "sha256": digest,
            "bytes": n,
        }
    meta.update(files=out, format=fmt)
    meta.pop("digest", None)
    if fmt >= 2:
        meta["digest"] = "sha256:" + hashlib.sha256(metacheck._canonical(meta)).hexdigest()
    (path / ckfiles.METADATA).write_text(json.dumps(meta, indent=1))


@pytest.mark.parametrize("fmt", [1, 2])
def test_checkpoints_of_older_formats_still_load(fmt, tmp_path):
    src = FakeEngine(3)
    rng = torch.get_rng_state()
    path = Path(save_checkpoint(src, tmp_path, client_state={"pos": 4}))
    assert sorted(os.listdir(path)) == ["client_state.pt", "dp000-tp00.shard", "metadata.json"]
    downgrade(path, fmt)
    assert sorted(os.listdir(path)) == ["client_state.pt", "dp000-tp00.pt", "metadata.json"]
    got = FakeEngine(9)
    torch.manual_seed(1234)
    _, client = load_checkpoint(got, tmp_path)
    _same(src, got)
    assert client == {"pos": 4} and torch.equal(torch.get_rng_state(), rng)  # this rank's file found: RNG restored
    full = consolidated_state_dict(path)
    assert sorted(full) == ["b", "f", "running", "w"] and torch.equal(full["w"], src.module.w)
    if fmt == 2:  # a format-2 rank file is still checked whole
        _flip(path / "dp000-tp00.pt", (path / "dp000-tp00.pt").stat().st_size // 2)
        with pytest.raises(CheckpointError, match="dp000-tp00.pt is corrupt"):
            load_checkpoint(FakeEngine(9), tmp_path)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_rank_file_fails_the_load_naming_it_before_anything_changes(damage, tmp_path):
    src = FakeEngine(3)
    path = Path(save_checkpoint(src, tmp_path))
    victim = path / "dp000-tp00.shard"
    f = bf.BlockFile(str(victim))
    exp_avg = f.value()["buffers"][0]["exp_avg"].index
    if damage == "flip":
        _flip(victim, f.records[exp_avg][2] + 13)
    else:
        os.truncate(victim, victim.stat().st_size - 3)
    got, before = FakeEngine(9), FakeEngine(9)
    with pytest.raises(CheckpointError, match=r"dp000-tp00.shard is corrupt"):
        load_checkpoint(got, tmp_path)
    _same(before, got)  # nothing was modified
    with pytest.raises(CheckpointError, match=r"dp000-tp00.shard is corrupt"):
        consolidated_state_dict(path)


# ---------------------------------------------------------------------------------------------------- ZeRO's views
def views_body(stage, bf16):
    from test_checkpoint import _engine, _train

    engine, model = _engine(stage, bf16=bf16)
    _train(engine, model, 0, 1)
    opt = engine.optimizer
    views, shards = opt.checkpoint_shard_views(), opt.checkpoint_shards()
    if views is None:
        return shards is None
    live = [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        for b in opt.buffers
        for t in [b.flat, *(() if b.shard is None else [b.shard]), *b.state.values()]
    ]
    for entry, copy in zip(views, shards):
        assert sorted(entry) == sorted(copy)
        for key, pieces in entry.items():
            assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), copy[key]), key
            if key != "steps":  # views of the live buffers: a synchronous save copies nothing
                assert all(any(a <= p.data_ptr() < a + n for a, n in live) for p in pieces), key
            assert all(copy[key].untyped_storage().data_ptr() != a for a, _ in live), key  # shards: fresh
    return True


@pytest.mark.parametrize("stage, bf16", [(0, False), (2, False), (2, True), (3, False)])
def test_zero_shard_views_are_the_live_buffers_and_equal_the_shards(stage, bf16):
    from multirank import run_ranks

    assert all(run_ranks(views_body, 2, stage, bf16, timeout=120))


# ---------------------------------------------------------------------------------------------------- shared hashing
def shared_body(root, corrupt):
    import torch.distributed as dist
    from test_checkpoint import _engine, _train

    engine, model = _engine(2)
    _train(engine, model, 0, 2)
    path = Path(engine.save_checkpoint(root))
    dist.barrier()
    if corrupt and dist.get_rank() == 0:  # params of rank 1's file: rank 0 reads them too, rank 1 hashes them
        f = bf.BlockFile(str(path / "dp001-tp00.shard"))
        _flip(path / "dp001-tp00.shard", f.records[f.value()["buffers"][0]["params"].index][2] + 40)
    dist.barrier()
    hashed: dict[str, int] = {}
    real = bf.BlockFile.verify_blocks

    def counting(self, blocks):
        blocks = list(blocks)
        n = sum(1 for k in blocks if not self.verified[k])
        if n:
            hashed[os.path.basename(self.path)] = hashed.get(os.path.basename(self.path), 0) + n
        return real(self, blocks)

    bf.BlockFile.verify_blocks = counting
    try:
        engine.load_checkpoint(root)
        return hashed, None
    except CheckpointError as e:
        return hashed, str(e)
    finally:
        bf.BlockFile.verify_blocks = real


@pytest.mark.parametrize("corrupt", [False, True])
def test_ranks_share_the_hashing_and_agree_on_a_corrupt_block(corrupt, tmp_path):
    """ZeRO-2 at dp=2: each rank reads every param (both files) but hashes only its own file; a corrupt block of
    rank 1's params, read by both, is found by rank 1 and named on both."""
    from multirank import run_ranks

    for rank, (hashed, err) in enumerate(run_ranks(shared_body, 2, str(tmp_path), corrupt, timeout=120)):
        assert set(hashed) == {f"dp00{rank}-tp00.shard"}, (rank, hashed)
        if corrupt:
            assert err is not None and "dp001-tp00.shard is corrupt" in err, (rank, err)
        else:
            assert err is None, err


def test_blocks_nobody_wrote_are_spread_over_the_ranks_that_read_them(tmp_path):
    """Two readers of a file neither wrote (a tp=2 checkpoint loaded at tp=1 x dp=2): each block hashed once, the
    blocks alternating between them; the writer, when it reads a block, hashes it."""
    from llmpar.checkpoint.shards import RankFiles

    info = bw.write(str(tmp_path / "f.shard"), {"x": torch.randn(5 * bf.BLOCK // 4)})  # 6 blocks
    meta = {"files": {"f.shard": {**info, "dp_rank": 0, "tp_rank": 1, "pp_rank": 0}}}
    for owner in (None, 1):
        readers = [RankFiles(str(tmp_path), meta) for _ in range(2)]
        for r in readers:
            r.record(True)
            r.tree("f.shard")["x"].read()
        bids = [r.claims(lambda name, i=i: i == owner, i, 2) for i, r in enumerate(readers)]
        top = torch.maximum(*bids)
        for i, r in enumerate(readers):
            r.verify_mine(top, lambda name, i=i: i == owner, i, 2)
        done = [list(r._blocks["f.shard"].verified) for r in readers]
        assert all(a + b == 1 for a, b in zip(*done)), done  # each block hashed once
        assert done[1] == [1] * 6 if owner == 1 else done[0] == [1, 0, 1, 0, 1, 0], done


def test_without_early_writeback_or_hash_threads(monkeypatch, tmp_path):
    """Where ``sync_file_range`` is missing (not Linux) and no thread can start, the file is the same."""
    want = _obj(2)
    info = bw.write(str(tmp_path / "a.shard"), want, block=256)
    monkeypatch.setattr(bw, "_writeback", lambda: None)
    monkeypatch.setattr(bf.threading.Thread, "start", lambda self: (_ for _ in ()).throw(RuntimeError("shutdown")))
    assert bw.write(str(tmp_path / "b.shard"), want, block=256, threads=2) == info
    assert (tmp_path / "a.shard").read_bytes() == (tmp_path / "b.shard").read_bytes()
    _check(bf.load(str(tmp_path / "b.shard"), info), want)
