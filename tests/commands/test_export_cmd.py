"""The export command: the official file set and a model card from a training checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import reference_weights
from tests.training.conftest import tiny_run
from tests.videos import encode_video, write_energon_dataset
from tokenizer_posttrain.__main__ import main
from tokenizer_posttrain.io.checkpoint import load_tokenizer
from tokenizer_posttrain.training.train import train


def test_export_command_writes_files_and_model_card(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = train(**tiny_run(tmp_path / "r", model={"ema_decay": 0.9}, trainer={"checkpoint_every_n_steps": 1}))
    # a checkpoint from during the run (at the end Lightning copies the EMA into the live weights)
    ckpt = run / "checkpoints" / "step=2.ckpt"
    # An evaluation against the base puts its verdict in the card.
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"metrics": {"psnr": 5.0}, "baseline_metrics": {"psnr": 6.0}, "n_clips": 3}))
    for flag, out in ((["--results", str(results)], "plain"), (["--ema"], "ema")):
        assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / out), *flag]) == 0
        card = (tmp_path / out / "README.md").read_text()
        assert "CV8x8x8" in card and "| steps | 2 |" in card
        # Three clips are too few to judge (tests/evaluation/test_report.py has the verdicts themselves).
        verdict = (
            "**Verdict: inconclusive against the base: PSNR 6.00 -> 5.00 dB (-1.000 dB) on 3 held-out clips: only 3 "
            "clips; a verdict needs at least 8.**"
        )
        assert (verdict in card) == (out == "plain"), card
    plain = torch.jit.load(str(tmp_path / "plain" / "autoencoder.jit")).state_dict()
    ema = torch.jit.load(str(tmp_path / "ema" / "autoencoder.jit")).state_dict()
    assert any(not torch.equal(plain[k], ema[k]) for k in plain)  # the EMA average differs from the last weights
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def chunks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two 121-frame videos: one chunk each, as Cosmos world models (and diffusers' pipelines) encode them."""
    videos = {f"v{i}": encode_video(121, 32, 32, seed=i) for i in range(2)}
    return write_energon_dataset(tmp_path_factory.mktemp("chunks"), videos)


