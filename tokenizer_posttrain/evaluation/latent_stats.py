"""Latent statistics of a continuous tokenizer, in the files Cosmos world models normalize latents with.

``mean_std.pt`` holds ``(mean, std)``, each ``[C, T]``: per latent channel and latent-frame position of a clip
(the first latent frame of a causal tokenizer codes one frame alone, so its statistics differ). A consumer
reads them with ``view(C, -1)[:, :T]`` and uses ``(latent - mean) / std``. ``image_mean_std.pt`` holds the
per-channel ``(mean, std)`` ``[C]`` of single-frame latents, for the image path of the same models.
"""

from __future__ import annotations

import copy
import itertools
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..core.errors import CheckpointError, EvaluationError
from ..core.files import atomic_path
from ..core.progress import progress as progress_report
from ..core.untrusted import load_torch_file
from ..io.export import CHUNK_FRAMES
from ..network import VideoTokenizer, family_of
from .clips import open_clips

Accelerate = Callable[[VideoTokenizer], Callable[[Tensor], Tensor]]
"""Turns a network into a faster ``encode`` (training.acceleration's :func:`fast_encoder`, handed down by the
commands: this layer sits below it)."""

MEAN_STD = "mean_std.pt"
IMAGE_MEAN_STD = "image_mean_std.pt"
STATS_CLIPS = 400
"""Default clips for the statistics: two seeds then agree to 1% (median over channels and latent positions of the
mean and std differences, in units of the std; docs/benchmarks.md)."""


class Moments:
    """Mean and variance over every axis but ``keep`` (the channel and position axes), merged batch by batch in
    fp64 with Chan's update, so millions of latent values lose no precision to a running sum of squares."""

    def __init__(self) -> None:
        self.count = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None

    def add(self, values: Tensor, reduce: tuple[int, ...]) -> None:
        """Take in ``values``, reduced over the axes ``reduce``."""
        values = values.double()
        n = 1
        for dim in reduce:
            n *= values.shape[dim]
        mean = values.mean(dim=reduce)
        m2 = ((values - values.mean(dim=reduce, keepdim=True)) ** 2).sum(dim=reduce)
        self._combine(n, mean, m2)

    def merge(self, other: Moments) -> None:
        """Take in the values ``other`` took in."""
        if other.mean is not None and other.m2 is not None:
            self._combine(other.count, other.mean, other.m2)

    def _combine(self, n: int, mean: Tensor, m2: Tensor) -> None:
        if self.mean is None or self.m2 is None:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * n / total)
        self.count = total

    def mean_std(self) -> tuple[Tensor, Tensor]:
        """Float32 mean and (population) standard deviation."""
        if self.mean is None or self.m2 is None:
            raise EvaluationError("no latent was added to the statistics")
        return self.mean.float(), (self.m2 / self.count).sqrt().float()

    def extended(self, positions: int) -> tuple[Tensor, Tensor]:
        """:meth:`mean_std` of moments kept per ``[C, T]``, extended to ``positions`` latent frames: positions past
        the measured ones get the pooled statistics of every measured position but the first (which codes one
        frame alone); with a single measured position, its own."""
        mean, std = self.mean_std()
        measured = mean.shape[1]
        if measured >= positions:
            return mean, std
        assert self.mean is not None and self.m2 is not None
        later = slice(1, None) if measured > 1 else slice(0, 1)
        means, m2 = self.mean[:, later], self.m2[:, later]
        pooled = means.mean(dim=1)
        # Every position saw the same number of values: the pooled m2 is the sum of theirs plus the spread of
        # their means.
        variance = (m2.sum(dim=1) + self.count * ((means - pooled[:, None]) ** 2).sum(dim=1)) / (
            self.count * means.shape[1]
        )
        fill = positions - measured
        return (
            torch.cat([mean, pooled.float()[:, None].expand(-1, fill)], dim=1),
            torch.cat([std, variance.sqrt().float()[:, None].expand(-1, fill)], dim=1),
        )


@dataclass
class LatentStats:
    """Per channel and latent-frame position (``mean``/``std`` ``[C, T]``) and of single frames (``[C]``)."""

    mean: Tensor
    std: Tensor
    image_mean: Tensor
    image_std: Tensor
    clips: int
    measured_positions: int | None = None
    """Latent frames measured from clips; positions past them carry pooled statistics (None: all measured)."""

    def write(self, folder: str | Path) -> list[Path]:
        """``mean_std.pt`` and ``image_mean_std.pt`` in ``folder`` (plain tensor tuples: load with weights_only)."""
        written = []
        for name, pair in ((MEAN_STD, (self.mean, self.std)), (IMAGE_MEAN_STD, (self.image_mean, self.image_std))):
            path = Path(folder) / name
            with atomic_path(path) as tmp:
                torch.save(tuple(t.contiguous() for t in pair), tmp)
            written.append(path)
        return written


