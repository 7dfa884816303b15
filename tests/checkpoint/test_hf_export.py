"""Weights out for HuggingFace models (issue 18, item 3): tiny Llama / Qwen2 / GPT-2 (from configs, random weights,
tied and untied) trained through ``llmpar.initialize(model_parameters=model.parameters())`` on 2 CPU ranks at ZeRO-2
and ZeRO-3 (and tp=2), then written two ways:

* ``save_checkpoint`` + ``llmpar checkpoint consolidate`` (the command line),
* ``engine.save_hf_model`` (collective; ZeRO-3 gathered unit by unit, tp params all-gathered and unpadded),

and ``AutoModelForCausalLM.from_pretrained`` loads each without missing or unexpected keys, with the trained weights
(equal to the gathered model, tensor by tensor) and the trained model's logits; model names, not ``group0.param0``;
no non-persistent buffer (rotary ``inv_freq``); a tied embedding written once and tied again on load; shards +
index at a small ``max_shard_size``, exactly ``huggingface_hub``'s split; ``--dtype bf16`` writes bf16; a bad dtype
or shard size is an error naming the argument; a checkpoint written before non-persistent buffers were left out
still loads strictly; ``save_16bit_model(..., "model.safetensors")`` writes safetensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from llmpar.checkpoint.formats.hf import files as hf_files  # noqa: E402

from multirank import run_ranks  # noqa: E402

VOCAB = 67  # not divisible by tp=2: the vocabulary layers are padded under tensor parallelism


def _hf_model(kind: str, tie: bool):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=4, **common)
        return transformers.GPT2LMHeadModel(cfg)
    llama_like = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        **common,
    )
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama_like))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_like))


def _ds_config(stage: int, tp: int = 1) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 64},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp}
    return cfg


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))


def train_body(root: str, kind: str, tie: bool, stage: int, tp: int, client_opt: bool, shard: str):
    """Train 3 steps, save a checkpoint and an HF export; returns (rank 0) the gathered trained state, the logits of
    the trained model and the optimizer's param names."""
    import llmpar

    model = _hf_model(kind, tie)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) if client_opt else None
    engine, zopt, _, _ = llmpar.initialize(
        model=model, model_parameters=model.parameters(), optimizer=opt, config=_ds_config(stage, tp)
    )
    rank = dist.get_rank() if tp == 1 else 0  # under tp every rank sees the same batch
    for step in range(3):
        ids = _ids(100 * step + rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(os.path.join(root, "ck"))
    for bad, match in (
        (dict(dtype="int8"), "dtype='int8'"),
        (dict(max_shard_size="5XB"), "max_shard_size='5XB'"),
        (dict(max_shard_size=0), "max_shard_size=0"),
    ):
        with pytest.raises(ValueError, match=match):  # on every rank, before any collective
            engine.save_hf_model(os.path.join(root, "never"), **bad)
    assert engine.save_hf_model(os.path.join(root, "hf"), max_shard_size=shard) is True
    assert engine.save_hf_model(os.path.join(root, "hf_bf16"), dtype=torch.bfloat16)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=_ids(999)).logits
    state = engine.module_state_dict()
    names = [p["name"] for b in zopt.checkpoint_layout() for p in b["params"]]
    return (state, logits, names) if dist.get_rank() == 0 else None


