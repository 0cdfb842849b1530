"""Energon TaskEncoder: from a raw ``<key>.mp4`` webdataset sample to a training clip.

Decodes only the frames a clip needs (seeking by frame index), at a uniformly random
start, optionally resized during decoding, randomly cropped (only the crop is converted to
RGB, see :mod:`.clip_decode`) and flipped, normalised to [-1, 1] and cast to bf16.
Unusable videos are skipped, and the skip (key and reason) travels with the next batch so
the trainer can count, log and bound them. So are the samples of a tar shard that is cut short
or damaged: energon's reader raises for them (``tarfile.ReadError`` and the like) and would end
the stream; the encoder wraps that reader so such a sample, and every later one of its shard, is
a named skip instead.
"""

from __future__ import annotations

import math
import random
import struct
import tarfile
import warnings
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import av
import torch
import webdataset
from megatron.energon import (
    Cooker,
    DefaultTaskEncoder,
    Sample,
    SampleDecoder,
    SkipSample,
    WorkerConfig,
    basic_sample_keys,
    edataclass,
    stateless,
)
from megatron.energon.av import AVDecoder, AVWebdatasetDecoder

from ..core.errors import DataError
from .batch import (
    ASPECT_RATIO,
    CLIP_FRAMES,
    CLIP_SIZE,
    DAMAGED_SHARD,
    IN_DAMAGED_SHARD,
    KEYS,
    LOSS_MASK,
    SKIPPED,
    VIDEO,
)
from .clip_decode import Box, ClipReader
from .clip_start import CLIP_STARTS, DECODERS, keyframe_start, uniform_start

# Bucket name -> width / height. One pixel budget (crop_height x crop_width) for all.
ASPECT_BUCKETS: dict[str, float] = {"1:1": 1.0, "4:3": 4 / 3, "3:4": 3 / 4, "16:9": 16 / 9, "9:16": 9 / 16}

# What a damaged or odd file raises from PyAV/energon while we read it.
_DECODE_ERRORS = (
    av.FFmpegError,
    OSError,
    EOFError,
    ValueError,
    RuntimeError,
    AssertionError,
    IndexError,
    ZeroDivisionError,
)


# What energon's tar reader raises for a shard that is cut short or damaged where a sample lies.
_SHARD_ERRORS = (tarfile.TarError, OSError, EOFError, ValueError, IndexError, struct.error)
_SHARD_FIX = "re-create the shard (python -m data_tools make-shards) or restore the file"


