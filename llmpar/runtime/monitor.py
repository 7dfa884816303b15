"""DeepSpeed's monitors: the config's ``tensorboard``, ``csv_monitor`` and ``wandb`` blocks, written by global rank 0
through the usual writers, with DeepSpeed's event names, files and semantics.

    "tensorboard": {"enabled": true, "output_path": "logs/", "job_name": "run1"}    -> logs/run1/events.out.tfevents.*
    "csv_monitor": {"enabled": true, "output_path": "logs/", "job_name": "run1"}    -> logs/run1/Train_Samples_lr.csv
    "wandb": {"enabled": true, "project": "p", "group": "g", "team": "t"}          -> wandb.init(project, group, entity)

Events are ``(name, value, step)`` with the step = samples seen (``engine.global_samples``), as DeepSpeed's:

    Train/Samples/train_loss   plain engine: at each accumulation boundary's backward, the sum over the accumulation
                               of rank 0's loss / gradient_accumulation_steps (its mean loss), at the samples seen
                               before that step (DeepSpeed's engine before its backward rewrite; 0.19 writes it from
                               its pipeline engine only); pipeline engine: the step's mean loss after the step
    Train/Samples/lr           after each optimizer step (applied or skipped): the first param group's lr
    Train/Samples/loss_scale   with fp16, after each optimizer step: the loss scale

``engine.monitor.write_events([(name, value, step), ...])`` writes a script's own events the same way (DeepSpeed's
``engine.monitor``). Writers: tensorboard through ``torch.utils.tensorboard.SummaryWriter`` into
``output_path/job_name`` (needs the ``tensorboard`` package); csv through the ``csv`` module, one file per event
``output_path/job_name/<name with / and spaces as _>.csv`` with a ``step,<last part of the name>`` header written
once per process (DeepSpeed's); wandb through ``wandb.log({name: value}, step=step)`` (needs the ``wandb``
package; ``WANDB_MODE=offline`` works without a network). An enabled writer whose package is missing is an error at
``initialize`` on every rank, naming the package. A writer that fails later (its directory removed or turned
unwritable, a full disk, a wandb error) is a warning on the ``llmpar`` logger, once per writer, naming the writer, its
path and the error; training goes on, and the writer is tried again with each later event (they are lost while it
fails). DeepSpeed's ``comet`` monitor is not provided (an error saying so).
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from llmpar.validation import as_bool, check_keys

BLOCKS = ("tensorboard", "csv_monitor", "wandb")
logger = logging.getLogger("llmpar")


class MissingPackage(ImportError, ValueError):
    """An enabled monitor's package is not installed (an ``ImportError``; a ``ValueError`` too, so that
    ``initialize`` agrees on it between the ranks like any other config error)."""


_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb"}


@dataclass(kw_only=True)
class WriterConfig:
    """``tensorboard`` / ``csv_monitor``: global rank 0 writes the engine's events (train loss, lr, loss scale, at
    the samples seen) to ``output_path/job_name``; the csv monitor one ``<event>.csv`` file per event."""

    enabled: bool = False
    output_path: str = ""  # the directory (created); "" is the working directory
    job_name: str = "DeepSpeedJobName"  # the subdirectory of this run


@dataclass(kw_only=True)
class WandbConfig:
    """``wandb``: global rank 0 logs the engine's events to ``wandb.init(project=, group=, entity=team)`` (needs the
    ``wandb`` package; ``WANDB_MODE=offline`` works without a network)."""

    enabled: bool = False
    team: str | None = None
    group: str | None = None
    project: str = "deepspeed"


@dataclass(kw_only=True)
class MonitorConfig:
    tensorboard: WriterConfig = field(default_factory=WriterConfig)
    csv_monitor: WriterConfig = field(default_factory=WriterConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    @property
    def enabled(self) -> bool:
        return self.tensorboard.enabled or self.csv_monitor.enabled or self.wandb.enabled


def _string(name: str, value: Any, *, optional: bool = False, nonempty: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or (nonempty and not value):
        raise TypeError(
            f'"{name}"={value!r} must be a {"non-empty " if nonempty else ""}string' + (" or null" if optional else "")
        )
    return value


def monitor_block(name: str, block: Any) -> WriterConfig | WandbConfig:
    """One monitor block checked and typed; an enabled writer whose package is missing raises
    :class:`MissingPackage` (an ``ImportError``)."""
    if name not in BLOCKS:
        raise ValueError(f"{name!r} is not a monitor block ({', '.join(BLOCKS)})")
    if block is None:
        block = {}
    if name == "wandb":
        check_keys(name, block, ["enabled", "team", "group", "project"])
        cfg: WriterConfig | WandbConfig = WandbConfig(
            enabled=as_bool("wandb.enabled", block.get("enabled", False)),
            team=_string("wandb.team", block.get("team"), optional=True),
            group=_string("wandb.group", block.get("group"), optional=True),
            project=_string("wandb.project", block.get("project", "deepspeed"), nonempty=True),
        )
    else:
        check_keys(name, block, ["enabled", "output_path", "job_name"])
        enabled = as_bool(f"{name}.enabled", block.get("enabled", False))  # a disabled block may leave names empty
        cfg = WriterConfig(
            enabled=enabled,
            output_path=_string(f"{name}.output_path", block.get("output_path", "")),
            job_name=_string(f"{name}.job_name", block.get("job_name", "DeepSpeedJobName"), nonempty=enabled),
        )
    package = _PACKAGE.get(name)
    if cfg.enabled and package is not None and importlib.util.find_spec(package) is None:
        raise MissingPackage(
            f'"{name}.enabled"=true needs the {package!r} package, which is not installed: pip install {package}'
        )
    return cfg


def monitor_config(raw: dict) -> MonitorConfig:
    """The monitor blocks of a DeepSpeed config (absent blocks: disabled)."""
    return MonitorConfig(**{name: monitor_block(name, raw.get(name)) for name in BLOCKS})


class _TensorBoard:
    def __init__(self, cfg: WriterConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(cfg.output_path, cfg.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Csv:
    def __init__(self, cfg: WriterConfig) -> None:
        self.log_dir = os.path.join(cfg.output_path, cfg.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.started: set[str] = set()  # files given their header by this process

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, filename + ".csv"), "a+", newline="") as f:
                out = csv.writer(f)
                if filename not in self.started:
                    self.started.add(filename)
                    out.writerow(["step", name.split("/")[-1]])
                out.writerow([step, value])

    def close(self) -> None:
        pass


class _Wandb:
    def __init__(self, cfg: WandbConfig) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=cfg.project, group=cfg.group, entity=cfg.team)

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.run.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()


class MonitorMaster:
    """``engine.monitor``: the enabled writers on global rank 0 (other ranks: none; ``enabled`` is the config's on
    every rank, as DeepSpeed's). :meth:`write_events` takes DeepSpeed's ``[(name, value, step), ...]``."""

    def __init__(self, config: MonitorConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        self.enabled = config.enabled
        self.writers: dict[str, Any] = {}
        self.failed: dict[str, str] = {}  # writer -> its first failure (logged once; events lost while it fails)
        if rank == 0:
            if config.tensorboard.enabled:
                self.writers["tensorboard"] = _TensorBoard(config.tensorboard)
            if config.csv_monitor.enabled:
                self.writers["csv_monitor"] = _Csv(config.csv_monitor)
            if config.wandb.enabled:
                self.writers["wandb"] = _Wandb(config.wandb)

    def write_events(self, event_list: list | tuple) -> None:
        """Write ``(name, value, step)`` events to every enabled writer (global rank 0; elsewhere nothing). A
        malformed event is a ``TypeError`` naming it, on every rank."""
        if not isinstance(event_list, (list, tuple)):
            raise TypeError(f"event_list must be a list of (name, value, step) tuples, got {type(event_list).__name__}")
        events = []
        for e in event_list:
            ok = isinstance(e, (list, tuple)) and len(e) == 3 and isinstance(e[0], str)
            try:
                value, step = (float(e[1]), int(e[2])) if ok else (math.nan, 0)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise TypeError(f"event {e!r} must be (name: str, value: number, step: int)")
            events.append((e[0], value, step))
        for name, w in self.writers.items():
            self._guarded(name, w, "write", w.write, events)

    def _guarded(self, name: str, writer: Any, doing: str, fn: Any, *args: Any) -> None:
        """``fn(*args)``; an exception is logged once per writer (a monitor never stops training)."""
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - any writer failure: logged, never raised into the step
            if name not in self.failed:
                self.failed[name] = f"{type(err).__name__}: {err}"
                where = getattr(writer, "log_dir", None)
                logger.warning(
                    "monitor %s%s: %s failed (%s); training goes on without its events (this warning is not repeated)",
                    name,
                    f" ({where})" if where else "",
                    doing,
                    self.failed[name],
                )

    def close(self) -> None:
        """Flush and close the writers (``engine.destroy()`` calls it); later events are dropped."""
        for name, w in self.writers.items():
            self._guarded(name, w, "close", w.close)
        self.writers.clear()
        self.enabled = False


__all__ = [
    "BLOCKS",
    "MissingPackage",
    "MonitorConfig",
    "MonitorMaster",
    "WandbConfig",
    "WriterConfig",
    "monitor_block",
    "monitor_config",
]
