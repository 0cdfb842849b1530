"""Synthetic video clips: moving coloured gratings and blobs, deterministic per seed.

Built on the CPU in the loader workers (NeMo's fake data makes CUDA tensors in workers,
which breaks with worker processes). The clips move, so a falling loss means something.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .batch import CLIP_FRAMES, CLIP_SIZE, LOSS_MASK, VIDEO


def synthetic_clip(frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    """One clip ``[3, frames, height, width]`` in [-1, 1] (fp32), a pure function of its args."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(frames, dtype=torch.float32).view(frames, 1, 1)
    y = torch.linspace(0, 1, height).view(1, height, 1)
    x = torch.linspace(0, 1, width).view(1, 1, width)
    clip = torch.zeros(3, frames, height, width)
    for _ in range(3):  # drifting sinusoidal gratings, a colour each
        fx, fy = (torch.rand(2, generator=gen) * 6 + 1).tolist()
        vx, vy = ((torch.rand(2, generator=gen) - 0.5) * 0.1).tolist()
        phase = float(torch.rand(1, generator=gen)) * 2 * math.pi
        colour = (torch.rand(3, generator=gen) * 2 - 1).view(3, 1, 1, 1)
        wave = torch.sin(2 * math.pi * (fx * (x - vx * t) + fy * (y - vy * t)) + phase)
        clip += 0.3 * colour * wave
    for _ in range(2):  # blobs moving along straight lines
        cx, cy, vx, vy = (
            torch.rand(4, generator=gen) * torch.tensor([1, 1, 0.04, 0.04]) - torch.tensor([0, 0, 0.02, 0.02])
        ).tolist()
        radius = 0.08 + 0.1 * float(torch.rand(1, generator=gen))
        colour = (torch.rand(3, generator=gen) * 2 - 1).view(3, 1, 1, 1)
        d2 = (x - cx - vx * t) ** 2 + (y - cy - vy * t) ** 2
        clip += 0.6 * colour * torch.exp(-d2 / (2 * radius**2))
    return clip.clamp(-1, 1)


class SyntheticVideoDataset(Dataset):
    """``num_samples`` clips; clip ``i`` depends only on ``(seed, i)``."""

    def __init__(
        self,
        num_samples: int,
        frames: int,
        height: int,
        width: int,
        seed: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        cache: bool = False,
    ) -> None:
        self.num_samples, self.frames, self.height, self.width = num_samples, frames, height, width
        self.seed, self.dtype = seed, dtype
        # Filled in each loader worker on its own (a copy of the dataset lives in every worker).
        self._cache: dict[int, torch.Tensor] | None = {} if cache else None

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        clip = None if self._cache is None else self._cache.get(index)
        if clip is None:
            clip = synthetic_clip(self.frames, self.height, self.width, self.seed * 1_000_003 + index).to(self.dtype)
            if self._cache is not None:
                self._cache[index] = clip
        mask = torch.ones(1, self.frames, self.height, self.width, dtype=self.dtype)
        # The collation stacks clips into a new batch tensor: the cached one never leaves the worker.
        return {VIDEO: clip, LOSS_MASK: mask}


class StreamSampler(Sampler[int]):
    """An endless, seeded, rank-sharded stream of dataset indices that can start mid-stream.

    Position ``p`` of the global stream is clip ``perm_e[p % n]`` with a fresh permutation per pass
    ``e = p // n``; rank ``r`` of ``w`` takes positions ``r, r + w, ...``. Starting at the number of
    clips already consumed makes a resumed run read exactly what an uninterrupted one would.
    """

    LENGTH = 10**12  # a length keeps Lightning from prefetching and from cutting the stream into epochs

    def __init__(self, num_samples: int, seed: int, start: int = 0, rank: int = 0, world_size: int = 1) -> None:
        self.num_samples, self.seed, self.start, self.rank, self.world_size = num_samples, seed, start, rank, world_size

    def __iter__(self) -> Iterator[int]:
        position = self.start * self.world_size + self.rank
        perm_pass, perm = -1, torch.empty(0, dtype=torch.long)
        while True:
            if position // self.num_samples != perm_pass:
                perm_pass = position // self.num_samples
                perm = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + perm_pass))
            yield int(perm[position % self.num_samples])
            position += self.world_size

    def __len__(self) -> int:
        return self.LENGTH


class SyntheticVideoDataModule(pl.LightningDataModule):
    """Train and validation loaders over :class:`SyntheticVideoDataset`.

    The train loader is an endless stream (:class:`StreamSampler`) sharded over the ranks; on
    resume it starts after the clips the finished optimizer steps consumed.
    """

    def __init__(
        self,
        frames: int = CLIP_FRAMES,
        height: int = CLIP_SIZE,
        width: int = CLIP_SIZE,
        micro_batch_size: int = 1,
        num_workers: int = 2,
        num_train_samples: int = 10_000,
        num_val_samples: int = 64,
        seed: int = 1234,
        cache: bool = False,
    ) -> None:
        super().__init__()
        shape = dict(frames=frames, height=height, width=width)
        self.train_set = SyntheticVideoDataset(num_train_samples, seed=seed, cache=cache, **shape)
        self.val_set = SyntheticVideoDataset(num_val_samples, seed=seed + 1, **shape)
        self.micro_batch_size = micro_batch_size
        self.num_workers = num_workers
        self.seed = seed

    def _consumed_per_rank(self) -> int:
        trainer = self.trainer
        if trainer is None:
            return 0
        # Checkpoints are taken at optimizer-step boundaries, so this is exact on resume.
        return trainer.global_step * trainer.accumulate_grad_batches * self.micro_batch_size

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        sampler = StreamSampler(len(self.train_set), self.seed, self._consumed_per_rank(), rank, world)
        return DataLoader(
            self.train_set,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            # Page-locked batches copy to the GPU asynchronously, beside the running step.
            pin_memory=torch.cuda.is_available(),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set,
            batch_size=self.micro_batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
