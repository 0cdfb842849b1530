"""Latent statistics of a continuous tokenizer, in the files its world models normalize latents with.

The family's :attr:`~..network.TokenizerFamily.latent_stats` kind says which files (:data:`STATS_FILES`):

- ``per-frame`` (Cosmos): ``mean_std.pt`` holds ``(mean, std)``, each ``[C, T]``: per latent channel and
  latent-frame position of a clip (the first latent frame of a causal tokenizer codes one frame alone, so its
  statistics differ). A consumer reads them with ``view(C, -1)[:, :T]`` and uses ``(latent - mean) / std``.
  ``image_mean_std.pt`` holds the per-channel ``(mean, std)`` ``[C]`` of single-frame latents, for the image path
  of the same models.
- ``per-channel`` (the Wan VAEs): the consumers normalise with the base's hard-coded per-channel constants
  (:attr:`~..network.TokenizerFamily.latent_constants`), which no file changes. Cosmos-Predict2.5's
  ``Wan2pt1VAEInterface`` (``load_mean_std=True``) then normalises the result a second time with
  ``video_mean_std.pt``, a ``(mean, std)`` pair it reshapes to ``[1, C, 32, 1, 1]`` and slices to the clip's latent
  frames, and, for single frames, ``images_mean_std.pt``, reshaped to ``[1, C, 1, 1, 1]``; both are looked up
  beside its ``mean_std.pt`` path (the name replaced). Those files therefore hold the statistics of
  ``(latent - constant mean) / constant std``, written here in exactly those shapes.

:class:`LatentStats` always holds the statistics of the latent itself (a VAE's posterior mean); only the files
hold the normalised ones.
"""

from __future__ import annotations

import copy
import itertools
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..core.errors import CheckpointError, EvaluationError
from ..core.files import atomic_path
from ..core.progress import progress as progress_report
from ..core.untrusted import load_torch_file
from ..io.export import CHUNK_FRAMES
from ..network import VideoTokenizer, family_of
from ..network.family import NetworkConfig
from .clips import open_clips

Accelerate = Callable[[VideoTokenizer], Callable[[Tensor], Tensor]]
"""Turns a network into a faster ``encode`` (training.acceleration's :func:`fast_encoder`, handed down by the
commands: this layer sits below it)."""

MEAN_STD = "mean_std.pt"
IMAGE_MEAN_STD = "image_mean_std.pt"
VIDEO_MEAN_STD = "video_mean_std.pt"
"""Cosmos-Predict2.5's per channel and latent-frame statistics of a Wan latent normalised by the constants."""
IMAGES_MEAN_STD = "images_mean_std.pt"
"""Cosmos-Predict2.5's per-channel statistics of a single-frame Wan latent normalised by the constants."""
PREDICT25_POSITIONS = 32
"""Latent frames ``video_mean_std.pt`` covers: Cosmos-Predict2.5 reshapes it to ``[1, 16, 32, 1, 1]``."""
PER_FRAME = "per-frame"
"""Statistics per latent channel and latent frame, read as they are (Cosmos' ``mean_std.pt``)."""
PER_CHANNEL = "per-channel"
"""Consumers that normalise with the base's per-channel constants, and may read files on top (the Wan VAEs)."""
STATS_CLIPS = 400
"""Default clips for the statistics: two seeds then agree to 1% (median over channels and latent positions of the
mean and std differences, in units of the std; docs/benchmarks.md)."""


@dataclass(frozen=True)
class StatsFiles:
    """The files of one kind of latent statistics (a :attr:`~..network.TokenizerFamily.latent_stats` value)."""

    video: str
    """The ``(mean, std)`` per channel and latent-frame position."""
    image: str
    """The ``(mean, std)`` per channel of single-frame latents."""
    positions: Callable[[NetworkConfig], int]
    """The latent-frame positions the video file covers, for a model of this config."""
    normalized: bool = False
    """Whether the files hold the statistics of the latent normalised by the family's constants (what a consumer
    that applies the constants first divides by next), rather than of the latent itself."""
    consumer_shape: bool = False
    """Whether the tensors are stored as the consumer broadcasts them, ``[1, C, T, 1, 1]`` and ``[1, C, 1, 1, 1]``,
    rather than ``[C, T]`` and ``[C]``."""

    @property
    def names(self) -> tuple[str, str]:
        return self.video, self.image


STATS_FILES: dict[str, StatsFiles] = {
    PER_FRAME: StatsFiles(MEAN_STD, IMAGE_MEAN_STD, positions=lambda cfg: cfg.latent_frames(CHUNK_FRAMES)),
    PER_CHANNEL: StatsFiles(
        VIDEO_MEAN_STD,
        IMAGES_MEAN_STD,
        positions=lambda cfg: PREDICT25_POSITIONS,
        normalized=True,
        consumer_shape=True,
    ),
}
"""Kind of latent statistics -> the files its consumers read."""


