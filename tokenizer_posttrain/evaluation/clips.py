"""Clips of an energon dataset for evaluation and latent statistics: the trainer's own loaders, one pass."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

from torch import Tensor

from ..core.errors import EvaluationError


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
        raise EvaluationError(
            f"{path} is not an energon dataset (no .nv-meta folder); make one from a folder of videos with "
            f"`python -m data_tools make-shards {path} OUT --val-fraction 0.05` (or `prepare` for tar shards)"
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
