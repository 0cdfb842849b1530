"""Energon's loader state stored as plain data: an exact resume through a weights-only load, and nothing but
the known energon state classes rebuilt from a file."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.videos import encode_video, write_energon_dataset
from tokenizer_posttrain.core.errors import CheckpointError
from tokenizer_posttrain.data.batch import KEYS, PREFETCH, VIDEO
from tokenizer_posttrain.data.energon import EnergonVideoDataModule
from tokenizer_posttrain.data.energon_state import FORMAT, from_plain, to_plain
from tokenizer_posttrain.data.task_encoder import ClipSpec

SPEC = ClipSpec(frames=9, height=32, width=32)
FIELD = "energon_loader_state"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    videos = {f"v{i}": encode_video(20, 48, 64, seed=i) for i in range(6)}
    return write_energon_dataset(tmp_path_factory.mktemp("energon_state"), videos)


def datamodule(path: Path, workers: int = 0, **kw: Any) -> EnergonVideoDataModule:  # noqa: ANN401
    return EnergonVideoDataModule(str(path), SPEC, micro_batch_size=1, num_workers=workers, seed=3, **kw)


def take(dm: EnergonVideoDataModule, n: int) -> list[dict]:
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def through_a_file(state: dict) -> dict:
    """``state`` saved as a checkpoint entry and read back weights-only, as a resume reads it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def stored_state(path: Path, batches: int = 2) -> dict:
    dm = datamodule(path)
    take(dm, batches)
    return through_a_file(dm.state_dict())


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert [x[KEYS] for x in a] == [x[KEYS] for x in b]
    assert all(torch.equal(x[VIDEO], y[VIDEO]) for x, y in zip(a, b, strict=True))


# One worker takes energon's path for worker processes (a checkpoint per worker plus an offset); each worker
# costs ~5 s to shut down, so the uninterrupted loader is the one whose state is saved midway.
@pytest.mark.parametrize("workers", [0, 1])
def test_a_restored_loader_continues_where_the_saved_one_stopped(dataset: Path, workers: int) -> None:
    first = datamodule(dataset, workers)
    stream = iter(first.train_dataloader())
    [next(stream) for _ in range(3)]
    saved = through_a_file(first.state_dict())
    uninterrupted = [next(stream) for _ in range(3)]
    assert saved[FIELD]["format"] == FORMAT  # plain data, not pickled bytes
    resumed = datamodule(dataset, workers)
    resumed.load_state_dict(saved)
    assert_same_batches(take(resumed, 3), uninterrupted)
    assert len({k for batch in uninterrupted for k in batch[KEYS]}) > 1  # it really moves through the videos


@pytest.mark.parametrize("workers", [0, 1])
def test_a_restored_loader_with_several_crops_per_decode_continues_where_it_stopped(
    dataset: Path, workers: int
) -> None:
    spec = ClipSpec(frames=9, height=16, width=16, crops_per_decode=2)

    def module() -> EnergonVideoDataModule:
        return EnergonVideoDataModule(str(dataset), spec, micro_batch_size=2, num_workers=workers, seed=3)

    first = module()
    stream = iter(first.train_dataloader())
    [next(stream) for _ in range(3)]
    saved = through_a_file(first.state_dict())
    uninterrupted = [next(stream) for _ in range(3)]
    assert all(len(set(batch[KEYS])) == 1 for batch in uninterrupted)  # a micro-batch: one decode's crops
    resumed = module()
    resumed.load_state_dict(saved)
    assert_same_batches(take(resumed, 3), uninterrupted)


def test_a_state_restores_into_a_loader_that_prefetches_more(dataset: Path) -> None:
    # data.prefetch is a speed switch: a run may resume with another one and still continue where it stopped.
    first = datamodule(dataset, 1, prefetch=2)
    stream = iter(first.train_dataloader())
    [next(stream) for _ in range(2)]
    saved = through_a_file(first.state_dict())
    uninterrupted = [next(stream) for _ in range(3)]
    resumed = datamodule(dataset, 1, prefetch=6)
    resumed.load_state_dict(saved)
    assert_same_batches(take(resumed, 3), uninterrupted)
    assert resumed._train_loader.prefetch_factor == 6
    assert datamodule(dataset, 1).prefetch == PREFETCH == 6  # the default


