"""Tensor parallelism: column/row-parallel linears, vocab-parallel embedding and cross-entropy, autograd
collectives, and ``parallelize`` to swap them into existing models. Groups are always passed explicitly."""

from llmpar.distributed.errors import TokenIdError
from llmpar.tensor_parallel.comm import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tensor_region,
)
from llmpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from llmpar.tensor_parallel.embedding import VocabParallelEmbedding
from llmpar.tensor_parallel.grad_norm import clip_grad_norm_
from llmpar.tensor_parallel.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from llmpar.tensor_parallel.parallelize import DEFAULT_PLANS, GPT_PLAN, LLAMA_PLAN, parallelize

__all__ = [
    "ColumnParallelLinear",
    "clip_grad_norm_",
    "DEFAULT_PLANS",
    "GPT_PLAN",
    "LLAMA_PLAN",
    "ParallelLMHead",
    "RowParallelLinear",
    "TokenIdError",
    "VocabParallelEmbedding",
    "copy_to_tensor_region",
    "gather_from_sequence_region",
    "gather_from_tensor_region",
    "parallelize",
    "reduce_from_tensor_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tensor_region",
    "vocab_parallel_cross_entropy",
]
