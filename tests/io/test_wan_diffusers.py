"""The Wan2.1 VAE's diffusers format both ways: the official WanVAE_ keys <-> diffusers' AutoencoderKLWan
folders, checked against the official layout, diffusers' own class and the official tiny reference vectors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import load_file, save_file

from tests.conftest import REFERENCE
from tests.io.test_diffusers_format import diffusers_messages
from tokenizer_posttrain.core.errors import CheckpointError, ExportError
from tokenizer_posttrain.io.diffusers_format import DIFFUSERS_WEIGHTS
from tokenizer_posttrain.io.wan_diffusers import (
    WAN21_LATENTS_MEAN,
    WAN21_LATENTS_STD,
    WAN_DIFFUSERS_VERSION,
    diffusers_config,
    diffusers_key,
    diffusers_shapes,
    is_wan_diffusers,
    official_key,
    official_shapes,
    read_wan_diffusers,
    wan_diffusers_latents,
    write_wan_diffusers,
)

WAN = REFERENCE / "wan"
TINY = json.loads((WAN / "tiny_vectors.json").read_text())["Wan2.1"]["config"]
FULL = json.loads((WAN / "wan_layout.json").read_text())["Wan2.1"]
DIM, Z_DIM = TINY["dim"], TINY["z_dim"]
MEAN, STD = [0.1, -0.2, 0.3, -0.4], [0.5, 1.5, 2.5, 3.5]
"""Latent statistics of the tiny VAE (z_dim 4)."""
ENVIRONMENT = ("`accelerate` was not found",)
"""diffusers' only warning about the environment (accelerate is not installed here), not about the files."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_weights() -> dict[str, torch.Tensor]:
    return load_file(str(WAN / "wan21_tiny_weights.safetensors"))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def diffusers_layout(**config: object) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in AutoencoderKLWan(**config).state_dict().items()}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The official tiny weights written as a diffusers folder."""
    write_wan_diffusers(tiny_weights(), DIM, Z_DIM, tmp_path / "vae", MEAN, STD)
    return tmp_path / "vae"


# -- (a) the key maps -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dim", "z_dim", "official"),
    [
        (96, 16, {k: tuple(shape) for k, (shape, _) in FULL["state_dict"].items()}),  # Wan2.1_VAE.pth
        (DIM, Z_DIM, {k: tuple(v.shape) for k, v in tiny_weights().items()}),  # the tiny reference weights
    ],
    ids=["full", "tiny"],
)
def test_the_key_maps_are_a_bijection_between_the_official_layout_and_diffusers_one(
    dim: int, z_dim: int, official: dict[str, tuple[int, ...]]
) -> None:
    assert official_shapes(dim, z_dim) == official  # every key and shape of the official WanVAE_
    theirs = diffusers_layout(base_dim=dim, z_dim=z_dim)  # diffusers' class, on the meta device
    assert diffusers_shapes(dim, z_dim) == theirs
    mapped = {diffusers_key(k): shape for k, shape in official.items()}
    assert mapped == theirs  # one-to-one (as many keys), onto diffusers' keys, shapes kept
    assert all(official_key(diffusers_key(k)) == k for k in official)
    assert all(diffusers_key(official_key(k)) == k for k in theirs)
    if dim == 96:
        assert sum(torch.Size(s).numel() for s in official.values()) == FULL["num_parameters"]


def test_a_key_no_wan21_vae_has_maps_to_nothing_and_is_named() -> None:
    for key in ("encoder.middle.3.residual.0.gamma", "decoder.upsamples.3.residual.0.gamma", "quant_conv.weight"):
        with pytest.raises(ExportError, match=rf"^the weight {key} is not a weight of the Wan2\.1 VAE"):
            diffusers_key(key)
    for key in ("decoder.up_blocks.3.upsamplers.0.resample.1.weight", "conv1.weight", "encoder.avg_shortcut.x"):
        with pytest.raises(CheckpointError, match=rf"^the weight {key} is not a weight of diffusers'"):
            official_key(key)


# -- (b) diffusers loads the folder and computes the official reference vectors -------------------------------


def test_the_official_tiny_weights_written_load_in_diffusers_and_reproduce_the_reference(folder: Path) -> None:
    assert_diffusers_reproduces_the_reference(folder, "wan21_tiny_io.safetensors", MEAN, STD)


def assert_diffusers_reproduces_the_reference(folder: Path, io_file: str, mean: list[float], std: list[float]) -> None:
    """``AutoencoderKLWan.from_pretrained(folder)`` loads every weight, says nothing but INFO, carries ``mean`` and
    ``std`` and computes the official vectors of ``io_file`` (both Wan variants)."""
    assert {p.name for p in folder.iterdir()} == {"config.json", DIFFUSERS_WEIGHTS}
    with diffusers_messages() as messages:
        vae, info = AutoencoderKLWan.from_pretrained(folder, output_loading_info=True)
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    problems = [m for m in messages if not m.startswith("INFO") and not any(e in m for e in ENVIRONMENT)]
    assert not problems, problems
    assert vae.config.latents_mean == mean and vae.config.latents_std == std
    vae.eval()
    io = load_file(str(WAN / io_file))
    with torch.no_grad():
        for tag in ("video", "image"):
            posterior = vae.encode(io[f"{tag}_input"]).latent_dist
            assert rel(posterior.mean, io[f"{tag}_mu"]) <= 1e-5, tag  # the reference's own tolerance
            assert rel(posterior.logvar, io[f"{tag}_log_var"]) <= 1e-5, tag
            # diffusers' decode clamps to [-1, 1] as Wan's wrappers do; the reference is WanVAE_'s, unclamped.
            decoded = vae.decode(io[f"{tag}_mu"]).sample
            assert rel(decoded, io[f"{tag}_reconstruction"].clamp(-1, 1)) <= 1e-5, tag


def test_the_config_builds_the_official_wan21_vae_in_diffusers() -> None:
    config = diffusers_config(96, 16, WAN21_LATENTS_MEAN, WAN21_LATENTS_STD)
    assert config["_class_name"] == "AutoencoderKLWan" and config["_diffusers_version"] == WAN_DIFFUSERS_VERSION
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"), diffusers_messages() as messages:
        built, default = AutoencoderKLWan.from_config(fields).config, AutoencoderKLWan().config
    assert not messages, messages  # every field diffusers has, and none it does not know
    assert {**built} == {**{k: v for k, v in default.items() if k != "_use_default_values"}, **fields}
    assert fields == {k: v for k, v in default.items() if k != "_use_default_values"}  # diffusers' default: Wan2.1


def test_bf16_weights_are_written_in_bf16(tmp_path: Path) -> None:
    write_wan_diffusers(tiny_weights(), DIM, Z_DIM, tmp_path, MEAN, STD, dtype=torch.bfloat16)
    assert {v.dtype for v in load_file(str(tmp_path / DIFFUSERS_WEIGHTS)).values()} == {torch.bfloat16}


# -- (c) reading back -------------------------------------------------------------------------------------------


def test_reading_the_folder_gives_back_exactly_the_official_tensors(folder: Path) -> None:
    assert is_wan_diffusers(folder)
    weights = read_wan_diffusers(folder)
    official = tiny_weights()
    assert weights.state.keys() == official.keys()
    assert all(torch.equal(weights.state[k], v) for k, v in official.items())
    assert weights.source == str(folder / DIFFUSERS_WEIGHTS) and weights.config is None
    assert wan_diffusers_latents(folder) == (MEAN, STD)


def test_a_folder_diffusers_saved_itself_reads_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=DIM, z_dim=Z_DIM, latents_mean=MEAN, latents_std=STD)
    vae.save_pretrained(tmp_path)  # with every field of the installed release, Wan2.2's among them
    weights = read_wan_diffusers(tmp_path)
    assert all(torch.equal(weights.state[official_key(k)], v) for k, v in vae.state_dict().items())
    assert wan_diffusers_latents(tmp_path) == (MEAN, STD)


def test_is_wan_diffusers_tells_other_folders_apart(tmp_path: Path) -> None:
    assert not is_wan_diffusers(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLCosmos"}))
    assert not is_wan_diffusers(tmp_path)
    with pytest.raises(CheckpointError, match="not an AutoencoderKLWan"):
        read_wan_diffusers(tmp_path)


def test_statistics_left_out_are_diffusers_defaults_the_official_constants(tmp_path: Path) -> None:
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=DIM, z_dim=16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["latents_mean"], config["latents_std"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert wan_diffusers_latents(tmp_path) == (list(WAN21_LATENTS_MEAN), list(WAN21_LATENTS_STD))
    assert AutoencoderKLWan.from_pretrained(tmp_path).config.latents_std == list(WAN21_LATENTS_STD)


# -- (d) refusals -----------------------------------------------------------------------------------------------


def damage_weights(folder: Path, change: str) -> None:
    state = load_file(str(folder / DIFFUSERS_WEIGHTS))
    if change == "missing":
        del state["decoder.up_blocks.1.resnets.0.conv_shortcut.weight"]
    elif change == "extra":
        state["decoder.up_blocks.3.upsamplers.0.resample.1.weight"] = torch.zeros(4, 8, 3, 3)
    else:
        state["encoder.mid_block.attentions.0.to_qkv.weight"] = torch.zeros(96, 16, 1, 1)
    save_file(state, str(folder / DIFFUSERS_WEIGHTS))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("missing", "missing keys: decoder.up_blocks.1.resnets.0.conv_shortcut.weight"),
        ("extra", "unexpected keys: decoder.up_blocks.3.upsamplers.0.resample.1.weight"),
        (
            "shape",
            "wrong shapes: encoder.mid_block.attentions.0.to_qkv.weight (96, 16, 1, 1) (expected (96, 32, 1, 1))",
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
    assert "do not fit the Wan2.1 AutoencoderKLWan (base_dim=8, z_dim=4)" in message
    assert named in message


def rewrite_config(folder: Path, **fields: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"patch_size": 2}, r"patch_size=2, but the Wan2\.1 VAE has null \(is_residual is false or left out\)"),
        (
            {"decoder_base_dim": 256},
            r"decoder_base_dim=256, but the Wan2\.1 VAE has its encoder's width",
        ),
        ({"is_residual": True}, r"in_channels=3, but the Wan2\.2 VAE has 12 \(is_residual is true\)"),
        ({"is_residual": 1}, r"is_residual=1, but the Wan2\.1 VAE has false"),  # 1 is not true: no Wan2.2 switch
    ],
    ids=["patch_size", "decoder_base_dim", "is_residual", "is_residual_1"],
)
def test_a_config_of_neither_wan_vae_is_refused_in_one_line_naming_the_field(
    folder: Path, fields: dict, match: str
) -> None:
    rewrite_config(folder, **fields)
    for read in (read_wan_diffusers, wan_diffusers_latents):
        with pytest.raises(CheckpointError, match=match) as e:
            read(folder)
        assert "no Wan VAE that tokenizer-posttrain reads (Wan2.1 or Wan2.2)" in str(e.value)
        assert "\n" not in str(e.value)
    assert is_wan_diffusers(folder)  # diffusers' class it is: the reader says why it cannot take it


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"dim_mult": [1, 2, 4]}, r"dim_mult=\[1, 2, 4\], but the Wan2\.1 VAE has \[1, 2, 4, 4\]"),
        ({"attn_scales": [0.5]}, r"attn_scales=\[0\.5\], but the Wan2\.1 VAE has \[\]"),
        ({"base_dim": 10**9}, r"base_dim=1000000000 is not an integer from 1 to 4096"),
        ({"z_dim": "16"}, r"z_dim='16' is not an integer"),
        ({"latents_std": [1.0, 1.0, 1.0, 0.0]}, r"latents_std=.* holds a value <= 0"),
        ({"latents_mean": [0.0] * 16}, r"latents_mean=.* is not a list of 4 numbers"),
    ],
)
def test_a_config_of_no_wan21_vae_is_refused_naming_the_field(folder: Path, fields: dict, match: str) -> None:
    rewrite_config(folder, **fields)
    with pytest.raises(CheckpointError, match=match):
        read_wan_diffusers(folder) if "latents" not in next(iter(fields)) else wan_diffusers_latents(folder)


def test_a_folder_without_its_weights_file_is_refused(folder: Path) -> None:
    (folder / DIFFUSERS_WEIGHTS).rename(folder / "diffusion_pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"but no diffusion_pytorch_model\.safetensors \(diffusion_pytorch_mod"):
        read_wan_diffusers(folder)


def test_writing_refuses_weights_and_statistics_no_wan21_vae_has(tmp_path: Path) -> None:
    state = tiny_weights()
    del state["decoder.upsamples.4.shortcut.bias"]
    with pytest.raises(ExportError, match=r"with dim=8, z_dim=4 .*missing keys: decoder\.upsamples\.4\.shortcut\.bias"):
        write_wan_diffusers(state, DIM, Z_DIM, tmp_path, MEAN, STD)
    state = tiny_weights()
    state["conv2.bias"][0] = float("nan")
    with pytest.raises(ExportError, match=r"hold NaN or Inf \(first: conv2\.bias\)"):
        write_wan_diffusers(state, DIM, Z_DIM, tmp_path, MEAN, STD)
    with pytest.raises(ExportError, match=r"latents_mean=.* is not a list of 4 numbers"):
        write_wan_diffusers(tiny_weights(), DIM, Z_DIM, tmp_path, WAN21_LATENTS_MEAN, WAN21_LATENTS_STD)
    with pytest.raises(ExportError, match=r"dim=16, z_dim=4 .*wrong shapes: encoder\.conv1\.weight"):
        write_wan_diffusers(tiny_weights(), 16, Z_DIM, tmp_path, MEAN, STD)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_our_trained_network_exported_as_diffusers_reconstructs_like_ours(tmp_path: Path) -> None:
    """The export path end to end: our Wan2.1 network (LoRA merged on the way) through io/formats.py's diffusers
    entry, loaded by diffusers, against our own encode, decode and round trip."""
    from tokenizer_posttrain.io.checkpoint import load_tokenizer
    from tokenizer_posttrain.io.formats import FORMATS
    from tokenizer_posttrain.network import build_tokenizer
    from tokenizer_posttrain.network.lora import apply_lora

    torch.manual_seed(3)
    ours = build_tokenizer("Wan2.1-VAE", channels=8).eval()
    apply_lora(ours, 2, 4.0, allowed=ours.lora_modules)
    with torch.no_grad():  # adapters that change the outputs, as a trained run's would
        for name, param in ours.named_parameters():
            if "lora_up" in name:
                param.normal_(std=0.05)

    class Stats:
        mean, std = torch.zeros(16, 32), torch.ones(16, 32)

    FORMATS["diffusers"].write(ours, tmp_path, Stats(), torch.float32)
    with diffusers_messages() as messages:
        theirs = AutoencoderKLWan.from_pretrained(tmp_path).eval()
    assert not [m for m in messages if "missing" in m or "unexpected" in m], messages
    x = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        encoding = ours.encoding(x)
        posterior = theirs.encode(x).latent_dist
        assert rel(posterior.mean, encoding.mean) < 1e-5 and rel(posterior.logvar, encoding.logvar) < 1e-5
        # diffusers clips its decoded video to [-1, 1]; ours does not (training keeps the gradients there).
        decoded = theirs.decode(encoding.latent).sample
        assert rel(decoded, ours.decode(encoding.latent).clamp(-1, 1)) < 1e-5
        assert rel(theirs(x).sample, ours(x).clamp(-1, 1)) < 1e-5
    # And it reads back here, strictly, as the same network.
    again = load_tokenizer(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(x), ours(x), rtol=1e-5, atol=1e-5)
    assert set(again.state_dict()) == set(build_tokenizer("Wan2.1-VAE", channels=8).state_dict())
