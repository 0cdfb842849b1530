"""The files energon reads from a dataset folder (issue 35): nothing in them runs code, none of them hangs the
launch, and every shard training or validation reads is compared with its index."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli_here
from tests.data.test_preflight import other_videos, rewrite_shard
from tests.videos import encode_video, write_energon_dataset
from tokenizer_posttrain.core.errors import DataError
from tokenizer_posttrain.data import layout
from tokenizer_posttrain.data.energon import EnergonVideoDataModule
from tokenizer_posttrain.data.preflight import check_worker_share, preflight
from tokenizer_posttrain.data.task_encoder import ClipSpec

PREPARED_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
LOADER_PY = (
    "open({marker!r}, 'w').close()\ndef sample_loader(raw):\n    return raw\ndef part_filter(part):\n    return True\n"
)
"""A sample_loader.py that makes ``marker`` when energon imports it."""

PLANTED = {
    # The command runs: energon calls os.system(command=...) for a mapping nested in the CrudeWebdataset's settings.
    "nested_os_system": (
        PREPARED_YAML
        + "subflavors:\n  x:\n    __module__: os\n    __function__: system\n    command: touch {marker}\n",
        "subflavors.x.__module__: 'os' names code",
    ),
    "os_system": ("__module__: os\n__function__: system\ncommand: touch {marker}\n", "__module__: 'os' names code"),
    "sample_loader": (
        "sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
        "sample_loader: sample_loader.py:sample_loader\npart_filter: [mp4]\n",
        "sample_loader: 'sample_loader.py:sample_loader' names Python code to load",
    ),
    "part_filter": (
        PREPARED_YAML + "part_filter: sample_loader.py:part_filter\n",
        "part_filter: 'sample_loader.py:part_filter' names Python code to load",
    ),
}


def make_prepared(folder: Path) -> Path:
    """``folder/data``: a dataset as prepare writes it (train0.tar and train1.tar of 2 videos each, val.tar of 1)."""
    train = {f"v{i}": encode_video(12, 48, 64, seed=i) for i in range(4)}
    val = {"w0": encode_video(12, 48, 64, seed=9)}
    return write_energon_dataset(folder / "data", train, val, train_shards=2)


@pytest.fixture(scope="module")
def prepared_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_prepared(tmp_path_factory.mktemp("prepared"))


@pytest.fixture
def prepared(prepared_once: Path, tmp_path: Path) -> Path:
    """A dataset as prepare writes it (train0.tar, train1.tar, val.tar), each test's own copy to alter."""
    return Path(shutil.copytree(prepared_once, tmp_path / "data"))


def plant(root: Path, case: str, marker: Path) -> str:
    """Make ``root``'s dataset.yaml the ``case`` of :data:`PLANTED` (with a sample_loader.py beside it) whose code
    makes ``marker``; returns what the refusal must say."""
    text, said = PLANTED[case]
    (root / ".nv-meta" / "dataset.yaml").write_text(text.format(marker=marker))
    (root / ".nv-meta" / "sample_loader.py").write_text(LOADER_PY.format(marker=str(marker)))
    return said


def module(root: Path) -> EnergonVideoDataModule:
    return EnergonVideoDataModule(str(root), ClipSpec(frames=9, height=32, width=32), 1, 0)


def refusal(call: Callable[[], Any]) -> str:
    """The message of the DataError ``call`` raises."""
    with pytest.raises(DataError) as err:
        call()
    return str(err.value)


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_dataset_yaml_that_names_code_is_refused_before_energon_reads_it(
    prepared: Path, tmp_path: Path, case: str
) -> None:
    # Before: energon's load_config imported os and called system (nested_os_system), or imported
    # .nv-meta/sample_loader.py (sample_loader, part_filter), when the data module built its loader: the marker
    # was made. The launch's own checks read only split.yaml and let it through.
    marker = tmp_path / "marker"
    said = plant(prepared, case, marker)
    file = prepared / ".nv-meta" / "dataset.yaml"
    for call in (
        module(prepared).train_dataloader,
        module(prepared).val_dataloader,
        lambda: check_worker_share(prepared, 1, 0),
        lambda: preflight(prepared, 9, 32, 32, None, 0, 0.1),
    ):
        message = refusal(call)
        assert "\n" not in message and message.startswith(f"refusing {file}: {said}")
        assert message.endswith(
            f"run python -m data_tools prepare {prepared} again (it rewrites .nv-meta), or restore the file"
        )
    assert not marker.exists()


