"""Checkpoints of a run: written atomically, every N steps, at the last step and on preemption, with the RNG
states (what a launch resumes from is :mod:`.resume`'s job)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..core.errors import CheckpointError
from ..core.files import atomic_path
from ..core.untrusted import skip_pickled_state
from ..io.checkpoint import read_checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary name and renames it, so a kill during a save
    never leaves a truncated file under the name resume will read."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        try:
            with atomic_path(path) as tmp:
                super().save_checkpoint(checkpoint, tmp, storage_options)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # atomic_path removed the partial file: the previous checkpoint is intact and the next launch finds it.
            free = shutil.disk_usage(Path(path).parent).free
            raise CheckpointError(
                f"no space left to write {path}: it needs about {_tensor_bytes(checkpoint):,} bytes, "
                f"{free:,} are free; the previous checkpoint is kept. Free some space (or set "
                "trainer.checkpoint_keep lower) and run the same command again to resume"
            ) from None

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        """The checkpoint to resume from, always weights-only whatever Lightning asks (it asks for a full unpickle
        of URLs, which runs code planted in the file), and refused in one line when damaged or crafted, or when
        it lacks an entry Lightning's resume reads."""
        return read_checkpoint(path, resume=True)


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in a (nested) checkpoint: about the size of its file."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class OptimizerStateCheck(pl.Callback):
    """After a resume restored the optimizers: every moment of a parameter has the parameter's shape, and every
    step count one value. The file alone cannot tell (it does not say which parameter each state belongs to), and
    AdamW would otherwise stop at its first step with a traceback about tensor sizes."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.ckpt_path:
            return
        for i, optimizer in enumerate(trainer.optimizers):
            params = [param for group in optimizer.param_groups for param in group["params"]]
            # The file numbers the parameters in this order, and names their states by these numbers.
            for number, param in enumerate(params):
                for name, value in optimizer.state.get(param, {}).items():
                    fits = value.numel() == 1 if name == "step" else value.shape == param.shape
                    if not fits:
                        raise CheckpointError(
                            f"{trainer.ckpt_path}: entry optimizer_states[{i}].state[{number}].{name} has shape "
                            f"{tuple(value.shape)}, its parameter {tuple(param.shape)}; the file was altered or "
                            "not written by tokenizer-posttrain"
                        )


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


class FinalCheckpoint(pl.Callback):
    """``last.ckpt`` at the step training ended on, so a run's newest checkpoint and its export hold the same
    step (the step checkpoints come only every ``trainer.checkpoint_every_n_steps``)."""

    def __init__(self, path: Path, periodic: ModelCheckpoint) -> None:
        self.path = Path(path)
        self.periodic = periodic

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step > 0 and self.periodic._last_global_step_saved != trainer.global_step:
            trainer.save_checkpoint(str(self.path), weights_only=False)


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM (Lightning stops after the current batch) write ``last.ckpt`` so the
    next launch of the same command resumes where this one stopped."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(str(self.path), weights_only=False)
            if trainer.is_global_zero:
                print(
                    f"Preempted at step {trainer.global_step}: saved {self.path}; "
                    "run the same command again to resume.",
                    flush=True,
                )


class RngState(pl.Callback):
    """Saves and restores the Python, NumPy and torch random states with every checkpoint, so a
    resumed run draws the same random numbers (posterior samples, LoRA dropout, augmentation) as an
    uninterrupted one.

    What runs between a save and the next training step differs between the two runs: the uninterrupted
    one may validate there, the resumed one runs Lightning's sanity check and makes its data loaders'
    iterators, and each loader iterator draws its seed from torch's global generator. So the host states
    (Python, NumPy, torch's CPU generator) are set again, to what the checkpoint holds, at the first training
    batch after a save or a load, in both runs: the training steps then draw the same numbers either way. The
    CUDA states are restored at the load only (nothing in between draws from them, and setting them while CUDA
    graphs replay is best left alone).

    The states are stored as tensors, numbers and strings only: a checkpoint is loaded with
    ``weights_only=True`` and nothing in it is unpickled. Checkpoints from earlier releases hold pickled
    states, which are never unpickled (that can run code planted in the file): with ``skip_pickled``
    (``resume.skip_pickled_states=true``) the resume goes on without them.
    """

    KEY = "rng_states"

    def __init__(self, skip_pickled: bool = False) -> None:
        self.skip_pickled = skip_pickled
        # The host states the next training batch starts from (set by a save or a load), or None.
        self._next_batch: tuple[tuple, tuple, torch.Tensor] | None = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        import random

        import numpy as np

        python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
        version, python_words, gauss = python_state
        kind, keys, position, has_gauss, cached = numpy_state
        checkpoint[self.KEY] = {
            "python": {"version": version, "state": torch.tensor(python_words, dtype=torch.int64), "gauss": gauss},
            "numpy": {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": torch_state,
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        self._next_batch = (python_state, numpy_state, torch_state)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        import numpy as np

        states = checkpoint.get(self.KEY)
        if not states:
            return
        python, numpy_state = states["python"], states["numpy"]
        if isinstance(python, bytes) or isinstance(numpy_state, bytes):
            skip_pickled_state(f"the random states ({self.KEY})", self.skip_pickled)
            return
        python = (int(python["version"]), tuple(int(v) for v in python["state"].tolist()), python["gauss"])
        numpy_state = (
            str(numpy_state["kind"]),
            numpy_state["keys"].numpy().astype(np.uint32),
            int(numpy_state["position"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["cached_gaussian"]),
        )
        self._next_batch = (python, numpy_state, states["torch"])
        _set_host_states(*self._next_batch)
        if states["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._next_batch is not None:
            _set_host_states(*self._next_batch)
            self._next_batch = None


def _set_host_states(python: tuple, numpy_state: tuple, torch_state: torch.Tensor) -> None:
    import random

    import numpy as np

    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
