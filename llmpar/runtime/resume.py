"""Resuming exactly where a run stopped: the data loader's place, and ``"checkpoint": {"auto_resume": DIR}``.

An engine checkpoint already brings back the weights, the optimizer, the LR scheduler, the fp16 loss scale, the engine
counters and every rank's RNG states. What a restarted loop also needs is the *data*: the engine's
``training_dataloader`` (``initialize(training_data=...)``, ``engine.deepspeed_io``) is a :class:`ResumableLoader`
that knows where its current pass stands, the checkpoint saves that place with the engine counters
(``dataloader_position``: the sampler's epoch and the samples this pass handed out), and a load makes the loader's
next pass start there (indices skipped, no sample read) with the sampler's epoch set back. So a loop written as

    engine.load_checkpoint(DIR)                        # or "checkpoint": {"auto_resume": DIR}
    while engine.global_steps < steps:
        for batch in engine.training_dataloader:       # resumes mid-epoch after a load
            ...; engine.step()
            if engine.global_steps % k == 0: engine.save_checkpoint(DIR)
        else:
            engine.training_dataloader.data_sampler.set_epoch(...)

sees, after a restart, the batches an uninterrupted run would have seen (a resumed pass draws no seed from torch's RNG,
whose saved state already follows the draw its pass made). The pipeline engine's loader (``training_data`` with a
``"pipeline"`` block, which ``train_batch()`` pulls) resumes likewise. A checkpoint saved at dp ranks and loaded at
dp' skips (samples x dp) / dp' samples per rank (exact for the ``DistributedSampler``, whose ranks interleave; a
remainder is rounded down with a warning).

``"checkpoint": {"auto_resume": DIR}`` (llmpar's key, opt-in): ``initialize`` loads ``DIR``'s ``latest`` when any rank
sees one (agreed, so every rank loads or none does; a first run starts fresh, without a warning). Without ``latest``
(deleted, ``save_latest=False``, a run stopped before its first ``latest``, checkpoints copied in) it loads the
newest complete checkpoint there by the step its own files record (``checkpoint/scan.py``), with a warning, and
refuses on every rank, naming them, checkpoints it cannot order (two at the same step, unreadable, unpublished):
a fresh start would re-save over them. Resuming from ``latest``, newer complete checkpoints beside it (another run's,
or saved with ``save_latest=False``) are named in a warning;
``engine.resumed_from`` is then its path and ``engine.resumed_client_state`` the ``client_state`` saved with it (both
None on a fresh start). The loop only saves;
with ``"auto_resume_interval": k`` the engine saves there itself after every k-th optimizer step (``engine.step()``
or ``train_batch()``), so the loop has nothing to add.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from llmpar.validation import check_keys

logger = logging.getLogger("llmpar")

AUTO_RESUME = "auto_resume"
INTERVAL = "auto_resume_interval"


class _Skipped(Sampler):
    """The indices of ``sampler`` without its first ``skip``."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


class _Counted:
    """A pass over a loader that counts the batches it hands out (into ``loader._handed``)."""

    def __init__(self, loader: "ResumableLoader", inner: Iterator[Any]) -> None:
        self.loader, self.inner = loader, inner

    def __iter__(self) -> "_Counted":
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        if self.loader._pass is self:
            self.loader._handed += 1
        return batch

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


class ResumableLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` that knows where its current pass is: :meth:`position` (saved by engine
    checkpoints) and :meth:`resume` (a load: the next pass starts there). Only for a loader built from ``sampler=``
    and ``batch_size=`` (what ``deepspeed_io`` builds); ``len(loader)`` stays a whole pass."""

    _start = 0  # samples skipped at the start of the current pass
    _handed = 0  # batches the current pass handed out
    _skip = 0  # samples the next pass skips (set by resume)
    _skipping = 0  # the skip of the pass being built (read by _index_sampler while __iter__ builds the iterator)
    _pass: Any = None  # the current pass (an older iterator still running no longer counts)

    @property
    def _index_sampler(self) -> Any:
        if self._skipping and self.batch_sampler is not None and self.batch_size is not None:
            return BatchSampler(_Skipped(self.sampler, self._skipping), self.batch_size, self.drop_last)
        return super()._index_sampler

    def __iter__(self) -> _Counted:  # type: ignore[override]
        skip, self._skip = self._skip, 0
        self._skipping = skip
        # a pass draws a seed from torch's RNG (for its workers) when it starts; a resumed pass started before the
        # checkpoint, whose RNG state already follows that draw: drawing again would shift the run's random stream
        rng = torch.get_rng_state() if skip and self.generator is None else None
        try:
            inner = super().__iter__()
        finally:
            self._skipping = 0
            if rng is not None:
                torch.set_rng_state(rng)
        self._start, self._handed = skip, 0
        self._pass = _Counted(self, inner)
        return self._pass

    def position(self, replicas: int) -> dict[str, Any]:
        """Where the current pass stands: ``{"epoch": the sampler's epoch (None without one), "samples": this rank's
        samples handed out in this pass, "replicas": replicas}`` (``replicas``: the data-parallel ranks sharing the
        data)."""
        if self._pass is None:  # no pass since the loader was built or resumed: where the next one starts
            samples = self._skip
        else:
            samples = min(self._start + self._handed * (self.batch_size or 1), len(self.sampler))  # type: ignore
        return {"epoch": getattr(self.sampler, "epoch", None), "samples": samples, "replicas": replicas}

    def resume(self, position: dict[str, Any], replicas: int) -> None:
        """Make the next pass start at ``position`` (as :meth:`position` gave it, perhaps at another number of
        ``replicas``): the sampler's epoch is set back and the samples handed out are skipped."""
        if not isinstance(position, dict):
            raise TypeError(f"dataloader_position must be a dict, got {type(position).__name__}")
        epoch, samples, saved = position.get("epoch"), int(position.get("samples", 0)), position.get("replicas")
        if epoch is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(int(epoch))
        saved = int(saved) if saved else replicas
        total = samples * saved
        if total % replicas:
            logger.warning(
                "resuming the data loader at %d data-parallel ranks from a checkpoint of %d: %d samples "
                "per rank were handed out there, %d / %d is not whole: %d are skipped here (some samples "
                "are seen twice)",
                replicas,
                saved,
                samples,
                total,
                replicas,
                total // replicas,
            )
        self._skip = total // replicas
        self._pass = None  # a pass already running stops counting


def resumable(loader: Any) -> Any:
    """``loader`` when checkpoints can save and restore its place: a :class:`ResumableLoader`, or a wrapper of one
    with its own ``position`` / ``resume`` (the pipeline engine's ``RepeatingLoader``); else None."""
    if isinstance(loader, ResumableLoader):
        return loader
    inner = getattr(loader, "loader", None)
    return loader if isinstance(inner, ResumableLoader) and callable(getattr(loader, "resume", None)) else None


def check_auto_resume(name: str, value: Any) -> str | None:
    """``checkpoint.auto_resume``: a directory path (str or ``os.PathLike``, not empty), or null (off). Raises a
    TypeError / ValueError naming the key."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f'"{name}"={value!r}: expected a directory path (a string), or null for no auto-resume')
    if not value.strip():
        raise ValueError(f'"{name}"={value!r}: expected a directory path (a non-empty string)')
    return value


def check_interval(name: str, value: Any) -> int | None:
    """``checkpoint.auto_resume_interval``: a positive int (save every that many optimizer steps), or null."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f'"{name}"={value!r}: expected a positive integer (optimizer steps between the saves), or null'
        )
    return value


def check_load_universal(name: str, value: Any) -> bool:
    """``checkpoint.load_universal``: a bool or null (false)."""
    if value is not None and not isinstance(value, bool):
        shown = json.dumps(value) if isinstance(value, (int, float, str)) else repr(value)
        raise ValueError(
            f'"{name}"={shown}: a bool (true: load_checkpoint(dir) loads the universal '
            "checkpoint dir/latest_universal names) or null"
        )
    return bool(value)


@dataclass(kw_only=True)
class CheckpointConfig:
    """``"checkpoint"``: DeepSpeed's ``load_universal``, and llmpar's ``auto_resume``: ``initialize`` loads the
    directory's latest checkpoint when any rank sees one (else the newest complete one there, with a warning; a first
    run starts fresh), and with ``auto_resume_interval`` the engine saves there itself."""

    load_universal: bool = False  # true: load_checkpoint(dir) with tag=None loads the tag dir/latest_universal names
    auto_resume: str | None = None  # a directory: initialize loads its latest checkpoint when there is one
    auto_resume_interval: int | None = None  # the engine saves to auto_resume after every that many optimizer steps


def checkpoint_block(block: Any, ignored: tuple[str, ...] = ()) -> CheckpointConfig:
    """``"checkpoint"`` -> :class:`CheckpointConfig`. ``ignored``: DeepSpeed's keys of the block that ``ds_keys``
    checks and takes out before (accepted here, and named among the valid keys of an error)."""
    if block is None:
        block = {}
    check_keys("checkpoint", block, [f.name for f in fields(CheckpointConfig)] + list(ignored))
    directory = check_auto_resume(f"checkpoint.{AUTO_RESUME}", block.get(AUTO_RESUME))
    every = check_interval(f"checkpoint.{INTERVAL}", block.get(INTERVAL))
    if every is not None and directory is None:
        raise ValueError(
            f'"checkpoint.{INTERVAL}"={every} needs "checkpoint.{AUTO_RESUME}": the directory to save '
            "to and resume from"
        )
    return CheckpointConfig(
        load_universal=check_load_universal("checkpoint.load_universal", block.get("load_universal")),
        auto_resume=directory,
        auto_resume_interval=every,
    )


def save_if_due(engine: Any) -> None:
    """The engine's step hook for ``auto_resume_interval``: save to the auto-resume directory every that many
    optimizer steps (collective, on every rank at the same step)."""
    directory, every = engine.auto_save
    if engine.global_steps % every == 0:
        engine.save_checkpoint(directory)


def apply_auto_resume(engine: Any, checkpoint: CheckpointConfig) -> str | None:
    """``initialize``'s step for ``"checkpoint": {"auto_resume": DIR}``: load ``DIR``'s latest checkpoint when any
    rank sees ``DIR/latest`` (agreed over the engine's ranks, so all load or none does). Sets
    ``engine.resumed_from`` (the path, or None) and ``engine.resumed_client_state``; returns the path."""
    from llmpar.checkpoint import files
    from llmpar.distributed.agree import raise_if_any_failed

    engine.resumed_from, engine.resumed_client_state, engine.auto_save = None, None, None
    directory, every = checkpoint.auto_resume, checkpoint.auto_resume_interval
    if directory is None:
        return None
    engine.auto_save = (directory, every) if every is not None else None
    grid = engine.checkpoint_grid()
    error = None
    if os.path.exists(directory) and not os.path.isdir(directory):
        error = ValueError(f'"checkpoint.auto_resume"={directory!r} is not a directory')
    raise_if_any_failed(error, grid.groups, what="llmpar.initialize: checkpoint.auto_resume")
    found = os.path.isfile(os.path.join(directory, files.LATEST))
    tag = None
    if not files.agree(int(found), grid.groups, grid.device):
        tag = _newest_without_latest(directory, grid)
        if tag is None:
            if grid.rank0:
                logger.info(
                    "llmpar.initialize: checkpoint.auto_resume: no checkpoint in %s yet: starting fresh", directory
                )
            return None
    path, client = engine.load_checkpoint(directory, tag=tag)
    engine.resumed_from, engine.resumed_client_state = path, client
    if grid.rank0:
        logger.info("llmpar.initialize: checkpoint.auto_resume: resumed from %s at step %d", path, engine.global_steps)
        if tag is None:
            _warn_newer(directory, engine.global_steps)
    return path


def _warn_newer(directory: str, steps: int) -> None:
    """Rank 0, after resuming from ``latest``: a warning naming complete checkpoints of more steps (another run's,
    or saves with ``save_latest=False``), which saves of this run at their tags would replace."""
    from llmpar.checkpoint import scan

    try:
        newer = [f"{f.tag} (step {f.steps})" for f in scan.found(directory)[0] if f.steps > steps]
    except OSError:
        return
    if newer:
        logger.warning(
            "llmpar.initialize: checkpoint.auto_resume: %s/latest names a checkpoint of step %d, but %s "
            "holds newer complete ones: %s; a save of this run under one of their tags replaces it",
            directory,
            steps,
            directory,
            newer[:8],
        )


def _newest_without_latest(directory: str, grid: Any) -> str | None:
    """Collective: the tag of the newest complete checkpoint of ``directory`` (by the step its metadata records,
    ``checkpoint.scan``), the same on every rank, or None when there is none; an error on every rank naming them when
    they cannot be told apart or read (a fresh start would re-save over them)."""
    from llmpar.checkpoint import files, scan
    from llmpar.checkpoint.files import CheckpointError
    from llmpar.distributed.agree import raise_if_any_failed

    newest, error = None, None
    try:
        newest = scan.newest(directory)
    except (CheckpointError, OSError) as e:
        error = CheckpointError(f"llmpar.initialize: checkpoint.auto_resume: {e}")
    raise_if_any_failed(error, grid.groups, what="llmpar.initialize: checkpoint.auto_resume", types=(CheckpointError,))
    text = "" if newest is None else f"{newest.tag}\0{newest.steps}"
    h = files.fingerprint(text)
    hi, neg = files.agree_all([h, -h], grid.groups, grid.device)
    if (hi, -neg) != (h, h):
        mine = f"{newest.tag} at step {newest.steps}" if newest is not None else "none"
        raise CheckpointError(
            f"llmpar.initialize: checkpoint.auto_resume: the ranks see different checkpoints in "
            f"{directory} (no 'latest'; this rank's newest: {mine}): is the directory shared by "
            "every rank?"
        )
    if newest is not None and grid.rank0:
        logger.warning(
            "llmpar.initialize: checkpoint.auto_resume: %s has no 'latest': resuming from the newest "
            "complete checkpoint, %s (step %d by its own record)",
            directory,
            newest.tag,
            newest.steps,
        )
    return None if newest is None else newest.tag


__all__ = [
    "AUTO_RESUME",
    "INTERVAL",
    "CheckpointConfig",
    "ResumableLoader",
    "apply_auto_resume",
    "check_auto_resume",
    "check_interval",
    "check_load_universal",
    "checkpoint_block",
    "resumable",
    "save_if_due",
]
