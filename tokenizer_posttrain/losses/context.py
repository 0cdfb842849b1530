"""What a loss term reads of a training step: :class:`StepContext`.

The step fills it once and hands it to every term (:meth:`~.loss.Loss.forward`); each term reads what it
needs. The clip's reconstruction, the clip and its mask are always there; the posterior where the network
has one (VAEs; None for Cosmos); the encoder's continuous output; and ``extras``, the network's outputs on other
clips that a term asked for (:meth:`~.terms.LossTerm.extra_inputs`: loss.consistency's windows), run by the step
before its own pass, each once, and only at the steps where a term that asks is on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional

from torch import Tensor


class Posterior(NamedTuple):
    """A VAE encoder's Gaussian posterior over the latent, which a KL term reads."""

    mean: Tensor
    logvar: Tensor

    @classmethod
    def of(cls, encoding: Any) -> Optional[Posterior]:
        """The posterior of a network's ``Encoding`` (its ``mean`` and ``logvar``), or None where it has none."""
        if encoding.mean is None or encoding.logvar is None:
            return None
        return cls(encoding.mean, encoding.logvar)


class NetworkOutput(NamedTuple):
    """The network's outputs on the clips of an extra pass (:meth:`~.terms.LossTerm.extra_inputs`)."""

    reconstruction: Tensor
    """``[N, 3, T, H, W]``."""
    latent: Optional[Tensor] = None
    """Continuous latents ``[N, C, t, h, w]``; None for discrete tokenizers (their codes are quantized: terms
    compare their pixels only)."""


NetworkPass = Callable[[Tensor], NetworkOutput]
"""The step's network run on other clips (encoder and decoder, as in its own pass), which the step hands to
:meth:`~.loss.Loss.extra_passes`."""


class StepContext(NamedTuple):
    """One step as the loss terms see it. Videos are ``[B, 3, T, H, W]`` in [-1, 1]; ``mask``
    ``[B, 1, T, H, W]`` is 1 where a pixel counts."""

    reconstruction: Tensor
    """The network's reconstruction of ``target``."""
    target: Tensor
    """The clip."""
    mask: Tensor
    """Which pixels count (padding does not)."""
    posterior: Optional[Posterior] = None
    """The encoder's posterior over the clip's latent; None where the network has none (Cosmos)."""
    extras: Optional[Mapping[str, NetworkOutput]] = None
    """The network's outputs on the clips the active terms asked for, by the name each term gave them."""
    latent: Optional[Tensor] = None
    """The encoder's continuous output on the clip (``Encoding.continuous``: the latent, a VAE's posterior mean,
    a discrete tokenizer's codes before quantizing), which loss.latent_anchor holds near the base's."""

    def extra(self, name: str) -> NetworkOutput:
        """The extra pass ``name``; a clear error where the step did not run it."""
        if self.extras is None or name not in self.extras:
            raise ValueError(
                f"the step's context holds no extra pass {name!r}: the step runs Loss.extra_passes before its "
                "own pass and hands the outputs over as StepContext(extras=)"
            )
        return self.extras[name]
