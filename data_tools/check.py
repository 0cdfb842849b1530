"""``check``: probe every sample of a dataset for a requested clip shape and report what is wrong."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from tokenizer_posttrain.data.layout import check_prepared, read_shard_counts
from tokenizer_posttrain.data.probe import Problem, VideoProbeError, clip_problems, probe_video
from tokenizer_posttrain.data.shard_check import MemberScan, ShardDamage, index_change, index_offsets

from .prepare import META, find_shards
from .sources import find_videos, is_video

EXAMPLES = 3  # offending names shown per problem code; the report has them all


class NoSamples(Exception):
    """DATA does not exist or holds no video samples (exit status 2)."""


DAMAGED_SHARD = "damaged_shard"
CHANGED_SHARD = "changed_shard"
PICKLED_MEMBER = "pickled_member"
# Members webdataset's default decoders unpickle (pickle.loads) or torch.load with weights_only=False, also gzipped.
_PICKLED_SUFFIXES = (".pkl", ".pickle", ".pyd", ".pth")


def is_pickled(name: str) -> bool:
    """Whether webdataset's readers would unpickle the tar member ``name`` (from its name only)."""
    lowered = name.lower()
    while lowered.endswith(".gz"):  # webdataset gunzips a member first, then decodes it by the name left
        lowered = lowered[: -len(".gz")]
    return lowered.endswith(_PICKLED_SUFFIXES)


def pickled_problem(shard: str, member: str) -> Problem:
    """The ``pickled_member`` error of ``member`` in ``shard``."""
    key = member.rsplit("/", 1)[-1].split(".", 1)[0]
    return Problem(
        "error",
        PICKLED_MEMBER,
        f"sample {key} of {shard} holds {member}, a pickle: training never reads it, but other webdataset "
        "readers unpickle it (or torch.load it), which runs any code planted in it; remove it from the shard",
    )


@dataclass
class Findings:
    """Every problem found, per sample, in reading order; and the tar shards that are cut short or
    damaged (their samples from the damage on cannot be read, so they are not among ``samples``)."""

    samples: int = 0
    problems: list[tuple[str, Problem]] = field(default_factory=list)
    damaged: list[ShardDamage] = field(default_factory=list)
    pickled: list[tuple[str, Problem]] = field(default_factory=list)
    """``("<shard>:<member>", pickled_member error)`` per pickled tar member (never read, so not a sample)."""
    changed: list[tuple[str, Problem]] = field(default_factory=list)
    """``(shard, changed_shard error)`` per shard that no longer matches its energon index (training refuses it)."""

    def bad_samples(self, severity: str) -> set[str]:
        """Names of the samples with at least one problem of ``severity``."""
        return {name for name, p in self.problems if p.severity == severity}

    @property
    def lost(self) -> int:
        """Samples the damaged shards' indexes list that cannot be read (unknown ones count 0)."""
        return sum(d.lost or 0 for d in self.damaged)

    def all_problems(self) -> list[tuple[str, Problem]]:
        """The samples' problems, the pickled members' errors, then one ``changed_shard`` error per changed shard
        and one ``damaged_shard`` error per damaged shard (named by the shard)."""
        shards = [(d.shard, Problem("error", DAMAGED_SHARD, d.message())) for d in self.damaged]
        return [*self.problems, *self.pickled, *self.changed, *shards]


def _samples_in_tars(root: Path, shards: list[str], found: Findings) -> Iterator[tuple[str, BinaryIO]]:
    """Video members of each shard up to its first damage, which goes to ``found.damaged``; pickled members go
    to ``found.pickled``, unread; shards that no longer match their energon index go to ``found.changed``."""
    for shard in shards:
        offsets = index_offsets(root / shard)
        change = index_change(root / shard, every_sample=True)
        if change is not None:
            found.changed.append((shard, Problem("error", CHANGED_SHARD, change.message(root))))
        scan = MemberScan(root / shard, None if offsets is None else len(offsets) - 1, lambda m: is_video(Path(m.name)))
        for member, f in scan:
            if is_video(Path(member.name)):
                yield f"{shard}:{member.name}", f
            elif is_pickled(member.name):
                found.pickled.append((f"{shard}:{member.name}", pickled_problem(shard, member.name)))
        if scan.damage is not None:
            found.damaged.append(scan.damage)


