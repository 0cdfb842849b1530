"""Writing what :func:`.evaluate.evaluate` found: results.json, report.md, PNG plots, mp4s.

Plots use matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), so writing a
report never opens a window nor changes the plotting state of the process that calls it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..core.errors import DriftedFromBaseError, WorseThanBaseError
from ..io.model_card import COMPARISONS, METRICS
from .latent_shift import CONSTANTS, shift_markdown
from .media import labelled_panels, write_mp4

RESULTS_JSON = "results.json"
REPORT_MD = "report.md"
PSNR_PNG = "psnr_per_clip.png"
ERRORS_PNG = "error_histogram.png"
VIDEO_DIR = "videos"
NOISED = "psnr_noised"
"""Key, in ``metrics`` and ``baseline_metrics`` (and ``deltas``), of the PSNR decoded from noised latents:
``{"0.05": dB, ...}`` by noise level (:data:`.evaluate.NOISE_LEVELS`); absent for discrete models."""


MIN_VERDICT_CLIPS = 8
"""Held-out clips a verdict needs: a mean over fewer says too little about footage the model has not seen."""
SPREAD_SIGMAS = 2.0
"""A change counts when the mean per-clip PSNR change is more than this many standard errors of it from 0 (about
95% of the means such clips would give lie within it)."""
LATENT_DRIFT_LIMIT = 0.05
"""Latent drift (continuous models: relative L2 of the latent) or token flip rate (DV) above which the verdict is
``drifted``: the default of ``posttrain --max-drift`` and ``evaluate --max-drift``, and the sweep's limit.

Why 5%: a world model sees latents normalised per channel, ``(z - mean) / std``. For latents of about zero mean and
channels of similar spread, a relative change of 0.05 of ``z`` moves each normalised value by about 0.05 of a
standard deviation (root mean square): a signal-to-change ratio of 26 dB, the size of the smallest noise level of
:data:`.evaluate.NOISE_LEVELS`, small against the noise a diffusion world model learns to remove, yet already a
systematic shift it was not trained on. It is a conservative rule of thumb, not a threshold calibrated on a world
model's loss: channel means far from 0 make the relative L2 understate the normalised change (the mean inflates
``||z_base||``), a change concentrated in a channel of small spread counts for more than its share, and for DV
5% is one token in twenty that an autoregressive model trained on the base's tokens would not have predicted."""
EXIT_WORSE = WorseThanBaseError.exit_code
"""Exit code of a command whose tokenizer is worse than its base (``posttrain``, ``evaluate --baseline``)."""
EXIT_DRIFTED = DriftedFromBaseError.exit_code
"""Exit code of a command whose tokenizer's latents (DV: tokens) drifted from its base's past the limit: not 3
(worse), so that a script can tell the two apart."""


class Drift(NamedTuple):
    """How far the latents (or tokens) moved from the baseline's, and the limit they are held to."""

    what: str
    """``latent drift`` (continuous models) or ``token flip rate`` (DV)."""
    value: float
    limit: float | None
    """None: no limit (nothing counts as drifted)."""

    @property
    def over(self) -> bool:
        """Above the limit. Strictly: a drift of exactly 0 (a decoder-only run leaves the latents as they were)
        is never over, even a limit of 0. A NaN drift is (nothing says the latents are still valid)."""
        return self.limit is not None and not self.value <= self.limit

    @property
    def value_text(self) -> str:
        """The value with the digits that tell it from the limit (0.05004 against 0.05: not ``0.05``)."""
        digits = 3
        while digits < 8 and self.limit is not None and self.value != self.limit:
            if float(f"{self.value:.{digits}g}") != self.limit:
                break
            digits += 1
        return f"{self.value:.{digits}g}"

    @property
    def text(self) -> str:
        """``latent drift 0.081 > 0.05`` (over the limit) or ``latent drift 0.012 <= 0.05``."""
        if self.limit is None:
            return f"{self.what} {self.value_text}"
        return f"{self.what} {self.value_text} {'>' if self.over else '<='} {self.limit:g}"


_DRIFTS = (("latent_drift", "latent drift"), ("token_flip_rate", "token flip rate"))


