"""What trains: one side of the network bit-identical to the other, LoRA adapters only, merged exports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import fit
from tests.training.conftest import no_vgg, snapshot, tiny
from tokenizer_posttrain.io.export import export_tokenizer
from tokenizer_posttrain.training.config import LoRAConfig, OptimConfig
from tokenizer_posttrain.training.module import TokenizerModel


@pytest.mark.parametrize(
    "trainable, frozen, moving", [("decoder", "encoder.", "decoder."), ("encoder", "decoder.", "encoder.")]
)
def test_one_side_training_leaves_the_other_bit_identical(
    tmp_path: Path, trainable: str, frozen: str, moving: str
) -> None:
    module = TokenizerModel(tiny(trainable=trainable), OptimConfig(lr=1e-3), no_vgg())
    before = snapshot(module)
    fit(module, tmp_path)
    after = module.network.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(frozen))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(moving))
    if trainable == "decoder":  # the latent space is untouched: the same clip gives the same tokens
        video = torch.rand(1, 3, 9, 32, 32) * 2 - 1
        fresh = TokenizerModel(tiny(), loss=no_vgg()).network.eval()
        with torch.no_grad():
            assert torch.equal(module.network.eval().encode(video)[0], fresh.encode(video)[0])


def test_lora_trains_adapters_only_and_exports_merged(tmp_path: Path) -> None:
    module = TokenizerModel(
        tiny("CV8x8x8", lora=LoRAConfig(rank=4, targets=["decoder.*"])), OptimConfig(lr=1e-2), no_vgg()
    )
    assert module.trainable_names and all(".lora_" in n and n.startswith("decoder.") for n in module.trainable_names)
    base = {k: v for k, v in snapshot(module).items() if ".lora_" not in k}
    fit(module, tmp_path)
    state = module.network.state_dict()
    assert all(torch.equal(base[k], state[k]) for k in base)  # base weights untouched
    video = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        adapted = module.network.eval()(video)
    folder = export_tokenizer(module.network, tmp_path / "export")
    exported = torch.jit.load(str(folder / "autoencoder.jit"))
    assert not any(".lora_" in k for k in exported.state_dict())  # official keys: nothing extra needed
    with torch.no_grad():
        torch.testing.assert_close(
            exported(video)[0], adapted, rtol=1e-3, atol=1e-4
        )  # merged weights round differently


def test_lora_checkpoint_loads_merged(tmp_path: Path) -> None:
    from tokenizer_posttrain.io.checkpoint import load_tokenizer

    module = TokenizerModel(tiny("CV8x8x8", lora=LoRAConfig(rank=2, alpha=4.0)), OptimConfig(lr=1e-2), no_vgg())
    trainer = fit(module, tmp_path, steps=2)
    trainer.save_checkpoint(tmp_path / "lora.ckpt")
    loaded = load_tokenizer(tmp_path / "lora.ckpt").eval()
    video = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(video), module.network.eval()(video), rtol=1e-3, atol=1e-4
        )  # merged weights round differently