def nodes(value: Any) -> list[dict]:  # noqa: ANN401
    """Every tagged dict of a stored state."""
    found = []
    if isinstance(value, dict):
        found.append(value)
        for item in value.get("items", []):
            found += nodes(list(item))
        for item in value.get("fields", {}).values():
            found += nodes(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            found += nodes(item)
    return found


def test_the_stored_state_is_tagged_data_of_known_energon_classes(dataset: Path) -> None:
    state = stored_state(dataset)[FIELD]
    tags = {node["type"] for node in nodes(state["state"])}
    assert {"SavableDataLoaderState", "FlexState", "SliceState"} <= tags
    rebuilt = from_plain(state, FIELD)
    assert type(rebuilt[0]).__name__ == "SavableDataLoaderState"


@pytest.mark.parametrize(
    ("kind", "plant", "message"),
    [
        ("SliceState", {"type": "posix.system"}, r"has type tag 'posix\.system', none of the energon state types"),
        ("SliceState", {"type": "ndarray", "dtype": "object", "shape": [1], "data": b"x"}, r"dtype 'object'"),
        ("SliceState", {"fields": {"__reduce__": 1}}, r"with fields \['__reduce__'\], expected"),
        ("FlexState", {"items": b"\x80\x04."}, r"without a list of \[key, value\] items"),
    ],
)
def test_anything_but_the_known_classes_is_refused_naming_the_field(
    dataset: Path, kind: str, plant: dict, message: str
) -> None:
    state = stored_state(dataset)[FIELD]
    next(node for node in nodes(state["state"]) if node["type"] == kind).update(plant)
    with pytest.raises(CheckpointError, match=message) as refused:
        datamodule(dataset).load_state_dict({FIELD: state})
    assert str(refused.value).startswith(f"the checkpoint's {FIELD} is not a loader state")
    assert "\n" not in str(refused.value)


def test_a_state_of_another_format_or_entry_type_is_refused(dataset: Path) -> None:
    with pytest.raises(CheckpointError, match=r"energon_loader_state .*expected format .*found 'other/1'"):
        datamodule(dataset).load_state_dict({FIELD: {"format": "other/1", "state": None}})
    with pytest.raises(CheckpointError, match=r"state is not a list of one SavableDataLoaderState \(or None\) per"):
        datamodule(dataset).load_state_dict({FIELD: to_plain({"rank0": None})})
    with pytest.raises(CheckpointError, match=r"EnergonVideoDataModule entry is a bytes, not the state"):
        datamodule(dataset).load_state_dict(b"\x80\x04.")  # type: ignore[arg-type]


def test_numpy_arrays_and_scalars_come_back_exactly() -> None:
    from megatron.energon.savable_loader import SavableDataLoaderState
    from megatron.energon.state import FlexState

    worker = FlexState(keys=np.arange(5, dtype=np.uint32), n=np.int64(7), pair=(1, "a"), raw=b"\x00\x01")
    state = [SavableDataLoaderState(worker_states=[worker], next_worker_id=0, micro_batch_size=1)]
    (rank,) = from_plain(through_a_file({"s": to_plain(state)})["s"], FIELD)
    (back,) = rank.worker_states
    assert type(back) is FlexState and back["keys"].dtype == np.uint32 and back["keys"].tolist() == [0, 1, 2, 3, 4]
    assert type(back["n"]) is np.int64 and back["n"] == 7
    assert back["pair"] == (1, "a") and back["raw"] == b"\x00\x01"
    assert (rank.next_worker_id, rank.micro_batch_size) == (0, 1)


def test_an_unknown_object_is_never_stored_silently() -> None:
    from collections import OrderedDict

    with pytest.raises(CheckpointError, match=r"state\[0\]\['x'\] is a collections.OrderedDict, which .* not know"):
        to_plain([{"x": OrderedDict()}])


class _Planted:
    """Unpickling this writes a marker file: what a crafted checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.write_text, (self.marker, "code ran"))


def test_a_pickled_state_of_an_earlier_release_is_never_unpickled(dataset: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    legacy = {FIELD: pickle.dumps(_Planted(marker))}
    with pytest.raises(CheckpointError, match=r"energon_loader_state\) as pickled bytes.*resume\.skip_pickled_states"):
        datamodule(dataset).load_state_dict(legacy)
    # Asked to go on without it: a warning, and the stream starts from the beginning.
    resumed = datamodule(dataset, skip_pickled_states=True)
    with pytest.warns(UserWarning, match="energon loader state .* not restored"):
        resumed.load_state_dict(through_a_file(legacy))
    assert_same_batches(take(resumed, 2), take(datamodule(dataset), 2))
    assert not marker.exists()
