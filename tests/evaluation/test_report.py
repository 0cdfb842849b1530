"""The verdict of an evaluation against its base: worse, better or unchanged, on one line."""

from __future__ import annotations

import math

import pytest

from tokenizer_posttrain.evaluation.report import Verdict, verdict


@pytest.mark.parametrize(
    "before, after, word, line",
    [
        (6.34, 5.92, "worse", "WORSE than the base: PSNR 6.34 -> 5.92 dB (-0.420 dB) on 4 held-out clips"),
        (30.0, 31.5, "better", "better than the base: PSNR 30.00 -> 31.50 dB (+1.500 dB) on 4 held-out clips"),
        (30.0, 30.0, "unchanged", "no better than the base: PSNR 30.00 -> 30.00 dB (+0.000 dB) on 4 held-out clips"),
        # A drop that rounds away at two decimals is still a drop; the change says so.
        (30.0, 29.999, "worse", "WORSE than the base: PSNR 30.00 -> 30.00 dB (-0.001 dB) on 4 held-out clips"),
    ],
)
def test_verdict_compares_the_psnr_of_the_same_clips(before: float, after: float, word: str, line: str) -> None:
    judged = Verdict(before, after, 4)
    assert (judged.word, judged.worse, judged.line) == (word, word == "worse", line)


def test_a_broken_post_trained_model_is_worse() -> None:
    assert Verdict(20.0, math.nan, 1).worse
    assert Verdict(20.0, math.nan, 1).line.endswith("on 1 held-out clip")


def test_verdict_of_results_needs_a_baseline() -> None:
    results = {"metrics": {"psnr": 5.92}, "baseline_metrics": {"psnr": 6.34}, "n_clips": 2}
    assert verdict(results) == Verdict(6.34, 5.92, 2)
    assert verdict({"metrics": {"psnr": 5.92}, "baseline_metrics": None, "n_clips": 2}) is None
