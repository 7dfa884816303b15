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

import logging

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from multirank import run_ranks  # noqa: E402

VOCAB, SEQ, MICRO, STEPS = 61, 13, 2, 3
WORLD2 = [  # (model, mode, cp size, ulysses size, zero stage): each mode with ZeRO-2 and ZeRO-3, each model twice
    ("llama", "ulysses", 2, None, 2),
    ("llama", "ring", 2, None, 3),
    ("qwen2", "ring", 2, None, 2),
    ("qwen2", "ulysses", 2, None, 3),
    ("mistral", "ulysses", 2, None, 2),
    ("mistral", "ring", 2, None, 3),
    ("llama", "ring", 2, None, "2+ckpt"),
]  # activation checkpointing: layers recomputed in backward
WORLD4 = [
    ("llama", "hybrid", 4, 2, 2),
    ("qwen2", "hybrid", 4, 2, 3),
    ("mistral", "ulysses", 2, None, 3),
    ("llama", "ulysses", 2, None, "2+tp"),
]  # cp=2 x tp=2: losses and the grad norm (params split over tp)


def model_config(kind: str, **kw):
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}[
        kind
    ]
    return cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **kw,
    )


def build(kind: str, **kw):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(model_config(kind, **kw)).double()


def batch(step: int, rows: int) -> dict:
    """``rows`` sequences of SEQ random tokens: row 1 is padding after token 9 (mask 0, labels -100); at step 1 only
    the first 3 labels of every row count (the later cp ranks hold none); at step 2 embeddings and position ids are
    given instead of token ids."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if step == 1:
        labels[:, 3:] = -100
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if step == 2:  # given embeddings and position ids (offset by 5) are sharded with the tokens
        out["position_ids"] = (torch.arange(SEQ) + 5)[None].expand(rows, -1)
        out["inputs_embeds"] = torch.randn(rows, SEQ, 32, generator=g, dtype=torch.float64)
        del out["input_ids"]
    return out


def ds_config(mode: str, size: int, ulysses: int | None, stage: int | str) -> dict:
    block = {"size": size, "mode": mode, **({"ulysses_size": ulysses} if ulysses else {})}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": int(str(stage)[0])},
        "context_parallel": block,
        "gradient_clipping": 1e9,
    }  # never clips; the engine reports the norm
    if str(stage).endswith("+ckpt"):
        config["activation_checkpointing"] = {}
    if str(stage).endswith("+tp"):
        config["tensor_parallel"] = {"size": 2}
    return config


def engine_body(cases: list) -> list:
    """For each case: (per step (loss, {param: [(start, stop, reduced grad piece)]}, grad norm), dp size, dp rank)
    of this rank."""
    import llmpar

    out, logits = [], []
    for kind, mode, size, ulysses, stage in cases:
        model = build(kind)
        engine, *_ = llmpar.initialize(model=model, config=ds_config(mode, size, ulysses, stage))
        engine.adapter.tiled_chunk = 5  # the loss in tiles of 5 of the 14 or 16 local tokens (where it tiles)
        dp, r = engine.dp_world_size, engine.dp_rank
        split = any(getattr(p, "tensor_model_parallel", False) for p in model.parameters())
        assert split == str(stage).endswith("+tp"), f"{kind} {mode} {stage}: split over tp: {split}"
        steps = []
        for step in range(STEPS):
            full = batch(step, MICRO * dp)
            output = engine(**{k: v[r * MICRO : (r + 1) * MICRO] for k, v in full.items()})
            tiled = str(stage).startswith("2") and not str(stage).endswith("+tp")  # whole head weight: tiled
            assert (output.logits.shape[1] == 0) == tiled, f"{kind} {mode} {stage}: logits {output.logits.shape}"
            engine.backward(output.loss)
            engine.optimizer.reduce_gradients()
            pieces = (
                {}
                if str(stage).endswith("+tp")
                else {  # tp: pieces of tp shards, the norm is compared
                    n: [(a, z, v.detach().clone()) for v, a, z in engine.optimizer.grad_pieces(p)]
                    for n, p in model.named_parameters()
                }
            )
            engine.step()
            steps.append((float(output.loss), pieces, float(engine.get_global_grad_norm())))
        out.append((steps, dp, r))
        if len(out) <= 2:  # the whole sequence's logits on request (ZeRO-2: the loss is tiled otherwise)
            logits.append(full_logits(engine, model, dp, r))
        if len(out) == 1:  # the last cp rank fed a shorter sequence (a ragged last batch): refused on every rank
            full, short = batch(0, MICRO * dp), engine.context_parallel.rank == engine.context_parallel.size - 1
            try:
                engine(**{k: v[r * MICRO : (r + 1) * MICRO, : SEQ - short] for k, v in full.items()})
                mismatch = "no error"
            except ValueError as e:
                mismatch = str(e)
    out.append({"mismatch": mismatch, "logits": logits})
    return out


def full_logits(engine, model, dp: int, r: int) -> tuple:
    """(out.logits by default, with ``gather_logits``, the unsplit model's logits; both losses)."""
    mine = {k: v[r * MICRO : (r + 1) * MICRO] for k, v in batch(0, MICRO * dp).items()}
    default = engine(**mine)
    engine.adapter.gather_logits = True
    gathered = engine(**mine)
    engine.adapter.gather_logits = False
    with torch.no_grad():  # the prepared model called whole: transformers' attention over the whole sequence
        want = model(input_ids=mine["input_ids"], attention_mask=mine["attention_mask"]).logits
    return (
        tuple(default.logits.shape),
        gathered.logits,
        want,
        float(default.loss),
        float(gathered.loss),
        gathered.logits.requires_grad,
    )


def token_mean_loss(model, attention_mask, labels, **kw) -> torch.Tensor:
    """The causal-LM loss in the logits' dtype (transformers' own rounds float64 logits to float32)."""
    logits = model(attention_mask=attention_mask, **kw).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)


