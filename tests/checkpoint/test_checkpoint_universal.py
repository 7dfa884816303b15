"""DeepSpeed *universal* checkpoints load into llmpar as they are (``llmpar.checkpoint.formats.universal.read``).

One launch on 2 ranks: real DeepSpeed (0.19, CPU, gloo) trains the demo GPT K steps at ZeRO-2 and ZeRO-3 (fp32),
saves, and DeepSpeed's own ``ds_to_universal`` converts each save (``DIR/TAG_universal`` + ``DIR/latest_universal``;
ZeRO-2: ``{"param", "cat_dim"}`` files and ``step.pt``, ZeRO-3: bare flat tensors, the step in
``optimizer_state.pt``). DeepSpeed then resumes each with ``checkpoint.load_universal`` on a model of another seed and
trains N steps: the reference. llmpar builds the model from a third seed, loads each universal checkpoint at another
ZeRO stage / dp / tp (with CPU offload once; tp=2 pads the vocabulary 61 -> 62 rows), continues the same N steps on the
same global batches, and its losses equal DeepSpeed's (<= 1e-6 relative, fp32); counters, scheduler and
client_state travel. The same launch: an llmpar checkpoint converted with ``convert --to universal`` and read back
by llmpar equals the llmpar checkpoint it came from (masters, moments, steps, params bitwise); a missing param
folder, a truncated file and a model of another shape fail on every rank naming the path / param. Also in it:
``"checkpoint": {"load_universal": true}`` picks ``latest_universal`` over ``latest``; and a DeepSpeed save at
tensor-parallel degree 2 (an mpu, ``test_checkpoint_ds_mp``'s model) carrying ``universal_checkpoint_info`` merge
patterns goes through ``ds_to_universal`` (slices concatenated on each param's cat_dim) and llmpar continues it equal
to DeepSpeed's own tp=2 run.
"""

import argparse
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from test_checkpoint_deepspeed import GAS, MICRO, K, N, V, _config, _error, _model, _train

from multirank import run_ranks

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

# (universal checkpoint, ZeRO stage, tp, offload) llmpar loads it at
CASES = (("z2", 3, 1, False), ("z2", 1, 2, False), ("z3", 2, 1, True), ("z3", 1, 2, False))


