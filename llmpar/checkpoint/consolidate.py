"""The model's weights from a sharded checkpoint, on one process (no ranks needed), in HuggingFace's layout.

    llmpar checkpoint consolidate ckpts/global_step100 out/      # or ckpts (its `latest`)
    -> out/model.safetensors (or model-0000k-of-0000n.safetensors + model.safetensors.index.json above
       --max-shard-size, default 5GB) and, for a HuggingFace model, out/config.json (+ generation_config.json):
       AutoModelForCausalLM.from_pretrained("out") loads it
    llmpar checkpoint consolidate ckpts out/ --dtype bf16         # float tensors in bf16 (default fp32; keep: as saved)
    llmpar checkpoint consolidate ckpts out/ --format bin         # pytorch_model.bin (torch.save) instead
    llmpar checkpoint publish ckpts global_step100               # a save whose publish never ran (ckpts/.tmp-TAG)
    llmpar checkpoint convert ds_ckpts out/ --to hf              # a DeepSpeed (or llmpar) checkpoint, auto-detected

Each trained param is rebuilt whole from the shards by name (``CheckpointReader.full``: a tensor-parallel param is
concatenated over the saved tp ranks along its split dim, vocabulary padding dropped; a pipeline checkpoint already
names params as the unsplit model does, a tied weight once), from the fp32 master when the run kept one, else from
the params, cast to ``dtype`` (default float32: the full-precision weights, as DeepSpeed's ``zero_to_fp32``; float64
stays float64); persistent module buffers and frozen params come from dp
rank 0's files (a checkpoint written before llmpar left non-persistent buffers out still holds those and they are
written too). Names are the model's own (``model.named_parameters()``); a tied weight appears once, under its first
name. The files are written by ``hf_files.write_hf_model``, ``config.json`` from the HuggingFace config the engine
recorded in ``metadata.json`` (none for an older checkpoint or a model without one). ``metadata.json``'s digest and
fields (``metacheck``) and every file's sha256 are verified first.

``convert`` (``ds_convert.py``) takes a checkpoint of either layout (``--from`` auto-detected: DeepSpeed's files, or
llmpar's ``metadata.json``) to HuggingFace's layout as ``consolidate`` writes it (no ``config.json`` from a DeepSpeed
checkpoint: it records none), then reads every written file back and compares each tensor with the source, bitwise.
A universal checkpoint (``ds_to_universal``'s, or ``--to universal``'s) converts to every layout (``--from universal``
or detected: ``zero/`` beside a model states file, or ``latest_universal`` naming one).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from llmpar.checkpoint import (
    dcp_convert,
    dcp_format,
    ds_convert,
    ds_universal,
    ds_write,
    files,
    hf_files,
    metacheck,
    outdir,
    publish,
)
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.reshard import CheckpointReader


def _locate(path: str, tag: str | None) -> str:
    if os.path.isfile(os.path.join(path, files.METADATA)) and tag is None:
        return path
    return files.resolve(path, tag)[1]


def _read(path: str, tag: str | None, dtype: torch.dtype | None) -> tuple[dict[str, torch.Tensor], dict]:
    """({name: full tensor}, metadata.json) of the checkpoint, every file verified first."""
    ckpt = _locate(os.fspath(path), tag)
    meta = metacheck.read(ckpt)
    reader = CheckpointReader(ckpt, meta)
    for fname in sorted(meta["files"]):
        why = reader.files.check(fname, full=True)  # every block; read below from the same opened files
        if why is not None:
            raise CheckpointError(f"checkpoint shard {os.path.join(ckpt, fname)} is {why}")
    out: dict[str, torch.Tensor] = {}
    for name, (bi, _, _) in reader.where.items():
        key = "master" if "master" in meta["layout"]["buffers"][bi]["state_keys"] else "params"
        t = reader.full(name, key)
        if dtype is not None and t.is_floating_point() and t.dtype != torch.float64:
            t = t.to(dtype)
        out[name] = t.clone()
    for name, t in reader.extras(reader.tp, 0).items():
        out.setdefault(name, t.clone())
    return out, meta


def consolidated_state_dict(
    path: str, tag: str | None = None, *, dtype: torch.dtype | None = torch.float32
) -> dict[str, torch.Tensor]:
    """{name: full tensor} of checkpoint ``path`` (a checkpoint dir, or a save dir with ``latest`` / ``tag``).
    dtype: float params are cast to it (float64 ones kept); None keeps the saved dtype."""
    return _read(path, tag, dtype)[0]


def consolidate(
    path: str,
    out_dir: str,
    tag: str | None = None,
    *,
    dtype: Any = torch.float32,
    max_shard_size: Any = hf_files.DEFAULT_SHARD_SIZE,
    format: str | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Write the checkpoint's weights into ``out_dir`` as HuggingFace does (``hf_files.write_hf_model``): float
    tensors in ``dtype`` (bf16 / fp16 / fp32 or a torch dtype, float64 ones kept; None / "keep": as saved), shards of
    at most ``max_shard_size`` ("5GB", or bytes) with an index, ``config.json`` / ``generation_config.json`` when the
    checkpoint recorded the model's HuggingFace config. ``format``: "safetensors" (default when installed) or "bin".
    ``out_dir`` is built beside and swapped in whole (``outdir.py``): a non-empty one is refused unless
    ``overwrite``. Returns the paths written."""
    target = hf_files.parse_dtype(dtype)
    hf_files.parse_size(max_shard_size)  # bad arguments fail before the checkpoint is read
    hf_files.parse_format(format)
    outdir.check_target(out_dir, overwrite, path)
    state, meta = _read(path, tag, target)
    model = meta.get("model", {})
    with outdir.staged(out_dir, overwrite=overwrite, source=path, what="consolidate") as tmp:
        written = hf_files.write_hf_model(
            tmp,
            state,
            config=model.get("hf_config"),
            generation_config=model.get("hf_generation_config"),
            max_shard_size=max_shard_size,
            format=format,
        )
    return outdir.moved(written, tmp, out_dir)


