"""Latent statistics: stable moments, and files a Cosmos world model's loader reads as it reads NVIDIA's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import reference_weights
from tests.evaluation.wan_base import tiny_wan
from tests.videos import encode_video, write_energon_dataset
from tokenizer_posttrain.__main__ import main
from tokenizer_posttrain.core.errors import CheckpointError
from tokenizer_posttrain.evaluation.latent_stats import (
    IMAGES_MEAN_STD,
    MEAN_STD,
    VIDEO_MEAN_STD,
    LatentStats,
    Moments,
    base_latent_stats,
    carry_base_stats,
    copy_latent_stats,
    kept_base_stats,
    latent_statistics,
    read_latent_stats,
)
from tokenizer_posttrain.io.checkpoint import load_tokenizer
from tokenizer_posttrain.network.wan21 import WAN21_LATENT_MEAN, WAN21_LATENT_STD


def test_moments_merged_batch_by_batch_equal_those_of_all_values_at_once() -> None:
    values = torch.randn(7, 4, 3, 5, 5, dtype=torch.float64) * 3 + 100  # an offset that breaks naive sums of squares
    moments = Moments()
    for chunk in values.split([1, 4, 2]):
        moments.add(chunk, reduce=(0, 3, 4))
    mean, std = moments.mean_std()
    torch.testing.assert_close(mean, values.mean(dim=(0, 3, 4)).float())
    torch.testing.assert_close(std, values.std(dim=(0, 3, 4), correction=0).float())


def test_positions_past_a_short_clip_carry_the_pooled_statistics_of_the_measured_ones_but_the_first() -> None:
    # Latents of 5-frame-position clips; the world model's loader wants 16 positions.
    values = torch.randn(6, 2, 5, 3, 3, dtype=torch.float64) + torch.arange(5.0, dtype=torch.float64)[:, None, None]
    moments = Moments()
    moments.add(values, reduce=(0, 3, 4))
    mean, std = moments.extended(16)
    assert mean.shape == std.shape == (2, 16)
    torch.testing.assert_close(mean[:, :5], values.mean(dim=(0, 3, 4)).float())
    later = values[:, :, 1:].movedim(1, -1).reshape(-1, 2)  # every value of positions 1..4, per channel
    for t in range(5, 16):
        torch.testing.assert_close(mean[:, t], later.mean(dim=0).float())
        torch.testing.assert_close(std[:, t], later.std(dim=0, correction=0).float())


def test_statistics_files_are_read_weights_only_and_checked(tmp_path: Path) -> None:
    source, out = tmp_path / "source", tmp_path / "out"
    source.mkdir(), out.mkdir()
    assert read_latent_stats(source) is None
    torch.save((torch.zeros(32), torch.ones(32)), source / "mean_std.pt")  # flat, as some folders ship it
    assert [p.name for p in copy_latent_stats(source, out)] == ["mean_std.pt"]
    stats = read_latent_stats(out / "model.safetensors")  # the folder of a file in it
    assert stats is not None and stats.mean.shape == (32, 1) and stats.image_std.shape == (32,)
    torch.save({"mean": torch.zeros(3)}, source / "mean_std.pt")
    with pytest.raises(CheckpointError, match=r"mean_std.pt does not hold a \(mean, std\) pair of tensors"):
        read_latent_stats(source)


def test_clips_are_drawn_from_the_seed_and_passes_repeat_until_enough(tmp_path: Path) -> None:
    from tokenizer_posttrain.evaluation.latent_stats import dataset_latent_stats

    data = write_energon_dataset(tmp_path, {f"v{i}": encode_video(25, 48, 48, seed=i) for i in range(3)})
    net = load_tokenizer(reference_weights("CV8x8x8")).eval()

    def stats(seed: int) -> LatentStats:
        return dataset_latent_stats(net, data, 7, 32, frames=9, seed=seed, progress=False)

    first, again, other = stats(0), stats(0), stats(1)
    assert first.clips == 7  # three videos, three passes
    torch.testing.assert_close(first.mean, again.mean, atol=0, rtol=0)
    assert not torch.allclose(first.mean, other.mean, atol=1e-4)


@pytest.fixture(scope="module")
def long_videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four 121-frame videos: each gives one chunk as the Cosmos world models encode it."""
    videos = {f"v{i}": encode_video(121, 32, 32, seed=i) for i in range(4)}
    return write_energon_dataset(tmp_path_factory.mktemp("long"), videos)


