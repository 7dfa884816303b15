"""DeepSpeed's checkpoint files on disk: their names and layout, recognising a directory of them, resolving a tag,
finding one model-parallel rank's files, unpickling a file without DeepSpeed, and pickling DeepSpeed's classes by
name when writing its layout (``write.py``, ``universal/write.py``).

DeepSpeed 0.19's layout of one model-parallel rank (``rank.py`` reads it; ``pipeline.py`` and
``tensor_parallel.py`` the files of several):

    DIR/latest                         the tag, no newline
    DIR/TAG/mp_rank_00_model_states.pt stages 0-2: "module" (weights in the model's dtype, buffers named by
                                       "buffer_names"), "optimizer" (stage 0: the torch optimizer's state dict, params
                                       by index; bf16: {"fp32_groups", "optimizer_state_dict"}; else None),
                                       "param_shapes" [per group {name: shape}], "frozen_param_shapes" /
                                       "frozen_param_fragments", "shared_params" {tied name: source}, "lr_scheduler",
                                       "global_steps", "global_samples", "skipped_steps", "dp_world_size", "ds_config",
                                       ..., and the keys of the caller's client_state
    DIR/TAG/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: the same, one per dp rank R ("module" empty,
                                       "frozen_param_fragments" R's chunks)
    DIR/TAG/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   stages 1-3, one per dp rank R:
        "optimizer_state_dict": {"zero_stage", "partition_count", "loss_scaler", ...,
            stages 1-2: "single_partition_of_fp32_groups" [g] (R's partition less its end padding),
                        "base_optimizer_state" (torch's state dict, state[g] = {step, exp_avg, exp_avg_sq} over the
                        padded partition; an elastic checkpoint: a list of per-group states),
                        "param_alignment_paddings" [g][i]
            stage 3:    "fp32_flat_groups" [sub group], "optimizer_state_dict" (state[sub group])}

Flat order. Stages 1-2: group g's params in ``param_shapes[g]`` order, param i followed by
``param_alignment_paddings[g][i]`` elements, the group padded at its end and cut into dp partitions of P elements:
element e of a param at offset o is element ``(o + e) % P`` of rank ``(o + e) // P``'s partition. Stage 3: each
param alone is cut into dp chunks of ``c = ceil(numel / dp)`` (the last one padded); rank R's flat (its sub groups
in turn) holds its chunk of every param in ``param_shapes`` order: element e is at rank ``e // c``, position
``offset + e % c``.

BF16_Optimizer (bf16 without ZeRO, or pipelines) writes "single_partition_of_fp32_groups", "base_optimizer_state",
"group_paddings" (end padding only) and no "zero_stage": read as ZeRO-1 (``kind`` says which). fp16 without ZeRO
(FP16_Optimizer): "fp32_groups_flat" and its optimizer's flat state in the model states file, read as ZeRO-1 at dp=1.

DeepSpeed's own pickled classes (its loss scaler, ``ZeroStageEnum``, ``fragment_address``) are read as
:class:`Foreign` stand-ins, so DeepSpeed need not be installed; every other object unpickles as ``torch.load(...,
weights_only=False)`` does (as DeepSpeed itself loads them): load only checkpoints you trust. Files are
memory-mapped. Written, they are pickled by name (:class:`_Global`) without importing DeepSpeed, streamed into a
``.part`` file, fsynced and renamed (:func:`save_pickled`).
"""

from __future__ import annotations

import copyreg
import os
import pickle
import re
import types
from typing import Any, NamedTuple

import torch

from llmpar.checkpoint.files import METADATA, CheckpointError
from llmpar.checkpoint.tags import tagged_dir

MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# a pipeline layer file: layer index, then the model-parallel (tensor) rank when the topology has a "model" axis
LAYER_RE = re.compile(r"^layer_(\d+)-(?:model_(\d+)-)?model_states\.pt$")
DS_VERSION = "0.19.8"  # the version the files llmpar writes say they come from
_ADAMW = {  # torch AdamW's flags, beside the hyper-parameters of each param group
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
MOMENTS = ("exp_avg", "exp_avg_sq")
# model_states keys DeepSpeed writes itself; the others are the caller's client_state
DS_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        "autoep_layers",
        "ds_autoep_layers",
    }
)


def scalar(v: Any) -> float:
    """A step count or scale saved as a number or a 0-d tensor, as a float."""
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def flat_slice(parts: list[torch.Tensor], a: int, z: int) -> torch.Tensor:
    """Elements [a, z) of the concatenation of the flat tensors ``parts``, copying only those."""
    out, at = [], 0
    for p in parts:
        n = p.numel()
        if a < at + n and z > at:
            out.append(p.reshape(-1)[max(a - at, 0) : min(z - at, n)])
        at += n
    if sum(t.numel() for t in out) != z - a:
        raise CheckpointError(f"elements [{a}, {z}) lie beyond the {at} elements saved")
    return out[0] if len(out) == 1 else torch.cat(out)


