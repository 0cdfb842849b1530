"""Files from anywhere: a torch file holding an object is refused in one line, pickled bytes are unpickled
only after the opt-in, and neither runs the code planted in it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tokenizer_posttrain.core.errors import CheckpointError
from tokenizer_posttrain.core.untrusted import PICKLED_STATES_OPT_IN, load_torch_file, skip_pickled_state


class Planted:
    """Unpickling this writes a marker file: what a crafted file could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.write_text, (self.marker, "code ran"))


@pytest.mark.parametrize("mmap", [False, True])
def test_a_torch_file_holding_an_object_is_refused_without_running_it(tmp_path: Path, mmap: bool) -> None:
    marker = tmp_path / "marker"
    torch.save({"state_dict": {}, "planted": Planted(marker)}, tmp_path / "last.ckpt")
    with pytest.raises(CheckpointError) as refused:
        load_torch_file(tmp_path / "last.ckpt", mmap=mmap)
    message = str(refused.value)
    assert message.startswith(f"refusing to load {tmp_path / 'last.ckpt'}: it holds a pickled Python object (")
    assert "could run code planted in the file" in message and "\n" not in message
    assert "weights_only" not in message  # torch's own advice (load it fully) is not passed on
    assert not marker.exists()


def test_plain_data_loads_and_bad_files_say_what_is_wrong(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "n": 3, "s": ["a", (1, None)], "b": b"\x00"}, tmp_path / "ok.ckpt")
    loaded = load_torch_file(tmp_path / "ok.ckpt")
    assert loaded["n"] == 3 and loaded["s"] == ["a", (1, None)] and torch.equal(loaded["w"], torch.ones(2))
    (tmp_path / "half.ckpt").write_bytes((tmp_path / "ok.ckpt").read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"cannot read .*half\.ckpt: .*looks truncated"):
        load_torch_file(tmp_path / "half.ckpt")
    with pytest.raises(CheckpointError, match=r"checkpoint .*none\.ckpt does not exist"):
        load_torch_file(tmp_path / "none.ckpt")
    # Before: garbage was said to hold "a pickled Python object", which sent users looking for an attack.
    (tmp_path / "noise.ckpt").write_bytes(b"\x80\x02" + bytes(range(103, 250)))
    with pytest.raises(CheckpointError) as refused:
        load_torch_file(tmp_path / "noise.ckpt")
    assert str(refused.value).startswith(
        f"cannot read {tmp_path / 'noise.ckpt'}: it is damaged, or holds more than tensors and plain data "
        "(Unsupported operand 103), which is never unpickled"
    )


def test_pickled_bytes_are_refused_or_skipped_never_unpickled() -> None:
    with pytest.raises(CheckpointError) as refused:
        skip_pickled_state("the random states (rng_states)", skip=False)
    message = str(refused.value)
    assert message.startswith("the checkpoint holds the random states (rng_states) as pickled bytes")
    assert PICKLED_STATES_OPT_IN in message and "\n" not in message
    with pytest.warns(UserWarning, match="not restored"):
        skip_pickled_state("the random states (rng_states)", skip=True)


@pytest.mark.parametrize("mmap", [False, True])
def test_a_fifo_or_folder_as_a_torch_file_is_refused_without_opening_it(tmp_path: Path, mmap: bool) -> None:
    # Before: torch.load opened the FIFO and waited for a writer.
    os.mkfifo(tmp_path / "last.ckpt")
    (tmp_path / "step=1.ckpt").mkdir()
    for name, what in (("last.ckpt", "a FIFO"), ("step=1.ckpt", "a folder")):
        with pytest.raises(CheckpointError) as refused:
            load_torch_file(tmp_path / name, mmap=mmap)
        assert str(refused.value) == (
            f"{tmp_path / name} is {what}, not a regular file; give the path of the checkpoint file itself"
        )


def test_a_path_that_cannot_be_stat_ed_is_described_not_raised(tmp_path: Path) -> None:
    # Before: a loop of links or a NUL in the name raised from os.stat, a traceback wherever it was asked.
    from tokenizer_posttrain.core.untrusted import special_file

    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    assert special_file(tmp_path / "a").startswith("a path that cannot be read (")
    assert special_file("bad\0name").startswith("a path that cannot be read (")
    assert special_file(tmp_path / "none") is None
