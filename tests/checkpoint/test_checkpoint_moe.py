"""llmpar's own checkpoints of expert-parallel engines (``llmpar/checkpoint/experts.py``).

One 4-rank job: an engine with two MoE layers of 8 experts spread over ep=2 (ZeRO-1, edp=2, clipping, aux losses and
the aux-loss-free expert bias) trains 2 steps, saves, trains 2 more (the uninterrupted run). Fresh engines (another
seed) load that checkpoint at ep=2 / ZeRO-1 (the same layout), ep=1 / ZeRO-2 (the experts in the dense optimizer) and
ep=4 / ZeRO-3 (edp=1), each re-saves what it loaded (ep=4: asynchronously) and trains the 2 steps: the re-saved
params, moments and step counts equal the saved ones bitwise (read back whole by global name, so an expert saved
under its local index would land on another expert's rows), consolidate writes them whole, the losses equal the
uninterrupted run's (bitwise at the same layout); at ep=4 / ZeRO-2 with 8-bit moments (AdamW8bit) the params and
steps load bitwise, the moments re-quantized, the losses within 1e-2. ``optimizer.state_dict()`` /
``load_state_dict`` of the ep=2 engine round-trip both optimizers bitwise (the dense part alone is refused). In the
same job DeepSpeed's legacy layer saved at ep=2 x edp=2 loads at ep=4 bitwise (each expert's shards over edp). Bad
input: a checkpoint of 6 experts loaded at ep=4 (6 does not split over 4 ranks) and at ep=2 into 8 experts: a
CheckpointError naming the param and the counts on every rank, before anything is modified. A 2-rank job saves
DeepSpeed's legacy layer (``llmpar.moe.layer.MoE``, a module per expert) at ep=2, loads it at ep=1 and back at ep=2
(ZeRO-2, and ZeRO-3 re-saved asynchronously): every expert under its global index, params, moments and steps bitwise,
the reader's param groups the experts' own (and so in ``convert``'s universal output); a model of another expert
count or expert width is refused naming the param and the shapes, before anything is modified. A 2-rank job exports
tiny Qwen3-MoE / Mixtral models trained at ep=2 with ``save_hf_model``: ``from_pretrained`` reads every tensor back
bitwise, the experts whole.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import llmpar
from llmpar.checkpoint import CheckpointError, convert, metacheck
from llmpar.checkpoint.consolidate import consolidated_state_dict
from llmpar.checkpoint.experts import one_expert
from llmpar.checkpoint.formats.llmpar import LlmparCheckpoint
from llmpar.checkpoint.formats.open import open_source
from llmpar.checkpoint.formats.source import full, locate
from llmpar.checkpoint.plan import stored_names
from llmpar.checkpoint.reshard import CheckpointReader
from llmpar.distributed.dims import ParallelDims
from llmpar.moe import MoEBlock, RouterConfig
from llmpar.moe.layer import MoE
from llmpar.moe.utils import split_params_into_different_moe_groups_for_optimizer

from multirank import run_ranks

H, INTER, E, OUT = 12, 8, 8, 3
KEYS = ("params", "master", "exp_avg", "exp_avg_sq")
LOADS = {  # tag: (ep, ZeRO stage, zero_optimization extras, exact losses)
    "ep2-z1": (2, 1, {}, True),
    "ep1-z2": (1, 2, {}, False),
    "ep4-z3": (4, 3, {"stage3_param_persistence_threshold": 0}, False),
    "ep4-z2-int8": (4, 2, {}, None),  # 8-bit moments: loaded as their float32 values, re-quantized here
}


class _Net(nn.Module):
    def __init__(self, experts: int = E) -> None:
        super().__init__()
        router = RouterConfig(aux_loss_coeff=0.05, expert_bias=True, bias_update_rate=0.05)
        self.inp = nn.Linear(H, H)
        self.moe1 = MoEBlock(H, INTER, experts, 2, router=router, shared_intermediate_size=6)
        self.moe2 = MoEBlock(H, INTER, experts, 2, router=router)
        self.out = nn.Linear(H, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.moe1(h)
        h = h + self.moe2(h)
        return self.out(h)


def _engine(ep: int, stage: int, extra: dict, seed: int, experts: int = E, kind: str = "AdamW"):
    torch.manual_seed(seed)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.05,
        "optimizer": {"type": kind, "params": {"lr": 2e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, **extra},
        "expert_parallel": {"enabled": True, "autoep_size": ep},
    }
    engine, *_ = llmpar.initialize(model=_Net(experts), config=config)
    return engine


def _train(engine, first: int, steps: int) -> list[float]:
    out = []
    for s in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * s + dist.get_rank())
        x, y = torch.randn(2, 5, H, generator=g), torch.randn(2, 5, OUT, generator=g)
        loss = engine.backward(nn.functional.mse_loss(engine(x), y)).detach().double()
        engine.step()
        dist.all_reduce(loss)
        out.append(loss.item())
    return out


def moe_body(root: str) -> dict:
    a = _engine(2, 1, {}, seed=0)
    assert a.optimizer.experts is not None and a.module.moe1.experts.gate_up_proj.shape[0] == E // 2
    _train(a, 0, 2)
    a.save_checkpoint(root, tag="saved")
    opt_sd = a.optimizer.state_dict()  # this rank's shards of both optimizers (the experts' over edp)
    buffers = {n: b.clone() for n, b in a.module.named_buffers()}  # the expert biases move each step
    want = _train(a, 2, 2)
    with pytest.raises(ValueError, match="expert"):  # the dense part alone: refused on every rank
        a.optimizer.load_state_dict({k: v for k, v in opt_sd.items() if k != "experts"})
    a.optimizer.load_state_dict(opt_sd)
    for n, b in a.module.named_buffers():
        b.copy_(buffers[n])
    again = _train(a, 2, 2)
    assert again == want, (again, want)  # the optimizer's state dict round trip, bitwise
    a.destroy()
    six = _engine(2, 1, {}, seed=0, experts=6)
    _train(six, 0, 1)
    six.save_checkpoint(root, tag="six")
    six.destroy()
    out: dict = {"want": want, "errors": {}}
    for tag, (ep, stage, extra, _) in LOADS.items():
        e = _engine(ep, stage, extra, seed=1, kind="AdamW8bit" if tag.endswith("int8") else "AdamW")
        if ep in (2, 4) and not tag.endswith(
            "int8"
        ):  # 6 experts: no split over 4 ranks; 3 per rank at ep=2, but this model has 8
            before = {k: v.detach().clone() for k, v in e.module.state_dict().items()}
            with pytest.raises(CheckpointError) as err:
                e.load_checkpoint(root, tag="six")
            out["errors"][tag] = str(err.value)
            assert all(torch.equal(before[k], v) for k, v in e.module.state_dict().items())  # nothing modified
        e.load_checkpoint(root, tag="saved")
        out.setdefault("modes", {})[tag] = sorted(
            {b["mode"] for b in (e.optimizer.experts or e.optimizer).checkpoint_layout()}
        )
        e.save_checkpoint(root, tag=tag, async_save=ep == 4)  # ep=4: the experts' host snapshot, written by a thread
        e.wait_checkpoint()
        out[tag] = _train(e, 2, 2)
        e.destroy()
    # DeepSpeed's legacy layer (a module per expert) at ep=2 x edp=2 (each expert's shards over 2 ranks) -> ep=4
    la = _legacy_engine(2, 2, seed=0, split=True)
    _legacy_train(la, 0, 2)
    la.save_checkpoint(root, tag="legacy-ep2")
    out["legacy-want"] = _legacy_train(la, 2, 2)
    la.destroy()
    lb = _legacy_engine(4, 1, seed=1, split=False)
    lb.load_checkpoint(root, tag="legacy-ep2")
    lb.save_checkpoint(root, tag="legacy-ep4")
    out["legacy-ep4"] = _legacy_train(lb, 2, 2)
    lb.destroy()
    return out


def _whole(path: str) -> dict[tuple[str, str], torch.Tensor]:
    """{(name, key): the whole tensor} of every param and state of a checkpoint, and the step counts."""
    meta = metacheck.read(path)
    reader = CheckpointReader(path, meta)
    out = {}
    for name in stored_names(meta):
        if not reader.holds(name):
            continue  # a module buffer
        for key in KEYS:
            if reader.has(name, key):
                out[name, key] = reader.full(name, key).clone()
        out[name, "step"] = torch.tensor(reader.step(name))
    return out


@pytest.mark.slow(reason="one 4-rank job: save at ep=2, load at ep=1 / 2 / 4 and ZeRO 1-3, bad expert counts")
def test_expert_parallel_checkpoint_loads_at_any_ep_and_stage_exactly(tmp_path):
    outs = run_ranks(moe_body, 4, str(tmp_path), timeout=600)
    res = outs[0]
    saved = _whole(os.path.join(tmp_path, "saved"))
    experts = {n for n, k in saved if ".experts." in n and k == "exp_avg"}
    assert {"moe1.experts.gate_up_proj", "moe2.experts.down_proj"} <= experts, sorted(saved)
    assert saved["moe1.experts.gate_up_proj", "params"].shape == (E, 2 * INTER, H)  # global, not E / ep rows
    whole = consolidated_state_dict(str(tmp_path / "saved"), dtype=None)  # what `llmpar checkpoint consolidate` writes
    params = {n: v for (n, k), v in saved.items() if k == "params"}
    assert set(params) <= set(whole) and len(params) > 4, sorted(set(params) - set(whole))
    assert all(torch.equal(whole[n], v) for n, v in params.items())
    for tag, (_, _, _, exact) in LOADS.items():
        again = _whole(os.path.join(tmp_path, tag))
        assert sorted(again) == sorted(saved), tag
        lowbit = exact is None
        differ = [
            k for k, v in saved.items() if not (lowbit and k[1].startswith("exp_avg")) and not torch.equal(v, again[k])
        ]
        assert not differ, (tag, differ)
        got, want = res[tag], res["want"]
        if lowbit:  # the moments re-quantized in 8-bit blocks (not compared): params and steps exact, the run close
            assert res["modes"][tag] == ["int8"], res["modes"]
            assert max(abs(g - w) for g, w in zip(got, want)) < 1e-2, (tag, got, want)
        elif exact:
            assert got == want, (tag, got, want)
        else:
            assert max(abs(g - w) for g, w in zip(got, want)) < 1e-5, (tag, got, want)
    legacy = _whole(os.path.join(tmp_path, "legacy-ep2"))  # 4 legacy experts written at ep=2 x edp=2, read at ep=4
    assert {n for n, k in legacy if ".deepspeed_experts." in n and k == "exp_avg"} == {
        f"moe.deepspeed_moe.experts.deepspeed_experts.{e}.{i}.{w}"
        for e in range(LE)
        for i in (0, 2)
        for w in ("weight", "bias")
    }
    again = _whole(os.path.join(tmp_path, "legacy-ep4"))
    assert sorted(again) == sorted(legacy) and not [k for k, v in legacy.items() if not torch.equal(v, again[k])]
    assert max(abs(g - w) for g, w in zip(res["legacy-ep4"], res["legacy-want"])) < 1e-6, res
    for rank_out in outs:  # every rank raised, naming the param and the counts
        errs = rank_out["errors"]
        assert ".experts." in errs["ep4-z3"] and "6 experts" in errs["ep4-z3"] and "ep=4" in errs["ep4-z3"]
        assert "6 experts" in errs["ep2-z1"] and "8 experts" in errs["ep2-z1"], errs


# ------------------------------------------------------------------------------------------------ DeepSpeed's MoE
LE = 4  # experts of the legacy layer: 2 per rank at ep=2


class _Scaled(nn.Module):
    """An expert's output scaled by a persistent buffer (module state outside the optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((H,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _LegacyNet(nn.Module):
    """A DeepSpeed MoE script's model (``llmpar.moe.layer.MoE``, one module per expert: ``[8, 12]`` / ``[12, 8]``
    weights), global expert g seeded by g so that ep=1 and ep=2 builds hold the same experts."""

    def __init__(self, ep: int, experts: int = LE, inter: int = INTER, buffered: bool = False) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(H, H), nn.Linear(H, OUT)
        expert = nn.Sequential(nn.Linear(H, inter), nn.GELU(), nn.Linear(inter, H), *([_Scaled()] * buffered))
        group = ParallelDims(dp=dist.get_world_size(), ep=ep).group("ep") if ep > 1 else None
        self.moe = MoE(H, expert, experts, ep, k=2, min_capacity=0, top2_2nd_expert_sampling=False, ep_group=group)
        first = (dist.get_rank() % ep) * (experts // ep)
        for i, e in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(100 + first + i)
            with torch.no_grad():
                for p in e.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(self.inp(x))
        return self.out(h).pow(2).mean() + 0.01 * l_aux


def _legacy_engine(
    ep: int, stage: int, seed: int, split: bool, experts: int = LE, inter: int = INTER, buffered: bool = False
):
    """``split``: DeepSpeed's MoE param groups (``split_params_into_different_moe_groups_for_optimizer``), else
    ``model.parameters()`` (the engine puts the experts in the expert optimizer's group)."""
    torch.manual_seed(seed)
    net = _LegacyNet(ep, experts, inter, buffered)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if not split:
        return llmpar.initialize(model=net, config=config)[0]
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "p", "weight_decay": 0.01}
    )
    return llmpar.initialize(model=net, model_parameters=groups, config=config)[0]


