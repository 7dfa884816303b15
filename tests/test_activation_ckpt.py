"""The "activation_checkpointing" block: which blocks are recomputed, gradients equal to the run without it (float64,
dropout on: the recompute replays the RNG), the activation bytes kept by the forward (measured with saved-tensor
hooks) down to one block input per block, ZeRO-3 and tensor-parallel partitioned inputs on CPU/gloo ranks, and the
selective recomputation the planner assumes (SDPA keeps no s x s scores) measured on the GPT.
"""

import logging

import pytest
import torch
from torch import nn
from zero_helpers import GPT_CFG, engine_loop, gpt_batch

import llmpar
from llmpar.models import GPT, GPTConfig
from llmpar.planning.memory import activation_bytes_per_layer
from llmpar.runtime.activations import (
    PartitionedInputs,
    apply_activation_checkpointing,
    checkpoint_blocks,
    exposed_blocks,
)
from llmpar.runtime.blocks import ActivationCheckpointingConfig

from multirank import run_ranks

CFG = dict(vocab_size=64, n_layer=4, n_head=4, d_model=32, seq_len=24, dropout=0.1)


class _Saved:
    """Bytes of the distinct storages autograd keeps for backward (params left out), as a saved-tensor hook sees
    them: the activations a forward leaves behind."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}
        self.shapes: list[tuple[int, ...]] = []

    def __enter__(self):
        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in self.params:
                self.seen[s.data_ptr()] = s.nbytes()
                self.shapes.append(tuple(t.shape))
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def _grads(model, x, y, seed=5):
    torch.manual_seed(seed)  # dropout
    with _Saved(model) as saved:
        loss = model.loss(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads, saved


def test_exposed_blocks():
    gpt = GPT(GPTConfig(**CFG))
    assert [n for n, _ in exposed_blocks(gpt)] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    assert [n for n, _ in exposed_blocks(seq)] == ["0", "2"]  # the root's children; no block inside a block

    class Piped(nn.Module):  # no ModuleList: the model's own modules among its pipeline_blocks()
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.b(self.a(x))

        def pipeline_blocks(self):
            return [("a", self.a), ("extra", nn.Linear(3, 3)), ("b", self.b)]

    assert [n for n, _ in exposed_blocks(Piped())] == ["a", "b"]
    with pytest.raises(ValueError, match="exposes no blocks"):
        checkpoint_blocks(nn.Linear(3, 3))


def test_gradients_equal_and_activations_kept_drop_to_the_block_inputs():
    x, y = gpt_batch(0, 3, vocab=64, seq=CFG["seq_len"])
    plain = GPT(GPTConfig(**CFG), seed=3, dtype=torch.float64).train()
    ckpt = GPT(GPTConfig(**CFG), seed=3, dtype=torch.float64).train()
    assert checkpoint_blocks(ckpt) == [f"blocks.{i}" for i in range(4)]
    assert checkpoint_blocks(ckpt) == [f"blocks.{i}" for i in range(4)]  # a second call wraps nothing again
    loss0, g0, s0 = _grads(plain, x, y)
    loss1, g1, s1 = _grads(ckpt, x, y)
    assert torch.equal(loss0, loss1)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-13, atol=1e-15, msg=lambda m: f"{n}: {m}")
    # kept with checkpointing: outside the blocks as before, inside each block only its input x [B, T, d]
    block_input = 3 * CFG["seq_len"] * CFG["d_model"] * 8
    plain_blocks = _block_bytes(plain, x)
    assert s1.bytes <= s0.bytes - plain_blocks + CFG["n_layer"] * block_input
    assert s1.bytes < 0.5 * s0.bytes, (s1.bytes, s0.bytes)
    assert s1.shapes.count((3, CFG["seq_len"], CFG["d_model"])) >= CFG["n_layer"]


def _block_bytes(model, x):
    """What the blocks of an unwrapped GPT keep for backward, alone."""
    with torch.no_grad():
        h = model.drop(model.tok_emb(x) + model.pos_emb(torch.arange(x.shape[1])))
    h.requires_grad_(True)
    with _Saved(model) as saved:
        for block in model.blocks:
            h = block(h)
    return saved.bytes


def test_number_checkpoints_and_eval_mode():
    model = GPT(GPTConfig(**CFG), dtype=torch.float64)
    assert checkpoint_blocks(model, first=1) == ["blocks.0"]
    assert getattr(model.blocks[1], "_llmpar_recompute", None) is None
    x, _ = gpt_batch(0, 2, vocab=64, seq=8)
    with torch.no_grad():  # no grad: the plain forward
        out = model.eval()(x)
    assert out.shape == (2, 8, 64)


def test_selective_recompute_the_planner_assumes_is_what_sdpa_does():
    """The planner's "selective" layouts keep no s x s attention scores (34 s b h per layer, not 34 + 5 a s / h): the
    GPT's attention (scaled_dot_product_attention) keeps activations linear in the sequence length."""
    cfg = dict(CFG, dropout=0.0, seq_len=256)
    model = GPT(GPTConfig(**cfg), dtype=torch.float32)
    kept = {}
    for seq in (64, 128, 256):
        x, _ = gpt_batch(0, 2, vocab=64, seq=seq)
        kept[seq] = _block_bytes(model, x)
    assert kept[128] == 2 * kept[64] and kept[256] == 2 * kept[128], kept
    per_layer = kept[256] / cfg["n_layer"]
    common = dict(seq_len=256, micro_batch=2, hidden=cfg["d_model"], n_heads=cfg["n_head"])
    selective = 2 * activation_bytes_per_layer(**common, checkpointing="selective")  # fp32: twice the bf16 formula
    none = 2 * activation_bytes_per_layer(**common, checkpointing="none")  # + the scores: 5 a s / h = 160 s b h
    assert per_layer <= selective < none, (per_layer, selective, none)


