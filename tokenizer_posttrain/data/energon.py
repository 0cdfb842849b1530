"""Lightning data module over an energon dataset of ``<key>.mp4`` webdataset shards."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
from megatron.energon import WorkerConfig, get_loader, get_savable_loader, get_train_dataset, get_val_dataset
from megatron.energon.savable_loader import SavableDataLoaderState
from megatron.energon.state import FlexState

from ..core.errors import CheckpointError, UserError
from ..core.untrusted import skip_pickled_state
from .batch import PREFETCH
from .energon_state import from_plain, to_plain
from .layout import check_prepared, dataset_splits
from .task_encoder import ClipSpec, VideoClipTaskEncoder

_STATE_KEY = "energon_loader_state"


def saved_loader_layout(entry: Any, where: str) -> tuple[int, int] | None:
    """``(training processes, data.num_workers)`` of the loader whose position a checkpoint's
    :class:`EnergonVideoDataModule` entry holds (``where``: the file, for messages): energon continues a stream
    only with as many of each (one saved position per process, each worker reads its own share of the shards),
    and asserts otherwise. None when the entry holds no position, or the pickled one of an earlier release (never
    unpickled)."""
    value = entry.get(_STATE_KEY) if isinstance(entry, dict) else None
    if value is None or isinstance(value, bytes):
        return None
    state = from_plain(value, _STATE_KEY)
    ranks = [rank for rank in state if rank is not None] if isinstance(state, list) else [None]
    if not all(isinstance(rank, SavableDataLoaderState) and isinstance(rank.worker_states, list) for rank in ranks):
        raise CheckpointError(
            f"{where}: entry {_STATE_KEY} is not a loader position as energon saves it (a list of one "
            "SavableDataLoaderState per process); the file was altered or not written by tokenizer-posttrain"
        )
    if not ranks:
        return None
    # Without workers the loader keeps one plain state, with N workers one checkpoint per worker.
    plain = any(isinstance(s, FlexState) for s in ranks[0].worker_states)
    return len(state), 0 if plain else len(ranks[0].worker_states)


class _Stream:
    """The endless energon train loader, presented to Lightning as one very long epoch.

    With energon's own length, Lightning cuts "epochs" out of the stream and steps the
    optimizer at each cut with a partial accumulation. With no length at all, Lightning
    prefetches one batch beyond the one it trains on, and the saved loader state then skips
    that batch on resume. A known, huge length avoids both.
    """

    LENGTH = 10**12

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Any:
        batches = iter(self.loader)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except UserError as err:
                raise type(err)(_worker_message(err)) from None
            yield batch

    def __len__(self) -> int:
        return self.LENGTH


def _worker_message(err: UserError) -> str:
    """The message of an error raised in a loader worker process: torch re-raises it in the trainer's
    process with the worker's traceback around it ("Caught DataError in DataLoader worker process 1.
    Original Traceback ..."), and our errors are one line."""
    text = str(err)
    if text.startswith("Caught ") and "Traceback" in text:
        return text.rsplit(f"{type(err).__name__}: ", 1)[-1].strip()
    return text


class EnergonVideoDataModule(pl.LightningDataModule):
    """Train and validation loaders over an energon dataset, on this process's data-parallel rank.

    The train loader's position is saved in every checkpoint (for all ranks, gathered on
    rank 0) and restored on resume, so a resumed run neither repeats nor skips samples. It is stored as
    plain data (:mod:`.energon_state`); the pickled state of checkpoints from earlier releases is never
    unpickled (that can run code planted in a file): with ``skip_pickled_states``
    (``resume.skip_pickled_states=true``) the stream starts afresh instead. ``restart_stream``: why the saved
    position is dropped (``resume.allow_changes=true`` with another loader layout), said in a warning; the stream
    then starts afresh too.
    """

    def __init__(
        self,
        path: str,
        spec: ClipSpec,
        micro_batch_size: int,
        num_workers: int,
        prefetch: int = PREFETCH,
        shuffle_buffer_size: int = 100,
        max_samples_per_sequence: int = 100,
        seed: int = 0,
        skip_pickled_states: bool = False,
        restart_stream: str | None = None,
    ) -> None:
        super().__init__()
        if micro_batch_size % spec.crops_per_decode:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} must be a multiple of crops_per_decode={spec.crops_per_decode}"
            )
        self.path = str(path)
        self.spec = spec
        self.micro_batch_size = micro_batch_size
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.shuffle_buffer_size = shuffle_buffer_size
        self.max_samples_per_sequence = max_samples_per_sequence
        self.seed = seed
        self.skip_pickled_states = skip_pickled_states
        self.restart_stream = restart_stream
        self._train_loader: Any = None
        self._restore_state: Any = None

    @property
    def has_validation(self) -> bool:
        return "val" in dataset_splits(self.path)

    def _worker_config(self, num_workers: int) -> WorkerConfig:
        # Built here, after Lightning set up torch.distributed, so rank and world size are right.
        config = WorkerConfig.default_worker_config(num_workers=num_workers)
        config.seed_offset = self.seed
        return config

    def train_dataloader(self) -> Any:
        if self._train_loader is None:
            # energon runs the code its config files name: they are checked here too, not only at the preflight,
            # for every caller that builds this module.
            check_prepared(self.path)
            dataset = get_train_dataset(
                self.path,
                worker_config=self._worker_config(self.num_workers),
                # Each sample holds the crops of one decode: fewer samples make the micro-batch.
                batch_size=self.micro_batch_size // self.spec.crops_per_decode,
                shuffle_buffer_size=self.shuffle_buffer_size,
                max_samples_per_sequence=self.max_samples_per_sequence,
                task_encoder=VideoClipTaskEncoder(self.spec),
            )
            self._train_loader = get_savable_loader(dataset, prefetch_factor=self.prefetch)
            if self._restore_state is not None and self.restart_stream:
                warnings.warn(f"the data stream starts afresh: {self.restart_stream}", stacklevel=2)
                self._restore_state = None
            if self._restore_state is not None:
                self._train_loader.restore_state_global(self._restore_state)
                self._restore_state = None
        return _Stream(self._train_loader)

    def val_dataloader(self) -> Any:
        if not self.has_validation:  # its check_prepared reads the dataset's files before energon does
            return []
        spec = ClipSpec(**{**self.spec.__dict__, "random_crop": False, "hflip": False, "crops_per_decode": 1})
        dataset = get_val_dataset(
            self.path,
            # In the main process: validation reads a batch or two, and energon's worker processes
            # take ~10 s to shut down after an unfinished pass.
            worker_config=self._worker_config(0),
            batch_size=self.micro_batch_size,
            task_encoder=VideoClipTaskEncoder(spec),
        )
        return get_loader(dataset)

    def state_dict(self) -> dict[str, Any]:
        if self._train_loader is None:
            return {}
        # Every rank must take part in the gather; rank 0 gets all states and writes them.
        return {_STATE_KEY: to_plain(self._train_loader.save_state_global(global_dst_rank=0))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise CheckpointError(
                f"the checkpoint's {type(self).__name__} entry is a {type(state_dict).__name__}, not the state of "
                "a data module; the file was altered or written by another program"
            )
        if _STATE_KEY not in state_dict:
            return
        value = state_dict[_STATE_KEY]
        if isinstance(value, bytes):
            # Never unpickled: the stream then starts afresh (skip_pickled_state warns).
            skip_pickled_state(f"the energon loader state ({_STATE_KEY})", self.skip_pickled_states)
            self._restore_state = None
        else:
            self._restore_state = from_plain(value, _STATE_KEY)
