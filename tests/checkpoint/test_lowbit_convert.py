"""Checkpoints of 8- / 4-bit optimizer states through the converters and across state precisions.

A low-bit ZeRO run saves its moments as float32 ``exp_avg`` / ``exp_avg_sq`` (the codes dequantized,
``llmpar/zero/lowbit_state.py``), so:
  - ``llmpar checkpoint convert --to deepspeed / universal / dcp / hf`` writes fp32 optimizer states equal, element for
    element, to the dequantized codes of the live run (read back here with llmpar's DeepSpeed and universal readers,
    and from the DeepSpeed files as DeepSpeed's engine unpickles them);
  - a converted checkpoint loaded back into a low-bit run at the same units re-quantizes to the same codes and scales,
    bitwise (DeepSpeed ZeRO-2 and universal from a ZeRO-2 8-bit run, DeepSpeed ZeRO-3 from a ZeRO-3 4-bit run, DCP);
  - a low-bit checkpoint loads into an fp32-state run (the moments are the dequantized codes, exactly), and an
    fp32-state checkpoint into a low-bit run (each unit shard quantized from the saved moments, as
    ``lowbit.quantize`` does it on the unit's values): switching precision is a config change, said in the log.
One pool job (2 ranks) does the runs, saves, conversions (rank 0) and loads; the checks read its results.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from llmpar.ops import lowbit as L

from multirank import run_ranks

T, ROWS, V = 8, 8, 67
BITS = {"AdamW8bit": 8, "AdamW4bit": 4}
MOMENTS = {"exp_avg": ("m_codes", "m_scale", True), "exp_avg_sq": ("v_codes", "v_scale", False)}


def _engine(stage, typ):
    import llmpar
    from llmpar.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=V, n_layer=2, n_head=4, d_model=16, seq_len=T), seed=0, dtype=torch.float32)
    cfg = {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": typ, "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "stage3_param_persistence_threshold": 100},
    }
    engine, *_ = llmpar.initialize(model=model, config=cfg)
    return engine, model


def _train(engine, model, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    n = ROWS // world
    for s in steps:
        d = torch.randint(0, V, (ROWS, T + 1), generator=torch.Generator().manual_seed(100 + s))
        x, y = d[rank * n : (rank + 1) * n, :-1], d[rank * n : (rank + 1) * n, 1:]
        engine.backward(model.loss(engine(x), y))
        engine.step()


def _codes(engine):
    return [{k: t.clone() for k, t in b.state.items()} for b in engine.optimizer.buffers]


def _moments(engine):
    """{key: {name: [(start, stop, numpy values)]}}: this rank's pieces of each param's moments as the seam shows
    them; for a low-bit run they are recomputed here with ``lowbit.dequantize`` from each unit shard's codes."""
    from llmpar.zero import lowbit_state

    opt = engine.optimizer
    out = {k: {} for k in MOMENTS}
    shards = opt.checkpoint_shards()
    for b, held, shard in zip(opt.buffers, opt.checkpoint_held(), shards):
        bits, lay = lowbit_state.bits_of(b.mode), b.layout
        for key, (ck, sk, signed) in MOMENTS.items():
            if bits is None:
                part = shard[key]
            else:
                part = torch.cat(
                    [
                        L.dequantize(
                            lowbit_state.unit_view(lay, b.state[ck], ck, u, bits),
                            lowbit_state.unit_view(lay, b.state[sk], sk, u, bits),
                            bits,
                            signed,
                            lay.units[u].shard_numel(lay.shards),
                        )
                        for u in range(len(lay.units))
                    ]
                )
                assert torch.equal(part, shard[key]), "the seam shows the dequantized codes"
            for name, a, z, at in held:
                out[key].setdefault(name, []).append((a, z, part[at : at + z - a].numpy().copy()))
    return out