def stats_kind(config: NetworkConfig | None) -> str:
    """The kind of latent statistics a model of ``config`` has (None: ``per-frame``, the files of the first
    family and of every folder written before there were families)."""
    return PER_FRAME if config is None else family_of(config).latent_stats


def stats_files(config: NetworkConfig | None) -> StatsFiles:
    """The files the latent statistics of a model of ``config`` go to (None: ``per-frame``)."""
    kind = stats_kind(config)
    if kind not in STATS_FILES:
        raise EvaluationError(
            f"{config.name if config else 'this model'}: its world models read {kind} latent statistics, which this "
            f"version does not compute (only {', '.join(STATS_FILES)} ones); export without latent statistics"
        )
    return STATS_FILES[kind]


def latent_constants(config: NetworkConfig | None) -> tuple[Tensor, Tensor] | None:
    """The base's per-channel ``(mean, std)`` that consumers of ``config``'s family hard-code, as ``[C]`` float
    tensors; None when its family has none, or when ``config``'s latent has another number of channels (a test
    model of another ``z_dim``: nothing hard-codes its constants)."""
    constants = None if config is None else family_of(config).latent_constants
    if constants is None or len(constants[0]) != config.latent_dim:
        return None
    mean, std = constants
    return torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)


def base_latent_stats(config: NetworkConfig) -> LatentStats | None:
    """The statistics the base's hard-coded constants stand for, the same at every latent position (what a
    decoder-only run keeps, and what a retrained encoder's are compared with); None without constants."""
    constants = latent_constants(config)
    if constants is None:
        return None
    mean, std = constants
    positions = stats_files(config).positions(config)
    return LatentStats(
        mean[:, None].expand(-1, positions).clone(),
        std[:, None].expand(-1, positions).clone(),
        mean.clone(),
        std.clone(),
        clips=0,
        kind=stats_kind(config),
        constants=constants,
    )


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
    """Of the latent itself: per channel and latent-frame position (``mean``/``std`` ``[C, T]``) and of single
    frames (``[C]``); ``kind`` and ``constants`` say how :meth:`write` stores them."""

    mean: Tensor
    std: Tensor
    image_mean: Tensor
    image_std: Tensor
    clips: int
    measured_positions: int | None = None
    """Latent frames measured from clips; positions past them carry pooled statistics (None: all measured)."""
    kind: str = PER_FRAME
    """The family's kind of statistics (:data:`STATS_FILES`): which files :meth:`write` writes."""
    constants: tuple[Tensor, Tensor] | None = field(default=None, repr=False)
    """The family's per-channel constants (:func:`latent_constants`), which files of a ``normalized`` kind are
    taken relative to."""

    def file_pairs(self) -> dict[str, tuple[Tensor, Tensor]]:
        """File name -> the ``(mean, std)`` pair it holds, as the kind's consumers read it."""
        files = STATS_FILES[self.kind]
        video, image = (self.mean, self.std), (self.image_mean, self.image_std)
        if files.normalized and self.constants is not None:
            mean, std = self.constants
            video = ((video[0] - mean[:, None]) / std[:, None], video[1] / std[:, None])
            image = ((image[0] - mean) / std, image[1] / std)
        if files.consumer_shape:
            channels = self.mean.shape[0]
            video = tuple(t.reshape(1, channels, -1, 1, 1) for t in video)
            image = tuple(t.reshape(1, channels, 1, 1, 1) for t in image)
        return {files.video: video, files.image: image}

    def write(self, folder: str | Path) -> list[Path]:
        """The kind's two files in ``folder`` (``mean_std.pt`` and ``image_mean_std.pt`` for Cosmos,
        ``video_mean_std.pt`` and ``images_mean_std.pt`` for the Wan VAEs): plain tuples of two float32 tensors,
        which load with weights_only."""
        written = []
        for name, pair in self.file_pairs().items():
            path = Path(folder) / name
            with atomic_path(path) as tmp:
                torch.save(tuple(t.float().contiguous() for t in pair), tmp)
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
    ``positions``: latent frames the statistics must cover (default: those the family's files cover,
    :attr:`StatsFiles.positions`: for Cosmos a :data:`CHUNK_FRAMES` chunk's); clips shorter than that leave the
    later positions to :meth:`Moments.extended`. ``progress`` shows the
    clips done with clips/s on stdout: a bar in a terminal, lines in a log file (:mod:`~..core.progress`).
    ``accelerate`` gives the ``encode`` to run (e.g. compiled, on GPUs)."""
    if network.is_discrete:
        raise EvaluationError(
            f"{network.config.name} is a discrete tokenizer: world models read its token indices, which have no "
            "latent statistics (none are written)"
        )
    files = stats_files(network.config)
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
    wanted = positions or files.positions(network.config)
    mean, std = video.extended(wanted)
    mean, std = mean[:, :wanted], std[:, :wanted]  # clips longer than the files cover: the first positions
    image_mean, image_std = image.mean_std()
    measured = video.mean.shape[1] if video.mean is not None else 0
    return LatentStats(
        mean,
        std,
        image_mean,
        image_std,
        seen,
        measured if measured < wanted else None,
        kind=stats_kind(network.config),
        constants=latent_constants(network.config),
    )


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


def read_latent_stats(checkpoint: str | Path, config: NetworkConfig | None = None) -> LatentStats | None:
    """The statistics beside ``checkpoint`` (a tokenizer folder, or a file in one) of a model of ``config`` (None:
    Cosmos' ``per-frame`` files): the kind's video file, and its image file when there, loaded weights-only as
    ``[C, T]`` and ``[C]`` statistics of the latent itself (files of normalised latents are taken back through
    the constants); None when there is no video file. A file that is not a pair of tensors raises a one-line
    :class:`CheckpointError`."""
    folder = stats_folder(checkpoint)
    files = stats_files(config)
    if not (folder / files.video).is_file():
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

    mean, std = pair(files.video)
    if files.consumer_shape and mean.dim() == 5:  # [1, C, T, 1, 1]
        mean, std = mean[0, :, :, 0, 0], std[0, :, :, 0, 0]
    channels = mean.shape[0] if mean.dim() > 0 else 1
    mean, std = mean.reshape(channels, -1), std.reshape(channels, -1)
    if (folder / files.image).is_file():
        image_mean, image_std = (t.reshape(-1) for t in pair(files.image))
    else:
        image_mean, image_std = mean[:, 0], std[:, 0]
    kind, constants = stats_kind(config), latent_constants(config)
    if files.normalized and constants is not None:
        if mean.shape[0] != constants[0].shape[0]:
            raise CheckpointError(
                f"{folder / files.video} holds statistics of {mean.shape[0]} latent channels, but "
                f"{config.name if config else 'the model'} has {constants[0].shape[0]}"
            )
        base_mean, base_std = constants
        mean, std = mean * base_std[:, None] + base_mean[:, None], std * base_std[:, None]
        image_mean, image_std = image_mean * base_std + base_mean, image_std * base_std
    return LatentStats(mean, std, image_mean, image_std, clips=0, kind=kind, constants=constants)


def stats_folder(checkpoint: str | Path) -> Path:
    """Where the statistics of ``checkpoint`` live: the folder itself, or the folder of a file."""
    path = Path(checkpoint).expanduser()
    return path if path.is_dir() else path.parent


def copy_latent_stats(source: str | Path, out: str | Path, config: NetworkConfig | None = None) -> list[Path]:
    """Copy the statistics files of a model of ``config`` (None: Cosmos' ``per-frame`` ones) from the folder
    ``source`` into ``out`` unchanged (a tokenizer whose encoder did not train keeps its latent space, so the
    base's statistics stay exact); returns the copies."""
    copied = []
    for name in stats_files(config).names:
        if (Path(source) / name).is_file():
            with atomic_path(Path(out) / name) as tmp:
                shutil.copyfile(Path(source) / name, tmp)
            copied.append(Path(out) / name)
    return copied


def carry_base_stats(
    trainable: str, base: str | Path | None, out: str | Path, config: NetworkConfig | None = None
) -> list[Path]:
    """Copy the base's statistics files (those of ``config``'s kind, None: ``per-frame``) into the export ``out``
    when only the decoder trained (``trainable`` ``decoder``: the latent space did not move) and the base's folder
    has them; returns the copies (none otherwise)."""
    if trainable != "decoder" or not base or read_latent_stats(base, config) is None:
        return []
    return copy_latent_stats(stats_folder(base), out, config)


def files_note(config: NetworkConfig) -> str:
    """Where the statistics files of ``config``'s kind go and who reads them (the model card's row ends with it)."""
    files = stats_files(config)
    names = f"`{files.video}` and `{files.image}`"
    if files.normalized and latent_constants(config) is not None:
        return (
            f"{names} hold those of the latent normalised by the base's constants, as Cosmos-Predict2.5 reads them "
            "(`load_mean_std=True`: looked up beside its `mean_std_path`)"
        )
    return f"in {names}"


def kept_base_stats(trainable: str, config: NetworkConfig) -> str | None:
    """What a decoder-only run of a family with hard-coded constants keeps, in one line (None otherwise): its
    latent space did not move, so the constants every consumer normalises with stay exact and nothing is
    measured."""
    if trainable != "decoder" or latent_constants(config) is None:
        return None
    return (
        f"the encoder did not train: the base's {config.latent_dim} per-channel latent constants, which "
        f"the {family_of(config).name} family's consumers hard-code, stay exact (nothing measured)"
    )
