"""Sharded, atomic, reshardable checkpoints of an engine (``llmpar.Engine``, ``llmpar.PipelineEngine``), and the
checkpoints of other stacks read and written by name.

    path = engine.save_checkpoint("ckpts", client_state={"data_pos": 1234})   # every rank writes its own shards
    path, client_state = engine.load_checkpoint("ckpts")       # latest; any dp / tp / pp degree, ZeRO stage, offload
    engine.save_checkpoint("ckpts", async_save=True); ...train...; engine.wait_checkpoint()  # written by a thread
    llmpar checkpoint consolidate ckpts/global_step100 out/     # HF layout: model*.safetensors (+ index), config.json
    llmpar checkpoint convert ds_ckpts out/ --to universal       # any layout to any other (hf, deepspeed, dcp too)

llmpar's own format, on the lower floor (it never imports ``formats/``, but for ``load.py``'s dispatch):

    protocol.py    the typed seam: what an engine (``Checkpointable``) and its optimizer (``CheckpointOptimizer``)
                   show a checkpoint; nothing else of theirs is read here (no import of ``llmpar.zero``,
                   ``llmpar.pipeline`` or ``llmpar.runtime``)
    view.py        one save's or load's view of an engine (grid, params under the unsplit model's names)
    files.py       on-disk layout, checksums, accepted tags and resolving one, ``latest``, agreement between ranks
    metacheck.py   ``metadata.json`` written with its digest, read back and checked field by field before a load
    blockfile.py   the rank files (raw tensors, hashed per block; verified per block as read); ``blockwrite.py``
                   writes them
    shards.py      what a rank file holds and how any saved layout is cut back into named param ranges
    reshard.py     tensor-parallel splits recorded per param and cut for another tp
    publish.py     the publish (crash-safe at every instant), the one directory swap, cleaning up after failures;
                   ``outdir.py``: an export's output directory built beside and swapped in whole
    tags.py        which directory a ``(load_dir, tag)`` names, for the readers of other layouts
    save.py        the collective save; ``pending.py``: a save between its snapshot and its publish
    load.py        the collective load (``plan.py``: what one rank reads, checked first); a foreign checkpoint goes
                   to ``formats.load``

Other stacks' formats (``formats/``, above the core): ``formats/source.py`` is the one reader protocol, with one
reader per format (llmpar's own, DeepSpeed's, universal, DCP), one loader into an engine written once
(``formats/loader.py``) and one writer per format (DeepSpeed, universal, DCP, HuggingFace). On top:
``consolidate.py`` (an llmpar checkpoint's full weights, HuggingFace's layout), ``convert.py`` (any reader to any
writer), ``scan.py`` (the complete checkpoints of a save directory, for ``auto_resume``) and ``cli.py`` (the
``llmpar checkpoint`` command).
"""

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.hf.load import load_hf_weights
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
