"""The networks reproduce the official implementation's outputs (fp32, CPU)."""

import torch

from tests.conftest import reference_io
from tokenizer_posttrain.network.cosmos import CausalVideoTokenizer


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_outputs_match_the_reference(tiny_network: CausalVideoTokenizer, model_name: str) -> None:
    io = reference_io(model_name)
    with torch.no_grad():
        if model_name.startswith("CV"):
            latent = tiny_network.encode(io["input"])
            assert latent.shape == io["latent"].shape
            assert rel_l2(latent, io["latent"]) <= 1e-5
            assert rel_l2(tiny_network.decode(latent), io["reconstruction"]) <= 1e-5
            assert rel_l2(tiny_network(io["input"]), io["reconstruction"]) <= 1e-5
        else:
            indices, codes = tiny_network.encode(io["input"])
            assert indices.dtype == torch.int32 and indices.shape == io["indices"].shape
            assert (indices == io["indices"]).float().mean().item() >= 0.999
            assert rel_l2(codes, io["codes"]) <= 1e-5
            assert rel_l2(tiny_network.decode(codes), io["reconstruction"]) <= 1e-5
            assert rel_l2(tiny_network.decode_indices(io["indices"]), io["reconstruction"]) <= 1e-5
            assert rel_l2(tiny_network(io["input"]), io["reconstruction"]) <= 1e-5
