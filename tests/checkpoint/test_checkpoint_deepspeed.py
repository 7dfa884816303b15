"""Checkpoints written by real DeepSpeed (0.19, CPU accelerator, gloo) load into llmpar as they are.

One launch on 2 ranks: DeepSpeed trains the demo GPT K steps at ZeRO 0, 1, 2, 3 (fp32), ZeRO-2 bf16 and ZeRO-3 with
two frozen params (saved in chunks apart from the trained ones), saves, and continues N steps; llmpar builds the
model from another seed (the load must overwrite every value), loads each checkpoint at another ZeRO stage (dp=2)
and at tp=2 x dp=1 (the vocabulary 61 padded to 62 rows), continues the same N steps on the same global batches,
and its losses equal DeepSpeed's continuation (<= 1e-6 relative in fp32, bf16-level in bf16; DeepSpeed continuing
after its save and DeepSpeed loading that checkpoint give the same losses, bitwise, so the cheaper one is the
reference). The same run checks the counters, the LR scheduler, client_state, load_module_only /
load_optimizer_states=False, and the errors (a missing optimizer file, an unknown layout, a param of another shape)
naming what was found, on every rank. A second phase of the same launch goes the other way: llmpar checkpoints saved
right after two of those loads (and a DeepSpeed one) are converted to DeepSpeed's ZeRO and universal layouts
(``convert --to deepspeed|universal``) and real DeepSpeed resumes them, matching llmpar's continuation.
"""

import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

K, N = 2, 3  # steps DeepSpeed trains before its save, steps both continue
GAS, MICRO, SEQ, V = 2, 2, 16, 61


def _model(frozen=False, seed=3):
    """The demo GPT; ``frozen``: its position embedding and last norm's bias frozen (DeepSpeed saves them apart)."""
    from llmpar.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=V, n_layer=2, n_head=2, d_model=24, seq_len=SEQ), seed=seed)
    if frozen:
        model.pos_emb.weight.requires_grad_(False)
        model.ln_f.bias.requires_grad_(False)
    return model


def _config(stage, micro=MICRO, bf16=False):
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 3, "total_num_steps": 20, "warmup_max_lr": 1e-2, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000, "allgather_bucket_size": 5000},
        "bf16": {"enabled": bf16},
        "steps_per_print": 1000,
    }