def _unit_codes(engine):
    """[buffer][unit] -> {codes / scales key: numpy} of this rank's shard, and each buffer's describe()."""
    from llmpar.zero import lowbit_state

    opt = engine.optimizer
    out = []
    for b in opt.buffers:
        bits = lowbit_state.bits_of(b.mode)
        out.append(
            [
                {
                    k: lowbit_state.unit_view(b.layout, b.state[k], k, u, bits).numpy().copy()
                    for k in lowbit_state.CODE_KEYS
                }
                for u in range(len(b.layout.units))
            ]
        )
    return out, opt.describe()["buffers"]


def _same(a, b):
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x) and len(a) == len(b)


def body(root):
    from llmpar.checkpoint import convert

    os.environ["LLMPAR_BACKEND"] = "torch"
    rank, out = dist.get_rank(), {}
    runs = {"s2-int8": (2, "AdamW8bit"), "s3-int4": (3, "AdamW4bit"), "s2-fp32": (2, "AdamW")}
    live = {}
    for name, (stage, typ) in runs.items():
        e, m = _engine(stage, typ)
        _train(e, m, range(2))
        e.save_checkpoint(f"{root}/{name}", tag="t2")
        live[name] = _codes(e)
        out[f"moments/{name}"] = _moments(e)
    if rank == 0:
        for src, to, stage in (
            ("s2-int8", "deepspeed", None),
            ("s2-int8", "universal", None),
            ("s2-int8", "dcp", None),
            ("s2-int8", "hf", None),
            ("s3-int4", "deepspeed", 3),
        ):
            convert.convert(f"{root}/{src}", f"{root}/{src}-{to}", to=to, stage=stage)
    dist.barrier()
    # converted checkpoints back into a low-bit run at the same units: the same codes and scales
    for src, to, stage, typ in (
        ("s2-int8", "deepspeed", 2, "AdamW8bit"),
        ("s2-int8", "universal", 2, "AdamW8bit"),
        ("s2-int8", "dcp", 2, "AdamW8bit"),
        ("s3-int4", "deepspeed", 3, "AdamW4bit"),
    ):
        e, _ = _engine(stage, typ)
        e.load_checkpoint(f"{root}/{src}-{to}")
        out[f"back/{src}-{to}"] = _same(live[src], _codes(e))
    # across state precisions: low-bit -> fp32 states, fp32 -> low-bit, 8 -> 4 bits (said in the log)
    import logging

    notes = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logging.getLogger("llmpar").addHandler(handler)
    for src, stage, typ in (
        ("s2-int8", 2, "AdamW"),
        ("s3-int4", 2, "AdamW"),
        ("s2-fp32", 2, "AdamW8bit"),
        ("s2-int8", 3, "AdamW4bit"),
    ):
        e, m = _engine(stage, typ)
        e.load_checkpoint(f"{root}/{src}", tag="t2")
        out[f"cross/{src}->{typ}@{stage}"] = _moments(e)
        if typ != "AdamW":
            out[f"cross_codes/{src}->{typ}@{stage}"] = _unit_codes(e)
        _train(e, m, range(2, 3))  # and it trains on
    logging.getLogger("llmpar").removeHandler(handler)
    out["notes"] = [n for n in notes if "was saved with optimizer states" in n]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lowbit_convert")
    return run_ranks(body, 2, str(root), timeout=300), root


def _full(outs, key, what):
    """{name: float32 tensor} assembled from every rank's pieces of ``key`` in result ``what``."""
    pieces = {}
    for r in outs:
        for name, ps in r[what][key].items():
            pieces.setdefault(name, []).extend(ps)
    full = {}
    for name, ps in pieces.items():
        n = max(z for _, z, _ in ps)
        t = torch.full((n,), float("nan"))
        for a, z, v in ps:
            t[a:z] = torch.from_numpy(v)
        assert not t.isnan().any(), name
        full[name] = t
    return full


