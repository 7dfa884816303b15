"""DeepSpeed's API on 2 CPU ranks (issue 17, items 2, 3 and 6): a DeepSpeed training script run under torchrun by
DeepSpeed itself and by llmpar (``import llmpar as deepspeed``, the only change) gives the same losses, lrs, grad
norms, step flags, loader batches and accessors, and llmpar's run prints DeepSpeed-like log lines from rank 0 and no
deprecation warning; then the entries whose meaning is about ranks: the training loader's sampler, ``no_sync``,
``deepspeed.comm``, ``zero_to_fp32`` on a sharded checkpoint and ``zero.GatheredParameters`` without the optimizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from multirank import free_port, run_ranks

TESTS = Path(__file__).resolve().parent
ROOT, DATA = TESTS.parent, TESTS / "data"
CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000, "allgather_bucket_size": 1000},
    "steps_per_print": 2,
    "zero_allow_untested_optimizer": True,
}


def _script(which, tmp_path, ext):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(CONFIG))
    out = tmp_path / f"{which}.json"
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "TORCH_EXTENSIONS_DIR": str(ext),
        "PYTHONWARNINGS": "always",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(DATA / "pipe_launch.py"),
        which,
        str(DATA / "ds_script.py"),
        "--deepspeed",
        "--deepspeed_config",
        str(cfg),
        "--out",
        str(out),
        "--ckpt",
        str(tmp_path / f"ckpt_{which}"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{which} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), proc


def test_deepspeed_script_runs_with_llmpar_and_matches_deepspeed(tmp_path, ds_ext_dir):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    theirs, _ = _script("deepspeed", tmp_path, ds_ext_dir)
    ours, proc = _script("llmpar", tmp_path, ds_ext_dir)
    for key in ("loss", "resumed_loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor(ours[key], dtype=torch.float64),
            torch.tensor(theirs[key], dtype=torch.float64),
            rtol=1e-5,
            atol=0,
            msg=key,
        )
    for key in ("lr", "resumed_lr", "last_lr"):
        torch.testing.assert_close(torch.tensor(ours[key]), torch.tensor(theirs[key]), rtol=1e-12, atol=0, msg=key)
    same = [
        "boundary",
        "applied",
        "global_steps",
        "first_batches",
        "loader_len",
        "local_rank",
        "world_size",
        "dp_world_size",
        "global_rank",
        "device",
        "bf16",
        "fp16",
        "clip",
        "steps_per_print",
        "stage",
        "partition_gradients",
        "data_types",
        "monitor",
        "scheduler_is_client",
        "batch",
    ]
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    assert ours["loss"][-1] < 0.5 * ours["loss"][0]
    # item 6: what initialize chose and DeepSpeed's progress lines, from rank 0 only; no deprecation warning
    log = proc.stdout
    assert log.count("llmpar.initialize: Engine on 2 ranks (dp=2 x tp=1 x pp=1), ZeRO stage 2") == 1, log
    assert log.count("[Rank 0] engine ready on 2 ranks") == 1
    assert log.count("step=2, skipped=0, lr=[0.0225, 0.0225], mom=[(0.9, 0.95), (0.9, 0.95)], grad_norm=") == 1
    assert log.count("step=6, skipped=0,") == 2  # trained to step 6, then again after loading step 3
    assert "Warning" not in proc.stderr and "[WARNING]" not in proc.stderr, proc.stderr[-3000:]


# --------------------------------------------------------------------------------------- rank-level entries
def loader_body():
    import llmpar as deepspeed

    data = torch.utils.data.TensorDataset(torch.arange(21))
    engine, _, loader, _ = deepspeed.initialize(
        model=nn.Linear(2, 2), training_data=data, config={"train_micro_batch_size_per_gpu": 4}
    )
    rank = dist.get_rank()
    want = list(torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank))  # DeepSpeed's sampler
    got = torch.cat([b for (b,) in loader]).tolist()
    again = torch.cat([b for (b,) in loader]).tolist()
    ordered = torch.cat([b for (b,) in engine.deepspeed_io(data, route="eval")]).tolist()
    return got, want, again, ordered, len(loader)


def test_training_dataloader_has_deepspeeds_sampler_semantics():
    outs = run_ranks(loader_body, 2, timeout=120)
    for got, want, again, _ordered, n in outs:
        assert got == want == again and n == 3  # 11 of 21 samples per rank (padded), the same order every epoch
    assert set(outs[0][0]) | set(outs[1][0]) == set(range(21)) and outs[0][0] != list(range(0, 21, 2))  # shuffled
    assert outs[0][3] == list(range(0, 21, 2)) and outs[1][3] == list(range(1, 21, 2)) + [0]


def no_sync_body(stage):
    import llmpar as deepspeed
    from llmpar.distributed.collectives import CommCounter

    rank, out = dist.get_rank(), []
    for mode in ("no_sync", "boundary"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        counter = CommCounter()
        engine, *_ = deepspeed.initialize(
            model=model,
            counter=counter,
            config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}},
        )
        counter.reset()
        for k in range(3):
            x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * k + rank))
            if mode == "boundary":
                engine.set_gradient_accumulation_boundary(k == 2)
            if mode == "no_sync" and k < 2:
                with engine.no_sync():
                    engine.backward(engine(x).pow(2).mean())
                    if k == 1:
                        volume_inside = counter.total_volume()
            else:
                engine.backward(engine(x).pow(2).mean())
                if mode == "boundary" and k < 2:
                    engine.step()
        engine.step()
        out.append(([p.detach().clone() for p in model.parameters()], volume_inside if mode == "no_sync" else None))
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_locally_and_reduces_once(stage):
    for (synced, inside), (bounded, _) in run_ranks(no_sync_body, 2, stage, timeout=120):
        assert inside == 0  # nothing reduced inside the block
        for a, b in zip(synced, bounded):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def comm_body():
    import llmpar as deepspeed

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch 2.13's collective names: no FutureWarning
        c = deepspeed.comm
        deepspeed.init_distributed(dist_backend="gloo")
        rank, world = c.get_rank(), c.get_world_size()
        c.barrier()
        t = torch.tensor([rank + 1.0])
        c.all_reduce(t)
        b = torch.tensor([float(rank)])
        c.broadcast(b, src=1)
        gathered = torch.zeros(world * 2)
        c.all_gather_into_tensor(gathered, torch.tensor([rank, rank + 0.5]))
        scattered = torch.zeros(1)
        c.reduce_scatter_tensor(scattered, torch.tensor([1.0, 2.0]) * (rank + 1))
        parts = [torch.zeros(1) for _ in range(world)]
        c.all_gather(parts, torch.tensor([10.0 * rank]))
        a2a = torch.zeros(world)
        c.all_to_all_single(a2a, torch.tensor([rank * 10.0, rank * 10.0 + 1]))
        objs = [None] * world
        c.all_gather_object(objs, {"rank": rank})
        pair = [torch.ones(2) * (rank + 1), torch.ones(3, dtype=torch.float64) * (rank + 1)]
        c.all_reduce_coalesced(pair)
        if rank == 0:
            c.send(torch.tensor([42.0]), dst=1)
            got = None
        else:
            got = torch.zeros(1)
            c.recv(got, src=0)
            got = got.item()
        group = c.new_group([0, 1])
        info = (
            c.get_local_rank(),
            c.get_global_rank(group, 1),
            c.get_all_ranks_from_group(group),
            c.is_initialized(),
            c.has_all_gather_into_tensor(),
            c.has_reduce_scatter_tensor(),
        )
    return (
        t.item(),
        b.item(),
        gathered.tolist(),
        scattered.item(),
        [p.item() for p in parts],
        a2a.tolist(),
        objs,
        [p.tolist() for p in pair],
        got,
        info,
    )


def test_comm_functions():
    outs = run_ranks(comm_body, 2, timeout=120)
    for rank, (s, b, g, rs, parts, a2a, objs, pair, _got, info) in enumerate(outs):
        assert s == 3.0 and b == 1.0 and g == [0.0, 0.5, 1.0, 1.5] and rs == [3.0, 6.0][rank]
        assert parts == [0.0, 10.0] and a2a == [float(rank), 10.0 + rank] and objs == [{"rank": 0}, {"rank": 1}]
        assert pair == [[3.0, 3.0], [3.0, 3.0, 3.0]] and info == (rank, 1, [0, 1], True, True, True)
    assert outs[1][8] == 42.0
    import llmpar as deepspeed

    with pytest.raises(NotImplementedError, match="CommCounter"):
        deepspeed.comm.log_summary()
    with pytest.raises(ValueError, match="CommCounter"):
        deepspeed.comm.configure(enabled=True)


def zero_to_fp32_body(stage, root):
    import llmpar as deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 50), nn.Tanh(), nn.LayerNorm(50), nn.Linear(50, 3))
    engine, *_ = deepspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        },
    )
    x = torch.randn(2, 6, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    engine.save_checkpoint(root)
    masters = {}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        names = {id(p): n for n, p in model.named_parameters()}
        for p in model.parameters():  # the bf16 params are the rounded fp32 masters
            masters[names[id(p)]] = p.detach().float().clone()
    return masters


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_consolidates_a_sharded_checkpoint(stage, tmp_path):
    from llmpar.utils import zero_to_fp32 as z

    bf16 = run_ranks(zero_to_fp32_body, 2, stage, str(tmp_path), timeout=120)[0]
    state = z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert set(state) == set(bf16) and all(t.dtype == torch.float32 for t in state.values())
    for name, value in bf16.items():
        torch.testing.assert_close(state[name].bfloat16().float(), value, rtol=0, atol=0)  # fp32 masters
    files = z.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path), str(tmp_path / "out"), max_shard_size=800)
    assert [Path(f).name for f in files][-1] == "pytorch_model.bin.index.json" and len(files) > 2
    index = json.loads(Path(files[-1]).read_text())
    merged = {k: v for f in files[:-1] for k, v in torch.load(f).items()}
    assert set(index["weight_map"]) == set(merged) == set(state)
    assert all(torch.equal(merged[k], state[k]) for k in state)
    one = z.convert_zero_checkpoint_to_state_dict(
        str(tmp_path), str(tmp_path / "st"), dtype="bf16", safe_serialization=True
    )
    from safetensors.torch import load_file

    assert [Path(f).name for f in one] == ["model.safetensors"]
    assert all(t.dtype == torch.bfloat16 for t in load_file(one[0]).values())
    model = nn.Sequential(nn.Linear(6, 50), nn.Tanh(), nn.LayerNorm(50), nn.Linear(50, 3))
    z.load_state_dict_from_zero_checkpoint(model, str(tmp_path))
    assert torch.equal(model[0].weight, state["0.weight"])
    with pytest.raises(ValueError, match="exclude_frozen_parameters"):
        z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), exclude_frozen_parameters=True)


def gathered_body(stage):
    import llmpar as deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
    engine, *_ = deepspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        },
    )
    with deepspeed.zero.GatheredParameters(model[0].weight, modifier_rank=0):  # DeepSpeed's form: no optimizer
        shape = tuple(model[0].weight.shape)
        if dist.get_rank() == 0:
            model[0].weight.fill_(0.25)
    full = engine.module_state_dict()  # collective; the full weights on rank 0, {} elsewhere
    with deepspeed.zero.GatheredParameters(model[0].weight):
        here = model[0].weight.detach().clone()
    return shape, full.get("0.weight"), here


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_without_the_optimizer_on_two_ranks(stage):
    outs = run_ranks(gathered_body, 2, stage, timeout=120)
    for shape, _full, here in outs:
        assert shape == (64, 4) and torch.all(here == 0.25)  # rank 0's write reached rank 1's shard / copy
    assert torch.all(outs[0][1] == 0.25)


def warnings_body(root):
    import llmpar
    from llmpar.models import GPT, GPTConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, extra in enumerate(
            (
                {"tensor_parallel": {"size": 2}},
                {"zero_optimization": {"stage": 3}},
                {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2},
            )
        ):
            model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=4, d_model=16, seq_len=8), seed=1)
            engine, *_ = llmpar.initialize(
                model=model, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, **extra}
            )
            x = torch.randint(0, 64, (4 if "pipeline" in extra else 2, 8), generator=torch.Generator().manual_seed(i))
            for _ in range(2):
                if "pipeline" in extra:
                    engine.train_batch(x, x)
                else:
                    engine.backward(model.loss(engine(x), x))
                    engine.step()
            engine.save_checkpoint(f"{root}/{i}")
            engine.load_checkpoint(f"{root}/{i}")
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]


def test_no_deprecation_warnings_from_llmpars_own_calls(tmp_path):
    """tp=2, ZeRO-3 and a 2-stage pipeline, trained, saved and loaded: torch 2.13 warns about no call of llmpar's
    (it renamed all_gather_into_tensor / reduce_scatter_tensor: llmpar.distributed calls the new names)."""
    for rank, seen in enumerate(run_ranks(warnings_body, 2, str(tmp_path), timeout=240)):
        assert seen == [], (rank, seen)
