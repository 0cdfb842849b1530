"""Where a training clip starts in its video (``data.start``).

A decoder can only begin at a keyframe: a clip starting ``d`` frames after one decodes ``d`` frames it throws
away. With a uniform start that is half a GOP on average, which on footage as cameras write it (a keyframe every
few seconds) is several times the clip itself. ``keyframe`` starts each clip at a keyframe or at most
``keyframe_window`` frames after it.

The bias that buys: clips start only at those few places of each video. A keyframe is drawn with a
probability proportional to the starts its GOP covers under ``uniform`` (so every stretch of the video is as
likely as before), but within a GOP the later frames appear only inside clips, never at their start; and a video
with one keyframe (a GOP as long as the video) gives clips from its first ``keyframe_window + 1`` starts only.
Encoders also put keyframes at scene cuts, so clips starting on a cut become more frequent.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

CLIP_STARTS = ("uniform", "keyframe")
"""The values of ``data.start``."""
DECODERS = ("cpu", "gpu")
"""The values of ``data.decode``: where clips are decoded (:class:`~.clip_decode.ClipReader`)."""


def uniform_start(n_frames: int, frames: int, rng: random.Random) -> int:
    """Any start that leaves room for ``frames`` frames, all alike."""
    return rng.randint(0, n_frames - frames)


def keyframe_start(keyframes: Sequence[int], n_frames: int, frames: int, window: int, rng: random.Random) -> int:
    """A start at a keyframe of ``keyframes`` (sorted frame indices) or up to ``window`` frames after it, drawn
    as the module docstring says; a uniform start when no keyframe leaves room for the clip (or none is known)."""
    last = n_frames - frames  # the last start with room for the clip
    usable = [k for k in keyframes if 0 <= k <= last]
    if not usable:
        return uniform_start(n_frames, frames, rng)
    # Starts a GOP covers under uniform starts: from its keyframe to the next one (or to the last start).
    ends = usable[1:] + [last + 1]
    spans = [end - k for k, end in zip(usable, ends, strict=True)]
    key = rng.choices(usable, weights=spans)[0]
    span = spans[bisect.bisect_left(usable, key)]
    return key + rng.randint(0, min(window, span - 1))