def test_export_writes_the_diffusers_folder_beside_or_instead_of_the_cosmos_files(
    chunks: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from tests.io.test_diffusers_format import load_in_diffusers

    ckpt = str(reference_weights("CV8x8x8"))
    stats = ["--latent-stats", str(chunks), "--stats-size", "32", "--stats-clips", "2"]
    both, alone = tmp_path / "both", tmp_path / "alone"
    assert main(["export", "--checkpoint", ckpt, "--out", str(both), "--format", "cosmos,diffusers", *stats]) == 0
    assert "vae/config.json (AutoencoderKLCosmos" in capsys.readouterr().out
    assert {p.name for p in (both / "vae").iterdir()} == {"config.json", "diffusion_pytorch_model.safetensors"}
    assert (both / "autoencoder.jit").is_file() and "`vae/` holds them" in (both / "README.md").read_text()
    # The pipelines' statistics are those of mean_std.pt, flattened channel by channel.
    mean, std = torch.load(both / "mean_std.pt", weights_only=True)
    config = json.loads((both / "vae" / "config.json").read_text())
    assert config["latents_mean"] == mean.flatten().tolist() and config["latents_std"] == std.flatten().tolist()
    assert mean.shape == (16, 16)  # 121 frames: the whole chunk a pipeline normalizes
    vae = load_in_diffusers(both / "vae")
    x = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(vae(x).sample, load_tokenizer(ckpt).eval()(x), rtol=1e-4, atol=1e-4)

    assert main(["export", "--checkpoint", ckpt, "--out", str(alone), "--format", "diffusers", *stats]) == 0
    assert {p.name for p in alone.iterdir()} == {"config.json", "diffusion_pytorch_model.safetensors", "README.md"}
    assert json.loads((alone / "config.json").read_text()) == config
    card = (alone / "README.md").read_text()
    assert "Exported by tokenizer-posttrain as a diffusers folder (`AutoencoderKLCosmos` for" in card


@pytest.mark.parametrize(
    ("model", "flags", "refused"),
    [
        ("DV8x16x16", ["--latent-stats", "DATA"], "for DV8x16x16 (channels=16): a discrete (FSQ) tokenizer"),
        ("CV8x8x8", [], "--format diffusers needs --latent-stats DATA"),
    ],
)
def test_export_refuses_a_diffusers_folder_it_cannot_write_in_one_line_before_writing(
    model: str, flags: list[str], refused: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    args = ["export", "--checkpoint", str(reference_weights(model)), "--out", str(out), "--format", "diffusers"]
    assert main([*args, *flags]) == 1
    err = capsys.readouterr().err
    assert refused in err and err.count("\n") == 1, err
    assert not out.exists()


def test_an_unknown_format_is_a_command_line_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        main(["export", "--checkpoint", "x", "--out", "y", "--format", "cosmos,onnx"])
    assert done.value.code == 2 and "unknown format 'onnx'" in capsys.readouterr().err


def test_a_folder_of_the_other_format_is_not_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = str(reference_weights("CV8x8x8"))
    cosmos, diffusers = tmp_path / "cosmos", tmp_path / "diffusers"
    cosmos.mkdir()
    (cosmos / "autoencoder.jit").write_bytes(b"")
    diffusers.mkdir()
    (diffusers / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLCosmos"}))
    for out, flags, refused in (
        (
            cosmos,
            ["--format", "diffusers", "--latent-stats", "DATA"],
            f"{cosmos} holds a Cosmos export, whose config.json --format diffusers would replace: use --format "
            f"cosmos,diffusers (the diffusers folder goes to {cosmos / 'vae'}) or another --out",
        ),
        (diffusers, [], f"{diffusers} holds a diffusers folder, whose config.json --format cosmos would replace"),
    ):
        assert main(["export", "--checkpoint", ckpt, "--out", str(out), *flags]) == 1
        err = capsys.readouterr().err
        assert refused in err and err.count("\n") == 1, err
        assert len(list(out.iterdir())) == 1  # nothing written


def test_export_of_a_wan_vae_writes_the_predict25_files_and_the_shift_from_the_constants(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from tests.evaluation.wan_base import tiny_wan_pth
    from tokenizer_posttrain.evaluation.latent_stats import read_latent_stats

    base = tiny_wan_pth(tmp_path / "base")
    data = write_energon_dataset(tmp_path / "data", {f"v{i}": encode_video(5, 16, 16, seed=i) for i in range(2)})
    out = tmp_path / "out"
    stats = ["--latent-stats", str(data), "--stats-clips", "2", "--stats-frames", "5", "--stats-size", "16"]
    # Without statistics a diffusers folder of an encoder that may have trained is refused, before any work.
    assert main(["export", "--checkpoint", str(base), "--out", str(out), "--format", "wan21,diffusers"]) == 1
    assert "--format diffusers needs --latent-stats DATA" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(base), "--out", str(out), "--format", "wan21,diffusers", *stats]) == 0
    printed = capsys.readouterr().out
    assert "latent statistics against the base's per-channel constants: largest mean offset" in printed
    assert {"Wan2.1_VAE.pth", "video_mean_std.pt", "images_mean_std.pt", "README.md"} <= {p.name for p in out.iterdir()}
    assert not (out / "mean_std.pt").exists() and not (out / "vae" / "video_mean_std.pt").exists()
    measured = read_latent_stats(out, load_tokenizer(base).config)
    assert measured is not None and measured.mean.shape == (16, 32)
    # diffusers' latents_mean/latents_std: the measured statistics pooled per channel.
    config = json.loads((out / "vae" / "config.json").read_text())
    assert config["latents_mean"][3] == pytest.approx(measured.mean[3].mean().item(), abs=1e-5)
    card = (out / "README.md").read_text()
    assert "## Latent statistics against the base" in card and "per-channel constants" in card
    assert "| latent statistics | measured on 2 clips of" in card and "`load_mean_std=True`" in card


def test_export_of_a_wan22_vae_writes_its_file_48_channel_statistics_and_a_folder_diffusers_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from diffusers import AutoencoderKLWan

    from tests.evaluation.wan_base import WAN22, tiny_wan_pth
    from tokenizer_posttrain.evaluation.latent_shift import shift_from_base, shift_line
    from tokenizer_posttrain.evaluation.latent_stats import base_latent_stats, read_latent_stats
    from tokenizer_posttrain.network.wan22 import WAN22_LATENT_MEAN

    base = tiny_wan_pth(tmp_path / "base", model=WAN22)
    data = write_energon_dataset(tmp_path / "data", {f"v{i}": encode_video(5, 16, 16, seed=i) for i in range(2)})
    out = tmp_path / "out"
    stats = ["--latent-stats", str(data), "--stats-clips", "2", "--stats-frames", "5", "--stats-size", "16"]
    assert main(["export", "--checkpoint", str(base), "--out", str(out), "--format", "wan22,diffusers", *stats]) == 0
    printed = capsys.readouterr().out
    assert {"Wan2.2_VAE.pth", "video_mean_std.pt", "images_mean_std.pt", "README.md"} <= {p.name for p in out.iterdir()}
    config = load_tokenizer(base).config
    measured = read_latent_stats(out, config)
    assert measured is not None and measured.mean.shape == (48, 32)
    # The shift printed is the one from Wan2.2's 48 constants (no statistics files beside the base).
    constants = base_latent_stats(config)
    assert constants is not None and constants.mean[:, 0].tolist() == pytest.approx(WAN22_LATENT_MEAN)
    shift = shift_from_base(measured, config, base=None)
    assert shift is not None and len(shift["channels"]) == 48 and shift_line(shift) in printed
    # The diffusers folder: Wan2.2's AutoencoderKLWan with the measured statistics pooled per channel...
    vae = AutoencoderKLWan.from_pretrained(out / "vae").eval()
    assert vae.config.z_dim == 48 and vae.config.is_residual and vae.config.decoder_base_dim == 12
    assert vae.config.latents_mean[47] == pytest.approx(measured.mean[47].mean().item(), abs=1e-5)
    # ...computing our round trip of the posterior mean, clipped to [-1, 1] as diffusers' decoder output is.
    ours = load_tokenizer(out / "Wan2.2_VAE.pth").eval()
    video = torch.rand(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        theirs, want = vae(video).sample, ours(video).clamp(-1, 1)
    assert (want.abs() < 1).float().mean() > 0.9  # mostly inside the clip: a comparison of values, not of +-1
    torch.testing.assert_close(theirs, want, rtol=0, atol=1e-4)
