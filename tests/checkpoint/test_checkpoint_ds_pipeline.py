"""DeepSpeed *pipeline* checkpoints (``layer_II-model_states.pt`` per layer, ``mp_rank_SS_model_states.pt`` and ZeRO-1
``zero_pp_rank_R_mp_rank_SS_optim_states.pt`` per stage) load into llmpar as they are
(``formats/deepspeed/pipeline.py``).

One launch on 2 ranks (the rank pool): real DeepSpeed (0.19, CPU, gloo) trains ``tests/data/pipe_ckpt_model.py``'s
PipelineModule (a weight tied between the stages, called through a ``forward_fn`` on stage 1, a frozen param, random
persistent buffers, odd widths) at pp=2 x dp=1, ZeRO-1, with a WarmupLR schedule and gradient clipping, for K steps,
saves with a client_state, and continues N steps on given batches. llmpar builds the model from another seed (the load
must overwrite every value) and loads the checkpoint at the same layout (pp=2, ZeRO-1), at pp=1 x dp=2 (ZeRO-2) and
into a plain (non-pipeline) engine at dp=2 (ZeRO-3) of a module with the PipelineModule's names, continues the same N
steps on the same global batches, and its losses equal DeepSpeed's continuation (<= 1e-6 relative; at the same layout
the weights after those steps equal DeepSpeed's to 1e-6 too); counters, scheduler, client_state, lr, buffers
and the frozen param travel. The same launch checks the errors, on both ranks: a missing layer file, a truncated one,
a model with a layer fewer, each naming the file. The same launch has DeepSpeed save the pipeline without ZeRO
(fp32: torch's optimizer state in the model states files, the frozen param in it, stateless; bf16: BF16_Optimizer's
flat files), which llmpar continues at pp=2 and pp=1 x dp=2 (fp32) and reads bitwise (bf16), the params named by the
loading model.
"""

import os
import shutil
import sys

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

K, N = 2, 3  # steps DeepSpeed trains before its save, steps both continue
MICRO, GAS = 3, 4  # DeepSpeed's pp=2 x dp=1 run: 12 rows per step
TAG = "saved"


def _model_file():
    """``tests/data/pipe_ckpt_model.py`` (imported on the ranks, whose path may not hold tests/data)."""
    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
    if data not in sys.path:
        sys.path.insert(0, data)
    import pipe_ckpt_model

    return pipe_ckpt_model


def _config(stage, micro=MICRO, gas=GAS, clip=0.5):
    """``stage`` None: no "zero_optimization" (DeepSpeed's default for pipelines: the optimizer in the model files)."""
    zero = {} if stage is None else {"zero_optimization": {"stage": stage}}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "gradient_clipping": clip,
        **zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-2, "weight_decay": 0.01, "betas": [0.9, 0.95], "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_max_lr": 2e-2, "warmup_type": "linear"},
        },
    }


def _data(step, dp):
    """This rank's micro-batches of global step ``step`` (the same 12 rows split over dp)."""
    mine = _model_file().batches(step, GAS, MICRO)
    per = GAS // dp
    r = dist.get_rank() if dp > 1 else 0
    return mine[r * per : (r + 1) * per]