@pytest.fixture(scope="module")
def exported(long_videos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny CV8x8x8 exported with latent statistics of the four chunks; read only."""
    out = tmp_path_factory.mktemp("export") / "export"
    args = ["export", "--checkpoint", str(reference_weights("CV8x8x8")), "--out", str(out)]
    stats = ["--latent-stats", str(long_videos), "--stats-frames", "121", "--stats-size", "32", "--stats-clips", "4"]
    assert main([*args, *stats]) == 0
    return out


def chunks(long_videos: Path) -> torch.Tensor:
    """The four 121-frame chunks ``[4, 3, 121, 32, 32]`` in [-1, 1]."""
    from tokenizer_posttrain.evaluation.clips import open_clips

    _, clips = open_clips(str(long_videos), 121, 32, 32, None, [])
    return torch.stack([clip for _, clip in clips])


def cosmos_loader(folder: Path) -> tuple[torch.jit.ScriptModule, torch.jit.ScriptModule, torch.Tensor, torch.Tensor]:
    """What the Cosmos-1.0 world models' tokenizer loader does with a tokenizer folder: both modules cast to
    bf16, the statistics read weights-only through ``view(16, -1)``, cut to the 16 latent frames of a chunk and
    cast to the modules' dtype."""
    encoder = torch.jit.load(str(folder / "encoder.jit")).to(torch.bfloat16)
    decoder = torch.jit.load(str(folder / "decoder.jit")).to(torch.bfloat16)
    mean, std = torch.load(folder / "mean_std.pt", weights_only=True)
    return encoder, decoder, mean.view(16, -1)[:, :16].bfloat16(), std.view(16, -1)[:, :16].bfloat16()


def test_the_export_normalizes_latents_the_way_the_cosmos_loader_reads_them(long_videos: Path, exported: Path) -> None:
    encoder, decoder, mean, std = cosmos_loader(exported)
    image_mean, image_std = (t.view(16) for t in torch.load(exported / "image_mean_std.pt", weights_only=True))
    x = chunks(long_videos)
    with torch.no_grad():
        latent = encoder(x.bfloat16())[0].float()  # [4, 16, 16, 4, 4]
        normalized = (latent - mean[None, :, :, None, None]) / std[None, :, :, None, None]
        # Over the clips they came from: zero mean, unit deviation at every channel and latent position.
        torch.testing.assert_close(normalized.mean(dim=(0, 3, 4)), torch.zeros(16, 16), atol=0.02, rtol=0)
        torch.testing.assert_close(normalized.std(dim=(0, 3, 4), correction=0), torch.ones(16, 16), atol=0.02, rtol=0)
        # The first latent frame codes one frame alone: its statistics are its own.
        assert not torch.allclose(mean[:, 0], mean[:, 1:].mean(dim=1), atol=1e-3)
        # Denormalized latents decode as the latents themselves do.
        restored = normalized * std[None, :, :, None, None] + mean[None, :, :, None, None]
        torch.testing.assert_close(decoder(restored.bfloat16()), decoder(latent.bfloat16()), atol=0.05, rtol=0.05)
        # The image path: per channel, of single-frame latents.
        ours = load_tokenizer(reference_weights("CV8x8x8")).eval()
        frames = ours.encode(x[:, :, :1])
        torch.testing.assert_close(image_mean, frames.mean(dim=(0, 2, 3, 4)), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(image_std, frames.std(dim=(0, 2, 3, 4), correction=0), atol=1e-4, rtol=1e-4)


def test_a_long_video_through_the_cosmos_loader_matches_our_own_chunked_pipeline(
    long_videos: Path, exported: Path
) -> None:
    from tokenizer_posttrain.evaluation.inference import Options, encode, reconstruct
    from tokenizer_posttrain.evaluation.media import to_frames
    from tokenizer_posttrain.evaluation.metrics import clip_psnr

    encoder, decoder, mean, std = cosmos_loader(exported)
    x = chunks(long_videos)
    video = to_frames(torch.cat([x[0], x[1]], dim=1))  # uint8 [242, 32, 32, 3]: two chunks of 121 frames
    with torch.no_grad():
        # The world model's way: 121-frame chunks, each encoded, normalized, denormalized and decoded in bf16.
        latents, restored, round_trip = [], [], []
        for chunk in video.split(121):
            clip = (chunk.permute(3, 0, 1, 2)[None].float() / 127.5 - 1).bfloat16()
            latent = encoder(clip)[0]
            normalized = (latent - mean[None, :, :, None, None]) / std[None, :, :, None, None]
            latents.append(latent.float())
            restored.append(normalized * std[None, :, :, None, None] + mean[..., None, None])
            round_trip.append(to_frames(decoder(restored[-1])[0]))
        ours = load_tokenizer(reference_weights("CV8x8x8")).to(torch.bfloat16).eval()
        our_latents = encode(ours, video, Options(window=121, context=0, dtype=torch.bfloat16))["latent"].float()
        our_video = reconstruct(ours, video, Options(window=121, context=0, dtype=torch.bfloat16))
        exact = reconstruct(ours.float(), video, Options(window=121, context=0))  # our pipeline in fp32: the reference
    # The latents are ours, and the statistics' round trip gives them back to bf16 precision.
    torch.testing.assert_close(torch.cat(latents), our_latents, atol=0.02, rtol=0.02)
    torch.testing.assert_close(torch.cat(restored).float(), torch.cat(latents), atol=0.01, rtol=0)
    # Pure-bf16 TorchScript and our autocast bf16 run their norms in different precisions: each lands a few
    # levels from the fp32 result, the loader's round trip no farther from it than our own bf16 pipeline.
    loader_psnr = clip_psnr(torch.cat(round_trip)[None].float(), exact[None].float(), data_range=255.0).item()
    ours_psnr = clip_psnr(our_video[None].float(), exact[None].float(), data_range=255.0).item()
    assert loader_psnr > ours_psnr - 1.0 and loader_psnr > 35, (loader_psnr, ours_psnr)


def test_a_discrete_tokenizer_has_no_latent_statistics_and_nothing_is_written(
    long_videos: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "export"
    ckpt = str(reference_weights("DV8x16x16"))
    assert main(["export", "--checkpoint", ckpt, "--out", str(out), "--latent-stats", str(long_videos)]) == 1
    err = capsys.readouterr().err
    assert "discrete tokenizer" in err and "no latent statistics" in err and err.count("\n") == 1
    assert not out.exists()


def test_a_decoder_only_run_and_its_export_carry_the_base_statistics(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from tests.training.conftest import tiny_run
    from tokenizer_posttrain.io.export import export_tokenizer
    from tokenizer_posttrain.training.train import train

    base = export_tokenizer(load_tokenizer(reference_weights("CV8x8x8")), tmp_path / "base")
    torch.save((torch.randn(16, 16), torch.rand(16, 16) + 0.5), base / "mean_std.pt")
    torch.save((torch.randn(16), torch.rand(16) + 0.5), base / "image_mean_std.pt")
    model = {"jit_ckpt_pth": str(base), "trainable": "decoder"}
    run = train(**tiny_run(tmp_path, steps=1, model=model, log={"export_on_end": True}))
    # The encoder did not train: the run's own export and an export of its checkpoint keep the base's files.
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(run / "checkpoints" / "last.ckpt"), "--out", str(out)]) == 0
    assert "mean_std.pt, image_mean_std.pt" in capsys.readouterr().out
    for folder in (run / "export", out):
        for name in ("mean_std.pt", "image_mean_std.pt"):
            assert (folder / name).read_bytes() == (base / name).read_bytes()
    # When the encoder trains too, the latents move, and nothing is carried.
    from tokenizer_posttrain.evaluation.latent_stats import carry_base_stats

    assert carry_base_stats("all", base, tmp_path / "other") == []
    assert carry_base_stats("encoder", base / "autoencoder.jit", tmp_path / "other") == []
    assert not (tmp_path / "other").exists()


def test_empty_statistics_are_refused_in_one_line(tmp_path: Path) -> None:
    # Before: a RuntimeError traceback reshaping them (posttrain's base check is meant to say it in one line).
    from tokenizer_posttrain.evaluation.latent_stats import read_latent_stats

    torch.save((torch.zeros(0), torch.zeros(0)), tmp_path / "mean_std.pt")
    with pytest.raises(CheckpointError, match=r"mean_std\.pt holds empty statistics"):
        read_latent_stats(tmp_path)


# -- the Wan2.1 VAE: per-channel constants, and Cosmos-Predict2.5's files on top of them -----------------------


def _wan_clips(count: int, frames: int = 5, size: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.rand(3, frames, size, size, generator=generator) * 2 - 1 for _ in range(count)]


def test_wan_statistics_are_the_predict25_files_relative_to_the_constants(tmp_path: Path) -> None:
    network = tiny_wan()
    clips = _wan_clips(3)
    stats = latent_statistics(network, clips, max_clips=3)
    # Per channel and latent frame, 32 positions (two measured), of the posterior mean itself.
    assert stats.kind == "per-channel" and stats.mean.shape == (16, 32) and stats.measured_positions == 2
    written = stats.write(tmp_path)
    assert [p.name for p in written] == [VIDEO_MEAN_STD, IMAGES_MEAN_STD] and not (tmp_path / MEAN_STD).exists()
    # Loaded as Cosmos-Predict2.5's Wan2pt1VAEInterface does: a (mean, std) pair, reshaped to [1, 16, 32, 1, 1]
    # (images: [1, 16, 1, 1, 1]) and applied to the latent the hard-coded constants normalised first.
    video_mean, video_std = (t.reshape(1, 16, 32, 1, 1) for t in torch.load(written[0], weights_only=True))
    image_mean, image_std = (t.reshape(1, 16, 1, 1, 1) for t in torch.load(written[1], weights_only=True))
    constant_mean, constant_std = (torch.tensor(c).view(1, 16, 1, 1, 1) for c in (WAN21_LATENT_MEAN, WAN21_LATENT_STD))
    with torch.no_grad():
        latents = torch.cat([network.latent(clip[None]) for clip in clips])
        images = torch.cat([network.latent(clip[None, :, :1]) for clip in clips])
    frames = latents.shape[2]
    normalised = ((latents - constant_mean) / constant_std - video_mean[:, :, :frames]) / video_std[:, :, :frames]
    assert normalised.mean(dim=(0, 3, 4)).abs().max() < 1e-4
    assert (normalised.std(dim=(0, 3, 4), unbiased=False) - 1).abs().max() < 1e-4
    image = ((images - constant_mean) / constant_std - image_mean) / image_std
    assert image.mean(dim=(0, 3, 4)).abs().max() < 1e-4
    # Read back as statistics of the latent itself; without the model's config, the Cosmos files are looked for.
    again = read_latent_stats(tmp_path, network.config)
    assert again is not None and torch.allclose(again.mean, stats.mean, atol=1e-5)
    assert torch.allclose(again.image_std, stats.image_std, atol=1e-6)
    assert read_latent_stats(tmp_path) is None


def test_a_decoder_only_wan_run_keeps_the_constants_and_copies_files_the_base_has(tmp_path: Path) -> None:
    config = tiny_wan().config
    kept = base_latent_stats(config)
    assert kept is not None and kept.mean.shape == (16, 32)
    assert torch.equal(kept.mean[:, 7], torch.tensor(WAN21_LATENT_MEAN)) and kept.clips == 0
    assert "stay exact" in (kept_base_stats("decoder", config) or "") and kept_base_stats("all", config) is None
    # The constants written as files are the identity Predict2.5 uses without files: zeros and ones.
    mean, std = torch.load(kept.write(tmp_path)[0], weights_only=True)
    assert mean.abs().max() < 1e-6 and (std - 1).abs().max() < 1e-6
    out = tmp_path / "out"
    out.mkdir()
    assert [p.name for p in carry_base_stats("decoder", tmp_path / "Wan2.1_VAE.pth", out, config)] == [
        VIDEO_MEAN_STD,
        IMAGES_MEAN_STD,
    ]
    assert carry_base_stats("all", tmp_path, tmp_path / "elsewhere", config) == []
    # A test model of another latent width has no constants: nothing hard-codes them.
    assert base_latent_stats(config.replace(z_dim=4)) is None
