"""Plain text shipped with the package, and a byte-level tokenizer.

The corpus (``shakespeare.txt``, ~300 KB of ASCII) is public domain; README.md beside this file says where it is from.
"""

from __future__ import annotations

from importlib import resources

import torch

DEFAULT_TEXT = "shakespeare"


def available_texts() -> list[str]:
    """Names of the texts shipped in ``llmpar/data`` (file names without ``.txt``)."""
    root = resources.files("llmpar.data")
    return sorted(p.name[: -len(".txt")] for p in root.iterdir() if p.name.endswith(".txt"))


def load_text(name: str = DEFAULT_TEXT) -> str:
    """The shipped text ``name`` (see :func:`available_texts`) as a string."""
    names = available_texts()
    if name not in names:
        raise ValueError(f"text {name!r} is not shipped with llmpar; available: {names}")
    return resources.files("llmpar.data").joinpath(f"{name}.txt").read_text(encoding="utf-8")


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``vocab_size = 256``, no state, round-trips any text exactly."""

    vocab_size: int = 256

    def encode(self, text: str) -> torch.Tensor:
        """text -> ids [n_bytes] (int64)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        data = bytearray(text.encode("utf-8"))
        if not data:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """ids [n] with values in [0, 256) -> text (invalid UTF-8 sequences become U+FFFD)."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [v for v in values if not 0 <= v < 256]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the byte vocabulary [0, 256)")
        return bytes(values).decode("utf-8", errors="replace")


def load_tokens(name: str = DEFAULT_TEXT) -> torch.Tensor:
    """The shipped text ``name`` tokenized with :class:`ByteTokenizer`: [n_bytes] (int64)."""
    return ByteTokenizer().encode(load_text(name))
