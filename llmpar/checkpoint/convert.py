"""``llmpar checkpoint convert SRC DST --to hf | deepspeed | universal | dcp``: a checkpoint of any layout written in
any other, through the reader protocol (``formats/source.py``): the source is located and opened by its format's
reader (``--from``: "auto", detected, or the layout it must be: llmpar's, DeepSpeed's, universal), then one writer
takes it, whatever it is (N readers, M writers: no path between two formats):

    hf          ``formats/hf/write.py``         HuggingFace's layout, as ``consolidate`` writes it (safetensors from a
                                                memory-mapped source streamed in pieces; ``config.json`` from an
                                                llmpar checkpoint that recorded one)
    deepspeed   ``formats/deepspeed/write.py``  DeepSpeed's ZeRO-``stage`` layout for ``dp`` ranks (defaults: the
                                                source's)
    universal   ``formats/universal/write.py``  DeepSpeed's universal layout (``checkpoint.load_universal``)
    dcp         ``formats/dcp/write.py``        a ``torch.distributed.checkpoint`` directory FSDP2 / torchtitan load
                                                (from an llmpar or a universal checkpoint)

Every file written is read back and each tensor compared with the source (dcp: the source's files are verified
before anything is written). ``out_dir`` is built beside and swapped in whole once every file is written and checked
(``outdir.py``): a non-empty one is refused unless ``overwrite``, an interrupted convert leaves it as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from llmpar.checkpoint import outdir
from llmpar.checkpoint.formats.dcp.write import to_dcp
from llmpar.checkpoint.formats.deepspeed.write import write_deepspeed
from llmpar.checkpoint.formats.hf import files as hf_files
from llmpar.checkpoint.formats.hf.write import write_hf
from llmpar.checkpoint.formats.open import open_source
from llmpar.checkpoint.formats.source import SOURCES, locate
from llmpar.checkpoint.formats.universal.write import write_universal

TARGETS = ("hf", "deepspeed", "universal", "dcp")


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
    """Convert checkpoint ``src`` (``source``: "auto", "deepspeed", "llmpar" or "universal") to ``to`` ("hf":
    HuggingFace's layout, ``dtype`` / ``max_shard_size`` / ``format`` as :func:`consolidate.consolidate` takes them;
    "deepspeed": DeepSpeed's ZeRO-``stage`` layout for ``dp`` ranks; "universal"; "dcp") in ``out_dir`` (module
    docstring). Returns the paths written."""
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
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is not one of {list(SOURCES)}")
    if to == "deepspeed":
        return write_deepspeed(src, out_dir, stage=stage, dp=dp, tag=tag, source=source)
    if to == "universal" and stage is None and dp is None:
        return write_universal(src, out_dir, tag=tag, source=source)
    if stage is not None or dp is not None:
        raise ValueError(f"stage={stage!r} / dp={dp!r}: only for to='deepspeed', not to={to!r}")
    if to not in TARGETS:
        raise ValueError(
            f"to={to!r}: convert writes 'hf' (HuggingFace's layout), 'deepspeed', 'universal' "
            "(DeepSpeed's) or 'dcp' (torch.distributed.checkpoint); a DeepSpeed or DCP checkpoint loads "
            "into llmpar as it is (engine.load_checkpoint)"
        )
    found = locate(src, tag, source)
    if to == "dcp":
        if found.format == "deepspeed":
            raise ValueError(
                f"to='dcp' converts llmpar checkpoints; {found.path} is DeepSpeed's: load it into an engine "
                "(engine.load_checkpoint), save, and convert that"
            )
        return to_dcp(open_source(found), out_dir)
    target = hf_files.parse_dtype(dtype)  # bad arguments fail before the checkpoint is read
    hf_files.parse_size(max_shard_size)
    fmt = hf_files.parse_format(format)
    reader = open_source(found)
    # streamed from a memory-mapped source (bounded memory); llmpar's reader holds a param whole (tp shards merged)
    stream = fmt == "safetensors" and reader.format != "llmpar"
    return write_hf(reader, out_dir, dtype=target, max_shard_size=max_shard_size, format=format, stream=stream)


__all__ = ["TARGETS", "convert"]
