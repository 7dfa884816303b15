"""``metadata.json``: written with its digest (:func:`write_metadata`), read back with the digest checked
(:func:`read_metadata`), and checked whole (:func:`read`) before a load or a consolidation reads anything else or
modifies any state.

The digest (``"digest"``: the sha256 of every other key, canonical JSON) proves that the file is as it was written,
not that what was written is sound: an edited file re-digested, a bug of another writer, or a field an older llmpar
did not write. A load reads the layout to plan (sizes, offsets, unit indices: a zero or negative size there was a
ZeroDivisionError, or an endless loop), and the run state (``engine``, ``optimizer``, ``param_groups``,
``scheduler``) only after the params were copied in: a ``"engine": null`` or ``"optimizer": {}`` failed there with a
bare TypeError / KeyError and a half-loaded engine. :func:`read` checks every field a reader uses, by type and
range, and raises a ``CheckpointError`` naming the file, the field (``layout.buffers[0].units[1].padded``), its
value and what is accepted; :func:`check_engine` checks the entries the engine's counters and scheduler state hold
as numbers. Optional fields (older formats lack them) are checked when present: ``pp``, ``extras``, ``model``, a
buffer's ``pp_rank`` / ``index``, a param's ``tp`` / ``dup``; a rank file entry's ``sha256`` (formats 1-2) or
``index_sha256`` (format 3).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, NoReturn

from llmpar.checkpoint import files
from llmpar.checkpoint.files import CheckpointError

_HYPER = ("lr", "betas", "eps", "weight_decay")


class _Fields:
    """Raises a ``CheckpointError`` naming ``where`` (the metadata file) and the field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, value: Any, want: str) -> NoReturn:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointError(
            f"{self.where}: {field} is {shown}, expected {want}: the checkpoint's metadata is "
            f"malformed (its digest matches: it was written so, or edited and re-digested); "
            f"nothing was loaded"
        )

    def get(self, obj: dict, key: str, field: str) -> Any:
        if key not in obj:
            raise CheckpointError(
                f"{self.where}: {field} is missing: the checkpoint's metadata is malformed; nothing was loaded"
            )
        return obj[key]

    def obj(self, value: Any, field: str) -> dict:
        if not isinstance(value, dict):
            self.fail(field, value, "an object")
        return value

    def seq(self, value: Any, field: str) -> list:
        if not isinstance(value, list):
            self.fail(field, value, "a list")
        return value

    def count(self, value: Any, field: str, lo: int = 0, hi: int | None = None) -> int:
        """An int (not a bool) in [lo, hi)."""
        if not _is_int(value) or value < lo or (hi is not None and value >= hi):
            self.fail(field, value, f"an integer >= {lo}" + (f" and < {hi}" if hi is not None else ""))
        return value

    def number(self, value: Any, field: str, *, none: bool = False) -> None:
        if not (_is_num(value) or (none and value is None)):
            self.fail(field, value, "a number" + (" or null" if none else ""))

    def text(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value:
            self.fail(field, value, "a non-empty string")
        return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _canonical(meta: dict) -> bytes:
    return json.dumps(
        {k: v for k, v in meta.items() if k != "digest"}, sort_keys=True, separators=(",", ":"), allow_nan=True
    ).encode()


def write_metadata(path: str, meta: dict) -> dict:
    """Write ``path/metadata.json`` (atomically, fsynced) with its digest; returns what was written."""
    meta = json.loads(json.dumps({**meta, "format": files.FORMAT_VERSION}))  # the digest of what a reader will parse
    meta["digest"] = "sha256:" + hashlib.sha256(_canonical(meta)).hexdigest()
    files.write_json_atomic(os.path.join(path, files.METADATA), meta)
    return meta


def read_metadata(path: str) -> dict:
    """``path/metadata.json``, its digest checked; a ``CheckpointError`` naming the file when it cannot be read,
    parsed, is of an unknown format or does not match its digest."""
    name = os.path.join(path, files.METADATA)
    try:
        with open(name, "rb") as f:
            raw = f.read()
        meta = json.loads(raw)
    except OSError as e:
        raise CheckpointError(f"cannot read {name}: {e.strerror or e}") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{name} is not valid JSON ({len(raw)} bytes; truncated or corrupt?): {e}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{name} holds a JSON {type(meta).__name__}, not a checkpoint's metadata")
    fmt = meta.get("format")
    if fmt not in files.READABLE_FORMATS:
        raise CheckpointError(
            f"{name} has format {fmt!r}; this llmpar reads formats {list(files.READABLE_FORMATS)}"
            + (" (it was written by a newer llmpar)" if isinstance(fmt, int) and fmt > 1 else "")
        )
    if fmt >= 2:
        digest = meta.get("digest")
        want = "sha256:" + hashlib.sha256(_canonical(meta)).hexdigest()
        if digest != want:
            raise CheckpointError(
                f"{name} does not match its digest ({'none recorded' if digest is None else digest}"
                f", content {want}): it was edited or corrupted after it was written"
            )
    return meta


def identity(path: str) -> str:
    """What tells one saved checkpoint from another: the sha256 of its ``metadata.json`` (which names its tag and
    every file's sha256)."""
    return files.sha256_file(os.path.join(path, files.METADATA))[0]


def read(path: str) -> dict:
    """``path/metadata.json``: read, its digest checked (:func:`read_metadata`), then every field checked
    (:func:`check`)."""
    meta = read_metadata(path)
    check(meta, os.path.join(path, files.METADATA))
    return meta


def check(meta: dict, where: str) -> None:
    """Raise a ``CheckpointError`` naming ``where`` and the field when a field of ``meta`` a reader uses is missing,
    of the wrong type, or out of range (module docstring)."""
    f = _Fields(where)
    stage = f.count(f.get(meta, "stage", "stage"), "stage", 0, 4)
    dp = f.count(f.get(meta, "dp", "dp"), "dp", 1)
    tp = f.count(f.get(meta, "tp", "tp"), "tp", 1)
    pp = f.count(meta.get("pp", 1), "pp", 1)
    _files(f, f.obj(f.get(meta, "files", "files"), "files"), dp, tp, pp)
    layout = f.obj(f.get(meta, "layout", "layout"), "layout")
    buffers = f.seq(f.get(layout, "buffers", "layout.buffers"), "layout.buffers")
    for i, b in enumerate(buffers):
        _buffer(f, b, f"layout.buffers[{i}]", 1 if stage == 0 else dp, pp)
    if "extras" in meta:
        for name, at in f.obj(meta["extras"], "extras").items():
            f.count(at, f"extras[{name!r}]", 0, pp)
    groups = f.seq(f.get(meta, "param_groups", "param_groups"), "param_groups")
    for i, g in enumerate(groups):
        g = f.obj(g, f"param_groups[{i}]")
        for key in _HYPER:
            value = f.get(g, key, f"param_groups[{i}].{key}")
            if key == "betas":
                if not isinstance(value, list) or len(value) != 2 or not all(_is_num(x) for x in value):
                    f.fail(f"param_groups[{i}].betas", value, "a list of two numbers")
            else:
                f.number(value, f"param_groups[{i}].{key}")
    opt = f.obj(f.get(meta, "optimizer", "optimizer"), "optimizer")
    f.count(f.get(opt, "skipped_steps", "optimizer.skipped_steps"), "optimizer.skipped_steps")
    f.number(f.get(opt, "last_grad_norm", "optimizer.last_grad_norm"), "optimizer.last_grad_norm", none=True)
    f.obj(f.get(meta, "engine", "engine"), "engine")
    sched = f.get(meta, "scheduler", "scheduler")
    if sched is not None:
        f.obj(sched, "scheduler")
    if "model" in meta:
        f.obj(meta["model"], "model")


def _files(f: _Fields, entries: dict, dp: int, tp: int, pp: int) -> None:
    for name, e in entries.items():
        field = f"files[{name!r}]"
        try:
            files.check_tag(name, what="file name")  # a plain name inside the checkpoint directory
        except ValueError:
            f.fail(f"the name of {field}", name, "a file name inside the checkpoint directory")
        e = f.obj(e, field)
        f.count(f.get(e, "bytes", f"{field}.bytes"), f"{field}.bytes")
        key = "index_sha256" if "index_sha256" in e else "sha256"
        f.text(f.get(e, key, f"{field}.{key}"), f"{field}.{key}")
        for k, hi in (("dp_rank", dp), ("tp_rank", tp), ("pp_rank", pp)):
            if k in e:
                f.count(e[k], f"{field}.{k}", 0, hi)


def _buffer(f: _Fields, b: Any, field: str, shards: int, pp: int) -> None:
    b = f.obj(b, field)
    units = f.seq(f.get(b, "units", f"{field}.units"), f"{field}.units")
    padded = []
    for j, u in enumerate(units):
        u = f.obj(u, f"{field}.units[{j}]")
        p = f.count(f.get(u, "padded", f"{field}.units[{j}].padded"), f"{field}.units[{j}].padded", 1)
        if p % shards:
            f.fail(f"{field}.units[{j}].padded", p, f"a multiple of the {shards} shards it is split into")
        f.count(f.get(u, "shard_offset", f"{field}.units[{j}].shard_offset"), f"{field}.units[{j}].shard_offset")
        padded.append(p)
    keys = f.seq(f.get(b, "state_keys", f"{field}.state_keys"), f"{field}.state_keys")
    if not all(isinstance(k, str) for k in keys) or "params" not in keys:
        f.fail(f"{field}.state_keys", keys, "a list of names that includes 'params'")
    steps = f.seq(f.get(b, "steps", f"{field}.steps"), f"{field}.steps")
    if len(steps) != len(units) or not all(_is_num(s) for s in steps):
        f.fail(f"{field}.steps", steps, f"a list of {len(units)} numbers (one per unit)")
    if "pp_rank" in b:
        f.count(b["pp_rank"], f"{field}.pp_rank", 0, pp)
    if "index" in b:
        f.count(b["index"], f"{field}.index")
    for k, slot in enumerate(f.seq(f.get(b, "params", f"{field}.params"), f"{field}.params")):
        _param(f, slot, f"{field}.params[{k}]", padded)


def _param(f: _Fields, slot: Any, field: str, padded: list[int]) -> None:
    slot = f.obj(slot, field)
    f.text(f.get(slot, "name", f"{field}.name"), f"{field}.name")
    shape = f.seq(f.get(slot, "shape", f"{field}.shape"), f"{field}.shape")
    if not all(_is_int(d) and d >= 0 for d in shape):
        f.fail(f"{field}.shape", shape, "a list of sizes >= 0")
    unit = f.count(f.get(slot, "unit", f"{field}.unit"), f"{field}.unit", 0, len(padded))
    offset = f.count(f.get(slot, "offset", f"{field}.offset"), f"{field}.offset")
    numel = 1
    for d in shape:
        numel *= d
    if offset + numel > padded[unit]:
        f.fail(
            field,
            {"offset": offset, "shape": shape, "unit": unit},
            f"a param inside its unit ({padded[unit]} elements, padded)",
        )
    spec = slot.get("tp")
    if spec is not None:
        spec = f.obj(spec, f"{field}.tp")
        f.count(f.get(spec, "dim", f"{field}.tp.dim"), f"{field}.tp.dim", 0, max(len(shape), 1))
        full = f.count(f.get(spec, "full", f"{field}.tp.full"), f"{field}.tp.full", 1)
        if spec.get("padded") is not None:
            f.count(spec["padded"], f"{field}.tp.padded", full)
    if not isinstance(slot.get("dup", False), bool):
        f.fail(f"{field}.dup", slot["dup"], "true or false")


def check_engine(meta: dict, where: str, counters: dict, scheduler: dict | None) -> None:
    """Raise a ``CheckpointError`` naming ``where`` and the field when an entry the engine holds as a number (its
    ``checkpoint_counters()``, its scheduler's ``state_dict()``, nested objects too) is missing from the checkpoint or
    not a number there (a counter: not an integer >= 0). Entries the engine holds otherwise are not checked (torch
    schedulers take what they are given)."""
    f = _Fields(where)
    saved = f.obj(f.get(meta, "engine", "engine"), "engine")
    for key, value in counters.items():
        if _is_int(value):
            f.count(f.get(saved, key, f"engine.{key}"), f"engine.{key}")
        elif isinstance(value, dict) and key in saved:
            _like(f, f.obj(saved[key], f"engine.{key}"), value, f"engine.{key}")
    if scheduler is not None and meta.get("scheduler") is not None:
        _like(f, f.obj(meta["scheduler"], "scheduler"), scheduler, "scheduler")


def _like(f: _Fields, saved: dict, live: dict, field: str) -> None:
    """Every entry of ``live`` that is a number is one in ``saved``; nested objects likewise."""
    for key, value in live.items():
        if _is_num(value):
            f.number(f.get(saved, key, f"{field}.{key}"), f"{field}.{key}")
        elif isinstance(value, dict) and key in saved:
            _like(f, f.obj(saved[key], f"{field}.{key}"), value, f"{field}.{key}")


__all__ = ["check", "check_engine", "identity", "read", "read_metadata", "write_metadata"]
