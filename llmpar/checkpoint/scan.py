"""The complete checkpoints a save directory holds, each with the step its own files record (never the name).

    found(save_dir) -> [Found(tag, path, steps, kind)]   llmpar's (``metadata.json``, its digest and fields checked)
                                                        and DeepSpeed's (a model states file's ``global_steps``)
    newest(save_dir) -> Found | None                    the one of most steps; a ``CheckpointError`` naming them when
                                                        several share that step, or when unpublished saves (complete
                                                        ``.tmp-TAG``) or unreadable ones are there

What ``"checkpoint": {"auto_resume": DIR}`` resumes from when ``DIR/latest`` is missing (deleted, ``save_latest=
False``, a run stopped before its first ``latest`` write, checkpoints copied in). A ``.old-TAG`` copy whose ``TAG``
is missing (a re-save stopped between its renames) counts as ``TAG``: ``files.resolve`` loads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from llmpar.checkpoint import files, metacheck, publish
from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.deepspeed import files as ds_files


@dataclass(frozen=True)
class Found:
    tag: str
    path: str
    steps: int  # the engine's global_steps recorded in the checkpoint
    kind: str  # "llmpar" or "deepspeed"


def _deepspeed_steps(path: str, names: list[str]) -> int:
    """The engine's ``global_steps`` a DeepSpeed checkpoint directory records (its model states file), of files
    ``names``; a CheckpointError naming the file when there is none or it is not a step count."""
    model = sorted(n for n in names if ds_files.MODEL_RE.match(n))
    if not model:
        raise CheckpointError(f"{path} holds DeepSpeed files {names[:4]} but no model states file")
    states = ds_files.load_file(os.path.join(path, model[0]))
    steps = states.get("global_steps") if isinstance(states, dict) else None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise CheckpointError(f"{os.path.join(path, model[0])} records global_steps {steps!r}, not a step count")
    return steps


def found(save_dir: str) -> tuple[list[Found], list[str]]:
    """(the complete checkpoints of ``save_dir``, sorted by steps then tag; the problems of directories that look
    like checkpoints but cannot be read: "PATH: why")."""
    out, bad = [], []
    for name in sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []:
        tag = name.removeprefix(files.OLD_PREFIX)
        if name.startswith(files.TMP_PREFIX) or (tag != name and os.path.lexists(os.path.join(save_dir, tag))):
            continue
        path = os.path.join(save_dir, name)
        if not os.path.isdir(path):
            continue
        try:
            if files.complete(path):
                meta = metacheck.read(path)
                steps = (meta.get("engine") or {}).get("global_steps")
                if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
                    raise CheckpointError(f"{path}/metadata.json records engine.global_steps {steps!r}")
                out.append(Found(tag, path, steps, "llmpar"))
            elif names := ds_files.detect(path):
                out.append(Found(tag, path, _deepspeed_steps(path, names), "deepspeed"))
        except (CheckpointError, OSError, ValueError) as e:
            bad.append(f"{path}: {e}")
    return sorted(out, key=lambda f: (f.steps, f.tag)), bad


def newest(save_dir: str) -> Found | None:
    """The complete checkpoint of ``save_dir`` with the most steps (module docstring); None when there is none."""
    complete, bad = found(save_dir)
    waiting = publish.unpublished(save_dir) if os.path.isdir(save_dir) else []
    if waiting:
        raise CheckpointError(
            f"{save_dir} has no 'latest' and holds saves that were never published: {waiting} "
            f"(`llmpar checkpoint publish {save_dir} TAG` publishes one; or delete them)"
        )
    if bad:
        raise CheckpointError(
            f"{save_dir} has no 'latest' and holds checkpoints that cannot be read: " + "; ".join(bad[:4])
        )
    if not complete:
        return None
    top = [f for f in complete if f.steps == complete[-1].steps]
    if len(top) > 1:
        raise CheckpointError(
            f"{save_dir} has no 'latest' and holds {len(top)} complete checkpoints at step "
            f"{top[0].steps}: {[f.tag for f in top]}; which one to resume from is not clear: "
            f"write its tag into {os.path.join(save_dir, files.LATEST)}, or remove the others"
        )
    return complete[-1]


__all__ = ["Found", "found", "newest"]