class DamagedShardGuard:
    """energon's tar reader of one dataset, where a sample that cannot be read from its shard is
    skipped (``None``, which energon's sample loader passes over) instead of raised, and so is every
    later sample of that shard, without reading it again.

    ``note`` gets one ``"<where>: <reason>"`` line per skipped sample: the first failure in a shard
    names it and its lost samples (reason starting with :data:`~.batch.DAMAGED_SHARD`), later ones
    are ``"<shard>#<n>: "`` + :data:`~.batch.IN_DAMAGED_SHARD`.
    """

    def __init__(self, reader: Any, note: Callable[[str], None]) -> None:
        self._reader = reader
        self._note = note
        self._first_lost: dict[int, int] = {}  # shard number -> first sample (in the shard) that failed
        self._skips_in_a_row = 0

    def __getitem__(self, index: int) -> Any:
        shard, position = self._locate(index)
        info = self._reader.shard_infos[shard]
        first_lost = self._first_lost.get(shard)
        if first_lost is not None and position >= first_lost:
            self._skipped(f"{info.name}#{position + 1}: {IN_DAMAGED_SHARD} (from sample {first_lost + 1} on)")
            return None
        try:
            sample = self._reader[index]
        except _SHARD_ERRORS as err:
            self._first_lost[shard] = position if first_lost is None else min(first_lost, position)
            self._forget_open_file(shard)
            reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            self._skipped(
                f"{info.name}: {DAMAGED_SHARD} ({reason}): sample {position + 1} of {info.count} cannot be read, so "
                f"samples {position + 1} to {info.count} of it are skipped; {_SHARD_FIX}"
            )
            return None
        self._skips_in_a_row = 0
        return sample

    def _skipped(self, entry: str) -> None:
        self._note(entry)
        self._skips_in_a_row += 1
        # A loader worker whose whole share is lost would loop over it for ever, yielding nothing.
        if self._skips_in_a_row > len(self._reader):
            names = sorted(self._reader.shard_infos[shard].name for shard in self._first_lost)
            raise DataError(
                f"every sample this data loader worker reads lies in the damaged part of tar shards "
                f"({', '.join(names[:5])}): there is nothing left for it to train on; {_SHARD_FIX}"
            )

    def _locate(self, index: int) -> tuple[int, int]:
        cumulative = self._reader.shard_count_cumsum
        shard = bisect_right(cumulative, index) - 1
        return shard, index - cumulative[shard]

    def _forget_open_file(self, shard: int) -> None:
        # A later read of the good part opens the file afresh rather than trusting a failed handle.
        tar_id = self._reader.shard_tar_file_idxs[shard]
        tar = self._reader.itar_files_cache.pop(tar_id, None)
        if tar is not None:
            tar.fileobj.close()
            tar.close()

    def __len__(self) -> int:
        return len(self._reader)

    def __str__(self) -> str:
        return f"DamagedShardGuard({self._reader})"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_reader":  # pickling looks these up before _reader is set
            raise AttributeError(name)
        return getattr(self._reader, name)


def guard_damaged_shards(dataset: Any, note: Callable[[str], None]) -> int:
    """Wrap the tar readers under energon's built ``dataset`` in :class:`DamagedShardGuard`; returns
    how many were wrapped (0 when this energon builds its datasets differently)."""
    wrapped, node, seen = 0, dataset, set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        readers = getattr(node, "join_readers", None)
        if readers is not None:
            guarded = [
                DamagedShardGuard(r, note) if hasattr(r, "shard_count_cumsum") and hasattr(r, "shard_infos") else r
                for r in readers
            ]
            wrapped += sum(isinstance(r, DamagedShardGuard) for r in guarded)
            node.join_readers = guarded
            break
        node = getattr(node, "dataset", None)
    return wrapped


@dataclass(frozen=True)
class ClipSpec:
    """The clip every sample is turned into."""

    frames: int = CLIP_FRAMES
    height: int = CLIP_SIZE
    width: int = CLIP_SIZE
    resize_short_side: int | None = None
    """Resize frames so their short side has this length before cropping (during decode)."""
    hflip: bool = False
    """Flip half of the clips horizontally."""
    start: str = "uniform"
    """Where random clips start: ``uniform`` or ``keyframe`` (:mod:`.clip_start`)."""
    keyframe_window: int = 4
    """With ``start="keyframe"``: the frames after a keyframe a clip may start at."""
    decode: str = "cpu"
    """``cpu`` or ``gpu`` (NVDEC): where the video is decoded."""
    aspect_buckets: bool = False
    """Crop each clip at the bucket (1:1, 4:3, 3:4, 16:9, 9:16) nearest its video's aspect ratio,
    all at the pixel budget height x width; every batch holds one bucket."""
    multiple_of: int = 16
    """Bucket sides are rounded to this (the tokenizers' spatial compression)."""
    random_crop: bool = True
    """False: the middle frames and the centre crop (deterministic validation)."""
    crops_per_decode: int = 1
    """Random crops cut from each decoded stretch of frames, each its own clip (same frames, own offset and
    flip): one decode pays for all of them. Random crops only (validation takes one centre crop)."""

    def __post_init__(self) -> None:
        crops = self.crops_per_decode
        if isinstance(crops, bool) or not isinstance(crops, int) or crops < 1:
            raise ValueError(f"ClipSpec.crops_per_decode={crops!r} must be an integer >= 1")
        if self.crops_per_decode > 1 and not self.random_crop:
            raise ValueError("ClipSpec.crops_per_decode > 1 needs random crops (random_crop=False cuts one)")
        if self.start not in CLIP_STARTS:
            raise ValueError(f"ClipSpec.start={self.start!r} must be one of {', '.join(CLIP_STARTS)}")
        if self.decode not in DECODERS:
            raise ValueError(f"ClipSpec.decode={self.decode!r} must be one of {', '.join(DECODERS)}")
        if self.keyframe_window < 0:
            raise ValueError(f"ClipSpec.keyframe_window={self.keyframe_window} must be >= 0")

    def bucket_size(self, name: str) -> tuple[int, int]:
        """(height, width) of an aspect bucket at this spec's pixel budget."""
        ratio = ASPECT_BUCKETS[name]
        area = self.height * self.width
        m = self.multiple_of
        height = max(m, round(math.sqrt(area / ratio) / m) * m)
        width = max(m, round(math.sqrt(area * ratio) / m) * m)
        return height, width