class Foreign:
    """A DeepSpeed object in a checkpoint, read without DeepSpeed: its class name, constructor ``args`` and pickled
    ``state`` (``__dict__``)."""

    qualname = "?"
    args: tuple[Any, ...]
    state: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> "Foreign":
        obj = object.__new__(cls)
        obj.args, obj.state = args, {}
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state if isinstance(state, dict) else {"state": state}

    def __repr__(self) -> str:
        return f"<{self.qualname} args={self.args} state={self.state}>"


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            return type(name, (Foreign,), {"qualname": f"{module}.{name}"})
        return super().find_class(module, name)


_READ_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="llmpar_ds_pickle")


def load_file(path: str) -> Any:
    """One DeepSpeed checkpoint file, memory-mapped; a ``CheckpointError`` naming it when it cannot be read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True, pickle_module=_READ_PICKLE)
    except FileNotFoundError as e:
        raise CheckpointError(f"DeepSpeed checkpoint file {path} is missing") from e
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: named
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: {e!r}") from e


def detect(path: str) -> list[str]:
    """The DeepSpeed files of directory ``path`` when it has no ``metadata.json`` ([] otherwise, or when none)."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, METADATA)):
        return []
    return sorted(f for f in os.listdir(path) if MODEL_RE.match(f) or OPTIM_RE.match(f) or LAYER_RE.match(f))


def resolve(load_dir: Any, tag: str | None) -> str | None:
    """``load_dir/tag`` (``tag`` None: the one ``load_dir/latest`` names) when it is a DeepSpeed checkpoint, else
    None (no such tag, or llmpar's layout: ``files.resolve`` reports it)."""
    return tagged_dir(load_dir, tag, detect)


def identity(path: str) -> str:
    """What tells one DeepSpeed checkpoint from another: its tag (the directory's name) and each file's name, size
    and mtime (not the path: ranks may mount the same directory at different places)."""
    parts = [os.path.basename(os.path.normpath(path))]
    for f in detect(path):
        st = os.stat(os.path.join(path, f))
        parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    return "deepspeed:" + "|".join(parts)


def loss_scaler(st: dict[str, Any]) -> dict[str, Any]:
    """The engine's loss-scaler counters from the state of DeepSpeed's scaler (``cur_scale`` in it)."""
    last = st.get("last_overflow_iter")
    return {
        "cur_scale": float(st["cur_scale"]),
        "cur_iter": int(st.get("cur_iter", 0)),
        "last_overflow_iter": int(last) if last is not None else -1,
        "cur_hysteresis": int(st.get("cur_hysteresis", 1)),
        "dynamic": bool(st.get("dynamic", False)),
    }


class MpFiles(NamedTuple):
    """The files of model-parallel rank ``mp_rank`` in a DeepSpeed checkpoint directory."""

    mp_rank: int
    optim: dict[int, str]  # dp rank -> its optimizer file
    zero_models: list[int]  # the dp ranks with a ZeRO-3 model states file of their own
    model_file: str  # the model states file read (stage 3: dp rank 0's)


def model_parallel_ranks(found: list[str]) -> list[int]:
    """The model-parallel ranks of DeepSpeed files ``found`` (layer files left out)."""
    return sorted(
        {
            int((MODEL_RE.match(f) or OPTIM_RE.match(f)).groups()[-1])  # type: ignore[union-attr]
            for f in found
            if not LAYER_RE.match(f)
        }
    )


def mp_files(path: str, mp_rank: int | None) -> MpFiles:
    """The files of model-parallel rank ``mp_rank`` of directory ``path``; ``mp_rank`` None: the directory must hold
    mp_rank_00's alone (a CheckpointError naming the ranks found otherwise)."""
    found = detect(path)
    if mp_rank is None:
        mp = model_parallel_ranks(found)
        if mp != [0]:
            raise CheckpointError(
                f"{path} holds DeepSpeed files of model-parallel ranks {mp} ({found[:4]}): "
                "only mp_rank_00 (model-parallel degree 1) and pipeline (layer_*) "
                "checkpoints are read"
            )
        mp_rank = 0
    found = [
        f
        for f in found
        if not LAYER_RE.match(f) and int((MODEL_RE.match(f) or OPTIM_RE.match(f)).groups()[-1]) == mp_rank  # type: ignore[union-attr]
    ]
    mp_name = f"mp_rank_{mp_rank:02d}"
    optim = {int(m.group(2)): f for f in found if (m := OPTIM_RE.match(f))}
    zero_models = sorted(int(m.group(1)) for f in found if (m := MODEL_RE.match(f)) and m.group(1) is not None)
    model_file = (
        f"{mp_name}_model_states.pt"
        if f"{mp_name}_model_states.pt" in found
        else (f"zero_pp_rank_{zero_models[0]}_{mp_name}_model_states.pt" if zero_models else None)
    )
    if model_file is None:
        raise CheckpointError(
            f"{path} has DeepSpeed optimizer files {found[:4]} but no model states file "
            f"({mp_name}_model_states.pt or zero_pp_rank_0_{mp_name}_model_states.pt)"
        )
    return MpFiles(mp_rank, optim, zero_models, model_file)


