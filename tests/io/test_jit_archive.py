"""TorchScript archives read as data: the same weights as ``torch.jit.load``, and nothing in a crafted file runs.

The tests play both sides: ``torch.jit.load`` stands for the consumer (NVIDIA's loaders) whose result must be
matched, and for the victim that a crafted archive attacks; the app itself never calls it.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.commands.test_infer import run_infer
from tests.conftest import reference_weights, run_cli_here
from tests.videos import encode_video, write_energon_dataset, write_video
from tokenizer_posttrain.__main__ import main
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
    data = write_energon_dataset(tmp_path / "data", {"a": encode_video(9, 16, 16)})
    capsys.readouterr()
    for args in (
        ("export", "--checkpoint", archive, "--out", tmp_path / "export"),
        ("evaluate", "--checkpoint", reference_weights("CV8x8x8"), "--baseline", archive, "--data", data),
        ("posttrain", "--base", archive, "--videos", data, "--out", tmp_path / "run"),
    ):
        assert main([str(a) for a in args]) == 1, args
        assert capsys.readouterr().err.startswith(f"error: refusing to load {archive}: it holds an object"), args
        assert not target.exists()
    assert not (tmp_path / "export").exists() and not (tmp_path / "run").exists()


def test_an_archive_that_never_returns_is_refused_at_once(tmp_path: Path) -> None:
    torch.jit.script(_NeverReturns()).save(str(tmp_path / "loop.jit"))
    error = _error_within(30, load_tokenizer, tmp_path / "loop.jit")  # before: torch.jit.load never returned
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
    with pytest.raises(CheckpointError, match=re.escape("a tensor of size [9] that reaches past its storage record 0")):
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
        (lambda p, src: os.mkfifo(p), "is a FIFO, not a regular file"),
        (lambda p, src: p.mkdir(), "is a folder, not a regular file"),
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


_CODE = b'class M(Module):\n  __parameters__ = ["w", ]\n  __buffers__ = []\n  w : Tensor\n  training : bool\n'
_DAG = b")q\x00" + b"h\x00h\x00\x86q\x00" * 80  # t = (t, t) eighty times over, through the memo: 2**80 leaves
_TENSOR = (  # M().w = a tensor over the 2 floats of record 0, with the sizes and strides put in its place
    b"\x80\x02c__torch__\nM\n)\x81}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n"
    b"((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQK\x00"
    b"%s\x89ccollections\nOrderedDict\n)RtRsX\x08\x00\x00\x00training\x89sb."
)


def _archive(path: Path, pickled: bytes, code: bytes = _CODE, compress: int = zipfile.ZIP_STORED) -> Path:
    """A hand-made archive: ``data.pkl`` as given, one class file, record 0 with two floats, the version and
    no constants."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(zipfile.ZipInfo("m/data.pkl"), pickled, compress_type=compress)
        archive.writestr("m/code/__torch__.py", code)
        archive.writestr("m/data/0", b"\0" * 8)
        archive.writestr("m/version", b"3\n")
        archive.writestr("m/constants.pkl", b"\x80\x02).")
    return path


def test_the_hand_made_archive_reads_as_torch_jit_load_reads_it(tmp_path: Path) -> None:
    # The baseline of the attacks below: with sizes (2,) and strides (1,) it is a valid archive.
    path = _archive(tmp_path / "m.jit", _TENSOR % b"(K\x02t(K\x01t")
    assert_same_state(read_jit_state(path), jit_load_state(path))


