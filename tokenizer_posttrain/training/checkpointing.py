"""Checkpoints of a run: written atomically, every N steps and on preemption, with the RNG states, and
found again on resume."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..core.files import atomic_path
from .config import ResumeConfig

LAST_CKPT = "last.ckpt"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary name and renames it, so a kill during a save
    never leaves a truncated file under the name resume will read."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        with atomic_path(path) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)


def checkpoint_callback(ckpt_dir: Path, every_n_steps: int, keep: int) -> ModelCheckpoint:
    """``step=N.ckpt`` every ``every_n_steps`` keeping the newest ``keep``, plus ``last.ckpt``."""
    return ModelCheckpoint(
        dirpath=str(ckpt_dir),
        filename="{step}",
        every_n_train_steps=every_n_steps,
        # Monitoring the step keeps the newest k (Lightning needs a monitor for top-k > 1).
        monitor="step",
        mode="max",
        save_top_k=keep,
        save_last=True,
        enable_version_counter=False,
        auto_insert_metric_name=True,
    )


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM (Lightning stops after the current batch) write ``last.ckpt`` so the
    next launch of the same command resumes where this one stopped."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(str(self.path))
            if trainer.is_global_zero:
                print(
                    f"Preempted at step {trainer.global_step}: saved {self.path}; "
                    "run the same command again to resume.",
                    flush=True,
                )


class RngState(pl.Callback):
    """Saves and restores the Python, NumPy and torch random states with every checkpoint, so a
    resumed run draws the same random numbers (LoRA dropout, augmentation) as an uninterrupted one."""

    KEY = "rng_states"

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        import random

        import numpy as np
        import torch

        checkpoint[self.KEY] = {
            "python": pickle.dumps(random.getstate()),
            "numpy": pickle.dumps(np.random.get_state()),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        import random

        import numpy as np
        import torch

        states = checkpoint.get(self.KEY)
        if not states:
            return
        random.setstate(pickle.loads(states["python"]))
        np.random.set_state(pickle.loads(states["numpy"]))
        torch.set_rng_state(states["torch"])
        if states["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])


def find_resume_checkpoint(ckpt_dir: Path, resume: ResumeConfig) -> str | None:
    """The explicit ``resume.resume_from_path``, else the newest of ``last.ckpt`` and ``step=N.ckpt``
    (a kill between writing ``step=N.ckpt`` and ``last.ckpt`` must not lose that step)."""
    if resume.resume_from_path:
        path = Path(resume.resume_from_path)
        if not path.is_file():
            raise FileNotFoundError(f"resume.resume_from_path={path} does not exist")
        return str(path)
    if not resume.resume_if_exists or not ckpt_dir.is_dir():
        return None
    candidates = [
        (int(p.stem.split("=", 1)[1]), 0, str(p))
        for p in ckpt_dir.glob("step=*.ckpt")
        if p.stem.split("=", 1)[1].isdigit()
    ]
    last = ckpt_dir / LAST_CKPT
    if last.is_file():  # preferred at equal steps
        candidates.append((checkpoint_step(str(last)), 1, str(last)))
    return max(candidates)[2] if candidates else None


def checkpoint_step(path: str) -> int:
    """The optimizer step a checkpoint was written at (read without loading its tensors)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return int(ckpt.get("global_step", 0))
