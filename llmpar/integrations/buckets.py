"""The ``"auto"`` ZeRO bucket sizes of a DeepSpeed config, from the model's hidden size ``h``, as transformers and
accelerate derive them for DeepSpeed (one rule for both integrations):

    zero_optimization.reduce_bucket_size                 h * h
    zero_optimization.stage3_prefetch_bucket_size        int(0.9 * h * h)
    zero_optimization.stage3_param_persistence_threshold 10 * h

``h`` is the model's ``config.hidden_size`` (or the largest of ``hidden_sizes``), else its ``config.text_config``'s
(a multimodal model's language part).
"""

from __future__ import annotations

from typing import Any

BUCKET_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


def hidden_size(model: Any) -> int | None:
    """The model's ``config.hidden_size`` (or the largest of ``hidden_sizes``; a ``text_config``'s), else None."""
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if isinstance(getattr(c, "hidden_size", None), int):
            return c.hidden_size
        if getattr(c, "hidden_sizes", None):
            return max(c.hidden_sizes)
    return None


def bucket_sizes(hidden: int) -> dict[str, int]:
    """{key of :data:`BUCKET_KEYS`: its size} for hidden size ``hidden`` (module docstring)."""
    return dict(zip(BUCKET_KEYS, (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)))


__all__ = ["BUCKET_KEYS", "bucket_sizes", "hidden_size"]
