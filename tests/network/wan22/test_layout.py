"""The network has the official Wan2.2 VAE state dict key for key, shape for shape and in order, so the released
``Wan2.2_VAE.pth`` loads strictly."""

from __future__ import annotations

import json

import torch

from tests.conftest import REFERENCE
from tokenizer_posttrain.network import build_tokenizer, get_config

OFFICIAL = json.loads((REFERENCE / "wan" / "wan_layout.json").read_text())["Wan2.2"]


def test_the_registered_config_is_the_official_one() -> None:
    official, cfg = OFFICIAL["config"], get_config("Wan2.2-VAE")
    assert (cfg.channels, cfg.dec_channels, cfg.z_dim) == (official["dim"], official["dec_dim"], official["z_dim"])
    assert (list(cfg.dim_mult), cfg.num_res_blocks) == (official["dim_mult"], official["num_res_blocks"])
    assert (list(cfg.temporal_downsample), cfg.dropout) == (official["temperal_downsample"], official["dropout"])
    assert official["attn_scales"] == []  # the official levels have no attention; the config has no such field
    assert (cfg.temporal_compression, cfg.spatial_compression, cfg.latent_dim) == (4, 16, 48)


def test_state_dict_matches_the_official_layout() -> None:
    with torch.device("meta"):  # no 2.8 GB allocation
        net = build_tokenizer("Wan2.2-VAE")
    ours = [(k, list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in net.state_dict().items()]
    official = [(k, shape, dtype) for k, (shape, dtype) in OFFICIAL["state_dict"].items()]
    assert ours == official
    assert sum(p.numel() for p in net.parameters()) == OFFICIAL["num_parameters"] == 704_688_668


def test_the_official_layout_loads_strictly_on_meta() -> None:
    with torch.device("meta"):
        net = build_tokenizer("Wan2.2-VAE")
        state = {k: torch.empty(shape, device="meta") for k, (shape, _dtype) in OFFICIAL["state_dict"].items()}
    net.load_state_dict(state, strict=True, assign=True)
