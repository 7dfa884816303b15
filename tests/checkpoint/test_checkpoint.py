"""Sharded checkpoints on CPU/gloo ranks: save at step k, load, continue to 2k == uninterrupted (bitwise) for ZeRO
stages 0-3 (+ offload, bf16 master); resharding dp 4 -> 2 -> 1 -> 2 across stages 2 <-> 3 and offload (fp32
tolerance); atomic publish under a crash; corrupt / missing shards named on every rank."""

import os

import pytest
import torch
import torch.distributed as dist

import llmpar
from llmpar.checkpoint import files as ckfiles
from llmpar.checkpoint import save_checkpoint
from llmpar.models import GPT, GPTConfig

from multirank import run_ranks

SEQ, GLOBAL_BATCH = 12, 4
GPT_CFG = dict(vocab_size=64, n_layer=2, n_head=4, d_model=16, seq_len=SEQ)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _config(stage, dp, *, offload_opt=False, offload_param=False, bf16=False):
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 700,
            "stage3_param_persistence_threshold": 100,
            "offload_optimizer": {"device": "cpu" if offload_opt else "none"},
            "offload_param": {"device": "cpu" if offload_param else "none"},
        },
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(stage, seed=1, frozen=False, **kw):
    dp = dist.get_world_size()
    model = GPT(GPTConfig(**GPT_CFG), seed=seed)
    if frozen:  # a partly frozen model: ZeRO-3 shards the frozen params too; the checkpoint must hold them
        model.blocks[0].requires_grad_(False)
    engine, *_ = llmpar.initialize(model=model, config=_config(stage, dp, **kw))
    return engine, model


def _train(engine, model, start, stop):
    dp, r = dist.get_world_size(), dist.get_rank()
    micro = GLOBAL_BATCH // dp
    losses = []
    for s in range(start, stop):
        x, y = _batch(s)
        loss = model.loss(engine(x[r * micro : (r + 1) * micro]), y[r * micro : (r + 1) * micro]).float()
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / dp)
    return losses


def resume_body(stage, k, root, kw):
    engine, model = _engine(stage, **kw)
    ref = _train(engine, model, 0, k)
    engine.save_checkpoint(root, client_state={"data_pos": k, "note": "hi"})
    ref += _train(engine, model, k, 2 * k)
    fresh, fmodel = _engine(stage, seed=7, **kw)  # other weights: the load must overwrite everything
    path, client = fresh.load_checkpoint(root)
    assert client == {"data_pos": k, "note": "hi"}, client
    assert fresh.global_steps == k and fresh.micro_steps == k
    resumed = _train(fresh, fmodel, k, 2 * k)
    return ref, resumed, os.path.basename(path)


@pytest.mark.parametrize(
    "world, stage, kw",
    [
        (2, 0, {}),
        (2, 1, {}),
        (2, 2, {}),
        (2, 3, {}),
        (1, 2, {}),
        (2, 3, {"offload_opt": True, "offload_param": True}),
        (2, 2, {"bf16": True}),
        (2, 3, {"frozen": True}),
        (2, 3, {"frozen": True, "offload_param": True}),
    ],
    ids=[
        "dp2-s0",
        "dp2-s1",
        "dp2-s2",
        "dp2-s3",
        "dp1-s2",
        "dp2-s3-offload",
        "dp2-s2-bf16",
        "dp2-s3-frozen",
        "dp2-s3-frozen-offload",
    ],
)
def test_resume_is_bitwise(world, stage, kw, tmp_path):
    outs = run_ranks(resume_body, world, stage, 3, str(tmp_path), kw, timeout=120)
    for rank, (ref, resumed, tag) in enumerate(outs):
        assert tag == "global_step3"
        assert ref[3:] == resumed, f"rank {rank}: {ref[3:]} != {resumed}"
    assert (tmp_path / "latest").read_text().strip() == "global_step3"
    if stage == 0:  # the model state is written once (dp rank 0), not by every rank
        sizes = [(tmp_path / "global_step3" / ckfiles.rank_file(r, 0)).stat().st_size for r in range(world)]
        assert sizes[1] * 5 < sizes[0], sizes
    names = sorted(os.listdir(tmp_path / "global_step3"))
    assert names == sorted(["metadata.json", "client_state.pt"] + [ckfiles.rank_file(r, 0) for r in range(world)])


def segment_body(stage, kw, load_from, save_to, start, stop):
    engine, model = _engine(stage, seed=3 if load_from is None else 11, **kw)
    if load_from is not None:
        engine.load_checkpoint(load_from)
        assert engine.global_steps == start
    losses = _train(engine, model, start, stop)
    if save_to is not None:
        engine.save_checkpoint(save_to)
    return losses


