"""The verdict of an evaluation against its base (better, worse, inconclusive or drifted, on one line), the exit code
it gives, the drift flag, the rows of the noised-latent PSNR and the PSNR plot."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tokenizer_posttrain.evaluation.report import (
    EXIT_DRIFTED,
    EXIT_WORSE,
    LATENT_DRIFT_LIMIT,
    MIN_VERDICT_CLIPS,
    Drift,
    Verdict,
    drift_warning,
    exit_code,
    metric_rows,
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


def _moved(change: float) -> list[float]:
    """:data:`BASE` moved by ``change`` dB, each clip give or take 0.02 dB (a change far beyond the spread)."""
    return [b + change + (0.02 if i % 2 else -0.02) for i, b in enumerate(BASE)]


@pytest.mark.parametrize(
    ("after", "drift", "word"),
    [
        (_moved(1.5), 0.081, "drifted"),  # better by PSNR: the drift still decides
        (_moved(1.5), 0.05, "better"),  # at the limit is within it
        (BASE[:3], 0.2, "drifted"),  # inconclusive by PSNR (3 clips)
        (_moved(-0.42), 0.2, "worse"),  # worse first
        ([math.nan] * 8, 0.2, "worse"),  # broken
    ],
)
def test_a_drift_over_the_limit_makes_the_verdict_drifted_unless_worse(
    after: list[float], drift: float, word: str
) -> None:
    judged = Verdict.of(BASE[: len(after)], after, videos=3, drift=Drift("latent drift", drift, 0.05))
    assert judged.word == word and judged.drifted == (word == "drifted") and judged.worse == (word == "worse")
    assert judged.over_drift == (drift > 0.05)


def test_the_drifted_line_leads_with_the_drift_and_keeps_the_psnr() -> None:
    judged = Verdict.of(BASE, _moved(1.5), videos=3, drift=Drift("latent drift", 0.081, 0.05))
    assert judged.line == (
        "DRIFTED from the base: latent drift 0.081 > 0.05 (PSNR 20.31 -> 21.81 dB, +1.500 ± 0.015 dB on 8 held-out "
        "clips of 3 videos; better by PSNR alone)"
    )
    assert judged.reason == "latent drift 0.081 > 0.05: the latents moved past the limit"
    few = Verdict.of([6.43], [12.95], drift=Drift("token flip rate", 0.2, 0.05))
    assert few.line.startswith("DRIFTED from the base: token flip rate 0.2 > 0.05 (PSNR 6.43 -> 12.95 dB, +6.520 dB")
    assert few.line.endswith(
        f"; inconclusive by PSNR alone: only 1 clip; a verdict needs at least {MIN_VERDICT_CLIPS})"
    )
    # A value that rounds to the limit shows the digits that tell them apart.
    assert Drift("latent drift", 0.050004, 0.05).text == "latent drift 0.050004 > 0.05"
    assert Drift("latent drift", 0.012, 0.05).text == "latent drift 0.012 <= 0.05"


def test_unchanged_latents_never_drift() -> None:
    # A decoder-only run leaves the latents exactly as they were: a drift of 0, within even a limit of 0.
    for limit in (0.0, LATENT_DRIFT_LIMIT):
        judged = Verdict.of(BASE, _moved(1.5), drift=Drift("latent drift", 0.0, limit))
        assert judged.word == "better" and not judged.over_drift and exit_code(judged) == 0
    assert Drift("latent drift", math.nan, 0.05).over  # a NaN drift says nothing is still valid
    assert not Drift("latent drift", 7.0, None).over  # no limit


def test_exit_codes_of_a_verdict() -> None:
    drift = Drift("latent drift", 0.2, 0.05)
    worse_and_drifted = Verdict.of(BASE, _moved(-0.42), drift=drift)
    drifted = Verdict.of(BASE, _moved(1.5), drift=drift)
    assert (EXIT_WORSE, EXIT_DRIFTED) == (3, 4)
    assert exit_code(None) == 0 and exit_code(Verdict.of(BASE, _moved(1.5))) == 0
    assert exit_code(Verdict.of(BASE, _moved(-0.42))) == EXIT_WORSE
    assert exit_code(worse_and_drifted) == EXIT_WORSE and exit_code(drifted) == EXIT_DRIFTED
    # Each allowance waives its own check only: a worse model let through is still held to the drift limit.
    assert exit_code(worse_and_drifted, allow_worse=True) == EXIT_DRIFTED
    assert exit_code(worse_and_drifted, allow_worse=True, allow_drift=True) == 0
    assert exit_code(drifted, allow_drift=True) == 0 and exit_code(worse_and_drifted, allow_drift=True) == EXIT_WORSE


def test_verdict_of_results_reads_the_drift_and_its_limit() -> None:
    after = _moved(1.5)
    results = {
        "metrics": {"psnr": sum(after) / 8},
        "baseline_metrics": {"psnr": sum(BASE) / 8},
        "n_clips": 8,
        "per_clip": {"model": {"psnr": after}, "baseline": {"psnr": BASE}},
        "comparison": {"latent_drift": 0.081},
        "drift_limit": 0.1,
    }
    assert verdict(results).word == "better" and verdict(results).drift == Drift("latent drift", 0.081, 0.1)
    results["drift_limit"] = 0.05
    assert verdict(results).word == "drifted" and drift_warning(results).startswith("latent drift 0.081 is above")
    del results["drift_limit"]  # results of an earlier release: the default limit
    assert verdict(results).drift == Drift("latent drift", 0.081, LATENT_DRIFT_LIMIT)
    results["comparison"] = {"token_flip_rate": 0.0}
    assert verdict(results).word == "better" and drift_warning(results) is None


def test_the_noised_psnr_has_a_row_per_level_beside_the_clean_psnr() -> None:
    results = {
        "metrics": {"psnr": 30.0, "psnr_noised": {"0.05": 29.5, "0.1": 28.25}, "ssim": 0.9},
        "baseline_metrics": {"psnr": 29.0, "psnr_noised": {"0.05": 28.0, "0.1": 26.0}, "ssim": 0.8},
        "deltas": {"psnr": 1.0, "psnr_noised": {"0.05": 1.5, "0.1": 2.25}, "ssim": 0.1},
        "comparison": {},
    }
    rows = metric_rows(results)
    assert [row[0] for row in rows[:4]] == [
        "PSNR (dB) ↑",
        "PSNR from latent + 0.05 σ noise (dB) ↑",
        "PSNR from latent + 0.1 σ noise (dB) ↑",
        "SSIM ↑",
    ]
    assert rows[2] == ("PSNR from latent + 0.1 σ noise (dB) ↑", "26.00", "28.25", "+2.25")
    alone = {**results, "baseline_metrics": None, "deltas": {}}
    assert metric_rows(alone)[1] == ("PSNR from latent + 0.05 σ noise (dB) ↑", "-", "29.50", "-")