def measured_drift(results: dict[str, Any]) -> Drift | None:
    """The drift of an evaluation against a baseline (:func:`.evaluate.evaluate`), with its limit
    (``results["drift_limit"]``; results of earlier releases without it: :data:`LATENT_DRIFT_LIMIT`); None when
    not measured (no baseline, or latents of another kind or shape)."""
    limit = results.get("drift_limit", LATENT_DRIFT_LIMIT)
    comparison = results.get("comparison") or {}
    for key, what in _DRIFTS:
        value = comparison.get(key)
        if value is not None:
            return Drift(what, float(value), None if limit is None else float(limit))
    return None


@dataclass(frozen=True)
class Verdict:
    """How a post-trained tokenizer compares with its base on the same held-out clips: by PSNR (dB), and by how
    far its latents moved.

    ``before`` and ``after`` are the mean PSNRs; ``spread`` is the standard error of the mean per-clip change
    (None with fewer than two clips); ``videos`` the held-out videos the clips came from (None: not known);
    ``drift`` the latent drift or token flip rate and its limit (None: not measured).
    By PSNR, the change counts only with at least :data:`MIN_VERDICT_CLIPS` clips and when it is more than
    :data:`SPREAD_SIGMAS` standard errors from 0; otherwise it is ``inconclusive``, with the reason. A drift over
    its limit makes the verdict ``drifted`` unless PSNR says ``worse``: worse is the first thing to know, and a
    better or inconclusive PSNR does not make up for latents a world model no longer reads as it learned them.
    """

    before: float
    after: float
    clips: int
    spread: float | None = None
    videos: int | None = None
    drift: Drift | None = None

    @classmethod
    def of(
        cls, before: Sequence[float], after: Sequence[float], videos: int | None = None, drift: Drift | None = None
    ) -> Verdict:
        """The verdict of per-clip PSNRs of the base (``before``) and the post-trained model (``after``), clip by
        clip the same clips, and of the ``drift`` between them. Clips where either PSNR is not finite (a perfect or
        a broken reconstruction) stay in the means but not in the spread; a NaN mean makes the verdict ``worse``."""
        if len(before) != len(after) or not before:
            raise ValueError(f"a verdict needs the same clips on both sides, got {len(before)} and {len(after)}")
        changes = [a - b for b, a in zip(before, after, strict=True) if math.isfinite(a) and math.isfinite(b)]
        spread = None
        if len(changes) >= 2:
            mean = sum(changes) / len(changes)
            variance = sum((c - mean) ** 2 for c in changes) / (len(changes) - 1)
            spread = math.sqrt(variance / len(changes))
        return cls(sum(before) / len(before), sum(after) / len(after), len(before), spread, videos, drift)

    @property
    def change(self) -> float:
        """Mean PSNR change (dB), post-trained minus base."""
        return self.after - self.before

    @property
    def psnr_reason(self) -> str | None:
        """Why the PSNR comparison is inconclusive (None when it is not)."""
        if math.isnan(self.after):
            return None  # a broken model is worse, however few the clips
        if math.isnan(self.before):
            return "the base's PSNR is NaN"
        if math.isnan(self.change):  # inf - inf: some clip is reconstructed exactly by both
            return "a clip reconstructed exactly by both (infinite PSNR) leaves the mean change undefined"
        if self.clips < MIN_VERDICT_CLIPS:
            return f"only {_clips(self.clips)}; a verdict needs at least {MIN_VERDICT_CLIPS}"
        if self.spread is None:
            return "the PSNR of too few clips is finite to measure their spread"
        if self.change == 0 and self.spread == 0:
            return "the PSNR did not change"
        if abs(self.change) <= SPREAD_SIGMAS * self.spread:
            return (
                f"the change is within the clips' own spread (±{SPREAD_SIGMAS * self.spread:.3f} dB, "
                f"{SPREAD_SIGMAS:g} standard errors of the mean change)"
            )
        return None

    @property
    def psnr_word(self) -> str:
        """The verdict by PSNR alone: ``better``, ``worse`` or ``inconclusive``."""
        if math.isnan(self.after):
            return "worse"
        if self.psnr_reason is not None:
            return "inconclusive"
        return "better" if self.change > 0 else "worse"

    @property
    def over_drift(self) -> bool:
        """The drift is over its limit, whatever the verdict's word."""
        return self.drift is not None and self.drift.over

    @property
    def word(self) -> str:
        """``worse`` (by PSNR, first), ``drifted`` (the drift over its limit), else ``better`` or
        ``inconclusive``."""
        if self.psnr_word == "worse":
            return "worse"
        return "drifted" if self.over_drift else self.psnr_word

    @property
    def reason(self) -> str | None:
        """Why the verdict is ``inconclusive`` or ``drifted`` (None when it is ``better`` or ``worse``)."""
        if self.word == "inconclusive":
            return self.psnr_reason
        if self.word == "drifted" and self.drift is not None:
            return f"{self.drift.text}: the latents moved past the limit"
        return None

    @property
    def worse(self) -> bool:
        """Worse beyond the clips' spread, or broken (a NaN PSNR)."""
        return self.word == "worse"

    @property
    def drifted(self) -> bool:
        """The verdict is ``drifted``: PSNR not worse, the drift over its limit."""
        return self.word == "drifted"

    @property
    def line(self) -> str:
        """One line for the terminal, the model card and the report, e.g. ``WORSE than the base: PSNR 16.34 ->
        15.92 dB (-0.420 ± 0.102 dB) on 12 held-out clips of 3 videos``; an inconclusive one ends with its
        reason; a drifted one leads with the drift, e.g. ``DRIFTED from the base: latent drift 0.081 > 0.05 (PSNR
        30.10 -> 31.20 dB, +1.100 ± 0.102 dB on 12 held-out clips of 3 videos; better by PSNR alone)``."""
        spread = f" ± {SPREAD_SIGMAS * self.spread:.3f}" if self.spread is not None else ""
        of = f" of {self.videos} video{'s' if self.videos != 1 else ''}" if self.videos else ""
        psnr = f"PSNR {self.before:.2f} -> {self.after:.2f} dB"
        change = f"{self.change:+.3f}{spread} dB"
        clips = f"on {self.clips} held-out clip{'s' if self.clips != 1 else ''}{of}"
        if self.word == "drifted" and self.drift is not None:
            alone = f"{self.psnr_word} by PSNR alone"
            alone += f": {self.psnr_reason}" if self.psnr_word == "inconclusive" else ""
            return f"DRIFTED from the base: {self.drift.text} ({psnr}, {change} {clips}; {alone})"
        label = {
            "worse": "WORSE than the base",
            "better": "better than the base",
            "inconclusive": "inconclusive against the base",
        }
        line = f"{label[self.word]}: {psnr} ({change}) {clips}"
        return f"{line}: {self.reason}" if self.word == "inconclusive" else line