CHAINS = {
    # dp4 stage 2 -> dp2 stage 3 -> dp1 stage 2 + offload -> dp2 stage 3 + param offload == one dp4 run
    "fp32": (
        [(4, 2, {}), (2, 3, {}), (1, 2, {"offload_opt": True}), (2, 3, {"offload_opt": True, "offload_param": True})],
        1e-5,
        1e-6,
    ),
    # bf16 params + fp32 masters: dp2 stage 2 -> dp1 stage 3 -> dp2 stage 1 (bf16 reduction order differs by dp)
    # part of the model frozen: sharded by stage 3, whole under stage 2: dp2 s3 -> dp1 s2 -> dp2 s3 + param offload
    "frozen": (
        [(2, 3, {"frozen": True}), (1, 2, {"frozen": True}), (2, 3, {"frozen": True, "offload_param": True})],
        1e-5,
        1e-6,
    ),
    "bf16": ([(2, 2, {"bf16": True}), (1, 3, {"bf16": True}), (2, 1, {"bf16": True})], 1e-3, 1e-3),
}


@pytest.mark.parametrize("chain_name", sorted(CHAINS))
def test_reshard_dp_stage_offload(chain_name, tmp_path):
    k = 2
    chain, rtol, atol = CHAINS[chain_name]
    world0, stage0, kw0 = chain[0]
    ref = run_ranks(segment_body, world0, stage0, kw0, None, None, 0, k * len(chain), timeout=120)[0]
    got, prev = [], None
    for i, (world, stage, kw) in enumerate(chain):
        save = str(tmp_path / f"seg{i}") if i + 1 < len(chain) else None
        got += run_ranks(segment_body, world, stage, kw, prev, save, i * k, (i + 1) * k, timeout=120)[0]
        prev = save
    assert got[:k] == ref[:k]
    diff = max(abs(a - b) for a, b in zip(got, ref))
    print(f"{chain_name}: max loss diff after resharding: {diff:.3g}")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=rtol, atol=atol)


def crash_body(root, point):
    engine, model = _engine(2)
    first = _train(engine, model, 0, 2)
    engine.save_checkpoint(root, tag="good")
    _train(engine, model, 2, 3)

    def hook(where):
        if where == point and dist.get_rank() == (1 if point == "shard_written" else 0):
            raise OSError(f"simulated crash at {where}")

    try:
        save_checkpoint(engine, root, tag="bad", fault_hook=hook)
        raised = None
    except ckfiles.CheckpointError as e:
        raised = str(e)
    fresh, fmodel = _engine(2, seed=5)
    path, _ = fresh.load_checkpoint(root)
    return raised, os.path.basename(path), fresh.global_steps, first


@pytest.mark.parametrize("point", ["shard_written", "before_publish", "before_latest"])
def test_crash_mid_save_keeps_previous(point, tmp_path):
    outs = run_ranks(crash_body, 2, str(tmp_path), point, timeout=120)
    for rank, (raised, tag, steps, _) in enumerate(outs):
        assert raised is not None and (
            "simulated crash" in raised or "another rank" in raised or "rank 0 failed publishing" in raised
        ), (rank, raised)
        assert tag == "good" and steps == 2
    assert (tmp_path / "latest").read_text().strip() == "good"
    bad_complete = (tmp_path / "bad" / "metadata.json").exists()
    assert bad_complete == (point == "before_latest")  # renamed only once complete; latest never moved
    assert not (tmp_path / ".tmp-bad").exists()  # a failed save's files are deleted


