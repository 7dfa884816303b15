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
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=52, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    tie_word_embeddings=False)


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
            s, outer = self.f.get_slice(name), self

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
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3}, "tensor_parallel": {"size": 2}}
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
        shard = (sum(v for n, v in sizes.items() if "norm" not in n) // tp
                 + sum(v for n, v in sizes.items() if "norm" in n)) // dp
        assert r["bytes"] == r["stats"]["bytes_read"], (r["bytes"], r["stats"])
        assert 0 < r["bytes"] <= shard + largest, f"rank {rank}: read {r['bytes']} bytes, shard {shard} + " \
                                                  f"largest tensor {largest}"
        assert r["bytes"] <= total / world + largest, f"rank {rank}: read {r['bytes']} of the model's {total} bytes"
