"""The checkpoint protocol is the seam: ``llmpar.checkpoint`` reads an engine and its optimizer only through
``Checkpointable`` / ``CheckpointOptimizer``.

* the source of ``llmpar/checkpoint/`` imports neither ``llmpar.zero``, ``llmpar.pipeline`` nor ``llmpar.runtime``,
  reads no ``_private`` attribute of another object and keeps no module-level hook or registry (AST check);
* a tiny fake engine + optimizer that share nothing with ZeRO (one process, no process group: an empty grid) save,
  load, async-save, crash at a fault hook passed per call, and consolidate through the real checkpoint code;
* ZeRO's mixin and both engines implement every method of the protocols; every format's reader (llmpar's, DeepSpeed's
  three layouts, universal, DCP) every member of the one reader protocol (``formats/source.py``).
"""

from __future__ import annotations

import ast
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from llmpar.checkpoint import (
    Checkpointable,
    CheckpointError,
    CheckpointOptimizer,
    Grid,
    load_checkpoint,
    save_checkpoint,
    wait_checkpoint,
)
from llmpar.checkpoint.consolidate import consolidated_state_dict
from llmpar.checkpoint.pending import pending

CKPT = Path(__file__).resolve().parents[2] / "llmpar" / "checkpoint"


# ---------------------------------------------------------------------------------------------------- the source
def _sources() -> list[Path]:
    return sorted(CKPT.rglob("*.py"))  # the formats' packages too


def test_checkpoint_imports_neither_zero_nor_pipeline():
    bad = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            bad += [
                f"{path.relative_to(CKPT)}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[:2] in (["llmpar", "zero"], ["llmpar", "pipeline"], ["llmpar", "runtime"])
            ]
    assert not bad, "llmpar/checkpoint must see the optimizer and engines through protocol.py only:\n" + "\n".join(bad)


