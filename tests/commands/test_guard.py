"""One mapping from failures to exit codes for every command."""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.commands.guard import run_guarded
from tokenizer_posttrain.core.errors import (
    CheckpointError,
    CommandError,
    DataError,
    EvaluationError,
    WorseThanBaseError,
)


def raising(error: BaseException):  # noqa: ANN201
    def command() -> int:
        raise error

    return command


@pytest.mark.parametrize(
    "error",
    [
        CheckpointError("ckpt.jit: truncated"),
        DataError("data.path=x: no shards"),
        EvaluationError("no usable clip"),
        CommandError("input video x does not exist"),
        ValueError("invalid optim.lr=0"),
        FileNotFoundError("vgg16-397923af.pth not found"),
    ],
)
def test_expected_errors_are_one_line_and_exit_1(error: Exception, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_guarded(raising(error)) == 1
    err = capsys.readouterr().err
    assert err == f"error: {error}\n"


def test_a_result_worse_than_the_base_exits_3_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # 3: neither a failure (1) nor argparse's bad command line (2).
    assert run_guarded(raising(WorseThanBaseError("WORSE than the base: PSNR 6.34 -> 5.92 dB"))) == 3
    assert capsys.readouterr().err == "error: WORSE than the base: PSNR 6.34 -> 5.92 dB\n"


def test_out_of_memory_says_what_to_lower(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_guarded(raising(torch.OutOfMemoryError("CUDA out of memory")), oom_hint="use --tile 256") == 1
    assert capsys.readouterr().err == "error: out of memory; use --tile 256\n"


def test_interrupt_exits_130(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_guarded(raising(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "error: interrupted\n"


def test_a_bug_keeps_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_guarded(raising(ZeroDivisionError("division by zero"))) == 1
    err = capsys.readouterr().err
    assert (
        "Traceback" in err
        and "ZeroDivisionError" in err
        and err.endswith("error: the command failed (traceback above)\n")
    )


def test_the_command_s_own_code_passes_through() -> None:
    assert run_guarded(lambda: 3) == 3 and run_guarded(lambda: None) == 0
