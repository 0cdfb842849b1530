"""evaluate: metrics over held-out clips, results.json, report, side-by-side videos and the CLI.

Real shards of real h264 files (64x96), the tiny reference CV8x8x8 and DV8x16x16 models, a perturbed copy of each
as a "post-trained" model, and the real torchmetrics and VGG16 code paths.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import pytest
import torch
from safetensors.torch import save_file
from torchmetrics.functional.image import peak_signal_noise_ratio

from tests.conftest import reference_weights
from tests.losses.test_perceptual import random_vgg16_state
from tests.videos import encode_video, write_energon_dataset
from tokenizer_posttrain.core.errors import EvaluationError
from tokenizer_posttrain.data.energon import EnergonVideoDataModule
from tokenizer_posttrain.data.task_encoder import ClipSpec
from tokenizer_posttrain.evaluation.evaluate import evaluate
from tokenizer_posttrain.evaluation.media import LABEL_HEIGHT, PANEL_MIN_WIDTH
from tokenizer_posttrain.io.checkpoint import load_tokenizer
from tokenizer_posttrain.losses.perceptual import VGG16_FILE

CV, DV = str(reference_weights("CV8x8x8")), str(reference_weights("DV8x16x16"))
FRAMES, SIZE = 9, 64
VAL_KEYS = ["val0", "val1", "val2"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def empty_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """No VGG16 file anywhere, whatever this machine's torch hub cache holds: LPIPS is null unless a test adds one."""
    home = tmp_path_factory.mktemp("torch_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_HOME", str(home))
        patch.setattr(torch.hub, "_hub_dir", None)  # the default: get_dir() follows TORCH_HOME
        yield home


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three usable val clips and one too short for a clip (skipped and named), two train clips."""
    val = {key: encode_video(12, 64, 96, seed=i) for i, key in enumerate(VAL_KEYS)}
    val["short"] = encode_video(5, 64, 96, seed=9)
    train = {f"train{i}": encode_video(12, 64, 96, seed=10 + i) for i in range(2)}
    return write_energon_dataset(tmp_path_factory.mktemp("shards"), train, val)


def perturbed(src: str, out: Path) -> str:
    """A copy of a checkpoint with 5% noise on every parameter (buffers such as the FSQ codebook kept)."""
    net = load_tokenizer(src)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in net.parameters():
            param += 0.05 * param.std().nan_to_num() * torch.randn(param.shape, generator=generator)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(out))
    return str(out)


@pytest.fixture(scope="module")
def runs(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Path]]:
    """results and output folder of: each model against itself, and a perturbed copy against the original."""
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for name, ckpt in (("cv", CV), ("dv", DV)):
        for kind, model in (("same", ckpt), ("perturbed", perturbed(ckpt, tmp / f"{name}.safetensors"))):
            folder = tmp / f"{name}_{kind}"
            # One clip per video: the clips of these tests are the videos (several per video: their own test).
            results = evaluate(
                model, str(dataset), str(folder), baseline=ckpt, frames=FRAMES, size=SIZE, clips_per_video=1
            )
            out[f"{name}_{kind}"] = results, folder
    return out


def read_results(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "results.json").read_text())


def video_rate(path: Path) -> float:
    """Frames per second of an mp4, as its stream says."""
    with av.open(str(path)) as container:
        return float(container.streams.video[0].average_rate)


def video_shape(path: Path) -> tuple[int, int, int]:
    """(frames, height, width) of an mp4, read back with PyAV."""
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return len(frames), frames[0].shape[0], frames[0].shape[1]


# -- metric helpers ---------------------------------------------------------------------------------------------


# -- results.json ----------------------------------------------------------------------------------------------


def test_results_against_the_same_model(runs: dict, dataset: Path) -> None:
    results, folder = runs["cv_same"]
    assert read_results(folder) == json.loads(json.dumps(results))  # the file is what evaluate returned
    assert results["n_clips"] == 3 and results["per_clip"]["keys"] == VAL_KEYS
    assert results["n_videos"] == 3 and results["per_clip"]["videos"] == VAL_KEYS and results["drift_limit"] == 0.05
    assert results["data"] == {"path": str(dataset), "source": "energon val split"}
    assert results["clip"] == {"frames": FRAMES, "height": SIZE, "width": SIZE, "resize_short_side": None}
    assert results["model"]["name"] == results["baseline"]["name"] == "CV8x8x8"
    assert len(results["skipped"]) == 1 and "short" in results["skipped"][0]
    model, base = results["metrics"], results["baseline_metrics"]
    assert math.isfinite(model["psnr"]) and model["psnr"] == base["psnr"]
    assert results["per_clip"]["model"] == results["per_clip"]["baseline"]
    assert -1 <= model["ssim"] <= 1 and model["flicker"] >= 0
    noised = {"0.05": 0.0, "0.1": 0.0, "0.2": 0.0}
    assert results["deltas"] == {"psnr": 0.0, "ssim": 0.0, "flicker": 0.0, "psnr_noised": noised}
    assert results["comparison"] == {"latent_drift": 0.0} and results["per_clip"]["latent_drift"] == [0.0] * 3
    assert sum(results["error_histogram"]["model"]) == 3 * 3 * FRAMES * SIZE * SIZE
    assert sum(results["per_clip"]["model"]["psnr"]) / 3 == pytest.approx(model["psnr"])


def test_perturbed_model_drifts(runs: dict) -> None:
    results, _ = runs["cv_perturbed"]
    assert results["comparison"]["latent_drift"] > 0
    assert all(d > 0 for d in results["per_clip"]["latent_drift"])
    assert results["metrics"]["psnr"] != results["baseline_metrics"]["psnr"]
    assert results["deltas"]["psnr"] == pytest.approx(results["metrics"]["psnr"] - results["baseline_metrics"]["psnr"])


def test_psnr_from_noised_latents_of_both_tokenizers_and_the_same_on_a_rerun(runs: dict) -> None:
    results, folder = runs["cv_perturbed"]
    model, base = results["metrics"]["psnr_noised"], results["baseline_metrics"]["psnr_noised"]
    assert list(model) == list(base) == ["0.05", "0.1", "0.2"] and all(math.isfinite(v) for v in model.values())
    assert results["deltas"]["psnr_noised"] == pytest.approx({k: model[k] - base[k] for k in model})
    assert "latent + level x σ x Gaussian noise" in results["notes"]["psnr_noised"]
    # The base is the baseline of both runs: another evaluation, the same noise from the same seeds, the same dB.
    assert runs["cv_same"][0]["baseline_metrics"]["psnr_noised"] == base
    report = (folder / "report.md").read_text()
    assert f"| PSNR from latent + 0.1 σ noise (dB) ↑ | {base['0.1']:.2f} | {model['0.1']:.2f} |" in report


def test_discrete_model_codebook_and_token_flips(runs: dict) -> None:
    same, _ = runs["dv_same"]
    for metrics in (same["metrics"], same["baseline_metrics"]):
        assert 0 < metrics["codebook_usage"] <= 1 and metrics["perplexity"] >= 1
    assert same["comparison"] == {"token_flip_rate": 0.0} and "latent_drift" not in same["per_clip"]
    # World models hand a DV decoder token indices, never latents a little off: no noised PSNR, and the note says so.
    assert "psnr_noised" not in same["metrics"] and "psnr_noised" not in same["baseline_metrics"]
    assert "not measured: DV8x16x16 is discrete" in same["notes"]["psnr_noised"]
    flipped, _ = runs["dv_perturbed"]
    assert 0 < flipped["comparison"]["token_flip_rate"] <= 1


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")
def test_psnr_matches_torchmetrics_on_uint8_frames(runs: dict, dataset: Path) -> None:
    results, _ = runs["cv_perturbed"]
    spec = ClipSpec(FRAMES, SIZE, SIZE, random_crop=False)
    batch = next(iter(EnergonVideoDataModule(str(dataset), spec, 1, 0).val_dataloader()))
    net = load_tokenizer(results["model"]["checkpoint"]).eval()
    with torch.no_grad():
        recon = net(batch["video"].float())

    def uint8(video: torch.Tensor) -> torch.Tensor:
        return ((video.float().clamp(-1, 1) + 1) * 127.5).round()

    expected = peak_signal_noise_ratio(uint8(recon), uint8(batch["video"]), data_range=255.0).item()
    index = results["per_clip"]["keys"].index(batch["keys"][0])
    assert results["per_clip"]["model"]["psnr"][index] == pytest.approx(expected, abs=1e-4)


# -- report and videos -----------------------------------------------------------------------------------------


def test_report_links_plots_and_three_panel_videos(runs: dict) -> None:
    results, folder = runs["cv_perturbed"]
    report = (folder / "report.md").read_text()
    assert "| metric | baseline | post-trained | change |" in report and "latent drift" in report
    base, model = results["baseline_metrics"]["psnr"], results["metrics"]["psnr"]
    assert f"PSNR {base:.2f} -> {model:.2f} dB" in report and "- verdict: **" in report
    same = (runs["cv_same"][1] / "report.md").read_text()
    # Three clips are too few for a verdict, and an unchanged model is no better.
    assert "- verdict: **inconclusive against the base: PSNR" in same and "only 3 clips; a verdict needs" in same
    drift = results["comparison"]["latent_drift"]
    assert ("- **drift: latent drift" in report) == (drift > 0.05) and "- **drift:" not in same
    links = re.findall(r"\]\(([^)]+)\)", report)
    assert {"psnr_per_clip.png", "error_histogram.png"} <= set(links)
    assert all((folder / link).is_file() for link in links)
    assert (folder / "psnr_per_clip.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    videos = results["videos"]
    assert [(v["kind"], v["rank"]) for v in videos] == [("best", 1), ("best", 2), ("worst", 1)]  # 3 clips: no repeats
    psnr = dict(zip(results["per_clip"]["keys"], results["per_clip"]["model"]["psnr"], strict=True))
    assert videos[0]["psnr"] == max(psnr.values()) and videos[-1]["psnr"] == min(psnr.values())
    scale = -(-PANEL_MIN_WIDTH // SIZE)
    for video in videos:
        assert video["path"] in links and video["panels"] == ["input", "baseline", "post-trained"]
        # Named panels above the clip, scaled up to be seen, at the source's 10 fps (before: always 8).
        assert video_shape(folder / video["path"]) == (FRAMES, LABEL_HEIGHT + scale * SIZE, 3 * scale * SIZE)
        assert video["fps"] == 10.0 and video_rate(folder / video["path"]) == 10.0
    assert "input | baseline | post-trained" in report and "10 fps" in report


def test_lpips_is_null_with_a_reason_without_vgg_weights(runs: dict) -> None:
    results, folder = runs["cv_same"]
    assert results["metrics"]["lpips"] is None and results["per_clip"]["model"]["lpips"] is None
    assert VGG16_FILE in results["notes"]["lpips"] and "not computed" in results["notes"]["lpips"]
    assert read_results(folder)["metrics"]["lpips"] is None


def test_lpips_with_vgg_weights_in_the_hub_cache(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    (tmp_path / "torch" / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(random_vgg16_state(), tmp_path / "torch" / "hub" / "checkpoints" / VGG16_FILE)
    results = evaluate(CV, str(dataset), str(tmp_path / "out"), frames=FRAMES, size=SIZE, max_clips=1)
    lpips = results["metrics"]["lpips"]
    assert isinstance(lpips, float) and math.isfinite(lpips) and lpips > 0
    assert results["per_clip"]["model"]["lpips"] == [lpips] and "VGG16" in results["notes"]["lpips"]


def test_train_split_when_there_is_no_val_split(tmp_path: Path) -> None:
    data = write_energon_dataset(tmp_path / "data", {f"t{i}": encode_video(12, 64, 96, seed=i) for i in range(2)})
    results = evaluate(DV, str(data), str(tmp_path / "out"), frames=FRAMES, size=SIZE, max_clips=1)
    assert results["data"]["source"].startswith("energon train split") and results["per_clip"]["keys"] == ["t0"]


# -- command line ----------------------------------------------------------------------------------------------


def test_several_clips_per_held_out_video_and_a_verdict_on_them(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: one clip per video, whatever --max-clips asked for.
    model = perturbed(CV, tmp_path / "cv.safetensors")
    monkeypatch.setenv("TOKENIZER_POSTTRAIN_PROGRESS_INTERVAL", "0")
    options = {"frames": FRAMES, "size": SIZE, "noise_levels": []}  # no noised decodes: not this test's point
    results = evaluate(model, str(dataset), str(tmp_path / "out"), baseline=CV, max_clips=8, **options)
    # Progress in a log (stdout is captured, no terminal): a plain line per clip at interval 0, no bar.
    out = capsys.readouterr().out
    assert "[evaluate] 0/8 clips | elapsed 0:00" in out and "[evaluate] 8/8 clips" in out and "\r" not in out
    keys = results["per_clip"]["keys"]
    assert results["n_clips"] == 8 and results["n_videos"] == 3 and keys[:3] == VAL_KEYS
    # Each further pass visits every video once, in its own shuffled order.
    assert sorted(keys[3:6]) == [f"{key}#2" for key in VAL_KEYS] and {k[-2:] for k in keys[6:]} == {"#3"}
    assert results["per_clip"]["videos"] == [key.split("#")[0] for key in keys]
    assert len(results["skipped"]) == 1  # the short video, named once
    report = (tmp_path / "out" / "report.md").read_text()
    assert "8 clips of 3 videos" in report and "- verdict: **" in report and "on 8 held-out clips of 3 videos" in report
    # Limited per video: 3 videos x 2 clips.
    two = evaluate(CV, str(dataset), str(tmp_path / "two"), clips_per_video=2, **options)
    assert two["n_clips"] == 6 and "psnr_noised" not in two["metrics"] and "psnr_noised" not in two["notes"]


@pytest.mark.parametrize(("wan", "channels"), [("Wan2.1-VAE", 16), ("Wan2.2-VAE", 48)], ids=["wan21", "wan22"])
def test_a_wan_vae_against_its_base_drift_on_the_posterior_mean_and_shift_from_the_constants(
    dataset: Path, tmp_path: Path, wan: str, channels: int
) -> None:
    from tests.evaluation.wan_base import tiny_wan, tiny_wan_pth
    from tokenizer_posttrain.evaluation.latent_stats import latent_statistics

    base = tiny_wan_pth(tmp_path / "base", model=wan)
    # The "post-trained" model: another draw of weights, in a folder with its Predict2.5 statistics files.
    model = tiny_wan_pth(tmp_path / "model", seed=1, model=wan)
    latent_statistics(tiny_wan(seed=1, model=wan), [torch.rand(3, 5, 16, 16) * 2 - 1], max_clips=1).write(
        tmp_path / "model"
    )
    options = {"frames": 5, "size": 16, "max_clips": 2, "videos_per_side": 1}
    results = evaluate(str(model), str(dataset), str(tmp_path / "eval"), baseline=str(base), **options)
    assert results["model"]["kind"] == "continuous" and results["model"]["name"] == wan
    for key in ("psnr", "ssim", "flicker"):
        assert math.isfinite(results["metrics"][key]) and math.isfinite(results["baseline_metrics"][key])
    assert results["comparison"]["latent_drift"] > 0
    levels = {"0.05", "0.1", "0.2"}
    assert set(results["metrics"]["psnr_noised"]) == set(results["baseline_metrics"]["psnr_noised"]) == levels
    assert "its family's hard-coded per-channel std" in results["notes"]["psnr_noised"]
    # Measured against the per-channel constants every Wan consumer hard-codes (16 for Wan2.1, 48 for Wan2.2): in
    # the results, the report and the card.
    shift = results["latent_stats_shift"]
    assert shift["reference"] == "constants" and len(shift["channels"]) == channels and shift["positions"] == 32
    assert "per-channel constants" in (tmp_path / "eval" / "report.md").read_text()
    # The same model as its own baseline: no drift.
    same = evaluate(str(base), str(dataset), str(tmp_path / "same"), baseline=str(base), **options)
    assert same["comparison"]["latent_drift"] == 0 and "latent_stats_shift" not in same
    # The same noise for both: the same model gives the same noised PSNR on both sides.
    assert same["metrics"]["psnr_noised"] == same["baseline_metrics"]["psnr_noised"]


def test_the_psnr_from_noised_latents_falls_with_the_noise_level(tmp_path: Path) -> None:
    # The tiny models' random decoders barely depend on their latent, and reconstruct real clips so poorly (5-9 dB)
    # that noise moves their PSNR either way by 0.001 dB. A clip the tiny Wan VAE reconstructs at ~21 dB (its own
    # reconstruction of a synthetic clip): there noise costs dB, more at each level.
    from tests.evaluation.wan_base import tiny_wan_pth
    from tests.videos import frames_array
    from tokenizer_posttrain.evaluation.media import to_frames

    base = tiny_wan_pth(tmp_path / "base")
    net = load_tokenizer(base).eval()
    clip = torch.from_numpy(frames_array(9, 32, 32, seed=1)).permute(3, 0, 1, 2).float().div(127.5).sub(1)
    with torch.no_grad():
        frames = to_frames(net.decode(net.encoding(clip[None]).latent).clamp(-1, 1)[0]).numpy()
    data = write_energon_dataset(tmp_path / "data", {"t": encode_video(9, 32, 32, images=frames)})
    options = {"frames": 9, "size": 32, "max_clips": 1, "videos_per_side": 0, "noise_levels": [0.05, 0.1, 0.2]}
    results = evaluate(str(base), str(data), str(tmp_path / "eval"), **options)
    clean, noised = results["metrics"]["psnr"], results["metrics"]["psnr_noised"]
    assert clean > 18 and clean - 0.5 > noised["0.05"] > noised["0.1"] > noised["0.2"], (clean, noised)
    assert results["baseline_metrics"] is None and "psnr_noised" not in results["deltas"]
    with pytest.raises(EvaluationError, match="noise levels must be positive and finite, got 0.1 0"):
        evaluate(str(base), str(data), str(tmp_path / "bad"), **{**options, "noise_levels": [0.1, 0]})
