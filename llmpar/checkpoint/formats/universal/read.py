"""A DeepSpeed *universal* checkpoint (DeepSpeed 0.19's ``ds_to_universal``, or llmpar's ``convert --to universal``)
read as it is, a reader of the protocol (``formats/source.py``), which ``load_checkpoint`` loads into an engine at
any dp, ZeRO stage, offload and tp (``formats/loader.py``) and ``convert`` writes in any layout:

    DIR/latest_universal                 the tag (``ds_to_universal`` writes it beside DIR/latest)
    DIR/TAG/zero/<param>/fp32.pt         the fp32 master of the whole param: ``{"param": tensor}`` in its full shape
                                         (ZeRO 1-2; tensor-parallel slices merged: ``cat_dim``, ``vocab_tensor``: the
                                         vocabulary padding stripped, ``sub_param_shape`` ...), or the bare flat
                                         tensor (``ds_to_universal`` of a ZeRO-3 checkpoint: shape in param_shapes)
    DIR/TAG/zero/<param>/exp_avg.pt, exp_avg_sq.pt   Adam's moments, the same way
    DIR/TAG/zero/<param>/step.pt         the step count (ZeRO 1-2; ZeRO-3: optimizer_state.pt's state[0]["step"])
    DIR/TAG/zero/optimizer_state.pt      global state: "param_groups", "loss_scaler", "zero_stage", ...
    DIR/TAG/mp_rank_00_model_states.pt   ZeRO 1-2 (ZeRO-3: zero_pp_rank_R_mp_rank_00_model_states.pt, one per saved
                                         dp rank): "param_shapes" (which params are trained), "shared_params",
                                         buffers ("module" / "buffer_names"), frozen params, "lr_scheduler",
                                         counters, "universal_checkpoint_info" and the caller's client_state keys

Each tensor file is memory-mapped when first needed (:meth:`UniversalCheckpoint.prepare`) and only this rank's element
ranges are read from it; a tensor-parallel param is cut from the whole tensor along llmpar's own split dim
(``loader.Pieces``), a vocabulary tensor (``vocab_tensor``) padded back with zero rows to this model's vocabulary when
that is larger, as DeepSpeed does. The trained params are those of ``param_shapes`` (the folders of ``zero/`` when
absent); ``ds_to_universal`` also writes ``fp32.pt`` folders for buffers and frozen params, which are read from the
model states instead. A load (``loader.load_source``) opens on every rank the files of its own params (a missing folder,
a truncated file or a shape that differs from this model's is a CheckpointError naming the path, raised on every rank)
before anything is modified, then masters, moments, steps, buffers, frozen params, param-group hyper-parameters,
counters, loss scaler and LR scheduler are restored and the client_state returned. Like DeepSpeed's, a universal
checkpoint holds no RNG state: this engine's are kept.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from llmpar.checkpoint import files
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.deepspeed.files import DS_KEYS, MOMENTS, Foreign, load_file, loss_scaler, scalar
from llmpar.checkpoint.tags import tagged_dir

LATEST_UNIVERSAL = "latest_universal"
ZERO = "zero"
OPTIM_STATE = "optimizer_state.pt"
MODEL_FILE = "mp_rank_00_model_states.pt"
FILE_OF = {"params": "fp32", "master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _zero3_files(path: str) -> list[str]:
    """``zero_pp_rank_R_mp_rank_00_model_states.pt`` of ``path``, by R."""
    found = []
    for f in os.listdir(path):
        if f.startswith("zero_pp_rank_") and f.endswith("_mp_rank_00_model_states.pt"):
            r = f[len("zero_pp_rank_") : -len("_mp_rank_00_model_states.pt")]
            if r.isdigit():
                found.append((int(r), f))
    return [f for _, f in sorted(found)]


def detect(path: str) -> bool:
    """Whether directory ``path`` is a universal checkpoint: a ``zero/`` folder beside DeepSpeed's model states file
    (and no llmpar ``metadata.json``)."""
    if not os.path.isdir(os.path.join(path, ZERO)) or os.path.exists(os.path.join(path, files.METADATA)):
        return False
    return os.path.isfile(os.path.join(path, MODEL_FILE)) or bool(_zero3_files(path))


def latest_tag(load_dir: str) -> str | None:
    """The tag ``load_dir/latest_universal`` names (None when it is absent, unreadable or not a plain name)."""
    try:
        with open(os.path.join(load_dir, LATEST_UNIVERSAL)) as f:
            return files.check_tag(f.read().strip())
    except (OSError, CheckpointError, TypeError, ValueError):
        return None


def resolve(load_dir: Any, tag: str | None) -> str | None:
    """The universal checkpoint ``(load_dir, tag)`` names, else None: ``load_dir/tag``; with ``tag`` None,
    ``load_dir`` itself, the tag ``load_dir/latest`` names, or (only when ``latest`` is absent: DeepSpeed writes
    ``latest`` for its own checkpoint and ``latest_universal`` beside it) the tag ``load_dir/latest_universal``
    names."""
    if not isinstance(load_dir, (str, os.PathLike)):
        return None
    load_dir = os.fspath(load_dir)
    if tag is None and detect(load_dir):
        return load_dir
    found = tagged_dir(load_dir, tag, detect)
    if found is not None or tag is not None or os.path.exists(os.path.join(load_dir, files.LATEST)):
        return found
    name = latest_tag(load_dir)
    return os.path.join(load_dir, name) if name is not None and detect(os.path.join(load_dir, name)) else None


def identity(path: str) -> str:
    """What tells one universal checkpoint from another: its tag and its top files' names, sizes and mtimes."""
    parts = [os.path.basename(os.path.normpath(path))]
    for f in [*sorted(os.listdir(path)), os.path.join(ZERO, OPTIM_STATE)]:
        full = os.path.join(path, f)
        if os.path.isfile(full):
            st = os.stat(full)
            parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    return "universal:" + "|".join(parts)