def test_the_launch_refuses_a_dataset_yaml_that_names_code(prepared: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    plant(prepared, "nested_os_system", marker)
    args = ["--factory", "tiny", "data.num_workers=0", "data.global_batch_size=1", "data.micro_batch_size=1"]
    result = run_cli_here(
        *args, f"data.path={prepared}", "trainer.max_steps=1", f"log.log_dir={tmp_path}", cwd=tmp_path
    )
    assert result.returncode == 1
    (line,) = [line for line in result.stderr.splitlines() if "dataset.yaml" in line]
    assert line.startswith(f"error: refusing {prepared / '.nv-meta' / 'dataset.yaml'}: subflavors.x.__module__")
    assert not marker.exists()


def test_datasets_as_prepare_writes_them_still_load(prepared: Path) -> None:
    assert (prepared / ".nv-meta" / "dataset.yaml").read_text() == PREPARED_YAML
    assert layout.check_prepared(prepared) == {"train": ["train{0..1}.tar"], "val": ["val.tar"]}
    assert check_worker_share(prepared, 1, 0) == 4
    assert preflight(prepared, 9, 32, 32, None, 2, 0.1) == []
    batch = next(iter(module(prepared).train_dataloader()))
    assert batch["video"].shape == (1, 3, 9, 32, 32)


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        (
            "split.yaml",
            "split_parts:\n  train: [../other/train0.tar]\n",
            "lists '../other/train0.tar', which is not a shard inside",
        ),
        (
            "split.yaml",
            "split_parts: &a\n  train: [train0.tar]\n  val: [val.tar]\nexclude: *a\n",
            "uses YAML aliases (*name), which prepare never writes",
        ),
        (  # nine levels of nine aliases: 9**9 strings once expanded, which printing or comparing would do
            "dataset.yaml",
            PREPARED_YAML
            + "x0: &x0 [lol]\n"
            + "".join(f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 9)}]\n" for i in range(1, 10)),
            "uses YAML aliases",
        ),
        ("dataset.yaml", "[" * 5000 + "]" * 5000, "nests its YAML too deeply to read"),  # was a RecursionError
        ("split.yaml", "split_parts:\n  train: ['{0..99999999999}.tar']\n", "lists more than 100000 shards"),
        (".info.json", "[" * 100_000, "nests its JSON too deeply to read"),  # was a RecursionError
        (
            "split.yaml",
            "split_parts:\n  train: [train0.tar]\nsample_loader: x.py:f\n",
            "holds ['sample_loader'], not the split_parts and exclude",
        ),
        ("dataset.yaml", "!!python/object/apply:os.system [true]\n", "is not valid YAML"),
        ("dataset.yaml", "__module__: megatron.energon\n", "lacks '__class__: CrudeWebdataset'"),
        (
            "dataset.yaml",
            PREPARED_YAML + "shuffle_over_epochs: 2\n",
            "key 'shuffle_over_epochs' is not one prepare writes",
        ),
        (".info.json", '{"shard_counts": {"train0.tar": 2,', "is not valid JSON (Expecting property name"),
        (".info.json", '{"shard_counts": 3}', "holds no shard_counts"),
    ],
)
def test_meta_files_but_as_prepare_writes_them_are_refused_naming_the_file(
    prepared: Path, name: str, text: str, said: str
) -> None:
    # Before: a traceback from yaml or json without the file's name (.info.json, split.yaml), or nothing at all.
    (prepared / ".nv-meta" / name).write_text(text)
    message = refusal(lambda: layout.split_parts(prepared))
    assert "\n" not in message and str(prepared / ".nv-meta" / name) in message and said in message
    assert message.endswith("or restore the file")


def finishes(call: Callable[[], Any], fifo: Path, seconds: float = 30) -> BaseException | None:
    """What ``call`` raised (None if nothing), failing the test when it does not finish in ``seconds``: it then
    hangs on ``fifo``, which is opened for writing and closed to let it go, not to hang the suite."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            raised.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            raised.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # end of file for the blocked reader
        thread.join(seconds)
        pytest.fail(f"blocked reading the FIFO {fifo}")
    return raised[0]


@pytest.mark.parametrize("name", ["train1.tar.idx", "val.tar.idx", ".nv-meta/.info.json", ".nv-meta/dataset.yaml"])
def test_a_fifo_in_the_dataset_is_refused_not_waited_on(prepared: Path, name: str) -> None:
    # Before: the launch preflight blocked for ever reading it (the .tar.idx with read_bytes, .info.json with
    # read_text); energon would have blocked on it too.
    fifo = prepared / name
    fifo.unlink()
    os.mkfifo(fifo)
    calls = [lambda: preflight(prepared, 9, 32, 32, None, 0, 0.1)]
    if not name.endswith(".idx"):  # the worker share reads no index
        calls.append(lambda: check_worker_share(prepared, 1, 0))
    for call in calls:
        error = finishes(call, fifo)
        assert isinstance(error, DataError), error
        assert str(error).startswith(f"{fifo} is a FIFO, not a regular file: ")
        assert "\n" not in str(error) and "python -m data_tools prepare" in str(error)


def test_a_changed_val_shard_is_refused_at_launch(prepared: Path) -> None:
    # Before: only the train shards were compared with their index; validation read what val.tar's old index
    # lists in the new file, without a word.
    rewrite_shard(prepared / "val.tar", other_videos(3, first_seed=100))
    message = refusal(lambda: preflight(prepared, 9, 32, 32, None, 0, 0.1))
    assert "\n" not in message
    assert message.startswith(f"data.path={prepared}: val.tar: tar shard changed since it was prepared: ")
    assert message.endswith(f"Run python -m data_tools prepare {prepared} again")