@torch.no_grad()
def latent_statistics(
    network: VideoTokenizer,
    clips: Iterable[Tensor],
    max_clips: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_size: int = 1,
    progress: bool = False,
    positions: int | None = None,
    accelerate: Accelerate | None = None,
) -> LatentStats:
    """Encode up to ``max_clips`` clips (``[3, T, H, W]`` in [-1, 1], one shape) and their first frames, and
    return the latent statistics. ``dtype`` is the encoder's compute dtype (bf16 on GPUs: inference speed).
    ``positions``: latent frames the statistics must cover (default: those of a :data:`CHUNK_FRAMES` chunk);
    clips shorter than that chunk leave the later positions to :meth:`Moments.extended`. ``progress`` shows the
    clips done with clips/s on stdout: a bar in a terminal, lines in a log file (:mod:`~..core.progress`).
    ``accelerate`` gives the ``encode`` to run (e.g. compiled, on GPUs)."""
    if network.is_discrete:
        raise EvaluationError(
            f"{network.config.name} is a discrete tokenizer: world models read its token indices, which have no "
            "latent statistics (none are written)"
        )
    kind = family_of(network.config).latent_stats
    if kind != PER_FRAME:
        raise EvaluationError(
            f"{network.config.name}: its world models read {kind} latent statistics, which this version does not "
            f"compute (only {PER_FRAME} ones, as Cosmos world models read); export without latent statistics"
        )
    # A copy: a cast of the caller's network to bf16 would round the weights it goes on to export.
    net = copy.deepcopy(network).to(device, dtype).eval()
    encode = accelerate(net) if accelerate is not None else net.latent
    video, image = Moments(), Moments()
    seen, batch = 0, []
    bar = progress_report("latent statistics", max_clips, "clips", enabled=progress)

    def flush() -> None:
        x = torch.stack(batch).to(dtype)
        video.add(encode(x), reduce=(0, 3, 4))  # [B, C, T, h, w] -> per (C, T)
        image.add(encode(x[:, :, :1]), reduce=(0, 2, 3, 4))  # single frames -> per C
        batch.clear()

    with bar:
        for clip in clips:
            # Each clip to the device as it comes (in the loader's dtype): the host does no stacking or casting.
            batch.append(clip.to(device, non_blocking=True))
            seen += 1
            if len(batch) == batch_size:
                flush()
                bar.update(seen)
            if seen == max_clips:
                break
        if batch:
            flush()
            bar.update(seen)
    if seen == 0:
        raise EvaluationError("no usable clip for the latent statistics (see the skipped videos above)")
    wanted = positions or network.config.latent_frames(CHUNK_FRAMES)
    mean, std = video.extended(wanted)
    image_mean, image_std = image.mean_std()
    measured = video.mean.shape[1] if video.mean is not None else 0
    return LatentStats(mean, std, image_mean, image_std, seen, measured if measured < wanted else None)


PER_FRAME = "per-frame"
"""The statistics computed here: a mean and std per latent channel and latent frame (Cosmos' ``mean_std.pt``)."""
_PASSES = 1_000_000
"""Passes over the dataset one seed may make: pass ``n`` of seed ``s`` draws from ``s * _PASSES + n``, so no two
seeds share a draw."""


def default_stats_workers() -> int:
    """Decoding processes for the statistics: the encoder outruns one decoding process on a GPU, not on a CPU."""
    return min(8, os.cpu_count() or 1) if torch.cuda.is_available() else 0