def corrupt_body(root, what):
    engine, model = _engine(2)
    _train(engine, model, 0, 2)
    path = engine.save_checkpoint(root)
    dist.barrier()
    victim = os.path.join(path, ckfiles.rank_file(1, 0))
    if dist.get_rank() == 0:
        if what == "flip":
            with open(victim, "r+b") as f:
                f.seek(os.path.getsize(victim) // 2)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0xFF]))
        else:
            os.remove(victim)
    dist.barrier()
    try:
        engine.load_checkpoint(root)
    except ckfiles.CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what", ["flip", "delete"])
def test_corrupt_or_missing_shard_is_named_on_every_rank(what, tmp_path):
    outs = run_ranks(corrupt_body, 2, str(tmp_path), what, timeout=120)
    for rank, msg in enumerate(outs):
        assert msg is not None and "dp001-tp00.shard" in msg, (rank, msg)
        assert ("corrupt" if what == "flip" else "missing") in msg


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(ckfiles.CheckpointError, match="latest"):
        ckfiles.resolve(str(tmp_path), None)
    with pytest.raises(ValueError, match="tag"):
        ckfiles.check_tag("../x")


def consolidate_body(root, stage, bf16, frozen=False):
    engine, model = _engine(stage, bf16=bf16, frozen=frozen)
    _train(engine, model, 0, 2)
    engine.save_checkpoint(root)
    gathered = engine.module_state_dict()  # full params (their dtype) on rank 0
    masters = None
    if bf16:  # the fp32 masters, gathered from the shards
        opt = engine.optimizer
        masters = {}
        for b in opt.buffers:
            full = torch.zeros(b.layout.total, dtype=torch.float32)
            dist.all_gather_into_tensor(full, b.state["master"].clone()) if opt.dp > 1 else full.copy_(
                b.state["master"]
            )
            # partition order == unit order of each rank's shard: rebuild per unit
            part = b.layout.partition
            for unit in b.layout.units:
                n = unit.padded // opt.dp
                pieces = [full[r * part + unit.shard_offset : r * part + unit.shard_offset + n] for r in range(opt.dp)]
                unit_full = torch.cat(pieces)
                for i in unit.params:
                    masters[b.layout.slot(i).name] = b.layout.param_in_unit(unit_full, i).clone()
    return gathered, masters


@pytest.mark.parametrize(
    "stage, bf16, frozen",
    [(3, False, False), (2, True, False), (3, False, True)],
    ids=["s3-fp32", "s2-bf16-master", "s3-frozen"],
)
def test_consolidate_equals_gathered_model(stage, bf16, frozen, tmp_path):
    from llmpar.checkpoint.consolidate import consolidated_state_dict
    from llmpar.cli import main

    gathered, masters = run_ranks(consolidate_body, 2, str(tmp_path / "ck"), stage, bf16, frozen, timeout=120)[0]
    out = tmp_path / "out"
    assert main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(out)]) == 0
    from safetensors.torch import load_file

    sd = load_file(str(out / "model.safetensors"))
    want = masters if bf16 else gathered
    assert sorted(sd) == sorted(want)
    for name, t in want.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], t.float()), name
    assert main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(out), "--format", "bin", "--overwrite"]) == 0
    bin_sd = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert sorted(os.listdir(out)) == ["pytorch_model.bin"]  # the safetensors file of the export before is gone
    assert all(torch.equal(bin_sd[n], sd[n]) for n in sd) and sorted(bin_sd) == sorted(sd)
    plain = GPT(GPTConfig(**GPT_CFG), seed=9)
    plain.load_state_dict(sd)  # strict: every key of the plain model
    kept = consolidated_state_dict(str(tmp_path / "ck"), dtype=None)
    if bf16:
        assert all(kept[n].dtype == torch.float32 for n in kept)  # masters are fp32 already
    assert main(["checkpoint", "consolidate", str(tmp_path / "nothing"), str(tmp_path / "out2")]) == 1


def tp_body(root, stage):
    env = llmpar.init_distributed(tp=2)
    dp_rank, dp = env.mesh["dp"].get_local_rank(), env.mesh["dp"].size()

    def build(seed):
        model = GPT(GPTConfig(**GPT_CFG), seed=seed)
        llmpar.parallelize(model, env.mesh["tp"])
        cfg = _config(stage, dp)
        engine, *_ = llmpar.initialize(model=model, config=cfg, mesh=env.mesh)
        return engine, model

    def train(engine, model, a, b):
        micro, losses = GLOBAL_BATCH // dp, []
        for s in range(a, b):
            x, y = _batch(s)
            loss = model.loss(
                engine(x[dp_rank * micro : (dp_rank + 1) * micro]), y[dp_rank * micro : (dp_rank + 1) * micro]
            )
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    engine, model = build(1)
    ref = train(engine, model, 0, 2)
    engine.save_checkpoint(root)
    ref += train(engine, model, 2, 4)
    fresh, fmodel = build(4)
    fresh.load_checkpoint(root)
    return ref[2:], train(fresh, fmodel, 2, 4)


@pytest.mark.parametrize("stage", [2, 3])
def test_tp2_dp2_resume_is_bitwise(stage, tmp_path):
    for rank, (ref, resumed) in enumerate(run_ranks(tp_body, 4, str(tmp_path), stage, timeout=180)):
        assert ref == resumed, f"rank {rank}"
    assert len([f for f in os.listdir(tmp_path / "global_step2") if f.endswith(".shard")]) == 4  # one per rank