def nearest_bucket(width: int, height: int) -> str:
    """The aspect bucket closest (in log ratio) to a ``width x height`` frame."""
    ratio = math.log(width / height)
    return min(ASPECT_BUCKETS, key=lambda name: abs(math.log(ASPECT_BUCKETS[name]) - ratio))


@edataclass
class RawVideo(Sample):
    """A webdataset sample with its video still encoded (decoded lazily, frames on demand)."""

    video: AVDecoder


@edataclass
class Clip(Sample):
    video: torch.Tensor  # [N, 3, T, H, W] bf16 in [-1, 1]: the N crops of one decode (ClipSpec.crops_per_decode)
    loss_mask: torch.Tensor  # [1, T, H, W] bf16, the same for each crop
    aspect_ratio: float
    bucket: str
    skipped: list[str]


VIDEO_MEMBER = "mp4"
"""The one member of a sample that is decoded (our shards store ``<key>.mp4``)."""


class VideoOnlyDecoder(SampleDecoder):
    """energon's sample decoder cut down to :data:`VIDEO_MEMBER`: every other member of a sample stays the bytes
    it is and is never looked at.

    energon's default decoder runs webdataset's handlers on every member, and they unpickle ``.pkl``,
    ``.pickle`` and ``.pyd`` members and ``torch.load`` ``.pth`` members with ``weights_only=False``: a shard
    holding ``<key>.pkl`` next to ``<key>.mp4`` would run whatever code that file plants at every read. None of
    those handlers is even built: ``SampleDecoder.__init__`` would build them into ``_decoder``, which its
    ``decode`` would reach, so it is not called.
    """

    def __init__(self) -> None:
        """The video handler alone (see the class)."""
        # The config SampleDecoder.__init__(av_decode="AVDecoder") sets, kept: energon reports it with the
        # dataset's config, which should not change with this.
        self._config = {
            "image_decode": "torchrgb",
            "av_decode": "AVDecoder",
            "video_decode_audio": False,
            "guess_content": False,
        }
        # No pre/post handlers: the defaults would gunzip members and hand them to the pickle handlers.
        self._decoder = webdataset.autodecode.Decoder(
            [AVWebdatasetDecoder(video_decode_audio=False, av_decode="AVDecoder")],
            pre=[],
            post=[],
            only=[VIDEO_MEMBER],
        )

    def __call__(self, sample: dict) -> dict:
        """The sample with its video member as a lazy :class:`AVDecoder`, every other member as raw bytes."""
        return self._decoder(sample)

    def config(self) -> dict:
        """energon's description of the decoder (logged), naming the only member it decodes."""
        return {**super().config(), "decoded_members": [VIDEO_MEMBER]}