def dataset_latent_stats(
    network: VideoTokenizer,
    data: str | Path,
    clips: int,
    size: int,
    frames: int = CHUNK_FRAMES,
    fallback_frames: int | None = None,
    resize_short_side: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
    workers: int = 0,
    accelerate: Accelerate | None = None,
    seed: int = 0,
) -> LatentStats:
    """:func:`latent_statistics` of ``clips`` clips of the energon dataset ``data`` (its train split, else val),
    on the GPU in bf16 when there is one. Each clip is ``frames`` frames from a random start, cropped to ``size``
    at a random place (after resizing the short side to ``resize_short_side``), drawn from ``seed``; passes over
    the videos repeat (with new draws) until ``clips`` are encoded. When no video is long enough for ``frames``
    and ``fallback_frames`` is given, clips of that length instead (the positions past them pooled, see
    :meth:`Moments.extended`); what was skipped or shortened is printed. ``workers``: decoding processes (see
    :func:`~.clips.open_clips`); ``accelerate``: see :func:`latent_statistics`, used on GPUs only."""
    cuda = torch.cuda.is_available()

    def passes(length: int, skipped: list[str]) -> Iterator[Tensor]:
        for n in itertools.count():
            _, stream = open_clips(
                str(data),
                length,
                size,
                size,
                resize_short_side,
                skipped if n == 0 else [],  # the same videos skip in every pass
                prefer="train",
                workers=workers,
                seed=seed * _PASSES + n,
                float32=False,
            )
            found = 0
            for _, clip in stream:
                found += 1
                yield clip
            if not found:
                return

    def measure(length: int) -> tuple[LatentStats | None, list[str]]:
        skipped: list[str] = []
        try:
            stats = latent_statistics(
                network,
                passes(length, skipped),
                clips,
                device="cuda" if cuda else "cpu",
                dtype=torch.bfloat16 if cuda else torch.float32,
                batch_size=batch_size,
                progress=progress,
                accelerate=accelerate if cuda else None,
            )
        except EvaluationError:  # no usable clip of this length
            return None, skipped
        return stats, skipped

    length = frames
    stats, skipped = measure(length)
    if stats is None and fallback_frames and fallback_frames != frames:
        length = fallback_frames
        stats, skipped = measure(length)
        if stats is not None:
            print(f"latent statistics: no video has {frames} frames, measured on {length}-frame clips", flush=True)
    if stats is None:
        why = "; ".join(skipped[:3]) or "the dataset holds no videos"
        raise EvaluationError(f"no usable {length}x{size}x{size} clip in {data} for the latent statistics: {why}")
    if skipped:
        print(f"latent statistics: skipped {len(skipped)} videos (first: {skipped[0]})", flush=True)
    if stats.measured_positions is not None:
        print(
            f"latent statistics: latent frames {stats.measured_positions} to {stats.mean.shape[1] - 1} carry the "
            "pooled statistics of the measured ones",
            flush=True,
        )
    return stats


def read_latent_stats(checkpoint: str | Path) -> LatentStats | None:
    """The statistics beside ``checkpoint`` (a tokenizer folder, or a file in one): ``mean_std.pt``, and
    ``image_mean_std.pt`` when there, loaded weights-only as ``[C, T]`` and ``[C]``; None when there is no
    ``mean_std.pt``. A file that is not a pair of tensors raises a one-line :class:`CheckpointError`."""
    folder = stats_folder(checkpoint)
    if not (folder / MEAN_STD).is_file():
        return None

    def pair(name: str) -> tuple[Tensor, Tensor]:
        value = load_torch_file(folder / name)
        if not (isinstance(value, tuple | list) and len(value) == 2 and all(isinstance(t, Tensor) for t in value)):
            raise CheckpointError(f"{folder / name} does not hold a (mean, std) pair of tensors")
        mean, std = (t.float() for t in value)
        if mean.shape != std.shape:
            raise CheckpointError(f"{folder / name}: mean {tuple(mean.shape)} and std {tuple(std.shape)} differ")
        if mean.numel() == 0:
            raise CheckpointError(f"{folder / name} holds empty statistics: compute them again or remove the file")
        return mean, std

    mean, std = pair(MEAN_STD)
    channels = mean.shape[0] if mean.dim() > 0 else 1
    mean, std = mean.reshape(channels, -1), std.reshape(channels, -1)
    image_mean, image_std = pair(IMAGE_MEAN_STD) if (folder / IMAGE_MEAN_STD).is_file() else (mean[:, 0], std[:, 0])
    return LatentStats(mean, std, image_mean.reshape(-1), image_std.reshape(-1), clips=0)


def stats_folder(checkpoint: str | Path) -> Path:
    """Where the statistics of ``checkpoint`` live: the folder itself, or the folder of a file."""
    path = Path(checkpoint).expanduser()
    return path if path.is_dir() else path.parent


def copy_latent_stats(source: str | Path, out: str | Path) -> list[Path]:
    """Copy the statistics files of the folder ``source`` into ``out`` unchanged (a tokenizer whose encoder did
    not train keeps its latent space, so the base's statistics stay exact); returns the copies."""
    copied = []
    for name in (MEAN_STD, IMAGE_MEAN_STD):
        if (Path(source) / name).is_file():
            with atomic_path(Path(out) / name) as tmp:
                shutil.copyfile(Path(source) / name, tmp)
            copied.append(Path(out) / name)
    return copied


def carry_base_stats(trainable: str, base: str | Path | None, out: str | Path) -> list[Path]:
    """Copy the base's statistics into the export ``out`` when only the decoder trained (``trainable``
    ``decoder``: the latent space did not move) and the base's folder has them; returns the copies (none
    otherwise)."""
    if trainable != "decoder" or not base or read_latent_stats(base) is None:
        return []
    return copy_latent_stats(stats_folder(base), out)
