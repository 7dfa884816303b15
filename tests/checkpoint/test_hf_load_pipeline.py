"""Safetensors weights loaded straight into a pipeline engine (``llmpar.checkpoint.load_hf_weights``): llmpar's GPT
(the pipeline engine cuts models given as blocks; HF's Llama has none) with tied embeddings and an odd vocabulary
(padded at tp=2), its random weights written as safetensors under its own (unsplit) names in >= 2 shards, the tied head
once (``formats.hf.files.write_hf_model``), loaded into pp=2 engines built from other random weights on 4 CPU ranks:
pp=2 x tp=2 (ZeRO-1) and pp=2 x dp=2 (ZeRO-2), one after the other in the same ranks.

Each engine's first loss equals the plain model's on the files' weights (float64 reference, 1e-5 relative), and its
second (after one AdamW step from a fresh optimizer state) equals a torch AdamW step of the plain model: the
optimizer's masters took the weights too. Every rank reads only its stage's tensors: the bytes read (the reader's
counter, and a count of what ``safe_open`` handed out) are at most its stage's share (its tp cut) plus the largest
tensor, and the last stage's tied head is read from the embedding's tensor. Files of another shape are refused on
every rank naming the param, before any weight changes.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("safetensors")

from multirank import run_ranks  # noqa: E402

V, D, T, ROWS, LR = 67, 16, 8, 8, 1e-2  # vocabulary (odd: padded at tp=2), width, tokens, rows per step, AdamW lr
LAYOUTS = (("pp2-tp2", 2, 1), ("pp2-dp2", 1, 2))  # name, tp, ZeRO stage (dp = 4 / (pp tp))


def model(seed: int, dtype=torch.float32, d: int = D):
    from llmpar.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=V, n_layer=2, n_head=4, d_model=d, seq_len=T, tie_embeddings=True)
    return GPT(cfg, seed=seed, dtype=dtype)


def batch(step: int):
    g = torch.Generator().manual_seed(50 + step)
    d = torch.randint(0, V, (ROWS, T + 1), generator=g)
    return d[:, :-1], d[:, 1:]


def save(path: str, seed: int, d: int = D) -> dict[str, torch.Tensor]:
    """The GPT's weights, every one random (no zeros, no ones), as safetensors shards under its own names."""
    from llmpar.checkpoint.formats.hf import files as hf_files

    m = model(seed, d=d)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state = dict(m.state_dict())
    hf_files.write_hf_model(path, state, max_shard_size=3000 if d == D else 10**9)
    return {n: t.clone() for n, t in hf_files.untied(state).items()}


def body(good: str, bad: str) -> list[dict]:
    import safetensors
    import torch.distributed as dist

    import llmpar
    from llmpar.checkpoint import CheckpointError, load_hf_weights

    counted = {"bytes": 0, "names": set()}
    real = safetensors.safe_open

    class Counting:  # safe_open counting what it hands out (get_tensor and get_slice(...)[...])
        def __init__(self, path: str, framework: str = "pt") -> None:
            self.f = real(path, framework=framework)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def keys(self):
            return self.f.keys()

        def _count(self, name, t):
            counted["bytes"] += t.numel() * t.element_size()
            counted["names"].add(name)
            return t

        def get_tensor(self, name):
            return self._count(name, self.f.get_tensor(name))

        def get_slice(self, name):
            s, count = self.f.get_slice(name), self._count

            class Slice:
                def get_shape(self):
                    return s.get_shape()

                def get_dtype(self):
                    return s.get_dtype()

                def __getitem__(self, index):
                    return count(name, s[index])

            return Slice()

    out = []
    safetensors.safe_open = Counting
    try:
        for name, tp, stage in LAYOUTS:
            dp = dist.get_world_size() // (2 * tp)
            engine, *_ = llmpar.initialize(
                model=model(seed=5),
                config={
                    "train_micro_batch_size_per_gpu": ROWS // dp // 2,
                    "steps_per_print": 10**6,
                    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
                    "zero_optimization": {"stage": stage},
                    "tensor_parallel": {"size": tp},
                    "pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 2},
                },
            )
            counted.update(bytes=0, names=set())
            try:
                load_hf_weights(engine, bad)
                refused = ""
            except CheckpointError as e:
                refused = str(e)
            refused_bytes = counted["bytes"]
            stats = load_hf_weights(engine, good)
            dp_rank = engine.mesh["dp"].get_local_rank()
            losses = []
            for step in range(2):
                x, y = batch(step)
                n = ROWS // dp
                losses.append(
                    float(engine.train_batch(x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]))
                )
            names = sorted(set(engine.checkpoint_names().values()))
            out.append(
                {
                    "layout": name,
                    "tp": tp,
                    "pp_rank": engine.mesh["pp"].get_local_rank(),
                    "tp_rank": engine.mesh["tp"].get_local_rank() if tp > 1 else 0,
                    "losses": losses,
                    "stats": stats,
                    "counted": counted["bytes"],
                    "read": sorted(counted["names"]),
                    "names": names,
                    "refused": refused,
                    "refused_bytes": refused_bytes,
                }
            )
            dist.barrier()
    finally:
        safetensors.safe_open = real
    return out


