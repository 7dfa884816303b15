"""A model's weights in HuggingFace's on-disk layout, from a full state dict: what ``from_pretrained`` loads.

    write_hf_model(out, state, config=cfg, generation_config=gen, dtype=torch.bfloat16, max_shard_size="5GB")
    -> out/model.safetensors                                          (all tensors fit in one shard), or
       out/model-00001-of-00003.safetensors ... + out/model.safetensors.index.json
          {"metadata": {"total_size": bytes, "total_parameters": elements}, "weight_map": {name: file}}
       out/config.json             when ``config`` (the model's ``PretrainedConfig`` as a dict) is given, its dtype
                                   field set to the dtype written; out/generation_config.json likewise

Used by ``llmpar checkpoint consolidate`` and ``convert`` (``write.py``, the config from the checkpoint's
``metadata.json``) and by ``engine.save_hf_model`` (the live model's). HuggingFace's rules, followed here:

* tied weights once: tensors sharing storage (a weight tied between the embedding and the head) keep their first
  name in the state dict's order (the embedding's, ``model.embed_tokens.weight``) and drop the others
  (``lm_head.weight``; the config's ``tie_word_embeddings`` re-ties it on load); safetensors refuses shared tensors;
* shards: the tensors in order, a new shard when the next tensor would take the current one past
  ``max_shard_size`` (a tensor bigger than that gets a shard of its own), ``huggingface_hub``'s split; one shard is
  named ``model.safetensors`` and gets no index. Sizes are HuggingFace's: ``"5GB"`` is 5 * 10**9 bytes (``"5GiB"``
  is 5 * 2**30); an int is bytes;
* the weight files of an earlier export in ``out`` (``model*.safetensors``, the index, ``pytorch_model*.bin``) are
  removed before the first new file lands, then the configs are written, the shards, and the index last (each file
  written aside and renamed into place): an interrupted export leaves no loadable mix of two models (weights
  without their index, or a config without weights). ``consolidate`` / ``convert`` go further: they write into a
  new directory and swap it in whole (``outdir.py``).
``format="bin"`` writes ``pytorch_model.bin`` (``torch.save``) with the same sharding and index names.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
"""Names a ``dtype`` argument takes (``"keep"`` / None: the dtype the tensors have)."""

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
FORMATS = {"safetensors": ("model", "safetensors"), "bin": ("pytorch_model", "bin")}
DEFAULT_SHARD_SIZE = "5GB"


def parse_dtype(dtype: Any, *, arg: str = "dtype") -> torch.dtype | None:
    """``dtype`` as a torch float dtype (None or ``"keep"``: None, the tensors keep theirs); a ValueError naming
    ``arg`` otherwise."""
    if dtype is None or dtype == "keep":
        return None
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(
        f"{arg}={dtype!r} is not a dtype the weights can be written in: use one of bf16, fp16, fp32 "
        "(or bfloat16, float16, float32, a torch dtype), or None / 'keep' for the tensors' own"
    )


def parse_size(size: Any, *, arg: str = "max_shard_size") -> int:
    """Bytes of ``size``: a positive int, or a string such as ``"5GB"`` / ``"500MB"`` / ``"2GiB"``; a ValueError naming
    ``arg`` otherwise."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size > 0:
            return size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]I?B|B)?\s*", size, flags=re.IGNORECASE)
        if m is not None and int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]) > 0:
            return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    raise ValueError(f"{arg}={size!r} must be a positive number of bytes or a size such as '5GB', '500MB' or '2GiB'")