def reference(kind: str, dp: int) -> list:
    """Per step ([loss of each dp rank's part], {param: grad}) of the unsplit model on one process: the gradient of
    the mean over dp parts of each part's full-sequence token mean, AdamW as the engine's."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    steps = []
    for step in range(STEPS):
        full = batch(step, MICRO * dp)
        parts = [
            token_mean_loss(model, **{k: v[r * MICRO : (r + 1) * MICRO] for k, v in full.items()}) for r in range(dp)
        ]
        opt.zero_grad()
        (sum(parts) / dp).backward()
        grads = {
            n: torch.zeros_like(p) if p.grad is None else p.grad.clone()  # no grad: the embedding at step 2
            for n, p in model.named_parameters()
        }
        steps.append(([float(p.detach()) for p in parts], grads))
        opt.step()
    return steps


def check_against_reference(case: tuple, ranks: list, rtol: float = 1e-10) -> None:
    dp = ranks[0][1]
    ref = reference(case[0], dp)
    for step, (want_losses, want_grads) in enumerate(ref):
        for rank, (steps, _, dp_rank) in enumerate(ranks):
            got, want_loss = steps[step][0], want_losses[dp_rank]
            assert abs(got - want_loss) <= rtol * abs(want_loss), (
                f"{case} step {step} rank {rank}: loss {got} != {want_loss}"
            )
            norm, got_norm = float(torch.stack([g.norm() for g in want_grads.values()]).norm()), steps[step][2]
            assert abs(got_norm - norm) <= rtol * norm, f"{case} step {step}: grad norm {got_norm} != {norm}"
        if str(case[4]).endswith("+tp"):
            continue
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
    size = cases[0][2]
    for rank, o in enumerate(outs):
        for case, (shape, got, want, loss, gathered_loss, grad) in zip(cases, o[-1]["logits"]):
            tiled, multiple = str(case[4]) == "2", case[2] * (1 if case[1] == "ulysses" else 2)
            local = -(-SEQ // multiple) * multiple // case[2]  # this rank's slice of the padded sequence
            assert shape == (MICRO, 0 if tiled else local, VOCAB), (case, shape)
            assert got.shape == (MICRO, SEQ, VOCAB) and not grad, (case, got.shape)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"{case} rank {rank}: logits")
            assert abs(loss - gathered_loss) <= 1e-12 * abs(loss), (case, loss, gathered_loss)
        err, first = o[-1]["mismatch"], rank - rank % size
        assert (
            f"cp rank {size - 1} (global rank {first + size - 1}): attention_mask [{MICRO}, {SEQ - 1}], "
            f"input_ids [{MICRO}, {SEQ - 1}], labels [{MICRO}, {SEQ - 1}]" in err
        ), err


def test_hf_models_equal_the_unsplit_model_ulysses_and_ring():
    _run(WORLD2, 2)


def test_hf_models_equal_the_unsplit_model_hybrid_and_dp_x_cp():
    _run(WORLD4, 4)


# ---- the Trainer: llmpar's with "context_parallel" against transformers' own on one process ----
class Rows(torch.utils.data.Dataset):
    """13 rows of SEQ tokens, some padded (mask 0, labels -100): an epoch of batches of 2 ends on a batch of 1."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (16, SEQ), generator=g)
        self.mask = torch.ones_like(self.ids)
        self.mask[::3, 8:] = 0

    def __len__(self) -> int:
        return 13

    def __getitem__(self, i: int) -> dict:
        return {
            "input_ids": self.ids[i],
            "attention_mask": self.mask[i],
            "labels": self.ids[i].masked_fill(self.mask[i] == 0, -100),
        }


