"""Checkpoints of a run: written atomically, every N steps and on preemption, with the RNG states, and
found again on resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..core.files import atomic_path
from ..core.untrusted import unpickle_legacy_state
from ..io.checkpoint import read_checkpoint
from .config import ResumeConfig

LAST_CKPT = "last.ckpt"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary name and renames it, so a kill during a save
    never leaves a truncated file under the name resume will read."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        with atomic_path(path) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        """The checkpoint to resume from, always weights-only whatever Lightning asks (it asks for a full unpickle
        of URLs, which runs code planted in the file), and refused in one line when damaged or crafted."""
        return read_checkpoint(path)


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
    resumed run draws the same random numbers (LoRA dropout, augmentation) as an uninterrupted one.

    The states are stored as tensors, numbers and strings only: a checkpoint is loaded with
    ``weights_only=True`` and nothing in it is unpickled. Checkpoints from earlier releases hold pickled
    states; those are restored only with ``allow_pickled`` (``resume.allow_pickled_states=true``), since
    unpickling can run code planted in the file.
    """

    KEY = "rng_states"

    def __init__(self, allow_pickled: bool = False) -> None:
        self.allow_pickled = allow_pickled

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        import random

        import numpy as np
        import torch

        version, python_state, gauss = random.getstate()
        kind, keys, position, has_gauss, cached = np.random.get_state()
        checkpoint[self.KEY] = {
            "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64), "gauss": gauss},
            "numpy": {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
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
        python, numpy_state = states["python"], states["numpy"]
        if isinstance(python, bytes) or isinstance(numpy_state, bytes):
            what = f"the random states ({self.KEY})"
            python = unpickle_legacy_state(python, self.allow_pickled, what)
            numpy_state = unpickle_legacy_state(numpy_state, self.allow_pickled, what)
        else:
            python = (int(python["version"]), tuple(int(v) for v in python["state"].tolist()), python["gauss"])
            numpy_state = (
                str(numpy_state["kind"]),
                numpy_state["keys"].numpy().astype(np.uint32),
                int(numpy_state["position"]),
                int(numpy_state["has_gauss"]),
                float(numpy_state["cached_gaussian"]),
            )
        random.setstate(python)
        np.random.set_state(numpy_state)
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
    return int(read_checkpoint(path, mmap=True).get("global_step", 0))