class UniversalCheckpoint:
    """Universal checkpoint directory ``path`` (module docstring), a reader of the protocol; :meth:`prepare` opens
    a param's files and checks them."""

    format = kind = "universal"

    def __init__(self, path: str) -> None:
        self.path, self.zero = path, os.path.join(path, ZERO)
        if not os.path.isdir(self.zero):
            raise CheckpointError(f"universal checkpoint {path} has no {ZERO}/ folder")
        zero3 = _zero3_files(path)
        self.model_files = [MODEL_FILE] if os.path.isfile(os.path.join(path, MODEL_FILE)) else zero3
        if not self.model_files:
            raise CheckpointError(
                f"universal checkpoint {path} has no model states file ({MODEL_FILE} or "
                "zero_pp_rank_0_mp_rank_00_model_states.pt)"
            )
        self.model = load_file(os.path.join(path, self.model_files[0]))
        if not isinstance(self.model, dict):
            raise CheckpointError(f"{os.path.join(path, self.model_files[0])} is not a DeepSpeed model states file")
        self.optim = load_file(os.path.join(self.zero, OPTIM_STATE))
        if not isinstance(self.optim, dict):
            raise CheckpointError(f"{os.path.join(self.zero, OPTIM_STATE)} is not a universal optimizer state")
        stage = self.optim.get("zero_stage")
        self.stage = int(stage.args[0]) if isinstance(stage, Foreign) and stage.args else int(stage or 1)
        count = self.optim.get("partition_count", 1)
        self.dp = int(count[0] if isinstance(count, (list, tuple)) and count else count or 1)
        groups = self.model.get("param_shapes")
        buffers = set(self.model.get("buffer_names") or ()) | set(self.model.get("frozen_param_shapes") or {})
        if isinstance(groups, list) and groups:
            shapes = {n: tuple(int(d) for d in s) for g in groups for n, s in g.items()}
        else:  # no param_shapes: every folder with an fp32.pt that is not a buffer or a frozen param
            shapes = {
                n: ()
                for n in sorted(os.listdir(self.zero))
                if os.path.isfile(os.path.join(self.zero, n, "fp32.pt")) and n not in buffers
            }
        self.names: list[str] = list(shapes)
        self.shapes: dict[str, tuple[int, ...]] = shapes
        self.aliases: dict[str, str] = dict(self.model.get("shared_params") or {})
        self.info: dict = dict(self.model.get("universal_checkpoint_info") or {})
        self._open: dict[tuple[str, str], torch.Tensor] = {}  # (name, file) -> flat, memory-mapped
        self._known: set[str] = set()  # names whose shape was read from their files
        self._vocab: set[str] = set()
        self._pad: dict[str, int] = {}  # name -> elements of zero rows added at its end
        self._steps: dict[str, float] = {}
        self._frozen: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ files
    def source(self, name: str) -> str:
        src = self.aliases.get(name, name)
        if src not in self.shapes:
            raise CheckpointError(f"param {name!r} is not in universal checkpoint {self.path}")
        return src

    def _load(self, name: str, fname: str) -> torch.Tensor:
        """``zero/<name>/<fname>.pt`` as a flat memory-mapped tensor; its full shape noted (``shapes``)."""
        key = (name, fname)
        if key in self._open:
            return self._open[key]
        folder = os.path.join(self.zero, name)
        if not os.path.isdir(folder):
            raise CheckpointError(
                f"universal checkpoint {self.path}: the folder of param {name!r} ({folder}) is missing"
            )
        path = os.path.join(folder, f"{fname}.pt")
        obj = load_file(path)
        t = obj.get("param") if isinstance(obj, dict) else obj
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(
                f"{path} holds no tensor (a universal checkpoint file is {{'param': tensor}} or a "
                f"tensor), found {type(obj).__name__}"
            )
        shape = tuple(t.shape) if isinstance(obj, dict) or t.dim() > 1 else self.shapes[name]
        if isinstance(obj, dict) and obj.get("vocab_tensor"):
            self._vocab.add(name)
        if name in self._known and shape != self.shapes[name]:
            raise CheckpointError(f"{path} has shape {shape}, {name!r}'s other files {self.shapes[name]}")
        if t.numel() != math.prod(shape):
            raise CheckpointError(f"{path} holds {t.numel()} elements, {name!r} has shape {shape}")
        self.shapes[name] = shape
        self._known.add(name)
        self._open[key] = t.reshape(-1)
        return self._open[key]

    def open(self, name: str, keys: tuple[str, ...] = ("master", *MOMENTS)) -> None:
        """Open (memory-mapped) and check the files of param ``name`` (or the param it is tied to) for ``keys``:
        a missing folder, a file that cannot be read or of another shape is a CheckpointError naming it."""
        src = self.source(name)
        for key in keys:
            if key in ("params", "master") or self.has(src, key):
                self._load(src, FILE_OF[key])

    def prepare(self, name: str, shape: tuple[int, ...]) -> None:
        """Before ``name`` is read at full ``shape``: its files opened and checked (:meth:`open`), a vocabulary
        tensor fitted to ``shape`` (:meth:`fit`)."""
        self.open(name)
        self.fit(name, shape)

    def fit(self, name: str, shape: tuple[int, ...]) -> None:
        """A vocabulary tensor saved without its padding (``vocab_tensor``) read as ``shape``: zero rows added at
        its end when this model's vocabulary is larger (as DeepSpeed's universal load pads it)."""
        src = self.source(name)
        have = self.shapes[src]
        if (
            src in self._vocab
            and len(shape) == len(have) > 0
            and shape[1:] == have[1:]
            and shape[0] > have[0]
            and src not in self._pad
        ):
            self._pad[src] = math.prod(shape) - math.prod(have)
            self.shapes[src] = tuple(shape)

    def release(self, name: str = "") -> None:
        """Drop param ``name``'s opened files (every param's: ``name`` empty); their mapped pages leave this process
        once no tensor holds them."""
        src = self.source(name) if name else None
        for key in [k for k in self._open if src is None or k[0] == src]:
            del self._open[key]

    def has(self, name: str, key: str) -> bool:
        if key in ("params", "master"):
            return True
        return key in MOMENTS and os.path.isfile(os.path.join(self.zero, self.source(name), f"{key}.pt"))

    def read(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        """Elements ``[a, z)`` of param ``name``'s state ``key`` (flat, fp32 as saved; padding rows: zeros)."""
        src = self.source(name)
        flat = self._load(src, FILE_OF[key])
        n = flat.numel()
        if z <= n:
            return flat[a:z]
        return torch.cat([flat[min(a, n) : n], flat.new_zeros(z - max(a, n))])

    def step(self, name: str) -> float:
        """The step count of param ``name``: its ``step.pt``, else optimizer_state.pt's (ZeRO-3), else 0."""
        src = self.source(name)
        if src not in self._steps:
            path = os.path.join(self.zero, src, "step.pt")
            if os.path.isfile(path):
                self._steps[src] = scalar(load_file(path))
            else:
                state = (self.optim.get("optimizer_state_dict") or {}).get("state") or {}
                first = state.get(0, next(iter(state.values()), {})) if isinstance(state, dict) else {}
                self._steps[src] = scalar(first.get("step", 0)) if isinstance(first, dict) else 0.0
        return self._steps[src]

    # ------------------------------------------------------------------ the rest of the run
    def buffers(self) -> dict[str, torch.Tensor]:
        module = self.model.get("module") or {}
        return {n: module[n] for n in self.model.get("buffer_names") or () if n in module}

    def frozen(self) -> dict[str, torch.Tensor]:
        """Frozen params whole: the model states file's fragments (ZeRO 1-2), or every saved rank's chunks (ZeRO-3
        model states files)."""
        shapes = self.model.get("frozen_param_shapes") or {}
        if not shapes:
            return {}
        if self._frozen is None:
            if self.model_files == [MODEL_FILE]:
                frags = self.model.get("frozen_param_fragments") or {}
                self._frozen = {n: frags[n].reshape(tuple(s)) for n, s in shapes.items() if n in frags}
            else:
                chunks = [
                    load_file(os.path.join(self.path, f)).get("frozen_param_fragments") or {} for f in self.model_files
                ]
                self._frozen = {
                    n: torch.cat([c[n].reshape(-1) for c in chunks])[: math.prod(s)].view(tuple(s))
                    for n, s in shapes.items()
                }
        return self._frozen

    def counters(self) -> dict[str, Any]:
        m = self.model
        out: dict[str, Any] = {k: int(m.get(k, 0)) for k in ("global_steps", "global_samples", "skipped_steps")}
        scaler = self.optim.get("loss_scaler")
        st = scaler.state if isinstance(scaler, Foreign) else {}
        if "cur_scale" in st:
            out["loss_scaler"] = loss_scaler(st)
        return out

    def groups(self) -> list[list[str]]:
        """The param groups' names (``param_shapes``; one group of every param when absent)."""
        groups = self.model.get("param_shapes")
        return [list(g) for g in groups] if isinstance(groups, list) and groups else [list(self.names)]

    def hyper(self) -> list[dict[str, Any]]:
        groups = self.optim.get("param_groups")
        if not isinstance(groups, list):
            groups = (self.optim.get("optimizer_state_dict") or {}).get("param_groups") or []
        return list(groups)

    def scheduler(self) -> dict | None:
        return self.model.get("lr_scheduler")

    def client_state(self) -> dict:
        return {k: v for k, v in self.model.items() if k not in DS_KEYS}

    def ds_config(self) -> dict:
        return dict(self.model.get("ds_config") or {})

    def hf_config(self) -> dict:
        return {}

    def describe(self) -> str:
        return f"ZeRO-{self.stage} at dp={self.dp}"

    def file_of(self, name: str) -> str:
        return os.path.join(ZERO, self.aliases.get(name, name))


__all__ = ["LATEST_UNIVERSAL", "UniversalCheckpoint", "detect", "identity", "latest_tag", "resolve"]
