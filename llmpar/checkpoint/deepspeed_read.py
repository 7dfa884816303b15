"""A checkpoint directory written by DeepSpeed's ``engine.save_checkpoint``, opened as the reader of the layout it
holds, each answering the same questions (the checkpoint protocol's terms: names, shapes, states, counters):

    :class:`~llmpar.checkpoint.ds_rank_read.RankCheckpoint`                one model-parallel rank: ZeRO 0-3 (the layout
                                                                          is described there)
    :class:`~llmpar.checkpoint.ds_pipe_read.DeepSpeedPipelineCheckpoint`   ``layer_*`` files: a pipeline, its stages
    :class:`~llmpar.checkpoint.ds_mp_read.DeepSpeedTPCheckpoint`           files of mp ranks > 0 and no layer files: a
                                                                          model made tensor-parallel through an mpu
"""

from __future__ import annotations

from typing import Any

from llmpar.checkpoint.ds_files import LAYER_RE, MODEL_RE, OPTIM_RE, detect
from llmpar.checkpoint.ds_mp_read import DeepSpeedTPCheckpoint
from llmpar.checkpoint.ds_pipe_read import DeepSpeedPipelineCheckpoint
from llmpar.checkpoint.ds_rank_read import DS_KEYS, MOMENTS, RankCheckpoint


class DeepSpeedCheckpoint(RankCheckpoint):
    """``DeepSpeedCheckpoint(path, **kwargs)``: the reader of the layout directory ``path`` holds (module docstring);
    a plain one (a single model-parallel rank) is this class."""

    def __new__(cls, path: str, mp_rank: int | None = None, **kwargs: Any) -> Any:
        found = detect(path) if mp_rank is None else []
        if any(LAYER_RE.match(f) for f in found):
            return DeepSpeedPipelineCheckpoint(path, **kwargs)
        if any((m := MODEL_RE.match(f) or OPTIM_RE.match(f)) and int(m.groups()[-1]) > 0 for f in found):
            return DeepSpeedTPCheckpoint(path, **kwargs)
        return object.__new__(cls)


__all__ = ["DS_KEYS", "MOMENTS", "DeepSpeedCheckpoint"]
