"""The family entry: names, the config a checkpoint records, the per-channel latent constants and the official
``.pth`` weights file, read weights-only and loaded strictly with its sizes inferred; the Wan2.1 and Wan2.2
readers each leave the other's file alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenizer_posttrain import load_tokenizer
from tokenizer_posttrain.core.errors import CheckpointError
from tokenizer_posttrain.network import FAMILIES, build_tokenizer, config_from_dict, family_of, get_config, resolve
from tokenizer_posttrain.network.wan21 import read_pth as read_wan21_pth
from tokenizer_posttrain.network.wan22 import WAN22_LATENT_MEAN, WAN22_LATENT_STD, Wan22VAE, read_pth

from .conftest import TINY


@pytest.mark.parametrize("name", ["Wan2.2-VAE", "Wan-AI/Wan2.2-VAE", " Wan2.2-VAE/", "Wan2.2_VAE"])
def test_the_names_resolve_to_the_family(name: str) -> None:
    family, short = resolve(name)
    assert (family.name, short) == ("wan22", "Wan2.2-VAE")
    assert family.latent_stats == "per-channel" and family.posterior and family is FAMILIES["wan22"]
    assert resolve("Wan2.1-VAE")[0].name == "wan21" and resolve("CV8x8x8")[0].name == "cosmos"


def test_the_config_round_trips_through_a_checkpoint_record() -> None:
    cfg = get_config("Wan2.2-VAE", **TINY, temporal_downsample=[False, False, True])
    record = json.loads(json.dumps(cfg.to_dict()))
    assert record["family"] == "wan22" and record["temporal_downsample"] == [False, False, True]
    assert record["dec_channels"] == 12
    assert config_from_dict(record) == cfg and hash(config_from_dict(record)) == hash(cfg)
    assert family_of(cfg).name == "wan22" and (cfg.temporal_compression, cfg.spatial_compression) == (2, 16)
    with pytest.raises(ValueError, match=r"unknown Wan2.2 config field\(s\) \['dec_dim'\]"):
        get_config("Wan2.2-VAE", dec_dim=8)
    with pytest.raises(ValueError, match="one flag per resampler"):
        get_config("Wan2.2-VAE", temporal_downsample=(True,))
    with pytest.raises(ValueError, match=r"dec_channels .* level 2: widths 48 -> 6 do not share 4 positions"):
        get_config("Wan2.2-VAE", dec_channels=6, dim_mult=(1, 1, 8, 8))


def test_the_latent_constants_are_48_per_channel_numbers() -> None:
    assert len(WAN22_LATENT_MEAN) == len(WAN22_LATENT_STD) == get_config("Wan2.2-VAE").latent_dim == 48
    assert min(WAN22_LATENT_STD) > 0
    assert FAMILIES["wan22"].latent_constants == (WAN22_LATENT_MEAN, WAN22_LATENT_STD)


def test_a_pth_state_dict_loads_strictly_with_its_sizes_inferred(tmp_path: Path) -> None:
    network = build_tokenizer("Wan2.2-VAE", **TINY)
    torch.save(network.state_dict(), tmp_path / "Wan2.2_VAE.pth")
    loaded = load_tokenizer(tmp_path / "Wan2.2_VAE.pth")
    assert isinstance(loaded, Wan22VAE) and loaded.config == get_config("Wan2.2-VAE", **TINY)
    for key, value in network.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_a_wrong_key_is_named(tmp_path: Path) -> None:
    state = build_tokenizer("Wan2.2-VAE", **TINY).state_dict()
    state["decoder.head.2.kernel"] = state.pop("decoder.head.2.weight")
    torch.save(state, tmp_path / "renamed.pth")
    with pytest.raises(ValueError, match=r"decoder\.head\.2\.weight") as raised:
        load_tokenizer(tmp_path / "renamed.pth", "Wan2.2-VAE", **TINY)
    assert "decoder.head.2.kernel" in str(raised.value)


def test_the_reader_takes_only_wan22_state_dicts(tmp_path: Path) -> None:
    assert read_pth(tmp_path) is None and read_pth(tmp_path / "absent.pth") is None
    torch.save({"weight": torch.zeros(1)}, tmp_path / "other.pth")
    assert read_pth(tmp_path / "other.pth") is None  # another model's tensors: not this format
    torch.save(build_tokenizer("Wan2.1-VAE", channels=8).state_dict(), tmp_path / "Wan2.1_VAE.pth")
    assert read_pth(tmp_path / "Wan2.1_VAE.pth") is None  # a Wan2.1 VAE's
    assert read_wan21_pth(tmp_path / "Wan2.1_VAE.pth") is not None
    torch.save({"state_dict": {"conv1.weight": torch.zeros(1)}, "step": 3}, tmp_path / "nested.pth")
    with pytest.raises(CheckpointError, match=r"nested\.pth is not a state dict of tensors") as raised:
        read_pth(tmp_path / "nested.pth")
    assert "\n" not in str(raised.value)


def test_the_wan21_reader_leaves_a_wan22_file_alone(tmp_path: Path) -> None:
    torch.save(build_tokenizer("Wan2.2-VAE", **TINY).state_dict(), tmp_path / "Wan2.2_VAE.pth")
    assert read_pth(tmp_path / "Wan2.2_VAE.pth") is not None
    assert read_wan21_pth(tmp_path / "Wan2.2_VAE.pth") is None


def test_a_file_is_built_at_every_size_its_shapes_give(tmp_path: Path) -> None:
    # A decoder wider than the encoder's width gives it (8 scales the decoder to 12 as the release's 160 to 256).
    state = build_tokenizer("Wan2.2-VAE", channels=8, dec_channels=32, z_dim=8).state_dict()
    torch.save(state, tmp_path / "wide_decoder.pth")
    config = load_tokenizer(tmp_path / "wide_decoder.pth").config
    assert (config.channels, config.dec_channels, config.z_dim) == (8, 32, 8)
    # A state dict that no family's reader claims still gets the closest model and what it lacks, by name.
    del state["decoder.conv1.weight"]
    torch.save(state, tmp_path / "broken.pth")
    with pytest.raises(CheckpointError, match=r"Closest is Wan2.2-VAE \(.*\): missing keys: decoder.conv1.weight"):
        load_tokenizer(tmp_path / "broken.pth")


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"num_res_blocks": 1000000}, "num_res_blocks=1000000 is not from 0 to 16"),
        ({"dim_mult": [1] * 9}, "dim_mult has 9 entries, more than 8"),
        ({"name": "Wan2.1-VAE"}, "name='Wan2.1-VAE' is not a model of its family"),
    ],
)
def test_a_checkpoint_s_recorded_config_is_bounded_before_anything_is_built(
    tmp_path: Path, change: dict, refused: str
) -> None:
    from safetensors.torch import save_file

    network = build_tokenizer("Wan2.2-VAE", channels=8)
    save_file(network.state_dict(), str(tmp_path / "model.safetensors"))
    record = {**network.config.to_dict(), **change}
    (tmp_path / "config.json").write_text(json.dumps({"model": "Wan2.2-VAE", "tokenizer_config": record}))
    with pytest.raises(CheckpointError, match=refused):
        load_tokenizer(tmp_path)
