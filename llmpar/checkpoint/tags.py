"""Which checkpoint directory a ``(load_dir, tag)`` names, for the readers of foreign layouts (DeepSpeed, DCP)."""

from __future__ import annotations

import os
from typing import Any

from llmpar.checkpoint.files import CheckpointError, check_tag, read_latest


def tagged_dir(load_dir: Any, tag: str | None, detect: Any) -> str | None:
    """``load_dir/tag`` (``tag`` None: the tag ``load_dir/latest`` names) when ``detect(path)`` says it is a
    checkpoint of the caller's format; None otherwise (not a path, no such tag, a bad tag, another layout)."""
    if not isinstance(load_dir, (str, os.PathLike)):
        return None
    load_dir = os.fspath(load_dir)
    try:
        tag = read_latest(load_dir) if tag is None else check_tag(tag)
    except (CheckpointError, TypeError, ValueError):
        return None
    if tag is None:
        return None
    path = os.path.join(load_dir, tag)
    return path if detect(path) else None
