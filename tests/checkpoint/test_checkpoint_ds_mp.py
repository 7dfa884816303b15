"""DeepSpeed checkpoints of a model made tensor-parallel by its user (``deepspeed.initialize(..., mpu=...)``: one
``mp_rank_TT`` file set per tensor-parallel rank) load into llmpar as the unsplit model
(``formats/deepspeed/tensor_parallel.py``).

One launch on 2 ranks (the rank pool): real DeepSpeed (0.19, CPU, gloo) trains ``tests/data/tp_ckpt_model.py``'s
hand-written Megatron-style model (column-parallel ``up``, row-parallel ``down``, replicated rest, odd widths) at tp=2
x dp=1, ZeRO-1, with a WarmupLR schedule and gradient clipping, for K steps, saves with a client_state and continues
N steps. llmpar builds the unsplit model from another seed and loads the checkpoint at dp=2 ZeRO-2 and ZeRO-3 (each
param's shards merged along the dim the model's full shape tells) and at tp=2 with its own layers, continues the same N
steps on the same global batches, and its losses equal DeepSpeed's continuation (<= 1e-6 relative); the loaded weights
are DeepSpeed's shards merged, bitwise. The same launch checks that a model whose shape fits no merge of the shards is
refused on both ranks, naming the param and the shapes.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

K, N, ROWS = 2, 3, 6
TAG = "saved"


def _model_file():
    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
    if data not in sys.path:
        sys.path.insert(0, data)
    import tp_ckpt_model

    return tp_ckpt_model


def _config(stage, micro):
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-2, "weight_decay": 0.01, "betas": [0.9, 0.95], "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_max_lr": 2e-2, "warmup_type": "linear"},
        },
    }


def _step(engine, x, y):
    loss = torch.nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.detach()


def _deepspeed(root):
    """DeepSpeed at tp=2: K steps, save, N more: (losses, this rank's shards at the save, (scheduler, lr))."""
    import deepspeed
    import deepspeed.ops

    M = _model_file()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed()
    mpu = M.MPU(2)
    torch.manual_seed(3)
    full = M.Full()
    net = M.TP(mpu)
    net.load_full(full)
    engine, *_ = deepspeed.initialize(model=net, config=_config(1, ROWS), model_parameters=net.parameters(), mpu=mpu)
    for step in range(K):
        _step(engine, *M.batch(step))
    engine.save_checkpoint(root, tag=TAG, client_state={"epoch": 3})
    shards = {n: t.detach().clone() for n, t in net.named_parameters()}
    run = (engine.lr_scheduler.state_dict(), engine.get_lr())
    losses = [float(_step(engine, *M.batch(step))) for step in range(K, K + N)]
    M.forget_mpu()
    return losses, shards, run


def _llmpar(stage, model):
    import llmpar

    engine, *_ = llmpar.initialize(model=model, config=_config(stage, ROWS // 2))
    return engine


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the text
        return f"{type(e).__name__}: {e}"
    return None


def body(root, ext_dir):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", ext_dir)
    M = _model_file()
    out = {"ds": _deepspeed(root)}
    dist.barrier()
    r = dist.get_rank()
    for stage in (2, 3):
        torch.manual_seed(99)
        model = M.Full()
        engine = _llmpar(stage, model)
        path, client = engine.load_checkpoint(root)
        loaded = {n: t.detach().clone() for n, t in engine.module_state_dict().items()}
        facts = (
            os.path.basename(path),
            client,
            engine.global_steps,
            engine.lr_scheduler.state_dict(),
            [g["lr"] for g in engine.optimizer.param_groups],
        )
        losses = []
        for step in range(K, K + N):
            x, y = M.batch(step)
            loss = _step(engine, x[r * 3 : (r + 1) * 3], y[r * 3 : (r + 1) * 3]).to(torch.float64)
            dist.all_reduce(loss)
            losses.append(loss.item() / 2)
        out[stage] = (losses, facts, loaded)
    # llmpar at tp=2 x dp=1, ZeRO-1 (its own column / row layers): each rank cuts its shards from the merged params
    import llmpar

    env = llmpar.init_distributed(tp=2)
    torch.manual_seed(99)
    model = llmpar.parallelize(M.Full(), env.mesh["tp"], plan={"up": "column", "down": "row"})
    engine, *_ = llmpar.initialize(model=model, config=_config(1, ROWS), mesh=env.mesh)
    path, client = engine.load_checkpoint(root)
    loaded = {n: t.detach().clone() for n, t in model.named_parameters()}
    facts = (
        os.path.basename(path),
        client,
        engine.global_steps,
        engine.lr_scheduler.state_dict(),
        [g["lr"] for g in engine.optimizer.param_groups],
    )
    out["tp2"] = ([float(_step(engine, *M.batch(step))) for step in range(K, K + N)], facts, loaded)
    M.FFN += 2  # a model whose up / down do not fit the shards
    try:
        engine = _llmpar(2, M.Full())
        out["error"] = _error(lambda: engine.load_checkpoint(root))
    finally:
        M.FFN -= 2
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ds_ext_dir):
    root = tmp_path_factory.mktemp("dsmp")
    return run_ranks(body, 2, str(root), str(ds_ext_dir), timeout=240), root


def test_deepspeed_tensor_parallel_checkpoint_files(runs):
    """DeepSpeed wrote one file set per tensor-parallel rank; the reader merges column-parallel params on dim 0,
    row-parallel ones on dim 1, reads replicated ones from rank 0, and refuses to guess without the model."""
    from llmpar.checkpoint.files import CheckpointError
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed
    from llmpar.checkpoint.formats.deepspeed.tensor_parallel import DeepSpeedTPCheckpoint

    runs, root = runs
    assert sorted(os.listdir(root / TAG)) == [
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
    ]
    with pytest.raises(CheckpointError, match=r"tensor-parallel \(tp=2\) DeepSpeed checkpoint: its files do not say"):
        open_deepspeed(str(root / TAG), validate=False)
    shards = [out["ds"][1] for out in runs]
    dims = {"up.weight": 0, "up.bias": 0, "down.weight": 1}
    model = {
        n: (tuple(torch.cat([s[n] for s in shards], dims[n]).shape) if n in dims else tuple(t.shape), True)
        for n, t in shards[0].items()
    }
    ck = open_deepspeed(str(root / TAG), model, validate=False)
    assert isinstance(ck, DeepSpeedTPCheckpoint) and (ck.tp, ck.stage, ck.dp) == (2, 1, 1)
    assert ck.dims == {n: dims.get(n) for n in shards[0]}
    for n in shards[0]:
        want = torch.cat([s[n] for s in shards], dims[n]) if n in dims else shards[0][n]
        assert torch.equal(ck.read(n, "master", 0, want.numel()), want.reshape(-1)), n
        assert ck.read(n, "exp_avg", 0, want.numel()).abs().sum() > 0 and ck.step(n) == K


@pytest.mark.parametrize("stage", [2, 3, "tp2"])
def test_llmpar_continues_deepspeed_tensor_parallel(runs, stage):
    """llmpar's unsplit model at dp=2 (ZeRO-2, ZeRO-3) and its own tp=2 layers ("tp2": ZeRO-1) continue DeepSpeed's
    tp=2 checkpoint: the next losses are DeepSpeed's (<= 1e-6 relative), the loaded weights its shards merged (at
    tp=2: each rank's shards DeepSpeed's on that rank), bitwise; counters, scheduler, lr and client_state its own."""
    runs, _ = runs
    theirs, _, run = runs[0]["ds"]
    shards = [out["ds"][1] for out in runs]
    dims = {"up.weight": 0, "up.bias": 0, "down.weight": 1}
    for r, out in enumerate(runs):
        losses, facts, loaded = out[stage]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(theirs), rtol=1e-6, atol=0)
        name, client, steps, sched, lrs = facts
        assert (name, client, steps) == (TAG, {"epoch": 3}, K)
        assert (sched, lrs) == run
        if stage == "tp2":
            assert loaded.keys() == shards[r].keys()
            assert all(torch.equal(t, shards[r][n]) for n, t in loaded.items()), r
        elif r == 0:  # the state dict is gathered on rank 0
            assert loaded.keys() == shards[0].keys()
            for n, t in loaded.items():
                want = torch.cat([s[n] for s in shards], dims[n]) if n in dims else shards[0][n]
                assert torch.equal(t, want), (stage, r, n)


def test_unmergeable_tensor_parallel_params_are_refused_on_every_rank(runs):
    runs, _ = runs
    for out in runs:
        e = out["error"]
        assert (
            e and "param 'up.weight'" in e and "shards of shapes [(5, 11), (5, 11)]" in e and "full shape (12, 11)" in e
        ), e
