"""The L1 reconstruction term."""

from dataclasses import dataclass

from torch import Tensor

from .context import StepContext
from .terms import LossTerm, TermConfig


@dataclass
class L1Config(TermConfig):
    """Mean absolute pixel error over the masked pixels."""

    weight: float = 1.0

    def build(self) -> "L1Loss":
        return L1Loss(self)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over the elements where ``mask`` (broadcast to them) is 1, in fp32."""
    weight = mask.float().expand_as(values)
    return (values.float() * weight).sum() / weight.sum().clamp_min(1)


def masked_l1(reconstruction: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Mean absolute error over the pixels where ``mask`` is 1 (computed in fp32)."""
    return masked_mean((reconstruction.float() - target.float()).abs(), mask)


class L1Loss(LossTerm):
    """:func:`masked_l1` as a loss term."""

    def __init__(self, config: L1Config) -> None:
        super().__init__()
        self.config = config

    def forward(self, context: StepContext) -> Tensor:
        return masked_l1(context.reconstruction, context.target, context.mask)
