"""The config.json beside our model.safetensors, and every config a network is built from: a value out of range,
a file that is not a JSON object or not JSON at all, or not a regular file, is refused in one line naming the file
(and the field, its value and the range) before anything is built from it."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenizer_posttrain import load_tokenizer
from tokenizer_posttrain.__main__ import main
from tokenizer_posttrain.core.errors import CheckpointError
from tokenizer_posttrain.io.config_json import MAX_CONFIG_BYTES
from tokenizer_posttrain.io.export import export_tokenizer
from tokenizer_posttrain.network import build_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REEXPORT = "export the tokenizer again, or restore config.json from a copy"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CV8x8x8 export's model.safetensors and config.json (without the .jit files, which a folder loads
    first); read only."""
    full = export_tokenizer(build_tokenizer("CV8x8x8", channels=16), tmp_path_factory.mktemp("export") / "full")
    folder = full.parent / "safetensors"
    folder.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copy(full / name, folder / name)
    return folder


def _copy(exported: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(exported, folder)
    return folder


def _settings(**changes: object) -> Callable[[dict], object]:
    return lambda config: {**config, "tokenizer_config": {**config["tokenizer_config"], **changes}}


ALTERED = "the file was altered or does not describe a Cosmos tokenizer"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # Before: the layout of a hundred million blocks was built until the memory ran out.
        (_settings(num_res_blocks=100_000_000), "num_res_blocks=100000000 is not an integer from 1 to 16;"),
        # Before: a traceback from torch's size arithmetic.
        (_settings(channels=1_000_000_000), "tokenizer_config.channels=1000000000 is not an integer from 1 to 16384"),
        (_settings(channels_mult=[2, 4, 10**9]), r"tokenizer_config.channels_mult=\[2, 4, 1000000000\] is not a list"),
        (_settings(channels=4096, channels_mult=[2, 4, 8]), r"channels=4096 x channels_mult=\[2, 4, 8\] makes a layer"),
        (_settings(latent_channels=2**40), "tokenizer_config.latent_channels=1099511627776 is not an integer from 1"),
        (_settings(patch_size=3), "tokenizer_config.patch_size=3 is not a power of two from 1 to 16"),
        (_settings(levels=[256] * 16), r"tokenizer_config.levels=\[256, .* make a codebook of .* codes, more than"),
        (_settings(dropout="0.1"), r"tokenizer_config.dropout='0.1' is not a number in \[0, 1\)"),
        # Before: these loaded, under a name no model has, or a DV kind with a CV model's name.
        (_settings(name="CV8x8x8x"), "tokenizer_config.name='CV8x8x8x' is not one of CV8x8x8, CV8x16x16"),
        (_settings(kind="DV"), "tokenizer_config.kind='DV', but CV8x8x8 is of kind 'CV'"),
        # Before: a traceback, or the whole config in a message.
        (_settings(channel=16), r"tokenizer_config has unknown fields \['channel'\]"),
        (lambda config: {**config, "tokenizer_config": [16]}, "tokenizer_config is not a mapping of tokenizer"),
    ],
)  # fmt: skip
def test_a_config_value_out_of_range_is_refused_in_one_line_naming_file_field_and_range(
    exported: Path, tmp_path: Path, edit: Callable[[dict], object], message: str
) -> None:
    folder = _copy(exported, tmp_path)
    meta = folder / "config.json"
    meta.write_text(json.dumps(edit(json.loads(meta.read_text()))))
    with pytest.raises(CheckpointError, match=message) as refused:
        load_tokenizer(folder)
    assert str(refused.value).startswith(f"{meta}: ") and ALTERED in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # Before: "'list' object has no attribute 'get'" and a traceback, for each.
        ("[1, 2]", "holds a JSON array, not an object of settings"),
        ('"tokenizer"', "holds a JSON string, not an object of settings"),
        ("16", "holds a JSON number, not an object of settings"),
        # Before: json's message without the file's name.
        ('{"tokenizer_config": {\n  "name": "CV8x8x8",\n}', r"is not valid JSON \(.* at line 3, column 1\)"),
        (b'{"name": "\xff"}', r"is not text \(byte 10 is not UTF-8\)"),
    ],
)
def test_a_config_json_that_is_not_a_json_object_is_refused_in_one_line_naming_it(
    exported: Path, tmp_path: Path, content: str | bytes, message: str
) -> None:
    folder = _copy(exported, tmp_path)
    meta = folder / "config.json"
    meta.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError, match=message) as refused:
        load_tokenizer(folder)
    assert str(refused.value).startswith(str(meta)) and str(refused.value).endswith(REEXPORT)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        # Before: a FIFO was skipped without a word (and a reader of it would wait for a writer forever).
        (os.mkfifo, r"config.json is a FIFO, not a regular file; export the tokenizer again"),
        (os.mkdir, r"config.json is a folder, not a regular file"),
        # Before: read whole, then json's traceback.
        (lambda p: p.write_bytes(b" " * (MAX_CONFIG_BYTES + 1)), rf"is {MAX_CONFIG_BYTES + 1} bytes, more than the"),
    ],
)
def test_a_config_json_that_cannot_be_read_is_refused_in_one_line_without_waiting(
    exported: Path, tmp_path: Path, make: Callable[[Path], object], message: str
) -> None:
    folder = _copy(exported, tmp_path)
    (folder / "config.json").unlink()
    make(folder / "config.json")
    with pytest.raises(CheckpointError, match=message) as refused:
        load_tokenizer(folder / "model.safetensors")
    assert str(refused.value).endswith(REEXPORT) and "\n" not in str(refused.value)