def exit_code(judged: Verdict | None, allow_worse: bool = False, allow_drift: bool = False) -> int:
    """The exit code of a command whose evaluation against a baseline ran to its end: :data:`EXIT_WORSE` when
    worse (unless ``allow_worse``), else :data:`EXIT_DRIFTED` when the drift is over its limit (unless
    ``allow_drift``; a worse model let through with ``allow_worse`` is still held to the drift limit), else 0.
    No verdict (no baseline): 0."""
    if judged is None:
        return 0
    if judged.worse and not allow_worse:
        return EXIT_WORSE
    if judged.over_drift and not allow_drift:
        return EXIT_DRIFTED
    return 0


def _clips(count: int) -> str:
    return f"{count} clip{'s' if count != 1 else ''}"


def verdict(results: dict[str, Any]) -> Verdict | None:
    """The verdict of an evaluation against a baseline (:func:`.evaluate.evaluate` with ``baseline``), from its
    per-clip PSNRs and its drift (:func:`measured_drift`); None without a baseline PSNR."""
    base = (results.get("baseline_metrics") or {}).get("psnr")
    after = (results.get("metrics") or {}).get("psnr")
    if base is None or after is None:
        return None
    per_clip = results.get("per_clip") or {}
    before_clips = (per_clip.get("baseline") or {}).get("psnr")
    after_clips = (per_clip.get("model") or {}).get("psnr")
    videos, drift = results.get("n_videos"), measured_drift(results)
    if before_clips and after_clips and len(before_clips) == len(after_clips):
        # results.json writes a non-finite PSNR as null: read it back as NaN.
        return Verdict.of(_floats(before_clips), _floats(after_clips), videos, drift)
    return Verdict(float(base), float(after), int(results.get("n_clips") or 0), None, videos, drift)


