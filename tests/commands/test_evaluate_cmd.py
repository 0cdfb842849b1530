"""The evaluate command: the report without a baseline, every bad input as one line with exit code 1, and the exit
codes of a finished evaluation against a baseline (3 worse, 4 drifted)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from tests.evaluation.test_evaluate import (  # noqa: F401 - dataset and empty_hub are fixtures
    CV,
    DV,
    FRAMES,
    SIZE,
    dataset,
    empty_hub,
    perturbed,
    read_results,
    video_shape,
)
from tokenizer_posttrain.commands.evaluate_cmd import register
from tokenizer_posttrain.evaluation.media import LABEL_HEIGHT, PANEL_MIN_WIDTH


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tokenizer_posttrain")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["evaluate", *argv])
    return args.func(args)


def test_cli_writes_the_report_without_baseline(
    dataset: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "eval"
    code = cli(
        "--checkpoint",
        CV,
        "--data",
        str(dataset),
        "--out",
        str(out),
        "--frames",
        "9",
        "--size",
        "64",
        "--max-clips",
        "2",
        "--clips-per-video",
        "1",
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "PSNR (dB)" in printed and f"report: {out}/report.md" in printed
    results = read_results(out)
    assert results["baseline"] is None and results["baseline_metrics"] is None and results["deltas"] == {}
    assert results["n_clips"] == 2 and results["dtype"] == "fp32"
    # Two clips, two videos per side: each clip once, input | post-trained.
    assert [v["kind"] for v in results["videos"]] == ["best", "best"]
    scale = -(-PANEL_MIN_WIDTH // SIZE)
    assert video_shape(out / results["videos"][0]["path"]) == (FRAMES, LABEL_HEIGHT + scale * SIZE, 2 * scale * SIZE)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--checkpoint": "/no/such/checkpoint"}, "checkpoint /no/such/checkpoint does not exist"),
        ({"--data": "/no/such/data"}, "data /no/such/data does not exist"),
        ({"--frames": "8"}, "--frames=8 is not 1+8k frames (use 1 or 9)"),
        ({"--size": "40", "--checkpoint": DV}, "--size=40 is not a multiple of 16"),
        ({"--data": str(Path(__file__).parent)}, "is not an energon dataset"),
        ({"--vgg-weights": "/no/vgg16.pth"}, "VGG16 weights /no/vgg16.pth (--vgg-weights) not found"),
    ],
)
def test_cli_errors_are_one_line(
    change: dict[str, str],
    message: str,
    dataset: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = {"--checkpoint": CV, "--data": str(dataset), "--out": str(tmp_path), "--frames": "9", **change}
    code = cli(*(item for pair in options.items() for item in pair))
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert message in err
    assert not (tmp_path / "results.json").exists()


def test_cli_prints_the_verdict_and_says_how_to_get_one(
    dataset: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = ["--checkpoint", CV, "--baseline", CV, "--data", str(dataset), "--out", str(tmp_path), "--frames", "9"]
    assert cli(*options, "--size", "64", "--max-clips", "1") == 0
    printed = capsys.readouterr().out
    assert f"1 clip of 1 video of {dataset}" in printed
    assert "post-trained tokenizer: inconclusive against the base: PSNR" in printed
    # The hint names this command's own options.
    assert "for a verdict: at least 8 clips (--max-clips; up to --clips-per-video per video)" in printed


def test_a_drifted_model_exits_4_with_every_file_written(
    dataset: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The perturbed copy's latents move by ~0.18 (relative L2); one clip leaves PSNR inconclusive: drifted decides.
    model = perturbed(CV, tmp_path / "cv.safetensors")
    options = ["--checkpoint", model, "--baseline", CV, "--data", str(dataset), "--out", str(tmp_path / "eval")]
    options += ["--frames", "9", "--size", "64", "--max-clips", "1", "--videos-per-side", "0", "--noise-levels"]
    assert cli(*options, "--max-latent-drift", "0.01") == 4  # the option's earlier name still sets the limit
    printed = capsys.readouterr().out
    results = read_results(tmp_path / "eval")
    assert results["drift_limit"] == 0.01 and "psnr_noised" not in results["metrics"]  # --noise-levels: none
    assert "post-trained tokenizer: DRIFTED from the base: latent drift 0.1" in printed
    assert "inconclusive by PSNR alone: only 1 clip" in printed
    assert "warning: " not in printed  # the drifted verdict says it: no second line of the same
    assert "- verdict: **DRIFTED from the base" in (tmp_path / "eval" / "report.md").read_text()


def _results(change: float, drift: float, limit: float) -> dict[str, Any]:
    """What :func:`evaluate` returns for eight clips moved by ``change`` dB and latents moved by ``drift``."""
    before = [20.0 + 0.5 * i for i in range(8)]
    after = [b + change + (0.02 if i % 2 else -0.02) for i, b in enumerate(before)]
    per_clip = {"keys": [str(i) for i in range(8)], "model": {"psnr": after}, "baseline": {"psnr": before}}
    return {
        "data": {"path": "d", "source": "energon val split"},
        "n_clips": 8,
        "n_videos": 2,
        "skipped": [],
        "metrics": {"psnr": sum(after) / 8},
        "baseline_metrics": {"psnr": sum(before) / 8},
        "deltas": {"psnr": change},
        "comparison": {"latent_drift": drift},
        "drift_limit": limit,
        "per_clip": per_clip,
    }


@pytest.mark.parametrize(
    ("change", "drift", "code", "word"),
    [(-1.0, 0.2, 3, "WORSE than"), (1.0, 0.2, 4, "DRIFTED from"), (1.0, 0.01, 0, "better than")],
    ids=["worse", "drifted", "better"],
)
def test_a_finished_evaluation_exits_3_when_worse_4_when_drifted(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    change: float,
    drift: float,
    code: int,
    word: str,
) -> None:
    # The evaluation itself is the other tests'; here what the command makes of its verdict.
    import tokenizer_posttrain.evaluation.evaluate as module

    calls: list[dict[str, Any]] = []

    def fake(**kwargs: Any) -> dict[str, Any]:  # noqa: ANN401
        calls.append(kwargs)
        return _results(change, drift, kwargs["drift_limit"])

    monkeypatch.setattr(module, "evaluate", fake)
    assert cli("--checkpoint", "m", "--baseline", "b", "--data", "d", "--out", "o", "--max-drift", "0.1") == code
    assert calls[0]["drift_limit"] == 0.1 and calls[0]["noise_levels"] == [0.05, 0.1, 0.2]
    assert f"post-trained tokenizer: {word} the base" in capsys.readouterr().out
