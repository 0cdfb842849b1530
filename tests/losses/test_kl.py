"""loss.kl: the KL divergence of a VAE's posterior from the unit Gaussian."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from tokenizer_posttrain.losses import LossConfig, StepContext, build_loss
from tokenizer_posttrain.losses.context import Posterior
from tokenizer_posttrain.losses.kl import KLConfig, kl_to_unit_gaussian
from tokenizer_posttrain.losses.terms import Clips


def test_the_value_is_the_kl_summed_over_each_clip_s_latent_and_averaged_over_clips() -> None:
    mean, logvar = torch.randn(3, 4, 2, 5, 5), torch.randn(3, 4, 2, 5, 5) * 0.5
    expected = kl_divergence(Normal(mean, torch.exp(0.5 * logvar)), Normal(0.0, 1.0)).flatten(1).sum(1).mean()
    torch.testing.assert_close(kl_to_unit_gaussian(mean, logvar), expected, rtol=1e-5, atol=1e-6)
    assert float(kl_to_unit_gaussian(torch.zeros(2, 4, 1, 3, 3), torch.zeros(2, 4, 1, 3, 3))) == 0.0


def test_the_term_reads_the_step_s_posterior_and_joins_the_total() -> None:
    loss = build_loss(LossConfig(perceptual_weight=0.0, kl=KLConfig(weight=1e-3)))
    weights = loss.prepare(0, torch.device("cpu"))
    assert weights == {"l1": 1.0, "kl": 1e-3}
    video = torch.rand(2, 3, 5, 8, 8) * 2 - 1
    posterior = Posterior(torch.randn(2, 4, 2, 1, 1), torch.randn(2, 4, 2, 1, 1))
    terms = loss(StepContext(video * 0.5, video, torch.ones(2, 1, 5, 8, 8), posterior), weights)
    torch.testing.assert_close(terms["kl"], kl_to_unit_gaussian(*posterior))
    torch.testing.assert_close(terms["loss"], terms["l1"] + 1e-3 * terms["kl"])
    assert not loss.reconstruction_only(weights)  # the GAN's split step cannot carry it
    with pytest.raises(ValueError, match="loss.kl is on but the step has no posterior"):
        loss(StepContext(video, video, torch.ones(2, 1, 5, 8, 8)), weights)


def test_a_model_without_a_posterior_refuses_it_at_launch() -> None:
    config = LossConfig(perceptual_weight=0.0, kl=KLConfig(weight=1e-6))
    cosmos = Clips(33, ((256, 256),), 8, continuous=True, posterior=False)
    assert config.clip_problems(cosmos) == [
        "loss.kl needs the posterior of a VAE, which this model's encoder does not give; set loss.kl.weight=0"
    ]
    assert config.clip_problems(Clips(33, ((256, 256),), 4, continuous=True, posterior=True)) == []
