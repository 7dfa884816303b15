"""Text shipped with llmpar, a byte-level tokenizer, and a deterministic data-parallel batch loader."""

from llmpar.data.loader import BatchLoader
from llmpar.data.text import DEFAULT_TEXT, ByteTokenizer, available_texts, load_text, load_tokens

__all__ = ["BatchLoader", "ByteTokenizer", "DEFAULT_TEXT", "available_texts", "load_text", "load_tokens"]
