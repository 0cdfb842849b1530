"""What happens to each optimizer step between the backward pass and AdamW: the loss terms' means over the
micro-batches, the gradient norm, the NaN/Inf verdict that skips a step, clipping, and the read-back of
those scalars from the GPU a step late (so the host never waits for it) to the loggers.
:class:`StepGuard` is the piece the LightningModule delegates all of it to."""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import Tensor

from ..core.errors import UserError


class NonFiniteLossError(UserError, RuntimeError):
    """Too many optimizer steps in a row had a NaN/Inf loss or gradient: steps ``first`` to ``last``."""

    def __init__(self, message: str, first: int = 0, last: int = 0) -> None:
        super().__init__(message)
        self.first, self.last = first, last


@dataclass
class _Pending:
    step: int
    names: tuple[str, ...]
    host: Tensor  # the values, in page-locked host memory once the copy has landed
    ready: torch.cuda.Event | None


class DeviceScalars:
    """A queue of per-step scalar dicts on their way from the device to the host.

    On a GPU each push is one asynchronous copy into page-locked memory behind a CUDA event. Reading
    a value at once (``.item()``, ``float()``, Lightning's logging of a CUDA tensor) would drain the
    GPU's queue and leave it idle while the host prepares the next step; read a step later, the copy
    finished long ago and the event wait costs nothing.
    """

    def __init__(self) -> None:
        self._pending: deque[_Pending] = deque()

    def push(self, step: int, values: dict[str, Tensor]) -> None:
        """Queue the scalars of optimizer step ``step`` (one-element tensors on one device)."""
        names = tuple(values)
        stacked = torch.stack([value.detach().float().reshape(()) for value in values.values()])
        if stacked.device.type == "cuda":
            host = torch.empty(stacked.shape, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            self._pending.append(_Pending(step, names, host, ready))
        else:
            self._pending.append(_Pending(step, names, stacked, None))

    def pop(self, keep_last: int = 0) -> list[tuple[int, dict[str, float]]]:
        """All but the newest ``keep_last`` queued steps, oldest first, as ``(step, {name: value})``."""
        out = []
        while len(self._pending) > keep_last:
            item = self._pending.popleft()
            if item.ready is not None:
                item.ready.synchronize()
            out.append((item.step, dict(zip(item.names, item.host.tolist(), strict=True))))
        return out


def is_log_step(step: int, log_every_n_steps: int) -> bool:
    """Whether optimizer step ``step`` (0-based) is logged: Lightning's cadence, 0 meaning never."""
    return log_every_n_steps > 0 and (step + 1) % log_every_n_steps == 0


def grad_norm(grads: list[Tensor]) -> Tensor:
    """The global L2 norm of ``grads`` in fp32, whatever their dtype (bf16 under bf16-true), in a few
    kernels; a 0-dim tensor on their device."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def skip_flag(norm: Tensor) -> Tensor:
    """1.0 where the step must be skipped (``norm`` is NaN/Inf), else 0.0: the ``found_inf`` tensor
    that fused AdamW reads to leave parameters, moments and step count untouched, on the device."""
    return (~torch.isfinite(norm)).float()


class NonFiniteSteps:
    """Counts optimizer steps skipped for a NaN/Inf gradient norm; ``max_in_a_row`` in a row stop the run.

    Every DDP rank sees the same all-reduced norm at the same step, so all ranks warn and stop together.
    """

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.first_bad = 0

    def check(self, step: int, norm: float) -> bool:
        """Whether step ``step`` (gradient norm ``norm``) is skipped; raises :class:`NonFiniteLossError`
        once ``max_in_a_row`` skipped steps came in a row."""
        if math.isfinite(norm):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        if self.in_a_row == 1:
            self.first_bad = step
        warnings.warn(f"step {step}: gradient norm is {norm}; step skipped ({self.in_a_row} in a row)", stacklevel=2)
        if self.in_a_row >= self.max_in_a_row:
            # The run folder's checkpoints are named by the training entry, which rewrites this message.
            raise NonFiniteLossError(
                f"{self.in_a_row} steps in a row (steps {self.first_bad}-{step}) had a NaN/Inf loss or gradient "
                f"(trainer.max_bad_steps="
                f"{self.max_in_a_row}); stopped",
                first=self.first_bad,
                last=step,
            )
        return True


class StepGuard:
    """The per-step bookkeeping of one training run (see the module docstring).

    ``gradient_clip_val`` > 0 clips the global gradient norm to it, from the norm computed for the logs anyway;
    Lightning's own clipping refuses fused AdamW (our CUDA optimizer) under mixed precision, even bf16.
    """

    def __init__(self, max_bad_steps: int = 10, gradient_clip_val: float = 0.0) -> None:
        self.nonfinite = NonFiniteSteps(max_bad_steps)
        self.gradient_clip_val = gradient_clip_val
        self.loss_history: list[tuple[int, float]] = []
        """``(optimizer step, train/loss)`` of every logged step."""
        self.reset()

    def reset(self) -> None:
        """Nothing left over from an earlier fit (a second ``fit()`` after an exception)."""
        self.to_host = DeviceScalars()
        self._sums: dict[str, Tensor] = {}  # loss terms summed over this optimizer step's micro-batches
        self._micro_batches = 0
        self._deferred_stop: NonFiniteLossError | None = None

    def add_micro_batch(self, terms: dict[str, Tensor]) -> None:
        """Add one micro-batch's loss terms to the step's sums (no host sync)."""
        for name, value in terms.items():
            value = value.detach()
            # A copy where the output itself would be kept: a CUDA graph overwrites it at its next replay.
            self._sums[name] = self._sums[name] + value if name in self._sums else value.clone()
        self._micro_batches += 1

    def before_optimizer_step(self, module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        """After the backward (and DDP's all-reduce) of optimizer step ``module.global_step``: queue its
        scalars, decide the skip of a NaN/Inf step (on the device with fused AdamW), clip."""
        if self._deferred_stop is not None:
            raise self._deferred_stop
        step = module.global_step
        scalars = {f"train/{name}": total / self._micro_batches for name, total in self._sums.items()}
        self._sums, self._micro_batches = {}, 0
        params = [p for p in module.parameters() if p.grad is not None]
        if not params:
            return
        # After DDP's all-reduce: the same norm, hence the same verdict, on every rank.
        norm = grad_norm([p.grad for p in params])
        self.to_host.push(step, {**scalars, "train/grad_norm": norm})  # grad_norm: before clipping
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper, if any
        fused = bool(optimizer.defaults.get("fused"))
        if fused:
            # Fused AdamW leaves parameters, moments and step count alone where found_inf is 1 (the
            # hook GradScaler uses), on the device: no host wait; the verdict is read a step later.
            optimizer.found_inf = skip_flag(norm)  # type: ignore[attr-defined]
        if self.settle(module, keep_last=1 if fused else 0) and not fused:  # the verdict is this step's
            optimizer.zero_grad(set_to_none=True)  # AdamW skips parameters without gradients
            return
        if self.gradient_clip_val > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.gradient_clip_val, norm, foreach=True)

    def settle(self, module: pl.LightningModule, keep_last: int, to_bar: bool = True) -> bool:
        """Read back the queued steps' scalars: skip verdicts, loggers, progress bar. Whether the newest
        step read was skipped."""
        skipped = logged = False
        every = module.trainer.log_every_n_steps if module._trainer else 1
        for step, values in self.to_host.pop(keep_last):
            skipped = self.nonfinite.check(step, values["train/grad_norm"])
            if skipped:
                values["train/bad_steps"] = float(self.nonfinite.in_a_row)
            # Lightning's own logging cadence and step numbers.
            if is_log_step(step, every) or skipped:
                logged = True
                for logger in module.loggers:
                    logger.log_metrics(values, step=step)
                if "train/loss" in values:
                    self.loss_history.append((step, values["train/loss"]))
                    if to_bar:  # a CPU value: the bar reads it without waiting for the GPU
                        module.log("train/loss", torch.tensor(values["train/loss"]), prog_bar=True, logger=False)
        if logged:  # rows read back after Lightning's own last save would otherwise stay unwritten
            for logger in module.loggers:
                logger.save()
        return skipped

    def on_save_checkpoint(self, module: pl.LightningModule) -> None:
        """The step still on its way to the host goes to the loggers now: a run stopped right after this
        checkpoint (preemption) must not leave a gap in the logs at the step it resumes from. A stop for NaN
        steps waits for the next step: raised here it would break the save (and the preemption handling
        that may have asked for it)."""
        try:
            self.settle(module, keep_last=0, to_bar=False)
        except NonFiniteLossError as stop:
            self._deferred_stop = stop

    def on_train_end(self, module: pl.LightningModule) -> None:
        """The last step's verdict and scalars (no ``self.log`` at this point of the fit)."""
        if self._deferred_stop is not None:
            raise self._deferred_stop
        self.settle(module, keep_last=0, to_bar=False)
