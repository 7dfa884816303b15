"""DeepSpeed's MoE checkpoints (``layer_L_expert_E_mp_rank_00_model_states.pt`` beside the model states, the experts'
param groups in the ZeRO optimizer files, or ``expp_rank_R`` optimizer files without ZeRO) load into llmpar.

The checkpoints are DeepSpeed 0.19's own (``ds_moe_run.py``: two legacy MoE layers of 4 experts, trained 2 steps on 2
CPU ranks at ZeRO-2 / ep=2, ZeRO-1 / ep=1 and without ZeRO / ep=2, saved, and continued 2 steps), kept as golden
files (``tests/golden/ds_moe/``, ``make golden``); one case runs DeepSpeed live and must equal its golden. One launch
on 2 ranks loads each into an llmpar engine of the same model built from ``llmpar.moe.layer.MoE`` (another seed: the
load must overwrite every value) at another ZeRO stage and ep=1, and the two ep=2 checkpoints also at ep=2 (ZeRO-2,
ZeRO-3; each rank's experts in the expert optimizer, read by their global index), as is the ZeRO-2 one converted to
universal (the generic loader): every weight equals the checkpoint's (experts
under their global index) bitwise, the param groups keep DeepSpeed's hyper-parameters, the next steps' losses equal
DeepSpeed's continuation (1e-6), and a model with another expert count is refused naming the layer and the counts
(at ep=2: the whole model's count, not one rank's). In one process:
the reader's names and groups, ``convert`` to universal and HF, and the broken checkpoints (a missing or extra expert
file, an ep that does not divide the experts, an expert file of another expert) raise errors naming the file.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from multirank import close_pools, run_ranks
from reference_runs import References

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # imported as checkpoint.test_checkpoint_ds_moe
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (reference_runs.SUITES) without conftest.py
import ds_moe_run as run  # noqa: E402

CASES = {"z2-ep2": {"stage": 2, "ep": 2}, "z1-ep1": {"stage": 1, "ep": 1}, "z0-ep2": {"stage": 0, "ep": 2}}
LOADED_AT = {"z2-ep2": 1, "z1-ep1": 2, "z0-ep2": 3}  # the ZeRO stage llmpar loads each at (dp=2, ep=1)
# (ZeRO stage, ep): the experts spread as DeepSpeed had them; "uni": z2-ep2 converted to universal (the generic loader)
AT_EP2 = {"z2-ep2@ep2": (2, 2), "z0-ep2@ep2": (3, 2), "uni@ep2": (1, 2)}
FROM = {"uni": "z2-ep2"}  # a converted checkpoint: the DeepSpeed one it was written from


def _origin(case: str) -> str:
    """The DeepSpeed run ``case`` (``"<checkpoint>[@ep2]"``) holds the checkpoint of."""
    src = case.split("@")[0]
    return FROM.get(src, src)


EXPERT = "moe{}.deepspeed_moe.experts.deepspeed_experts.{}.{}"
LOCAL = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..+)$")


def _record(case: str, spec: dict, tmp: Path, ext: Path) -> dict:
    # in fresh processes, as `make golden` made the goldens: after another DeepSpeed engine in the same process (the
    # pooled workers of tests/checkpoint/test_checkpoint_deepspeed.py), DeepSpeed's MoE run differs in the last bits
    close_pools()
    return run_ranks(run.deepspeed_body, 2, spec, str(tmp), str(ext), timeout=240)[0]


def _contents(files: dict[str, str], tmp: Path) -> dict:
    from llmpar.checkpoint.formats.deepspeed.files import load_file

    run.unpack(files, tmp)
    return {name: load_file(str(tmp / name)) for name in files}


def _same_objects(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _same_objects(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_objects(x, y, f"{where}[{i}]")
    elif hasattr(a, "state") and hasattr(a, "args"):  # a DeepSpeed object read without DeepSpeed
        assert type(a).__name__ == type(b).__name__ and a.args == b.args, where
        _same_objects(a.state, b.state, where)
    else:
        assert a == b, (where, a, b)


def _same(case: str, live: dict, golden: dict) -> None:
    """The same losses, and the same files holding the same objects (torch.save's bytes carry a random id)."""
    assert live["before"] == golden["before"] and live["after"] == golden["after"], (live, golden)
    assert sorted(live["files"]) == sorted(golden["files"])
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _same_objects(_contents(live["files"], Path(tmp) / "a"), _contents(golden["files"], Path(tmp) / "b"), case)


REFERENCES = References(
    "ds_moe",
    run=_record,
    cases=CASES,
    live={"z2-ep2"},
    sources=["tests/checkpoint/ds_moe_run.py"],
    packages=("deepspeed", "torch"),
    same=_same,
)


def _golden(case: str) -> dict:
    data = REFERENCES.golden(case)
    assert data is not None, f"no golden file {REFERENCES.path(case)}: run `make golden`"
    return data["record"]


def _unpacked(case: str, root: Path) -> Path:
    """The checkpoint of ``case`` as DeepSpeed wrote it: ``root/case/global_step2``."""
    folder = root / case / run.TAG
    if not folder.is_dir():
        run.unpack(_golden(case)["files"], folder)
    return folder


def _saved_weights(folder: str) -> dict[str, torch.Tensor]:
    """Every param of the checkpoint, read without llmpar's reader: the dense ones from the model states file, the
    experts from their files (which name them globally)."""
    out = {}
    for f in sorted(os.listdir(folder)):
        sd = torch.load(os.path.join(folder, f), map_location="cpu", weights_only=False)
        if f == "mp_rank_00_model_states.pt":
            out.update(sd["module"])
        elif f.startswith("layer_"):
            out.update(sd)
    return out


def _llmpar(stage: int, num_experts: int = run.E, ep: int = 1):
    """llmpar's engine of the same model (``llmpar.moe.layer.MoE``, another seed), dp=2, ``ep`` (2: the experts
    spread over both ranks, in the expert optimizer), the script's AdamW over
    ``split_params_into_different_moe_groups_for_optimizer`` groups, weight decay 0 (the load restores 0.1)."""
    import torch.distributed as dist

    import llmpar
    from llmpar.moe.layer import MoE
    from llmpar.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    from llmpar.utils import groups

    groups._reset()
    model = run.Net(MoE, ep, seed=11, num_experts=num_experts)
    model.spread(dist.get_rank() % ep, seed=70)
    opt = torch.optim.AdamW(split({"params": list(model.parameters()), "name": "params"}), lr=1e-3, weight_decay=0.0)
    cfg = {k: v for k, v in run.config(stage).items() if k != "optimizer"}
    engine, *_ = llmpar.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the text
        return f"{type(e).__name__}: {e}"
    return None


def _global(name: str, ep: int, rank: int) -> str:
    """The global name of this rank's local expert param ``name`` (ep rank ``rank`` of ``ep``)."""
    m = LOCAL.match(name)
    return name if m is None else f"{m.group(1)}{rank % ep * (run.E // ep) + int(m.group(2))}{m.group(3)}"


def _load_body(root: str) -> dict:
    """Each case loaded at ``LOADED_AT`` and continued (module docstring), then a model of 2 experts per layer."""
    import torch.distributed as dist

    from llmpar.zero import GatheredParameters

    rank, out = dist.get_rank(), {}
    for case, (stage, ep) in {**{c: (s, 1) for c, s in LOADED_AT.items()}, **AT_EP2}.items():
        src = case.split("@")[0]
        folder = f"{root}/{_origin(case)}/{run.TAG}"
        engine = _llmpar(stage, ep=ep)
        assert (engine.optimizer.experts is not None) == (ep > 1)
        path, client = engine.load_checkpoint(f"{root}/{src}", tag=run.TAG)
        want = _saved_weights(folder)
        with GatheredParameters(list(engine.module.parameters())):
            got = {_global(n, ep, rank): p.detach().clone() for n, p in engine.module.named_parameters()}
        if ep > 1:  # this rank's experts: global ids rank * E_local + i
            want = {n: w for n, w in want.items() if LOCAL.match(n) is None or n in got}
            assert len(want) == len(got) < len(_saved_weights(folder)), (sorted(got), sorted(want))
        differ = sorted(n for n in want if n not in got or not torch.equal(got[n], want[n]))
        hyper = [(g["weight_decay"], tuple(g["betas"])) for g in engine.optimizer.param_groups]
        facts = (os.path.basename(path), client, engine.global_steps, hyper, sorted(set(got) - set(want)))
        out[case] = (differ, facts, run.train(engine, range(run.K, run.K + run.N), rank))
    for ep in (1, 2):
        engine = _llmpar(1, num_experts=2, ep=ep)
        out[f"fewer_experts@ep{ep}"] = _error(lambda: engine.load_checkpoint(f"{root}/z2-ep2", tag=run.TAG))
    return out


def test_deepspeed_moe_checkpoints_resume_in_llmpar(tmp_path):
    records = {case: _golden(case) for case in CASES}
    for case in CASES:
        _unpacked(case, tmp_path)
    from llmpar.checkpoint import convert

    convert.convert(str(_unpacked("z2-ep2", tmp_path)), str(tmp_path / "uni"), to="universal")
    per_rank = run_ranks(_load_body, 2, str(tmp_path), timeout=240)
    for rank, out in enumerate(per_rank):
        for case, (differ, facts, losses) in ((c, out[c]) for c in [*CASES, *AT_EP2]):
            assert differ == [], (case, rank, differ[:4])
            tag, client, steps, hyper, extra = facts
            assert (tag, client, steps, extra) == (run.TAG, {"data_pos": 7}, run.K, []), (case, facts)
            assert hyper == [(0.1, (0.9, 0.95))] * 2, (case, hyper)  # both groups: the dense and the experts'
            torch.testing.assert_close(
                torch.tensor(losses, dtype=torch.float64),
                torch.tensor(records[_origin(case)]["after"][rank], dtype=torch.float64),
                rtol=1e-6,
                atol=0,
                msg=lambda m, c=case: f"{c} rank {rank}: {m}",
            )
        for ep in (1, 2):  # the whole model's count, at ep=2 too (1 expert per rank x 2)
            err = out[f"fewer_experts@ep{ep}"]
            assert err is not None and "MoE layer 'moe0' has 4 experts" in err and "but 2 in this model" in err, err


def test_deepspeed_moe_golden_matches_live_deepspeed(tmp_path, ds_ext_dir):
    """DeepSpeed here writes what the golden files hold (the one live case: ZeRO-2, ep=2)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    record = REFERENCES.get("z2-ep2", tmp_path, ds_ext_dir)
    assert record["after"] == _golden("z2-ep2")["after"]
    # the record's files are DeepSpeed's MoE layout: per-expert files under global ids, no expert weights in the
    # model states, and the expert group partitioned over edp = dp / ep = 1 rank
    files = sorted(record["files"])
    assert [f for f in files if f.startswith("layer_")] == [
        f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in range(2) for e in range(run.E)
    ]
    contents = _contents(record["files"], tmp_path / "files")
    assert not any("experts" in n for n in contents["mp_rank_00_model_states.pt"]["module"])
    assert contents["layer_1_expert_3_mp_rank_00_model_states.pt"].keys() == {
        EXPERT.format(1, 3, p) for p in ("0.weight", "0.bias", "2.weight", "2.bias")
    }
    z = contents["zero_pp_rank_1_mp_rank_00_optim_states.pt"]["optimizer_state_dict"]
    assert z["partition_count"] == [2, 1]


def test_reader_names_experts_globally_and_keeps_their_groups(tmp_path):
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed
    from llmpar.checkpoint.formats.source import full, one_step

    readers = {case: open_deepspeed(str(_unpacked(case, tmp_path))) for case in CASES}
    names = readers["z1-ep1"].names
    for case, ck in readers.items():
        assert sorted(ck.names) == sorted(names), case
        groups = ck.groups()
        assert len(groups) == 2 and not any("experts" in n for n in groups[0]), case
        assert sorted(groups[1]) == sorted(n for n in names if "experts" in n), case
        assert [g.get("moe", False) for g in ck.hyper()] == [False, True], case
        assert one_step(ck) == run.K and "ep=" in ck.describe() and ck.client_state() == {"data_pos": 7}
    assert {EXPERT.format(layer, e, "2.bias") for layer in range(2) for e in range(run.E)} <= set(names)
    # the same training at ep=1 and ep=2 (DeepSpeed averages expert gradients over dp): every expert's state agrees
    for case in ("z2-ep2", "z0-ep2"):
        for name in names:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                a, b = full(readers["z1-ep1"], name, key), full(readers[case], name, key)
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{case} {n}: {m}")
    # the experts of ep rank 1 are its own (global ids 2, 3), not a copy of rank 0's
    ck = readers["z2-ep2"]
    w = _saved_weights(str(_unpacked("z2-ep2", tmp_path)))
    for e in range(run.E):
        name = EXPERT.format(0, e, "0.weight")
        assert torch.equal(full(ck, name, "master").view(w[name].shape), w[name]), name


def test_convert_deepspeed_moe_to_universal_and_hf(tmp_path):
    from safetensors.torch import load_file

    from llmpar.checkpoint import convert
    from llmpar.checkpoint.formats.open import open_source
    from llmpar.checkpoint.formats.source import full, locate

    folder = _unpacked("z2-ep2", tmp_path)
    ds = open_source(locate(str(folder)))
    convert.convert(str(folder), str(tmp_path / "uni"), to="universal")
    uni = open_source(locate(str(tmp_path / "uni")))
    assert sorted(uni.names) == sorted(ds.names)
    for name in ds.names:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(full(uni, name, key), full(ds, name, key)), (name, key)
    written = convert.convert(str(folder), str(tmp_path / "hf"), to="hf")
    hf = {}
    for f in written:
        if f.endswith(".safetensors"):
            hf.update(load_file(f))
    w = _saved_weights(str(folder))
    assert sorted(hf) == sorted(w) and all(torch.equal(hf[n], w[n]) for n in w)


def _broken(tmp_path: Path, case: str, edit) -> str:
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed

    folder = tmp_path / f"broken-{edit.__name__}"
    shutil.copytree(_unpacked(case, tmp_path), folder)
    edit(folder)
    err = _error(lambda: open_deepspeed(str(folder)))
    assert err is not None and err.startswith("CheckpointError"), err
    return err


def test_broken_deepspeed_moe_checkpoints_are_named(tmp_path):
    def missing(d):
        os.remove(d / "layer_1_expert_3_mp_rank_00_model_states.pt")

    def extra(d):
        shutil.copy(
            d / "layer_0_expert_0_mp_rank_00_model_states.pt", d / "layer_0_expert_4_mp_rank_00_model_states.pt"
        )

    def uneven(d):  # no ZeRO: 3 expert optimizer files for layers of 4 experts
        shutil.copy(d / "expp_rank_1_mp_rank_00_optim_states.pt", d / "expp_rank_2_mp_rank_00_optim_states.pt")

    def changed(d):  # an expert file of another save: its weights differ from the masters in the optimizer files
        path = d / "layer_0_expert_2_mp_rank_00_model_states.pt"
        sd = torch.load(path, weights_only=True)
        sd[EXPERT.format(0, 2, "2.bias")][-1] += 0.25
        torch.save(sd, path)

    err = _broken(tmp_path, "z2-ep2", missing)
    assert "lacks expert files ['layer_1_expert_3_mp_rank_00_model_states.pt']" in err and "ep=2" in err, err
    err = _broken(tmp_path, "z1-ep1", extra)
    assert "experts [0, 1, 2, 3, 4]" in err and "4 experts" in err, err
    err = _broken(tmp_path, "z0-ep2", uneven)
    assert "4 expert files, which ep=3" in err, err
    err = _broken(tmp_path, "z2-ep2", changed)
    assert "layer_0_expert_2_mp_rank_00_model_states.pt" in err and EXPERT.format(0, 2, "2.bias") in err, err


def test_old_expert_file_names_are_refused_naming_them(tmp_path):
    """DeepSpeed's old naming (``expert_E_mp_rank_MM_model_states.pt``, no MoE layer id) is refused naming its files
    (not loaded without its experts)."""
    from llmpar.checkpoint.files import CheckpointError
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed

    for n in ["mp_rank_00_model_states.pt", *(f"expert_{i}_mp_rank_00_model_states.pt" for i in range(4))]:
        (tmp_path / n).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"\(4 expert files: \['expert_0_mp_rank_00_model_states.pt'.*old naming"):
        open_deepspeed(str(tmp_path), validate=False)