def _legacy_train(engine, first: int, steps: int) -> list[float]:
    out = []
    for s in range(first, first + steps):
        x = torch.randn(7, H, generator=torch.Generator().manual_seed(500 + 10 * s + dist.get_rank()))
        loss = engine.backward(engine(x)).detach().double()
        engine.step()
        dist.all_reduce(loss)
        out.append(loss.item())
    return out


def legacy_body(root: str) -> dict:
    a = _legacy_engine(2, 2, seed=0, split=True)  # ep=2, ZeRO-2 over edp=1
    assert a.optimizer.experts is not None and len(a.module.moe.deepspeed_moe.experts.deepspeed_experts) == LE // 2
    _legacy_train(a, 0, 2)
    a.save_checkpoint(root, tag="ep2")
    out = {"want": _legacy_train(a, 2, 2)}
    a.destroy()
    b = _legacy_engine(1, 1, seed=1, split=True)  # ep=1, ZeRO-1 over dp=2: every expert in the dense optimizer
    assert b.optimizer.experts is None
    b.load_checkpoint(root, tag="ep2")
    b.save_checkpoint(root, tag="ep1")
    out["ep1"] = _legacy_train(b, 2, 2)
    b.destroy()
    c = _legacy_engine(2, 2, seed=2, split=False)  # back to ep=2; the experts' group made by the engine
    c.load_checkpoint(root, tag="ep1")
    c.save_checkpoint(root, tag="ep2-again")
    out["ep2-again"] = _legacy_train(c, 2, 2)
    c.destroy()
    d = _legacy_engine(2, 3, seed=3, split=True)  # ep=2, ZeRO-3: the experts' shards, re-saved asynchronously
    d.load_checkpoint(root, tag="ep1")
    d.save_checkpoint(root, tag="ep2-z3", async_save=True)
    d.wait_checkpoint()
    out["ep2-z3"] = _legacy_train(d, 2, 2)
    d.destroy()
    out["errors"] = {}
    for count, inter in ((8, INTER), (LE, INTER + 2)):  # another expert count (the gate's shape), wider experts
        e = _legacy_engine(2, 1, seed=4, split=True, experts=count, inter=inter)
        before = {k: v.detach().clone() for k, v in e.module.state_dict().items()}
        with pytest.raises(CheckpointError) as err:
            e.load_checkpoint(root, tag="ep2")
        out["errors"][count, inter] = str(err.value)
        assert all(torch.equal(before[k], v) for k, v in e.module.state_dict().items())  # nothing modified
        e.destroy()
    e = _legacy_engine(2, 1, seed=5, split=True, buffered=True)  # experts with a buffer: not saved per expert
    for call in (lambda: e.save_checkpoint(root, tag="buffered"), lambda: e.load_checkpoint(root, tag="ep2")):
        with pytest.raises(CheckpointError) as err:
            call()
        out["errors"].setdefault("buffered", []).append(str(err.value))
    assert not os.path.exists(os.path.join(root, "buffered"))
    e.destroy()
    return out


