"""``llmpar checkpoint convert SRC DST --to deepspeed``: a checkpoint (llmpar's or DeepSpeed's) written in DeepSpeed
0.19's ZeRO layout (``deepspeed_read.py`` describes it), so that ``DeepSpeedEngine.load_checkpoint(DST)`` on the same
model and config resumes from it.

    DST/latest                                     the tag (the source's: ``global_stepN``)
    DST/TAG/mp_rank_00_model_states.pt             stages 1-2: "module" (every param whole, fp32, from the
                                                   masters; buffers), "param_shapes" [per group {name: shape}],
                                                   "frozen_param_shapes" / "frozen_param_fragments", "buffer_names",
                                                   "lr_scheduler", "global_steps", "global_samples", "skipped_steps",
                                                   "dp_world_size", "mp_world_size", "ds_config" ({} unless the
                                                   source had one), "ds_version", and the source's client_state keys
    DST/TAG/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: the same per dp rank R, "module" with empty
                                                   tensors for the params (as DeepSpeed writes it), R's chunks of
                                                   the frozen params
    DST/TAG/zero_pp_rank_R_mp_rank_00_optim_states.pt   per dp rank R: {"optimizer_state_dict": ...}
        stages 1-2: group g flat in param_shapes order (no per-param alignment padding:
                    ``param_alignment_paddings`` all 0, DeepSpeed's default), padded at its end to a multiple of 2 x dp
                    (``nccl_start_alignment_factor``) and cut into dp partitions of P elements;
                    "single_partition_of_fp32_groups" (R's partition less its end padding), "base_optimizer_state"
                    (torch AdamW's state dict: state[g] = {step, exp_avg, exp_avg_sq} over the padded partition),
                    "group_paddings", "param_alignment_paddings", "partition_count", "param_slice_mappings",
                    "zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "ds_version", "clip_grad" (a
                    DeepSpeed source's gradient_clipping; left out for an llmpar source: the engine keeps its own)
        stage 3:    each param alone cut into dp chunks of ceil(numel / dp) (the last padded with zeros), R's flat
                    of group g = its chunks in turn; "fp32_flat_groups", "optimizer_state_dict" (state[g] over R's
                    flat), "zero_stage", "partition_count", "loss_scaler", "dynamic_loss_scale", "overflow"

DeepSpeed's own classes (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``) are pickled by name without
importing DeepSpeed. Refused (a ``CheckpointError`` / ``ValueError`` naming what was found): a source whose groups
have different step counts, an llmpar source of several param groups (which param is in which is not recorded), an
llmpar source with buffers or frozen params converted to stage 3 (the checkpoint does not tell them apart), stage 0
or > 3, dp < 1, an llmpar pipeline (pp > 1) source and DeepSpeed pipeline / model-parallel ones (``deepspeed_read``).
A tensor-parallel llmpar source is merged (``CheckpointReader.full``: params named and shaped as in the unsplit model,
vocabulary padding dropped), so the output is model-parallel degree 1. Params are written in the order the source
lists them (DeepSpeed's param_shapes; llmpar's layout, the model's order): DeepSpeed's ZeRO 1-2 flat groups follow
the model's parameter order, so a model whose order differs would load other values. After writing, every file is
read back with ``deepspeed_read.DeepSpeedCheckpoint`` and every param's master and moments compared bitwise with the
source. Memory: each rank's optimizer file is built from pieces of the params it overlaps (``Source.piece``: a
range of the memory-mapped source; an llmpar source reads one whole param at a time), written streamed into its file
and dropped before the next; the stage 1-2 model states file holds every param whole, as DeepSpeed's does; the check
reads back one param at a time. Peak: one output file + about two copies of the largest tensor.
A universal checkpoint (``universal_read``) is a source too (``--from universal``, or detected).
"""
from __future__ import annotations

import copyreg
import math
import os
import pickle
import types
from typing import Any

import torch

