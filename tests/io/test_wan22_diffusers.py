"""The Wan2.2 VAE's diffusers format both ways: the official Wan2.2 WanVAE_ keys <-> diffusers' AutoencoderKLWan
folders with Wan2.2's config, checked against the official layout, diffusers' own class and the official tiny
reference vectors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import load_file, save_file

from tests.conftest import REFERENCE
from tests.io.test_diffusers_format import diffusers_messages
from tests.io.test_wan_diffusers import (
    assert_diffusers_reproduces_the_reference,
    diffusers_layout,
    rewrite_config,
)
from tokenizer_posttrain.core.errors import CheckpointError, ExportError
from tokenizer_posttrain.io.diffusers_format import DIFFUSERS_WEIGHTS
from tokenizer_posttrain.io.wan_diffusers import (
    WAN22,
    WAN22_DIFFUSERS_VERSION,
    WAN22_LATENTS_MEAN,
    WAN22_LATENTS_STD,
    WanVAE,
    diffusers_config,
    diffusers_key,
    diffusers_shapes,
    official_key,
    official_shapes,
    read_wan_diffusers,
    wan_diffusers_latents,
    wan_diffusers_variant,
    wan_vae,
    write_wan_diffusers,
)

WAN = REFERENCE / "wan"
TINY = json.loads((WAN / "tiny_vectors.json").read_text())["Wan2.2"]["config"]
FULL = json.loads((WAN / "wan_layout.json").read_text())["Wan2.2"]
DIM, DEC_DIM, Z_DIM = TINY["dim"], TINY["dec_dim"], TINY["z_dim"]
MEAN = [0.1 * i - 0.35 for i in range(Z_DIM)]
STD = [0.5 + 0.25 * i for i in range(Z_DIM)]
"""Latent statistics of the tiny VAE (z_dim 8)."""
RELEASED = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
}
"""The config fields of the released Wan2.2 VAE in diffusers (Wan-AI/Wan2.2-TI2V-5B-Diffusers), beside the ones
it shares with Wan2.1's."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_weights() -> dict[str, torch.Tensor]:
    return load_file(str(WAN / "wan22_tiny_weights.safetensors"))