def reference(state: dict[str, torch.Tensor]) -> list[float]:
    """The plain model on ``state``'s weights: the first loss (float64) and the loss after one torch AdamW step."""
    m = model(seed=9, dtype=torch.float64)
    m.load_state_dict({n: t.double() for n, t in state.items()}, strict=False)  # the tied head: the embedding's
    assert torch.equal(m.lm_head.weight, m.tok_emb.weight)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(2):
        x, y = batch(step)
        loss = m.loss(m(x), y)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def test_hf_weights_into_pipeline(tmp_path) -> None:
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    state = save(good, seed=3)
    save(bad, seed=4, d=D + 8)
    assert "lm_head.weight" not in state and len([f for f in os.listdir(good) if f.endswith(".safetensors")]) >= 2
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    largest = max(sizes.values())
    want = reference(state)
    results = run_ranks(body, 4, good, bad, timeout=120)
    for rank, per_layout in enumerate(results):
        for r in per_layout:
            where = f"rank {rank} ({r['layout']}, stage {r['pp_rank']})"
            assert "has full shape" in r["refused"] and "bad" in r["refused"], f"{where}: {r['refused']!r}"
            assert r["refused_bytes"] == 0, f"{where}: the refused load read {r['refused_bytes']} bytes"
            for i, (got, ref) in enumerate(zip(r["losses"], want)):
                assert abs(got - ref) <= 1e-5 * abs(ref), f"{where}: loss {i} {got} != the plain model's {ref}"
            # its stage's tensors only (the last stage's tied head read as the embedding), each cut by tp
            mine = set(r["names"]) | ({"tok_emb.weight"} if "lm_head.weight" in r["names"] else set())
            mine.discard("lm_head.weight")
            assert set(r["read"]) <= mine, f"{where}: read {sorted(set(r['read']) - mine)}, not its stage's"
            assert set(r["read"]) == {n for n in mine if n in sizes}, f"{where}: {r['read']} vs {sorted(mine)}"
            share = sum(
                sizes[n]
                // (
                    r["tp"]
                    if n.endswith(
                        (
                            "tok_emb.weight",
                            "qkv.weight",
                            "fc.weight",
                            "fc.bias",
                            "qkv.bias",
                            "attn.proj.weight",
                            "mlp.proj.weight",
                        )
                    )
                    else 1
                )
                for n in mine
            )
            assert r["counted"] == r["stats"]["bytes_read"], (where, r["counted"], r["stats"])
            assert 0 < r["stats"]["bytes_read"] <= share + largest, (
                f"{where}: read {r['stats']['bytes_read']} bytes, its stage's share {share} + largest {largest}"
            )
            assert r["stats"]["bytes_read"] < sum(sizes.values()) * 0.75, (where, r["stats"])
