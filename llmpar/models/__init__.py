"""Models used by the demo, the tests and the benchmarks."""
from llmpar.models.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig, GPTEmbedding, GPTHead, lm_loss

__all__ = ["GPT", "GPTConfig", "GPTEmbedding", "GPTHead", "Block", "CausalSelfAttention", "MLP", "lm_loss"]
