"""Checkpoint resharding across tensor- and pipeline-parallel degrees on CPU/gloo ranks, float64 GPTs whose vocabulary
(67) does not divide by tp, so the vocab-parallel padding is exercised:

* tp 2 -> 1 -> 2 -> 4 (with dp and ZeRO stages changing too): save at step k, load at the next layout, continue:
  losses equal an uninterrupted tp=2 x dp=2 run (1e-6 relative; fp64);
* pp 2 (x tp 2, tied embeddings) -> plain engine pp 1 -> pp 2 (x dp 2): the same against an uninterrupted pipeline run;
* a pp=2 x tp=2 (async) save / load roundtrip continues bitwise, with one file per rank and the tied weight written
  once;
* the consolidated state dict of a tp=2 and of a pp=2 x tp=2 checkpoint equals the full model gathered from the live
  ranks, exactly;
* a param whose full shape differs raises a CheckpointError naming it, on every rank.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

import llmpar
from llmpar.checkpoint import blockfile
from llmpar.checkpoint import files as ckfiles
from llmpar.models import GPT, GPTConfig

from multirank import run_ranks

T, ROWS, V = 8, 8, 67  # tokens, rows per step (all dp ranks together), vocabulary (odd: padded at tp = 2, 4)


def _model(tie, vocab=V, seed=0):
    cfg = GPTConfig(vocab_size=vocab, n_layer=2, n_head=4, d_model=16, seq_len=T, tie_embeddings=tie)
    return GPT(cfg, seed=seed, dtype=torch.float64)


def _config(stage, micro, extra=None):
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 900, "stage3_param_persistence_threshold": 100},
        **(extra or {}),
    }


def _batch(step, dp_rank, dp, vocab=V):
    g = torch.Generator().manual_seed(100 + step)
    d = torch.randint(0, vocab, (ROWS, T + 1), generator=g)
    n = ROWS // dp
    return d[dp_rank * n : (dp_rank + 1) * n, :-1], d[dp_rank * n : (dp_rank + 1) * n, 1:]


class Run:
    """An engine of one layout: ("plain", tp, stage) or ("pipe", pp, tp, stage) on this world; ``step(s)`` trains
    global step s on its dp rank's rows and returns the step's mean loss over all rows."""

    def __init__(self, layout, tie, seed=0, vocab=V):
        self.vocab = vocab
        if layout[0] == "pipe":
            _, pp, tp, stage = layout
            dp, m = dist.get_world_size() // (pp * tp), 2
            extra = {
                "pipeline": {"stages": pp, "schedule": "1f1b", "micro_batches": m},
                "tensor_parallel": {"size": tp},
            }
            self.engine, *_ = llmpar.initialize(
                model=_model(tie, vocab, seed), config=_config(stage, ROWS // dp // m, extra)
            )
            self.mesh = self.engine.mesh
        else:
            _, tp, stage = layout
            env = llmpar.init_distributed(tp=tp)
            self.mesh, dp = env.mesh, env.mesh["dp"].size()
            self.model = _model(tie, vocab, seed)
            if tp > 1:
                llmpar.parallelize(self.model, env.mesh["tp"])
            self.engine, *_ = llmpar.initialize(model=self.model, config=_config(stage, ROWS // dp), mesh=env.mesh)
        self.pipe, self.dp, self.dp_rank = layout[0] == "pipe", dp, self.mesh["dp"].get_local_rank()

    def step(self, s):
        x, y = _batch(s, self.dp_rank, self.dp, self.vocab)
        if self.pipe:
            return float(self.engine.train_batch(x, y))
        loss = self.model.loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t, group=self.mesh["dp"].get_group())
        return t.item() / self.dp

    def train(self, a, b):
        return [self.step(s) for s in range(a, b)]


def segment_body(layout, tie, load_from, save_to, start, stop):
    run = Run(layout, tie, seed=0 if load_from is None else 5)  # another seed: the load must overwrite everything
    if load_from is not None:
        run.engine.load_checkpoint(load_from)
        assert run.engine.global_steps == start
    losses = run.train(start, stop)
    if save_to is not None:
        run.engine.save_checkpoint(save_to)
    return losses


CHAINS = {  # layouts in turn (world size, layout); the first one's uninterrupted run is the reference
    # tp 2 -> 1 -> 2 -> 4: tp2 x dp2 ZeRO-2, tp1 x dp2 ZeRO-3, tp2 x dp1 ZeRO-1, tp4 x dp1 ZeRO-2
    "tp": (False, [(4, ("plain", 2, 2)), (2, ("plain", 1, 3)), (2, ("plain", 2, 1)), (4, ("plain", 4, 2))]),
    # tied embeddings: tp 2 -> 1 -> 2 (tp2 ZeRO-2, tp1 ZeRO-1, tp2 ZeRO-3)
    "tp-tied": (True, [(2, ("plain", 2, 2)), (1, ("plain", 1, 1)), (2, ("plain", 2, 3))]),
    # pp 2 -> 1 -> 2: pp2 x tp2 ZeRO-1 (tied embeddings), plain engine on one rank, pp2 x dp2 ZeRO-2
    "pp": (True, [(4, ("pipe", 2, 2, 1)), (1, ("plain", 1, 2)), (4, ("pipe", 2, 1, 2))]),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_reshard_chain_continues_like_one_run(name, tmp_path):
    k = 2
    tie, chain = CHAINS[name]
    world0, layout0 = chain[0]
    ref = run_ranks(segment_body, world0, layout0, tie, None, None, 0, k * len(chain), timeout=300)[0]
    got, prev = [], None
    for i, (world, layout) in enumerate(chain):
        save = str(tmp_path / f"seg{i}") if i + 1 < len(chain) else None
        outs = run_ranks(segment_body, world, layout, tie, prev, save, i * k, (i + 1) * k, timeout=300)
        assert all(o == outs[0] for o in outs), outs  # every rank reports the same global loss
        got += outs[0]
        prev = save
    assert got[:k] == ref[:k]
    diff = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    print(f"{name}: max relative loss diff after resharding: {diff:.3g}")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-6, atol=0)


def roundtrip_body(root, k):
    run = Run(("pipe", 2, 2, 1), tie=True)
    ref = run.train(0, k)
    run.engine.save_checkpoint(root, client_state={"pos": k}, async_save=True)  # written while training goes on
    ref += run.train(k, 2 * k)
    assert run.engine.wait_checkpoint() == os.path.join(root, f"global_step{k}")
    fresh = Run(("pipe", 2, 2, 1), tie=True, seed=5)
    _, client = fresh.engine.load_checkpoint(root)
    assert client == {"pos": k} and fresh.engine.global_steps == k
    return ref[k:], fresh.train(k, 2 * k)


def test_pp2_tp2_roundtrip_is_bitwise(tmp_path):
    k = 2
    for rank, (ref, resumed) in enumerate(run_ranks(roundtrip_body, 4, str(tmp_path), k, timeout=300)):
        assert ref == resumed, f"rank {rank}: {ref} != {resumed}"
    ckpt = tmp_path / f"global_step{k}"
    shards = sorted(f for f in os.listdir(ckpt) if f.endswith(".shard"))
    assert shards == [ckfiles.rank_file(0, t, p, 2) for p in range(2) for t in range(2)]
    assert shards[0] == "pp00-dp000-tp00.shard"
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert (meta["pp"], meta["tp"], meta["dp"]) == (2, 2, 1)
    names = [s["name"] for b in meta["layout"]["buffers"] for s in b["params"] if not s.get("dup")]
    assert sorted(names) == sorted(n for n, _ in _model(True).named_parameters())  # unsplit names, tied once
    emb = next(s for b in meta["layout"]["buffers"] for s in b["params"] if s["name"] == "tok_emb.weight")
    assert emb["tp"] == {"dim": 0, "full": V, "padded": V + 1} and emb["shape"] == [(V + 1) // 2, 16]
    for p in range(2):  # the last stage's tied copy (lm_head) is cut out of its files: written once
        bufs = blockfile.load(str(ckpt / ckfiles.rank_file(0, 0, p, 2)))["buffers"]
        cut = sum(int(b["holes"][:, 1].sum()) for b in bufs if "holes" in b)
        assert cut == (0 if p == 0 else (V + 1) // 2 * 16), (p, cut)


def _full_name(local):
    """A pipeline stage module's param name -> the GPT's ("embed.tok_emb.weight" -> "tok_emb.weight")."""
    block, rest = local.split(".", 1)
    if block in ("embed", "head"):
        return rest
    return block.replace("_", ".") + "." + rest


def consolidate_body(root, layout, tie):
    run = Run(layout, tie)
    run.train(0, 2)
    run.engine.save_checkpoint(root)
    if run.pipe:
        split = run.engine.runner.split
        named = [(_full_name(n), p) for m in split.modules for n, p in m.named_parameters()]
        tp_group, tp = split.tp_group, split.tp
    else:
        named, tp = list(run.model.named_parameters()), run.mesh["tp"].size()
        tp_group = run.mesh["tp"].get_group() if tp > 1 else None
    full_shapes = {n: p.shape for n, p in _model(tie).named_parameters()}
    out = {}
    for name, p in named:  # the same order on every tp rank: the all-gathers line up
        name = "tok_emb.weight" if tie and name == "lm_head.weight" else name  # the last stage's tied copy
        t = p.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, p.partition_dim)
        for dim, size in enumerate(full_shapes[name]):
            t = t.narrow(dim, 0, size)  # vocabulary padding dropped
        out.setdefault(name, t.clone())
    return out


@pytest.mark.parametrize(
    "layout, tie", [(("plain", 2, 2), False), (("pipe", 2, 2, 1), True)], ids=["tp2-dp2", "pp2-tp2-tied"]
)
def test_consolidate_equals_gathered_model(layout, tie, tmp_path):
    from llmpar.cli import main

    outs = run_ranks(consolidate_body, 4, str(tmp_path / "ck"), layout, tie, timeout=300)
    gathered = {}
    for o in outs:  # pipeline: each pp rank holds its stages' params (both copies of a tied weight: equal)
        for n, t in o.items():
            assert torch.equal(gathered.setdefault(n, t), t), n
    assert main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(tmp_path / "out"), "--dtype", "keep"]) == 0
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(sd) == sorted(gathered)
    for name, t in gathered.items():
        assert sd[name].dtype == torch.float64 and torch.equal(sd[name], t), name
    plain = _model(tie, seed=9)
    missing, unexpected = plain.load_state_dict(sd, strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if tie else [])  # a tied weight appears once


def mismatch_body(root):
    world = dist.get_world_size()
    run = Run(("plain", 2, 2), tie=False)
    run.train(0, 1)
    run.engine.save_checkpoint(root)
    dist.barrier()
    other = Run(("plain", 1, 2), tie=False, vocab=V - 1)  # tp 2 -> 1 but a vocabulary of 66 rows, not 67
    try:
        other.engine.load_checkpoint(root)
    except ckfiles.CheckpointError as e:
        return str(e), world
    return None, world


def test_shape_mismatch_that_cannot_be_resharded_is_a_clear_error_on_every_rank(tmp_path):
    for rank, (msg, _) in enumerate(run_ranks(mismatch_body, 2, str(tmp_path), timeout=300)):
        assert msg is not None, f"rank {rank} loaded a checkpoint of another vocabulary"
        assert "cannot be resharded" in msg and "full shape" in msg, (rank, msg)
        assert "'tok_emb.weight'" in msg or "'lm_head.weight'" in msg, (rank, msg)
