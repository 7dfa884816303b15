"""A ``torch.distributed.checkpoint`` (DCP) directory of a model and its Adam states, read and written by name.

The layout is the one FSDP2 / torchtitan runs write with ``dcp.save``: ``.metadata`` and one ``__{rank}_{n}.distcp``
file per writing rank, holding a flat state dict whose keys are

    [model.]NAME                         the model's params and persistent buffers (torchtitan: no ``model.`` prefix)
    {optim|optimizer}.state.NAME.KEY     Adam's ``exp_avg``, ``exp_avg_sq`` ([*shape] like the param) and ``step``
                                         (a 0-d tensor), as ``get_state_dict(model, optimizer)`` names them (the
                                         flattened and the nested optimizer state dicts give the same DCP keys)
    {optim|optimizer}.param_groups.NAME.lr ...   (flattened) hyper-parameters, stored as bytes: not read

:class:`DcpCheckpoint` is a reader of the protocol (``formats/source.py``: ``shapes``, ``has``, ``read``, ``step``,
``buffers``; no hyper-parameters, counters or scheduler: DCP stores the hyper-parameters as bytes, not read):
``read(name, key, a, z)`` reads only the rows of the saved tensor that hold flat elements ``[a, z)`` (a load plan of one
chunk per tensor: DCP reads the saved chunks overlapping it, nothing else), and :meth:`DcpCheckpoint.prefetch` reads
every range a rank will ask for in one ``dcp.load``. Reads run without collectives (``no_dist=True``): each rank reads
on its own. ``params`` are the model tensors that have an optimizer state (all of them when the checkpoint holds none);
the others are buffers (or frozen params).

``write.py`` writes such a directory (the same keys, ``model.`` / ``optim.`` prefixed) from one process; FSDP2 loads
it into its sharded params with ``dcp.load`` + ``set_state_dict`` (DCP reshards).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.tags import tagged_dir

METADATA = ".metadata"
DATA_RE = re.compile(r"^__\d+_\d+\.distcp$")
OPTIM_PREFIXES = ("optim.", "optimizer.", "")
MOMENTS = ("exp_avg", "exp_avg_sq")

Rows = tuple[int, int]


def detect(path: str) -> bool:
    """Whether directory ``path`` is a DCP checkpoint: ``.metadata`` and at least one ``__R_N.distcp`` file."""
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, METADATA)):
        return False
    return any(DATA_RE.match(f) for f in os.listdir(path))


def resolve(load_dir: Any, tag: str | None) -> str | None:
    """The DCP checkpoint ``load_dir`` names: ``load_dir`` itself (``tag`` None and a DCP directory), else
    ``load_dir/tag`` (``tag`` None: the tag ``load_dir/latest`` names) when that is one; None otherwise."""
    if tag is None and isinstance(load_dir, (str, os.PathLike)) and detect(os.fspath(load_dir)):
        return os.fspath(load_dir)
    return tagged_dir(load_dir, tag, detect)


def identity(path: str) -> str:
    """What tells one DCP checkpoint from another: its directory name and each file's name, size and mtime."""
    parts = [os.path.basename(os.path.normpath(path))]
    for f in sorted(os.listdir(path)):
        if f == METADATA or DATA_RE.match(f):
            st = os.stat(os.path.join(path, f))
            parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    return "dcp:" + "|".join(parts)


class _RowsPlanner(DefaultLoadPlanner):
    """Loads, for each key of the state dict, the saved rows ``[r0, r0 + len)`` along dim 0 into its tensor (``rows``:
    {key: r0}; a 0-d tensor whole)."""

    def __init__(self, rows: dict[str, int]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.rows = rows

    def create_local_plan(self) -> LoadPlan:
        items = []
        assert self.metadata is not None  # set by set_up_planner, which dcp.load calls first
        for fqn, t in self.state_dict.items():
            # every key of this planner's state dict is a tensor's (_read builds it), so its metadata is a tensor's
            md = cast(TensorStorageMetadata, self.metadata.state_dict_metadata[fqn])
            offsets = [self.rows[fqn]] + [0] * (t.dim() - 1) if t.dim() else []
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size())
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        """The part of the state dict's tensor a read item fills (``dest_offsets``: within the rows read)."""
        t, offsets = self.state_dict[read_item.dest_index.fqn], list(read_item.dest_offsets)
        for dim, (o, n) in enumerate(zip(offsets, read_item.lengths)):
            t = t.narrow(dim, o, n)
        return t


