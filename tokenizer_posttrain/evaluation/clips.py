"""Clips of an energon dataset for evaluation and latent statistics: the trainer's own loaders, one pass (or
several, for several clips per held-out video), and the frame rate of the videos they come from."""

from __future__ import annotations

import itertools
import json
import tarfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from torch import Tensor

from ..core.errors import EvaluationError, UserError

MANIFEST = "manifest.jsonl"
"""What ``data_tools make-shards`` writes beside the shards: one JSON line per video (key, fps, size...)."""
_MANIFEST_LINE = 1 << 16  # longer lines are not make-shards' and are not read


def open_clips(
    data: str,
    frames: int,
    height: int,
    width: int,
    resize_short_side: int | None,
    skipped: list[str],
    prefer: str = "val",
    workers: int = 0,
    seed: int | None = None,
    float32: bool = True,
) -> tuple[str, Iterator[tuple[str, Tensor]]]:
    """(which split, iterator of ``(key, clip [3, T, H, W] fp32 in [-1, 1])``) of an energon dataset.

    The ``prefer`` split (``val``: held-out clips; ``train``: the training data), else the other one, through the
    trainer's own validation loader: middle frames, centre crop, one ordered, non-repeating pass. Videos the
    loader skips (too short, too small, unreadable) are named in ``skipped``. ``workers`` > 0 decodes in that many
    processes (each reads its own shards, so clips arrive interleaved, not in dataset order). With ``seed``, one
    shuffled pass instead (shards and samples in random order, as the train loader reads them), each clip from a
    random start and crop, all drawn from that seed: the first N clips are then a random sample of the split, not
    its first videos. ``float32=False`` yields the loader's bf16 clips (converting is then the caller's: on a GPU,
    after the copy).
    """
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset, get_val_dataset

    from ..data.batch import KEYS, SKIPPED, VIDEO
    from ..data.layout import dataset_splits
    from ..data.preflight import split_shards
    from ..data.shard_check import index_change
    from ..data.task_encoder import ClipSpec, VideoClipTaskEncoder

    path = Path(data).expanduser()
    if not (path / ".nv-meta").is_dir():
        # make-shards takes a folder: name that folder, not a file given by mistake.
        videos = "VIDEOS (a folder with your videos)" if path.is_file() else str(path)
        raise EvaluationError(
            f"{path} is not an energon dataset (no .nv-meta folder); make one from a folder of videos with "
            f"`python -m data_tools make-shards {videos} OUT --val-fraction 0.05` and pass OUT (or `prepare` for a "
            "folder of tar shards)"
        )
    splits = dataset_splits(path)
    if not {"val", "train"} & splits:
        raise EvaluationError(f"{path} is an energon dataset without a train or val split (see .nv-meta/split.yaml)")
    split = prefer if prefer in splits else ({"val", "train"} - {prefer}).pop()
    # As the launch does: each shard against its index (a FIFO index is refused, never waited on), so a shard
    # replaced since prepare is not evaluated on what its old index lists.
    changed = [c for c in map(index_change, split_shards(path, split)) if c is not None]
    if changed:
        raise EvaluationError(f"{path}: {changed[0].message(path)}")
    encoder = VideoClipTaskEncoder(
        ClipSpec(frames, height, width, resize_short_side=resize_short_side, random_crop=seed is not None)
    )
    worker = WorkerConfig.default_worker_config(num_workers=workers)
    worker.seed_offset = seed or 0
    if seed is None:
        # The trainer's validation reader (middle frames, centre crop, one ordered pass); for the train split too.
        dataset = get_val_dataset(path, split_part=split, worker_config=worker, batch_size=1, task_encoder=encoder)
    else:
        # The train reader's shuffling, for one pass only (repeat=False): a split whose every video is skipped
        # ends the pass instead of looping forever.
        dataset = get_train_dataset(
            path,
            split_part=split,
            worker_config=worker,
            batch_size=1,
            shuffle_buffer_size=100,
            max_samples_per_sequence=10,
            task_encoder=encoder,
            repeat=False,
        )
    loader = get_loader(dataset)
    source = f"energon {split} split" + ("" if split == prefer else f" (the dataset has no {prefer} split)")

    def clips() -> Iterator[tuple[str, Tensor]]:
        with warnings.catch_warnings():
            # energon asks for pinned memory, which warns on machines without a GPU: noise, not news.
            warnings.filterwarnings("ignore", message=".*pin_memory.*", category=UserWarning)
            batches = iter(loader)
        for batch in batches:
            skipped.extend(batch.get(SKIPPED, []))
            for key, video in zip(batch[KEYS], batch[VIDEO], strict=True):
                yield key, video.float() if float32 else video  # bf16 from the loader; exact in fp32
        # Skips travel with the next batch; those after the last one are still waiting in the encoder.
        skipped.extend(encoder.take_skipped())

    return source, clips()