from llmpar.checkpoint import ds_convert, files, metacheck, universal_read
from llmpar.checkpoint.deepspeed_read import DeepSpeedCheckpoint
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.reshard import CheckpointReader
from llmpar.checkpoint.universal_read import UniversalCheckpoint

DS_VERSION = "0.19.8"
KEYS = ("master", "exp_avg", "exp_avg_sq")
_ADAMW = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
          "fused": None, "decoupled_weight_decay": True}


# ---------------------------------------------------------------------- DeepSpeed's classes, by name
class _Global:
    """A class named by module and name, pickled as a GLOBAL without importing it."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # pickle asks a reduce function to be callable; never called here
        raise TypeError(f"{self.module}.{self.name} is a name for pickling only")


class _Object:
    """An instance of DeepSpeed class ``module.name`` with ``__dict__`` ``state``."""

    def __init__(self, module: str, name: str, state: dict) -> None:
        self.cls, self.state = _Global(module, name), state

    def __reduce__(self) -> Any:
        return copyreg._reconstructor, (self.cls, object, None), self.state  # type: ignore[attr-defined]


class _Enum:
    def __init__(self, module: str, name: str, value: int) -> None:
        self.cls, self.value = _Global(module, name), value

    def __reduce__(self) -> Any:
        return self.cls, (self.value,)


class _Pickler(pickle._Pickler):  # type: ignore[name-defined, misc]
    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, _Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            return
        super().save(obj, save_persistent_id)


_PICKLE = types.SimpleNamespace(Pickler=_Pickler, dump=pickle.dump, __name__="llmpar_ds_pickle")


def save_pickled(obj: Any, path: str) -> None:
    """``torch.save`` of ``obj`` to ``path``, DeepSpeed's classes by name: streamed into a ``.part`` file (no copy of
    the bytes in memory), fsynced, renamed."""
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        torch.save(obj, f, pickle_module=_PICKLE)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and alone in its storage (``torch.save`` writes a view's whole storage: a slice of a
    memory-mapped partition would write the partition)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def write_bytes(path: str, data: bytes) -> None:
    """``data`` into ``path``: a ``.part`` file, fsynced, renamed."""
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def loss_scaler() -> _Object:
    """DeepSpeed's static fp32 ``LossScaler`` (scale 1), as a ZeRO optimizer of an fp32 run saves it."""
    return _Object("deepspeed.runtime.fp16.loss_scaler", "LossScaler", {"cur_scale": 1.0, "dynamic": False})


def zero_stage(stage: int) -> _Enum:
    """DeepSpeed's ``ZeroStageEnum`` member of ``stage``."""
    return _Enum("deepspeed.runtime.zero.config", "ZeroStageEnum", stage)


def clip_grad(s: "Source") -> dict:
    """{"clip_grad": the source's gradient clipping} when it recorded one (a DeepSpeed source's ds_config), else {}:
    a ZeRO 1-2 load then keeps the engine's own (DeepSpeed takes a saved 0.0 as clipping off)."""
    clip = s.ds_config.get("gradient_clipping")
    return {} if clip is None else {"clip_grad": float(clip)}


def torch_groups(hyper: list[dict]) -> list[dict]:
    """torch AdamW's ``param_groups`` as its ``state_dict`` holds them: group g's hyper-parameters, its defaults
    (``amsgrad`` ...), ``params`` [g] (DeepSpeed's optimizers hold one flat tensor per group)."""
    return [{**_ADAMW, **h, "betas": tuple(h["betas"]), "params": [g]} for g, h in enumerate(hyper)]


