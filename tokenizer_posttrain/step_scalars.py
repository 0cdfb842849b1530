"""Per-step scalars (losses, gradient norm) read back from the GPU a step late, so the host never
waits for it: the NaN/Inf verdict that skips a step, and the values that go to the loggers."""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a NaN/Inf loss or gradient."""


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

    def check(self, step: int, norm: float) -> bool:
        """Whether step ``step`` (gradient norm ``norm``) is skipped; raises :class:`NonFiniteLossError`
        once ``max_in_a_row`` skipped steps came in a row."""
        if math.isfinite(norm):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        warnings.warn(f"step {step}: gradient norm is {norm}; step skipped ({self.in_a_row} in a row)", stacklevel=2)
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteLossError(
                f"{self.in_a_row} steps in a row had a NaN/Inf loss or gradient (trainer.max_bad_steps="
                f"{self.max_in_a_row}); stopping. The newest checkpoint is from before them: lower optim.lr, "
                "check the data (python -m data_tools check) or use trainer.precision=32-true, then resume."
            )
        return True
