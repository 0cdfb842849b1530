"""Exported .jit files follow the official call contract and run without our package."""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import REFERENCE, reference_weights
from tokenizer_posttrain.core.errors import ExportError
from tokenizer_posttrain.io.checkpoint import load_tokenizer
from tokenizer_posttrain.io.export import export_tokenizer

_CLEAN_PROCESS = """
import sys, torch
for job in sys.argv[1:]:  # INPUT=FOLDER=OUT, or INPUT=FOLDER=OUT=DTYPE to cast the modules first, as consumers do
    inputs, folder, out, *cast = job.split("=")
    x = torch.load(inputs)
    enc = torch.jit.load(folder + "/encoder.jit")
    dec = torch.jit.load(folder + "/decoder.jit")
    auto = torch.jit.load(folder + "/autoencoder.jit")
    if cast:
        dtype = getattr(torch, cast[0])
        enc, dec, auto, x = enc.to(dtype), dec.to(dtype), auto.to(dtype), x.to(dtype)
    with torch.no_grad():
        e = enc(x)
        result = {"auto": auto(x), "enc": e, "dec": dec(e[0])}
    torch.save(result, out)
assert "tokenizer_posttrain" not in sys.modules
"""


def run_clean(*jobs: str, cwd: Path) -> None:
    """Run exported folders in a fresh ``python -I`` (no tokenizer_posttrain importable), one job an argument:
    ``INPUT=FOLDER=OUT[=DTYPE]``."""
    subprocess.run([sys.executable, "-I", "-c", _CLEAN_PROCESS, *jobs], check=True, cwd=cwd)


CASTS = [("float32", "bfloat16"), ("bfloat16", "float32")]
"""(dtype of the export, dtype its modules are cast to before running)."""


@dataclass
class CleanRun:
    """One model exported in fp32 and in bf16 (the session's ``exported_dirs``) and run by one fresh ``python -I``
    process: the fp32 files on ``x`` as they are (``plain``), and each export cast as in :data:`CASTS` on ``small``
    (``casts``)."""

    net: torch.nn.Module
    folder: Path
    x: torch.Tensor
    plain: dict
    small: torch.Tensor
    casts: dict[str, dict]


@pytest.fixture(scope="module")
def clean_runs() -> dict[str, CleanRun]:
    """Each model's :class:`CleanRun`, made once a module by :func:`clean_run`."""
    return {}