@pytest.mark.parametrize(
    ("pickled", "match"),
    [
        # Before: torch.jit.load ran each of these, and the first restricted unpickler crashed, hung or grew:
        (b"\x80\x02}" + b")" + b"\x85" * 100_000 + b"Ns.", "a dict key of type tuple"),  # C stack overflow
        (b"\x80\x02}(" + _DAG + b"Nu.", "a dict key of type tuple"),  # a hash of 2**80 steps
        (b"\x80\x02" + _DAG + b"Q.", "a persistent reference that is not a tensor storage"),  # a repr of 2**80
        (b"\x80\x02Nr\x00\x00\x00\x10.", "a NoneType at the top"),  # a memo index of 2**28: 4 GiB
        (b"\x80\x02\x8e" + (2**63 + 5).to_bytes(8, "little") + b".", "cannot read"),  # a 2**63-byte string
        (b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00id\x85R.", "a reference to posix.system"),
        (b"\x80\x02cbuiltins\neval\n.", "a reference to builtins.eval"),
        (b"\x80\x02ctorch\nload\n.", "a reference to torch.load"),
        (b"\x80\x04\x8c\x09__torch__\x8c\x03a\nb\x93)\x81}b.", "a reference to __torch__.a b, which"),
        (b"\x80\x02c__torch__\nM\n)X\x01\x00\x00\x00a\x85\x81.", "an object built with arguments"),
        (b"\x80\x02c__torch__\nM\n)\x81)b.", "whose state is not a dict of attributes"),
        (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}b.", "a malformed pickle stream"),  # BUILD on torch's
        (b"\x80\x02ctorch\nFloatStorage\n)R.", "a call of a dtype"),
        (b"\x80\x02ctorch\nQInt8Storage\n.", "quantized or sparse tensors (torch.QInt8Storage)"),
        (b"\x80\x02ctorch._utils\n_rebuild_qtensor\n.", "quantized or sparse tensors (torch._utils._rebuild_qtensor)"),
        (b"\x80\x02N0.", "the pickle opcode POP"),
        (_TENSOR % b"(K\x09t(K\x01t", "a tensor of size [9] that reaches past its storage record 0"),
        (_TENSOR % b"(\x8a\x06\x00\x00\x00\x00\x00\x01\x8a\x06\x00\x00\x00\x00\x00\x01t(K\x00K\x00t", "elements"),
        (_TENSOR % b"(K\x02t(K\x01K\x01t", "sizes and strides are not lists of counts"),
        (_TENSOR % b"(J\xff\xff\xff\xfft(K\x01t", "sizes and strides are not lists of counts"),
    ],
    ids=lambda value: None if isinstance(value, bytes) else value.split(" (")[0][:40],
)
def test_crafted_pickle_streams_are_refused_at_once_in_one_line(tmp_path: Path, pickled: bytes, match: str) -> None:
    path = _archive(tmp_path / "crafted.jit", pickled)
    error = _error_within(20, read_jit_state, path)
    assert isinstance(error, CheckpointError), error
    assert match in str(error) and "\n" not in str(error) and str(path) in str(error)


def test_a_file_cannot_change_the_readers_own_functions(tmp_path: Path) -> None:
    from tokenizer_posttrain.io import jit_archive

    before = jit_archive._rebuild_tensor.__defaults__
    # BUILD with a slot state on the function the archive names: pickle would set its attributes.
    pickled = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}X\x0c\x00\x00\x00__defaults__)s\x86b."
    assert isinstance(_error_within(20, read_jit_state, _archive(tmp_path / "m.jit", pickled)), CheckpointError)
    assert jit_archive._rebuild_tensor.__defaults__ == before


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: _archive(p, _TENSOR % b"(K\x02t(K\x01t", compress=zipfile.ZIP_DEFLATED), "a compressed record"),
        (lambda p: _archive(p, b"\x80\x02}" + b"}" * 1000 + b".", compress=zipfile.ZIP_DEFLATED), "compressed"),
        (lambda p: _overlapping(p), "records that overlap"),
        (lambda p: _encrypted(p), "encrypted or compressed in an unusual way"),
        (
            lambda p: _archive(p, _TENSOR % b"(K\x02t(K\x01t", code=b"class M(Module):\n  __buffers__ = 1\n"),
            "whose __buffers__ is not a list of names",
        ),
    ],
    ids=["compressed-data-pkl", "inflating-data-pkl", "overlapping-records", "encrypted", "odd-declarations"],
)
def test_crafted_zips_are_refused(tmp_path: Path, make, match: str) -> None:  # noqa: ANN001
    path = tmp_path / "crafted.jit"
    make(path)
    error = _error_within(20, read_jit_state, path)
    assert isinstance(error, CheckpointError) and match in str(error), error


def _overlapping(path: Path) -> None:
    # Two names whose entries point at the same bytes: one stretch of the file read as many records.
    _archive(path, _TENSOR % b"(K\x02t(K\x01t")
    with zipfile.ZipFile(path) as archive:
        infos = {i.filename: i for i in archive.infolist()}
    data = bytearray(path.read_bytes())
    record = data.rindex(b"m/data/0")  # the central directory's entry for record 0
    offset_field = record - 4  # the local header offset is the last field before the name
    data[offset_field : offset_field + 4] = infos["m/code/__torch__.py"].header_offset.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def _encrypted(path: Path) -> None:
    _archive(path, _TENSOR % b"(K\x02t(K\x01t")
    data = bytearray(path.read_bytes())
    central = data.index(b"PK\x01\x02")  # the first central directory entry (data.pkl): its flag bits
    data[central + 8] |= 0x1
    path.write_bytes(bytes(data))