# ---------------------------------------------------------------------- writing: DeepSpeed's classes by name
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
            # typeshed's pickle._Pickler declares neither write (set from the file in __init__) nor save
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())  # type: ignore[attr-defined]
            return
        super().save(obj, save_persistent_id)  # type: ignore[misc]


_WRITE_PICKLE = types.SimpleNamespace(Pickler=_Pickler, dump=pickle.dump, __name__="llmpar_ds_pickle")


class _Recording:
    """A binary file keeping its writes' first ``OSError``: ``torch.save`` reports a failed write (a full disk) as a
    ``RuntimeError`` ("unexpected pos ...") naming neither the file nor the cause."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def _written(path: str, write: Any) -> None:
    """``write(f)`` into ``path + ".part"``, fsynced, renamed to ``path``. A failure removes the ``.part`` file and
    raises an ``OSError`` with the cause (``errno``, ``strerror``) and ``filename`` ``path``."""
    tmp, rec = path + ".part", None
    try:
        with open(tmp, "wb") as f:
            rec = _Recording(f)
            write(rec)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        cause = rec.error if rec is not None and rec.error is not None else e
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror or str(cause), path) from e
        raise


def save_pickled(obj: Any, path: str) -> None:
    """``torch.save`` of ``obj`` to ``path``, DeepSpeed's classes by name: streamed into a ``.part`` file (no copy of
    the bytes in memory), fsynced, renamed; a failed write (a full disk) raises an ``OSError`` naming ``path`` and
    the cause, its ``.part`` removed."""
    _written(path, lambda f: torch.save(obj, f, pickle_module=_WRITE_PICKLE))


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and alone in its storage (``torch.save`` writes a view's whole storage: a slice of a
    memory-mapped partition would write the partition)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def write_bytes(path: str, data: bytes) -> None:
    """``data`` into ``path``: a ``.part`` file, fsynced, renamed (a failure: as :func:`save_pickled`)."""
    _written(path, lambda f: f.write(data))


def static_loss_scaler() -> _Object:
    """DeepSpeed's static fp32 ``LossScaler`` (scale 1), as a ZeRO optimizer of an fp32 run saves it."""
    return _Object("deepspeed.runtime.fp16.loss_scaler", "LossScaler", {"cur_scale": 1.0, "dynamic": False})


def fragment_address(numel: int, start: int) -> _Object:
    """DeepSpeed's ``fragment_address`` of a param's ``numel`` elements at ``start`` in a rank's partition."""
    return _Object("deepspeed.utils.tensor_fragment", "fragment_address", {"numel": numel, "start": start})


def zero_stage(stage: int) -> _Enum:
    """DeepSpeed's ``ZeroStageEnum`` member of ``stage``."""
    return _Enum("deepspeed.runtime.zero.config", "ZeroStageEnum", stage)


def torch_groups(hyper: list[dict]) -> list[dict]:
    """torch AdamW's ``param_groups`` as its ``state_dict`` holds them: group g's hyper-parameters, its defaults
    (``amsgrad`` ...), ``params`` [g] (DeepSpeed's optimizers hold one flat tensor per group)."""
    return [{**_ADAMW, **h, "betas": tuple(h["betas"]), "params": [g]} for g, h in enumerate(hyper)]


__all__ = [
    "DS_KEYS",
    "DS_VERSION",
    "LAYER_RE",
    "MODEL_RE",
    "MOMENTS",
    "OPTIM_RE",
    "Foreign",
    "MpFiles",
    "detect",
    "flat_slice",
    "fragment_address",
    "identity",
    "load_file",
    "loss_scaler",
    "model_parallel_ranks",
    "mp_files",
    "owned",
    "resolve",
    "save_pickled",
    "scalar",
    "static_loss_scaler",
    "torch_groups",
    "write_bytes",
    "zero_stage",
]
