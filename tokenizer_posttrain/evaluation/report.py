"""Writing what :func:`.evaluate.evaluate` found: results.json, report.md, PNG plots, mp4s.

Plots use matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), so writing a
report never opens a window nor changes the plotting state of the process that calls it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .latent_shift import shift_markdown
from .media import write_mp4

RESULTS_JSON = "results.json"
REPORT_MD = "report.md"
PSNR_PNG = "psnr_per_clip.png"
ERRORS_PNG = "error_histogram.png"
VIDEO_DIR = "videos"
# key, label (with the better direction), format
METRICS = (
    ("psnr", "PSNR (dB) ↑", "{:.2f}"),
    ("ssim", "SSIM ↑", "{:.4f}"),
    ("lpips", "LPIPS-style VGG16 distance ↓", "{:.4f}"),
    ("flicker", "temporal flicker ↓", "{:.5f}"),
    ("codebook_usage", "codebook usage ↑", "{:.4f}"),
    ("perplexity", "code perplexity ↑", "{:.1f}"),
)
COMPARISONS = (
    ("latent_drift", "latent drift vs baseline (relative L2)", "{:.5f}"),
    ("token_flip_rate", "token flip rate vs baseline", "{:.5f}"),
)


@dataclass(frozen=True)
class Verdict:
    """How a post-trained tokenizer compares with its base on the same held-out clips, by PSNR (dB)."""

    before: float
    after: float
    clips: int

    @property
    def worse(self) -> bool:
        """Any drop counts (the clips are the same, the evaluation deterministic); a NaN PSNR is worse too."""
        return not self.after >= self.before

    @property
    def word(self) -> str:
        """``worse``, ``better`` or ``unchanged``."""
        return "worse" if self.worse else "better" if self.after > self.before else "unchanged"

    @property
    def line(self) -> str:
        """One line for the terminal, the model card and the report, e.g. ``WORSE than the base: PSNR 6.34 ->
        5.92 dB (-0.420 dB) on 4 held-out clips``."""
        label = {
            "worse": "WORSE than the base",
            "better": "better than the base",
            "unchanged": "no better than the base",
        }
        change = self.after - self.before
        return (
            f"{label[self.word]}: PSNR {self.before:.2f} -> {self.after:.2f} dB ({change:+.3f} dB) "
            f"on {self.clips} held-out clip{'s' if self.clips != 1 else ''}"
        )


def verdict(results: dict[str, Any]) -> Verdict | None:
    """The verdict of an evaluation against a baseline (:func:`.evaluate.evaluate` with ``baseline``); None
    without a baseline PSNR."""
    base = (results.get("baseline_metrics") or {}).get("psnr")
    after = (results.get("metrics") or {}).get("psnr")
    if base is None or after is None:
        return None
    return Verdict(float(base), float(after), int(results.get("n_clips") or 0))


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
    for key, label, fmt in COMPARISONS:
        if key in results["comparison"]:
            rows.append((label, "-", _fmt(fmt, results["comparison"][key]), "-"))
    return rows


def format_table(results: dict[str, Any]) -> str:
    """The summary table as aligned plain text (for the terminal)."""
    rows = [("metric", "baseline", "post-trained", "change"), *metric_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def write_videos(
    out_dir: Path, selection: list[tuple[str, int, str, float, list[torch.Tensor]]], labels: list[str]
) -> list[dict[str, Any]]:
    """Write one side-by-side mp4 (panels left to right, as ``labels``) per selected clip; returns their entries.

    ``selection`` holds (``best``|``worst``, rank, clip key, PSNR, uint8 ``[T, H, W, 3]`` panels).
    """
    entries = []
    for kind, rank, key, psnr, panels in selection:
        relative = f"{VIDEO_DIR}/{kind}{rank}_{safe_name(key)}.mp4"
        write_mp4(out_dir / relative, torch.cat(panels, dim=2))
        entries.append({"kind": kind, "rank": rank, "key": key, "psnr": psnr, "path": relative, "panels": labels})
    return entries


def _finite(values: list[float] | None) -> list[float]:
    return [v for v in values or [] if v is not None and math.isfinite(v)]


def plot_psnr(results: dict[str, Any], path: Path) -> Path:
    """PSNR per clip: baseline vs post-trained scatter (above the diagonal = better), else sorted bars."""
    from matplotlib.figure import Figure

    model = results["per_clip"]["model"]["psnr"]
    base = (results["per_clip"].get("baseline") or {}).get("psnr")
    fig = Figure(figsize=(5.5, 4.5), layout="tight")
    ax = fig.add_subplot()
    if base:
        pairs = [(b, m) for b, m in zip(base, model, strict=True) if math.isfinite(b) and math.isfinite(m)]
        xs, ys = zip(*pairs, strict=True) if pairs else ((), ())
        ax.scatter(xs, ys, s=18, alpha=0.8)
        if pairs:
            lo, hi = min(*xs, *ys) - 0.5, max(*xs, *ys) + 0.5
            ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1, linestyle="--", label="no change")
            ax.legend(loc="upper left")
        ax.set_xlabel("baseline PSNR (dB)")
        ax.set_ylabel("post-trained PSNR (dB)")
    else:
        values = sorted(_finite(model), reverse=True)
        ax.bar(range(len(values)), values)
        ax.set_xlabel("clip (sorted by PSNR)")
        ax.set_ylabel("PSNR (dB)")
    ax.set_title(f"PSNR per clip ({results['n_clips']} clips)")
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
        f"- data: `{results['data']['path']}` ({results['data']['source']}), {results['n_clips']} clips of "
        f"{clip['frames']}x{clip['height']}x{clip['width']} (middle frames, centre crop{resize})",
        f"- run on {results['device']} in {results['dtype']}",
        *([f"- verdict: **{judged.line}**"] if (judged := verdict(results)) else []),
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
            f"Panels: {' | '.join(results['videos'][0]['panels'])}",
            "",
        ]
        lines += [
            f"- {v['kind']} {v['rank']}: `{v['key']}`, {_fmt('{:.2f}', v['psnr'])} dB: [{v['path']}]({v['path']})"
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


def card_sections(results: dict[str, Any]) -> list[str]:
    """Markdown sections of an evaluation that belong in the model card too: the latent statistics' shift
    against the base's, when both tokenizers have them."""
    shift = results.get("latent_stats_shift")
    if not shift:
        return []
    if shift["max_abs_mean_offset"] == 0 and shift["max_std_change"] == 0:
        return ["## Latent statistics against the base", "", "Identical to the base's (`mean_std.pt`).", ""]
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
