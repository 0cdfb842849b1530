"""The evaluate command: the report without a baseline, and every bad input as one line with exit code 1."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.evaluation.test_evaluate import (  # noqa: F401 - dataset and empty_hub are fixtures
    CV,
    DV,
    FRAMES,
    SIZE,
    dataset,
    empty_hub,
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