def _floats(values: list[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def drift_warning(results: dict[str, Any]) -> str | None:
    """One line when the latent drift (continuous models) or token flip rate (DV) against the baseline is over its
    limit (:func:`measured_drift`), saying what it means for a world model; None when within it or not measured."""
    drift = measured_drift(results)
    if drift is None or not drift.over:
        return None
    latents = "latents" if drift.what == "latent drift" else "tokens"
    return (
        f"{drift.what} {drift.value_text} is above the limit {drift.limit:g}: a world model trained on the "
        f"base's {latents} would need fine-tuning on the new ones"
    )


def safe_name(key: str) -> str:
    """A file-name-safe version of a clip key (energon and folder keys may hold slashes)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("_") or "clip"


def _fmt(fmt: str, value: float | None, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return str(value)
    return (fmt.replace("{:", "{:+") if signed else fmt).format(value)


def metric_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(metric, baseline, post-trained, change) rows of the summary table, as text."""
    model, base = results["metrics"], results["baseline_metrics"]
    rows = []
    for key, label, fmt in METRICS:
        if key not in model:
            continue  # codebook metrics exist for DV models only
        base_text = _fmt(fmt, base.get(key)) if base else "-"
        change = results["deltas"].get(key)
        rows.append((label, base_text, _fmt(fmt, model[key]), _fmt(fmt, change, signed=True) if base else "-"))
        if key == "psnr":  # beside the clean PSNR: what a world model's imperfect latents decode to
            rows += _noised_rows(results, fmt)
    for key, label, fmt in COMPARISONS:
        if key in results["comparison"]:
            rows.append((label, "-", _fmt(fmt, results["comparison"][key]), "-"))
    return rows


def _noised_rows(results: dict[str, Any], fmt: str) -> list[tuple[str, str, str, str]]:
    """Rows of the PSNR from noised latents (continuous models: ``metrics["psnr_noised"]``), one per level."""
    model, base = results["metrics"].get(NOISED) or {}, (results["baseline_metrics"] or {}).get(NOISED) or {}
    changes = results["deltas"].get(NOISED) or {}
    has_base = bool(results["baseline_metrics"])
    return [
        (
            f"PSNR from latent + {level} σ noise (dB) ↑",
            _fmt(fmt, base.get(level)) if has_base else "-",
            _fmt(fmt, value),
            _fmt(fmt, changes.get(level), signed=True) if has_base else "-",
        )
        for level, value in model.items()
    ]


def format_table(results: dict[str, Any]) -> str:
    """The summary table as aligned plain text (for the terminal)."""
    rows = [("metric", "baseline", "post-trained", "change"), *metric_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


UNKNOWN_FPS = 24.0
"""Frame rate of a report video whose source's rate cannot be found (a dataset not made by make-shards whose
shard cannot be read)."""


def write_videos(
    out_dir: Path,
    selection: list[tuple[str, int, str, float, list[torch.Tensor], float | None]],
    labels: list[str],
) -> list[dict[str, Any]]:
    """Write one side-by-side mp4 per selected clip, its panels named above them (``labels``, left to right) and
    played at its source's frame rate; returns their entries.

    ``selection`` holds (``best``|``worst``, rank, clip key, PSNR, uint8 ``[T, H, W, 3]`` panels, the source
    video's frames per second or None when unknown: then :data:`UNKNOWN_FPS`).
    """
    entries = []
    for kind, rank, key, psnr, panels, fps in selection:
        relative = f"{VIDEO_DIR}/{kind}{rank}_{safe_name(key)}.mp4"
        write_mp4(out_dir / relative, labelled_panels(panels, labels), fps=fps or UNKNOWN_FPS)
        entries.append(
            {
                "kind": kind,
                "rank": rank,
                "key": key,
                "psnr": psnr,
                "path": relative,
                "panels": labels,
                "fps": fps,
            }
        )
    return entries


def _finite(values: list[float] | None) -> list[float]:
    return [v for v in values or [] if v is not None and math.isfinite(v)]


def plot_psnr(results: dict[str, Any], path: Path) -> Path:
    """PSNR per clip. With a baseline: each clip's baseline and post-trained PSNR joined by a line (up: better),
    clips ordered by their change, the mean change and the clips' spread in the title; one clip is one such pair.
    Without: the clips' PSNR as bars, best first."""
    from matplotlib.figure import Figure

    per_clip = results["per_clip"]
    model = per_clip["model"]["psnr"]
    base = (per_clip.get("baseline") or {}).get("psnr")
    fig = Figure(figsize=(max(5.5, min(12.0, 2.5 + 0.25 * len(model))), 4.5), layout="tight")
    ax = fig.add_subplot()
    keys = per_clip["keys"]
    if base:
        pairs = [(k, b, m) for k, b, m in zip(keys, base, model, strict=True) if _finite([b]) and _finite([m])]
        pairs.sort(key=lambda pair: pair[2] - pair[1])
        for x, (_, b, m) in enumerate(pairs):
            ax.plot([x, x], [b, m], color="grey", linewidth=1, zorder=1)
        xs = range(len(pairs))
        ax.scatter(xs, [b for _, b, _ in pairs], s=24, label="baseline", zorder=2)
        ax.scatter(xs, [m for _, _, m in pairs], s=24, marker="D", label="post-trained", zorder=2)
        ax.set_xlabel("clip (ordered by PSNR change)")
        ax.legend(loc="best")
        judged = verdict(results)
        title = f"PSNR per clip: {judged.word}" if judged else "PSNR per clip"
        if judged is not None:
            spread = f" ± {SPREAD_SIGMAS * judged.spread:.2f}" if judged.spread is not None else ""
            title += f", mean change {judged.change:+.2f}{spread} dB"
    else:
        pairs = sorted(((k, m, m) for k, m in zip(keys, model, strict=True) if _finite([m])), key=lambda p: -p[2])
        ax.bar(range(len(pairs)), [m for _, _, m in pairs])
        ax.set_xlabel("clip (best first)")
        title = "PSNR per clip"
    if len(pairs) <= 12:  # few clips: name them (one clip is a single, named point)
        ax.set_xticks(range(len(pairs)), [k for k, _, _ in pairs], rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.75, len(pairs) - 0.25)
    ax.set_ylabel("PSNR (dB)")
    ax.set_title(f"{title}\n({_clips_of(results)})", fontsize=10)
    fig.savefig(path, dpi=100)
    return path


def plot_errors(results: dict[str, Any], path: Path) -> Path:
    """Distribution of per-pixel absolute errors (uint8 levels) of each tokenizer, log scale."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4), layout="tight")
    ax = fig.add_subplot()
    top = 1
    for which, label in (("baseline", "baseline"), ("model", "post-trained")):
        counts = results["error_histogram"].get(which)
        if not counts:
            continue
        total = sum(counts)
        top = max(top, max(i for i, c in enumerate(counts) if c) if total else 1)
        ax.step(range(len(counts)), [c / total for c in counts], where="mid", label=label)
    ax.set_xlim(0, top + 1)
    ax.set_yscale("log")
    ax.set_xlabel("absolute error per pixel and channel (uint8 levels)")
    ax.set_ylabel("fraction of pixels")
    ax.set_title("Reconstruction errors")
    ax.legend()
    fig.savefig(path, dpi=100)
    return path


def _json_safe(value: Any) -> Any:
    # Strict JSON has no Infinity/NaN (a perfect reconstruction has infinite PSNR): write null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _markdown(results: dict[str, Any]) -> str:
    model, base, clip = results["model"], results["baseline"], results["clip"]
    resize = f", short side resized to {clip['resize_short_side']}" if clip["resize_short_side"] else ""
    lines = [
        "# Tokenizer evaluation",
        "",
        f"- post-trained: **{model['name']}** `{model['checkpoint']}`",
        f"- baseline: **{base['name']}** `{base['checkpoint']}`" if base else "- baseline: none",
        f"- data: `{results['data']['path']}` ({results['data']['source']}), {_clips_of(results)} of "
        f"{clip['frames']}x{clip['height']}x{clip['width']} (per video: the middle frames and centre crop, then "
        f"random starts and crops of fixed seeds{resize})",
        f"- run on {results['device']} in {results['dtype']}",
        *([f"- verdict: **{judged.line}**"] if (judged := verdict(results)) else []),
        *([f"- **drift: {drifted}**"] if (drifted := drift_warning(results)) else []),
        "",
        "| metric | baseline | post-trained | change |",
        "|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in metric_rows(results)),
        "",
    ]
    lines += [f"- {name}: {note}" for name, note in results["notes"].items()]
    if results["skipped"]:
        lines += [f"- skipped {len(results['skipped'])} videos:", *(f"  - {s}" for s in results["skipped"])]
    lines += ["", "## Plots", "", f"![PSNR per clip]({PSNR_PNG})", "", f"![Reconstruction errors]({ERRORS_PNG})", ""]
    if results["videos"]:
        lines += [
            "## Best and worst clips by post-trained PSNR",
            "",
            f"Panels, named above them: {' | '.join(results['videos'][0]['panels'])}; played at the source's "
            "frame rate.",
            "",
        ]
        lines += [
            f"- {v['kind']} {v['rank']}: `{v['key']}`, {_fmt('{:.2f}', v['psnr'])} dB, "
            f"{_fmt('{:.3g}', v.get('fps') or UNKNOWN_FPS)} fps{'' if v.get('fps') else ' (source rate unknown)'}: "
            f"[{v['path']}]({v['path']})"
            for v in results["videos"]
        ]
        lines.append("")
    per_clip, has_base = results["per_clip"], bool(results["baseline"])
    lines += ["## PSNR per clip (dB)", "", "| clip | baseline | post-trained |", "|---|---|---|"]
    for i, key in enumerate(per_clip["keys"]):
        before = _fmt("{:.2f}", per_clip["baseline"]["psnr"][i]) if has_base else "-"
        lines.append(f"| `{key}` | {before} | {_fmt('{:.2f}', per_clip['model']['psnr'][i])} |")
    sections = card_sections(results)
    return "\n".join([*lines, "", *sections] if sections else lines) + "\n"


def _clips_of(results: dict[str, Any]) -> str:
    """``12 clips of 3 videos`` (the video count is missing from results of earlier releases)."""
    clips, videos = results["n_clips"], results.get("n_videos")
    text = f"{clips} clip{'s' if clips != 1 else ''}"
    return f"{text} of {videos} video{'s' if videos != 1 else ''}" if videos else text


def card_sections(results: dict[str, Any]) -> list[str]:
    """Markdown sections of an evaluation that belong in the model card too: the latent statistics' shift
    against the base's, when both tokenizers have them."""
    shift = results.get("latent_stats_shift")
    if not shift:
        return []
    if shift["max_abs_mean_offset"] == 0 and shift["max_std_change"] == 0:
        what = "per-channel constants" if shift.get("reference") == CONSTANTS else "statistics (`mean_std.pt`)"
        return ["## Latent statistics against the base", "", f"Identical to the base's {what}.", ""]
    return shift_markdown(shift)


def write_report(results: dict[str, Any], out_dir: Path) -> Path:
    """Write the plots, ``results.json`` and ``report.md`` (linking plots and videos) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results["plots"] = {
        "psnr": plot_psnr(results, out_dir / PSNR_PNG).name,
        "errors": plot_errors(results, out_dir / ERRORS_PNG).name,
    }
    results["report"] = REPORT_MD
    (out_dir / RESULTS_JSON).write_text(json.dumps(_json_safe(results), indent=2) + "\n")
    report = out_dir / REPORT_MD
    report.write_text(_markdown(results))
    return report
