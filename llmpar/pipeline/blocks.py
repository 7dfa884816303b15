"""A model as a sequence of blocks, the unit a pipeline split cuts at.

``to_blocks(model)`` returns ``[(name, module), ...]`` whose modules, applied one after the other, compute the model:

* anything with a ``pipeline_blocks()`` method returning such a list (llmpar's ``GPT`` has one: ``embed``,
  ``blocks.0`` ... ``blocks.{n-1}``, ``head``);
* ``nn.Sequential``: its children, named by their keys.

The blocks hold the model's own submodules (no copies), so parameter sharing (tied embeddings) stays visible to
the split, and tensor-parallel plans still match the original module names (``tok_emb``, ``attn.qkv``, ``lm_head``).
"""

from __future__ import annotations

from torch import nn

from llmpar.models.anatomy import pipeline_sequence


def to_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model as an ordered list of ``(name, block)``; see the module docstring for what is accepted (the rule:
    :func:`llmpar.models.anatomy.pipeline_sequence`)."""
    return pipeline_sequence(model)


class StageModule(nn.Sequential):
    """The blocks of one pipeline stage, applied in order. Child names are the block names with ``.`` -> ``_``
    (``blocks.3`` -> ``blocks_3``), so parameter names read ``blocks_3.attn.qkv.weight``."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], *, stage_index: int, block_names: list[str]) -> None:
        super().__init__()
        for name, block in blocks:
            self.add_module(stage_key(name), block)
        self.stage_index = stage_index
        self.block_names = list(block_names)


def stage_key(block_name: str) -> str:
    return block_name.replace(".", "_")


__all__ = ["StageModule", "stage_key", "to_blocks"]
