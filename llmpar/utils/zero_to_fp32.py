"""``deepspeed.utils.zero_to_fp32`` on llmpar checkpoints: one full-precision state dict from the sharded shards of
any dp / tp / pp degree and ZeRO stage, on one process (``llmpar.checkpoint.consolidate``).

    from llmpar.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint("ckpts")          # ckpts/latest, or tag="global_step100"
    model.load_state_dict(state)
    python -m llmpar.utils.zero_to_fp32 ckpts out/ [--tag T] [--safe_serialization] [--max_shard_size 5GB]

Trained params come from the fp32 masters when the run kept them, else from the params (float64 ones stay float64);
module buffers and frozen params from the saved files. Tied weights appear once, under the first name.
``exclude_frozen_parameters=True`` is refused: llmpar checkpoints do not record which saved untrained tensors are
frozen params rather than buffers (save with ``engine.save_checkpoint(..., exclude_frozen_parameters=True)``).
Output files: as DeepSpeed's (``pytorch_model.bin`` or ``model.safetensors``; above ``max_shard_size``
``pytorch_model-00001-of-0000N.bin`` ... with ``pytorch_model.bin.index.json``, HuggingFace's layout).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from llmpar.checkpoint.consolidate import consolidated_state_dict
from llmpar.checkpoint.formats.hf.files import parse_dtype, write_hf_model


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str, tag: str | None = None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict[str, torch.Tensor]:
    """{name: full tensor} (float params as float32, on the CPU) of the checkpoint ``checkpoint_dir/tag`` (default:
    the one ``checkpoint_dir/latest`` names; a checkpoint directory itself works too). ``lazy_mode`` is accepted
    (the tensors are real)."""
    if exclude_frozen_parameters:
        raise ValueError(
            "exclude_frozen_parameters=True is not supported: llmpar checkpoints do not record which "
            "untrained tensors are frozen params; drop them from the returned dict, or save with "
            "engine.save_checkpoint(..., exclude_frozen_parameters=True)"
        )
    return consolidated_state_dict(checkpoint_dir, tag, dtype=torch.float32)


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    dtype: Any = torch.float32,
    max_shard_size: Any = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """Write the consolidated state dict (float params in ``dtype``) to ``output_dir`` as DeepSpeed does (through
    ``llmpar.checkpoint.formats.hf.files``, HuggingFace's layout); returns the files written (shards, then the
    index)."""
    if exclude_frozen_parameters:
        get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters=True)
    target = parse_dtype(dtype)
    if target is None:
        raise ValueError(f"dtype={dtype!r} must be float32, float16 or bfloat16 (a torch dtype or its name)")
    state = consolidated_state_dict(checkpoint_dir, tag, dtype=target)
    return write_hf_model(
        output_dir,
        state,
        max_shard_size=max_shard_size if max_shard_size is not None else 2**62,
        format="safetensors" if safe_serialization else "bin",
    )


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: Any = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """:func:`convert_zero_checkpoint_to_state_dict` in float32."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir, output_dir, torch.float32, max_shard_size, safe_serialization, tag, exclude_frozen_parameters
    )


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str, tag: str | None = None) -> nn.Module:
    """Move ``model`` to the CPU and load the consolidated fp32 state dict into it (``strict=False``, as DeepSpeed);
    returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="consolidate an llmpar checkpoint into one fp32 state dict")
    p.add_argument("checkpoint_dir", help="the save directory (its 'latest', or --tag) or a checkpoint directory")
    p.add_argument("output_dir", help="where pytorch_model.bin / model.safetensors (and shards) go")
    p.add_argument("--tag", default=None)
    p.add_argument("--max_shard_size", default="5GB")
    p.add_argument("--safe_serialization", action="store_true")
    p.add_argument("--exclude_frozen_parameters", action="store_true")
    a = p.parse_args(argv)
    for path in convert_zero_checkpoint_to_fp32_state_dict(
        a.checkpoint_dir, a.output_dir, a.max_shard_size, a.safe_serialization, a.tag, a.exclude_frozen_parameters
    ):
        print(path)
    return 0


__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
]

if __name__ == "__main__":
    raise SystemExit(main())
