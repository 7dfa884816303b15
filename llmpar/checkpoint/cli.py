"""``llmpar checkpoint``: the command over ``consolidate.py``, ``convert.py`` and ``publish.py``.

    llmpar checkpoint consolidate ckpts/global_step100 out/      # HF layout: model*.safetensors (+ index), config.json
    llmpar checkpoint convert ds_ckpts out/ --to hf              # any layout (detected): hf, deepspeed, universal, dcp
    llmpar checkpoint publish ckpts global_step100               # a save whose publish never ran (ckpts/.tmp-TAG)

Each prints the paths it wrote (one a line) and exits 0; an error is one line on stderr naming the problem, exit 1
(bad flags: argparse's exit 2).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmpar.checkpoint import consolidate, convert, publish
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.hf import files as hf_files
from llmpar.checkpoint.formats.source import SOURCES


def _convert_cli(args: argparse.Namespace) -> int:
    try:
        paths = convert.convert(
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
        paths = consolidate.consolidate(
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
    what = (
        "convert a checkpoint (llmpar's, DeepSpeed's ZeRO / pipeline / tensor-parallel or universal, detected or "
        "--from) to HuggingFace's layout, DeepSpeed's ZeRO or universal layout, or a torch.distributed.checkpoint "
        "directory (--to); every tensor written is read back and compared with the source (dcp: the source's files "
        "verified first), and the output directory is swapped in whole"
    )
    v = sub.add_parser("convert", help=what, description=what)
    v.add_argument("src", help="a checkpoint directory, or the save directory (its 'latest', or --tag)")
    v.add_argument("dst", help="output directory")
    v.add_argument(
        "--to",
        default="hf",
        choices=list(convert.TARGETS),
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
        choices=list(SOURCES),
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


__all__ = ["register"]
