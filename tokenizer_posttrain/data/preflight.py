"""Fast checks of a dataset before the first training step: fail before launch, not an hour in."""

from __future__ import annotations

import os
import random
import shutil
import tarfile
import warnings
from pathlib import Path
from typing import Any

from ..core.errors import DataError
from .batch import PREFETCH
from .layout import SPLIT_FILE, read_shard_counts, split_parts
from .shard_check import FIX, index_change, indexed_damage, whole_members

# The video stack (PyAV, energon's helpers) is imported where it is used: runs on synthetic
# clips, which import this module, then need none of it.
VIDEO_SUFFIXES = (".mp4", ".mov", ".m4v", ".mkv", ".webm", ".avi")


def train_shards(path: str | Path) -> list[Path]:
    """The train shards of a prepared energon dataset (clear error when it is not one)."""
    shards = split_shards(path, "train")
    if not shards:
        raise DataError(f"{Path(path) / SPLIT_FILE} lists no train shards; re-run python -m data_tools make-shards")
    return shards


def split_shards(path: str | Path, split: str) -> list[Path]:
    """The shards of ``split`` of a prepared energon dataset, none when it has no such split; its files are
    checked first (:func:`~.layout.split_parts`: nothing in them may name code), and every shard must be there."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"data.path={root} does not exist or is not a folder")
    parts = split_parts(root)
    if parts is None:
        raise DataError(
            f"data.path={root} is not a prepared energon dataset (no .nv-meta/split.yaml). Make one from a folder of "
            f"videos with: python -m data_tools make-shards VIDEOS {root}"
        )
    from braceexpand import braceexpand

    # energon writes shard lists with brace ranges, e.g. "{000000..000009}.tar"
    shards = [root / name for pattern in parts.get(split, []) for name in braceexpand(pattern)]
    missing = [str(s) for s in shards if not s.is_file()]
    if missing:
        raise DataError(f"{root}: {split} shards listed in split.yaml are missing: {', '.join(missing[:5])}")
    return shards


def check_worker_share(path: str | Path, world_size: int, num_workers: int) -> int:
    """Energon gives each loader worker of each rank a share of the train samples and cannot
    repeat an empty share: there must be at least one sample per worker. Returns the count."""
    root = Path(path)
    shards = train_shards(root)
    counts = read_shard_counts(root)
    total = sum(counts.get(shard.name, 0) for shard in shards)
    workers = world_size * max(1, num_workers)
    if total < workers:
        raise DataError(
            f"data.path={root} has {total} training videos, fewer than the {workers} loader workers "
            f"({world_size} process(es) x {max(1, num_workers)}): lower data.num_workers or add videos"
        )
    return total


SHARED_MEMORY = Path("/dev/shm")
"""Where torch's loader workers put the batches they hand over (Linux)."""


