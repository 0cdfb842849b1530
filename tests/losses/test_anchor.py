"""loss.latent_anchor: the distance of the training encoder's output from the frozen base encoder's, in units of
each channel's spread; the base kept out of the checkpoint, the optimizer and DDP, and built only when on."""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.losses import LossConfig, StepContext
from tokenizer_posttrain.losses.anchor import LatentAnchorConfig, LatentAnchorTerm
from tokenizer_posttrain.losses.l1 import L1Config
from tokenizer_posttrain.losses.terms import Clips
from tokenizer_posttrain.network import build_tokenizer, channel_scale
from tokenizer_posttrain.training.config import LoRAConfig, ModelConfig
from tokenizer_posttrain.training.module import TokenizerModel

TINY = {"CV8x8x8": 16, "DV8x16x16": 16, "Wan2.1-VAE": 8}
CLIPS = {"CV8x8x8": (9, 32, 32), "DV8x16x16": (9, 32, 32), "Wan2.1-VAE": (5, 16, 16)}


def anchored(name: str, **model: object) -> TokenizerModel:
    """A tiny model trained on the anchor alone (L1 off), so every gradient is the anchor's."""
    torch.manual_seed(0)
    loss = LossConfig(perceptual_weight=0.0, l1=L1Config(weight=0.0), latent_anchor=LatentAnchorConfig(weight=1.0))
    return TokenizerModel(ModelConfig(model=name, channels=TINY[name], **model), loss=loss)


def step(module: TokenizerModel, name: str) -> dict[str, torch.Tensor]:
    video = torch.rand(2, 3, *CLIPS[name], generator=torch.Generator().manual_seed(1)) * 2 - 1
    mask = torch.ones(2, 1, *CLIPS[name])
    module.train()
    return module.step_forward(video, mask, module.loss.prepare(0, video.device))


@pytest.mark.parametrize("name", list(TINY))
def test_the_anchor_is_zero_at_the_base_and_its_gradient_reaches_the_encoder_only(name: str) -> None:
    module = anchored(name)
    assert float(step(module, name)["latent_anchor"]) == 0.0
    with torch.no_grad():  # the encoder moves away from its base
        for parameter in module.network.encoder.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    terms = step(module, name)
    assert float(terms["latent_anchor"]) > 0
    terms["loss"].backward()
    sides = module.network.sides
    for key, parameter in module.network.named_parameters():
        reached = parameter.grad is not None and bool(parameter.grad.abs().sum() > 0)
        if key.startswith(sides["decoder"]):
            assert not reached, key
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.network.encoder.parameters())


def test_the_value_is_the_mean_squared_distance_in_channel_spreads() -> None:
    network = build_tokenizer("Wan2.1-VAE", channels=8)
    term = LatentAnchorTerm()
    term.attach(network)
    video = torch.rand(1, 3, 5, 16, 16) * 2 - 1
    base = network.encoding(video).continuous.detach()
    moved = base + 0.5 * channel_scale(network.config, base)  # half a spread in every channel
    value = term(StepContext(video, video, torch.ones(1, 1, 5, 16, 16), latent=moved))
    assert value.item() == pytest.approx(0.25, rel=1e-5)


def test_the_base_is_frozen_outside_the_checkpoint_and_optimizer_and_has_no_decoder() -> None:
    plain = TokenizerModel(ModelConfig(model="CV8x8x8", channels=16), loss=LossConfig(perceptual_weight=0.0))
    module = anchored("CV8x8x8")
    assert "latent_anchor" not in plain.loss.terms  # weight 0: no copy made
    assert list(module.state_dict()) == list(plain.state_dict())
    optimized = {id(p) for group in module.configure_optimizers()["optimizer"].param_groups for p in group["params"]}
    base = module.loss.terms["latent_anchor"].base
    assert base.decoder is None and base.post_quant_conv is None
    assert not any(p.requires_grad or id(p) in optimized for p in base.parameters())
    # Taken before LoRA wraps the network: the base's convolutions are plain.
    lora = anchored("CV8x8x8", lora=LoRAConfig(rank=2))
    assert not any("lora" in key for key in lora.loss.terms["latent_anchor"].base.state_dict())


def test_a_frozen_encoder_refuses_the_anchor_at_launch() -> None:
    config = LossConfig(perceptual_weight=0.0, latent_anchor=LatentAnchorConfig(weight=0.1))
    clips = Clips(17, ((64, 64),), 4, continuous=True, posterior=True, encoder_trains=False)
    assert config.clip_problems(clips) == [
        "loss.latent_anchor holds a training encoder near its base, but model.trainable=decoder keeps the encoder "
        "(and the latents) as they are; set loss.latent_anchor.weight=0"
    ]
    assert config.clip_problems(Clips(17, ((64, 64),), 4, continuous=True)) == []