def trainer_run(output_dir: str, llmpar_config: dict | None) -> list:
    """[(loss, grad_norm)] per optimizer step: 5 steps of 2 x 2 rows (gradient accumulation 2; the 4th ends the epoch
    on one micro-batch of one row), the Trainer's AdamW and linear schedule, clipping at 1.0; llmpar's Trainer when a
    config is given, else transformers' own."""
    from transformers import TrainerCallback

    if llmpar_config is not None:
        from llmpar.integrations.transformers import Trainer, TrainingArguments

        extra = {"deepspeed": llmpar_config}
    else:
        from transformers import Trainer, TrainingArguments

        extra = {}
    rows: list = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                rows.append((float(logs["loss"]), float(logs["grad_norm"])))

    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=5,
        learning_rate=5e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=42,
        save_strategy="no",
        disable_tqdm=True,
        **extra,
    )
    Trainer(model=build("llama").float(), args=args, train_dataset=Rows(), callbacks=[Record()]).train()
    return rows


def trainer_body(output_dir: str) -> list:
    import os

    saved = dict(os.environ)  # transformers / accelerate write the launcher's variables: leave the pool as found
    try:
        config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
            "steps_per_print": 10**6,
            "zero_optimization": {"stage": 2},
            "context_parallel": {"size": 2, "mode": "ring"},
        }
        trainer_logger = transformers.trainer.logger
        lines: list = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        level, trainer_logger.level = trainer_logger.level, logging.INFO
        trainer_logger.addHandler(handler)
        try:
            rows = trainer_run(os.path.join(output_dir, str(dist.get_rank())), config)
        finally:
            trainer_logger.removeHandler(handler)
            trainer_logger.setLevel(level)
        return rows, [line for line in lines if "Context parallelism" in line or "Total train batch" in line]
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_trainer_with_context_parallelism_equals_the_plain_trainer(tmp_path, monkeypatch):
    """2 ranks, ring cp=2 (one data-parallel rank: both read the same batches): the logged full-sequence losses and
    grad norms equal transformers' Trainer on one process (fp32, 1e-5), the epoch's partial last batch included; the
    log says cp is on, and the banner's batch counts the one data-parallel rank (2 x 2, not 2 x 2 x 2)."""
    outs = run_ranks(trainer_body, 2, str(tmp_path), timeout=300)
    ours = [rows for rows, _ in outs]
    assert outs[0][1] == [
        "  Context parallelism = on: cp=2 (ring), each sequence split over 2 ranks; data-parallel "
        "ranks = 1 (the batch size counts these)",
        "  Total train batch size (w. parallel, distributed & accumulation) = 4",
    ], outs[0][1]
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    theirs = trainer_run(str(tmp_path / "plain"), None)
    assert len(theirs) == 5 and ours[0] == ours[1]
    torch.testing.assert_close(
        torch.tensor(ours[0], dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64), rtol=1e-5, atol=0
    )


