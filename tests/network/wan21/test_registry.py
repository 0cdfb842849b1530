"""The family entry: names, the config a checkpoint records, the per-channel latent constants and the official
``.pth`` weights file, read weights-only and loaded strictly with its width inferred."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenizer_posttrain import load_tokenizer
from tokenizer_posttrain.core.errors import CheckpointError
from tokenizer_posttrain.network import FAMILIES, build_tokenizer, config_from_dict, family_of, get_config, resolve
from tokenizer_posttrain.network.wan21 import WAN21_LATENT_MEAN, WAN21_LATENT_STD, Wan21VAE, read_pth


@pytest.mark.parametrize("name", ["Wan2.1-VAE", "Wan-AI/Wan2.1-VAE", " Wan2.1-VAE/", "Wan2.1_VAE"])
def test_the_names_resolve_to_the_family(name: str) -> None:
    family, short = resolve(name)
    assert (family.name, short) == ("wan21", "Wan2.1-VAE")
    assert family.latent_stats == "per-channel" and family is FAMILIES["wan21"]
    assert resolve("CV8x8x8")[0].name == "cosmos"  # the first family still resolves


def test_the_config_round_trips_through_a_checkpoint_record() -> None:
    cfg = get_config("Wan2.1-VAE", channels=8, z_dim=4, temporal_downsample=[False, False, True])
    record = json.loads(json.dumps(cfg.to_dict()))
    assert record["family"] == "wan21" and record["temporal_downsample"] == [False, False, True]
    assert config_from_dict(record) == cfg and hash(config_from_dict(record)) == hash(cfg)
    assert family_of(cfg).name == "wan21" and (cfg.temporal_compression, cfg.spatial_compression) == (2, 8)
    with pytest.raises(ValueError, match=r"unknown Wan2.1 config field\(s\) \['width'\]"):
        get_config("Wan2.1-VAE", width=8)
    with pytest.raises(ValueError, match="one flag per resampler"):
        get_config("Wan2.1-VAE", temporal_downsample=(True,))


def test_the_latent_constants_are_sixteen_per_channel_numbers() -> None:
    assert len(WAN21_LATENT_MEAN) == len(WAN21_LATENT_STD) == get_config("Wan2.1-VAE").latent_dim
    assert min(WAN21_LATENT_STD) > 0


def test_a_pth_state_dict_loads_strictly_with_its_width_inferred(tmp_path: Path) -> None:
    network = build_tokenizer("Wan2.1-VAE", channels=8)
    torch.save(network.state_dict(), tmp_path / "Wan2.1_VAE.pth")
    loaded = load_tokenizer(tmp_path / "Wan2.1_VAE.pth")
    assert isinstance(loaded, Wan21VAE) and loaded.config == get_config("Wan2.1-VAE", channels=8)
    for key, value in network.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_a_wrong_key_is_named(tmp_path: Path) -> None:
    state = build_tokenizer("Wan2.1-VAE", channels=8).state_dict()
    state["decoder.head.2.kernel"] = state.pop("decoder.head.2.weight")
    torch.save(state, tmp_path / "renamed.pth")
    with pytest.raises(ValueError, match=r"decoder\.head\.2\.weight") as raised:
        load_tokenizer(tmp_path / "renamed.pth", "Wan2.1-VAE", channels=8)
    assert "decoder.head.2.kernel" in str(raised.value)


def test_the_reader_takes_only_wan_state_dicts(tmp_path: Path) -> None:
    assert read_pth(tmp_path) is None and read_pth(tmp_path / "absent.pth") is None
    torch.save({"weight": torch.zeros(1)}, tmp_path / "other.pth")
    assert read_pth(tmp_path / "other.pth") is None  # another model's tensors: not this format
    save = tmp_path / "w.safetensors"
    save.write_bytes(b"")
    assert read_pth(save) is None
    torch.save({"state_dict": {"conv1.weight": torch.zeros(1)}, "step": 3}, tmp_path / "nested.pth")
    with pytest.raises(CheckpointError, match=r"nested\.pth is not a state dict of tensors") as raised:
        read_pth(tmp_path / "nested.pth")
    assert "\n" not in str(raised.value)