def tiny_config() -> dict[str, object]:
    """diffusers' constructor arguments of the tiny Wan2.2 VAE."""
    fields = diffusers_config(DIM, Z_DIM, MEAN, STD, variant=WAN22, dec_dim=DEC_DIM)
    return {k: v for k, v in fields.items() if not k.startswith("_")}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The official tiny Wan2.2 weights written as a diffusers folder."""
    write_wan_diffusers(tiny_weights(), DIM, Z_DIM, tmp_path / "vae", MEAN, STD, variant=WAN22, dec_dim=DEC_DIM)
    return tmp_path / "vae"


# -- (a) the key maps -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dim", "dec_dim", "z_dim", "official"),
    [
        (160, 256, 48, {k: tuple(shape) for k, (shape, _) in FULL["state_dict"].items()}),  # Wan2.2_VAE.pth
        (DIM, DEC_DIM, Z_DIM, {k: tuple(v.shape) for k, v in tiny_weights().items()}),  # the tiny reference
    ],
    ids=["full", "tiny"],
)
def test_the_key_maps_are_a_bijection_between_the_official_layout_and_diffusers_one(
    dim: int, dec_dim: int, z_dim: int, official: dict[str, tuple[int, ...]]
) -> None:
    assert official_shapes(dim, z_dim, variant=WAN22, dec_dim=dec_dim) == official  # every key and shape
    config = diffusers_config(dim, z_dim, [0.0] * z_dim, [1.0] * z_dim, variant=WAN22, dec_dim=dec_dim)
    theirs = diffusers_layout(**{k: v for k, v in config.items() if not k.startswith("_")})  # on the meta device
    assert diffusers_shapes(dim, z_dim, variant=WAN22, dec_dim=dec_dim) == theirs
    mapped = {diffusers_key(k, WAN22): shape for k, shape in official.items()}
    assert mapped == theirs  # one-to-one (as many keys), onto diffusers' keys, shapes kept
    assert all(official_key(diffusers_key(k, WAN22), WAN22) == k for k in official)
    assert all(diffusers_key(official_key(k, WAN22), WAN22) == k for k in theirs)
    if dim == 160:
        assert sum(torch.Size(s).numel() for s in official.values()) == FULL["num_parameters"]


def test_the_two_variants_name_their_blocks_apart() -> None:
    # Wan2.2 groups blocks per level; a Wan2.1 key (flat numbering) is none of its keys, and the other way round.
    assert diffusers_key("encoder.downsamples.1.downsamples.2.time_conv.weight", WAN22) == (
        "encoder.down_blocks.1.downsampler.time_conv.weight"
    )
    assert diffusers_key("decoder.upsamples.0.upsamples.3.resample.1.bias", WAN22) == (
        "decoder.up_blocks.0.upsampler.resample.1.bias"
    )
    with pytest.raises(ExportError, match=r"^the weight encoder\.downsamples\.2\.resample\.1\.weight is not a weight "):
        diffusers_key("encoder.downsamples.2.resample.1.weight", WAN22)
    with pytest.raises(CheckpointError, match=r"up_blocks\.0\.upsamplers\.0\.resample\.1\.bias .* for Wan2\.2"):
        official_key("decoder.up_blocks.0.upsamplers.0.resample.1.bias", WAN22)
    with pytest.raises(ExportError, match=r"^the weight encoder\.downsamples\.0\.downsamples\.0\.residual\.0\.gamma "):
        diffusers_key("encoder.downsamples.0.downsamples.0.residual.0.gamma")  # Wan2.1's map


# -- (b) diffusers loads the folder and computes the official reference vectors -------------------------------


def test_the_official_tiny_weights_written_load_in_diffusers_and_reproduce_the_reference(folder: Path) -> None:
    assert_diffusers_reproduces_the_reference(folder, "wan22_tiny_io.safetensors", MEAN, STD)


def test_the_config_builds_the_released_wan22_vae_in_diffusers() -> None:
    config = diffusers_config(160, 48, WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, variant=WAN22, dec_dim=256)
    assert config["_class_name"] == "AutoencoderKLWan" and config["_diffusers_version"] == WAN22_DIFFUSERS_VERSION
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    assert {k: fields[k] for k in RELEASED} == RELEASED
    with torch.device("meta"), diffusers_messages() as messages:
        built, default = AutoencoderKLWan.from_config(fields).config, AutoencoderKLWan().config
    assert not messages, messages  # every field diffusers has, and none it does not know
    assert set(fields) == set(default) - {"_use_default_values"}
    assert {k: built[k] for k in fields} == fields


def test_the_wan22_latent_constants_are_48_positive_spreads() -> None:
    assert len(WAN22_LATENTS_MEAN) == len(WAN22_LATENTS_STD) == 48
    assert min(WAN22_LATENTS_STD) > 0
    # Spot checks against Wan2.2's vae2_2.py (first and last of each list).
    assert (WAN22_LATENTS_MEAN[0], WAN22_LATENTS_MEAN[-1]) == (-0.2289, -0.0667)
    assert (WAN22_LATENTS_STD[0], WAN22_LATENTS_STD[-1]) == (0.4765, 0.7744)


# -- (c) reading back -------------------------------------------------------------------------------------------


def test_reading_the_folder_gives_back_exactly_the_official_tensors_and_says_wan22(folder: Path) -> None:
    weights = read_wan_diffusers(folder)
    official = tiny_weights()
    assert weights.state.keys() == official.keys()
    assert all(torch.equal(weights.state[k], v) for k, v in official.items())
    assert weights.vae == WanVAE(WAN22, dim=DIM, z_dim=Z_DIM, dec_dim=DEC_DIM) == wan_diffusers_variant(folder)
    assert weights.source == str(folder / DIFFUSERS_WEIGHTS) and weights.config is None
    assert wan_diffusers_latents(folder) == (MEAN, STD)


@pytest.mark.parametrize("dec_dim", [DEC_DIM, None], ids=["own_decoder_width", "decoder_base_dim_null"])
def test_a_folder_diffusers_saved_itself_reads_back(tmp_path: Path, dec_dim: int | None) -> None:
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**{**tiny_config(), "decoder_base_dim": dec_dim})
    vae.save_pretrained(tmp_path)
    weights = read_wan_diffusers(tmp_path)
    assert weights.vae == WanVAE(WAN22, DIM, Z_DIM, dec_dim or DIM)  # null: diffusers' decoder has base_dim
    assert all(torch.equal(weights.state[official_key(k, WAN22)], v) for k, v in vae.state_dict().items())


# -- (d) refusals -----------------------------------------------------------------------------------------------


def damage_weights(folder: Path, change: str) -> None:
    state = load_file(str(folder / DIFFUSERS_WEIGHTS))
    if change == "missing":
        del state["decoder.up_blocks.2.resnets.0.conv_shortcut.weight"]
    elif change == "extra":
        state["decoder.up_blocks.3.upsampler.resample.1.weight"] = torch.zeros(12, 12, 3, 3)
    else:
        state["encoder.down_blocks.1.downsampler.time_conv.weight"] = torch.zeros(16, 8, 3, 1, 1)
    save_file(state, str(folder / DIFFUSERS_WEIGHTS))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("missing", "missing keys: decoder.up_blocks.2.resnets.0.conv_shortcut.weight"),
        ("extra", "unexpected keys: decoder.up_blocks.3.upsampler.resample.1.weight"),
        (
            "shape",
            "wrong shapes: encoder.down_blocks.1.downsampler.time_conv.weight (16, 8, 3, 1, 1) "
            "(expected (16, 16, 3, 1, 1))",
        ),
    ],
)
def test_damaged_weights_are_refused_naming_the_key_as_diffusers_spells_it(
    folder: Path, change: str, named: str
) -> None:
    damage_weights(folder, change)
    with pytest.raises(CheckpointError) as caught:
        read_wan_diffusers(folder)
    message = str(caught.value)
    assert "\n" not in message and str(folder / DIFFUSERS_WEIGHTS) in message
    assert "do not fit the Wan2.2 AutoencoderKLWan (base_dim=8, decoder_base_dim=12, z_dim=8)" in message
    assert named in message


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"patch_size": None}, r"patch_size=None, but the Wan2\.2 VAE has 2 \(is_residual is true\)"),
        ({"in_channels": 3}, r"in_channels=3, but the Wan2\.2 VAE has 12"),
        ({"scale_factor_spatial": 8}, r"scale_factor_spatial=8, but the Wan2\.2 VAE has 16"),
        ({"out_channels": 12.0}, r"out_channels=12\.0, but the Wan2\.2 VAE has 12"),
        ({"decoder_base_dim": 0}, r"decoder_base_dim=0 is not an integer from 1 to 4096"),
        ({"latents_mean": MEAN[:4]}, r"latents_mean=.* is not a list of 8 numbers"),
    ],
)
def test_a_config_of_no_wan22_vae_is_refused_in_one_line_naming_the_field(
    folder: Path, fields: dict, match: str
) -> None:
    rewrite_config(folder, **fields)
    with pytest.raises(CheckpointError, match=match) as caught:
        read_wan_diffusers(folder) if "latents" not in next(iter(fields)) else wan_diffusers_latents(folder)
    assert "\n" not in str(caught.value)


def test_wan21_weights_are_no_wan22_weights_and_unknown_variants_are_named(tmp_path: Path) -> None:
    wan21 = load_file(str(WAN / "wan21_tiny_weights.safetensors"))
    with pytest.raises(ExportError, match=r"not those of the Wan2\.2 VAE with dim=8, dec_dim=12, z_dim=8 .*missing"):
        write_wan_diffusers(wan21, DIM, Z_DIM, tmp_path, MEAN, STD, variant=WAN22, dec_dim=DEC_DIM)
    with pytest.raises(ExportError, match=r"not those of the Wan2\.1 VAE with dim=8, z_dim=8 .*missing"):
        write_wan_diffusers(tiny_weights(), DIM, Z_DIM, tmp_path, MEAN, STD)  # Wan2.1 by default
    with pytest.raises(ExportError, match=r"^no Wan VAE 'Wan2\.3': the variants are Wan2\.1, Wan2\.2$"):
        write_wan_diffusers(tiny_weights(), DIM, Z_DIM, tmp_path, MEAN, STD, variant="Wan2.3")
    with pytest.raises(ExportError, match=r"^no Wan2\.1 VAE with dec_dim=12 and dim=8: its decoder has its encoder"):
        wan_vae("Wan2.1", DIM, Z_DIM, DEC_DIM)
    with pytest.raises(ExportError, match=r"^no Wan2\.2 AutoencoderKLWan for dec_dim=0: not an integer from 1 to"):
        wan_vae(WAN22, DIM, Z_DIM, 0)
    assert list(tmp_path.iterdir()) == []  # nothing written