def _load(path: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing / unexpected / mismatched keys
    return model.eval()


def _files(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _check_export(path: Path, state: dict, logits: torch.Tensor, model_ref, tie: bool, *, dtype=torch.float32):
    """The directory loads with from_pretrained, holds exactly the trained weights under the model's names (tied
    once, no non-persistent buffer) and gives the trained model's logits."""
    saved = _files(path)
    expected = set(model_ref.state_dict()) - ({"lm_head.weight"} if tie else set())
    assert set(saved) == expected, sorted(set(saved) ^ expected)
    assert not any("inv_freq" in k for k in saved)
    for name, t in saved.items():
        assert t.dtype == dtype, name
        if dtype == torch.float32:
            assert torch.equal(t, state[name]), name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dtype"] == str(dtype).removeprefix("torch.") and cfg["tie_word_embeddings"] == tie
    assert cfg["architectures"] == [type(model_ref).__name__]
    assert (path / "generation_config.json").is_file()
    loaded = _load(path)
    assert loaded.dtype == dtype
    out_emb, in_emb = loaded.get_output_embeddings().weight, loaded.get_input_embeddings().weight
    assert (out_emb.data_ptr() == in_emb.data_ptr()) == tie  # tied again on load (and only then)
    with torch.no_grad():
        got = loaded(input_ids=_ids(999)).logits.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, logits, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, logits, rtol=0.05, atol=0.05)
    return got


def _check_shards(path: Path, expect_sharded: bool) -> None:
    index = path / "model.safetensors.index.json"
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not expect_sharded:
        assert shards == ["model.safetensors"] and not index.exists()
        return
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    idx = json.loads(index.read_text())
    assert set(idx) == {"metadata", "weight_map"} and sorted(set(idx["weight_map"].values())) == shards
    sizes = 0
    for fname in shards:
        with safe_open(str(path / fname), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                assert idx["weight_map"][k] == fname
                t = f.get_tensor(k)
                sizes += t.numel() * t.element_size()
    assert idx["metadata"]["total_size"] == sizes


CASES = {  # id: (kind, tie, stage, client optimizer, save_hf_model shard size, consolidate shard size)
    "llama-s2-untied": ("llama", False, 2, False, "5GB", "30KB"),
    "qwen2-s3-tied": ("qwen2", True, 3, False, "20KB", "5GB"),
    "gpt2-s3-tied-client-opt": ("gpt2", True, 3, True, "5GB", "5GB"),
    "llama-s3-tied": ("llama", True, 3, False, "5GB", "5GB"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trained_model_exports_load_with_from_pretrained(case, tmp_path):
    from llmpar.cli import main

    kind, tie, stage, client_opt, hf_shard, ck_shard = CASES[case]
    state, logits, names = run_ranks(
        train_body, 2, str(tmp_path), kind, tie, stage, 1, client_opt, hf_shard, timeout=180
    )[0]
    ref = _hf_model(kind, tie)
    assert set(names) <= set(ref.state_dict()) and not any(n.startswith("group") for n in names)
    # (b) engine.save_hf_model
    _check_export(tmp_path / "hf", state, logits, ref, tie)
    _check_shards(tmp_path / "hf", hf_shard != "5GB")
    _check_export(tmp_path / "hf_bf16", state, logits, ref, tie, dtype=torch.bfloat16)
    # (a) save_checkpoint + `llmpar checkpoint consolidate`
    out = tmp_path / "out"
    assert main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(out), "--max-shard-size", ck_shard]) == 0
    _check_export(out, state, logits, ref, tie)
    _check_shards(out, ck_shard != "5GB")
    if case == "llama-s2-untied":  # (e) --dtype bf16 into the same directory: refused, then replaced whole
        assert main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(out), "--dtype", "bf16"]) == 1
        _check_shards(out, ck_shard != "5GB")
        assert (
            main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(out), "--dtype", "bf16", "--overwrite"]) == 0
        )
        _check_export(out, state, logits, ref, tie, dtype=torch.bfloat16)
        _check_shards(out, False)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_tensor_parallel_model_exports_unsplit(tie, tmp_path):
    """tp=2 (the vocabulary of 67 padded to 68): save_hf_model gathers and unpads every split param; consolidate of
    the tp=2 checkpoint writes the same tensors."""
    from llmpar.checkpoint.consolidate import consolidate

    state, logits, _ = run_ranks(train_body, 2, str(tmp_path), "llama", tie, 3, 2, False, "5GB", timeout=180)[0]
    ref = _hf_model("llama", tie)
    assert any(t.shape != ref.state_dict()[n].shape for n, t in state.items())  # the engine's state is split
    hf = _files(tmp_path / "hf")
    assert {n: tuple(t.shape) for n, t in hf.items()} == {
        n: tuple(t.shape) for n, t in ref.state_dict().items() if not (tie and n == "lm_head.weight")
    }
    consolidate(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert all(torch.equal(t, hf[n]) for n, t in _files(tmp_path / "out").items())
    loaded = _load(tmp_path / "hf")
    with torch.no_grad():
        got = loaded(input_ids=_ids(999)).logits
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-5)  # tp sums partial products in another order


def old_checkpoint_body(root: str):
    """A checkpoint that holds the non-persistent buffers (as llmpar wrote them before) loads strictly; save_16bit_model
    writes safetensors."""
    import llmpar
    from llmpar.runtime import engine_ckpt

    model = _hf_model("llama", True)
    engine, *_ = llmpar.initialize(model=model, config=_ds_config(2))
    ids = _ids(dist.get_rank())
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    real = engine_ckpt.unsaved_buffers
    engine_ckpt.unsaved_buffers = lambda modules: set()  # as before: every buffer saved
    try:
        old = engine.save_checkpoint(os.path.join(root, "old"))
    finally:
        engine_ckpt.unsaved_buffers = real
    new = engine.save_checkpoint(os.path.join(root, "new"))
    extras = [json.load(open(os.path.join(p, "metadata.json")))["extras"] for p in (old, new)]
    other = _hf_model("llama", True)  # its params given under other names: the checkpoint still uses the model's
    fresh, fopt, *_ = llmpar.initialize(
        model=other, config=_ds_config(2), model_parameters=[(f"p{i}", p) for i, p in enumerate(other.parameters())]
    )
    assert [s["name"] for b in fopt.checkpoint_layout() for s in b["params"]][:2] == ["p0", "p1"]
    fresh.load_checkpoint(os.path.join(root, "old"))  # strict: the saved inv_freq is not "unexpected"
    same = all(torch.equal(a, b) for a, b in zip(fresh.module.state_dict().values(), model.state_dict().values()))
    assert engine.save_16bit_model(os.path.join(root, "st"), "model.safetensors")
    return extras, same


