"""Where clips start: uniform starts, and keyframe starts with the GOP-weighted draw the module describes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tokenizer_posttrain.data.clip_start import keyframe_start, uniform_start


def starts(keyframes: list[int], n_frames: int, frames: int, window: int, draws: int = 4000) -> Counter:
    rng = random.Random(0)
    return Counter(keyframe_start(keyframes, n_frames, frames, window, rng) for _ in range(draws))


def test_starts_lie_at_or_just_after_a_keyframe_with_room_for_the_clip() -> None:
    # 100 frames, clips of 9: starts 0..91; keyframes every 25 frames, and one too late for a clip.
    seen = starts([0, 25, 50, 75, 95], 100, 9, window=3)
    assert set(seen) == {k + d for k in (0, 25, 50, 75) for d in range(4)}


def test_window_zero_starts_exactly_at_keyframes() -> None:
    assert set(starts([0, 10, 30], 60, 9, window=0)) == {0, 10, 30}


def test_a_window_never_reaches_past_the_next_keyframe_or_the_last_start() -> None:
    # GOPs of 2 frames: a window of 5 would overlap the next GOP's starts; the GOP at 4 reaches 4 + 5 = 9 (not
    # 10); the last start is 12 (21 - 9).
    seen = starts([0, 2, 4, 11], 21, 9, window=5)
    assert set(seen) == {0, 1, 2, 3} | set(range(4, 10)) | {11, 12}


def test_keyframes_are_drawn_in_proportion_to_the_starts_their_gop_covers() -> None:
    # GOP 0 covers starts 0..29 (30), GOP 30 covers 30..39 (10): a 3 : 1 draw, as uniform starts would give.
    seen = starts([0, 30], 49, 10, window=0, draws=8000)
    assert seen[0] / seen[30] == pytest.approx(3.0, rel=0.1)


def test_without_a_usable_keyframe_the_start_is_uniform() -> None:
    rng = random.Random(1)
    assert {keyframe_start([], 20, 9, 4, rng) for _ in range(400)} == set(range(12))
    assert {keyframe_start([15], 20, 9, 4, rng) for _ in range(400)} == set(range(12))


def test_uniform_starts_cover_every_start() -> None:
    rng = random.Random(2)
    assert {uniform_start(20, 9, rng) for _ in range(400)} == set(range(12))