def _deepspeed(root, pp, stage=1):
    """DeepSpeed trains the pipeline at pp x dp=2/pp for K steps, saves, continues N steps: (losses, params after),
    params and buffers at the save, (scheduler state, lr) at the save. ``stage`` None: no ZeRO, and DeepSpeed's
    optimizer holds every param (the frozen one too, stateless), not only the trained ones; no gradient clipping
    (DeepSpeed's fp32 pipeline without ZeRO clips by the norm of stage 0's gradients only, llmpar by the whole
    model's: README)."""
    import deepspeed
    import deepspeed.ops

    M = _model_file()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's CPU comm op
    deepspeed.init_distributed()
    torch.manual_seed(1234)
    net = deepspeed.pipe.PipelineModule(
        layers=M.layers(deepspeed.pipe), loss_fn=torch.nn.CrossEntropyLoss(), num_stages=pp
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for b in net.buffers():  # random buffers: the load must carry them
            b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    trained = [p for p in net.parameters() if p.requires_grad or stage is None]
    config = _config(stage, gas=GAS * pp // 2, clip=0.5 if stage else 0.0)
    engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=trained)
    for step in range(K):
        engine.train_batch(iter(_data(step, 2 // pp)))
    engine.save_checkpoint(root, tag=TAG, client_state={"epoch": 7, "note": "pipe"})
    state = {n: t.detach().clone() for n, t in [*net.named_parameters(), *net.named_buffers()]}
    run = (engine.lr_scheduler.state_dict(), engine.get_lr())
    losses = [float(engine.train_batch(iter(_data(step, 2 // pp)))) for step in range(K, K + N)]
    end = {n: t.detach().clone() for n, t in net.named_parameters()}
    return (losses, end), state, run


def _deepspeed_bf16(root):
    """DeepSpeed trains the bf16 pipeline (pp=2, no ZeRO: its BF16_Optimizer, bf16_zero_pp_rank_0_mp_rank_SS files)
    for K steps and saves: this stage's params, its fp32 flat masters and Adam moments (DeepSpeed's own tensors)."""
    import deepspeed

    M = _model_file()
    torch.manual_seed(1234)
    net = deepspeed.pipe.PipelineModule(
        layers=M.layers(deepspeed.pipe), loss_fn=torch.nn.CrossEntropyLoss(), num_stages=2
    ).to(torch.bfloat16)
    config = {**_config(None, clip=0.0), "bf16": {"enabled": True}}
    engine, *_ = deepspeed.initialize(
        model=net, config=config, model_parameters=[p for p in net.parameters() if p.requires_grad]
    )
    for step in range(K):
        engine.train_batch(iter([(x.to(torch.bfloat16), y) for x, y in _data(step, 1)]))
    engine.save_checkpoint(root, tag=TAG)
    opt = engine.optimizer
    state = opt.optimizer.state[opt.optimizer.param_groups[0]["params"][0]]
    flat = {k: state[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")}
    flat["master"] = opt.fp32_groups_flat_partition[0].detach().clone()
    return type(opt).__name__, {n: t.detach().clone() for n, t in net.named_parameters()}, flat


def _llmpar(layout, layers=None, clip=0.5):
    """An llmpar engine of ``layout``: "pp2" (pp=2, ZeRO-1), "pp1" (PipelineModule at pp=1 x dp=2, ZeRO-2), "plain"
    (a plain module with the PipelineModule's names, dp=2, ZeRO-3), built from another seed."""
    import llmpar
    import llmpar.pipe

    M = _model_file()
    torch.manual_seed(99)
    if layout == "plain":
        model = M.Flat(llmpar.pipe)
        engine, *_ = llmpar.initialize(model=model, config=_config(3, gas=GAS // 2, clip=clip))
        return engine, model
    pp = 2 if layout == "pp2" else 1
    net = llmpar.pipe.PipelineModule(
        layers=layers or M.layers(llmpar.pipe), loss_fn=torch.nn.CrossEntropyLoss(), num_stages=pp
    )
    engine, *_ = llmpar.initialize(
        model=net, config=_config(1 if pp == 2 else 2, gas=GAS * pp // 2, clip=clip), training_data=None
    )
    return engine, net


def _train(engine, model, layout):
    dp = 1 if layout == "pp2" else 2
    if layout != "plain":
        return [float(engine.train_batch(iter(_data(step, dp)))) for step in range(K, K + N)]
    out = []
    for step in range(K, K + N):
        total = torch.zeros(1, dtype=torch.float64)
        for x, y in _data(step, dp):
            loss = torch.nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / len(_data(step, dp))
        dist.all_reduce(total)
        out.append(total.item() / dp)
    return out


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the text
        return f"{type(e).__name__}: {e}"
    return None


def body(root, ext_dir):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", ext_dir)
    out = {}
    out["ds"], out["ds_state"], out["ds_run"] = _deepspeed(root, 2)
    out["ds_dp2"], out["ds_dp2_state"], out["ds_dp2_run"] = _deepspeed(os.path.join(root, "dp2"), 1)
    out["ds_z0"], out["ds_z0_state"], out["ds_z0_run"] = _deepspeed(os.path.join(root, "z0"), 2, stage=None)
    out["ds_bf16"] = _deepspeed_bf16(os.path.join(root, "bf16"))
    dist.barrier()
    for layout in ("pp2", "pp1", "plain", "pp2<dp2", "pp2<z0", "pp1<z0"):
        engine, model = _llmpar(layout.split("<")[0], clip=0.0 if "z0" in layout else 0.5)
        path, client = engine.load_checkpoint(root if "<" not in layout else os.path.join(root, layout.split("<")[1]))
        loaded = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        if layout == "plain":  # ZeRO-3: gathered to compare
            loaded = {n: t.detach().clone() for n, t in engine.module_state_dict().items()}
        facts = (
            os.path.basename(path),
            client,
            engine.global_steps,
            engine.global_samples,
            engine.lr_scheduler.state_dict(),
            [g["lr"] for g in engine.optimizer.param_groups],
        )
        losses = _train(engine, model, layout.split("<")[0])
        end = {n: t.detach().clone() for n, t in model.named_parameters()} if layout in ("pp2", "pp2<z0") else None
        out[layout] = ((losses, end), facts, loaded)
    # errors, on both ranks: a missing layer file, a truncated one, a model of another layer count
    import llmpar.pipe

    M = _model_file()
    if dist.get_rank() == 0:
        for bad in ("missing", "truncated"):
            shutil.copytree(os.path.join(root, TAG), os.path.join(root, bad, TAG))
        os.remove(os.path.join(root, "missing", TAG, "layer_03-model_states.pt"))
        victim = os.path.join(root, "truncated", TAG, "layer_07-model_states.pt")
        with open(victim, "rb") as f:
            head = f.read()[:200]
        with open(victim, "wb") as f:
            f.write(head)
    dist.barrier()
    errors = {}
    for bad in ("missing", "truncated"):
        engine, _ = _llmpar("pp2")
        errors[bad] = _error(lambda: engine.load_checkpoint(os.path.join(root, bad), tag=TAG))
    fewer = M.layers(llmpar.pipe)[:-1]  # no last Linear: the checkpoint's layer 10 has no place
    engine, _ = _llmpar("pp2", layers=fewer)
    errors["fewer"] = _error(lambda: engine.load_checkpoint(root))
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ds_ext_dir):
    root = tmp_path_factory.mktemp("dspipe")
    return run_ranks(body, 2, str(root), str(ds_ext_dir), timeout=240), root


def test_deepspeed_pipeline_checkpoint_files(runs):
    """The layout this reader expects is the one DeepSpeed wrote: a layer file per layer but the tied head called
    through forward_fn, a model states file and a ZeRO-1 optimizer file per stage; the reader joins the stages, the
    tied weight once (its stage-1 copy equal to stage 0's), buffers and the frozen param from the layer files."""
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed
    from llmpar.checkpoint.formats.deepspeed.pipeline import DeepSpeedPipelineCheckpoint

    runs, root = runs
    files = sorted(os.listdir(root / TAG))
    assert files == [f"layer_{i:02d}-model_states.pt" for i in (0, 1, 2, 3, 4, 5, 6, 7, 10)] + [
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
    ]
    ck = open_deepspeed(str(root / TAG), validate=False)
    assert isinstance(ck, DeepSpeedPipelineCheckpoint) and (ck.pp, ck.stage, ck.dp) == (2, 1, 1)
    state = runs[0]["ds_state"]  # DeepSpeed's params right after its save: stage 0's on rank 0, stage 1's on rank 1
    both = {**runs[1]["ds_state"], **state}
    trained = {n for n in both if n != "2.norm.bias" and not n.endswith("scale")}
    assert set(ck.names) == trained and ck.names[0] == "tied_modules.embed.weight"
    for n in trained:
        assert torch.equal(ck.read(n, "master", 0, both[n].numel()), both[n].reshape(-1)), n
    tied = "tied_modules.embed.weight"
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(ck.stages[0].read(tied, key, 0, 91), ck.stages[1].read(tied, key, 0, 91))
    assert ck.frozen().keys() == {"2.norm.bias"} and torch.equal(ck.frozen()["2.norm.bias"], both["2.norm.bias"])
    assert ck.buffers().keys() == {"2.scale", "7.scale"}
    assert all(torch.equal(ck.buffers()[n], both[n]) for n in ck.buffers())
    # without ZeRO: the optimizer in the model states files (params by index, the frozen one stateless), no names
    from llmpar.checkpoint.files import CheckpointError

    assert sorted(os.listdir(root / "z0" / TAG)) == files[:-2]
    with pytest.raises(CheckpointError, match=r"without ZeRO \(torch optimizer\): its files name no params"):
        open_deepspeed(str(root / "z0" / TAG), validate=False)


@pytest.mark.parametrize("layout", ["pp2", "pp1", "plain", "pp2<dp2", "pp2<z0", "pp1<z0"])
def test_llmpar_continues_deepspeed_pipeline(runs, layout):
    """llmpar continues DeepSpeed's pp=2 checkpoint at the same layout (pp=2, ZeRO-1), at pp=1 x dp=2 ZeRO-2 and in a
    plain engine at dp=2 ZeRO-3, and DeepSpeed's pp=1 x dp=2 checkpoint (each optimizer file a dp partition) at pp=2
    ("pp2<dp2"), and DeepSpeed's pp=2 checkpoint without ZeRO (torch's optimizer state in the model states files,
    the params named from llmpar's model) at pp=2 and pp=1 x dp=2 ("<z0"): the next losses are DeepSpeed's (<= 1e-6
    relative); every value it loaded is DeepSpeed's, bitwise (its own build drew others); counters, scheduler, lr and
    client_state are DeepSpeed's."""
    runs, _ = runs
    src = f"ds_{layout.split('<')[1]}" if "<" in layout else "ds"
    theirs = runs[0][src][0]
    both = {**runs[1][f"{src}_state"], **runs[0][f"{src}_state"]}
    for r, out in enumerate(runs):
        (losses, end), facts, loaded = out[layout]
        # DeepSpeed sums the micro-batch losses in fp32, llmpar in fp64: the reported losses differ in the last bits
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(theirs), rtol=1e-6, atol=0)
        if layout in ("pp2", "pp2<z0"):  # the same layout: the weights after the N steps are DeepSpeed's, to an ulp
            ds_end = out[src][1]  # or two (not bitwise: the sums of the step run in another order)
            assert end.keys() == ds_end.keys()
            for n in end:
                torch.testing.assert_close(end[n], ds_end[n], rtol=1e-6, atol=1e-7, msg=lambda m: f"{r} {n}: {m}")
        name, client, steps, samples, sched, lrs = facts
        assert (name, client, steps, samples) == (TAG, {"epoch": 7, "note": "pipe"}, K, K * MICRO * GAS)
        assert (sched, lrs) == runs[0][f"{src}_run"], (sched, lrs)
        for n, t in loaded.items():
            assert torch.equal(t, both[n]), (layout, r, n)
        if layout.startswith("pp2"):  # the rank's own stage, the tied weight on both
            assert len(loaded) == len(runs[r]["ds_state"])
        elif layout == "pp1" or r == 0:  # the plain engine's ZeRO-3 state dict is gathered on rank 0
            assert loaded.keys() == both.keys()


def test_convert_deepspeed_pipeline_checkpoint(runs, tmp_path):
    """``llmpar checkpoint convert`` reads a DeepSpeed pipeline checkpoint too: to HF safetensors (every tensor under
    the PipelineModule's names, DeepSpeed's values bitwise, the tied weight once) and to DeepSpeed's ZeRO layout (one
    model-parallel rank; read back equal to the pipeline checkpoint: masters, moments, steps)."""
    from safetensors.torch import load_file

    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed
    from llmpar.checkpoint.formats.deepspeed.rank import RankCheckpoint
    from llmpar.cli import main

    runs, root = runs
    both = {**runs[1]["ds_state"], **runs[0]["ds_state"]}
    assert main(["checkpoint", "convert", str(root), str(tmp_path / "hf"), "--to", "hf"]) == 0
    got = {}
    for f in sorted(os.listdir(tmp_path / "hf")):
        if f.endswith(".safetensors"):
            got.update(load_file(str(tmp_path / "hf" / f)))
    assert got.keys() == both.keys() and all(torch.equal(got[n], both[n]) for n in both)
    assert main(["checkpoint", "convert", str(root), str(tmp_path / "z"), "--to", "deepspeed"]) == 0
    src = open_deepspeed(str(root / TAG), validate=False)
    (tag,) = [d for d in os.listdir(tmp_path / "z") if d != "latest"]
    ck = open_deepspeed(str(tmp_path / "z" / tag), validate=False)
    assert type(ck) is RankCheckpoint and ck.names == src.names and (ck.stage, ck.dp) == (1, 1)
    for n in src.names:
        k = both[n].numel()
        assert ck.step(n) == src.step(n) == K
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ck.read(n, key, 0, k), src.read(n, key, 0, k)), (n, key)
    assert ck.client_state() == src.client_state() == {"epoch": 7, "note": "pipe"}


def test_bad_pipeline_checkpoints_fail_on_every_rank_naming_the_file(runs):
    runs, _ = runs
    for out in runs:
        e = out["errors"]
        assert e["missing"] and "lacks layer file layer_03-model_states.pt" in e["missing"], e["missing"]
        assert (
            e["truncated"]
            and "layer_07-model_states.pt" in e["truncated"]
            and "cannot read DeepSpeed checkpoint file" in e["truncated"]
        ), e["truncated"]
        assert (
            e["fewer"]
            and "in no rank's model" in e["fewer"]
            and "'10.weight' (" in e["fewer"]
            and "layer_10-model_states.pt" in e["fewer"]
        ), e["fewer"]


def test_pipeline_layouts_not_read_are_named(tmp_path):
    """A tensor-parallel pipeline checkpoint (layer_*-model_01-*) and a pipeline directory without its model states
    files are refused naming what was found, before any file is read."""
    from llmpar.checkpoint.files import CheckpointError
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed

    for sub, names, match in (
        (
            "tp",
            ["layer_01-model_00-model_states.pt", "layer_01-model_01-model_states.pt", "mp_rank_00_model_states.pt"],
            r"tensor-parallel ranks \[0, 1\]",
        ),
        (
            "bare",
            ["layer_00-model_states.pt", "layer_01-model_states.pt"],
            r"layer files \['layer_00-model_states.pt', 'layer_01-model_states.pt'\]\.\.\. "
            "but no mp_rank_00_model_states.pt",
        ),
    ):
        d = tmp_path / sub
        d.mkdir()
        for n in names:
            (d / n).write_bytes(b"")
        with pytest.raises(CheckpointError, match=match):
            open_deepspeed(str(d), validate=False)


def test_unnamed_pipeline_params_that_cannot_be_placed_are_refused():
    """Without ZeRO the stages' optimizer states are matched to the model's params by count and shape: states that
    fit two assignments (two tied modules of one shape, one per stage) or none are refused, naming the stage."""
    from llmpar.checkpoint.files import CheckpointError
    from llmpar.checkpoint.formats.deepspeed.pipeline_names import Stage, infer

    model = {"tied_modules.e.w": ((3,), True), "tied_modules.f.w": ((3,), True)}
    with pytest.raises(
        CheckpointError,
        match=r"stage 0's optimizer states fit the params \['tied_modules.e.w'\] "
        r"and \['tied_modules.f.w'\] alike",
    ):
        infer(model, {}, [Stage([(3,)], None, set()), Stage([(3,)], None, set())], "DIR")
    model = {"1.w": ((3,), True), "2.w": ((3,), False), "tied_modules.e.w": ((3,), True)}
    layers = {1: {"w": torch.ones(3)}, 2: {"w": torch.ones(3)}}
    got = infer(model, layers, [Stage([(3,), None], None, set()), Stage([(3,)], None, {2})], "DIR")
    # stage 1's state is the tied weight's, not the frozen 2.w's (a frozen param has no state)
    assert got == [(["tied_modules.e.w", "1.w"], set()), (["tied_modules.e.w"], set())]
    with pytest.raises(CheckpointError, match="no split of this model's 3 params over its 2 stages"):
        infer(model, layers, [Stage([(4,)], None, set()), Stage([(3,)], None, set())], "DIR")


def test_bf16_pipeline_checkpoint_without_zero(runs):
    """bf16 without ZeRO: DeepSpeed's BF16_Optimizer writes its flat fp32 masters and moments per stage into
    bf16_zero_pp_rank_0_mp_rank_SS files (the model states files name no params); read with the model's names, each
    param's master and moments are DeepSpeed's, bitwise, at its place in the stage's flat group (frozen params out of
    it), and DeepSpeed's bf16 weights are those masters rounded."""
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed

    runs, root = runs
    kinds = {out["ds_bf16"][0] for out in runs}
    assert kinds == {"BF16_Optimizer"}, kinds
    params = {**runs[1]["ds_bf16"][1], **runs[0]["ds_bf16"][1]}
    model = {n: (tuple(t.shape), n != "2.norm.bias") for n, t in params.items()}
    ck = open_deepspeed(str(root / "bf16" / TAG), model, validate=False)
    assert (ck.pp, ck.kind, ck.dp, ck.bf16) == (2, "BF16_Optimizer", 1, True)
    assert ck.frozen().keys() == {"2.norm.bias"} and torch.equal(ck.frozen()["2.norm.bias"], params["2.norm.bias"])
    for s, out in enumerate(runs):
        _, mine, flat = out["ds_bf16"]
        names = ck.stages[s].names
        assert names == [n for n in mine if n != "2.norm.bias"], names
        for key in ("master", "exp_avg", "exp_avg_sq"):
            got = torch.cat([ck.stages[s].read(n, key, 0, mine[n].numel()) for n in names])
            assert torch.equal(got, flat[key][: got.numel()]), (s, key)
        for n in names:
            assert ck.step(n) == K
            master = ck.read(n, "master", 0, mine[n].numel()).view(mine[n].shape)
            assert torch.equal(master.to(torch.bfloat16), mine[n]), n  # DeepSpeed's bf16 weights: its masters rounded
