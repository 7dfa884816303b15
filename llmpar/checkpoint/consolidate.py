"""One full-precision state dict from a sharded checkpoint, on one process (no ranks needed).

    llmpar checkpoint consolidate ckpts/global_step100 out/      # or ckpts (its `latest`)
    -> out/pytorch_model.bin  (torch.save of {name: tensor})  and  out/model.safetensors  (when safetensors is there)
    llmpar checkpoint publish ckpts global_step100               # a save whose publish never ran (ckpts/.tmp-TAG)

Each trained param is rebuilt whole from the shards by name (``CheckpointReader.full``: a tensor-parallel param is
concatenated over the saved tp ranks along its split dim, vocabulary padding dropped; a pipeline checkpoint already
names params as the unsplit model does, a tied weight once), from the fp32 master when the run kept one, else from
the params, cast to float32 (float64 stays float64); module buffers and frozen params come from dp rank 0's files.
``model.load_state_dict(torch.load(out/pytorch_model.bin))`` loads it into the plain model (tied weights
appear once, under the first name). ``metadata.json``'s digest and every file's sha256 are verified first.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from llmpar.checkpoint import files, publish
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.reshard import CheckpointReader


def _locate(path: str, tag: str | None) -> str:
    if os.path.isfile(os.path.join(path, files.METADATA)) and tag is None:
        return path
    return files.resolve(path, tag)[1]


def consolidated_state_dict(path: str, tag: str | None = None, *, dtype: torch.dtype | None = torch.float32
                            ) -> dict[str, torch.Tensor]:
    """{name: full tensor} of checkpoint ``path`` (a checkpoint dir, or a save dir with ``latest`` / ``tag``).
    dtype: float params are cast to it (float64 ones kept); None keeps the saved dtype."""
    ckpt = _locate(os.fspath(path), tag)
    meta = files.read_metadata(ckpt)
    for fname, entry in sorted(meta["files"].items()):
        why = files.check_file(ckpt, fname, entry)
        if why is not None:
            raise CheckpointError(f"checkpoint shard {os.path.join(ckpt, fname)} is {why}")
    reader = CheckpointReader(ckpt, meta)
    out: dict[str, torch.Tensor] = {}
    for name, (bi, _, _) in reader.where.items():
        key = "master" if "master" in meta["layout"]["buffers"][bi]["state_keys"] else "params"
        t = reader.full(name, key)
        if dtype is not None and t.is_floating_point() and t.dtype != torch.float64:
            t = t.to(dtype)
        out[name] = t.clone()
    for name, t in reader.extras(reader.tp, 0).items():
        out.setdefault(name, t.clone())
    return out


def consolidate(path: str, out_dir: str, tag: str | None = None, *, dtype: torch.dtype | None = torch.float32
                ) -> list[str]:
    """Write ``out_dir/pytorch_model.bin`` (and ``model.safetensors`` when safetensors is installed); returns paths."""
    state = consolidated_state_dict(path, tag, dtype=dtype)
    os.makedirs(out_dir, exist_ok=True)
    written = [os.path.join(out_dir, "pytorch_model.bin")]
    torch.save(state, written[0])
    try:
        from safetensors.torch import save_file
    except ImportError:
        return written
    written.append(os.path.join(out_dir, "model.safetensors"))
    save_file({k: v.contiguous() for k, v in state.items()}, written[1], metadata={"format": "pt"})
    return written


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "keep": None}


def _run(args: argparse.Namespace) -> int:
    try:
        paths = consolidate(args.dir, args.out, args.tag, dtype=_DTYPES[args.dtype])
    except (CheckpointError, OSError, ValueError) as e:
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
    p = subparsers.add_parser("checkpoint", help="work with sharded checkpoints (consolidate, publish)")
    sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    sub.required = True
    c = sub.add_parser("consolidate", help="write one full-precision state dict from a sharded checkpoint")
    c.add_argument("dir", help="a checkpoint directory, or the save directory (its 'latest', or --tag)")
    c.add_argument("out", help="output directory: pytorch_model.bin and model.safetensors")
    c.add_argument("--tag", default=None, help="checkpoint tag inside DIR (default: DIR/latest)")
    c.add_argument("--dtype", default="float32", choices=sorted(_DTYPES),
                   help="dtype of float tensors (default float32; 'keep' keeps the saved dtype)")
    c.set_defaults(func=_run)
    u = sub.add_parser("publish", help="publish a save left in DIR/.tmp-TAG (its run ended before the publish) once "
                                       "every rank's file is there; DIR/latest then names it")
    u.add_argument("dir", help="the save directory")
    u.add_argument("tag", help="the tag of the unpublished save (DIR/.tmp-TAG)")
    u.set_defaults(func=_publish)
