"""The model's weights from a sharded checkpoint, on one process (no ranks needed), in HuggingFace's layout.

    llmpar checkpoint consolidate ckpts/global_step100 out/      # or ckpts (its `latest`)
    -> out/model.safetensors (or model-0000k-of-0000n.safetensors + model.safetensors.index.json above
       --max-shard-size, default 5GB) and, for a HuggingFace model, out/config.json (+ generation_config.json):
       AutoModelForCausalLM.from_pretrained("out") loads it
    llmpar checkpoint consolidate ckpts out/ --dtype bf16         # float tensors in bf16 (default fp32; keep: as saved)
    llmpar checkpoint consolidate ckpts out/ --format bin         # pytorch_model.bin (torch.save) instead

Each trained param is rebuilt whole from the shards by name (``CheckpointReader.full``: a tensor-parallel param is
concatenated over the saved tp ranks along its split dim, vocabulary padding dropped; a pipeline checkpoint already
names params as the unsplit model does, a tied weight once), from the fp32 master when the run kept one, else from the
params, cast to ``dtype`` (default float32: the full-precision weights, as DeepSpeed's ``zero_to_fp32``; float64 stays
float64); persistent module buffers and frozen params come from dp rank 0's files (a checkpoint written before llmpar
left non-persistent buffers out still holds those and they are written too). Names are the model's own
(``model.named_parameters()``); a tied weight appears once, under its first name. The files are written by
``formats/hf/write.py`` (``write_hf_model``'s files, every tensor read back and compared), ``config.json`` from the
HuggingFace config the engine recorded in ``metadata.json`` (none for an older checkpoint or a model without one).
``metadata.json``'s digest and fields (``metacheck``) and every file's sha256 are verified first (``formats/llmpar.py``,
the reader).

``convert.py`` writes a checkpoint of any layout in any other; ``cli.py`` is the ``llmpar checkpoint`` command.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from llmpar.checkpoint import files, outdir
from llmpar.checkpoint.formats.hf import files as hf_files
from llmpar.checkpoint.formats.hf.write import write_hf
from llmpar.checkpoint.formats.llmpar import LlmparCheckpoint
from llmpar.checkpoint.formats.source import weights


def _open(path: str, tag: str | None) -> LlmparCheckpoint:
    """The llmpar checkpoint ``path`` names (a checkpoint dir, or a save dir with ``latest`` / ``tag``), every file
    verified."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, files.METADATA)) and tag is None:
        return LlmparCheckpoint(path)
    return LlmparCheckpoint(files.resolve(path, tag)[1])


def consolidated_state_dict(
    path: str, tag: str | None = None, *, dtype: torch.dtype | None = torch.float32
) -> dict[str, torch.Tensor]:
    """{name: full tensor} of checkpoint ``path`` (a checkpoint dir, or a save dir with ``latest`` / ``tag``).
    dtype: float params are cast to it (float64 ones kept; buffers and frozen params as saved); None keeps the
    saved dtype."""
    return weights(_open(path, tag), dtype, copy=True, extras_as_saved=True)


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
    src = _open(path, tag)
    with outdir.staged(out_dir, overwrite=overwrite, source=path, what="consolidate") as tmp:
        written = write_hf(src, tmp, dtype=target, max_shard_size=max_shard_size, format=format)
    return outdir.moved(written, tmp, out_dir)


__all__ = ["consolidate", "consolidated_state_dict"]