def _read(path: str, sd: dict[str, torch.Tensor], rows: dict[str, int]) -> None:
    """``dcp.load`` of ``sd`` (rows ``rows`` of each key) from ``path``, no collective; a CheckpointError naming the
    directory when it fails (DCP's own ``CheckpointException`` is a ``BaseException``)."""
    try:
        dcp.load(sd, storage_reader=FileSystemReader(path), planner=_RowsPlanner(rows), no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - named, and agreed between the ranks by the caller
        raise CheckpointError(f"reading {sorted(sd)[:4]} from DCP checkpoint {path} failed: {e!r}") from e


def _rows(shape: tuple[int, ...], a: int, z: int) -> Rows:
    """The rows along dim 0 holding flat elements ``[a, z)`` of a tensor of ``shape``."""
    if not shape:
        return (0, 1)
    row = math.prod(shape[1:])
    return (a // row, -(-z // row)) if row else (0, shape[0])


class DcpCheckpoint:
    """DCP checkpoint directory ``path`` (module docstring); raises a ``CheckpointError`` naming it when its
    ``.metadata`` cannot be read or holds no model tensor."""

    kind = "DCP"
    format = "dcp"
    stage, dp = 0, 1  # not recorded

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.md = FileSystemReader(path).read_metadata()
        except Exception as e:  # noqa: BLE001 - a foreign or truncated file: named
            raise CheckpointError(f"cannot read DCP metadata {os.path.join(path, METADATA)}: {e!r}") from e
        tensors = {k: v for k, v in self.md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self.optim_prefix = next((p for p in OPTIM_PREFIXES if any(k.startswith(p + "state.") for k in tensors)), None)
        opt = self.optim_prefix
        model = [k for k in tensors if opt is None or not k.startswith(opt + "state.")]
        model = [k for k in model if not re.match(r"^(optim|optimizer)\.", k)]
        self.model_prefix = "model." if model and all(k.startswith("model.") for k in model) else ""
        cut = len(self.model_prefix)
        self.shapes: dict[str, tuple[int, ...]] = {k[cut:]: tuple(tensors[k].size) for k in model}
        self.dtypes = {k[cut:]: tensors[k].properties.dtype for k in model}
        if not self.shapes:
            raise CheckpointError(
                f"DCP checkpoint {path} holds no model tensors (its keys: {sorted(self.md.state_dict_metadata)[:8]})"
            )
        with_state = {n for n in self.shapes if any(self.key(n, k) in tensors for k in (*MOMENTS, "step"))}
        self.names = sorted(with_state or self.shapes)
        self.aliases: dict[str, str] = {}
        self._pieces: dict[tuple[str, str], tuple[Rows, torch.Tensor]] = {}
        self._buffers: dict[str, torch.Tensor] | None = None

    def key(self, name: str, key: str) -> str:
        """The DCP key of param ``name``'s state ``key`` ("params" / "master": the model's tensor)."""
        if key in ("params", "master"):
            return self.model_prefix + name
        return f"{self.optim_prefix or ''}state.{name}.{key}"

    def source(self, name: str) -> str:
        return name

    def has(self, name: str, key: str) -> bool:
        """Whether the checkpoint holds param ``name``'s state ``key``."""
        return name in self.shapes and (
            key in ("params", "master") or (key in MOMENTS and self.key(name, key) in self.md.state_dict_metadata)
        )

    def _load(self, wanted: dict[tuple[str, str], Rows]) -> None:
        """Read the rows ``wanted`` of each (name, key) in one ``dcp.load`` (no collective)."""
        sd, rows = {}, {}
        for (name, key), (r0, r1) in wanted.items():
            fqn, shape = self.key(name, key), self.shapes[name]
            dtype = self._dtype(fqn)
            sd[fqn] = torch.empty((r1 - r0, *shape[1:]) if shape else (), dtype=dtype)
            rows[fqn] = r0
        if sd:
            _read(self.path, sd, rows)
        for (name, key), r in wanted.items():
            self._pieces[(name, key)] = (r, sd[self.key(name, key)])

    def prefetch(self, ranges: list[tuple[str, str, int, int]]) -> None:
        """Read, in one ``dcp.load``, the rows holding every ``(name, key, a, z)`` of ``ranges`` (those it has)."""
        wanted: dict[tuple[str, str], Rows] = {}
        for name, key, a, z in ranges:
            if self.has(name, key) and z > a:
                r0, r1 = _rows(self.shapes[name], a, z)
                old = wanted.get((name, key))
                wanted[(name, key)] = (min(r0, old[0]), max(r1, old[1])) if old else (r0, r1)
        self._load(wanted)

    def read(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        """Elements ``[a, z)`` of param ``name``'s state ``key`` (its flat view), fp32 as saved, a flat CPU tensor."""
        shape = self.shapes[name]
        r0, r1 = _rows(shape, a, z)
        have = self._pieces.get((name, key))
        if have is None or have[0][0] > r0 or have[0][1] < r1:
            self._load({(name, key): (r0, r1)})
            have = self._pieces[(name, key)]
        base = have[0][0] * (math.prod(shape[1:]) if shape else 1)
        return have[1].reshape(-1)[a - base : z - base]

    def _dtype(self, fqn: str) -> torch.dtype:
        """The dtype DCP's metadata records for key ``fqn``, a tensor's (the keys read here are params and their
        optimizer states)."""
        return cast(TensorStorageMetadata, self.md.state_dict_metadata[fqn]).properties.dtype

    def step(self, name: str) -> float:
        """Adam's step count saved for param ``name``."""
        fqn = self.key(name, "step")
        if fqn not in self.md.state_dict_metadata:
            raise CheckpointError(f"DCP checkpoint {self.path} has no {fqn!r} (Adam's step count of {name!r})")
        if (name, "step") not in self._pieces:
            sd = {fqn: torch.empty((), dtype=self._dtype(fqn))}
            _read(self.path, sd, {fqn: 0})
            self._pieces[(name, "step")] = ((0, 1), sd[fqn])
        return float(self._pieces[(name, "step")][1])

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model tensors without optimizer state (buffers, frozen params), whole (read once)."""
        if self._buffers is None:
            rest = [n for n in self.shapes if n not in set(self.names)]
            self._load({(n, "params"): (0, self.shapes[n][0] if self.shapes[n] else 1) for n in rest})
            self._buffers = {n: self._pieces[(n, "params")][1].reshape(self.shapes[n]) for n in rest}
        return self._buffers

    def frozen(self) -> dict[str, torch.Tensor]:
        return {}

    def scheduler(self) -> None:
        return None

    def groups(self) -> list[list[str]]:
        return [list(self.names)]

    def hyper(self) -> list[dict[str, Any]]:
        return []  # stored as bytes: not read

    def counters(self) -> dict[str, Any]:
        return {}

    def client_state(self) -> dict:
        return {}

    def ds_config(self) -> dict:
        return {}

    def hf_config(self) -> dict:
        return {}

    def prepare(self, name: str, shape: tuple[int, ...]) -> None:
        pass

    def release(self, name: str = "") -> None:
        self._pieces = {k: v for k, v in self._pieces.items() if name and k[0] != name}

    def describe(self) -> str:
        return f"DCP of {len(self.names)} params"

    def file_of(self, name: str) -> str:
        return ""


__all__ = ["DATA_RE", "METADATA", "MOMENTS", "DcpCheckpoint", "detect", "identity", "resolve"]