def test_old_checkpoint_with_non_persistent_buffers_loads_and_16bit_safetensors(tmp_path):
    extras, same = run_ranks(old_checkpoint_body, 2, str(tmp_path), timeout=120)[0]
    assert any("inv_freq" in n for n in extras[0]) and not any("inv_freq" in n for n in extras[1])
    assert same
    st = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert "model.embed_tokens.weight" in st and "lm_head.weight" not in st
    assert not any("inv_freq" in n for n in st)


# ---------------------------------------------------------------------------------------------------- one process
def test_shard_plan_is_huggingface_hubs_split():
    from huggingface_hub import split_torch_state_dict_into_shards

    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.empty(int(n)) for i, n in enumerate(torch.randint(1, 400, (40,), generator=g))}
    state["big"] = torch.empty(2000)
    for limit in (1000, 1600, 4000, 10**9):
        ours = hf_files.shard_plan(state, limit)
        theirs = split_torch_state_dict_into_shards(state, max_shard_size=limit)
        assert dict(zip(hf_files.shard_files(len(ours)), ours)) == theirs.filename_to_tensors, limit


def test_arguments_are_checked_and_named(tmp_path, capsys):
    from llmpar.checkpoint.consolidate import consolidate
    from llmpar.cli import main

    assert hf_files.parse_size("5GB") == 5 * 10**9 and hf_files.parse_size("2GiB") == 2 * 2**30
    assert hf_files.parse_size("500mb") == 5 * 10**8 and hf_files.parse_size(123) == 123
    assert hf_files.parse_dtype("bf16") is torch.bfloat16 and hf_files.parse_dtype(torch.float16) is torch.float16
    assert hf_files.parse_dtype(None) is None and hf_files.parse_dtype("keep") is None
    for bad in ("5XB", "", "-1GB", 0, True, 1.5, None):
        with pytest.raises(ValueError, match=r"max_shard_size=.*must be a positive number"):
            hf_files.parse_size(bad)
    for bad in ("int8", "float64", torch.int32, 16):
        with pytest.raises(ValueError, match=r"dtype=.*bf16, fp16, fp32"):
            hf_files.parse_dtype(bad)
    with pytest.raises(ValueError, match="dtype='int8'"):  # before the checkpoint is read
        consolidate(str(tmp_path / "nothing"), str(tmp_path / "o"), dtype="int8")
    with pytest.raises(ValueError, match="format='pt'"):
        hf_files.write_hf_model(str(tmp_path), {"w": torch.ones(2)}, format="pt")
    with pytest.raises(SystemExit):
        main(["checkpoint", "consolidate", str(tmp_path), str(tmp_path / "o"), "--max-shard-size", "lots"])
    assert "--max-shard-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["checkpoint", "consolidate", str(tmp_path), str(tmp_path / "o"), "--dtype", "int8"])
    assert "--dtype" in capsys.readouterr().err


def test_tied_tensors_once_and_stale_shards_removed(tmp_path):
    w = torch.randn(6, 4)
    state = {"embed.weight": w, "blocks.0.weight": torch.randn(4, 4), "head.weight": w, "view": w[:3]}
    written = hf_files.write_hf_model(str(tmp_path), state, max_shard_size=100, config={"model_type": "x"})
    saved = _files(tmp_path)
    assert sorted(saved) == ["blocks.0.weight", "embed.weight", "view"]  # the alias dropped, the view copied
    assert torch.equal(saved["view"], w[:3]) and len(written) == 5  # 3 shards, the index, config.json
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "x", "dtype": "float32"}
    hf_files.write_hf_model(str(tmp_path), state, dtype="fp16", format="bin")  # one file now: the shards go
    assert sorted(os.listdir(tmp_path)) == ["config.json", "pytorch_model.bin"]
    assert torch.load(tmp_path / "pytorch_model.bin", weights_only=True)["embed.weight"].dtype == torch.float16
