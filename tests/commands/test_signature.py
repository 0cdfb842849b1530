"""Options made from a typed function: names, types, defaults and help from one source."""

from __future__ import annotations

import argparse
from typing import Literal, Optional

import pytest

from tokenizer_posttrain.commands.signature import add_function_arguments, call_with_arguments, docstring_args


def job(
    base: str,
    steps: int = 200,
    lr: float = 1e-4,
    mode: Literal["all", "decoder"] = "all",
    size: Optional[int] = None,
    sweep: bool = False,
    lrs: Optional[list[float]] = None,
) -> dict:
    """Run a job.

    Args:
        base: the base checkpoint
        steps: optimizer steps
        lr: learning rate,
            over two lines
        mode: what trains
        size: crop size
        sweep: try several
        lrs: rates to try
    """
    return dict(base=base, steps=steps, lr=lr, mode=mode, size=size, sweep=sweep, lrs=lrs)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_function_arguments(p, job)
    return p


def test_defaults_types_and_choices_come_from_the_signature() -> None:
    args = parser().parse_args(["--base", "b"])
    assert call_with_arguments(job, args) == job("b")
    args = parser().parse_args(
        [
            "--base",
            "b",
            "--steps",
            "7",
            "--lr",
            "3e-5",
            "--mode",
            "decoder",
            "--size",
            "64",
            "--sweep",
            "--lrs",
            "1",
            "2",
        ]
    )
    assert call_with_arguments(job, args) == job("b", 7, 3e-5, "decoder", 64, True, [1.0, 2.0])


def test_required_and_invalid_values_are_refused() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args([])  # --base is required
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parser().parse_args(["--base", "b", "--mode", "encoder"])
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parser().parse_args(["--base", "b", "--steps", "many"])


def test_help_is_the_docstring() -> None:
    assert docstring_args(job)["lr"] == "learning rate, over two lines"
    text = parser().format_help()
    assert "optimizer steps (default: 200)" in text and "the base checkpoint" in text