@contextmanager
def _open_samples(data: Path, found: Findings) -> Iterator[tuple[Iterator[tuple[str, BinaryIO]], int | None]]:
    """(name, seekable file) for every video sample under ``data``, plus the count when known cheaply;
    damaged tar shards and pickled tar members go to ``found``."""
    if not data.exists():
        raise NoSamples(f"{data} does not exist")
    if data.is_file():
        if data.suffix == ".tar":
            yield _samples_in_tars(data.parent, [data.name], found), None
        elif is_video(data):
            yield _files([data], data.parent), 1
        else:
            raise NoSamples(f"{data} is neither a folder, a .tar shard nor a video file")
        return
    shards = find_shards(data)
    if (data / META).exists():
        # What training would refuse before energon reads the folder (code named in its yaml files, a FIFO).
        check_prepared(data)
    if shards:
        yield _samples_in_tars(data, shards, found), _indexed_count(data)
        return
    videos = find_videos(data)
    if not videos:
        raise NoSamples(f"{data} holds no .tar shards and no video files (.mp4 .mov .m4v .mkv .webm .avi)")
    yield _files(videos, data), len(videos)


def _files(paths: list[Path], root: Path) -> Iterator[tuple[str, BinaryIO]]:
    for path in paths:
        with open(path, "rb") as f:
            yield path.relative_to(root).as_posix(), f


def _indexed_count(root: Path) -> int | None:
    """The samples energon's ``.info.json`` counts in the prepared folder ``root`` (for the progress bar), None
    when the folder is not prepared."""
    if not (root / META).exists():
        return None
    return sum(read_shard_counts(root).values())


def _sha1(f: BinaryIO) -> str:
    digest = hashlib.sha1()
    while chunk := f.read(1 << 20):
        digest.update(chunk)
    f.seek(0)
    return digest.hexdigest()


def check_dataset(
    data: Path, frames: int, crop: int, resize_short_side: int | None = None, deep: bool = False
) -> Findings:
    """Probe every sample of ``data`` (tar shards or a folder of videos) and collect its problems;
    ``deep`` decodes every frame of every video (see :func:`probe_video`).

    Raises :class:`NoSamples` when ``data`` is missing or holds no video.
    """
    found = Findings()
    first_seen: dict[str, str] = {}
    with _open_samples(data, found) as (samples, total):
        for name, f in tqdm(samples, total=total, unit="video", desc="checking", disable=None, file=sys.stderr):
            found.samples += 1
            sha1 = _sha1(f)
            if sha1 in first_seen:
                found.problems.append(
                    (
                        name,
                        Problem(
                            "warning",
                            "duplicate",
                            f"same bytes as {first_seen[sha1]}; remove one copy (duplicates over-weight a clip "
                            "and can leak between train and val)",
                        ),
                    )
                )
            else:
                first_seen[sha1] = name
            try:
                info = probe_video(f, deep=deep)
            except VideoProbeError as err:
                found.problems.append((name, err.problem()))
                continue
            found.problems.extend((name, p) for p in clip_problems(info, frames, crop, resize_short_side))
    if found.samples == 0 and not found.damaged:
        raise NoSamples(f"{data} holds no video samples (tar members ending in .mp4 .mov .m4v .mkv .webm .avi)")
    return found


def write_report(found: Findings, path: Path) -> None:
    """One json line per problem: sample (the shard's name for a damaged shard), severity, code, message."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for name, p in found.all_problems():
            f.write(json.dumps({"sample": name, "severity": p.severity, "code": p.code, "message": p.message}) + "\n")


def print_summary(found: Findings, console: Console, report: Path) -> None:
    """A table of problem codes (count, severity, first offenders) and the usable total."""
    by_code: dict[str, list[tuple[str, Problem]]] = {}
    for name, p in found.all_problems():
        by_code.setdefault(p.code, []).append((name, p))
    if by_code:
        table = Table(title="Problems per code")
        for column in ("code", "severity", "samples", f"first {EXAMPLES}", "example message"):
            table.add_column(column, overflow="fold")
        order = sorted(by_code.items(), key=lambda kv: (kv[1][0][1].severity != "error", kv[0]))
        for code, hits in order:
            names = "\n".join(name for name, _ in hits[:EXAMPLES])
            style = "red" if hits[0][1].severity == "error" else "yellow"
            table.add_row(code, f"[{style}]{hits[0][1].severity}[/]", str(len(hits)), names, hits[0][1].message)
        console.print(table)
    errors, warnings = found.bad_samples("error"), found.bad_samples("warning")
    console.print(
        f"samples: {found.samples} total, {found.samples - len(errors)} usable, {len(errors)} with errors, "
        f"{len(warnings - errors)} with warnings only; all problems are in {report}"
    )
    if found.damaged:
        names = ", ".join(d.shard for d in found.damaged[:EXAMPLES])
        console.print(
            f"damaged tar shards: {len(found.damaged)} ({names}), {found.lost} more samples in them cannot be read "
            "(not counted above); re-create them (python -m data_tools make-shards) or restore the files"
        )
