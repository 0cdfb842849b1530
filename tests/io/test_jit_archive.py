"""TorchScript archives read as data: the same weights as ``torch.jit.load``, and nothing in a crafted file runs.

The tests play both sides: ``torch.jit.load`` stands for the consumer (NVIDIA's loaders) whose result must be
matched, and for the victim that a crafted archive attacks; the app itself never calls it.
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.commands.test_infer import run_infer
from tests.conftest import reference_weights, run_cli_here
from tokenizer_posttrain.io.checkpoint import CheckpointError, load_tokenizer, read_weights
from tokenizer_posttrain.io.export import export_tokenizer
from tokenizer_posttrain.io.jit_archive import read_jit_state


def jit_load_state(path: Path) -> dict[str, torch.Tensor]:
    """What ``torch.jit.load`` gives: the consumer's view of the file (run only on files the test made)."""
    with pytest.warns(FutureWarning):  # torch.jit.load's deprecation notice
        return torch.jit.load(str(path), map_location="cpu").state_dict()


def assert_same_state(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert list(ours) == list(theirs)  # the same keys in the same order
    for key, value in theirs.items():
        got = ours[key]
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
            value.dtype,
            value.shape,
            value.stride(),
            value.storage_offset(),
        ), key
        assert torch.equal(got, value), key


# -- the same weights as torch.jit.load ----------------------------------------------------------------------------


@pytest.mark.parametrize("file", ["encoder.jit", "decoder.jit", "autoencoder.jit"])
def test_the_exports_read_as_torch_jit_load_reads_them(exported_dirs: dict[str, Path], file: str) -> None:
    for folder in exported_dirs.values():  # bf16, as the official files
        assert_same_state(read_jit_state(folder / file), jit_load_state(folder / file))


def test_the_reference_weights_come_back_bit_for_bit_from_an_fp32_export(tmp_path: Path) -> None:
    for name in ("CV8x8x8", "DV8x16x16"):
        export_tokenizer(load_tokenizer(reference_weights(name)), tmp_path / name)
        reference = load_file(str(reference_weights(name)))
        for source in (tmp_path / name / "autoencoder.jit", tmp_path / name):  # a file, and encoder + decoder
            weights = read_weights(source)
            assert weights.state.keys() == reference.keys(), source
            assert all(torch.equal(weights.state[k], reference[k]) for k in reference), source


class _Scripted(nn.Module):
    """What a scripted (not traced) module can hold: containers, a None bias, buffers of both kinds, plain
    attributes and a shared submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Conv2d(2, 3, 3, bias=False), nn.BatchNorm2d(3)])
        self.heads = nn.ModuleDict({"b": nn.Linear(3, 4), "a": nn.Linear(4, 1)})
        self.register_buffer("kept", torch.arange(6.0).reshape(2, 3).t())  # not contiguous
        self.register_buffer("dropped", torch.ones(2), persistent=False)
        self.scale = 0.5
        self.sizes = [1, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        x = x.mean((2, 3))
        return self.heads["a"](self.heads["b"](x)) * self.scale + self.kept.sum() + self.dropped.sum()


def test_a_scripted_module_reads_as_torch_jit_load_reads_it(tmp_path: Path) -> None:
    module = torch.jit.script(_Scripted())
    module.save(str(tmp_path / "scripted.jit"))
    assert_same_state(read_jit_state(tmp_path / "scripted.jit"), jit_load_state(tmp_path / "scripted.jit"))


# -- crafted archives: nothing runs, one line naming the file ----------------------------------------------------


class _WritesAFile(nn.Module):
    """A module whose ``__setstate__`` (run by ``torch.jit.load``) creates or overwrites any file named in it."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target
        self.weight = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[str, torch.Tensor, bool]:
        return (self.target, self.weight, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, torch.Tensor, bool]) -> None:
        self.target = state[0]
        self.training = state[2]
        planted = torch.from_file(state[0], True, 16, dtype=torch.uint8)
        planted.fill_(7)
        self.weight = state[1] + planted[:2].float()  # used, so TorchScript keeps the write