def test_checkpoint_reads_no_private_attribute_of_another_object():
    bad = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                attr, owner = node.attr, node.value
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                attr, owner = node.args[1].value, node.args[0]
            else:
                continue
            private = attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))
            # the standard library's pickle internals that writing DeepSpeed's pickles needs (formats/deepspeed/
            # files.py): the pure-Python pickler's save() hook and the reconstructor protocol-2 reductions of plain
            # objects name
            stdlib = isinstance(owner, ast.Name) and (owner.id, attr) in {
                ("pickle", "_Pickler"),
                ("copyreg", "_reconstructor"),
            }
            own = (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (  # or an override's super()
                isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
            )
            if private and not stdlib and not own:
                bad.append(f"{path.relative_to(CKPT)}:{node.lineno} reads .{attr} of {ast.unparse(owner)}")
    assert not bad, "llmpar/checkpoint reads private attributes:\n" + "\n".join(bad)


def test_checkpoint_has_no_module_level_hook_or_registry():
    """A test hook (once ``files.FAULT_HOOK = None``) or a registry of pending saves (once ``save._PENDING =
    WeakKeyDictionary()``) at module level is state shared by every engine of the process: neither may come back."""
    registries = {"dict", "list", "set", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "defaultdict"}
    bad = []
    for path in _sources():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            v = node.value
            is_none = isinstance(v, ast.Constant) and v.value is None
            is_registry = isinstance(v, ast.Call) and getattr(v.func, "attr", getattr(v.func, "id", "")) in registries
            if is_none or is_registry:
                bad.append(f"{path.relative_to(CKPT)}:{node.lineno} {ast.unparse(node)}")
        bad += [
            f"{path.relative_to(CKPT)}:{n.lineno} global {', '.join(n.names)}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Global)
        ]
    assert not bad, "module-level state in llmpar/checkpoint:\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------------------- a fake
class Tiny(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(3, 4, generator=g))
        self.b = nn.Parameter(torch.randn(5, generator=g))
        self.f = nn.Parameter(torch.randn(2, generator=g), requires_grad=False)  # frozen: saved as an extra
        self.register_buffer("running", torch.randn(2, generator=g))


class FakeOptimizer:
    """One flat "buffer" of two units (w, b), one state (``exp_avg``), no sharding: nothing of ZeRO."""

    def __init__(self, model: Tiny, seed: int) -> None:
        g = torch.Generator().manual_seed(100 + seed)
        self.named = [("opt.w", model.w), ("opt.b", model.b)]
        self.exp_avg = {n: torch.randn(p.shape, generator=g) for n, p in self.named}
        self.step_count = float(seed)
        self.stage, self.dp, self.skipped_steps, self.last_grad_norm = 1, 1, seed, float(seed) / 2
        self.param_groups = [{"lr": 0.1 * seed, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}]
        self.calls: list[str] = []

    def _offsets(self) -> list[tuple[str, torch.Tensor, int]]:
        out, at = [], 0
        for n, p in self.named:
            out.append((n, p, at))
            at += p.numel()
        return out

    def checkpoint_facts(self) -> dict[str, bool | int]:
        return {"offload_optimizer": False, "offload_param": False, "reduce_bucket_size": 17}

    def checkpoint_device(self) -> torch.device:
        return torch.device("cpu")

    def checkpoint_layout(self) -> list[dict]:
        units = [
            {"params": [i], "numel": p.numel(), "padded": p.numel(), "offset": at, "shard_offset": at}
            for i, (_, p, at) in enumerate(self._offsets())
        ]
        params = [
            {"name": n, "shape": list(p.shape), "unit": i, "offset": 0} for i, (n, p, _) in enumerate(self._offsets())
        ]
        return [
            {
                "mode": "fake",
                "units": units,
                "params": params,
                "state_keys": ["params", "exp_avg"],
                "steps": [self.step_count] * len(units),
            }
        ]

    def checkpoint_params(self) -> list[list[tuple[str, torch.Tensor]]]:
        return [list(self.named)]

    def checkpoint_shards(self) -> list[dict[str, torch.Tensor]] | None:
        return [
            {
                "params": torch.cat([p.detach().reshape(-1) for _, p in self.named]),
                "exp_avg": torch.cat([self.exp_avg[n].reshape(-1) for n, _ in self.named]),
                "steps": torch.full((len(self.named),), self.step_count),
            }
        ]

    def checkpoint_held(self) -> list[list[tuple[str, int, int, int]]]:
        return [[(n, 0, p.numel(), at) for n, p, at in self._offsets()]]

    def checkpoint_reads(self) -> list[tuple[str, int, int]]:
        return [(n, 0, p.numel()) for n, p in self.named]

    def checkpoint_required(self) -> list[list[str]]:
        return [["params", "exp_avg"]]

    @torch.no_grad()
    def load_pieces(self, get, step, keep=frozenset()) -> None:
        for n, p in self.named:
            if n in keep:  # not in the checkpoint (strict=False): kept
                continue
            p.copy_(get(n, "params", 0, p.numel()).view(p.shape))
            self.exp_avg[n] = get(n, "exp_avg", 0, p.numel()).view(p.shape).clone()
            self.step_count = step(n)

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def gather_frozen(self) -> dict[str, torch.Tensor]:
        return {}

    def load_frozen(self, tensors: dict[str, torch.Tensor]) -> None:
        raise AssertionError("no frozen params are sharded here")

    def prepare_save(self) -> None:
        self.calls.append("prepare_save")

    def after_load(self) -> None:
        self.calls.append("after_load")


class FakeEngine:
    """The engine side on one process: an empty grid (no collectives), optimizer names ``opt.*`` saved as ``*``."""

    def __init__(self, seed: int) -> None:
        self.module = Tiny(seed)
        self.optimizer = FakeOptimizer(self.module, seed)
        self.lr_scheduler = None
        self.micro_steps, self.global_steps, self.global_samples = 10 * seed, seed, 4 * seed
        self.checkpoint_pending = None

    def checkpoint_grid(self) -> Grid:
        return Grid(groups=[], dp_rank=0, dp=1, tp_rank=0, tp=1, pp_rank=0, pp=1, device=torch.device("cpu"))

    def checkpoint_names(self) -> dict[str, str]:
        return {"opt.w": "w", "opt.b": "b"}

    def checkpoint_targets(self) -> dict[str, tuple[torch.Tensor, bool]]:
        out = {n: (t, True) for n, t in self.module.named_parameters()}
        return {**out, **{n: (t, False) for n, t in self.module.named_buffers()}}

    def checkpoint_duplicates(self) -> set[str]:
        return set()

    def checkpoint_modules(self) -> list[nn.Module]:
        return [self.module]

    def checkpoint_counters(self) -> dict[str, int]:
        return {
            "micro_steps": self.micro_steps,
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
        }

    def restore_counters(self, counters: dict[str, int]) -> None:
        self.micro_steps, self.global_steps = counters["micro_steps"], counters["global_steps"]
        self.global_samples = counters["global_samples"]


def _same(a: FakeEngine, b: FakeEngine) -> None:
    for (n, t), (_, u) in zip(a.module.state_dict().items(), b.module.state_dict().items()):
        assert torch.equal(t, u), n
    for n in a.optimizer.exp_avg:
        assert torch.equal(a.optimizer.exp_avg[n], b.optimizer.exp_avg[n]), n
    assert a.optimizer.step_count == b.optimizer.step_count
    assert a.checkpoint_counters() == b.checkpoint_counters()
    assert a.optimizer.param_groups == b.optimizer.param_groups
    assert (a.optimizer.skipped_steps, a.optimizer.last_grad_norm) == (
        b.optimizer.skipped_steps,
        b.optimizer.last_grad_norm,
    )


def test_fakes_implement_the_protocols():
    engine = FakeEngine(1)
    assert isinstance(engine, Checkpointable) and isinstance(engine.optimizer, CheckpointOptimizer)


def test_fake_engine_roundtrips_through_save_and_load(tmp_path):
    src, dst = FakeEngine(3), FakeEngine(5)
    path = save_checkpoint(src, tmp_path, client_state={"pos": 7})
    assert src.optimizer.calls == ["prepare_save"]
    meta = json.loads((tmp_path / "global_step3" / "metadata.json").read_text())
    assert sorted(s["name"] for b in meta["layout"]["buffers"] for s in b["params"]) == ["b", "w"]  # saved names
    assert meta["reduce_bucket_size"] == 17 and meta["engine"]["global_samples"] == 12
    got, client = load_checkpoint(dst, tmp_path)
    assert got == path and client == {"pos": 7} and dst.optimizer.calls == ["after_load"]
    _same(src, dst)
    full = consolidated_state_dict(path)
    assert sorted(full) == ["b", "f", "running", "w"]
    assert torch.equal(full["w"], src.module.w) and torch.equal(full["f"], src.module.f)


def test_fake_engine_async_save_is_the_engines_own(tmp_path):
    src, other, release = FakeEngine(2), FakeEngine(4), threading.Event()
    held = []

    def hook(point: str) -> None:
        held.append(point)
        if point == "before_write":
            assert release.wait(30)

    path = save_checkpoint(src, tmp_path, async_save=True, fault_hook=hook)
    saved_w = src.module.w.detach().clone()
    assert pending(src) is not None and pending(other) is None and not (tmp_path / "latest").exists()
    with torch.no_grad():
        src.module.w.add_(1.0)  # the snapshot was taken: this is not in the checkpoint
    release.set()
    assert wait_checkpoint(src) == path and pending(src) is None and wait_checkpoint(src) is None
    assert held == ["before_write", "shard_written", "before_publish", "before_latest"]
    load_checkpoint(other, tmp_path)
    assert torch.equal(other.module.w, saved_w) and not torch.equal(other.module.w, src.module.w)


@pytest.mark.parametrize("point", ["before_write", "shard_written", "before_publish", "before_latest"])
def test_fault_hook_is_per_call(point, tmp_path):
    engine = FakeEngine(1)
    save_checkpoint(engine, tmp_path, tag="good")

    def crash(where: str) -> None:
        if where == point:
            raise OSError(f"simulated crash at {where}")

    with pytest.raises(CheckpointError, match="simulated crash"):
        save_checkpoint(engine, tmp_path, tag="bad", fault_hook=crash)
    assert (tmp_path / "latest").read_text().strip() == "good"
    if point != "before_latest":  # the failed save deleted its .tmp-bad (a crash after the rename left "bad" whole)
        assert sorted(os.listdir(tmp_path)) == ["good", "latest"]
    save_checkpoint(engine, tmp_path, tag="next")  # no hook left behind anywhere
    assert (tmp_path / "latest").read_text().strip() == "next"


# ---------------------------------------------------------------------------------------------------- real sides
def _methods(proto: type) -> list[str]:
    return sorted(n for n, v in vars(proto).items() if callable(v) and not n.startswith("_"))


def test_zero_and_engines_implement_the_protocols():
    from llmpar.runtime import Engine, PipelineEngine
    from llmpar.zero.checkpointing import ZeroCheckpointing
    from llmpar.zero.optimizer import ZeroOptimizer

    assert issubclass(ZeroOptimizer, ZeroCheckpointing), "ZeroOptimizer must derive from ZeroCheckpointing"
    assert [m for m in _methods(CheckpointOptimizer) if not callable(getattr(ZeroOptimizer, m, None))] == []
    for cls in (Engine, PipelineEngine):
        assert [m for m in _methods(Checkpointable) if not callable(getattr(cls, m, None))] == [], cls
        assert "checkpoint_grid" in vars(cls), f"{cls.__name__} must say where it sits"
    from llmpar.checkpoint.formats import source
    from llmpar.checkpoint.formats.dcp.format import DcpCheckpoint
    from llmpar.checkpoint.formats.deepspeed.pipeline import DeepSpeedPipelineCheckpoint
    from llmpar.checkpoint.formats.deepspeed.rank import RankCheckpoint
    from llmpar.checkpoint.formats.deepspeed.tensor_parallel import DeepSpeedTPCheckpoint
    from llmpar.checkpoint.formats.llmpar import LlmparCheckpoint
    from llmpar.checkpoint.formats.universal.read import UniversalCheckpoint

    readers = (LlmparCheckpoint, RankCheckpoint, DeepSpeedPipelineCheckpoint, DeepSpeedTPCheckpoint)
    for cls in (*readers, UniversalCheckpoint, DcpCheckpoint):
        lacking = [m for m in _methods(source.Source) if not callable(getattr(cls, m, None))]
        assert lacking == [] and isinstance(getattr(cls, "format", None), str), (cls, lacking)
    assert {cls.format for cls in (LlmparCheckpoint, RankCheckpoint, UniversalCheckpoint, DcpCheckpoint)} == set(
        source.FORMATS
    )
