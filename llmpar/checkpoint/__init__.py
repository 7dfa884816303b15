"""Sharded, atomic, reshardable checkpoints of an :class:`llmpar.engine.Engine` or a pipeline ``PipelineEngine``.

    path = engine.save_checkpoint("ckpts", client_state={"data_pos": 1234})   # every rank writes its own shards
    path, client_state = engine.load_checkpoint("ckpts")       # latest; any dp / tp / pp degree, ZeRO stage, offload
    engine.save_checkpoint("ckpts", async_save=True); ...train...; engine.wait_checkpoint()  # written by a thread
    llmpar checkpoint consolidate ckpts/global_step100 out/     # HF layout: model*.safetensors (+ index), config.json

``protocol.py``: the typed seam, what an engine (``Checkpointable``) and its optimizer (``CheckpointOptimizer``) show
a checkpoint: nothing else of theirs is read here, and this package imports neither ``llmpar.zero`` nor
``llmpar.pipeline``; ``files.py``: on-disk layout, checksums, ``metadata.json`` and its digest, accepted tags and
resolving one, agreement between ranks; ``metacheck.py``: every field of ``metadata.json`` a reader uses, checked
before a load; ``blockfile.py``: the rank files (raw tensors hashed per block while written, verified per block as
read); ``publish.py``: the publish (crash-safe at every instant), publishing a save left pending (``llmpar checkpoint
publish``), cleaning up after failures; ``shards.py``: what a rank file holds and how any saved layout is cut back
into named param ranges; ``reshard.py``: tensor-parallel splits recorded per param and cut for another tp;
``view.py``: one save's or load's view of an engine (grid, params under the unsplit model's names); ``save.py`` /
``load.py``: the collective save and load; ``consolidate.py``: the single-process consolidation and its CLI command;
``hf_files.py``: a full state dict written as HuggingFace's ``from_pretrained`` loads it (safetensors shards + index,
tied weights once, config.json), for ``consolidate`` and ``engine.save_hf_model``.
"""

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.hf_load import load_hf_weights
from llmpar.checkpoint.load import load_checkpoint
from llmpar.checkpoint.pending import wait_checkpoint
from llmpar.checkpoint.protocol import Checkpointable, CheckpointOptimizer, Grid
from llmpar.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointOptimizer",
    "Checkpointable",
    "Grid",
    "load_checkpoint",
    "load_hf_weights",
    "save_checkpoint",
    "wait_checkpoint",
]