def _engine(stage, tp=1, offload=False, vocab=V, universal=None):
    import llmpar
    from llmpar.models import GPT, GPTConfig

    env = llmpar.init_distributed(tp=tp)
    model = GPT(GPTConfig(vocab_size=vocab, n_layer=2, n_head=2, d_model=24, seq_len=16), seed=11)
    if tp > 1:
        llmpar.parallelize(model, env.mesh["tp"])
    cfg = _config(stage, MICRO * 2 // env.mesh["dp"].size())
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if universal is not None:
        cfg["checkpoint"] = {"load_universal": universal}
    engine, *_ = llmpar.initialize(model=model, config=cfg, mesh=env.mesh)
    return engine


def _state(engine):
    """This rank's optimizer states and step counts, and the module's params (copies)."""
    opt = engine.optimizer
    return (
        [{k: t.clone() for k, t in b.state.items()} for b in opt.buffers],
        [[s.clone() for s in b.steps] for b in opt.buffers],
        {n: p.detach().clone() for n, p in engine.module.named_parameters()},
    )


def _to_universal(root, name):
    """DeepSpeed's ``ds_to_universal`` of ``root/name``'s save, as its command line runs it (one worker)."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=f"{root}/{name}/global_step{K}",
        output_folder=f"{root}/{name}/global_step{K}_universal",
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    ds_to_universal.main(args)


# ds_to_universal's merge patterns for tests/data/tp_ckpt_model.py (``up``: column-parallel, cat_dim 0 by default)
TP_INFO = {
    "universal_checkpoint_version": 0.2,
    "tp_replicated_parameter_patterns": [r"inp\.", r"out\.", r"down_bias"],
    "parameter_with_row_parallelism_patterns": [r"down\.weight"],
}


def _tp_universal(root):
    """DeepSpeed at tp=2 x dp=1 (an mpu; ``test_checkpoint_ds_mp``'s Megatron-style model), ZeRO-1: K steps, a save
    carrying ``TP_INFO``, converted by ``ds_to_universal`` (the tp slices merged), N more steps. llmpar loads the
    universal checkpoint into the unsplit model at dp=2 ZeRO-2 (``load_universal``) and continues the same N steps.
    Returns (DeepSpeed's losses, this rank's shards at the save, llmpar's losses, llmpar's loaded weights)."""
    import deepspeed
    from test_checkpoint_ds_mp import ROWS, _model_file, _step
    from test_checkpoint_ds_mp import _config as mp_config

    import llmpar

    M = _model_file()
    mpu = M.MPU(2)
    torch.manual_seed(3)
    net = M.TP(mpu)
    net.load_full(M.Full())
    engine, *_ = deepspeed.initialize(model=net, config=mp_config(1, ROWS), model_parameters=net.parameters(), mpu=mpu)
    for step in range(K):
        _step(engine, *M.batch(step))
    engine.save_checkpoint(f"{root}/tp", client_state={"universal_checkpoint_info": TP_INFO})
    shards = {n: t.detach().clone() for n, t in net.named_parameters()}
    theirs = [float(_step(engine, *M.batch(step))) for step in range(K, K + N)]
    del engine
    M.forget_mpu()
    dist.barrier()
    if dist.get_rank() == 0:
        _to_universal(root, "tp")
    dist.barrier()
    torch.manual_seed(99)
    cfg = mp_config(2, ROWS // 2)
    cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = llmpar.initialize(model=M.Full(), config=cfg)
    engine.load_checkpoint(f"{root}/tp")
    loaded = {n: t.detach().clone() for n, t in engine.module_state_dict().items()}
    r, ours = dist.get_rank(), []
    for step in range(K, K + N):
        x, y = M.batch(step)
        loss = _step(engine, x[r * 3 : (r + 1) * 3], y[r * 3 : (r + 1) * 3]).to(torch.float64)
        dist.all_reduce(loss)
        ours.append(loss.item() / 2)
    return theirs, shards, ours, loaded


def body(root, ext_dir):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", ext_dir)
    import deepspeed
    import deepspeed.ops

    from llmpar.checkpoint import convert

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's CPU comm op
    rank, out = dist.get_rank(), {"ds": {}, "ours": {}}
    info = {"universal_checkpoint_version": 0.2}  # ds_to_universal of ZeRO 1-2 needs it (the caller's state)
    for name, stage in (("z2", 2), ("z3", 3)):
        cfg = _config(stage)
        cfg["optimizer"]["params"]["torch_adam"] = True
        ds, *_ = deepspeed.initialize(model=_model(), model_parameters=None, config=cfg)
        _train(ds, range(K), False)
        ds.save_checkpoint(f"{root}/{name}", client_state={"data_pos": 17 + K, "universal_checkpoint_info": info})
        del ds
    dist.barrier()
    if rank == 0:
        for name in ("z2", "z3"):
            _to_universal(root, name)
            os.remove(f"{root}/{name}/latest")  # DIR/latest_universal only: llmpar finds it with tag=None
    dist.barrier()
    for name, stage in (("z2", 1), ("z3", 3)):  # DeepSpeed resumes its universal checkpoint: the reference
        cfg = _config(stage)
        cfg["optimizer"]["params"]["torch_adam"] = True
        cfg["checkpoint"] = {"load_universal": True}
        ds, *_ = deepspeed.initialize(model=_model(seed=5), model_parameters=None, config=cfg)
        ds.load_checkpoint(f"{root}/{name}")
        out["ds"][name] = _train(ds, range(K, K + N), False)
        del ds
    for name, stage, tp, offload in CASES:
        engine = _engine(stage, tp, offload)
        path, client = engine.load_checkpoint(f"{root}/{name}")
        facts = (
            os.path.basename(path),
            client,
            engine.global_steps,
            engine.global_samples,
            engine.lr_scheduler.state_dict(),
        )
        if (name, stage, tp) == ("z2", 3, 1):
            engine.save_checkpoint(f"{root}/ours")
        out["ours"][(name, stage, tp)] = (_train(engine, range(K, K + N), tp > 1), facts)
    # llmpar's own --to universal, read back by llmpar: the same state as the llmpar checkpoint it came from
    if rank == 0:
        convert.convert(f"{root}/ours", f"{root}/ours_u", to="universal")
    dist.barrier()
    states = []
    for src in ("ours", "ours_u"):
        engine = _engine(2)
        engine.load_checkpoint(f"{root}/{src}")
        states.append((_state(engine), engine.global_steps, engine.lr_scheduler.state_dict()))
    out["roundtrip"] = states
    # errors, on every rank: a missing param folder, a truncated file, a model of another shape
    uni = f"global_step{K}_universal"
    if rank == 0:
        for bad in ("nofolder", "truncated"):
            shutil.copytree(f"{root}/z2", f"{root}/{bad}")
        shutil.rmtree(f"{root}/nofolder/{uni}/zero/ln_f.bias")
        victim = f"{root}/truncated/{uni}/zero/blocks.0.attn.qkv.weight/exp_avg.pt"
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    dist.barrier()
    engine = _engine(2)
    out["nofolder"] = _error(lambda: engine.load_checkpoint(f"{root}/nofolder"))
    out["truncated"] = _error(lambda: engine.load_checkpoint(f"{root}/truncated", tag=uni))
    out["shape"] = _error(lambda: _engine(2, vocab=V + 2).load_checkpoint(f"{root}/z3"))
    # "checkpoint": {"load_universal": true}: tag=None reads latest_universal even beside DeepSpeed's own latest
    if rank == 0:
        shutil.copytree(f"{root}/z2", f"{root}/both")
        with open(f"{root}/both/latest", "w") as f:
            f.write(f"global_step{K}")
    dist.barrier()
    flags = {}
    for flag in (True, False, None):
        engine = _engine(2, universal=flag)
        path, _ = engine.load_checkpoint(f"{root}/both")
        flags[flag] = (os.path.basename(path), _state(engine))
    out["flags"] = flags
    engine = _engine(2, universal=True)
    out["no_latest_universal"] = _error(lambda: engine.load_checkpoint(f"{root}/ours"))
    out["not_universal"] = _error(lambda: engine.load_checkpoint(f"{root}/both", tag=f"global_step{K}"))
    out["tp"] = _tp_universal(root)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ds_ext_dir):
    root = tmp_path_factory.mktemp("ucp")
    return run_ranks(body, 2, str(root), str(ds_ext_dir), timeout=400), root


def test_llmpar_continues_deepspeed_universal_checkpoints(runs):
    """DeepSpeed's ds_to_universal output (ZeRO-2 and ZeRO-3 sources) loaded by llmpar at another stage / dp / tp /
    offload: the next N losses equal DeepSpeed resuming the same universal checkpoint (<= 1e-6 rel), on every rank;
    the tag comes from latest_universal, counters, scheduler and client_state travel."""
    runs, _ = runs
    out = runs[0]
    assert set(out["ours"]) == {c[:3] for c in CASES}
    for (name, stage, tp), (losses, facts) in out["ours"].items():
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(out["ds"][name]),
            rtol=1e-6,
            atol=0,
            msg=lambda m: f"universal {name} -> stage {stage} tp {tp}: {m}",
        )
        assert facts[0] == f"global_step{K}_universal"
        assert facts[1]["data_pos"] == 17 + K and "universal_checkpoint_info" in facts[1]
        assert facts[2:] == (K, K * GAS * MICRO * 2, {"last_batch_iteration": K - 1}), (name, stage, tp, facts)
    for r in runs[1:]:
        for key, (losses, _) in r["ours"].items():
            assert losses == out["ours"][key][0]


def test_llmpar_universal_output_reads_back_equal(runs):
    """``convert --to universal`` of an llmpar checkpoint, loaded by llmpar at ZeRO-2 dp=2, holds exactly the state
    the llmpar checkpoint loads (masters, moments, steps, params: bitwise), counters and scheduler too."""
    runs, _ = runs
    for r in runs:
        (a, sa, ca), (b, sb, cb) = r["roundtrip"]
        assert (sa, ca) == (sb, cb) and sa == K
        for x, y in zip(a[0], b[0]):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        assert all(torch.equal(s, t) for xs, ys in zip(a[1], b[1]) for s, t in zip(xs, ys))
        assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][n], b[2][n]) for n in a[2])


def test_bad_universal_checkpoints_fail_on_every_rank_naming_the_path(runs):
    runs, _ = runs
    for out in runs:
        assert "zero/ln_f.bias" in out["nofolder"] and "is missing" in out["nofolder"], out["nofolder"]
        assert "blocks.0.attn.qkv.weight/exp_avg.pt" in out["truncated"], out["truncated"]
        assert "cannot read" in out["truncated"], out["truncated"]
        assert "'tok_emb.weight' has full shape (63, 24) here" in out["shape"] and "(61, 24)" in out["shape"], out[
            "shape"
        ]


def _verify_catches(src_dir, out):
    """``formats.deepspeed.write.verify`` (one rank file at a time) of a ZeRO-2 dp=2 output: passes as written; catches
    a difference in the last element of the last param (the last rank's file) and in a stage 1-2 module weight."""
    from llmpar.checkpoint.files import CheckpointError
    from llmpar.checkpoint.formats.deepspeed import write as ds_write
    from llmpar.checkpoint.formats.open import open_source, writable
    from llmpar.checkpoint.formats.source import locate

    s = writable(open_source(locate(src_dir)))
    ds_write.verify(s, out, 2, 2)
    last, piece = s.groups[-1][-1], s.piece

    def bad(n, key, a, z):
        t = piece(n, key, a, z)
        if n == last and key == "exp_avg_sq" and z == math.prod(s.shapes[n]):
            t = t.clone()
            t[-1] += 1
        return t

    s.piece = bad
    with pytest.raises(CheckpointError, match=f"param '{last}' exp_avg_sq read back differs"):
        ds_write.verify(s, out, 2, 2)
    s.piece = piece
    model = os.path.join(out, "mp_rank_00_model_states.pt")
    sd = torch.load(model, weights_only=False)
    sd["module"]["blocks.1.mlp.fc.weight"][3, 5] += 1
    torch.save(sd, model)
    with pytest.raises(CheckpointError, match="module weight 'blocks.1.mlp.fc.weight' master read back differs"):
        ds_write.verify(s, out, 2, 2)


def test_convert_from_universal(runs, tmp_path):
    """``llmpar checkpoint convert`` of DeepSpeed's universal checkpoints (found through latest_universal, or
    ``--from universal``): to hf (the fp32 masters), deepspeed (ZeRO-3 at dp=3, ZeRO-2), universal and dcp; what was
    written equals the universal source bitwise (masters, moments, step); the converter's read-back catches a
    difference (``_verify_catches``); a directory that is not one is refused naming what it holds."""
    from safetensors.torch import load_file

    from llmpar.checkpoint import convert
    from llmpar.checkpoint.files import CheckpointError
    from llmpar.checkpoint.formats.dcp.format import DcpCheckpoint
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed
    from llmpar.checkpoint.formats.universal.read import UniversalCheckpoint
    from llmpar.cli import main

    _, root = runs
    uni = f"global_step{K}_universal"
    for name in ("z2", "z3"):
        src = UniversalCheckpoint(str(root / name / uni))
        size = {n: math.prod(src.shapes[n]) for n in src.names}
        for n in src.names:
            src.open(n)
        assert (
            main(["checkpoint", "convert", str(root / name), str(tmp_path / f"{name}_hf"), "--from", "universal"]) == 0
        )
        hf = load_file(tmp_path / f"{name}_hf" / "model.safetensors")
        assert set(src.names) <= set(hf)
        for n in src.names:
            assert torch.equal(hf[n].reshape(-1), src.read(n, "master", 0, size[n])), n
        for stage, dp in ((3, 3), (2, 2)):
            out = tmp_path / f"{name}_ds{stage}"
            convert.convert(str(root / name), str(out), to="deepspeed", stage=stage, dp=dp)
            ck = open_deepspeed(str(out / f"global_step{K}"), validate=False)
            assert (ck.stage, ck.dp, sorted(ck.names)) == (stage, dp, sorted(src.names))
            for n in src.names:
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(ck.read(n, key, 0, size[n]), src.read(n, key, 0, size[n])), (n, key)
                assert ck.step(n) == src.step(n) == K
        _verify_catches(str(root / name), str(tmp_path / f"{name}_ds2" / f"global_step{K}"))
        convert.convert(str(root / name), str(tmp_path / f"{name}_u"), to="universal")
        back = UniversalCheckpoint(str(tmp_path / f"{name}_u" / f"global_step{K}"))
        dcp_dir = tmp_path / f"{name}_dcp"
        convert.convert(str(root / name), str(dcp_dir), to="dcp")
        dc = DcpCheckpoint(str(dcp_dir))
        for n in src.names:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                want = src.read(n, key, 0, size[n])
                assert torch.equal(back.read(n, key, 0, size[n]), want), (n, key)
                assert torch.equal(dc.read(n, key, 0, size[n]), want), (n, key)
            assert back.step(n) == dc.step(n) == K
        assert back.client_state()["data_pos"] == 17 + K and back.counters()["global_steps"] == K
    with pytest.raises(CheckpointError, match="is not a universal checkpoint .* holds"):
        convert.convert(str(root / "ours"), str(tmp_path / "x"), source="universal")
    with pytest.raises(ValueError, match="source='zip' is not one of"):
        convert.convert(str(root / "ours"), str(tmp_path / "x"), source="zip")


def test_load_universal_config_reads_latest_universal(runs):
    """``"checkpoint": {"load_universal": true}``, as in DeepSpeed: ``load_checkpoint(DIR)`` loads the universal
    checkpoint ``DIR/latest_universal`` names even when ``DIR/latest`` names DeepSpeed's own save of the same run;
    false / absent loads ``latest``. The two hold the same state (the same save, two layouts). With the flag, a
    directory without ``latest_universal`` and a tag that is not a universal checkpoint fail on every rank naming
    them; a value that is not a bool is refused by the config."""
    from llmpar.runtime import Config

    runs, _ = runs
    for out in runs:
        flags = out["flags"]
        assert flags[True][0] == f"global_step{K}_universal"
        assert flags[False][0] == flags[None][0] == f"global_step{K}"
        (a, sa, pa), (b, sb, pb) = flags[True][1], flags[False][1]
        for x, y in zip(a, b):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        assert all(torch.equal(s, t) for xs, ys in zip(sa, sb) for s, t in zip(xs, ys))
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
        assert '"checkpoint.load_universal"=true' in out["no_latest_universal"], out["no_latest_universal"]
        assert "ours/latest_universal is missing" in out["no_latest_universal"], out["no_latest_universal"]
        assert f"both/global_step{K} is not a universal checkpoint" in out["not_universal"], out["not_universal"]
    with pytest.raises(ValueError, match='"checkpoint.load_universal"="yes": a bool'):
        Config.from_deepspeed({"train_batch_size": 8, "checkpoint": {"load_universal": "yes"}}, dp=2)


def test_deepspeed_tensor_parallel_save_to_universal(runs):
    """A DeepSpeed save at tp=2 (two mp_rank file sets) converted by ds_to_universal with merge patterns (column-
    parallel ``up`` on dim 0, row-parallel ``down.weight`` on dim 1, the rest replicated): the universal files record
    each cat_dim, llmpar's unsplit model at dp=2 ZeRO-2 loads DeepSpeed's shards merged (bitwise) and its next N
    losses equal DeepSpeed's own tp=2 continuation (<= 1e-6 relative)."""
    runs, root = runs
    zero = root / "tp" / f"global_step{K}_universal" / "zero"
    dims = {"up.weight": 0, "up.bias": 0, "down.weight": 1}
    for name, dim in dims.items():
        assert torch.load(zero / name / "fp32.pt", weights_only=False)["cat_dim"] == dim, name
    shards = [out["tp"][1] for out in runs]
    for out in runs:
        theirs, _, ours, _ = out["tp"]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-6, atol=0)
    loaded = runs[0]["tp"][3]  # the state dict is gathered on rank 0
    assert loaded.keys() == shards[0].keys()
    for n, t in loaded.items():
        want = torch.cat([s[n] for s in shards], dims[n]) if n in dims else shards[0][n]
        assert torch.equal(t, want), n