# ---------------------------------------------------------------------- sources
class Source:
    """What the writer needs of a checkpoint: ``groups`` [[name]], ``shapes``, ``hyper`` [per group {lr, betas,
    eps, weight_decay}], :meth:`full`, ``step``, ``extras`` (buffers), ``frozen``, ``run`` (counters, scheduler,
    client_state, ds_config)."""

    groups: list[list[str]]
    shapes: dict[str, tuple[int, ...]]
    hyper: list[dict]
    step: float
    buffers: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]
    counters: dict[str, Any]
    scheduler: Any
    client: dict
    ds_config: dict
    stage: int
    dp: int

    def full(self, name: str, key: str) -> torch.Tensor:
        raise NotImplementedError

    def piece(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        """Elements ``[a, z)`` of :meth:`full`'s flat view (a source reads only those when it can)."""
        return self.full(name, key).reshape(-1)[a:z]


class _DeepSpeedSource(Source):
    def __init__(self, path: str) -> None:
        ck = self.ck = DeepSpeedCheckpoint(path)
        shapes = ck.model.get("param_shapes") if ck.stage > 0 else [dict.fromkeys(ck.names)]
        self.groups = [list(g) for g in shapes]
        self.shapes = dict(ck.shapes)
        self.hyper = ck.param_groups()
        if len(self.hyper) != len(self.groups):
            raise CheckpointError(f"{path}: {len(self.groups)} param groups by param_shapes, {len(self.hyper)} "
                                  "in the optimizer state: cannot be written")
        steps = {ck.step(g[0]) for g in self.groups if g}
        self.step = _one_step(steps, path)
        self.buffers, self.frozen = ck.buffers(), ck.frozen()
        self.counters, self.scheduler, self.client = ck.counters(), ck.scheduler(), ck.client_state()
        self.ds_config = dict(ck.model.get("ds_config") or {})
        self.stage, self.dp = max(ck.stage, 1), ck.dp

    def full(self, name: str, key: str) -> torch.Tensor:
        if key == "master" and not self.ck.has(name, "master"):
            key = "params"
        n = math.prod(self.shapes[name])
        return self.ck.read(name, key, 0, n).to(torch.float32)

    def piece(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        if key == "master" and not self.ck.has(name, "master"):
            key = "params"
        return self.ck.read(name, key, a, z).to(torch.float32)


class _UniversalSource(Source):
    """A universal checkpoint (``universal_read``): every param's files opened (memory-mapped) and checked."""

    def __init__(self, path: str) -> None:
        ck = self.ck = UniversalCheckpoint(path)
        groups = ck.model.get("param_shapes")
        self.groups = [list(g) for g in groups] if isinstance(groups, list) and groups else [list(ck.names)]
        for n in ck.names:
            ck.open(n)
        self.shapes, self.aliases = dict(ck.shapes), dict(ck.aliases)
        self.hyper = ck.param_groups()
        if len(self.hyper) != len(self.groups):
            raise CheckpointError(f"{path}: {len(self.groups)} param groups by param_shapes, {len(self.hyper)} in "
                                  "zero/optimizer_state.pt: cannot be written")
        self.step = _one_step({ck.step(n) for n in ck.names}, path)
        self.buffers, self.frozen = ck.buffers(), ck.frozen()
        self.counters, self.scheduler, self.client = ck.counters(), ck.scheduler(), ck.client_state()
        self.ds_config = dict(ck.model.get("ds_config") or {})
        self.stage, self.dp = min(max(ck.stage, 1), 3), ck.dp

    def full(self, name: str, key: str) -> torch.Tensor:
        return self.piece(name, key, 0, math.prod(self.shapes[name]))

    def piece(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        if not self.ck.has(name, key):
            raise CheckpointError(f"universal checkpoint {self.ck.path} has no {key!r} of {name!r}")
        t = self.ck.read(name, key, a, z).to(torch.float32).clone()  # not a view of the mapped file
        self.ck.release(name)  # its mapped pages leave the RSS
        return t


class _LlmparSource(Source):
    def __init__(self, path: str) -> None:
        meta = metacheck.read(path)
        if int(meta.get("pp", 1)) > 1:
            raise CheckpointError(f"{path}: llmpar pipeline checkpoint (pp={meta['pp']}): DeepSpeed's ZeRO and "
                                  "universal layouts are written from pp=1 checkpoints only (load it at pp=1 and save)")
        if len(meta["param_groups"]) != 1:
            raise CheckpointError(f"{path}: llmpar checkpoint of {len(meta['param_groups'])} param groups: which "
                                  "param is in which is not recorded; only one group is written to DeepSpeed's layout")
        reader = self.reader = CheckpointReader(path, meta)
        self._last: tuple[tuple[str, str], torch.Tensor] | None = None
        for fname in sorted(meta["files"]):
            why = reader.files.check(fname, full=True)
            if why is not None:
                raise CheckpointError(f"checkpoint shard {os.path.join(path, fname)} is {why}")
        self.keys = {name: meta["layout"]["buffers"][bi]["state_keys"] for name, (bi, _, _) in reader.where.items()}
        names = list(reader.where)
        self.groups, self.shapes = [names], {n: reader.full_shape(n) for n in names}
        self.hyper = [dict(meta["param_groups"][0], betas=tuple(meta["param_groups"][0]["betas"]))]
        self.step = _one_step({reader.step(n) for n in names}, path)
        self.buffers, self.frozen = reader.extras(reader.tp, 0), {}
        eng = meta["engine"]
        self.counters = {k: eng.get(k, 0) for k in ("global_steps", "global_samples", "skipped_steps")}
        self.scheduler, self.ds_config = meta["scheduler"], {}
        self.client = files.load_file(os.path.join(path, files.CLIENT_STATE), mmap=False) \
            if files.CLIENT_STATE in meta["files"] else {}
        self.stage, self.dp = min(max(int(meta["stage"]), 1), 3), int(meta["dp"])

    def full(self, name: str, key: str) -> torch.Tensor:
        if key == "master" and key not in self.keys[name]:
            key = "params"
        if key not in self.keys[name]:
            raise CheckpointError(f"param {name!r} has no {key!r} in the llmpar checkpoint (saved: "
                                  f"{self.keys[name]}): an optimizer without Adam moments is not written")
        if self._last is None or self._last[0] != (name, key):  # one param's whole tensor at a time
            self._last = ((name, key), self.reader.full(name, key).reshape(-1).to(torch.float32))
        return self._last[1]


def _one_step(steps: set[float], path: str) -> float:
    if len(steps) > 1:
        raise CheckpointError(f"{path}: param groups at different step counts {sorted(steps)}: DeepSpeed keeps one")
    return float(next(iter(steps), 0.0))


def locate_universal(src: str, tag: str | None, source: str) -> str | None:
    """The universal checkpoint ``src`` names (``universal_read.resolve``) when ``source`` is "auto" or
    "universal"; None otherwise; a CheckpointError naming what ``src`` holds when ``source`` is "universal" and it
    is not one."""
    if source not in ("auto", "universal"):
        return None
    path = universal_read.resolve(os.fspath(src), tag)
    if path is None and source == "universal":
        where = os.path.join(os.fspath(src), tag) if tag is not None else os.fspath(src)
        found = sorted(os.listdir(where))[:8] if os.path.isdir(where) else "nothing (no such directory)"
        raise CheckpointError(f"{where} is not a universal checkpoint (no zero/ folder beside a model states file, "
                              f"and no latest_universal naming one): it holds {found}")
    return path


def open_source(src: str, tag: str | None = None, source: str = "auto") -> Source:
    """The checkpoint ``src`` (universal, llmpar's or DeepSpeed's: ``locate_universal``, ``ds_convert.locate``) as
    the writers read it."""
    uni = locate_universal(src, tag, source)
    if uni is not None:
        return _UniversalSource(uni)
    kind, path = ds_convert.locate(src, tag, source)
    return _DeepSpeedSource(path) if kind == "deepspeed" else _LlmparSource(path)


# ---------------------------------------------------------------------- the writer
def _check_args(stage: Any, dp: Any) -> None:
    if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool) or stage not in (1, 2, 3)):
        raise ValueError(f"stage={stage!r}: DeepSpeed's ZeRO layout is written for stages 1, 2 or 3")
    if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool) or dp < 1):
        raise ValueError(f"dp={dp!r}: the data-parallel degree to write for is an int >= 1")