def loader_prefetch(
    batch_bytes: int,
    num_workers: int,
    prefetch: int | None,
    processes: int = 1,
    folder: Path | None = None,
) -> int:
    """Batches each loader worker may prepare ahead: ``prefetch``, or with None :data:`~.batch.PREFETCH`, or
    fewer where that many would not fit in shared memory (warned).

    Each of ``num_workers`` workers of each of ``processes`` training processes on this machine holds up to that
    many batches of ``batch_bytes`` in ``folder`` (``/dev/shm``; all of them while the first step compiles), and
    a full ``folder`` kills the loader with a bus error mid-run: a ``prefetch`` that does not fit, or a loader
    that does not fit even at 1, raises ``DataError``. Nothing is checked without workers or where ``folder``
    does not exist.
    """
    folder = SHARED_MEMORY if folder is None else folder
    wanted = PREFETCH if prefetch is None else prefetch
    if num_workers < 1 or not folder.is_dir():
        return wanted
    free = shutil.disk_usage(folder).free

    def needed(ahead: int) -> int:  # plus the batch each process is reading
        return (processes * num_workers * ahead + processes) * batch_bytes

    if needed(wanted) <= free:
        return wanted
    # The most that fit, solved for (needed is linear in it): a scan up to a huge data.prefetch would hang.
    fits = max(0, min(wanted - 1, (free // batch_bytes - processes) // (processes * num_workers)))
    shown = f"{processes * num_workers * wanted + processes} batches of {_size(batch_bytes)}"
    what = (
        f"data.prefetch={wanted} x data.num_workers={num_workers} x {processes} process(es) on this machine keep up "
        f"to {shown} in shared memory ({_size(needed(wanted))}), but {folder} has {_size(free)} free"
    )
    more = "give it more (docker run --shm-size=... or --ipc=host)"
    if prefetch is None and fits:
        warnings.warn(
            f"{what}: data.prefetch lowered to {fits}, which may starve the GPU on real footage; {more}",
            stacklevel=2,
        )
        return fits
    lower = f"data.prefetch={fits} fits" if fits else "lower data.num_workers or data.micro_batch_size"
    raise DataError(f"{what}: the loader would die with a bus error. {more[0].upper()}{more[1:]}, or {lower}")


def _size(size: float) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


def _sample_members(shards: list[Path], count: int, seed: int, unreadable: list[str]) -> list[tuple[str, bytes]]:
    """Up to ``count`` (name, bytes) video members spread over the shards, chosen by ``seed``, from the
    whole members only; a shard that cannot be read at all is added to ``unreadable`` instead."""
    rng = random.Random(seed)
    order = list(shards)
    rng.shuffle(order)
    picked: list[tuple[str, bytes]] = []
    per_shard = max(1, -(-count // len(order)))
    for shard in order:
        try:
            size = shard.stat().st_size
            with tarfile.open(shard, mode="r:") as tar:  # energon reads plain tars only
                members = [m for m in whole_members(tar, size) if m.name.lower().endswith(VIDEO_SUFFIXES)]
                for member in rng.sample(members, min(per_shard, len(members))):
                    picked.append((f"{shard.name}:{member.name}", tar.extractfile(member).read()))
        except (tarfile.TarError, OSError, EOFError) as err:
            unreadable.append(f"{shard.name}: damaged tar shard ({type(err).__name__}: {err}); {FIX}")
        if len(picked) >= count:
            break
    return picked[:count]


def check_shards(
    path: str | Path, shards: list[Path], max_skip_fraction: float, val_shards: list[Path] | None = None
) -> list[str]:
    """Compare every train shard, and every validation shard of ``val_shards``, with its energon index (a stat,
    an index read and a few tar headers each): raise :class:`DataError` when a shard was replaced or rewritten
    since it was prepared (energon would read what its old index lists: :func:`~.shard_check.index_change`), or
    when the samples lost in cut-short train shards are more than ``max_skip_fraction`` of the train samples;
    else return one warning line per damaged shard (training and validation skip the lost samples and count
    them)."""
    root = Path(path)
    val_shards = val_shards or []
    changed = [c for c in map(index_change, [*shards, *val_shards]) if c is not None]
    if changed:
        more = f" ({len(changed) - 1} more shards changed: {', '.join(c.shard for c in changed[1:4])})"
        raise DataError(f"data.path={root}: {changed[0].message(root)}{more if len(changed) > 1 else ''}")
    damaged = [d for d in map(indexed_damage, shards) if d is not None]
    val_lines = [
        f"{d.shard}: {d.message()} (validation skips the {d.lost} lost samples)"
        for d in map(indexed_damage, val_shards)
        if d is not None
    ]
    if not damaged:
        return val_lines
    counts = read_shard_counts(root)
    total = sum(counts.get(shard.name, 0) for shard in shards)
    lost = sum(d.lost or 0 for d in damaged)
    named = "; ".join(f"{d.shard}: {d.message()}" for d in damaged[:3])
    more = f"; and {len(damaged) - 3} more damaged shards" if len(damaged) > 3 else ""
    if lost > max_skip_fraction * total:
        raise DataError(
            f"data.path={root}: {lost} of {total} training samples are lost in damaged tar shards, more than "
            f"data.max_skip_fraction={max_skip_fraction}: {named}{more}"
        )
    return [f"{d.shard}: {d.message()} (training skips the {d.lost} lost samples)" for d in damaged] + val_lines


def preflight(
    path: str | Path,
    frames: int,
    height: int,
    width: int,
    resize_short_side: int | None,
    samples: int,
    max_skip_fraction: float,
    seed: int = 0,
) -> list[str]:
    """Check every train and validation shard against its index (:func:`check_shards`), then probe a sample of
    the train videos; raise :class:`DataError` when too many cannot give a ``frames x height x width``
    clip. Returns the problems found (to warn about)."""
    from .probe import VideoProbeError, clip_problems, probe_video

    shards = train_shards(path)
    damaged = check_shards(path, shards, max_skip_fraction, split_shards(path, "val"))
    if samples <= 0:
        return damaged
    unreadable: list[str] = []
    checked = _sample_members(shards, samples, seed, unreadable)
    if not checked and unreadable:
        raise DataError(f"data.path={path}: no train shard can be read: {'; '.join(unreadable[:3])}")
    if not checked:
        raise DataError(
            f"data.path={path}: the train shards hold no video files ({', '.join(s.name for s in shards[:3])})"
        )
    bad: list[str] = []
    for name, data in checked:
        try:
            info = probe_video(data)
        except VideoProbeError as err:
            bad.append(f"{name}: {err}")
            continue
        errors = [
            p for p in clip_problems(info, frames, max(height, width), resize_short_side) if p.severity == "error"
        ]
        bad.extend(f"{name}: {p.message}" for p in errors[:1])
    if bad and len(bad) > max_skip_fraction * len(checked):
        listing = "\n  ".join(bad[:10])
        raise DataError(
            f"{len(bad)} of {len(checked)} sampled training videos cannot give a {frames}x{height}x{width} clip "
            f"(more than data.max_skip_fraction={max_skip_fraction}):\n  {listing}\n"
            "Fix: choose fewer data.frames or a smaller crop (data.height/data.width), set data.resize_short_side, "
            "or remove these files (python -m data_tools check lists every problem)."
        )
    return damaged + unreadable + bad


_CHECK_TIMEOUT_S = 120
"""How long the GPU-decoding check waits for one frame, in this process and in the forked one."""


def check_gpu_decoding(path: str | Path, num_workers: int, seed: int = 0) -> None:
    """For ``data.decode=gpu``: decode the first frame of one train video on this rank's GPU, where the loader
    will decode it, or raise :class:`DataError` saying what failed and what to do (before any worker starts).

    It decodes in this process first (does the driver give FFmpeg a video decoder at all?), then, when loader
    workers decode (``num_workers`` > 0), in a process forked after CUDA is up, as energon forks its workers.
    """
    unreadable: list[str] = []
    checked = _sample_members(train_shards(path), 1, seed, unreadable)
    if not checked:
        return  # the preflight names unreadable or empty shards
    name, data = checked[0]
    import torch

    if torch.cuda.is_available():
        # On this rank's GPU, as training will be: a context on GPU 0 from every rank would waste its memory.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise DataError(
                f"data.decode=gpu: LOCAL_RANK={local_rank} but this process sees {torch.cuda.device_count()} "
                "GPU(s) (CUDA_VISIBLE_DEVICES); start one process per visible GPU"
            )
        torch.cuda.set_device(local_rank)
        torch.cuda.init()
    here = _threaded_first_frame_problem(data)
    if here:
        raise DataError(
            f"data.decode=gpu: {name} could not be decoded on the GPU ({here}); FFmpeg needs the NVIDIA driver's "
            "video decoder (libnvcuvid; in a container, NVIDIA_DRIVER_CAPABILITIES must include video), or use "
            "data.decode=cpu"
        )
    forked = _forked_first_frame_problem(data) if num_workers > 0 else ""
    if forked:
        raise DataError(
            f"data.decode=gpu: {name} decodes on the GPU in the training process but not in a loader worker "
            f"({forked}): energon forks its workers, and CUDA does not work in a process forked after it started; "
            "set data.num_workers=0 (the training process then decodes, while the GPU runs the step it was "
            "given) or use data.decode=cpu"
        )


def _forked_first_frame_problem(data: bytes) -> str:
    """:func:`_first_frame_problem` in a forked process, as in a loader worker; "" when it decodes."""
    import multiprocessing
    import queue

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_decode_first_frame, args=(data, results), daemon=True)
    child.start()
    try:
        # Read before joining: a child blocks on exit until what it put on the queue is read.
        return results.get(timeout=_CHECK_TIMEOUT_S)
    except queue.Empty:
        return (
            f"no frame after {_CHECK_TIMEOUT_S} s"
            if child.is_alive()
            else f"the check's process died (exit code {child.exitcode})"
        )
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
        results.close()


def _threaded_first_frame_problem(data: bytes) -> str:
    """:func:`_first_frame_problem` in this process, given at most the check's time (a hung driver must not
    hang the launch); "" when it decodes."""
    import threading

    found: list[str] = []
    thread = threading.Thread(target=lambda: found.append(_first_frame_problem(data)), daemon=True)
    thread.start()
    thread.join(_CHECK_TIMEOUT_S)
    return found[0] if found else f"no frame after {_CHECK_TIMEOUT_S} s"


def _first_frame_problem(data: bytes) -> str:
    """ "" when the first frame of ``data`` decodes on the GPU, else why not."""
    import io

    from .clip_decode import Box, ClipReader

    try:
        with ClipReader(io.BytesIO(data), gpu=True) as reader:
            reader.read(0, 1, Box(0, 0, 2, 2))
        return ""
    except Exception as err:  # FFmpeg reports a missing device or decoder in many ways
        return f"{type(err).__name__}: {err}"


def _decode_first_frame(data: bytes, results: Any) -> None:
    """In the check's worker process: put :func:`_first_frame_problem` of ``data`` on ``results``."""
    results.put(_first_frame_problem(data))