def test_legacy_moe_checkpoint_names_experts_by_global_index(tmp_path):
    outs = run_ranks(legacy_body, 2, str(tmp_path), timeout=300)
    res = outs[0]
    saved = _whole(os.path.join(tmp_path, "ep2"))
    names = {n for n, _ in saved}
    experts = {n for n in names if ".deepspeed_experts." in n}
    want = {f"moe.deepspeed_moe.experts.deepspeed_experts.{e}.{i}.{w}" for e in range(LE) for i in (0, 2)
            for w in ("weight", "bias")}  # fmt: skip
    assert experts == want, sorted(experts ^ want)  # every expert under its global index, none under a local one
    assert saved["moe.deepspeed_moe.experts.deepspeed_experts.3.0.weight", "params"].shape == (INTER, H)
    whole = consolidated_state_dict(
        str(tmp_path / "ep2"), dtype=None
    )  # `llmpar checkpoint consolidate`: the ep=1 names
    assert experts <= set(whole) and all(torch.equal(whole[n], saved[n, "params"]) for n in experts)
    for tag in ("ep1", "ep2-again", "ep2-z3"):  # ep=2 -> ep=1 -> ep=2 (ZeRO-2, -3): weights, moments, steps bitwise
        again = _whole(os.path.join(tmp_path, tag))
        assert sorted(again) == sorted(saved), (tag, sorted(set(again) ^ set(saved)))
        differ = [k for k, v in saved.items() if not torch.equal(v, again[k])]
        assert not differ, (tag, differ)
    assert res["ep2-again"] == res["want"], res  # the same layout as the uninterrupted run: bitwise
    assert max(abs(g - w) for g, w in zip(res["ep1"] + res["ep2-z3"], res["want"] * 2)) < 1e-6, res
    more = [r["errors"][8, INTER] for r in outs]  # 8 experts: rank 0's gate has other rows, rank 1's experts 4-7 lack
    assert "moe.deepspeed_moe.gate.wg.weight" in more[0] and "(8, 12) here but (4, 12)" in more[0], more
    assert "16 expert params of this model are not in" in more[1], more
    assert "moe.deepspeed_moe.experts.deepspeed_experts.4.0.weight" in more[1], more
    for rank_out in outs:  # expert buffers at ep=2: save and load refused on every rank, naming them
        saving, loading = rank_out["errors"]["buffered"]
        assert saving.startswith("save_checkpoint") and loading.startswith("load_checkpoint"), (saving, loading)
        assert all("moe.deepspeed_moe.experts.deepspeed_experts.0.3.scale" in m for m in (saving, loading))
    for rank_out in outs:  # wider experts: refused on every rank, naming the param and both shapes
        wider = rank_out["errors"][LE, INTER + 2]
        assert "expert param 'moe.deepspeed_moe.experts.deepspeed_experts." in wider, wider
        assert "(8, 12) in the checkpoint but (10, 12) in this model" in wider, wider
    # the experts in their own param group, after the dense one (as DeepSpeed's split makes them), at every ep
    for tag in ("ep2", "ep1", "ep2-again", "ep2-z3"):
        ck = LlmparCheckpoint(os.path.join(tmp_path, tag))
        groups, hyper = ck.groups(), ck.hyper()
        assert [sorted(g) for g in groups] == [sorted(names - experts), sorted(experts)], (tag, groups)
        assert len(hyper) == 2 and hyper[1] == hyper[0] and hyper[1]["weight_decay"] == 0.01, (tag, hyper)
    # converted to universal with the experts' group: every state bitwise, the groups as the reader's
    convert.convert(str(tmp_path), str(tmp_path / "uni"), to="universal", tag="ep2-again")
    ck, uni = LlmparCheckpoint(os.path.join(tmp_path, "ep2-again")), open_source(locate(str(tmp_path / "uni")))
    assert [sorted(g) for g in uni.groups()] == [sorted(g) for g in ck.groups()] and len(uni.hyper()) == 2
    for name in ck.names:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(full(uni, name, key), full(ck, name, key)), (name, key)


