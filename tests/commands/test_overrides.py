"""The override groups read from the config dataclasses: documentation, types, the help lines, and the checks of
--yaml files and command-line override keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from tokenizer_posttrain.commands.overrides import (
    check_override_keys,
    check_yaml_file,
    field_docs,
    settings_help,
    type_name,
)
from tokenizer_posttrain.core.errors import CommandError
from tokenizer_posttrain.training.train import train


@dataclass
class Base:
    """A base config."""

    weight: float = 0.0
    """Weight of the term,
    over two lines."""
    steps: list[int] = field(default_factory=list)


@dataclass
class Child(Base):
    weight: float = 1.0
    name: Optional[str] = None
    """The ``name``."""


@dataclass
class Outer:
    """Outer group."""

    child: Child = field(default_factory=Child)
    """A nested config."""
    size: int = 3


def job(outer: Outer, other: int = 1) -> None:
    """A job."""


def test_field_docs_are_the_string_under_each_field_and_inherited_when_redeclared() -> None:
    # Child.weight redeclares the default only: the base's documentation still applies.
    assert field_docs(Child) == {"weight": "Weight of the term, over two lines.", "name": "The name."}
    assert field_docs(Outer) == {"child": "A nested config."}


def test_type_names_read_as_python() -> None:
    assert [type_name(t) for t in (int, Optional[str], list[str], Optional[dict[str, float]])] == [
        "int",
        "str | None",
        "list[str]",
        "dict[str, float] | None",
    ]


def test_help_lines_hold_key_type_default_doc_and_nested_groups() -> None:
    text = settings_help(job)
    assert text.splitlines() == [
        "",
        "outer.*  — Outer group.",
        "  outer.child.*  — A nested config.",
        "    outer.child.weight: float = 1.0  — Weight of the term, over two lines.",
        "    outer.child.steps: list[int] = []",
        "    outer.child.name: str | None = None  — The name.",
        "  outer.size: int = 3",
    ]


def test_help_shows_what_a_recipe_sets_beside_the_default() -> None:
    import recipes
    from tokenizer_posttrain.training.config import DataConfig

    text = settings_help(train, "tiny", recipes.tiny.tiny())
    assert f"data.frames: int = {DataConfig().frames}  [tiny: 17]  — Frames per clip" in text
    assert "  data.hflip: bool = False  — Flip half" in text  # the recipe leaves it: no bracket


def test_every_config_field_is_in_the_help_with_its_default() -> None:
    text = settings_help(train)

    def walk(prefix: str, cls: type) -> None:
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if dataclasses.is_dataclass(default):
                assert f"{prefix}.{f.name}.*" in text
                walk(f"{prefix}.{f.name}", type(default))
            else:
                assert f" {prefix}.{f.name}: " in text and f" = {default!r}" in text, f"{prefix}.{f.name}"

    from tokenizer_posttrain.commands.overrides import groups

    for name, cls in groups(train).items():
        walk(name, cls)


@pytest.mark.parametrize(
    "text, message",
    [
        ("- a\n- b\n", "f.yaml: the top level must be a mapping of override groups (model, data, trainer,"),
        ("modle:\n  channels: 16\n", "f.yaml: 'modle' is not an override group (did you mean model?)"),
        ("model:\n  chanels: 16\n", "f.yaml: model.chanels is not a setting (did you mean model.channels?)"),
        ("model:\n  lora: {rnk: 2}\n", "f.yaml: model.lora.rnk is not a setting (did you mean model.lora.rank?)"),
        ("model: {channels: 16\n", "f.yaml: not valid YAML: expected ',' or '}', but got '<stream end>' (line 2,"),
        ("", "f.yaml is empty; the top level must be a mapping"),
        ("_partial_: true\nmodel: {channels: 16}\n", "f.yaml: delete its top-level _partial_ line"),
    ],
)
def test_a_bad_yaml_file_is_named_with_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(text)
    with pytest.raises(CommandError) as err:
        check_yaml_file(path, train)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_good_yaml_file_passes_with_nemo_runs_own_keys(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    # --to-yaml writes _target_ into every group; values are NeMo-Run's to check.
    path.write_text("model:\n  _target_: x.ModelConfig\n  channels: 16\n  lora: {rank: 2}\nloss:\n  l1: {weight: 2}\n")
    check_yaml_file(path, train)
    with pytest.raises(CommandError, match="no such file"):
        check_yaml_file(tmp_path / "none.yaml", train)


def test_unknown_override_keys_name_the_closest_setting() -> None:
    check_override_keys(["--factory", "tiny", "--yaml", "a=b.yaml", "trainer.max_steps+=2", "model.lora.rank=2"], train)
    for arg, message in [
        ("modle.channels=16", "override modle.channels=16: 'modle' is not an override group (did you mean model?)"),
        ("trainer.max_stepz=3", "cannot apply override trainer.max_stepz=3: no such setting (did you mean trainer.max"),
    ]:
        with pytest.raises(CommandError) as err:
            check_override_keys(["--factory", "tiny", arg], train)
        assert message in str(err.value)