class _NeverReturns(nn.Module):
    """A module whose ``__setstate__`` loops forever: ``torch.jit.load`` hangs the launch."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[int, bool]:
        return (self.count, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[int, bool]) -> None:
        self.training = state[1]
        self.count = state[0]
        while self.count >= 0:
            self.count = self.count + 1 - 1


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(archive, target)``: a ``.jit`` that writes ``target`` when ``torch.jit.load`` opens it (checked here, so
    the tests below attack a file that really runs code)."""
    folder = tmp_path_factory.mktemp("planted")
    target = folder / "written_by_the_archive"
    torch.jit.script(_WritesAFile(str(target))).save(str(folder / "planted.jit"))
    jit_load_state(folder / "planted.jit")
    assert target.read_bytes() == bytes([7] * 16)
    target.unlink()
    return folder / "planted.jit", target


def test_an_archive_that_writes_a_file_is_refused_and_writes_nothing(planted: tuple[Path, Path]) -> None:
    archive, target = planted
    with pytest.raises(CheckpointError) as err:
        load_tokenizer(archive)
    message = str(err.value)
    assert "\n" not in message and str(archive) in message
    assert "__torch__._WritesAFile" in message or "not a dict of attributes" in message
    assert not target.exists()


def test_no_command_runs_the_planted_archive(planted: tuple[Path, Path], tmp_path: Path, capsys) -> None:  # noqa: ANN001
    archive, target = planted
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(archive, folder / "autoencoder.jit")  # a downloaded model folder
    video = tmp_path / "in.mp4"
    from tests.videos import write_video

    write_video(video, 9, 16, 16, fps=8)
    for checkpoint in (archive, folder):
        assert (
            run_infer("reconstruct", "--checkpoint", checkpoint, "--input", video, "--output", tmp_path / "o.mp4") == 1
        )
        assert not target.exists()
    train = run_cli_here(f"model.jit_ckpt_pth={archive}", "--factory", "tiny", "--yes", cwd=tmp_path)
    assert train.returncode == 1 and "Traceback" not in train.stderr
    assert f"refusing to load {archive}" in train.stderr
    assert not target.exists()


def test_an_archive_that_never_returns_is_refused_at_once(tmp_path: Path) -> None:
    torch.jit.script(_NeverReturns()).save(str(tmp_path / "loop.jit"))
    error = _error_within(30, read_jit_state, tmp_path / "loop.jit")
    assert isinstance(error, CheckpointError) and "not a dict of attributes" in str(error)