def test_one_expert_params_are_named_by_list_and_index():
    """Which params hold one expert (named by their global index) and which are packed (rows of ``[E, ...]``)."""
    w = torch.zeros(2)
    name = "moe.deepspeed_moe.experts.deepspeed_experts.3.0.weight"
    assert one_expert(name, w) == ("moe.deepspeed_moe.experts.deepspeed_experts.", 3, ".0.weight", None)
    assert one_expert("deepspeed_experts.0.w", w) == ("deepspeed_experts.", 0, ".w", None)  # the layer itself
    tagged = torch.zeros(2)
    tagged.expert_index = ("experts_list", 1, 2)  # type: ignore[attr-defined]
    assert one_expert("blocks.0.experts_list.1.fc.bias", tagged) == ("blocks.0.experts_list.", 1, ".fc.bias", 2)
    for packed in ("moe1.experts.gate_up_proj", "my_deepspeed_experts.1.w", "deepspeed_experts.x.w"):
        assert one_expert(packed, w) is None, packed


# ------------------------------------------------------------------------------------------------ HF export
HF_MODELS = ("qwen3_moe", "mixtral")


def hf_body(root: str) -> dict:
    from test_moe_hf import VOCAB, _model

    out = {}
    for name in HF_MODELS:
        model = _model(name).train()
        config = {"train_batch_size": 2, "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW"}}
        engine, *_ = llmpar.initialize(
            model=model, config={**config, "expert_parallel": {"enabled": True, "autoep_size": 2}}
        )
        assert engine.optimizer.experts is not None
        ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        state = engine.module_state_dict()
        engine.save_hf_model(os.path.join(root, name))
        out[name] = state
        engine.destroy()
    return out


@pytest.mark.slow(reason="one 2-rank job: transformers MoE models at ep=2 exported and read by from_pretrained")
def test_hf_export_of_expert_parallel_engine_loads_with_from_pretrained(tmp_path):
    import transformers

    states = run_ranks(hf_body, 2, str(tmp_path), timeout=300)
    assert all(s == {} for s in states[1].values())  # dp rank 0 gathers
    for name in HF_MODELS:
        want = states[0][name]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float32)
        got = loaded.state_dict()
        assert sorted(got) == sorted(want), (name, sorted(set(got) ^ set(want)))
        experts = [k for k in got if k.endswith("experts.gate_up_proj")]
        count = getattr(loaded.config, "num_local_experts", None) or loaded.config.num_experts
        assert experts and all(got[k].shape[0] == count for k in experts), name  # whole: every ep rank's rows
        differ = [k for k in want if not torch.equal(got[k], want[k])]
        assert not differ, (name, differ)