@stateless
def cook_video(raw: dict[str, Any]) -> RawVideo:
    """Crude webdataset sample -> :class:`RawVideo` (our shards store ``<key>.mp4``)."""
    if VIDEO_MEMBER not in raw:
        fields = sorted(k for k in raw if not k.startswith("__"))
        raise SkipSample(f"sample {raw.get('__key__')} has no .{VIDEO_MEMBER} member (has {fields})")
    return RawVideo(**basic_sample_keys(raw), video=raw[VIDEO_MEMBER])


class VideoClipTaskEncoder(DefaultTaskEncoder[RawVideo, Clip, dict, dict]):
    """Crops, normalises and batches clips; batches are plain dicts (see :mod:`.batch`)."""

    cookers = [Cooker(cook_video)]
    decoder = VideoOnlyDecoder()

    def __init__(self, spec: ClipSpec) -> None:
        super().__init__()
        self.spec = spec
        self._skipped: list[str] = []  # per worker process; emptied into the next batch

    def _target(self, width: int, height: int) -> tuple[str, int, int, int, int]:
        """(bucket, crop h, crop w, decode w, decode h) for a ``width x height`` video."""
        spec = self.spec
        bucket = nearest_bucket(width, height) if spec.aspect_buckets else "fixed"
        crop_h, crop_w = spec.bucket_size(bucket) if spec.aspect_buckets else (spec.height, spec.width)
        scale = 1.0
        if spec.resize_short_side:
            scale = spec.resize_short_side / min(width, height)
        if spec.aspect_buckets:  # scale so the frame covers the bucket's crop
            scale = max(scale if spec.resize_short_side else 0.0, crop_h / height, crop_w / width)
        if scale == 1.0:
            return bucket, crop_h, crop_w, width, height
        # even sizes: chroma subsampling in the scaler wants them
        out_w = max(crop_w, 2 * math.ceil(width * scale / 2))
        out_h = max(crop_h, 2 * math.ceil(height * scale / 2))
        return bucket, crop_h, crop_w, out_w, out_h

    def build_cook_crude_sample(self, dataset: Any, **kwargs: Any) -> Any:
        """energon's hook for crude datasets; first makes damaged tar shards skip, not end the stream."""
        if not guard_damaged_shards(dataset, self._note_skipped):
            warnings.warn(
                "this megatron-energon builds its datasets differently: a damaged tar shard will stop training "
                "instead of being skipped (python -m data_tools check finds such shards)",
                stacklevel=2,
            )
        return super().build_cook_crude_sample(dataset, **kwargs)

    def _note_skipped(self, entry: str) -> None:
        self._skipped.append(entry)

    def _skip(self, sample: RawVideo, reason: str) -> None:
        sources = getattr(sample, "__sources__", None) or ()
        where = f"{sources[0].shard_name}:{sample.__key__}" if sources else sample.__key__
        self._skipped.append(f"{where}: {reason}")
        raise SkipSample(reason)

    def take_skipped(self) -> list[str]:
        """The ``"<key>: <reason>"`` skips noted in this process since the last call (which empties them):
        each batch carries the skips before it; a reader of a finished pass takes the rest from here."""
        skipped, self._skipped = self._skipped, []
        return skipped

    def _rng(self) -> random.Random:
        # Our own generator from (worker seed, sample index): deterministic under a seed and
        # restorable on resume. (energon's restore_seeds caches the worker seed per process.)
        worker = WorkerConfig.active_worker_config
        seed = worker.worker_seed() if worker is not None else 0
        return random.Random(f"{seed}/{self.current_sample_index}")

    @stateless
    def encode_sample(self, sample: RawVideo) -> Clip:
        # One sample per decode, holding its spec.crops_per_decode crops (batch() lays them out as clips): the
        # loader's state stays one position per video, so a resume is exact. Every random draw comes before the
        # decode, in the order one crop draws them (start, offset, flip): one crop per decode gives the clips it
        # gave before there was a choice.
        spec = self.spec
        rng = self._rng()
        try:
            reader = ClipReader(sample.video, gpu=spec.decode == "gpu")
        except _DECODE_ERRORS as err:
            self._skip(sample, f"unreadable video ({type(err).__name__}: {err})")
        with reader:
            n_frames, width, height = reader.frames, reader.width, reader.height
            if not n_frames or not width or not height:
                self._skip(sample, "no video stream")
            if n_frames < spec.frames:
                self._skip(sample, f"{n_frames} frames, fewer than the {spec.frames} a clip needs")
            bucket, crop_h, crop_w, out_w, out_h = self._target(width, height)
            if out_w < crop_w or out_h < crop_h:
                self._skip(sample, f"frames {out_w}x{out_h} are smaller than the {crop_w}x{crop_h} crop")

            # Every valid start and offset is reachable: randint is inclusive at both ends.
            if spec.random_crop:
                if spec.start == "keyframe":
                    start = keyframe_start(reader.keyframes, n_frames, spec.frames, spec.keyframe_window, rng)
                else:
                    start = uniform_start(n_frames, spec.frames, rng)
                boxes = [
                    Box(rng.randint(0, out_h - crop_h), rng.randint(0, out_w - crop_w), crop_h, crop_w)
                    for _ in range(spec.crops_per_decode)
                ]
            else:
                start = (n_frames - spec.frames) // 2
                boxes = [Box((out_h - crop_h) // 2, (out_w - crop_w) // 2, crop_h, crop_w)]
            flips = [spec.hflip and rng.random() < 0.5 for _ in boxes]
            size = (out_w, out_h) if (out_w, out_h) != (width, height) else None
            try:
                videos = reader.read_crops(start, spec.frames, boxes, size, torch.bfloat16)
            except _DECODE_ERRORS as err:
                self._skip(sample, f"decoding failed ({type(err).__name__}: {err})")
        decoded = videos[0].shape[1]
        if decoded < spec.frames:
            self._skip(sample, f"decoded {decoded} of {spec.frames} frames from {start} (truncated file?)")
        videos = [video.flip(-1) if flip else video for video, flip in zip(videos, flips, strict=True)]
        crops = videos[0][None] if len(videos) == 1 else torch.stack(videos)
        # One stored element: cheap to pass from worker processes; batch() stacks it to full size.
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16).expand(1, spec.frames, crop_h, crop_w)
        skipped = self.take_skipped()
        return Clip.derive_from(
            sample, video=crops, loss_mask=mask, aspect_ratio=crop_w / crop_h, bucket=bucket, skipped=skipped
        )

    def batch_group_criterion(self, sample: Clip) -> tuple[str, None]:
        # One bucket per batch; the batch size itself is the dataset's.
        return sample.bucket, None

    @stateless
    def batch(self, samples: list[Clip]) -> dict[str, Any]:
        first = samples[0]
        clips = sum(len(s.video) for s in samples)
        video = torch.empty((clips, *first.video.shape[1:]), dtype=first.video.dtype)
        if torch.utils.data.get_worker_info() is not None:
            # Stacked straight into shared memory: the batch then crosses to the trainer's
            # process without the extra copy the worker queue would otherwise make.
            video.share_memory_()
        torch.cat([s.video for s in samples], out=video)
        if all(s.loss_mask.stride() == (0, 0, 0, 0) for s in samples):  # all ones, one stored element
            mask = first.loss_mask[None].expand(clips, *first.loss_mask.shape)
        else:
            mask = torch.stack([s.loss_mask for s in samples for _ in s.video])
        return {
            VIDEO: video,
            LOSS_MASK: mask,
            ASPECT_RATIO: torch.tensor([s.aspect_ratio for s in samples for _ in s.video]),
            KEYS: [s.__key__ for s in samples for _ in s.video],
            SKIPPED: [reason for s in samples for reason in s.skipped],
        }

    @stateless
    def encode_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch  # already a plain dict: Lightning cannot move energon's frozen Batch objects
