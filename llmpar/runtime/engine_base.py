"""What llmpar's two engines share: DeepSpeed's engine API (``engine_api.DeepSpeedAPI``), the step counters, the
end of an optimizer step (scheduler, zero_grad, counters, logging) and the checkpoint methods. ``Engine`` (plain /
ZeRO 0-3) and ``PipelineEngine`` (pp x dp x tp) derive from it; ``llmpar.checkpoint`` sees both through its protocol
(``llmpar.checkpoint.protocol.Checkpointable``): the counters and the module targets are implemented here, the grid,
the checkpoint names and the tied duplicates by each engine.

Counters (DeepSpeed's meaning): ``micro_steps`` forward/backward passes, ``global_steps`` optimizer steps taken
(applied or skipped), ``global_samples`` samples seen, ``skipped_steps`` optimizer steps skipped for non-finite
gradients (the optimizer's device counter, read only when asked; assignable, e.g. by a checkpoint load).
Every ``steps_per_print`` optimizer steps global rank 0 logs DeepSpeed's progress line to the ``llmpar`` logger:
``step=100, skipped=0, lr=[0.0003], mom=[(0.9, 0.999)], grad_norm=0.4321`` (``, loss=...`` for a pipeline step),
then the throughput since the previous line (``mfu.py``): ``, tokens/s=52100, TFLOP/s/device=401, MFU=40.5%`` (tokens:
this rank's training forwards' batches times the data ranks, or ``set_tokens_per_step``).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from llmpar.distributed.agree import raise_if_any_failed
from llmpar.distributed.errors import CollectiveError
from llmpar.distributed.flight import RECORDER
from llmpar.runtime import engine_ckpt
from llmpar.runtime.client import mirror_groups, step_scheduler
from llmpar.runtime.config import Config
from llmpar.runtime.engine_api import DeepSpeedAPI
from llmpar.runtime.mfu import Throughput
from llmpar.runtime.monitor import MonitorMaster
from llmpar.runtime.resume import save_if_due

if TYPE_CHECKING:
    from llmpar.checkpoint.protocol import Grid, PendingSave

logger = logging.getLogger("llmpar")


def reports_step(method: Callable[..., Any]) -> Callable[..., Any]:
    """A collective failing inside ``method`` (a dead or stuck peer) reports the engine's step with its operation;
    ``method`` after :meth:`EngineBase.destroy` is a ``RuntimeError`` saying so."""

    @functools.wraps(method)
    def wrapper(self: "EngineBase", *args: Any, **kwargs: Any) -> Any:
        if self.destroyed:
            raise RuntimeError(
                f"engine.{method.__name__}() after engine.destroy(): the engine released its hooks, "
                "gradients and optimizer state; build a new one with llmpar.initialize"
            )
        try:
            return method(self, *args, **kwargs)
        except CollectiveError as err:
            raise err.add_context(
                f"in engine.{method.__name__}() at optimizer step {self.global_steps}, micro step {self.micro_steps}"
            ) from err.__cause__

    return wrapper


class EngineBase(DeepSpeedAPI):
    """State and accessors common to the plain and the pipeline engine."""

    def __init__(self, module: nn.Module, config: Config, optimizer: Any, scheduler: Any) -> None:
        self.module, self.config, self.optimizer, self.lr_scheduler = module, config, optimizer, scheduler
        self.micro_steps = 0
        self.global_steps = 0
        RECORDER.step = 0
        self.global_samples = 0
        self._skip_offset = 0  # skipped_steps = the optimizer's count + offset
        self.checkpoint_pending: PendingSave | None = None  # this engine's async save, published at the next wait
        self.training_dataloader: Any = None  # initialize(training_data=...)'s loader (DeepSpeed's name)
        self.collate_fn: Callable | None = None
        self._step_applied: Any = False  # the last step's StepApplied (a device flag until read)
        self.client_optimizer: torch.optim.Optimizer | None = None  # a client lr_scheduler sets lrs here (client.py)
        self.client_optimizer_name: str | None = None
        self.exclude_frozen = False  # during save_checkpoint(exclude_frozen_parameters=True)
        self.destroyed = False
        self.losses: torch.Tensor | None = None  # this accumulation's sum of loss / gas (DeepSpeed's; for the monitor)
        self.monitor = self._build_monitor()
        self.throughput = Throughput()  # tokens and time between steps_per_print lines
        self._token_hook = (
            module.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
            if isinstance(module, nn.Module)
            else None
        )

    def _count_tokens(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            self.throughput.seen(args, kwargs)

    def set_tokens_per_step(self, tokens: int) -> None:
        """The job's tokens per optimizer step (all ranks) for the progress lines' throughput and MFU, instead of
        counting this rank's batches (for inputs that are not token ids, or a pipeline engine)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(
                f"set_tokens_per_step(tokens={tokens!r}): expected a positive int (tokens per optimizer "
                "step, all ranks together)"
            )
        self.throughput.tokens_per_step = tokens

    def _build_monitor(self) -> MonitorMaster:
        """DeepSpeed's monitors (``monitor.py``), writing on global rank 0; a writer failing to start there (an
        unwritable output_path, say) fails initialize on every rank."""
        cfg = self.config.monitor
        if not cfg.enabled:
            return MonitorMaster(cfg, rank=self.global_rank)
        error, monitor = None, None
        try:
            monitor = MonitorMaster(cfg, rank=self.global_rank)
        except Exception as e:  # noqa: BLE001 - agreed with the other ranks, then raised everywhere
            error = e if isinstance(e, (ValueError, TypeError, OSError)) else RuntimeError(f"monitor: {e!r}")
        if dist.is_initialized():
            raise_if_any_failed(error, dist.group.WORLD, what="a monitor could not start on global rank 0")
        elif error is not None:
            raise error
        assert monitor is not None
        return monitor

    def _monitor_loss(self, scaled: torch.Tensor, boundary: bool) -> None:
        """Add one micro-step's ``loss / gas`` to :attr:`losses`; at the boundary rank 0 writes their sum as
        ``Train/Samples/train_loss`` at the samples seen before this step (DeepSpeed's plain engine)."""
        if not self.monitor.enabled:
            return
        loss = scaled.detach().float()
        self.losses = loss if self.losses is None else self.losses + loss
        if boundary and self.global_rank == 0:
            self.monitor.write_events([("Train/Samples/train_loss", self.losses.item(), self.global_samples)])

    def _monitor_step(self, loss: float | None) -> None:
        """After an optimizer step, on rank 0: ``Train/Samples/lr`` (and ``loss_scale`` with fp16, ``train_loss``
        for a pipeline step's mean loss) at the samples seen now (DeepSpeed's)."""
        if self.global_rank != 0:
            return
        events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
        if self.fp16_enabled():
            events.append(("Train/Samples/loss_scale", self.optimizer.loss_scale, self.global_samples))
        if loss is not None:
            events.append(("Train/Samples/train_loss", loss, self.global_samples))
        self.monitor.write_events(events)

    def destroy(self) -> None:
        """DeepSpeed's cleanup: publish a pending async save (collective, as the save was), close the monitors'
        writers, and release the optimizer's hooks, gradients and states (``llmpar.zero.state_dict``). Calling
        it again does nothing; the engine's other methods raise ``RuntimeError`` afterwards. Under ZeRO 0-2 the
        model stays a plain module with the trained weights; under stage 3 each rank holds only its shards."""
        if self.destroyed:
            return
        if self.checkpoint_pending is not None:
            self.wait_checkpoint()
        self.monitor.close()
        if self._token_hook is not None:
            self._token_hook.remove()
        self.optimizer.destroy()
        self.losses = None
        self.destroyed = True

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite grads (reading it syncs with the device once)."""
        return self.optimizer.skipped_steps + self._skip_offset

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skip_offset = int(value) - self.optimizer.skipped_steps

    def _log_extra(self) -> str:
        """What an engine adds to its ``steps_per_print`` line (the plain engine: the MoE layers' balance)."""
        return ""

    def _finish_step(self, applied: Any, loss: float | None = None, lr_kwargs: dict | None = None) -> None:
        """After ``optimizer.step()`` returned ``applied`` (a device flag: read only when a scheduler must know,
        as DeepSpeed does not step the scheduler on a skipped step): scheduler, zero_grad, counters, log."""
        self._step_applied = applied
        if self.lr_scheduler is not None and applied:
            if self.client_optimizer is not None:
                step_scheduler(self.lr_scheduler, self.client_optimizer, self.optimizer, lr_kwargs)
            else:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        self.optimizer.zero_grad()
        self.global_steps += 1
        RECORDER.step = self.global_steps  # stamped on the flight recorder's entries
        self.global_samples += self.config.train_batch_size
        self.throughput.steps += 1
        self.losses = None
        if self.monitor.enabled:
            self._monitor_step(loss)
        if (
            self.global_steps % self.config.steps_per_print == 0
            and self.global_rank == 0
            and logger.isEnabledFor(logging.INFO)
        ):
            cp = getattr(self, "context_parallel", None)  # forwards see 1/cp of each sequence (and of its tokens)
            rate = self.throughput.report(
                self.module,
                tp=self.mp_world_size,
                world=self.world_size,
                data_ranks=self.world_size // self.mp_world_size,
                device=self.device,
                seq_scale=cp.size if cp is not None else 1,
            )
            logger.info(
                "step=%d, skipped=%d, lr=%s, mom=%s, grad_norm=%.4g%s%s%s",
                self.global_steps,
                self.skipped_steps,
                [round(lr, 8) for lr in self.get_lr()],
                self.get_mom(),
                self.optimizer.last_grad_norm or 0.0,
                "" if loss is None else f", loss={loss:.4f}",
                f", {rate}" if rate else "",
                self._log_extra(),
            )
        if getattr(self, "auto_save", None) is not None:  # "checkpoint.auto_resume_interval" (resume.py)
            save_if_due(self)

    def mirror_lrs_from_client(self) -> None:
        """Copy the lrs a client scheduler set in its optimizer into the engine's optimizer."""
        if self.client_optimizer is not None:
            mirror_groups(self.client_optimizer.param_groups, self.optimizer.param_groups)

    def mirror_lrs_to_client(self) -> None:
        """Copy the optimizer's lrs (e.g. just loaded) back into the client optimizer a client scheduler reads."""
        if self.client_optimizer is not None:
            mirror_groups(self.optimizer.param_groups, self.client_optimizer.param_groups)

    # checkpoints (llmpar.checkpoint): every rank writes its own shards, one metadata.json for the run; params are
    # named as in the unsplit model, so a checkpoint loads at another dp / tp / pp degree, ZeRO stage or engine kind
    @reports_step
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        async_save: bool = False,
    ) -> str:
        """Sharded, atomic checkpoint ``save_dir/tag`` (default ``global_step{N}``), collective over the engine's
        ranks (every rank must pass the same tag); see ``llmpar.checkpoint``. Returns its path. DeepSpeed's
        ``save_latest`` / ``exclude_frozen_parameters``: see ``engine_ckpt``. ``async_save``: written by a thread from
        a host copy, published at the next ``wait_checkpoint`` / ``save_checkpoint`` / ``load_checkpoint``; one still
        pending when the engine is collected or the interpreter exits is finished then, with a warning."""
        return engine_ckpt.save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, async_save)

    @reports_step
    def wait_checkpoint(self) -> str | None:
        """Publish the pending async save (collective); its path, or None if none was pending."""
        from llmpar.checkpoint import wait_checkpoint

        return wait_checkpoint(self)

    @reports_step
    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        load_module_strict: bool = True,
        custom_load_fn: Callable | None = None,
        *,
        strict: bool | None = None,
    ) -> tuple[str | None, dict | None]:
        """Load ``load_dir/tag`` (default: ``latest``; none there: ``(None, None)`` with a warning, as DeepSpeed),
        saved at any dp / tp / pp degree, ZeRO stage or offload; returns (path, client_state). Every rank must load
        the same checkpoint. ``strict`` (DeepSpeed's ``load_module_strict``): a param or buffer the model has and the
        checkpoint lacks, or the other way round, is an error naming it (False: the model's keep their values, the
        checkpoint's are ignored, with a warning). DeepSpeed's ``load_optimizer_states`` /
        ``load_lr_scheduler_states`` / ``load_module_only``: see ``engine_ckpt``."""
        if custom_load_fn is not None:
            raise ValueError(
                "load_checkpoint(custom_load_fn=...) is not supported: llmpar loads its own sharded "
                "format (load with strict=False and fix up the module afterwards)"
            )
        if strict is not None and strict != load_module_strict and load_module_strict is not True:
            raise ValueError(f"strict={strict} and load_module_strict={load_module_strict} disagree: give one")
        return engine_ckpt.load(
            self,
            load_dir,
            tag,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            load_module_strict if strict is None else strict,
        )

    # the engine's side of the checkpoint protocol (llmpar.checkpoint.protocol.Checkpointable); each engine adds
    # checkpoint_grid() and checkpoint_modules(), and overrides the naming when its modules are not the model
    # dataloader_position: where training_dataloader's pass stands (DeepSpeedAPI; resume.py)
    _COUNTERS = ("micro_steps", "global_steps", "global_samples", "skipped_steps", "dataloader_position")

    def checkpoint_grid(self) -> Grid:
        """This rank's place in the dp x tp (x pp) grid."""
        raise NotImplementedError(f"{type(self).__name__} does not say where it sits (checkpoint_grid)")

    def checkpoint_modules(self) -> list[nn.Module]:
        """The modules this rank holds."""
        return [self.module]

    def checkpoint_named(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        """(optimizer-style name, tensor) of this rank's module params (``kind="named_parameters"``) or buffers
        (``"named_buffers"``), a shared one under every name."""
        return [item for m in self.checkpoint_modules() for item in getattr(m, kind)(remove_duplicate=False)]

    def checkpoint_names(self) -> dict[str, str]:
        """{optimizer / module name: checkpoint name} where they differ (none: the module is the model)."""
        return {}

    def checkpoint_duplicates(self) -> set[str]:
        """Optimizer param names not written (tied copies another pipeline stage writes): none."""
        return set()

    def checkpoint_targets(self) -> dict[str, tuple[torch.Tensor, bool]]:
        """{checkpoint name: (live tensor, is_param)} of this rank's modules (the first holder of a shared one;
        non-persistent buffers left out, as ``state_dict`` leaves them out; frozen params left out while
        ``save_checkpoint(exclude_frozen_parameters=True)`` runs)."""
        names, unsaved = self.checkpoint_names(), engine_ckpt.unsaved_buffers(self.checkpoint_modules())
        out: dict[str, tuple[torch.Tensor, bool]] = {}
        for kind, is_param in (("named_parameters", True), ("named_buffers", False)):
            for name, t in self.checkpoint_named(kind):
                if t is None or (not is_param and id(t) in unsaved):
                    continue
                if not (self.exclude_frozen and is_param and not t.requires_grad):
                    out.setdefault(names.get(name, name), (t, is_param))
        return out

    def checkpoint_model(self) -> dict[str, Any]:
        """What a checkpoint records about the model (``llmpar.checkpoint.protocol.DescribesModel``): its
        HuggingFace config and generation config (``llmpar checkpoint consolidate`` writes them as ``config.json``
        / ``generation_config.json``; None for other models) and the names of the buffers not saved."""
        config, generation = engine_ckpt.hf_configs(self.module)
        names, unsaved = self.checkpoint_names(), engine_ckpt.unsaved_buffers(self.checkpoint_modules())
        return {
            "hf_config": config,
            "hf_generation_config": generation,
            "unsaved_buffers": sorted(
                {names.get(n, n) for n, t in self.checkpoint_named("named_buffers") if id(t) in unsaved}
            ),
        }

    def checkpoint_counters(self) -> dict[str, Any]:
        """The run counters a checkpoint saves."""
        return {k: getattr(self, k) for k in self._COUNTERS}

    def restore_counters(self, counters: dict[str, Any]) -> None:
        """Take saved counters back (``skipped_steps`` through its setter)."""
        for k in self._COUNTERS:
            if k in counters:
                setattr(self, k, counters[k])
        RECORDER.step = self.global_steps


__all__ = ["EngineBase"]