@pytest.fixture
def clean_run(
    model_name: str, clean_runs: dict, exported_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> CleanRun:
    """The :class:`CleanRun` of ``model_name``: the exports and the one fresh process that runs them all (an
    export and a fresh process each cost seconds); read only."""
    if model_name not in clean_runs:
        tmp = tmp_path_factory.mktemp(f"clean_{model_name}")
        net = load_tokenizer(reference_weights(model_name), channels=16).eval()
        folders = {"float32": export_tokenizer(net, tmp / "float32"), "bfloat16": exported_dirs[model_name]}
        # a clip of another length and size than the trace example: nothing is baked in
        x = torch.rand(2, 3, 25, 48, 96 if net.is_discrete else 56) * 2 - 1
        small = torch.rand(1, 3, 9, 16, 16) * 2 - 1  # the smallest clip both models take: bf16 on a CPU is slow
        torch.save(x, tmp / "x.pt")
        torch.save(small, tmp / "small.pt")
        jobs = [f"{tmp / 'x.pt'}={folders['float32']}={tmp / 'plain.pt'}"]
        jobs += [f"{tmp / 'small.pt'}={folders[e]}={tmp / e}.pt={c}" for e, c in CASTS]
        run_clean(*jobs, cwd=tmp)
        casts = {e: torch.load(tmp / f"{e}.pt") for e, _ in CASTS}
        clean_runs[model_name] = CleanRun(net, folders["float32"], x, torch.load(tmp / "plain.pt"), small, casts)
    return clean_runs[model_name]


def test_export_runs_in_a_clean_process_with_equal_outputs(clean_run: CleanRun) -> None:
    net, folder, x, got = clean_run.net, clean_run.folder, clean_run.x, clean_run.plain
    assert {p.name for p in folder.iterdir()} == {
        "encoder.jit",
        "decoder.jit",
        "autoencoder.jit",
        "model.safetensors",
        "config.json",
    }
    with torch.no_grad():
        rec = net(x)
        encoded = net.encode(x)
    if net.is_discrete:  # DV: (indices, codes, loss) / decoder takes indices / (rec, loss, indices)
        indices, codes = encoded
        assert torch.equal(got["enc"][0], indices) and got["enc"][0].dtype == torch.int32
        torch.testing.assert_close(got["enc"][1], codes)
        assert got["enc"][2].shape == (2, 1, 1, 1, indices.shape[-1])
        assert torch.equal(got["auto"][2], indices)
    else:  # CV: (latent, (zeros, zeros)) / decoder takes the latent / (rec, posteriors, latent)
        torch.testing.assert_close(got["enc"][0], encoded)
        assert len(got["enc"][1]) == 2
        torch.testing.assert_close(got["auto"][2], encoded)
    torch.testing.assert_close(got["auto"][0], rec)
    torch.testing.assert_close(got["dec"], rec)  # DV: exact codes, so decoding indices is the same


def test_a_cast_export_runs_and_matches_our_network_in_that_dtype(model_name: str, clean_run: CleanRun) -> None:
    # NVIDIA's diffusion loader casts the fp32 .jit files to bf16: no dtype may be frozen into the trace.
    x = clean_run.small
    for exported, cast in CASTS:
        got = clean_run.casts[exported]
        dtype = getattr(torch, cast)
        # Ours in the same dtype, from the weights as the file holds them (a bf16 file has bf16-rounded weights).
        ours = load_tokenizer(reference_weights(model_name), channels=16).eval().to(getattr(torch, exported))
        ours, xc = ours.to(dtype), x.to(dtype)
        with torch.no_grad():
            rec, encoded = ours(xc), ours.encode(xc)
        tolerance = {"atol": 3e-2, "rtol": 3e-2} if cast == "bfloat16" else {}
        assert got["auto"][0].dtype == dtype and got["dec"].dtype == dtype, (exported, cast)
        torch.testing.assert_close(got["auto"][0], rec, **tolerance)
        torch.testing.assert_close(got["dec"], rec, **tolerance)
        if clean_run.net.is_discrete:
            assert torch.equal(got["enc"][0], encoded[0])
        else:
            torch.testing.assert_close(got["enc"][0], encoded, **tolerance)


def test_export_reloads_with_our_loader(exported_dirs: dict[str, Path], model_name: str) -> None:
    folder = exported_dirs[model_name]
    meta = json.loads((folder / "config.json").read_text())
    assert meta["model"] == f"Cosmos-1.0-Tokenizer-{model_name}" and meta["tokenizer_config"]["channels"] == 16
    from_jit = load_tokenizer(folder)
    from_safetensors = load_tokenizer(folder / "model.safetensors")
    for k, v in from_jit.state_dict().items():
        assert torch.equal(v, from_safetensors.state_dict()[k]), k


def test_exported_state_dict_keys_follow_the_official_layouts(exported_dirs: dict[str, Path]) -> None:
    manifest = json.loads((REFERENCE / "checkpoint_layout.json").read_text())
    for name, folder in exported_dirs.items():
        for layout in ("encoder", "decoder", "autoencoder"):
            keys = list(torch.jit.load(str(folder / f"{layout}.jit")).state_dict())
            assert keys == list(manifest[name]["state_dict"][layout]), (name, layout)


def test_bf16_export_runs_in_bf16(exported_dirs: dict[str, Path]) -> None:
    # the reference wrapper runs the official bf16 files as they are, codes included
    auto = torch.jit.load(str(exported_dirs["DV8x16x16"] / "autoencoder.jit"))
    with torch.no_grad():
        rec = auto(torch.zeros(1, 3, 9, 32, 32, dtype=torch.bfloat16))[0]
    assert rec.dtype == torch.bfloat16 and rec.shape == (1, 3, 9, 32, 32)


def test_a_network_with_non_finite_weights_is_not_exported(tmp_path: Path) -> None:
    net = load_tokenizer(reference_weights("CV8x8x8"), channels=16)
    with torch.no_grad():
        next(p for n, p in net.named_parameters() if n.startswith("decoder.")).view(-1)[0] = float("inf")
    with pytest.raises(ExportError, match=r"weight tensors hold NaN or Inf \(first: decoder\."):
        export_tokenizer(net, tmp_path / "export")
    assert not (tmp_path / "export").exists()