def held_out_clips(
    data: str,
    frames: int,
    height: int,
    width: int,
    resize_short_side: int | None,
    skipped: list[str],
    clips_per_video: int,
) -> tuple[str, Iterator[tuple[str, str, Tensor]]]:
    """(which split, iterator of ``(clip key, video key, clip)``): up to ``clips_per_video`` clips of each video of
    the val split (else the train split), one pass over the videos after the other, so that stopping early still
    spreads the clips over every video.

    The first pass is :func:`open_clips`' ordered one (middle frames, centre crop: clip key = video key); pass
    ``n`` >= 1 draws a random start and crop per video from seed ``n`` (clip key ``<video key>#<n + 1>``). Every
    draw comes from its seed, so two evaluations of the same data see the same pixels (a model and its baseline,
    or the baseline before and after training). Skipped videos are named once, in ``skipped``."""
    if clips_per_video < 1:
        raise EvaluationError(f"clips_per_video must be >= 1, got {clips_per_video}")
    source, first = open_clips(data, frames, height, width, resize_short_side, skipped)

    def passes() -> Iterator[tuple[str, str, Tensor]]:
        for key, clip in first:
            yield key, key, clip
        for n in range(1, clips_per_video):
            # Opened only when the previous pass is used up: a caller that stops early never decodes it.
            _, clips = open_clips(data, frames, height, width, resize_short_side, [], seed=n)
            found = False
            for key, clip in clips:
                found = True
                yield f"{key}#{n + 1}", key, clip
            if not found:
                return

    return source, passes()


def video_fps(data: str, keys: list[str]) -> dict[str, float]:
    """The frame rate of the videos ``keys`` of the energon dataset ``data``: from make-shards' ``manifest.jsonl``
    when there is one, else read from their mp4 in the shards. Keys whose rate cannot be found are left out."""
    path = Path(data).expanduser()
    wanted = set(keys)
    found = _manifest_fps(path / MANIFEST, wanted)
    missing = wanted - set(found)
    if missing:
        found.update(_shard_fps(path, missing))
    return found


def _manifest_fps(manifest: Path, wanted: set[str]) -> dict[str, float]:
    found: dict[str, float] = {}
    if not manifest.is_file():  # a regular file only: a FIFO would block the read
        return found
    try:
        with manifest.open(encoding="utf-8", errors="replace") as lines:
            for line in iter(lambda: lines.readline(_MANIFEST_LINE), ""):
                if len(found) == len(wanted):
                    break
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                fps = entry.get("fps") if isinstance(entry, dict) else None
                key = entry.get("key") if isinstance(entry, dict) else None
                if key in wanted and isinstance(fps, int | float) and 0 < fps < 1000:
                    found[key] = float(fps)
    except OSError:
        pass  # the rate is a nicety of the report's videos: an unreadable manifest leaves it to the shards
    return found


def _shard_fps(path: Path, wanted: set[str]) -> dict[str, float]:
    import av

    from ..data.layout import dataset_splits
    from ..data.preflight import split_shards
    from ..data.task_encoder import VIDEO_MEMBER

    found: dict[str, float] = {}
    try:
        shards = itertools.chain.from_iterable(split_shards(path, split) for split in sorted(dataset_splits(path)))
        for shard in shards:
            if len(found) == len(wanted):
                break
            if not shard.is_file():
                continue
            with tarfile.open(shard) as tar:
                for member in tar:  # headers only: the videos are not read, but for the ones asked for
                    key, _, ext = member.name.rpartition(".")
                    if ext != VIDEO_MEMBER or key not in wanted or not member.isreg():
                        continue
                    with av.open(tar.extractfile(member)) as container:
                        rate = container.streams.video[0].average_rate if container.streams.video else None
                    if rate and 0 < float(rate) < 1000:
                        found[key] = float(rate)
    except (OSError, tarfile.TarError, av.FFmpegError, UserError, ValueError):
        pass  # as above: a damaged shard is the loader's to report, not this lookup's
    return found
