"""DeepSpeed's checkpoint files on disk: recognising its layout, resolving a tag, and unpickling a file without
DeepSpeed (``deepspeed_read.py`` reads what they hold).

DeepSpeed's own pickled classes (its loss scaler, ``ZeroStageEnum``, ``fragment_address``) are read as
:class:`Foreign` stand-ins, so DeepSpeed need not be installed; every other object unpickles as ``torch.load(...,
weights_only=False)`` does (as DeepSpeed itself loads them): load only checkpoints you trust. Files are
memory-mapped.
"""

from __future__ import annotations

import os
import pickle
import re
import types
from typing import Any

import torch

from llmpar.checkpoint.files import METADATA, CheckpointError
from llmpar.checkpoint.tags import tagged_dir

MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# a pipeline layer file: layer index, then the model-parallel (tensor) rank when the topology has a "model" axis
LAYER_RE = re.compile(r"^layer_(\d+)-(?:model_(\d+)-)?model_states\.pt$")


class Foreign:
    """A DeepSpeed object in a checkpoint, read without DeepSpeed: its class name, constructor ``args`` and pickled
    ``state`` (``__dict__``)."""

    qualname = "?"

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


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="llmpar_ds_pickle")


def load_file(path: str) -> Any:
    """One DeepSpeed checkpoint file, memory-mapped; a ``CheckpointError`` naming it when it cannot be read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True, pickle_module=_PICKLE)
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


__all__ = ["LAYER_RE", "MODEL_RE", "OPTIM_RE", "Foreign", "detect", "identity", "load_file", "loss_scaler", "resolve"]
