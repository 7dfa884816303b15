"""HuggingFace safetensors weights loaded straight into a parallel layout (``llmpar.checkpoint.load_hf_weights``):
a tiny Llama (vocab 61, hidden 40, 2 layers, 4 heads over 2 kv heads) saved by ``save_pretrained`` in >= 2 shards,
loaded into an engine built from other random weights at tp=2 x dp=2 ZeRO-3 (4 ranks),
gives the plain model's logits (fp32, 1e-5 relative); every rank's bytes read, counted by wrapping
``safetensors.safe_open``, are at most its shard plus the largest tensor and less than half the model. A file of
another shape is refused on every rank naming the param, before any weight changes.
One multirank run per world size feeds every assertion.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from multirank import run_ranks  # noqa: E402

VOCAB, SEQ = 61, 7


def config(hidden: int = 40):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=52,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def save(path: str, seed: int, hidden: int = 40) -> None:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config(hidden))
    with torch.no_grad():  # no zeros, no ones: every tensor random
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size="40KB")


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def body(good: str, bad: str, world: int) -> dict:
    import safetensors

    import llmpar
    from llmpar.checkpoint import CheckpointError, load_hf_weights

    counted = {"bytes": 0}
    real = safetensors.safe_open

    class Counting:  # safe_open whose reads are counted (get_tensor and get_slice(...)[...])
        def __init__(self, path: str, framework: str = "pt") -> None:
            self.f = real(path, framework=framework)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            t = self.f.get_tensor(name)
            counted["bytes"] += t.numel() * t.element_size()
            return t

        def get_slice(self, name):
            s = self.f.get_slice(name)

            class Slice:
                def get_shape(self):
                    return s.get_shape()

                def get_dtype(self):
                    return s.get_dtype()

                def __getitem__(self, index):
                    t = s[index]
                    counted["bytes"] += t.numel() * t.element_size()
                    return t

            return Slice()

    safetensors.safe_open = Counting
    try:
        torch.manual_seed(1)  # other weights than the files'
        model = transformers.LlamaForCausalLM(config())
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3},
            "tensor_parallel": {"size": 2},
        }
        engine, *_ = llmpar.initialize(model=model, config=cfg)
        try:
            load_hf_weights(engine, bad)
            refused = ""
        except CheckpointError as e:
            refused = str(e)
        assert counted["bytes"] == 0, f"the refused load read {counted['bytes']} bytes of weights"
        stats = load_hf_weights(engine, good)
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=ids()).logits.detach().clone()
    finally:
        safetensors.safe_open = real
    return {"logits": logits, "bytes": counted["bytes"], "stats": stats, "refused": refused}


@pytest.mark.parametrize("world", [4])  # tp=2 x dp=2: both cuts; a 2-rank run would double the time
def test_hf_weights_into_tp_zero3(tmp_path, world: int) -> None:
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    save(good, seed=3)
    save(bad, seed=4, hidden=48)
    shards = [f for f in os.listdir(good) if f.endswith(".safetensors")]
    assert len(shards) >= 2, shards
    from safetensors import safe_open

    sizes = {}
    for f in shards:
        with safe_open(os.path.join(good, f), framework="pt") as h:
            sizes.update({n: h.get_tensor(n).numel() * 4 for n in h.keys()})
    total, largest = sum(sizes.values()), max(sizes.values())
    ref = transformers.LlamaForCausalLM.from_pretrained(good, dtype=torch.float64).eval()
    with torch.no_grad():
        want = ref(input_ids=ids()).logits
    results = run_ranks(body, world, good, bad, world, timeout=120)
    for rank, r in enumerate(results):
        assert "has full shape" in r["refused"] and "bad" in r["refused"], f"rank {rank}: {r['refused']!r}"
        got = r["logits"].double()
        assert got.shape == want.shape, f"rank {rank}: logits {tuple(got.shape)} != {tuple(want.shape)}"
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= 1e-5, f"rank {rank} (world {world}): logits differ by {err:.2e} (relative to max)"
        tp, dp = 2, world // 2  # split params: 1/(tp dp) of their elements per rank, the norms 1/dp
        shard = (
            sum(v for n, v in sizes.items() if "norm" not in n) // tp + sum(v for n, v in sizes.items() if "norm" in n)
        ) // dp
        assert r["bytes"] == r["stats"]["bytes_read"], (r["bytes"], r["stats"])
        assert 0 < r["bytes"] <= shard + largest, (
            f"rank {rank}: read {r['bytes']} bytes, shard {shard} + largest tensor {largest}"
        )
        assert r["bytes"] <= total / world + largest, f"rank {rank}: read {r['bytes']} of the model's {total} bytes"


# ---------------------------------------------------------------- bounded-memory convert (DeepSpeed -> HF)
def write_zero3(d, params: dict, dp: int, stage=None, buffers: dict | None = None, shared: dict | None = None):
    """A DeepSpeed ZeRO-3 checkpoint of ``params`` ({name: fp32 tensor}) at ``dp`` written by hand in DeepSpeed
    0.19's layout (``formats/deepspeed/files.py``): each param cut into ``ceil(numel / dp)`` chunks (the last padded),
    rank R's flat the concat of its chunks. ``stage``: the pickled zero_stage object (DeepSpeed's ZeroStageEnum(3) for
    DeepSpeed's own reader; None: a stand-in pickled as ``deepspeed.ZeroStageEnum``, read without DeepSpeed)."""
    import types
    from unittest import mock

    class ZeroStageEnum:
        def __init__(self, value):
            self.value = value

        def __reduce__(self):
            return (ZeroStageEnum, (self.value,))

    ZeroStageEnum.__module__, ZeroStageEnum.__qualname__ = "deepspeed", "ZeroStageEnum"
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(os.path.dirname(d), "latest"), "w") as f:
        f.write(os.path.basename(d))
    with (
        mock.patch.dict("sys.modules", {"deepspeed": types.SimpleNamespace(ZeroStageEnum=ZeroStageEnum)})
        if stage is None
        else _nothing()
    ):
        for r in range(dp):
            parts = []
            for t in params.values():
                c = -(-t.numel() // dp)
                flat = torch.cat([t.reshape(-1).float(), torch.zeros(c * dp - t.numel())])
                parts.append(flat[r * c : (r + 1) * c])
            torch.save(
                {
                    "optimizer_state_dict": {
                        "zero_stage": stage if stage is not None else ZeroStageEnum(3),
                        "partition_count": dp,
                        "fp32_flat_groups": [torch.cat(parts)],
                        "optimizer_state_dict": {"state": {}, "param_groups": [{"params": [0]}]},
                    }
                },
                os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"),
            )
            del parts
            torch.save(
                {
                    "module": dict(buffers or {}),
                    "buffer_names": list(buffers or {}),
                    "param_shapes": [{n: t.shape for n, t in params.items()}],
                    "frozen_param_shapes": None,
                    "shared_params": dict(shared or {}),
                    "ds_version": "0.19.8",
                    "global_steps": 1,
                },
                os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"),
            )


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_convert_streams_zero3_to_hf(tmp_path, monkeypatch) -> None:
    """A hand-made ZeRO-3 checkpoint (dp=3, odd shapes, a tied copy, a buffer) converted in pieces of 50 elements
    with the source reopened along the way: the same files, index and tensors (bitwise) as the whole-state
    export, in fp32 and bf16; no read takes more than a piece (a param is never gathered whole); a byte changed
    on disk, or a tensor of another value, is caught by the check naming the tensor."""
    from safetensors.torch import load_file

    from llmpar.checkpoint import CheckpointError, convert
    from llmpar.checkpoint.formats.deepspeed.rank import RankCheckpoint
    from llmpar.checkpoint.formats.hf import files as hf_files
    from llmpar.checkpoint.formats.hf import stream as hf_stream
    from llmpar.checkpoint.formats.hf import write as hf_write
    from llmpar.checkpoint.formats.open import open_source
    from llmpar.checkpoint.formats.source import locate, weights

    g = torch.Generator().manual_seed(7)
    params = {
        "emb.weight": torch.randn(61, 13, generator=g),
        "h.0.w": torch.randn(29, 13, generator=g),
        "h.0.b": torch.randn(29, generator=g),
        "h.1.w": torch.randn(13, 29, generator=g),
        "norm": torch.randn(13, generator=g).double().float(),
    }
    buffers = {"mask": torch.randint(0, 2, (5, 5), generator=g).bool()}
    d = str(tmp_path / "ds" / "global_step1")
    write_zero3(d, params, 3, buffers=buffers, shared={"head.weight": "emb.weight"})
    reads, opens, real_read, real_init, real_release = (
        [],
        [0],
        RankCheckpoint.read,
        RankCheckpoint.__init__,
        RankCheckpoint.release,
    )

    def read(self, name, key, a, z):
        reads.append(z - a)
        return real_read(self, name, key, a, z)

    def init(self, *args, **kwargs):  # the files opened
        opens[0] += 1
        real_init(self, *args, **kwargs)

    def release(self, name=""):  # the files let go, opened again at the next read
        opens[0] += not name
        real_release(self, name)

    monkeypatch.setattr(RankCheckpoint, "read", read)
    monkeypatch.setattr(RankCheckpoint, "__init__", init)
    monkeypatch.setattr(RankCheckpoint, "release", release)
    monkeypatch.setattr(hf_write, "PIECE", 50)
    monkeypatch.setattr(hf_write, "REOPEN_MIN", 1)
    for dtype in (None, torch.bfloat16):
        out, ref_dir = str(tmp_path / f"out{dtype}"), str(tmp_path / f"ref{dtype}")
        opens[0] = 0
        written = convert.convert(str(tmp_path / "ds"), out, dtype=dtype, max_shard_size="3KB")
        assert max(reads) <= 50 and opens[0] >= 3, (max(reads), opens[0])  # reopened along the way
        state = weights(open_source(locate(d)), dtype)
        want = hf_files.write_hf_model(ref_dir, state, dtype=dtype, max_shard_size="3KB")
        assert [os.path.basename(p) for p in written] == [os.path.basename(p) for p in want]
        assert len(written) >= 3, written
        with open(written[-1]) as f, open(want[-1]) as h:
            assert f.read() == h.read()  # the index
        for p in written[:-1]:
            got = load_file(p)
            ref = load_file(os.path.join(ref_dir, os.path.basename(p)))
            assert got.keys() == ref.keys() and all(
                got[n].dtype == ref[n].dtype and torch.equal(got[n], ref[n]) for n in ref
            ), p
        reads.clear()
    src = hf_write._Stream(open_source(locate(d)), None, 1 << 30)
    names = list(load_file(written[0]))
    bf16 = hf_write._Stream(open_source(locate(d)), torch.bfloat16, 1 << 30)
    crcs = {n: hf_stream.digest(hf_stream.as_bytes(src.tensor(n).to(torch.bfloat16))) for n in names}
    hf_stream.check_file(written[0], bf16.meta, names, crcs)
    hf_stream.sample(written[0], bf16, names)
    with open(written[0], "r+b") as f:  # one byte of the last tensor's data
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(CheckpointError, match=f"bytes of '{names[-1]}' read back"):
        hf_stream.check_file(written[0], bf16.meta, names, crcs)
    with pytest.raises(CheckpointError, match="is BF16 .*, the source torch.float32"):
        hf_stream.check_file(written[0], hf_write._Stream(open_source(locate(d)), None, 1 << 30).meta, names, crcs)
    with open(written[0], "r+b") as f:  # the byte restored; then the file cut short by one byte
        f.seek(-1, os.SEEK_END)
        f.write(last)
    with open(written[0], "rb") as f:
        whole = f.read()
    with open(written[0], "wb") as f:
        f.write(whole[:-1])
    with pytest.raises(CheckpointError, match="cannot be parsed|is [0-9]+ bytes, the plan"):
        hf_stream.check_file(written[0], bf16.meta, names, crcs)
    with open(written[0], "wb") as f:
        f.write(whole)
    other = str(tmp_path / "other" / "global_step1")  # the same shapes, other values
    write_zero3(other, {n: t + 1 for n, t in params.items()}, 3, buffers=buffers, shared={"head.weight": "emb.weight"})
    with pytest.raises(CheckpointError, match="in .* differs from the source"):
        hf_stream.sample(written[0], hf_write._Stream(open_source(locate(other)), torch.bfloat16, 1 << 30), names)


@pytest.mark.parametrize("digest", ["default", "crc32"])
@pytest.mark.parametrize("what", ["bytes", "lost"])
def test_convert_catches_a_corrupted_write(tmp_path, monkeypatch, what, digest) -> None:
    """A write that puts a wrong byte in the file (one flipped bit in one tensor's bytes), or a write lost (a hole
    of zeros in the file), is caught by the convert itself: a CheckpointError naming the tensor, no file of that
    export left in place, no ``.tmp`` left; with the default digest (XXH3-64 where xxhash is installed) and CRC-32."""
    from llmpar.checkpoint import CheckpointError, convert
    from llmpar.checkpoint.formats.hf import stream as hf_stream
    from llmpar.checkpoint.formats.hf import write as hf_write

    g = torch.Generator().manual_seed(11)
    params = {
        "a": torch.randn(37, 5, generator=g),
        "b": torch.randn(23, generator=g),
        "c": torch.randn(9, 7, generator=g),
    }
    write_zero3(str(tmp_path / "ds" / "global_step1"), params, 2)
    real, calls = hf_stream.pwrite_all, [0]

    def bad(fd, data, at):
        calls[0] += 1
        if calls[0] == 3:  # a piece of a tensor's bytes (the header is the first write)
            if what == "bytes":
                data = bytearray(data)
                data[len(data) // 2] ^= 4
                data = memoryview(data)
            else:
                return
        real(fd, data, at)

    monkeypatch.setattr(hf_stream, "pwrite_all", bad)
    if digest == "crc32":
        monkeypatch.setattr(hf_stream, "new_digest", hf_stream.Crc32)
    monkeypatch.setattr(hf_write, "PIECE", 64)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="bytes of '[abc]' read back from .* differ"):
        convert.convert(str(tmp_path / "ds"), str(out), max_shard_size="1KB")
    assert calls[0] >= 3
    assert not out.exists() and os.listdir(tmp_path) == ["ds"], os.listdir(tmp_path)  # nothing of it left
