"""What every loss term shares: a weight schedule over optimizer steps, and the term's interface."""

import bisect
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from .context import StepContext


@dataclass(frozen=True)
class Clips:
    """The clips a run trains on, as a term's launch check sees them (:meth:`TermConfig.clip_problems`)."""

    frames: int
    """``data.frames``."""
    sizes: tuple[tuple[int, int], ...]
    """Every (height, width) the clips take: the crop, or each aspect bucket's."""
    temporal_compression: int
    """The model's: latent frames code ``1 + k * temporal_compression`` frames."""
    continuous: bool
    """Continuous latents (CV), not discrete tokens (DV)."""
    posterior: bool = False
    """The encoder gives a Gaussian posterior (a VAE), which loss.kl reads."""
    encoder_trains: bool = True
    """The run trains the encoder (``model.trainable`` is not ``decoder``), which loss.latent_anchor holds."""


@dataclass
class Schedule:
    """A value over optimizer steps: constant, or piecewise constant (a loss term's weight, the latent noise)."""

    weight: float = 0.0
    """Weight of the term at every step (used when ``values`` is empty); 0 turns the term off."""
    boundaries: list[int] = field(default_factory=list)
    """Optimizer steps (0-based) where the weight changes, increasing. As in NVIDIA's tokenizer trainers
    (``iteration < boundary``, on the 0-based step): ``values[0]`` while step < boundaries[0], ``values[i]``
    while boundaries[i-1] <= step < boundaries[i], ``values[-1]`` from the last boundary on."""
    values: list[float] = field(default_factory=list)
    """``len(boundaries) + 1`` weights of the schedule; empty means ``weight`` at every step."""

    def weight_at(self, step: int) -> float:
        """The weight at optimizer step ``step``."""
        if not self.values:
            return float(self.weight)
        return float(self.values[bisect.bisect_right(self.boundaries, step)])

    @property
    def weights(self) -> list[float]:
        """Every weight the schedule takes."""
        return [float(v) for v in self.values] if self.values else [float(self.weight)]

    @property
    def ever_on(self) -> bool:
        """Whether the term has a non-zero weight at some step (and so needs its files and networks)."""
        return any(w != 0 for w in self.weights)

    def problems(self, key: str) -> list[str]:
        """What is wrong with this schedule, each naming ``key`` (``loss.<term>``) and the fix."""
        problems = [
            f"{key}.weight={w} must be finite and >= 0" for w in self.weights if not (math.isfinite(w) and w >= 0)
        ]
        if self.values and len(self.values) != len(self.boundaries) + 1:
            problems.append(
                f"{key}.values has {len(self.values)} entries for {len(self.boundaries)} boundaries; "
                f"give len(boundaries) + 1 = {len(self.boundaries) + 1}"
            )
        if self.boundaries and not self.values:
            problems.append(f"{key}.boundaries is set but {key}.values is empty; give the weight of each interval")
        if any(b <= a for a, b in zip(self.boundaries, self.boundaries[1:], strict=False)) or any(
            b < 0 for b in self.boundaries
        ):
            problems.append(f"{key}.boundaries={self.boundaries} must be increasing optimizer steps >= 0")
        return problems


@dataclass
class TermConfig(Schedule):
    """A loss term's settings: its weight schedule, and the term it builds."""

    def build(self) -> "LossTerm":
        """The term this config sets up (each term's config names its class here)."""
        raise NotImplementedError(f"{type(self).__name__} names no loss term: give it a build() returning one")

    def clip_problems(self, key: str, clips: Clips) -> list[str]:
        """What stops this term on the run's ``clips``, each naming the setting (``key``: ``loss.<term>``) and what
        to set; asked at launch of the terms that are ever on. Most terms take any clip."""
        return []


class LossTerm(nn.Module):
    """One term of the objective: ``forward(context)`` -> fp32 scalar, from what it reads of the step's
    :class:`~.context.StepContext` (reconstruction, target, mask, posterior, extra passes).

    A term that needs a network or a file finds the file in :meth:`check` (at launch) and builds the
    network in :meth:`prepare`, the first time its weight is non-zero, outside any compiled code. A term that
    needs the network's outputs on other clips names them in :meth:`extra_inputs`.
    """

    reconstruction_only: ClassVar[bool] = True
    """Whether the term reads the network through the step's reconstruction alone (not through extra passes or
    the posterior). loss.gan's split step, which takes the loss's gradient at the reconstruction, runs only
    while every active term does."""

    def check(self) -> None:
        """Raise a clear error now if the term could not run later (e.g. a missing weights file)."""

    def attach(self, network: nn.Module) -> None:
        """Called once with the network to train, before training changes it (or adapters wrap it): a term that
        compares with the base model keeps what it needs of it here. Most terms: nothing."""

    def prepare(self, device: torch.device) -> None:
        """Build what the term needs (once) and move it to ``device``."""
        self.to(device)

    def extra_inputs(self, target: Tensor) -> dict[str, Tensor]:
        """Clips, made from the step's ``target``, that the network must also run on for this term, by name:
        the step runs each name once, before its own pass, and the term reads the outputs as
        ``context.extra(name)``. Most terms: none."""
        return {}

    def forward(self, context: StepContext) -> Tensor:  # pragma: no cover
        raise NotImplementedError