def write_deepspeed(src: str, out_dir: str, *, stage: int | None = None, dp: int | None = None,
                    tag: str | None = None, source: str = "auto") -> list[str]:
    """Write checkpoint ``src`` to ``out_dir`` in DeepSpeed's ZeRO-``stage`` layout for ``dp`` ranks (defaults: the
    source's; its stage 0 becomes 1), verify it (module docstring) and return the paths written."""
    _check_args(stage, dp)
    s = open_source(src, tag, source)
    stage, dp = stage or s.stage, dp or s.dp
    if stage == 3 and s.buffers and isinstance(s, _LlmparSource):
        raise CheckpointError(f"{src}: llmpar checkpoint with buffers / frozen params {sorted(s.buffers)[:8]}: "
                              "llmpar does not record which are frozen params, so they cannot be placed in a "
                              "ZeRO-3 layout; write stage 1 or 2")
    out_tag = f"global_step{int(s.counters.get('global_steps', 0))}"
    d = os.path.join(out_dir, out_tag)
    os.makedirs(d, exist_ok=True)
    written: list[str] = []
    hyper = torch_groups(s.hyper)
    for r in range(dp):
        flats, state, extra = [], {}, {}
        if stage < 3:
            pads, slices, groups_pad = [], [], []
            for g, names in enumerate(s.groups):
                total = sum(math.prod(s.shapes[n]) for n in names)
                padded = -(-total // (2 * dp)) * (2 * dp)
                part = padded // dp
                lo, hi = r * part, (r + 1) * part
                cut = {k: _partition(s, names, k, lo, hi) for k in KEYS}
                keep = max(0, min(hi, total) - lo)
                flats.append(cut["master"][:keep].clone())
                state[g] = {"step": torch.tensor(s.step), "exp_avg": cut["exp_avg"], "exp_avg_sq": cut["exp_avg_sq"]}
                pads.append([0] * len(names))
                groups_pad.append(part - keep)
                at, m = 0, {}
                for n in names:
                    k = math.prod(s.shapes[n])
                    a, z = max(at, lo), min(at + k, hi)
                    if a < z:
                        m[n] = _Object("deepspeed.utils.tensor_fragment", "fragment_address",
                                       {"numel": z - a, "start": a - lo})
                    at += k
                slices.append(m)
            extra = {"single_partition_of_fp32_groups": flats, "zero_stage": zero_stage(stage),
                     "group_paddings": groups_pad, "param_alignment_paddings": pads,
                     "partition_count": [dp] * len(s.groups), "param_slice_mappings": slices,
                     "ds_version": DS_VERSION, **clip_grad(s)}
            base_key = "base_optimizer_state"
        else:
            for g, names in enumerate(s.groups):
                cut = {k: _chunks(s, names, k, r, dp) for k in KEYS}
                flats.append(cut["master"])
                state[g] = {"step": torch.tensor(s.step), "exp_avg": cut["exp_avg"], "exp_avg_sq": cut["exp_avg_sq"]}
            extra = {"zero_stage": zero_stage(3), "partition_count": dp, "fp32_flat_groups": flats}
            base_key = "optimizer_state_dict"
        osd = {"loss_scaler": loss_scaler(), "dynamic_loss_scale": False, "overflow": False,
               base_key: {"state": state, "param_groups": hyper}, **extra}
        path = os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        save_pickled({"optimizer_state_dict": osd, "ds_config": s.ds_config, "ds_version": DS_VERSION}, path)
        written.append(path)
        if stage == 3 or r == 0:
            name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
            save_pickled(model_states(s, stage, dp, r), os.path.join(d, name))
            written.append(os.path.join(d, name))
    write_bytes(os.path.join(out_dir, "latest"), out_tag.encode())
    verify(s, d, stage, dp)
    return written


def _partition(s: Source, names: list[str], key: str, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the group of ``names`` flat in turn (zeros past its end), state ``key``: filled
    from the pieces of the params that overlap it, none read whole."""
    out, at = torch.zeros(hi - lo), 0
    for n in names:
        k = math.prod(s.shapes[n])
        a, z = max(at, lo), min(at + k, hi)
        if a < z:
            out[a - lo:z - lo] = s.piece(n, key, a - at, z - at)
        at += k
    return out


def _chunks(s: Source, names: list[str], key: str, r: int, dp: int) -> torch.Tensor:
    """ZeRO-3: rank ``r``'s chunk of each param of ``names`` in turn (``ceil(numel / dp)`` elements, the last
    padded with zeros), state ``key``, each read as a piece."""
    sizes = [-(-math.prod(s.shapes[n]) // dp) for n in names]
    out, at = torch.zeros(sum(sizes)), 0
    for n, c in zip(names, sizes):
        a, z = r * c, min((r + 1) * c, math.prod(s.shapes[n]))
        if a < z:
            out[at:at + z - a] = s.piece(n, key, a, z)
        at += c
    return out


def model_states(s: Source, stage: int, dp: int, r: int) -> dict:
    """The model states file of dp rank ``r`` (stages 1-2: the one file) for ZeRO-``stage`` at ``dp`` ranks."""
    module = {n: torch.empty(0) if stage == 3 else s.full(n, "master").view(s.shapes[n]).clone()
              for g in s.groups for n in g}
    frozen = {n: t.reshape(-1) for n, t in s.frozen.items()}
    if stage == 3:
        frozen = {n: torch.cat([t, t.new_zeros(-(-t.numel() // dp) * dp - t.numel())]).chunk(dp)[r].clone()
                  for n, t in frozen.items()}
    else:
        frozen = {n: t.view(s.frozen[n].shape) for n, t in frozen.items()}
        module.update(s.frozen)
    module.update(s.buffers)
    run = {"lr_scheduler": s.scheduler, "data_sampler": None, "random_ltd": None, "sparse_tensor_module_names": set(),
           "skipped_steps": int(s.counters.get("skipped_steps", 0)),
           "global_steps": int(s.counters.get("global_steps", 0)),
           "global_samples": int(s.counters.get("global_samples", 0)), "dp_world_size": dp, "mp_world_size": 1,
           "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
           "ds_config": s.ds_config, "ds_version": DS_VERSION}
    return {"module": module, "buffer_names": list(s.buffers), "optimizer": None,
            "param_shapes": [{n: torch.Size(s.shapes[n]) for n in g} for g in s.groups],
            "frozen_param_shapes": {n: t.shape for n, t in s.frozen.items()}, "shared_params": {},
            "frozen_param_fragments": frozen, **run, **s.client}


def verify(s: Source, path: str, stage: int, dp: int) -> None:
    """Read DeepSpeed checkpoint ``path`` back (``DeepSpeedCheckpoint``): its layout (stage, dp, names, shapes) and
    every param's master and moments equal the source's, bitwise; a CheckpointError naming what differs."""
    ck = DeepSpeedCheckpoint(path)
    names = [n for g in s.groups for n in g]
    if (ck.stage, ck.dp, ck.names) != (stage, dp, names):
        raise CheckpointError(f"{path} reads back as ZeRO-{ck.stage} dp={ck.dp} with params {ck.names[:4]}..., "
                              f"written as ZeRO-{stage} dp={dp} with {names[:4]}...")
    for n in names:
        for key in KEYS:
            got, want = ck.read(n, key, 0, math.prod(s.shapes[n])), s.full(n, key)
            if not torch.equal(got, want):
                raise CheckpointError(f"{path}: param {n!r} {key} read back differs from the source")
        if ck.step(n) != s.step:
            raise CheckpointError(f"{path}: param {n!r} step {ck.step(n)} read back, {s.step} in the source")
    for n, t in s.frozen.items():
        if not torch.equal(ck.frozen()[n].reshape(t.shape), t):
            raise CheckpointError(f"{path}: frozen param {n!r} read back differs from the source")


__all__ = ["open_source", "verify", "write_deepspeed"]
