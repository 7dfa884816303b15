"""fp16 loss scaling for :class:`ZeroOptimizer`: DeepSpeed's ``DynamicLossScaler`` / ``LossScaler`` rules, with the
state on the device so that a step reads nothing on the host.

    scaler = LossScaler(initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
    opt = ZeroOptimizer(model.named_parameters(), cfg, dp_group, stage=2, loss_scaler=scaler)
    scaler.scale_loss(loss).backward(); opt.step()     # (the engine's backward does the scaling)

The backward runs on ``loss * S``. ``ZeroOptimizer.step`` computes the global norm of the scaled grads, divides it by
S (the norm it reports and clips with is the true one), folds ``1/S`` into the clip coefficient the fused AdamW step
applies (no pass over the grads), and skips the step on every rank when the norm is not finite (an overflow on any
rank makes the all-reduced norm inf / nan). Then ``update(found_inf)`` moves S by DeepSpeed's rules:

    overflow: if hysteresis is down to 1 (or configured as 1): S = max(S / 2, min_loss_scale), else hysteresis -= 1;
              the iteration is remembered as the last overflow
    clean:    consecutive_hysteresis: hysteresis refilled; every loss_scale_window clean iterations after the last
              overflow: S *= 2 (and hysteresis refilled)
    static (``loss_scale`` > 0): S never moves; overflowing steps are still skipped

An overflow with S already at ``min_loss_scale`` and no hysteresis left is DeepSpeed's fatal "Current loss scale
already at minimum": a ``RuntimeError`` here, raised in that step on the CPU and at the next step (or read) on CUDA,
where the flag is copied to the host without blocking. ``state_dict()`` / ``load_state_dict()`` carry the state
(DeepSpeed's names: cur_scale, cur_iter, last_overflow_iter, cur_hysteresis) through checkpoints.
"""

from __future__ import annotations

import torch

from llmpar.ops.grad_norm import clip_coefficient
from llmpar.validation import as_bool, as_float, as_int

_AT_MINIMUM = (
    "Current loss scale already at minimum ({}) - cannot decrease scale anymore: the fp16 gradients "
    "overflow at every scale (DeepSpeed stops here too); lower the learning rate, check the data, or use "
    "bf16"
)


MAX_SCALE_POWER = 64  # S <= 2**64: far above any useful fp16 scale; S and 1/S stay finite and normal in float32


def check_scaling(
    *,
    loss_scale: float,
    initial_scale_power: int,
    loss_scale_window: int,
    hysteresis: int,
    consecutive_hysteresis: bool,
    min_loss_scale: float,
) -> dict:
    """The loss-scaling settings checked and typed (DeepSpeed's ``"fp16"`` names in every error, with the range):
    ``loss_scale`` 0 (dynamic) or a static scale in [2**-64, 2**64]; ``initial_scale_power`` in [0, 64] (2**128 is
    already infinite in float32, and every power above the useful ~16-32 costs one skipped step per halving);
    ``loss_scale_window`` and ``hysteresis`` >= 1 (int64 counters on the device); ``min_loss_scale`` (dynamic) in
    [2**-64, 2**initial_scale_power]: a floor above the starting scale would raise the scale on an overflow."""
    lo, hi = 2.0**-MAX_SCALE_POWER, 2.0**MAX_SCALE_POWER
    static = as_float("fp16.loss_scale", loss_scale)
    if static != 0.0 and not lo <= static <= hi:
        raise ValueError(
            f'"fp16.loss_scale"={static} must be 0 (dynamic) or a static scale in [2**-64, 2**64] (the '
            "scale and 1/scale are float32)"
        )
    power = as_int("fp16.initial_scale_power", initial_scale_power, minimum=0, maximum=MAX_SCALE_POWER)
    out = {
        "loss_scale": static,
        "initial_scale_power": power,
        "loss_scale_window": as_int("fp16.loss_scale_window", loss_scale_window, minimum=1),
        "hysteresis": as_int("fp16.hysteresis", hysteresis, minimum=1),
        "consecutive_hysteresis": as_bool("fp16.consecutive_hysteresis", consecutive_hysteresis),
        "min_loss_scale": as_float("fp16.min_loss_scale", min_loss_scale, minimum=0.0),
    }
    floor = out["min_loss_scale"]
    if (static == 0.0 and not lo <= floor <= 2.0**power) or floor > hi:
        raise ValueError(
            f'"fp16.min_loss_scale"={floor} must be > 0 with dynamic loss scaling, in [2**-64, '
            f'2**"fp16.initial_scale_power" = 2**{power}] (a floor above the initial scale would '
            "raise the scale on an overflow)"
        )
    return out


