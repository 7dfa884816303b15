"""The foreign checkpoint formats, one package each, behind one reader protocol (``source.py``):

    source.py      the protocol every reader answers (names, shapes, hyper-parameters, step, counters, buffers,
                   pieces of each state) and which layout a directory holds (``detect``, ``find``, ``locate``)
    llmpar.py      llmpar's own checkpoints as a reader (what ``convert`` and ``consolidate`` read)
    loader.py      any reader loaded into an engine through the checkpoint protocol, written once
    deepspeed/     DeepSpeed's files (``files``), one model-parallel rank (``rank``), a pipeline (``pipeline``,
                   ``pipeline_names``), a tensor-parallel one (``tensor_parallel``), the reader of a directory and
                   the check of its files (``open``), its ZeRO layout written (``write``) and loaded (``load``)
    universal/     DeepSpeed's universal layout: ``read``, ``write``
    dcp/           ``torch.distributed.checkpoint``: ``format`` (the reader), ``load``, ``write``
    hf/            HuggingFace's layout: ``files`` (a state dict as ``from_pretrained`` loads it), ``stream``
                   (safetensors written from pieces), ``write`` (any reader as HF weights), ``load`` (HF weights
                   into an engine)

Formats use llmpar's own checkpoint code (``llmpar.checkpoint``'s files, views, reshard rules), never the reverse:
``load_checkpoint`` reaches a foreign checkpoint only through :func:`load`, what this package exports.
"""

from __future__ import annotations

from llmpar.checkpoint.formats.dcp import load as dcp_load
from llmpar.checkpoint.formats.deepspeed import load as deepspeed_load
from llmpar.checkpoint.formats.loader import load_source
from llmpar.checkpoint.formats.source import Located, find
from llmpar.checkpoint.formats.universal.read import UniversalCheckpoint
from llmpar.checkpoint.protocol import Checkpointable
from llmpar.checkpoint.view import EngineView


def load(
    engine: Checkpointable, view: EngineView, found: Located, *, strict: bool, scheduler: bool
) -> tuple[str, dict | None]:
    """Load the foreign checkpoint ``found`` (:func:`find`, agreed by every rank) into ``engine`` with its format's
    loader; returns ``(path, client_state)``."""
    if found.format == "dcp":
        return dcp_load.load(engine, view, found.path, strict=strict, scheduler=scheduler)
    if found.format == "universal":
        return load_source(
            engine,
            view,
            found.path,
            lambda: UniversalCheckpoint(found.path),
            strict=strict,
            scheduler=scheduler,
            what="universal",
        )
    return deepspeed_load.load(engine, view, found.path, strict=strict, scheduler=scheduler)


__all__ = ["Located", "find", "load"]