def test_converted_lowbit_checkpoints_hold_the_dequantized_codes_as_fp32(runs):
    from llmpar.checkpoint.formats.deepspeed.open import open_deepspeed
    from llmpar.checkpoint.formats.open import open_source
    from llmpar.checkpoint.formats.source import full, locate

    outs, root = runs
    for src, to in (("s2-int8", "deepspeed"), ("s2-int8", "universal"), ("s3-int4", "deepspeed")):
        path = root / f"{src}-{to}"
        if to == "deepspeed":
            ck = open_deepspeed(os.path.join(path, (path / "latest").read_text().strip()), validate=False)
            read = lambda n, k, numel: ck.read(n, k, 0, numel)  # noqa: E731
        else:
            s = open_source(locate(str(path), None, "universal"))
            read = lambda n, k, numel: full(s, n, k).reshape(-1)  # noqa: E731
        for key in MOMENTS:
            want = _full(outs, key, f"moments/{src}")
            for name, t in want.items():
                got = read(name, key, t.numel())
                assert got.dtype == torch.float32 and torch.equal(got, t), (src, to, key, name)
    # as DeepSpeed's engine unpickles a ZeRO-2 rank file: torch AdamW's state over the fp32 partition
    ds = root / "s2-int8-deepspeed"
    tag = (ds / "latest").read_text().strip()
    sd = torch.load(ds / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)
    state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert float(state["step"]) == 2.0
    assert (root / "s2-int8-hf").is_dir() and (root / "s2-int8-dcp").is_dir()


@pytest.mark.parametrize("what", ["s2-int8-deepspeed", "s2-int8-universal", "s2-int8-dcp", "s3-int4-deepspeed"])
def test_converted_checkpoint_requantizes_to_the_same_codes(runs, what):
    outs, _ = runs
    assert all(r[f"back/{what}"] for r in outs)


def test_lowbit_checkpoint_loads_into_fp32_states_exactly(runs):
    outs, _ = runs
    notes = outs[0]["notes"]
    assert len(notes) == 4 and not outs[1]["notes"], notes  # one line per load, from the first rank
    assert "optimizer states ['int8'], this run keeps ['fp32']: the moments load as their float32 values" in notes[0]
    assert notes[2].endswith("re-quantized in this run's blocks"), notes[2]
    for src in ("s2-int8", "s3-int4"):
        for key in MOMENTS:
            want, got = _full(outs, key, f"moments/{src}"), _full(outs, key, f"cross/{src}->AdamW@2")
            assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want), (src, key)


@pytest.mark.parametrize("src, typ, stage", [("s2-fp32", "AdamW8bit", 2), ("s2-int8", "AdamW4bit", 3)])
def test_checkpoint_loads_into_lowbit_states_quantized_per_unit_shard(runs, src, typ, stage):
    """Each unit shard of the loading run holds ``lowbit.quantize`` of the saved moments laid out in that unit
    (params at their offsets, zero padding), cut at the shard: the same as a step would have quantized them."""
    outs, _ = runs
    bits = BITS[typ]
    saved = {key: _full(outs, key, f"moments/{src}") for key in MOMENTS}
    for rank, r in enumerate(outs):
        codes, layout = r[f"cross_codes/{src}->{typ}@{stage}"]
        for buf, units in zip(layout, codes):
            for ui, (unit, got) in enumerate(zip(buf["units"], units)):
                shard = unit["padded"] // buf["shards"]
                for key, (ck, sk, signed) in MOMENTS.items():
                    flat = torch.zeros(unit["padded"])
                    for i in unit["params"]:
                        p = buf["params"][i]
                        v = saved[key][p["name"]]
                        flat[p["offset"] : p["offset"] + v.numel()] = v
                    c, s = L.quantize(flat[rank * shard : (rank + 1) * shard], bits, signed)
                    assert torch.equal(torch.from_numpy(got[ck]), c) and torch.equal(torch.from_numpy(got[sk]), s), (
                        src,
                        typ,
                        rank,
                        ui,
                        key,
                    )
        # and the loaded run shows those codes dequantized
        for key in MOMENTS:
            got = _full(outs, key, f"cross/{src}->{typ}@{stage}")
            err = max(float((got[n] - saved[key][n]).abs().max()) for n in got)
            assert 0 < err <= max(float(t.abs().max()) for t in saved[key].values()) / (8 if bits == 4 else 50)
