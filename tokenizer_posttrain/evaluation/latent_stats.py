"""Latent statistics of a continuous tokenizer, in the files Cosmos world models normalize latents with.

``mean_std.pt`` holds ``(mean, std)``, each ``[C, T]``: per latent channel and latent-frame position of a clip
(the first latent frame of a causal tokenizer codes one frame alone, so its statistics differ). A consumer
reads them with ``view(C, -1)[:, :T]`` and uses ``(latent - mean) / std``. ``image_mean_std.pt`` holds the
per-channel ``(mean, std)`` ``[C]`` of single-frame latents, for the image path of the same models.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..core.errors import EvaluationError
from ..core.files import atomic_path
from ..network.tokenizer import CausalVideoTokenizer

MEAN_STD = "mean_std.pt"
IMAGE_MEAN_STD = "image_mean_std.pt"


class Moments:
    """Mean and variance over every axis but ``keep`` (the channel and position axes), merged batch by batch in
    fp64 with Chan's update, so millions of latent values lose no precision to a running sum of squares."""

    def __init__(self) -> None:
        self.count = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None

    def add(self, values: Tensor, reduce: tuple[int, ...]) -> None:
        values = values.double()
        n = 1
        for dim in reduce:
            n *= values.shape[dim]
        mean = values.mean(dim=reduce)
        m2 = ((values - values.mean(dim=reduce, keepdim=True)) ** 2).sum(dim=reduce)
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


@dataclass
class LatentStats:
    """Per channel and latent-frame position (``mean``/``std`` ``[C, T]``) and of single frames (``[C]``)."""

    mean: Tensor
    std: Tensor
    image_mean: Tensor
    image_std: Tensor
    clips: int

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
    network: CausalVideoTokenizer,
    clips: Iterable[Tensor],
    max_clips: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_size: int = 1,
    progress: bool = False,
) -> LatentStats:
    """Encode up to ``max_clips`` clips (``[3, T, H, W]`` in [-1, 1], one shape) and their first frames, and
    return the latent statistics. ``dtype`` is the encoder's compute dtype (bf16 on GPUs: inference speed)."""
    if network.is_discrete:
        raise EvaluationError(
            f"{network.config.name} is a discrete tokenizer: world models read its token indices, which have no "
            "latent statistics (none are written)"
        )
    net = network.to(device, dtype).eval()
    video, image = Moments(), Moments()
    seen, started, batch = 0, time.perf_counter(), []

    def flush() -> None:
        x = torch.stack(batch).to(device, dtype)
        video.add(net.encode(x), reduce=(0, 3, 4))  # [B, C, T, h, w] -> per (C, T)
        image.add(net.encode(x[:, :, :1]), reduce=(0, 2, 3, 4))  # single frames -> per C
        batch.clear()

    for clip in clips:
        batch.append(clip)
        seen += 1
        if len(batch) == batch_size:
            flush()
        if progress and seen % 10 == 0:
            print(f"latent statistics: {seen}/{max_clips} clips, {seen / (time.perf_counter() - started):.1f} clips/s")
        if seen == max_clips:
            break
    if batch:
        flush()
    if seen == 0:
        raise EvaluationError("no usable clip for the latent statistics (see the skipped videos above)")
    mean, std = video.mean_std()
    image_mean, image_std = image.mean_std()
    return LatentStats(mean, std, image_mean, image_std, seen)