class LossScaler:
    """The loss scale S of fp16 training (module docstring); keyword names as in DeepSpeed's ``"fp16"`` block."""

    def __init__(
        self,
        *,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> None:
        s = check_scaling(
            loss_scale=loss_scale,
            initial_scale_power=initial_scale_power,
            loss_scale_window=loss_scale_window,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_loss_scale=min_loss_scale,
        )
        self.dynamic = s["loss_scale"] == 0.0
        self.scale_window, self.delayed_shift = s["loss_scale_window"], s["hysteresis"]
        self.consecutive_hysteresis, self.min_scale = s["consecutive_hysteresis"], s["min_loss_scale"]
        init = float(2 ** s["initial_scale_power"]) if self.dynamic else s["loss_scale"]
        self.device = torch.device(device)
        self.cur_iter = 0
        self._scale = torch.tensor(init, dtype=torch.float64, device=self.device)
        self._hysteresis = torch.tensor(self.delayed_shift, dtype=torch.int64, device=self.device)
        self._last_overflow = torch.tensor(-1, dtype=torch.int64, device=self.device)
        self._stuck: torch.Tensor | None = None  # overflow at the minimum: raised when seen on the host
        self._pending: tuple[torch.Tensor, object] | None = None  # CUDA: (pinned copy of the flag, its event)

    def to(self, device: torch.device | str) -> "LossScaler":
        """Move the state to ``device`` (the optimizer's); returns self."""
        self.device = torch.device(device)
        self._scale, self._hysteresis, self._last_overflow = (
            t.to(self.device) for t in (self._scale, self._hysteresis, self._last_overflow)
        )
        return self

    # ------------------------------------------------------------------ reading
    @property
    def scale(self) -> torch.Tensor:
        """S as a float32 0-d tensor on the device (what the loss is multiplied by)."""
        return self._scale.to(torch.float32)

    def inv_scale(self) -> torch.Tensor:
        """1 / S, float64 0-d on the device."""
        return torch.reciprocal(self._scale)

    @property
    def loss_scale(self) -> float:
        """S on the host (DeepSpeed's ``optimizer.loss_scale`` / ``cur_scale``; reading syncs)."""
        self._check(block=True)
        return float(self._scale)

    cur_scale = loss_scale

    @property
    def cur_hysteresis(self) -> int:
        return int(self._hysteresis)

    @property
    def last_overflow_iter(self) -> int:
        return int(self._last_overflow)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` (float32 or wider: the scale is never rounded to the loss's float16)."""
        return loss * self.scale.to(loss.device)

    # ------------------------------------------------------------------ updating
    @torch.no_grad()
    def update(self, found_inf: torch.Tensor) -> None:
        """One optimizer step's update (DeepSpeed's ``update_scale``) from its found-inf flag, on the device."""
        self._check(block=False)
        self.cur_iter += 1
        if not self.dynamic:
            return
        it = self.cur_iter - 1  # DeepSpeed's cur_iter during its update
        overflow = found_inf.to(self.device).reshape(()) != 0
        exhausted = self._hysteresis <= 1
        drop = overflow & exhausted
        stuck = drop & (self._scale == self.min_scale)
        stable = it - self._last_overflow - 1
        grow = ~overflow & (stable > 0) & (torch.remainder(stable, self.scale_window) == 0)
        down = torch.clamp(self._scale / 2, min=self.min_scale)
        new_scale = torch.where(drop, down, torch.where(grow, self._scale * 2, self._scale))
        refill = ~overflow & (grow | self.consecutive_hysteresis)
        new_hyst = torch.where(
            overflow & ~exhausted,
            self._hysteresis - 1,
            torch.where(refill, torch.full_like(self._hysteresis, self.delayed_shift), self._hysteresis),
        )
        self._scale.copy_(torch.where(stuck, self._scale, new_scale))
        self._hysteresis.copy_(new_hyst)
        self._last_overflow.copy_(torch.where(overflow, torch.full_like(self._last_overflow, it), self._last_overflow))
        self._note_stuck(stuck)

    def _note_stuck(self, stuck: torch.Tensor) -> None:
        """Keep the at-minimum flag (sticky until raised): read at once on the CPU; on CUDA copied to pinned host
        memory without blocking, read once its copy has landed (next update) or when someone reads the scale."""
        self._stuck = stuck if self._stuck is None else self._stuck | stuck
        if stuck.device.type != "cuda":
            self._check(block=True)
            return
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(self._stuck, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)

    def _check(self, *, block: bool) -> None:
        """Raise the at-minimum error once its flag is on the host (``block``: wait for it)."""
        if self._stuck is None:
            return
        if self._pending is not None:
            host, event = self._pending
            if not event.query():  # type: ignore[attr-defined]
                if not block:
                    return
                event.synchronize()  # type: ignore[attr-defined]
            flag = bool(host)
        else:
            flag = bool(self._stuck)
        if flag:
            self._stuck, self._pending = None, None
            raise RuntimeError(_AT_MINIMUM.format(self.min_scale))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, float | int]:
        """JSON-able state (reading syncs once)."""
        return {
            "cur_scale": float(self._scale),
            "cur_iter": self.cur_iter,
            "last_overflow_iter": int(self._last_overflow),
            "cur_hysteresis": int(self._hysteresis),
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict) -> None:
        """Take a saved state back. A static scaler keeps its configured scale (as DeepSpeed's config wins)."""
        self.cur_iter = int(state["cur_iter"])
        self._stuck, self._pending = None, None
        if not self.dynamic:
            return
        self._scale.fill_(float(state["cur_scale"]))
        self._last_overflow.fill_(int(state["last_overflow_iter"]))
        self._hysteresis.fill_(int(state["cur_hysteresis"]))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={float(self._scale):g}, iter={self.cur_iter})"


@torch.no_grad()
def unscale_and_clip(
    norm: torch.Tensor, max_grad_norm: float | None, scaler: LossScaler | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """From the global norm of the (scaled) grads: ``(norm, gscale, gscale64, found_inf)``, all on the norm's device.

    norm: the true grad norm (the scaled one times 1/S), float64. gscale: the float32 coefficient the fused step
    multiplies every grad by, ``min(1, max_grad_norm / (norm + 1e-6)) / S`` (None: 1); gscale64: the same in float64
    for float64 grads (None: 1). found_inf: float32, 1 when the norm is not finite (the step is skipped).
    Without a scaler the float32 coefficient is ``clip_coefficient``'s, bit for bit."""
    inv = scaler.inv_scale().to(norm.device) if scaler is not None else None
    if inv is not None:
        norm = norm.double() * inv
    found_inf = (~torch.isfinite(norm)).to(torch.float32)
    clip64 = None
    gscale = None
    if max_grad_norm is not None:
        gscale, found_inf = clip_coefficient(norm, max_grad_norm)
        clip64 = torch.clamp(float(max_grad_norm) / (norm.double() + 1e-6), max=1.0)
        clip64 = torch.where(torch.isfinite(clip64), clip64, torch.ones_like(clip64))
    if inv is not None:
        gscale = inv.to(torch.float32) if gscale is None else gscale * inv.to(torch.float32)
        clip64 = inv if clip64 is None else clip64 * inv
    return norm, gscale, clip64, found_inf


__all__ = ["MAX_SCALE_POWER", "LossScaler", "check_scaling", "unscale_and_clip"]
