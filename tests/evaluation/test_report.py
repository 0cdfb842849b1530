"""The verdict of an evaluation against its base (better, worse or inconclusive, on one line), the drift flag and
the PSNR plot."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tokenizer_posttrain.evaluation.report import (
    MIN_VERDICT_CLIPS,
    Verdict,
    drift_warning,
    plot_psnr,
    verdict,
)

BASE = [20.0, 21.0, 19.5, 22.0, 20.5, 18.0, 21.5, 20.0]  # eight clips of a spread-out footage


@pytest.mark.parametrize(
    "change, word, line",
    [
        (-0.42, "worse", "WORSE than the base: PSNR 20.31 -> 19.89 dB (-0.420 ± 0.015 dB) on 8 held-out clips"),
        (1.5, "better", "better than the base: PSNR 20.31 -> 21.81 dB (+1.500 ± 0.015 dB) on 8 held-out clips"),
    ],
)  # fmt: skip
def test_a_change_beyond_the_clips_spread_is_a_verdict(change: float, word: str, line: str) -> None:
    # Every clip moves by the same amount give or take 0.02 dB: far beyond two standard errors.
    after = [b + change + (0.02 if i % 2 else -0.02) for i, b in enumerate(BASE)]
    judged = Verdict.of(BASE, after, videos=2)
    assert (judged.word, judged.worse, judged.reason) == (word, word == "worse", None)
    assert judged.line == f"{line} of 2 videos"


def test_a_verdict_on_one_clip_is_inconclusive() -> None:
    # Before: one clip 6.43 -> 12.95 dB wrote "better" into the summary and the model card.
    judged = Verdict.of([6.43], [12.95], videos=1)
    assert judged.word == "inconclusive" and not judged.worse and judged.spread is None
    assert judged.reason == f"only 1 clip; a verdict needs at least {MIN_VERDICT_CLIPS}"
    assert judged.line == (
        "inconclusive against the base: PSNR 6.43 -> 12.95 dB (+6.520 dB) on 1 held-out clip of 1 video: "
        f"only 1 clip; a verdict needs at least {MIN_VERDICT_CLIPS}"
    )
    # Seven clips that all improve are still too few.
    assert Verdict.of(BASE[:7], [b + 3 for b in BASE[:7]]).word == "inconclusive"


def test_a_change_inside_the_clips_spread_is_inconclusive() -> None:
    # +0.1 dB on average, but clips go up and down by a dB: the mean could as well be 0.
    after = [b + (1.1 if i % 2 else -0.9) for i, b in enumerate(BASE)]
    judged = Verdict.of(BASE, after)
    assert judged.word == "inconclusive" and judged.change == pytest.approx(0.1)
    assert judged.reason.startswith("the change is within the clips' own spread (±0.7")
    unchanged = Verdict.of(BASE, BASE)
    assert (unchanged.word, unchanged.reason) == ("inconclusive", "the PSNR did not change")


def test_a_broken_post_trained_model_is_worse_however_few_the_clips() -> None:
    assert Verdict.of([20.0], [math.nan]).worse
    assert Verdict(20.0, math.nan, 1).line.startswith("WORSE than the base: PSNR 20.00 -> nan dB")


def test_verdict_of_results_compares_clip_by_clip() -> None:
    after = [b + 1 + (0.1 if i % 2 else 0) for i, b in enumerate(BASE)]
    results = {
        "metrics": {"psnr": sum(after) / 8},
        "baseline_metrics": {"psnr": sum(BASE) / 8},
        "n_clips": 8,
        "n_videos": 3,
        "per_clip": {"keys": [f"k{i}" for i in range(8)], "model": {"psnr": after}, "baseline": {"psnr": BASE}},
    }
    assert verdict(results) == Verdict.of(BASE, after, videos=3) and verdict(results).word == "better"
    # results.json of an earlier release has no per-clip baseline: the means alone, no spread, inconclusive.
    old = {"metrics": {"psnr": 5.92}, "baseline_metrics": {"psnr": 6.34}, "n_clips": 2}
    assert verdict(old) == Verdict(6.34, 5.92, 2) and verdict(old).word == "inconclusive"
    assert verdict({"metrics": {"psnr": 5.92}, "baseline_metrics": None, "n_clips": 2}) is None


def test_drift_above_the_limit_is_flagged() -> None:
    # Measured before: a latent drift of 0.343 went unflagged.
    assert drift_warning({"comparison": {"latent_drift": 0.343}, "drift_limit": 0.05}) == (
        "latent drift 0.343 is above the limit 0.05: a world model trained on the base's latents would need "
        "fine-tuning on the new ones"
    )
    assert drift_warning({"comparison": {"latent_drift": 0.343}}).startswith("latent drift 0.343")  # default limit
    assert drift_warning({"comparison": {"token_flip_rate": 0.2}, "drift_limit": 0.05}).startswith("token flip rate")
    assert drift_warning({"comparison": {"latent_drift": 0.04}, "drift_limit": 0.05}) is None
    assert drift_warning({"comparison": {}}) is None


@pytest.mark.parametrize("baseline", [True, False])
def test_the_psnr_plot_of_one_clip(tmp_path: Path, baseline: bool) -> None:
    # Before: one point on a diagonal, with nothing to read off it. Now one named pair (or bar).
    results = {
        "n_clips": 1,
        "n_videos": 1,
        "metrics": {"psnr": 12.95},
        "baseline_metrics": {"psnr": 6.43} if baseline else None,
        "per_clip": {
            "keys": ["bigbuckbunny"],
            "model": {"psnr": [12.95]},
            **({"baseline": {"psnr": [6.43]}} if baseline else {}),
        },
    }
    path = plot_psnr(results, tmp_path / "psnr.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_clip_both_reconstruct_exactly_makes_no_worse_verdict() -> None:
    # inf - inf is NaN: the mean change was NaN, and a NaN change read as "worse" (exit 3 in posttrain).
    inf = float("inf")
    judged = Verdict.of([30 + 0.1 * i for i in range(9)] + [inf], [30.5 + 0.1 * i for i in range(9)] + [inf])
    assert judged.word == "inconclusive" and not judged.worse
    assert "infinite PSNR" in (judged.reason or "")