def _with_data_pkl(source: Path, out: Path, data: bytes) -> Path:
    """A copy of the archive ``source`` whose ``data.pkl`` is ``data``."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(out, "w") as new:
        for info in old.infolist():
            new.writestr(info, data if info.filename.endswith("/data.pkl") else old.read(info))
    return out


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_call_in_data_pkl_is_refused_by_name(exported_dirs: dict[str, Path], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    crafted = _with_data_pkl(
        exported_dirs["CV8x8x8"] / "autoencoder.jit", tmp_path / "crafted.jit", pickle.dumps(_RunsACommand(marker))
    )
    with pytest.raises(CheckpointError, match=r"a reference to posix\.system, which is not a tensor"):
        read_jit_state(crafted)
    assert not marker.exists()


def test_a_tensor_reaching_past_its_record_is_refused(planted: tuple[Path, Path], tmp_path: Path) -> None:
    archive, _ = planted
    with zipfile.ZipFile(archive) as old:
        data = old.read(next(n for n in old.namelist() if n.endswith("/data.pkl")))
    size_then_stride = b"K\x02t(K\x01t"  # the weight: sizes (2,), strides (1,), over a storage of 2 floats
    assert data.count(size_then_stride) == 1
    grown = _with_data_pkl(archive, tmp_path / "grown.jit", data.replace(size_then_stride, b"K\x09t(K\x01t"))
    with pytest.raises(CheckpointError, match=r"a tensor of size \[9\] that reaches past its storage record 0"):
        read_jit_state(grown)


def test_a_record_shorter_than_its_tensor_is_refused(exported_dirs: dict[str, Path], tmp_path: Path) -> None:
    source = exported_dirs["DV8x16x16"] / "decoder.jit"
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(tmp_path / "short.jit", "w") as new:
        for info in old.infolist():
            content = old.read(info)
            new.writestr(info, content[:-4] if info.filename.endswith("/data/3") else content)
    with pytest.raises(CheckpointError, match=r"a record data/3 of \d+ bytes for \d+ bytes of tensor"):
        read_jit_state(tmp_path / "short.jit")


def test_code_in_the_class_files_stays_text(tmp_path: Path) -> None:
    # Which attributes are parameters is read from the code/ files as text: a statement planted there never runs.
    torch.jit.script(_Scripted()).save(str(tmp_path / "scripted.jit"))
    marker = tmp_path / "ran"
    with zipfile.ZipFile(tmp_path / "scripted.jit") as old, zipfile.ZipFile(tmp_path / "code.jit", "w") as new:
        for info in old.infolist():
            content = old.read(info)
            if "/code/" in info.filename and info.filename.endswith(".py"):
                content = f"import os\nos.system('touch {marker}')\n".encode() + content
            new.writestr(info, content)
    assert_same_state(read_jit_state(tmp_path / "code.jit"), read_jit_state(tmp_path / "scripted.jit"))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p, src: p.write_bytes(b"not a zip at all" * 10), "not a TorchScript archive"),
        (lambda p, src: p.write_bytes(src.read_bytes()[: src.stat().st_size // 2]), "truncated"),
        (lambda p, src: os.mkfifo(p), "is not a regular file"),
        (lambda p, src: p.mkdir(), "is not a regular file"),
        (lambda p, src: _zip_without_data_pkl(p), "no data.pkl"),
    ],
    ids=["garbage", "cut-in-half", "fifo", "directory", "a-zip-but-not-torchscript"],
)
def test_damaged_or_odd_files_are_one_line(exported_dirs: dict[str, Path], tmp_path: Path, make, match: str) -> None:  # noqa: ANN001
    path = tmp_path / "model.jit"
    make(path, exported_dirs["CV8x8x8"] / "encoder.jit")
    with pytest.raises(CheckpointError, match=match) as err:
        read_jit_state(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def _zip_without_data_pkl(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("model/readme.txt", "hello")


def test_the_unpickler_builds_nothing_but_its_stand_ins() -> None:
    from tokenizer_posttrain.io.jit_archive import _ArchiveUnpickler, _Refused

    for name in ("os system", "builtins eval", "torch load", "torch.jit load", "collections defaultdict"):
        stream = b"\x80\x02c" + name.replace(" ", "\n").encode() + b"\n)R."
        with pytest.raises(_Refused, match="not a tensor or a TorchScript class"):
            _ArchiveUnpickler(stream).load()


@pytest.mark.parametrize("name", ["model.jit", "model.ckpt", "model.safetensors", "weights"])
def test_a_fifo_given_as_the_weights_is_refused_without_waiting(tmp_path: Path, name: str) -> None:
    os.mkfifo(tmp_path / name)
    error = _error_within(20, load_tokenizer, tmp_path / name)
    assert isinstance(error, CheckpointError) and "is not a regular file" in str(error)


def _error_within(seconds: float, function: Callable[..., object], *args: object) -> BaseException | None:
    """What ``function(*args)`` raises (None if nothing), failing the test if it has not returned after ``seconds``
    (it is left blocked in a daemon thread)."""
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            function(*args)
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - the test inspects whatever was raised
            outcome.append(err)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert not thread.is_alive(), f"{function.__name__}{args} has not returned after {seconds} s"
    return outcome[0]