def test_a_config_json_is_read_through_its_link_and_a_dangling_link_is_refused(exported: Path, tmp_path: Path) -> None:
    folder = _copy(exported, tmp_path)
    blob = tmp_path / "blobs" / "0123abcd"  # as in the Hugging Face cache, whose folders link each file to a blob
    blob.parent.mkdir()
    (folder / "config.json").rename(blob)
    (folder / "config.json").symlink_to(blob)
    assert load_tokenizer(folder).config.channels == 16
    blob.unlink()
    # Before: skipped without a word, the model then guessed from the weights.
    with pytest.raises(CheckpointError, match=r"config.json does not exist \(a link to a missing file\?\)") as refused:
        load_tokenizer(folder)
    assert str(refused.value).endswith(REEXPORT) and "\n" not in str(refused.value)


def test_the_export_command_refuses_a_bad_config_in_one_error_line(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _copy(exported, tmp_path)
    (folder / "config.json").write_text("[]")
    assert main(["export", "--checkpoint", str(folder), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {folder / 'config.json'} holds a JSON array, not an object of settings; {REEXPORT}\n"
    assert not (tmp_path / "out").exists()


def test_every_tokenizer_setting_is_known_and_every_number_bounded() -> None:
    # A field added to TokenizerConfig without a bound here would be refused as unknown, or built unchecked.
    from dataclasses import fields

    from tokenizer_posttrain.io.config_json import _KNOWN, INTEGERS, POWERS_OF_TWO
    from tokenizer_posttrain.network.cosmos import TokenizerConfig

    assert {f.name for f in fields(TokenizerConfig)} == _KNOWN
    numbers = {f.name for f in fields(TokenizerConfig) if f.type in ("int", int)}
    assert numbers and numbers <= set(INTEGERS) | set(POWERS_OF_TWO), numbers - set(INTEGERS) - set(POWERS_OF_TWO)


def test_a_value_too_long_to_print_is_named_by_its_size() -> None:
    from tokenizer_posttrain.io.config_json import shown

    assert shown(10**5000) == f"an integer of {(10**5000).bit_length()} bits"
    assert shown("x" * 100) == repr("x" * 50)[:50] + "... (102 characters)"
