"""transformers causal LMs (tiny Llama / Qwen2 / Mistral from configs: vocab 61, 2 layers, 4 query heads over 2 kv
heads) under context parallelism through ``llmpar.initialize`` equal the unsplit model on one process: per-step
losses and every parameter's reduced gradient (assembled from the ZeRO pieces of all ranks) within 1e-5 (fp32,
relative), for ulysses / ring (2 ranks) and hybrid 2 x 2 (4 ranks), ZeRO-2 and ZeRO-3, on 13-token sequences
(padded to 14 / 16 by the shard) with a padded row, and a step where the later cp ranks hold no labelled token.
Also: ulysses cp=2 x dp=2; llmpar's Trainer with ``"context_parallel"`` against transformers' own Trainer on one
process (same losses, grad norms); and the refusals (sliding window shorter than the sequence, KV cache, 4-D mask,
attention dropout, a model type outside the three), before any collective.

One multirank run per world size feeds every assertion of that world (a launch of HF models costs seconds here).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from multirank import run_ranks  # noqa: E402

VOCAB, SEQ, MICRO, STEPS = 61, 13, 2, 3
WORLD2 = [  # (model, mode, cp size, ulysses size, zero stage): each mode with ZeRO-2 and ZeRO-3, each model twice
    ("llama", "ulysses", 2, None, 2), ("llama", "ring", 2, None, 3), ("qwen2", "ring", 2, None, 2),
    ("qwen2", "ulysses", 2, None, 3), ("mistral", "ulysses", 2, None, 2), ("mistral", "ring", 2, None, 3),
    ("llama", "ring", 2, None, "2+ckpt")]  # activation checkpointing: layers recomputed in backward
WORLD4 = [("llama", "hybrid", 4, 2, 2), ("qwen2", "hybrid", 4, 2, 3), ("mistral", "ulysses", 2, None, 3)]


def model_config(kind: str, **kw):
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[kind]
    return cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, **kw)


def build(kind: str, **kw):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(model_config(kind, **kw)).double()


def batch(step: int, rows: int) -> dict:
    """``rows`` sequences of SEQ random tokens: row 1 is padding after token 9 (mask 0, labels -100); at step 1 only
    the first 3 labels of every row count (the later cp ranks hold none)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if step == 1:
        labels[:, 3:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def ds_config(mode: str, size: int, ulysses: int | None, stage: int | str) -> dict:
    block = {"size": size, "mode": mode, **({"ulysses_size": ulysses} if ulysses else {})}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "zero_optimization": {"stage": int(str(stage)[0])}, "context_parallel": block}
    if str(stage).endswith("+ckpt"):
        config["activation_checkpointing"] = {}
    return config


def engine_body(cases: list) -> list:
    """For each case: per step (loss, {param: [(start, stop, reduced grad piece)]}) of this rank, and the dp size."""
    import llmpar

    import time
    out = []
    for kind, mode, size, ulysses, stage in cases:
        t0 = time.perf_counter()
        model = build(kind)
        engine, *_ = llmpar.initialize(model=model, config=ds_config(mode, size, ulysses, stage))
        dp, r = engine.dp_world_size, engine.dp_rank
        steps = []
        for step in range(STEPS):
            full = batch(step, MICRO * dp)
            output = engine(**{k: v[r * MICRO:(r + 1) * MICRO] for k, v in full.items()})
            engine.backward(output.loss)
            engine.optimizer.reduce_gradients()
            pieces = {n: [(a, z, v.detach().clone()) for v, a, z in engine.optimizer.grad_pieces(p)]
                      for n, p in model.named_parameters()}
            engine.step()
            steps.append((float(output.loss), pieces))
        out.append((steps, dp, r, time.perf_counter() - t0))
    return out


def token_mean_loss(model, input_ids, attention_mask, labels) -> torch.Tensor:
    """The causal-LM loss in the logits' dtype (transformers' own rounds float64 logits to float32)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)


def reference(kind: str, dp: int) -> list:
    """Per step ([loss of each dp rank's part], {param: grad}) of the unsplit model on one process: the gradient of
    the mean over dp parts of each part's full-sequence token mean, AdamW as the engine's."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    steps = []
    for step in range(STEPS):
        full = batch(step, MICRO * dp)
        parts = [token_mean_loss(model, **{k: v[r * MICRO:(r + 1) * MICRO] for k, v in full.items()})
                 for r in range(dp)]
        opt.zero_grad()
        (sum(parts) / dp).backward()
        steps.append(([float(p.detach()) for p in parts], {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return steps


def check_against_reference(case: tuple, ranks: list, rtol: float = 1e-10) -> None:
    dp = ranks[0][1]
    print(case, [r[3] for r in ranks])
    ref = reference(case[0], dp)
    for step, (want_losses, want_grads) in enumerate(ref):
        for rank, (steps, _, dp_rank, _) in enumerate(ranks):
            got, want_loss = steps[step][0], want_losses[dp_rank]
            assert abs(got - want_loss) <= rtol * abs(want_loss), f"{case} step {step} rank {rank}: loss {got} " \
                                                                  f"!= {want_loss}"
        for name, want in want_grads.items():
            flat, seen = torch.zeros(want.numel(), dtype=want.dtype), torch.zeros(want.numel())
            for steps, *_ in ranks:
                for a, z, piece in steps[step][1][name]:
                    flat[a:z], seen[a:z] = piece.reshape(-1), seen[a:z] + 1
            assert bool((seen == 1).all()), f"{case} {name}: the ranks' pieces do not cover the gradient once"
            err = float((flat - want.reshape(-1)).norm() / want.norm().clamp(min=1e-30))
            assert err <= rtol, f"{case} step {step} {name}: gradient off by {err:.2e} (relative)"


def _run(cases: list, world: int) -> None:
    outs = run_ranks(engine_body, world, cases, timeout=300)
    for i, case in enumerate(cases):
        check_against_reference(case, [o[i] for o in outs])


def test_hf_models_equal_the_unsplit_model_ulysses_and_ring():
    _run(WORLD2, 2)


def test_hf_models_equal_the_unsplit_model_hybrid_and_dp_x_cp():
    _run(WORLD4, 4)