def _batch(step, micro, rank):
    """Random tokens (odd vocabulary), different for every step, micro-batch and dp rank."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randint(0, V, (MICRO, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _train(engine, steps, whole):
    """``steps`` global steps; ``whole``: this rank takes both dp ranks' rows (a dp=1 engine). Returns the mean
    loss of each step over all rows."""
    out = []
    for step in steps:
        total = torch.zeros(1, dtype=torch.float64)
        for micro in range(GAS):
            if whole:
                parts = [_batch(step, micro, r) for r in range(2)]
                x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            else:
                x, y = _batch(step, micro, dist.get_rank())
            loss = engine.module.loss(engine(x), y).float()
            engine.backward(loss)
            engine.step()
            total += loss.item() / GAS
        if not whole:
            dist.all_reduce(total)
            total /= 2
        out.append(total.item())
    return out


def _llmpar(stage, tp=1, bf16=False, frozen=False):
    import llmpar

    env = llmpar.init_distributed(tp=tp)
    model = _model(frozen, seed=11)  # not DeepSpeed's initial values: the load must overwrite them all
    if tp > 1:
        llmpar.parallelize(model, env.mesh["tp"])
    micro = MICRO * 2 // env.mesh["dp"].size()
    engine, *_ = llmpar.initialize(model=model, config=_config(stage, micro, bf16), mesh=env.mesh)
    return engine


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test looks at the text
        return f"{type(e).__name__}: {e}"
    return None


def body(root, ext_dir):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", ext_dir)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's CPU comm op
    rank, out = dist.get_rank(), {"ds": {}, "ours": {}}

    for name, stage, bf16 in (
        ("z0", 0, False),
        ("z1", 1, False),
        ("z2", 2, False),
        ("z3", 3, False),
        ("b2", 2, True),
        ("f3", 3, False),
    ):
        cfg = _config(stage, bf16=bf16)
        cfg["optimizer"]["params"]["torch_adam"] = True
        ds, *_ = deepspeed.initialize(model=_model(name.startswith("f")), model_parameters=None, config=cfg)
        _train(ds, range(K), False)
        ds.save_checkpoint(f"{root}/{name}", client_state={"data_pos": 17 + K})
        with deepspeed.zero.GatheredParameters(list(ds.module.parameters()), enabled=stage == 3):
            out.setdefault("weights", {})[name] = {n: p.detach().clone() for n, p in ds.module.named_parameters()}
        out["ds"][name] = _train(ds, range(K, K + N), False)
        if name in ("z2", "z3"):  # a later save: its rank files mixed into the one at step K below
            ds.save_checkpoint(f"{root}/{name}_late")
        del ds
    dist.barrier()
    for name, stage, tp, bf16 in (
        ("z0", 2, 1, False),
        ("z1", 3, 1, False),
        ("z2", 1, 2, False),
        ("z3", 1, 1, False),
        ("z3", 2, 2, False),
        ("b2", 3, 1, True),
        ("f3", 3, 1, False),
        ("f3", 1, 1, False),
    ):
        engine = _llmpar(stage, tp, bf16, frozen=name.startswith("f"))
        path, client = engine.load_checkpoint(f"{root}/{name}")
        if (name, stage, tp) in (("z0", 2, 1), ("z2", 1, 2)):  # llmpar checkpoints at step K, for convert
            engine.save_checkpoint(f"{root}/ours_k" if tp == 1 else f"{root}/ours_tp")
        facts = (
            os.path.basename(path),
            client,
            engine.global_steps,
            engine.global_samples,
            engine.lr_scheduler.state_dict(),
        )
        out["ours"][(name, stage, tp)] = (_train(engine, range(K, K + N), tp > 1), facts)
        if (name, stage, tp) == ("z1", 3, 1):  # an llmpar checkpoint for convert's auto-detection
            engine.save_checkpoint(f"{root}/ours")
    # load_module_only: the weights, and the optimizer, scheduler and counters as they were
    engine = _llmpar(1)
    before = [{k: t.clone() for k, t in b.state.items()} for b in engine.optimizer.buffers]
    engine.load_checkpoint(f"{root}/z2", load_module_only=True)
    out["module_only"] = (
        {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        all(torch.equal(t, b0[k]) for b, b0 in zip(engine.optimizer.buffers, before) for k, t in b.state.items()),
        engine.global_steps,
        engine.lr_scheduler.state_dict()["last_batch_iteration"],
    )
    engine.load_checkpoint(f"{root}/z1", load_optimizer_states=False)
    out["no_opt"] = (
        all(torch.equal(t, b0[k]) for b, b0 in zip(engine.optimizer.buffers, before) for k, t in b.state.items()),
        engine.global_steps,
    )
    # errors, on every rank: a missing optimizer file, an unknown layout, a model with another shape
    if rank == 0:
        shutil.copytree(f"{root}/z2", f"{root}/lacking")
        os.remove(f"{root}/lacking/global_step{K}/zero_pp_rank_1_mp_rank_00_optim_states.pt")
        os.makedirs(f"{root}/junk/step9")
        open(f"{root}/junk/step9/weights.bin", "wb").close()
    dist.barrier()
    out["lacking"] = _error(lambda: engine.load_checkpoint(f"{root}/lacking"))
    out["junk"] = _error(lambda: engine.load_checkpoint(f"{root}/junk", tag="step9"))
    import llmpar
    from llmpar.models import GPT, GPTConfig

    wide = GPT(GPTConfig(vocab_size=V + 2, n_layer=2, n_head=2, d_model=24, seq_len=SEQ), seed=3)
    engine, *_ = llmpar.initialize(model=wide, config=_config(2))
    out["shape"] = _error(lambda: engine.load_checkpoint(f"{root}/z3"))
    _mixed_saves(root, out)
    _deepspeed_resumes_converted(root, out)
    return out


# checkpoints whose rank files were mixed by hand: (name, source, {file: where it comes from}); "late" / "early": the
# same file of the save at step K + N / K, "cut": truncated to half, another file name: that file of this save
OPT = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MIXED = (
    ("mixed2", "z2", {OPT.format(1): "late"}),
    ("swapped2", "z2", {OPT.format(0): OPT.format(1), OPT.format(1): OPT.format(0)}),
    ("late_opt2", "z2", {OPT.format(0): "late", OPT.format(1): "late"}),
    ("mixed3", "z3", {OPT.format(1): "late"}),
    ("late_opt3", "z3", {OPT.format(0): "late", OPT.format(1): "late"}),
    ("cut2", "z2", {OPT.format(1): "cut"}),
    ("early_opt2", "z2_late", {OPT.format(0): "early", OPT.format(1): "early"}),
)


def _mixed_saves(root, out):
    """Each MIXED checkpoint loaded into a ZeRO-2 engine on both ranks: the errors, and whether the engine's params
    are what they were."""
    if dist.get_rank() == 0:
        for name, src, swaps in MIXED:
            shutil.copytree(f"{root}/{src}", f"{root}/{name}")
            step = K + N if src.endswith("_late") else K
            d, late = f"{root}/{name}/global_step{step}", f"{root}/{src}_late/global_step{K + N}"
            early = f"{root}/{src.removesuffix('_late')}/global_step{K}"
            for f, frm in swaps.items():
                if frm == "cut":
                    data = open(f"{d}/{f}", "rb").read()
                    open(f"{d}/{f}", "wb").write(data[: len(data) // 2])
                else:
                    where = {"late": late, "early": early}.get(frm, f"{root}/{src}/global_step{K}")
                    shutil.copy(f"{where}/{f if frm in ('late', 'early') else frm}", f"{d}/{f}")
    dist.barrier()
    engine = _llmpar(2)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out["mixed"] = {name: _error(lambda: engine.load_checkpoint(f"{root}/{name}")) for name, _, _ in MIXED}  # noqa
    out["mixed_untouched"] = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())


# (source, layout, ZeRO stage DeepSpeed loads it at): llmpar's ZeRO-2 dp=2 checkpoint at step K, DeepSpeed's ZeRO-1,
# llmpar's ZeRO-1 tp=2 x dp=1 one (its tp shards merged; a universal checkpoint, loaded at dp=2)
CONVERTED = (
    ("ours_k", "deepspeed", 2),
    ("ours_k", "deepspeed", 3),
    ("z1", "deepspeed", 3),
    ("ours_tp", "universal", 2),
    ("ours_tp", "universal", 3),
)


def _deepspeed_resumes_converted(root, out):
    """Second phase: ``convert --to deepspeed`` (rank 0), then real DeepSpeed loads each result on a model of
    another seed and trains the same N steps."""
    import deepspeed

    from llmpar.checkpoint import convert
    from llmpar.checkpoint.formats.deepspeed.files import DS_KEYS

    if dist.get_rank() == 0:
        for src, to, stage in CONVERTED:
            if to == "deepspeed" or stage == 2:
                convert.convert(
                    f"{root}/{src}", f"{root}/to_{to}_{src}_{stage}", to=to, stage=stage if to == "deepspeed" else None
                )
    dist.barrier()
    out["to_ds"] = {}
    for src, to, stage in CONVERTED:
        cfg = _config(stage)
        cfg["optimizer"]["params"]["torch_adam"] = True
        cfg["checkpoint"] = {"load_universal": to == "universal"}
        ds, *_ = deepspeed.initialize(model=_model(seed=5), model_parameters=None, config=cfg)
        path, client = ds.load_checkpoint(f"{root}/to_{to}_{src}_{2 if to == 'universal' else stage}")
        facts = (
            os.path.basename(os.path.dirname(path)),
            {k: v for k, v in client.items() if k not in DS_KEYS},
            ds.global_steps,
            ds.global_samples,
            ds.lr_scheduler.state_dict(),
        )
        out["to_ds"][(src, to, stage)] = (_train(ds, range(K, K + N), False), facts)
        del ds


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ds_ext_dir):
    root = tmp_path_factory.mktemp("dsck")
    return run_ranks(body, 2, str(root), str(ds_ext_dir), timeout=300), root


def test_llmpar_continues_deepspeed_checkpoints(runs):
    runs, _ = runs
    out = runs[0]
    assert set(out["ours"]) == {
        ("z0", 2, 1),
        ("z1", 3, 1),
        ("z2", 1, 2),
        ("z3", 1, 1),
        ("z3", 2, 2),
        ("b2", 3, 1),
        ("f3", 3, 1),
        ("f3", 1, 1),
    }
    for (name, stage, tp), (losses, facts) in out["ours"].items():
        theirs = out["ds"][name]
        rtol = 1e-2 if name.startswith("b") else 1e-6
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(theirs),
            rtol=rtol,
            atol=0,
            msg=lambda m: f"{name} -> stage {stage} tp {tp}: {m}",
        )
        assert facts == (
            f"global_step{K}",
            {"data_pos": 17 + K},
            K,
            K * GAS * MICRO * 2,
            {"last_batch_iteration": K - 1},
        ), (name, stage, tp, facts)
    for r in runs[1:]:  # every rank saw the same global losses
        assert r["ours"].keys() == out["ours"].keys()
        for key, (losses, _) in r["ours"].items():
            assert losses == out["ours"][key][0]


def test_module_only_and_without_optimizer_states(runs):
    runs, _ = runs
    weights, states_kept, steps, last = runs[0]["module_only"]
    saved = runs[0]["weights"]["z2"]
    assert weights.keys() == saved.keys()
    for n in saved:
        torch.testing.assert_close(weights[n], saved[n], rtol=0, atol=0)
    assert states_kept and steps == 0 and last == -1  # optimizer, counters and scheduler as they were
    kept, steps = runs[0]["no_opt"]
    assert kept and steps == K


def test_errors_name_what_was_found(runs):
    runs, _ = runs
    for out in runs:
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" not in out["lacking"].split("found")[-1]
        assert "lacks the optimizer files of dp ranks [1]" in out["lacking"], out["lacking"]
        assert "is not complete" in out["junk"] and "weights.bin" in out["junk"], out["junk"]
        assert "neither llmpar's layout" in out["junk"]
        assert "'tok_emb.weight' has full shape (63, 24) here" in out["shape"], out["shape"]
        assert "(61, 24)" in out["shape"]


def test_rank_files_of_different_saves_or_swapped_are_refused_naming_them(runs, tmp_path):
    """DeepSpeed optimizer files of another save (Adam step 5 beside 2, ZeRO-2 and ZeRO-3), swapped between the
    ranks, all of a later or an earlier save than the model states file, or one truncated: refused on every rank
    naming the files,
    before anything of the engine changed (they loaded silently, or failed mid-load); convert refuses them too."""
    from llmpar.checkpoint import convert
    from llmpar.checkpoint.files import CheckpointError

    runs, root = runs
    for out in runs:
        err = out["mixed"]
        for name in ("mixed2", "mixed3"):
            assert "the optimizer files are of different saves" in err[name], err[name]
            assert f"{OPT.format(0)}: [{float(K)}]" in err[name] and f"{OPT.format(1)}: [{float(K + N)}]" in err[name]
        for name in ("swapped2", "early_opt2"):  # the same steps in every file: the masters tell
            assert f"{OPT.format(0)} does not hold dp rank 0's partition of this save" in err[name], err[name]
            assert "differs from the weights in the model states file" in err[name]
        for name in ("late_opt2", "late_opt3"):
            assert f"the optimizer files record {K + N} optimizer steps, more than the {K} global steps" in err[name], (
                err[name]
            )
        assert f"cannot read DeepSpeed checkpoint file {root}/cut2/global_step{K}/{OPT.format(1)}" in err["cut2"], err[
            "cut2"
        ]
        assert "mixed" not in err["cut2"].split(OPT.format(1))[-1]  # found before the load began, not mid-load
        assert out["mixed_untouched"]
    for name in ("mixed2", "swapped2", "mixed3", "late_opt3"):
        with pytest.raises(CheckpointError, match="different saves|partition of this save|of a later save"):
            convert.convert(str(root / name), str(tmp_path / name))
        assert not (tmp_path / name).exists()


def test_convert_to_hf_verifies_what_it_wrote(runs, tmp_path):
    """``llmpar checkpoint convert`` (source auto-detected): DeepSpeed ZeRO-0 / ZeRO-3 (dp=2) / bf16 ZeRO-2
    checkpoints give DeepSpeed's weights at the save (the fp32 masters; bf16: they round to the bf16 weights), an
    llmpar checkpoint gives its consolidated state dict; the check reads back what was written and catches a
    difference; a wrong --from or --to is refused naming the layout."""
    from safetensors.torch import load_file

    from llmpar.checkpoint import CheckpointError, consolidate, convert
    from llmpar.checkpoint.formats.hf.write import verify
    from llmpar.cli import main

    runs, root = runs
    weights = runs[0]["weights"]
    for name in ("z0", "z3", "b2"):
        assert main(["checkpoint", "convert", str(root / name), str(tmp_path / name)]) == 0
        got = load_file(tmp_path / name / "model.safetensors")
        assert got.keys() == weights[name].keys()
        for n, w in weights[name].items():
            assert got[n].dtype == torch.float32
            torch.testing.assert_close(got[n].to(w.dtype), w, rtol=0, atol=0)
    assert main(["checkpoint", "convert", str(root / "ours"), str(tmp_path / "ours"), "--dtype", "bf16"]) == 0
    got, ref = (
        load_file(tmp_path / "ours" / "model.safetensors"),
        consolidate.consolidated_state_dict(str(root / "ours"), dtype=torch.bfloat16),
    )
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)
    bad = dict(got)
    bad["ln_f.bias"] = bad["ln_f.bias"] + 1
    with pytest.raises(CheckpointError, match="'ln_f.bias' in .* differs"):
        verify(bad, [str(tmp_path / "ours" / "model.safetensors")])
    with pytest.raises(CheckpointError, match="is a DeepSpeed checkpoint"):
        convert.convert(str(root / "z3"), str(tmp_path / "x"), source="llmpar")
    with pytest.raises(CheckpointError, match="not a DeepSpeed checkpoint .* holds"):
        convert.convert(str(root / "ours"), str(tmp_path / "x"), source="deepspeed")
    with pytest.raises(ValueError, match="to='dcp'"):
        convert.convert(str(root / "z3"), str(tmp_path / "x"), to="dcp")


def test_deepspeed_checkpoint_reads_without_deepspeed(tmp_path):
    """A hand-made ZeRO-3 checkpoint of dp=3 (params of 7 and 5 elements: chunks of 3 and 2, the last padded): any
    element range of the masters and moments reads back across rank boundaries, and DeepSpeed's pickled classes are
    read as stand-ins (DeepSpeed's module is replaced here by one DeepSpeed cannot import from)."""
    import types
    from unittest import mock

    from llmpar.checkpoint.formats.deepspeed import files as ds_files
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed

    class ZeroStageEnum:
        def __init__(self, value):
            self.value = value

        def __reduce__(self):
            return (ZeroStageEnum, (self.value,))

    class DynamicLossScaler:  # an fp16 run's scaler, pickled with its __dict__
        pass

    ZeroStageEnum.__module__, ZeroStageEnum.__qualname__ = "deepspeed", "ZeroStageEnum"
    DynamicLossScaler.__module__, DynamicLossScaler.__qualname__ = "deepspeed", "DynamicLossScaler"
    scaler = DynamicLossScaler()
    scaler.__dict__.update(cur_scale=256.0, cur_iter=5, last_overflow_iter=0, cur_hysteresis=2, dynamic=True)
    shapes = {"a": (7,), "b": (5,)}
    full = {n: torch.randn(math.prod(s), dtype=torch.float64).float() for n, s in shapes.items()}
    moments = {n: torch.randn(math.prod(s), dtype=torch.float64).float() for n, s in shapes.items()}
    d = tmp_path / "global_step1"
    d.mkdir()
    (tmp_path / "latest").write_text("global_step1")

    def chunk(t, r, c):
        return torch.cat([t, torch.zeros(3 * c - t.numel())])[r * c : (r + 1) * c]

    fake = types.SimpleNamespace(ZeroStageEnum=ZeroStageEnum, DynamicLossScaler=DynamicLossScaler)
    with mock.patch.dict("sys.modules", {"deepspeed": fake}):
        for r in range(3):
            flat = torch.cat([chunk(full["a"], r, 3), chunk(full["b"], r, 2)])
            mom = torch.cat([chunk(moments["a"], r, 3), chunk(moments["b"], r, 2)])
            state = {"state": {0: {"step": torch.tensor(4.0), "exp_avg": mom}}, "param_groups": [{"params": [0]}]}
            torch.save(
                {
                    "optimizer_state_dict": {
                        "zero_stage": ZeroStageEnum(3),
                        "partition_count": 3,
                        "loss_scaler": scaler,
                        "fp32_flat_groups": [flat],
                        "optimizer_state_dict": state,
                    }
                },
                d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
            )
            torch.save(
                {
                    "module": {},
                    "param_shapes": [{n: torch.Size(s) for n, s in shapes.items()}],
                    "global_steps": 1,
                    "my_key": r,
                },
                d / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
            )
    assert ds_files.resolve(str(tmp_path), None) == str(d)
    ck = open_deepspeed(str(d), validate=False)
    assert isinstance(ck.zero_state(0)["zero_stage"], ds_files.Foreign)
    assert (ck.stage, ck.dp, ck.names, ck.step("b")) == (3, 3, ["a", "b"], 4.0)
    for n in shapes:
        k = full[n].numel()
        for a in range(k):
            for z in range(a + 1, k + 1):
                assert torch.equal(ck.read(n, "master", a, z), full[n][a:z])
                assert torch.equal(ck.read(n, "exp_avg", a, z), moments[n][a:z])
    assert ck.client_state() == {"my_key": 0}
    assert ck.counters() == {
        "global_steps": 1,
        "global_samples": 0,
        "skipped_steps": 0,
        "loss_scaler": {
            "cur_scale": 256.0,
            "cur_iter": 5,
            "last_overflow_iter": 0,
            "cur_hysteresis": 2,
            "dynamic": True,
        },
    }


def test_deepspeed_layouts_not_read_are_named(tmp_path):
    """A tensor-parallel pipeline (layer_*-model_01) DeepSpeed checkpoint is refused naming its files; a
    tensor-parallel one (mp_rank_01) whose files cannot be read fails naming its ranks."""
    from llmpar.checkpoint.files import CheckpointError
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed

    for sub, names, match in (
        ("pipe", ["layer_01-model_01-model_states.pt", "mp_rank_00_model_states.pt"], r"tensor-parallel ranks \[1\]"),
        ("mp", ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"], r"model-parallel ranks \[0, 1\]"),
    ):
        d = tmp_path / sub
        d.mkdir()
        for n in names:
            (d / n).write_bytes(b"")
        with pytest.raises(CheckpointError, match=match):
            open_deepspeed(str(d), validate=False)


def test_deepspeed_resumes_what_convert_wrote(runs, tmp_path):
    """``llmpar checkpoint convert SRC DST --to deepspeed --stage S`` / ``--to universal``: real DeepSpeed loads what
    was written from an llmpar ZeRO-2 checkpoint (at ZeRO-2 and ZeRO-3), from a DeepSpeed ZeRO-1 one (at ZeRO-3) and,
    as a universal checkpoint with load_universal, from an llmpar tp=2 x dp=1 one (at ZeRO-2 and ZeRO-3, dp=2), and
    its next N losses equal llmpar continuing from the source (DeepSpeed continuing, for its own checkpoint),
    <= 1e-6 rel; the counters, scheduler and client_state travel. What was written reads back through llmpar's
    DeepSpeed reader bitwise (the converter's own check, also run here on a DeepSpeed source with frozen params to
    another dp); the checks catch a difference; bad arguments and a pipeline source are refused naming them."""
    from unittest import mock

    from llmpar.checkpoint import convert, metacheck
    from llmpar.checkpoint.files import CheckpointError
    from llmpar.checkpoint.formats.deepspeed import write as ds_write
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed
    from llmpar.checkpoint.formats.open import open_source, writable
    from llmpar.checkpoint.formats.source import locate
    from llmpar.checkpoint.formats.universal import write as ds_universal
    from llmpar.cli import main

    runs, root = runs
    for r in runs:
        assert set(r["to_ds"]) == set(CONVERTED)
        for (src, to, stage), (losses, facts) in r["to_ds"].items():
            ref = (
                runs[0]["ds"][src]
                if src in runs[0]["ds"]
                else runs[0]["ours"][{"ours_k": ("z0", 2, 1), "ours_tp": ("z2", 1, 2)}[src]][0]
            )
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(ref),
                rtol=1e-6,
                atol=0,
                msg=lambda m: f"{src} -> {to}, DeepSpeed ZeRO-{stage}: {m}",
            )
            client = {} if src.startswith("ours") else {"data_pos": 17 + K}
            assert facts == (f"global_step{K}", client, K, K * GAS * MICRO * 2, {"last_batch_iteration": K - 1}), (
                src,
                stage,
                facts,
            )
    # the CLI, a DeepSpeed ZeRO-3 source with frozen params to ZeRO-2 at dp=3; read back by llmpar
    assert (
        main(
            [
                "checkpoint",
                "convert",
                str(root / "f3"),
                str(tmp_path / "f"),
                "--to",
                "deepspeed",
                "--stage",
                "2",
                "--dp",
                "3",
            ]
        )
        == 0
    )
    ck, src = (
        open_deepspeed(str(tmp_path / "f" / f"global_step{K}"), validate=False),
        open_deepspeed(str(root / "f3" / f"global_step{K}"), validate=False),
    )
    assert (ck.stage, ck.dp, ck.names) == (2, 3, src.names)
    for n in src.names:
        k = math.prod(src.shapes[n])
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ck.read(n, key, 0, k), src.read(n, key, 0, k)), (n, key)
    assert ck.frozen().keys() == src.frozen().keys() == {"pos_emb.weight", "ln_f.bias"}
    assert all(torch.equal(ck.frozen()[n], src.frozen()[n]) for n in src.frozen())
    assert ck.client_state() == {"data_pos": 17 + K}
    # the checks catch a difference: a source read differently from what was written
    src = writable(open_source(locate(str(root / "ours_k"))))
    ds_write.write_deepspeed(str(root / "ours_k"), str(tmp_path / "k3"), stage=3)
    ds_universal.write_universal(str(root / "ours_k"), str(tmp_path / "u"))
    piece = src.piece
    src.piece = lambda n, key, a, z: piece(n, key, a, z) + (key == "exp_avg" and n == "ln_f.bias")
    with pytest.raises(CheckpointError, match="param 'ln_f.bias' exp_avg read back differs"):
        ds_write.verify(src, str(tmp_path / "k3" / f"global_step{K}"), 3, 2)
    with pytest.raises(CheckpointError, match="exp_avg of 'ln_f.bias'"):
        ds_universal.verify(src, str(tmp_path / "u" / f"global_step{K}"))
    for meta, match in (
        ({"pp": 2}, r"pipeline checkpoint \(pp=2\)"),
        ({"pp": 1, "param_groups": [{}, {}]}, "llmpar checkpoint of 2 param groups"),
    ):
        with (
            mock.patch.object(metacheck, "read", lambda path, real=metacheck.read, meta=meta: {**real(path), **meta}),
            pytest.raises(CheckpointError, match=match),
        ):
            ds_write.write_deepspeed(str(root / "ours_k"), str(tmp_path / "x"))
    with pytest.raises(ValueError, match="stage=4: DeepSpeed's ZeRO layout is written for stages 1, 2 or 3"):
        convert.convert(str(root / "z2"), str(tmp_path / "x"), to="deepspeed", stage=4)
    with pytest.raises(ValueError, match="dp=0"):
        ds_write.write_deepspeed(str(root / "z2"), str(tmp_path / "x"), dp=0)
    with pytest.raises(ValueError, match="only for to='deepspeed'"):
        convert.convert(str(root / "z2"), str(tmp_path / "x"), stage=2)