# ---- refusals, and the prepared model run whole (one process, before any collective) ----
class _Reached(Exception):
    """The stub's ``shard`` was called: every check before it passed."""


class StubCP:
    """Enough of a ContextParallel for what runs before the first collective."""

    size, current = 2, None

    def shard(self, seq_len: int, device) -> None:
        raise _Reached(seq_len)


def _prepared(kind: str, **kw):
    from llmpar.context_parallel.hf import HFCausalLMAdapter

    model, adapter = build(kind, **kw), HFCausalLMAdapter()
    adapter.prepare(model, StubCP())
    return model, adapter


def test_refusals_name_the_argument():
    from llmpar.context_parallel.hf import HFCausalLMAdapter

    ids = batch(0, 2)["input_ids"]
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        HFCausalLMAdapter().prepare(gpt2, StubCP())
    with pytest.raises(ValueError, match="got LlamaForSequenceClassification"):
        HFCausalLMAdapter().prepare(transformers.LlamaForSequenceClassification(model_config("llama")), StubCP())
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        HFCausalLMAdapter().prepare(build("llama", attention_dropout=0.1), StubCP())
    _, mistral = _prepared("mistral", sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=8 is shorter than the sequence"):
        mistral.shard_call(StubCP(), (ids,), {})
    _, qwen = _prepared("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding_window=8 is shorter than the sequence"):
        qwen.shard_call(StubCP(), (ids,), {})
    _, wide = _prepared("mistral", sliding_window=SEQ)  # a window covering the sequence is plain causal attention
    with pytest.raises(_Reached):
        wide.shard_call(StubCP(), (ids,), {})
    _, llama = _prepared("llama")
    with pytest.raises(ValueError, match="KV cache"):
        llama.shard_call(StubCP(), (ids,), {"cache": transformers.DynamicCache()})
    with pytest.raises(ValueError, match="attention_mask must be .batch=2, seq=13."):
        llama.shard_call(StubCP(), (ids,), {"attention_mask": torch.ones(2, 1, SEQ, SEQ)})
    packed = torch.cat([torch.arange(6), torch.arange(SEQ - 6)])[None].expand(2, -1)
    with pytest.raises(ValueError, match="position_ids restart inside a row and there is no attention_mask"):
        llama.shard_call(StubCP(), (ids,), {"position_ids": packed})
    with pytest.raises(_Reached):  # with a mask transformers reads them as positions only, and so does the adapter
        llama.shard_call(StubCP(), (ids,), {"position_ids": packed, "attention_mask": torch.ones_like(ids)})
    with pytest.raises(ValueError, match="logits_to_keep=1"):
        llama.shard_call(StubCP(), (ids,), {"logits_to_keep": 1})
    with pytest.raises(ValueError, match="exactly one of input_ids / inputs_embeds"):
        llama.shard_call(StubCP(), (), {"labels": ids})
    with pytest.raises(TypeError, match="'input_ids' twice"):
        llama.shard_call(StubCP(), (ids,), {"input_ids": ids})


def test_a_prepared_model_called_whole_is_the_plain_model():
    """Outside a sharded batch (evaluate / predict / generate) the registered attention is transformers' SDPA with
    its own mask: the same logits as before prepare, padded rows included."""
    plain = build("llama")
    model, _ = _prepared("llama")
    assert model.config._attn_implementation == "llmpar_cp"
    b = batch(0, 2)
    with torch.no_grad():
        want = plain(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        got = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