def convert(
    src: str,
    out_dir: str,
    *,
    to: str = "hf",
    source: str = "auto",
    tag: str | None = None,
    dtype: Any = torch.float32,
    max_shard_size: Any = hf_files.DEFAULT_SHARD_SIZE,
    format: str | None = None,
    stage: int | None = None,
    dp: int | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Convert checkpoint ``src`` (``source``: "auto", "deepspeed", "llmpar" or "universal": DeepSpeed's universal
    layout, ``universal_read.py``, also detected) to ``to`` ("hf": HuggingFace's
    layout, as :func:`consolidate` writes it; "deepspeed": DeepSpeed's ZeRO-``stage`` layout for ``dp`` ranks,
    ``ds_write.py``, defaults: the source's; "universal": DeepSpeed's universal layout, ``ds_universal.py``; "dcp":
    a ``torch.distributed.checkpoint`` directory FSDP2 / torchtitan load, from an llmpar checkpoint,
    ``dcp_convert.py``) in ``out_dir``; every file written is read back and each tensor compared with the source
    (dcp: the source's files are verified before anything is written). ``out_dir`` is built beside and swapped in
    whole once every file is written and checked (``outdir.py``): a non-empty one is refused unless ``overwrite``,
    an interrupted convert leaves it as it was. Returns the paths written."""
    with outdir.staged(out_dir, overwrite=overwrite, source=src, what="convert") as tmp:
        written = _convert(
            src,
            tmp,
            to=to,
            source=source,
            tag=tag,
            dtype=dtype,
            max_shard_size=max_shard_size,
            format=format,
            stage=stage,
            dp=dp,
        )
    return outdir.moved(written, tmp, out_dir)


def _convert(
    src: str,
    out_dir: str,
    *,
    to: str,
    source: str,
    tag: str | None,
    dtype: Any,
    max_shard_size: Any,
    format: str | None,
    stage: int | None,
    dp: int | None,
) -> list[str]:
    """:func:`convert` into the new directory ``out_dir``."""
    if source not in (*ds_convert.SOURCES, "universal"):
        raise ValueError(f"source={source!r} is not one of {[*ds_convert.SOURCES, 'universal']}")
    if to == "deepspeed":
        return ds_write.write_deepspeed(src, out_dir, stage=stage, dp=dp, tag=tag, source=source)
    if to == "universal" and stage is None and dp is None:
        return ds_universal.write_universal(src, out_dir, tag=tag, source=source)
    if stage is not None or dp is not None:
        raise ValueError(f"stage={stage!r} / dp={dp!r}: only for to='deepspeed', not to={to!r}")
    uni = ds_write.locate_universal(src, tag, source) if to in ("dcp", "hf") else None
    if uni is not None:
        return _from_universal(uni, out_dir, to, dtype=dtype, max_shard_size=max_shard_size, format=format)
    if to == "dcp":
        kind, path = ds_convert.locate(src, tag, source)
        if kind != "llmpar":
            raise ValueError(
                f"to='dcp' converts llmpar checkpoints; {path} is DeepSpeed's: load it into an engine "
                "(engine.load_checkpoint), save, and convert that"
            )
        dcp_convert.to_dcp(path, out_dir)
        return sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir))
    if to != "hf":
        raise ValueError(
            f"to={to!r}: convert writes 'hf' (HuggingFace's layout), 'deepspeed', 'universal' "
            "(DeepSpeed's) or 'dcp' (torch.distributed.checkpoint); a DeepSpeed or DCP checkpoint loads "
            "into llmpar as it is (engine.load_checkpoint)"
        )
    target = hf_files.parse_dtype(dtype)
    hf_files.parse_size(max_shard_size)
    hf_files.parse_format(format)
    kind, path = ds_convert.locate(src, tag, source)
    if kind == "deepspeed" and hf_files.parse_format(format) == "safetensors":  # streamed, bounded memory
        return ds_convert.write_hf(path, out_dir, dtype=target, max_shard_size=max_shard_size)
    if kind == "deepspeed":
        state, model = ds_convert.state_dict(path, target), {}
    else:
        state, meta = _read(path, None, target)
        model = meta.get("model", {})
    written = hf_files.write_hf_model(
        out_dir,
        state,
        config=model.get("hf_config"),
        generation_config=model.get("hf_generation_config"),
        max_shard_size=max_shard_size,
        format=format,
    )
    ds_convert.verify(state, written)
    return written


def _from_universal(path: str, out_dir: str, to: str, **hf: Any) -> list[str]:
    """Universal checkpoint ``path`` as HuggingFace weights (the fp32 masters, tied names, buffers and frozen params;
    every tensor read back and compared) or as a DCP directory (masters, Adam moments, steps, hyper-parameters per
    param group)."""
    s = ds_write.open_source(path, None, "universal")
    names = [n for g in s.groups for n in g]
    model = {n: s.full(n, "master").view(s.shapes[n]) for n in names}
    if to == "dcp":
        moments = {n: {k: s.full(n, k).view(s.shapes[n]) for k in dcp_format.MOMENTS} for n in names}
        hyper = {
            n: {k: (tuple(h[k]) if k == "betas" else h[k]) for k in ("lr", "betas", "eps", "weight_decay")}
            for g, h in zip(s.groups, s.hyper)
            for n in g
        }
        dcp_format.write_dcp(out_dir, {**model, **s.buffers, **s.frozen}, moments, dict.fromkeys(names, s.step), hyper)
        return sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir))
    target = hf_files.parse_dtype(hf["dtype"])
    state = {n: t.to(target) if target is not None and t.dtype != torch.float64 else t for n, t in model.items()}
    for alias, name in getattr(s, "aliases", {}).items():
        if name in state:
            state[alias] = state[name]
    for n, t in {**s.buffers, **s.frozen}.items():
        state.setdefault(
            n, t.to(target) if target is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        )
    written = hf_files.write_hf_model(out_dir, state, max_shard_size=hf["max_shard_size"], format=hf["format"])
    ds_convert.verify(state, written)
    return written


def _convert_cli(args: argparse.Namespace) -> int:
    try:
        paths = convert(
            args.src,
            args.dst,
            to=args.to,
            source=args.source,
            tag=args.tag,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            format=args.format,
            stage=args.stage,
            dp=args.dp,
            overwrite=args.overwrite,
        )
    except (CheckpointError, OSError, ValueError, ImportError) as e:
        print(f"llmpar checkpoint convert: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


def _size_arg(text: str) -> str:
    try:
        hf_files.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("max_shard_size=")) from None
    return text


def _run(args: argparse.Namespace) -> int:
    try:
        paths = consolidate(
            args.dir,
            args.out,
            args.tag,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            format=args.format,
            overwrite=args.overwrite,
        )
    except (CheckpointError, OSError, ValueError, ImportError) as e:
        print(f"llmpar checkpoint consolidate: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


def _publish(args: argparse.Namespace) -> int:
    try:
        path = publish.publish_written(args.dir, args.tag)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"llmpar checkpoint publish: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("checkpoint", help="work with sharded checkpoints (consolidate, convert, publish)")
    sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    sub.required = True
    c = sub.add_parser(
        "consolidate",
        help="write a checkpoint's weights as a HuggingFace model directory (safetensors shards + index, config.json)",
    )
    c.add_argument("dir", help="a checkpoint directory, or the save directory (its 'latest', or --tag)")
    c.add_argument(
        "out",
        help="output directory: model.safetensors (or shards + model.safetensors.index.json), "
        "config.json and generation_config.json for a HuggingFace model",
    )
    c.add_argument("--tag", default=None, help="checkpoint tag inside DIR (default: DIR/latest)")
    c.add_argument(
        "--dtype",
        default="fp32",
        choices=sorted(hf_files.DTYPES) + ["keep"],
        help="dtype of float tensors: bf16, fp16 or fp32 (the default: from the fp32 master when the run "
        "kept one); 'keep' keeps the saved dtype",
    )
    c.add_argument(
        "--max-shard-size",
        default=hf_files.DEFAULT_SHARD_SIZE,
        type=_size_arg,
        help="largest shard, e.g. 5GB (the default, HuggingFace's), 500MB, 2GiB or bytes",
    )
    c.add_argument(
        "--format",
        default=None,
        choices=sorted(hf_files.FORMATS),
        help="safetensors (the default when installed) or bin (pytorch_model.bin, torch.save)",
    )
    c.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty output directory whole (refused otherwise)"
    )
    c.set_defaults(func=_run)
    v = sub.add_parser(
        "convert",
        help="convert a DeepSpeed or llmpar checkpoint (auto-detected) to HuggingFace's "
        "layout, every tensor written read back and compared",
    )
    v.add_argument("src", help="a checkpoint directory, or the save directory (its 'latest', or --tag)")
    v.add_argument("dst", help="output directory")
    v.add_argument(
        "--to",
        default="hf",
        choices=["hf", "deepspeed", "universal", "dcp"],
        help="output layout: hf (safetensors shards + index), deepspeed (its ZeRO 1-3 files), universal "
        "(DeepSpeed's universal checkpoint, loaded with checkpoint.load_universal at any dp) or dcp "
        "(torch.distributed.checkpoint for FSDP2 / torchtitan; from an llmpar checkpoint)",
    )
    v.add_argument(
        "--stage",
        type=int,
        default=None,
        choices=[1, 2, 3],
        help="--to deepspeed: the ZeRO stage to write for (default: the source's, 0 -> 1)",
    )
    v.add_argument(
        "--dp", type=int, default=None, help="--to deepspeed: the data-parallel degree (default: the source's)"
    )
    v.add_argument(
        "--from",
        dest="source",
        default="auto",
        choices=[*ds_convert.SOURCES, "universal"],
        help="source layout (default: detected)",
    )
    v.add_argument("--tag", default=None, help="checkpoint tag inside SRC (default: SRC/latest)")
    v.add_argument(
        "--dtype",
        default="fp32",
        choices=sorted(hf_files.DTYPES) + ["keep"],
        help="dtype of float tensors (default fp32, from the fp32 masters); 'keep': as saved",
    )
    v.add_argument(
        "--max-shard-size",
        default=hf_files.DEFAULT_SHARD_SIZE,
        type=_size_arg,
        help="largest shard, e.g. 5GB (the default), 500MB or bytes",
    )
    v.add_argument(
        "--format",
        default=None,
        choices=sorted(hf_files.FORMATS),
        help="safetensors (the default when installed) or bin",
    )
    v.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty output directory whole (refused otherwise)"
    )
    v.set_defaults(func=_convert_cli)
    u = sub.add_parser(
        "publish",
        help="publish a save left in DIR/.tmp-TAG (its run ended before the publish) once "
        "every rank's file is there; DIR/latest then names it",
    )
    u.add_argument("dir", help="the save directory")
    u.add_argument("tag", help="the tag of the unpublished save (DIR/.tmp-TAG)")
    u.set_defaults(func=_publish)
