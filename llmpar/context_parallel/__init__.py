"""Context parallelism: the sequence dimension split over sp ranks (Ulysses all-to-all, ring attention, hybrid).

:class:`ContextParallel` shards a sequence (:meth:`~ContextParallel.shard` -> :class:`SeqShard`, applied to tensors
by :func:`shard_tensor`), runs attention over the whole sequence from each rank's part
(:meth:`~ContextParallel.attention`) and reduces the loss to the full-sequence token mean
(:meth:`~ContextParallel.token_mean`). Same floor as ``tensor_parallel``: it uses ``ops`` and ``distributed`` only.
"""

from llmpar.context_parallel.core import ContextParallel
from llmpar.context_parallel.ring import RingStats
from llmpar.context_parallel.shard import MODES, SeqShard, layout, padded_length, shard_tensor

__all__ = ["MODES", "ContextParallel", "RingStats", "SeqShard", "layout", "padded_length", "shard_tensor"]
