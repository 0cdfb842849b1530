"""The KL term of a variational autoencoder's posterior (the Wan VAEs): it keeps the encoder's Gaussian posterior
near the unit Gaussian it was trained against, so that fine-tuning does not collapse the variance or spread the
latents beyond what the decoder and the world models downstream were trained on."""

from dataclasses import dataclass

from torch import Tensor

from .context import StepContext
from .terms import Clips, LossTerm, TermConfig

VAE_KL_WEIGHT = 1e-6
"""The KL weight the VAE recipes and the posttrain workflow train with (the latent-diffusion VAEs')."""


@dataclass
class KLConfig(TermConfig):
    """KL divergence of the encoder's posterior ``N(mean, exp(logvar))`` from ``N(0, 1)``, summed over the latent
    of each clip and averaged over the clips (the convention of the latent-diffusion VAEs, whose weight 1e-6 the
    Wan recipes use: strong enough to hold the variance, weak enough that reconstruction leads).

    Weight 0 (default): off; only tokenizers with a posterior (the VAE families) can turn it on."""

    def build(self) -> "KLTerm":
        return KLTerm(self)

    def clip_problems(self, key: str, clips: Clips) -> list[str]:
        if clips.posterior:
            return []
        return [f"{key} needs the posterior of a VAE, which this model's encoder does not give; set {key}.weight=0"]


def kl_to_unit_gaussian(mean: Tensor, logvar: Tensor) -> Tensor:
    """``KL(N(mean, exp(logvar)) || N(0, 1))`` summed over every latent value of a clip, averaged over the clips
    (dimension 0), in fp32."""
    mean, logvar = mean.float(), logvar.float()
    per_value = 0.5 * (mean.square() + logvar.exp() - 1.0 - logvar)
    return per_value.flatten(1).sum(dim=1).mean()


class KLTerm(LossTerm):
    """:func:`kl_to_unit_gaussian` of the step's posterior, as a loss term. The posterior's gradients reach the
    encoder alone (not the reconstruction), so the GAN stage's split step, which takes gradients at the
    reconstruction, runs the whole step while this term is on."""

    reconstruction_only = False

    def __init__(self, config: KLConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, context: StepContext) -> Tensor:
        if context.posterior is None:
            raise ValueError("loss.kl is on but the step has no posterior (the model is no VAE); set loss.kl.weight=0")
        return kl_to_unit_gaussian(context.posterior.mean, context.posterior.logvar)


__all__ = ["VAE_KL_WEIGHT", "KLConfig", "KLTerm", "kl_to_unit_gaussian"]