# ------------------------------------------------------------------------------------------------ through initialize
def _cfg(stage, ckpt=None, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 700,
            "overlap_comm": True,
            "stage3_param_persistence_threshold": 50,
        },
        **extra,
    }
    if ckpt is not None:
        cfg["activation_checkpointing"] = ckpt
    return cfg


def _count_mlp_calls(model):
    """A list whose length is the number of times the blocks' MLPs started (forward and recompute; a pre-hook: the
    recompute stops as soon as the last tensor the backward needs is saved, which may be inside the MLP)."""
    calls = []
    for block in model.blocks:
        block.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def engine_body(stage, ckpt, tp=1):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(GPT_CFG, dropout=0.1)), seed=1, dtype=torch.float64)
    extra = {"tensor_parallel": {"size": tp}} if tp > 1 else {}
    mesh = llmpar.init_distributed(tp=tp).mesh
    if tp > 1:
        llmpar.parallelize(model, mesh["tp"])
    engine, _, _, _ = llmpar.initialize(model=model, config=_cfg(stage, ckpt, **extra), mesh=mesh)
    wrapped = [n for n, m in model.named_modules() if getattr(m, "_llmpar_recompute", None) is not None]
    calls = _count_mlp_calls(model)
    torch.manual_seed(10 + mesh["dp"].get_local_rank())  # dropout: the same on the tp ranks of a dp rank
    return engine_loop(engine, model, 4, 2, mesh["dp"]), wrapped, len(calls)


@pytest.mark.parametrize("stage", [2, 3])
def test_initialize_block_trains_as_without_it(stage):
    plain = run_ranks(engine_body, 2, stage, None, timeout=120)
    ckpt = run_ranks(engine_body, 2, stage, {"number_checkpoints": 2, "cpu_checkpointing": True}, timeout=120)
    for (l0, w0, c0), (l1, w1, c1) in zip(plain, ckpt):
        assert w0 == [] and w1 == ["blocks.0", "blocks.1"]
        assert c0 == 4 * 2 and c1 == 2 * c0  # 4 steps x 2 blocks, each block recomputed once in backward
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), rtol=1e-12, atol=1e-12)


