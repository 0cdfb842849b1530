"""``make-shards``: a folder of videos -> tar shards, manifest and energon preparation, incrementally."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import av
from tqdm import tqdm

from tokenizer_posttrain.core.errors import DataError
from tokenizer_posttrain.core.untrusted import read_regular_file, why_unreadable
from tokenizer_posttrain.data.probe import VideoInfo, VideoProbeError, probe_video

from .prepare import energon_prepare, find_shards, is_prepared
from .shards import Packed, ShardWriter, load_manifest, next_shard_index, write_manifest
from .sources import COPY_SUFFIXES, assign_keys, assign_splits, find_videos
from .transcode import transcode

SETTINGS = "make_shards.json"
MAX_SETTINGS_BYTES = 1 << 20
"""The largest make_shards.json read (make-shards writes a few hundred bytes)."""
SKIPPED = "skipped.jsonl"
TRANSCODE_TMP = ".transcode.tmp"
_OUR_TMP = re.compile(r"(\d+\.tar|manifest\.jsonl)\.tmp|\.transcode\.tmp")
# Options that change what a packed sample is; a re-run with other values would mix two datasets.
_PACKING = ("transcode", "max_height", "seed", "val_fraction")


class UsageError(Exception):
    """Bad input the user has to fix (exit status 2)."""


@dataclass(frozen=True)
class Options:
    """make-shards settings (see ``python -m data_tools make-shards --help``)."""

    shard_size: int = 10**9
    val_fraction: float = 0.01
    transcode: bool = False
    max_height: int | None = None
    seed: int = 0
    allow_skips: bool = False


def _say(msg: str) -> None:
    print(msg, flush=True)


def _write_if_changed(path: Path, text: str) -> None:
    # An up-to-date re-run should leave every file of OUT untouched (mtimes included).
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def _read_settings(path: Path) -> dict:
    """The options ``path`` (make_shards.json) records; :class:`DataError` naming it when it is not what
    make-shards writes."""
    fix = "delete it (make-shards writes it again with the options of this run) or choose a new OUT folder"
    try:
        saved = json.loads(read_regular_file(path, MAX_SETTINGS_BYTES))
    except OSError as err:  # a FIFO (never waited on), a folder, a link, a huge file
        raise DataError(f"{why_unreadable(path, err)}: {fix}") from None
    except RecursionError:
        raise DataError(f"{path} nests its JSON too deeply to read: {fix}") from None
    except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8 text
        problem = (
            f"is not valid JSON ({err.msg}: line {err.lineno} column {err.colno})"
            if isinstance(err, json.JSONDecodeError)
            else "is not UTF-8 text"
        )
    else:
        if isinstance(saved, dict):
            return saved
        problem = f"holds a JSON {type(saved).__name__}, not the object of options make-shards writes"
    raise DataError(f"{path} {problem}: {fix}")


def _check_settings(out: Path, src: Path, opts: Options) -> None:
    path = out / SETTINGS
    wanted = {name: getattr(opts, name) for name in _PACKING}
    if path.exists() or path.is_symlink():  # whatever is there is read, or refused (a FIFO would block a write)
        saved = _read_settings(path)
        diff = {k: (saved.get(k), v) for k, v in wanted.items() if saved.get(k) != v}
        if diff:
            was = ", ".join(f"{k}={old!r} (now {new!r})" for k, (old, new) in diff.items())
            raise UsageError(f"{out} was made with {was}; re-run with the same options or choose a new OUT folder")
        if saved.get("src") != str(src):
            _say(f"note: {out} was made from {saved.get('src')}; videos are matched by path relative to SRC")
    _write_if_changed(path, json.dumps({"src": str(src), **wanted}, indent=2) + "\n")


def _load_state(out: Path) -> list[dict]:
    """Manifest entries whose shard exists; also removes our temp files left by a killed run."""
    for path in out.iterdir():
        if _OUR_TMP.fullmatch(path.name):
            path.unlink()
    entries = load_manifest(out)
    present = [e for e in entries if (out / e["shard"]).is_file()]
    if len(present) < len(entries):
        _say(f"note: {len(entries) - len(present)} videos of an unfinished shard will be packed again")
        write_manifest(out, present)
    foreign = sorted(set(find_shards(out)) - {e["shard"] for e in present})
    if foreign:
        raise UsageError(
            f"{out} holds tar files make-shards did not write ({', '.join(foreign[:3])}); energon would mix them "
            "into the dataset. Choose an empty folder for OUT"
        )
    return present


def _report_changes(src: Path, entries: list[dict], videos: dict[str, Path]) -> None:
    gone = [e["relpath"] for e in entries if e["relpath"] not in videos]
    changed = []
    for e in entries:
        path = videos.get(e["relpath"])
        if path is not None:
            stat = path.stat()
            if (stat.st_size, stat.st_mtime_ns) != (e["source_bytes"], e["source_mtime_ns"]):
                changed.append(e["relpath"])
    if gone:
        _say(f"note: {len(gone)} packed videos are no longer in {src} (e.g. {gone[0]}); they stay in the dataset")
    if changed:
        _say(
            f"warning: {len(changed)} videos changed since they were packed (e.g. {changed[0]}); the packed copies "
            "are kept. Delete OUT and run again to re-pack them"
        )


def _info_fields(info: VideoInfo) -> dict:
    return dataclasses.asdict(info)


def _pack(out: Path, items: list[Packed], opts: Options, entries: list[dict], skipped: list[dict]) -> list[str]:
    """Write the new shards (train first, then val, never mixed); returns their names."""
    writer = ShardWriter(out, opts.shard_size, next_shard_index(out, entries), entries)
    tmp = out / TRANSCODE_TMP
    bar = tqdm(total=len(items), unit="video", desc="packing", disable=None, file=sys.stderr)
    try:
        for split in ("train", "val"):
            for item in (i for i in items if i.split == split):
                if item.transcoded:
                    try:
                        transcode(item.source, tmp, opts.max_height)
                        item.info = _info_fields(probe_video(tmp))
                    except (av.FFmpegError, OSError, ValueError, VideoProbeError) as err:
                        skipped.append({"source": str(item.source), "reason": f"transcode failed ({err})"})
                        bar.update()
                        continue
                    item.path = tmp
                writer.add(item)
                bar.update()
            writer.close()
    finally:
        bar.close()
        tmp.unlink(missing_ok=True)
    return writer.written


def make_shards(src: Path, out: Path, opts: Options) -> int:
    """Pack the videos under ``src`` into energon shards in ``out``; returns the exit status.

    Re-runs pack only videos not yet in ``out/manifest.jsonl`` and re-prepare only when shards
    were added. Unreadable videos are listed in ``out/skipped.jsonl``; they make the exit status 1
    unless ``opts.allow_skips``.
    """
    src, out = src.resolve(), out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    _check_settings(out, src, opts)
    entries = _load_state(out)
    exclude = out if out != src and out.is_relative_to(src) else None
    videos = {p.relative_to(src).as_posix(): p for p in find_videos(src, exclude=exclude)}
    _report_changes(src, entries, videos)

    done = {e["relpath"] for e in entries}
    new = [rel for rel in videos if rel not in done]
    skipped: list[dict] = []
    readable: dict[str, VideoInfo] = {}
    for rel in tqdm(new, unit="video", desc="probing", disable=None, file=sys.stderr):
        try:
            readable[rel] = probe_video(videos[rel])
        except VideoProbeError as err:
            skipped.append({"source": str(videos[rel]), "reason": str(err)})

    keys = assign_keys(list(readable), {e["key"] for e in entries})
    splits = assign_splits(list(keys.values()), {e["key"]: e["split"] for e in entries}, opts.val_fraction, opts.seed)
    items = []
    for rel, info in readable.items():
        path = videos[rel]
        recode = (
            opts.transcode
            or path.suffix.lower() not in COPY_SUFFIXES
            or bool(opts.max_height and info.height > opts.max_height)
        )
        items.append(Packed(rel, path, path, keys[rel], splits[keys[rel]], _info_fields(info), recode))
    before = len(entries)
    written = _pack(out, items, opts, entries, skipped) if items else []

    _write_if_changed(out / SKIPPED, "".join(json.dumps(s) + "\n" for s in skipped))
    if not entries:
        raise UsageError(f"no usable videos in {src} ({len(skipped)} unreadable, see {out / SKIPPED})")
    shards = {s: sorted({e["shard"] for e in entries if e["split"] == s}) for s in ("train", "val")}
    if not shards["train"]:
        raise UsageError(
            f"every usable video went to val; add videos or lower --val-fraction (now {opts.val_fraction})"
        )
    if written or not is_prepared(out, shards["train"] + shards["val"]):
        _say(f"preparing {out} for energon ...")
        energon_prepare(out, shards)

    counts = {s: sum(e["split"] == s for e in entries) for s in shards}
    total = f"{len(entries)} videos in {len(shards['train']) + len(shards['val'])} shards"
    total += f" (train: {counts['train']} in {len(shards['train'])}, val: {counts['val']} in {len(shards['val'])})"
    if written:
        _say(f"packed {len(entries) - before} new videos into {len(written)} shards; dataset {out}: {total}")
    else:
        _say(f"up to date: {out} holds {total}")
    if skipped:
        _say(f"skipped {len(skipped)} videos that cannot be read (all listed in {out / SKIPPED}):")
        for s in skipped[:10]:
            _say(f"  {s['source']}: {s['reason']}")
        if not opts.allow_skips:
            _say(
                "error: fix or remove these files and re-run (only they will be added), "
                "or pass --allow-skips to accept the dataset without them"
            )
            return 1
        _say("warning: --allow-skips given, the dataset was made without them")
    return 0