class _OptionalBuffers(nn.Module):
    """A buffer typed Optional[Tensor] (not in torch's state_dict even while it holds a tensor) beside complex
    tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("maybe", torch.ones(2))
        self.register_buffer("phase", torch.tensor([1 + 2j, 3 - 1j]))
        self.weight = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maybe = self.maybe
        return x + self.weight.sum() + self.phase.real.sum() + (maybe.sum() if maybe is not None else x.sum())


# Set here, not as a class annotation: TorchScript cannot resolve the string that `from __future__ import annotations`
# makes of one.
_OptionalBuffers.__annotations__ = {"maybe": Optional[torch.Tensor]}


def test_optional_buffers_and_complex_tensors_read_as_torch_jit_load_reads_them(tmp_path: Path) -> None:
    torch.jit.script(_OptionalBuffers()).save(str(tmp_path / "optional.jit"))
    theirs = jit_load_state(tmp_path / "optional.jit")
    assert "maybe" not in theirs and "phase" in theirs
    assert_same_state(read_jit_state(tmp_path / "optional.jit"), theirs)


def test_many_class_files_inflating_from_a_few_bytes_are_refused_at_once(tmp_path: Path) -> None:
    # Before: 1,000 class files of 2 MiB of blank lines (2.2 KB each, deflated) took 11 minutes to read.
    count = 10
    tree = (
        b"\x80\x02c__torch__\nM\n)\x81}("
        + b"".join(b"X\x04\x00\x00\x00c%03dc__torch__.f%d\nC\n)\x81}b" % (i, i) for i in range(count))
        + b"ub."
    )
    path = _archive(tmp_path / "many.jit", tree)
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        for i in range(count):
            archive.writestr(f"m/code/__torch__/f{i}.py", b"class C(Module):\n" + b"\n" * ((1 << 20) - 20))
    assert path.stat().st_size < 200_000
    error = _error_within(20, read_jit_state, path)
    assert isinstance(error, CheckpointError) and "more than 8388608 bytes of class files" in str(error)


def test_a_code_file_of_many_classes_is_read_once(tmp_path: Path) -> None:
    # Before: each class name parsed its whole code file again (1000 classes and a long comment: minutes).
    classes = b"".join(b"class C%d(Module):\n  __parameters__ = []\n  __buffers__ = []\n" % i for i in range(2000))
    code = _CODE + classes + b"#" * (1 << 19) + b"\n"
    tree = (
        b"\x80\x02c__torch__\nM\n)\x81}("
        + b"".join(b"X\x04\x00\x00\x00c%03dc__torch__\nC%d\n)\x81}b" % (i, i) for i in range(1000))
        + b"ub."
    )
    error = _error_within(20, read_jit_state, _archive(tmp_path / "many.jit", tree, code=code))
    assert error is None


@pytest.mark.parametrize("name", ["model.jit", "model.ckpt", "model.safetensors", "weights", "folder/autoencoder.jit"])
def test_a_fifo_given_as_the_weights_is_refused_without_waiting(
    tmp_path: Path, name: str, exported_dirs: dict[str, Path]
) -> None:
    # Before: the read waited for a writer (a FIFO autoencoder.jit in a folder was skipped for the other files).
    if name.startswith("folder/"):
        shutil.copytree(exported_dirs["CV8x8x8"], tmp_path / "folder")
        (tmp_path / name).unlink()
    os.mkfifo(tmp_path / name)
    error = _error_within(20, load_tokenizer, tmp_path / name.split("/")[0])
    assert isinstance(error, CheckpointError) and f"{tmp_path / name} is a FIFO, not a weights file" in str(error)


def test_a_fifo_given_to_the_commands_is_refused_without_waiting(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    video = write_video(tmp_path / "in.mp4", 9, 16, 16, fps=8)
    codes: list[int] = []
    for args, said in (
        (("decode", "--checkpoint", reference_weights("CV8x8x8"), "--input", fifo), f"latents file {fifo} is a FIFO"),
        (("reconstruct", "--checkpoint", reference_weights("CV8x8x8"), "--input", fifo), f"input video {fifo} is a"),
        (("reconstruct", "--checkpoint", fifo, "--input", video), f"checkpoint {fifo} is a FIFO, not a file"),
    ):
        assert _error_within(20, lambda a=args: codes.append(run_infer(*a, "--output", tmp_path / "o.mp4"))) is None
        assert codes[-1] == 1 and said in capsys.readouterr().err
    runs: list = []
    launch = (f"model.jit_ckpt_pth={fifo}", "--factory", "tiny")
    assert _error_within(120, lambda: runs.append(run_cli_here(*launch, cwd=tmp_path))) is None
    assert runs[0].returncode == 1 and f"{fifo} is a FIFO, not a weights file" in runs[0].stderr


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