def test_partition_activations_under_tensor_parallelism():
    """tp=2: each tp rank keeps half of every block input (all-gathered for the recompute); the run equals the one
    without checkpointing."""
    plain = run_ranks(engine_body, 4, 1, None, 2, timeout=180)
    parts = run_ranks(engine_body, 4, 1, {"partition_activations": True}, 2, timeout=180)
    for (l0, _, c0), (l1, w1, c1) in zip(plain, parts):
        assert w1 == ["blocks.0", "blocks.1"] and c1 == 2 * c0
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), rtol=1e-12, atol=1e-12)


def partition_body():
    env = llmpar.init_distributed(tp=2)
    tp_group = env.mesh["tp"].get_group()
    out = {}
    for partition in (False, True):
        model = GPT(GPTConfig(**dict(GPT_CFG, dropout=0.0)), seed=1, dtype=torch.float64)
        llmpar.parallelize(model, env.mesh["tp"])
        parts = PartitionedInputs(tp_group)
        checkpoint_blocks(model, save=(lambda: parts) if partition else None)
        x, y = gpt_batch(0, 3)
        loss = model.loss(model(x), y)
        loss.backward()
        out[partition] = (parts.held_bytes, {n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def test_partitioned_inputs_hold_one_tp_share():
    for out in run_ranks(partition_body, 2, timeout=120):
        held, grads = out[True]
        assert held == GPT_CFG["n_layer"] * 3 * 12 * GPT_CFG["d_model"] * 8 // 2  # half of each block input
        for n, g in out[False][1].items():
            torch.testing.assert_close(grads[n], g, rtol=1e-13, atol=1e-15)


def test_no_effect_settings_are_logged(caplog):
    model = GPT(GPTConfig(**CFG))
    cfg = ActivationCheckpointingConfig(
        enabled=True,
        partition_activations=True,
        cpu_checkpointing=True,
        contiguous_memory_optimization=True,
        profile=True,
    )
    with caplog.at_level(logging.INFO, logger="llmpar"):
        assert len(apply_activation_checkpointing(model, cfg)) == 4
    text = caplog.text
    assert "cpu_checkpointing" in text and "nothing to partition" in text and "contiguous_memory" in text
    assert apply_activation_checkpointing(GPT(GPTConfig(**CFG)), ActivationCheckpointingConfig()) == []


def pipeline_body(ckpt):
    model = GPT(GPTConfig(vocab_size=32, n_layer=4, n_head=2, d_model=16, seq_len=8), seed=0, dtype=torch.float64)
    cfg = _cfg(1, ckpt, pipeline={"stages": 2, "micro_batches": 4})
    engine, _, _, _ = llmpar.initialize(model=model, config=cfg)
    wrapped = [n for n, m in model.named_modules() if getattr(m, "_llmpar_recompute", None) is not None]
    calls = _count_mlp_calls(model)
    dp_rank = engine.mesh["dp"].get_local_rank()
    losses = [float(engine.train_batch(*gpt_batch(100 * s + dp_rank, 2 * 4, vocab=32, seq=8))) for s in range(4)]
    return losses, wrapped, len(calls)


def test_pipeline_engine_recomputes_the_blocks_of_its_stages():
    plain = run_ranks(pipeline_body, 2, None, timeout=180)
    ckpt = run_ranks(pipeline_body, 2, {}, timeout=180)
    for (l0, w0, c0), (l1, w1, c1) in zip(plain, ckpt):
        assert w0 == [] and w1 == [f"blocks.{i}" for i in range(4)]
        assert c1 - c0 >= 4 * 4 * 2, (c0, c1)  # each of 4 steps x 4 micro-batches x this stage's 2 blocks recomputed
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), rtol=1e-12, atol=1e-12)
