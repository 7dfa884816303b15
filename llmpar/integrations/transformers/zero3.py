"""HuggingFace models built sharded under llmpar's ``TrainingArguments`` with a ZeRO-3 config, as transformers does
for DeepSpeed (``is_deepspeed_zero3_enabled()``: ``from_config`` / ``from_pretrained`` under ``deepspeed.zero.Init``).

    args = TrainingArguments(..., deepspeed={"zero_optimization": {"stage": 3}, ...})   # llmpar's: registers here
    model = AutoModelForCausalLM.from_config(cfg)        # built inside llmpar.zero.Init: no param memory yet
    model = AutoModelForCausalLM.from_pretrained(path)   # the same; each param is read from the checkpoint when
                                                           # ZeRO-3 materialises its unit (one unit at a time)

``from_config`` equals the plain build of the same seed (``llmpar.zero.init``); ``from_pretrained`` equals the plain
``from_pretrained`` (the checkpoint's values, cast to the model's dtype; persistent buffers read at once). The sharded
``from_pretrained`` reads a local directory of safetensors whose names are the model's own (what ``save_pretrained`` and
``engine.save_hf_model`` write) with the plain keyword arguments (``config``, ``dtype``, ``attn_implementation``, hub
arguments at their defaults); anything else (renamed or missing keys, ``device_map``, quantization, ``.bin`` files, a
hub id) is built whole by transformers' own ``from_pretrained``, with one info line in the ``llmpar`` log saying why.

``model.resize_token_embeddings(...)`` on a model built that way (before ``initialize``) runs inside its recording
(``resize_sharded``): what transformers does under DeepSpeed's ``GatheredParameters``, giving the plain resize of the
plain build. The other ``is_deepspeed_zero3_enabled()`` branches of transformers are DeepSpeed's API calls and stay
off (llmpar never sets transformers' DeepSpeed config): ``from_config`` / ``from_pretrained`` are the builds above,
``tie_weights`` ties the recorded params (ZeRO-3 gathers a tied param for every module holding it), and the
Trainer's ``generate`` sets ``synced_gpus`` itself (``trainer.py``).

Registration, as transformers keeps its ``HfDeepSpeedConfig``: one per process, a weak reference to the latest llmpar
``TrainingArguments`` given a config (ZeRO-3 or not: a later non-ZeRO-3 config turns it off), held by the methods this
module installs on ``transformers.PreTrainedModel`` (``_from_config``, ``from_pretrained``,
``resize_token_embeddings``; installed once, they call the originals whenever no ZeRO-3 arguments are alive / the
model is not built sharded). Nothing is kept in llmpar's own modules.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import weakref
from typing import Any

import torch
import transformers
from torch import nn

from llmpar.zero import Init
from llmpar.zero.init import _INIT_FN

logger = logging.getLogger("llmpar")
_ATTR = "_llmpar_zero3_builds"  # on transformers.PreTrainedModel: the one _Builds of this process
# keyword arguments of from_pretrained the sharded path takes; hub ones only where they change nothing locally
_TAKEN = {
    "config",
    "dtype",
    "torch_dtype",
    "attn_implementation",
    "_from_auto",
    "_from_pipeline",
    "low_cpu_mem_usage",
    "trust_remote_code",
    "weights_only",
    "disable_mmap",
    "use_safetensors",
}
_HUB = {
    "local_files_only": lambda v: True,
    "cache_dir": lambda v: True,
    "token": lambda v: True,
    "force_download": lambda v: not v,
    "revision": lambda v: v in (None, "main"),
    "proxies": lambda v: v is None,
    "subfolder": lambda v: not v,
    "adapter_kwargs": lambda v: not v,
    "variant": lambda v: v is None,
}


def is_zero3(config: Any) -> bool:
    """Whether a DeepSpeed config (dict) asks for ZeRO stage 3."""
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    return isinstance(zero, dict) and zero.get("stage") == 3


class _Builds:
    """The patched build methods of ``transformers.PreTrainedModel`` and the arguments that switch them on."""

    def __init__(self) -> None:
        cls = transformers.PreTrainedModel
        self.from_config = cls.__dict__["_from_config"].__func__
        self.from_pretrained = cls.__dict__["from_pretrained"].__func__
        self.args: weakref.ref | None = None
        builds = self  # the class holds this object for the life of the process

        def _from_config(klass: type, config: Any, **kwargs: Any) -> Any:
            if not builds.on():
                return builds.from_config(klass, config, **kwargs)
            with Init():
                return builds.from_config(klass, config, **kwargs)

        def from_pretrained(klass: type, path: Any, *model_args: Any, **kwargs: Any) -> Any:
            if builds.on():
                model = sharded_from_pretrained(klass, path, model_args, kwargs, builds.from_config)
                if model is not None:
                    return model
            return builds.from_pretrained(klass, path, *model_args, **kwargs)

        _from_config.__doc__ = self.from_config.__doc__
        from_pretrained.__doc__ = self.from_pretrained.__doc__
        cls._from_config = classmethod(_from_config)
        cls.from_pretrained = classmethod(from_pretrained)
        self.resize = cls.__dict__["resize_token_embeddings"]
        resize = self.resize

        def resize_token_embeddings(model: Any, *args: Any, **kwargs: Any) -> Any:
            return resize_sharded(model, resize, args, kwargs)

        resize_token_embeddings.__doc__ = resize.__doc__
        cls.resize_token_embeddings = resize_token_embeddings

    def on(self) -> bool:
        return self.args is not None and self.args() is not None


def register(args: Any, config: Any) -> None:
    """``args`` (llmpar's TrainingArguments, given ``config``) decide from now on whether HF builds are sharded:
    they are while ``args`` is alive and ``config`` asks for ZeRO-3."""
    builds = transformers.PreTrainedModel.__dict__.get(_ATTR)
    if builds is None:
        if not is_zero3(config):
            return  # nothing installed until a ZeRO-3 config shows up
        builds = _Builds()
        setattr(transformers.PreTrainedModel, _ATTR, builds)
    builds.args = weakref.ref(args) if is_zero3(config) else None


def resize_sharded(model: nn.Module, resize: Any, args: tuple, kwargs: dict) -> Any:
    """``model.resize_token_embeddings(...)`` (transformers' ``resize``) on a model built sharded, before
    ``llmpar.initialize``: its params are recorded meta tensors, so the resize runs inside the recording of the block
    that built it (``llmpar.zero.init.recording``): the new rows, their mean-resizing draws and the copy of the old
    rows are recorded and replayed by ZeRO-3 one unit at a time, giving what the plain resize of the plain build gives
    (what DeepSpeed does with ``GatheredParameters`` around these steps). A model ``from_pretrained`` built sharded
    reads its embeddings from the checkpoint first (recorded writes: the mean of the old rows is the checkpoint's; the
    tensors read are held until initialize, as a state dict loaded then), and a resized param takes its values from
    the recording alone. After ``initialize`` at ZeRO-3 (each param a shard) it is refused: resize before training."""
    from llmpar.zero import OWNER_ATTR
    from llmpar.zero.init import _DEFERRED, Deferred, recording

    params = list(model.parameters())
    if any(getattr(getattr(p, OWNER_ATTR, lambda: None)(), "stage3", None) is not None for p in params):
        raise ValueError(
            "resize_token_embeddings on a model ZeRO-3 has already sharded (after llmpar.initialize / "
            "trainer.train()): resize it before, where its params are still whole or recorded"
        )
    if not any(hasattr(p, _DEFERRED) for p in params):
        return resize(model, *args, **kwargs)
    embeddings = [
        m.weight
        for m in (model.get_input_embeddings(), model.get_output_embeddings())
        if m is not None and isinstance(getattr(m, "weight", None), torch.Tensor)
    ]
    _read_from_checkpoint(model, embeddings)
    with recording(model):
        out = resize(model, *args, **kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        for name, p in model.named_parameters():
            d = getattr(p, _DEFERRED, None)
            if d is not None and d.recorder.key_of(p) != d.block.key:  # its storage was replaced by the resize
                now = d.now(p, name)
                setattr(p, _DEFERRED, Deferred(d.recorder, now.ref, now.ref))
                if hasattr(p, _INIT_FN):
                    delattr(p, _INIT_FN)  # its values are the recording's (the checkpoint's rows were copied in)
    return out


@torch.no_grad()
def _read_from_checkpoint(model: nn.Module, params: list[torch.Tensor]) -> None:
    """Params a sharded ``from_pretrained`` reads at materialisation (``CheckpointLoad``) take the checkpoint's
    values now, as recorded writes."""
    from safetensors import safe_open

    for p in params:
        loader = getattr(p, _INIT_FN, None)
        if not isinstance(loader, CheckpointLoad):
            continue
        name = next(
            (n for n, q in model.named_parameters(remove_duplicate=False) if q is p and n in loader.files), None
        )
        if name is not None:
            with safe_open(loader.files[name], framework="pt") as f:
                p.copy_(f.get_tensor(name))


def is_llmpar_zero3_enabled() -> bool:
    """transformers' ``is_deepspeed_zero3_enabled()`` for llmpar: HF builds are sharded now."""
    builds = transformers.PreTrainedModel.__dict__.get(_ATTR)
    return builds is not None and builds.on()


class CheckpointLoad:
    """``Init(init_fn=...)`` reading params from safetensors files: each param of the unit that holds memory (the
    unit's own, being materialised; others hold none) takes the checkpoint's value under one of its names."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files  # checkpoint name -> file
        self.model: weakref.ref | None = None

    def bind(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)

    @torch.no_grad()
    def __call__(self, unit: nn.Module) -> None:
        from safetensors import safe_open

        root = self.model() if self.model is not None else None
        if root is None:
            raise RuntimeError("the checkpoint reader lost its model (from_pretrained under llmpar ZeRO-3)")
        name_of: dict[int, str] = {}
        for n, p in root.named_parameters(remove_duplicate=False):
            if n in self.files and getattr(p, _INIT_FN, None) is self:  # not a param resized since (resize_sharded)
                name_of.setdefault(id(p), n)
        by_file: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for p in unit.parameters():
            n = name_of.get(id(p))
            if n is not None and p.untyped_storage().nbytes() > 0:
                by_file.setdefault(self.files[n], []).append((n, p))
        for path, items in by_file.items():
            with safe_open(path, framework="pt") as f:
                for n, p in items:
                    p.copy_(f.get_tensor(n))


def _checkpoint_files(path: str) -> dict[str, str] | None:
    """{name: file} of a local safetensors checkpoint (one file, or shards with their index), else None."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        return {n: os.path.join(path, fname) for n, fname in weight_map.items()}
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {n: single for n in f.keys()}
    return None


def _why_not(path: Any, model_args: tuple, kwargs: dict) -> str | None:
    """Why this from_pretrained call is built whole (None: it can be sharded)."""
    if model_args:
        return "positional model arguments"
    other = sorted(k for k in kwargs if k not in _TAKEN and k not in _HUB)
    if other:
        return f"arguments {other}"
    hub = sorted(k for k in kwargs if k in _HUB and not _HUB[k](kwargs[k]))
    if hub:
        return f"hub arguments {hub}"
    if kwargs.get("use_safetensors") is False:
        return "use_safetensors=False"
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return "not a local directory"
    if not isinstance(kwargs.get("config"), (transformers.PreTrainedConfig, type(None))):
        return "config given as a path"
    if isinstance(kwargs.get("dtype", kwargs.get("torch_dtype")), dict):
        return "a dtype per sub-model"
    return None


def _dtype(value: Any, config: Any, files: dict[str, str]) -> torch.dtype:
    """from_pretrained's dtype rule: None -> torch's default; "auto" -> the config's, else the checkpoint's."""
    if value is None:
        return torch.get_default_dtype()
    if isinstance(value, torch.dtype):
        return value
    if value == "auto":
        if isinstance(getattr(config, "dtype", None), torch.dtype):
            return config.dtype
        from safetensors import safe_open

        for n, path in files.items():
            with safe_open(path, framework="pt") as f:
                t = f.get_slice(n)
                dt = getattr(
                    torch,
                    {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}.get(
                        t.get_dtype(), "int64"
                    ),
                )
            if dt.is_floating_point:
                return dt
        return torch.get_default_dtype()
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    raise ValueError(f"dtype={value!r}: give a torch.dtype, its name, or 'auto'")


def _mismatch(model: nn.Module, files: dict[str, str]) -> str | None:
    """Why the checkpoint's names / shapes do not fit the model built (None: every param has a value, nothing left)."""
    from safetensors import safe_open

    state = model.state_dict(keep_vars=True)
    extra = sorted(set(files) - set(state))
    if extra:
        return f"checkpoint names not in the model: {extra[:4]}"
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    missing = [ns[0] for ns in names.values() if not any(n in files for n in ns)]
    if missing:
        return f"params missing from the checkpoint: {missing[:4]}"
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for n in f.keys():
                if n in state and tuple(f.get_slice(n).get_shape()) != tuple(state[n].shape):
                    return (
                        f"{n!r} has shape {tuple(f.get_slice(n).get_shape())} in the checkpoint, "
                        f"{tuple(state[n].shape)} in the model"
                    )
    return None


def sharded_from_pretrained(cls: type, path: Any, model_args: tuple, kwargs: dict, from_config: Any) -> Any:
    """``cls.from_pretrained(path, **kwargs)`` built inside ``llmpar.zero.Init`` with the checkpoint read one unit at a
    time when ZeRO-3 materialises it; None when the call is built whole instead (logged)."""
    why = _why_not(path, model_args, kwargs)
    files = _checkpoint_files(os.fspath(path)) if why is None else None
    if why is None and files is None:
        why = "no model.safetensors (or index) in it"
    if why is not None:
        logger.info(
            "llmpar ZeRO-3: %s.from_pretrained(%r) built whole by transformers (%s); ZeRO-3 shards it at initialize",
            cls.__name__,
            path,
            why,
        )
        return None
    assert files is not None
    config = kwargs.get("config")
    config = copy.deepcopy(config) if config is not None else cls.config_class.from_pretrained(path)
    dtype = _dtype(kwargs.get("dtype", kwargs.get("torch_dtype")), config, files)
    extra = {"attn_implementation": kwargs["attn_implementation"]} if kwargs.get("attn_implementation") else {}
    loader = CheckpointLoad(files)
    with Init(init_fn=loader):
        model = from_config(cls, config, dtype=dtype, **extra)
    why = _mismatch(model, files)
    if why is not None:
        logger.info("llmpar ZeRO-3: %s.from_pretrained(%r) built whole by transformers (%s)", cls.__name__, path, why)
        return None
    loader.bind(model)
    with torch.no_grad():
        from safetensors import safe_open

        for n, buf in model.named_buffers():
            if n in files:  # persistent buffers: small, read now
                with safe_open(files[n], framework="pt") as f:
                    buf.copy_(f.get_tensor(n))
    model.config.name_or_path = os.fspath(path)
    if model.can_generate() and os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    model.eval()
    return model


__all__ = [
    "CheckpointLoad",
    "is_llmpar_zero3_enabled",
    "is_zero3",
    "register",
    "resize_sharded",
    "sharded_from_pretrained",
]
