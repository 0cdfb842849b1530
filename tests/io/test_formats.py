"""The table of export formats: its entries, the parsing and checks shared by ``export`` and the workflow, and a
new format added through :func:`register_format` alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import reference_weights
from tokenizer_posttrain.__main__ import main
from tokenizer_posttrain.core.errors import ExportError
from tokenizer_posttrain.io.checkpoint import load_tokenizer
from tokenizer_posttrain.io.diffusers_format import LatentMoments
from tokenizer_posttrain.io.formats import (
    DEFAULT_FORMAT,
    FORMATS,
    ExportFormat,
    check_formats,
    format_choices,
    formats_metavar,
    parse_formats,
    placements,
    register_format,
    unknown_formats,
)
from tokenizer_posttrain.io.model_card import model_card
from tokenizer_posttrain.network.cosmos import REGISTRY, CausalVideoTokenizer


def test_the_table_holds_each_family_s_format_then_diffusers() -> None:
    assert list(FORMATS) == ["cosmos", "wan21", "wan22", "diffusers"] and DEFAULT_FORMAT == "cosmos"
    cosmos, diffusers = FORMATS["cosmos"], FORMATS["diffusers"]
    assert cosmos.files == ("encoder.jit", "decoder.jit", "autoencoder.jit", "model.safetensors", "config.json")
    assert cosmos.stats_beside and not cosmos.needs_stats and not cosmos.subfolder
    assert diffusers.files == ("config.json", "diffusion_pytorch_model.safetensors")
    assert diffusers.subfolder == "vae" and "latents_mean/latents_std" in diffusers.needs_stats
    # With both, the first goes into the export folder and the other into its subfolder.
    assert placements(["diffusers", "cosmos"]) == [(cosmos, ""), (diffusers, "vae")]
    assert placements(["diffusers"]) == [(diffusers, "")]


def test_names_parse_in_table_order_and_an_unknown_one_is_named() -> None:
    assert parse_formats("diffusers, cosmos,diffusers") == ("cosmos", "diffusers")
    assert parse_formats(["diffusers"]) == ("diffusers",)
    assert unknown_formats(["onnx", "cosmos", "gguf", "onnx"]) == ["onnx", "gguf"]
    assert format_choices() == "cosmos, wan21, wan22, diffusers or several"
    assert formats_metavar() == "{cosmos,wan21,wan22,diffusers}[,...]"
    unknown = r"^unknown format 'onnx' in 'cosmos,onnx': use cosmos, wan21, wan22, diffusers or several$"
    with pytest.raises(ValueError, match=unknown):
        parse_formats("cosmos,onnx")


def test_a_network_a_format_cannot_hold_is_refused_by_the_check() -> None:
    check_formats(["cosmos", "diffusers"], REGISTRY["CV8x8x8"])
    check_formats(["cosmos"], REGISTRY["DV8x16x16"])
    with pytest.raises(ExportError, match="no diffusers format for DV8x16x16.*a discrete .FSQ. tokenizer"):
        check_formats(["cosmos", "diffusers"], REGISTRY["DV8x16x16"])


@pytest.mark.parametrize("name", ["cosmos", "diffusers"])
def test_each_format_reads_back_what_it_wrote(name: str, tmp_path: Path) -> None:
    network = load_tokenizer(reference_weights("CV8x8x8"), channels=16).eval()
    fmt = FORMATS[name]
    stats = _Stats(torch.zeros(16, 16), torch.ones(16, 16))
    written = fmt.write(network, tmp_path, stats, torch.float32)
    assert [w.split(" ")[0] for w in written] == list(fmt.files) and fmt.found_in(tmp_path)
    assert not any(other.found_in(tmp_path) for other in FORMATS.values() if other is not fmt)
    back = fmt.read_back(tmp_path)
    expected = network.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in back.state_dict().items())


class _Stats:
    """Latent statistics as the formats take them (``LatentStats`` of the evaluation layer is one)."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.mean, self.std = mean, std


# -- a new format: one entry, and nothing else edited -------------------------------------------------------------


def _write_toy(
    network: CausalVideoTokenizer, folder: Path, stats: LatentMoments | None, dtype: torch.dtype
) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "toy.txt").write_text(f"{network.config.full_name} {str(dtype).removeprefix('torch.')}\n")
    return ["toy.txt"]


@pytest.fixture
def toy() -> Iterator[ExportFormat]:
    """A format that writes one text file, registered for one test."""
    fmt = register_format(
        ExportFormat(
            name="toy",
            what="toy file",
            files=("toy.txt",),
            help="toy.txt in OUT",
            card=lambda subfolder: f"`{subfolder or '.'}/toy.txt` names the model.",
            write=_write_toy,
            found_in=lambda folder: (folder / "toy.txt").is_file(),
            subfolder="toy",
        )
    )
    try:
        yield fmt
    finally:
        del FORMATS[fmt.name]


def test_a_registered_format_is_exported_and_described_with_no_other_edit(
    toy: ExportFormat, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert parse_formats("toy,cosmos") == ("cosmos", "toy")
    assert format_choices() == "cosmos, wan21, wan22, diffusers, toy or several"
    ckpt = str(reference_weights("CV8x8x8"))
    out = tmp_path / "out"
    assert main(["export", "--checkpoint", ckpt, "--out", str(out), "--format", "toy", "--dtype", "bf16"]) == 0
    assert {p.name for p in out.iterdir()} == {"toy.txt", "README.md"}
    assert (out / "toy.txt").read_text() == "Cosmos-1.0-Tokenizer-CV8x8x8 bfloat16\n"
    assert "`./toy.txt` names the model." in (out / "README.md").read_text()
    assert "(toy.txt, README.md)" in capsys.readouterr().out
    # Beside another format, it goes into its subfolder, and the card says so.
    card = model_card(Path("last.ckpt"), {"model": "CV8x8x8"}, None, ema=False, formats=("cosmos", "toy"))
    assert "`model.safetensors` holds the same weights. `toy/toy.txt` names the model." in card


def test_names_that_cannot_be_a_format_value_are_refused(toy: ExportFormat) -> None:
    with pytest.raises(ValueError, match="registered already"):
        register_format(toy)
    for name in ("a,b", "", " toy2"):
        with pytest.raises(ValueError, match="without commas or blanks"):
            register_format(ExportFormat(name, "x", (), "", str, _write_toy, bool))