def parse_format(fmt: str | None) -> str:
    """``"safetensors"`` or ``"bin"``; None: safetensors when the package is installed, else bin."""
    if fmt is None:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            return "bin"
        return "safetensors"
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {sorted(FORMATS)}")
    if fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"format='safetensors' needs the safetensors package ({e}): pip install safetensors, "
                "or write format='bin' (pytorch_model.bin)"
            ) from e
    return fmt


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every tensor once: a tensor sharing storage with an earlier one (the same tensor under a second
    name, a tied weight) is dropped; a different view of the same storage is copied (safetensors writes no shared
    storage)."""
    seen: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr()) if t.numel() else None
        first = seen.get(key) if key is not None else None
        if first is None:
            if key is not None:
                seen[key] = t
            out[name] = t
        elif not (
            first.shape == t.shape
            and first.stride() == t.stride()
            and first.storage_offset() == t.storage_offset()
            and first.dtype == t.dtype
        ):
            out[name] = t.clone()
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shard_plan(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The names of each shard, in order (``huggingface_hub``'s split: see the module docstring)."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, t in state.items():
        n = _nbytes(t)
        if n > max_bytes:
            shards.append([name])
            continue
        if current and used + n > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current or not shards:
        shards.append(current)
    return shards


def shard_files(count: int, fmt: str = "safetensors") -> list[str]:
    """``model.safetensors`` for one shard, else ``model-00001-of-0000N.safetensors`` ... (``pytorch_model``, bin)."""
    stem, ext = FORMATS[fmt]
    return [f"{stem}.{ext}"] if count == 1 else [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]


def _write_tensors(path: str, tensors: dict[str, torch.Tensor], fmt: str) -> None:
    tmp = path + ".tmp"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, tmp, metadata={"format": "pt"})
    else:
        torch.save(tensors, tmp)
    os.replace(tmp, path)


def save_safetensors(path: str, state: dict[str, torch.Tensor]) -> None:
    """One safetensors file of ``state`` (tied weights once, see :func:`untied`), HuggingFace's ``{"format": "pt"}``
    metadata."""
    _write_tensors(path, {k: v.contiguous() for k, v in untied(state).items()}, "safetensors")


def clean(out_dir: str, keep: set[str]) -> None:
    """Remove the weight files and index of an earlier export (either format: ``from_pretrained`` would prefer a
    stale ``model.safetensors`` to a new ``pytorch_model.bin``) that are not in ``keep``."""
    patterns = [
        re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.{ext}(\.index\.json)?") for stem, ext in FORMATS.values()
    ]
    for name in os.listdir(out_dir):
        if (
            name not in keep
            and any(p.fullmatch(name) for p in patterns)
            and os.path.isfile(os.path.join(out_dir, name))
        ):
            os.remove(os.path.join(out_dir, name))


def write_json(path: str, obj: dict) -> None:
    """As HuggingFace writes its json files (indent 2, sorted keys), aside and renamed into place."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(path + ".tmp", path)


def _float_dtype(state: dict[str, torch.Tensor]) -> torch.dtype | None:
    return next((t.dtype for t in state.values() if t.is_floating_point()), None)


def config_with_dtype(config: dict, dtype: torch.dtype | None) -> dict:
    """The config dict with its dtype field(s) (``dtype``; ``torch_dtype`` in transformers 4) naming ``dtype``, which
    ``from_pretrained(dtype="auto")`` builds the model in."""
    out = dict(config)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["dtype"]
        out.update({k: name for k in keys})
    return out


def write_hf_model(
    out_dir: str,
    state: dict[str, torch.Tensor],
    *,
    config: dict | None = None,
    generation_config: dict | None = None,
    dtype: Any = None,
    max_shard_size: Any = DEFAULT_SHARD_SIZE,
    format: str | None = None,
) -> list[str]:
    """Write ``state`` ({name: full tensor}) into ``out_dir`` as HuggingFace does (module docstring): float tensors
    cast to ``dtype`` (None: kept; float64 ones are cast too when a dtype is given), tied weights once, sharded at
    ``max_shard_size``, plus ``config.json`` / ``generation_config.json`` when given. Returns the paths written
    (shards, the index, then the configs)."""
    target = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    fmt = parse_format(format)
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"config must be a dict (the model config's to_dict()), got {type(config).__name__}")
    tensors = untied(state)

    def final(t: torch.Tensor) -> torch.Tensor:  # cast one shard at a time: no second copy of the whole model
        return (t.to(target) if target is not None and t.is_floating_point() else t).contiguous()

    sized = {
        n: torch.empty(
            t.shape, dtype=target if target is not None and t.is_floating_point() else t.dtype, device="meta"
        )
        for n, t in tensors.items()
    }
    shards = shard_plan(sized, max_bytes)
    names = shard_files(len(shards), fmt)
    index = "{}.{}.index.json".format(*FORMATS[fmt])
    os.makedirs(out_dir, exist_ok=True)
    clean(out_dir, set())  # the earlier export's weights gone before any new file lands (module docstring)
    configs = {}
    if config is not None:
        configs["config.json"] = config_with_dtype(config, _float_dtype(sized))
    if generation_config is not None:
        configs["generation_config.json"] = generation_config
    for fname, obj in configs.items():
        write_json(os.path.join(out_dir, fname), obj)
    written = []
    for fname, keys in zip(names, shards):
        _write_tensors(os.path.join(out_dir, fname), {k: final(tensors[k]) for k in keys}, fmt)
        written.append(os.path.join(out_dir, fname))
    if len(names) > 1:
        write_json(
            os.path.join(out_dir, index),
            {
                "metadata": {
                    "total_size": sum(_nbytes(t) for t in sized.values()),
                    "total_parameters": sum(t.numel() for t in sized.values()),
                },
                "weight_map": {k: fname for fname, keys in zip(names, shards) for k in keys},
            },
        )
        written.append(os.path.join(out_dir, index))
    return written + [os.path.join(out_dir, fname) for fname in configs]


__all__ = [
    "DEFAULT_SHARD_SIZE",
    "DTYPES",
    "FORMATS",
    "config_with_dtype",
    "parse_dtype",
    "parse_format",
    "parse_size",
    "save_safetensors",
    "shard_files",
    "shard_plan",
    "untied",
    "write_hf_model",
]
