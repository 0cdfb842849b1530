"""Our modules reproduce the official checkpoint layouts key for key and shape for shape."""

import json

import pytest
import torch

from tests.conftest import REFERENCE
from tokenizer_posttrain.network import build_tokenizer
from tokenizer_posttrain.network.cosmos import DecoderLayout, EncoderLayout

MANIFEST = json.loads((REFERENCE / "checkpoint_layout.json").read_text())


@pytest.mark.parametrize("name", sorted(MANIFEST))
@pytest.mark.parametrize("layout", ["autoencoder", "encoder", "decoder"])
def test_state_dict_matches_the_official_layout(name: str, layout: str) -> None:
    with torch.device("meta"):  # no 400 MB allocations
        net = build_tokenizer(name)
    module = {"autoencoder": net, "encoder": EncoderLayout(net), "decoder": DecoderLayout(net)}[layout]
    ours = [(k, list(v.shape)) for k, v in module.state_dict().items()]
    official = [(k, shape) for k, (shape, _dtype) in MANIFEST[name]["state_dict"][layout].items()]
    assert ours == official  # same keys, same shapes, same order


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_parameter_count_matches_the_manifest(name: str) -> None:
    with torch.device("meta"):
        net = build_tokenizer(name)
    assert sum(p.numel() for p in net.parameters()) == MANIFEST[name]["num_parameters"]


def test_strict_load_of_the_official_layout_on_meta() -> None:
    with torch.device("meta"):
        net = build_tokenizer("DV8x16x16")
        fake = {
            k: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            for k, (shape, dtype) in MANIFEST["DV8x16x16"]["state_dict"]["decoder"].items()
        }
    DecoderLayout(net).load_state_dict(fake, strict=True, assign=True)
