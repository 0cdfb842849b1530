"""layout: the official file set's names, the shapes a model's weights must have, and how weights differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokenizer_posttrain.core.errors import CheckpointError
from tokenizer_posttrain.io.layout import describe_config, diff_layout, expected_shapes, load_safetensors
from tokenizer_posttrain.network import build_tokenizer, get_config


def test_expected_shapes_are_the_built_networks() -> None:
    config = get_config("CV8x8x8", channels=16)
    built = {k: tuple(v.shape) for k, v in build_tokenizer("CV8x8x8", channels=16).state_dict().items()}
    assert expected_shapes(config) == built


def test_a_layout_difference_names_each_kind_and_counts_what_it_leaves_out() -> None:
    expected = {"a": (2,), "b": (3,), "c": (4, 4)}
    state = {"a": torch.zeros(2), "c": torch.zeros(4, 5), **{f"x{i}": torch.zeros(1) for i in range(7)}}
    diff = diff_layout(state, expected)
    assert (diff.missing, diff.wrong_shape) == (["b"], ["c (4, 5) (expected (4, 4))"])
    assert diff.unexpected == [f"x{i}" for i in range(7)] and diff.size == 9
    text = diff.describe(limit=5)
    assert text.startswith("missing keys: b; unexpected keys: x0, x1, x2, x3, x4, ... (7 in all); wrong shapes: c")
    assert diff_layout({"a": torch.zeros(2)}, {"a": (2,)}).size == 0


def test_a_config_is_described_by_name_and_by_width_only_where_it_differs() -> None:
    base = get_config("DV8x16x16")
    assert describe_config(base) == "DV8x16x16"
    assert describe_config(base.replace(channels=16)) == "DV8x16x16 (channels=16)"


def test_a_truncated_safetensors_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(path))
    assert torch.equal(load_safetensors(path)["w"], torch.arange(1000, dtype=torch.float32))
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors.*truncated or corrupt"):
        load_safetensors(path)
