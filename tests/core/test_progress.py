"""Progress in a terminal and in a log file: plain lines at an interval, the ETA, the interval setting."""

from __future__ import annotations

import io

import pytest

from tokenizer_posttrain.core.errors import UserError
from tokenizer_posttrain.core.progress import (
    INTERVAL_ENV,
    BarProgress,
    LineProgress,
    NoProgress,
    format_duration,
    format_rate,
    progress,
    progress_interval,
)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lines_come_at_the_start_then_at_most_every_interval_then_at_the_end() -> None:
    clock, out = Clock(), io.StringIO()
    line = LineProgress("reconstruct", 120, "frames", interval=30, stream=out, clock=clock)
    with line:
        for done in range(10, 121, 10):
            clock.now += 10  # 10 frames in 10 s, but a line only every 30 s
            line.update(done)
    lines = out.getvalue().splitlines()
    assert lines == [
        "[reconstruct] 0/120 frames | elapsed 0:00",
        "[reconstruct] 10/120 frames | 1.00 frames/s | elapsed 0:10",  # no ETA from the first piece alone
        "[reconstruct] 40/120 frames | 1.00 frames/s | elapsed 0:40 | ETA 1:20",
        "[reconstruct] 70/120 frames | 1.00 frames/s | elapsed 1:10 | ETA 0:50",
        "[reconstruct] 100/120 frames | 1.00 frames/s | elapsed 1:40 | ETA 0:20",
        "[reconstruct] 120/120 frames | 1.00 frames/s | elapsed 2:00",
    ]
    assert "\r" not in out.getvalue()


def test_a_loop_shorter_than_the_interval_prints_only_its_first_line() -> None:
    clock, out = Clock(), io.StringIO()
    with LineProgress("encode", 3, "frames", interval=30, stream=out, clock=clock) as line:
        for done in (1, 2, 3):
            clock.now += 1
            line.update(done)
    # The first update prints (the log shows the work moves), the end does not: the command's result follows.
    assert out.getvalue().splitlines() == [
        "[encode] 0/3 frames | elapsed 0:00",
        "[encode] 1/3 frames | 1.00 frames/s | elapsed 0:01",
    ]


def test_the_eta_leaves_out_the_slow_first_piece_and_the_steps_before_a_resume() -> None:
    clock, out = Clock(), io.StringIO()
    line = LineProgress("train", 100, "steps", start=40, interval=0, rate=False, stream=out, clock=clock)
    line.start()
    clock.now += 300  # the first step compiles
    line.update(41, loss="0.5")
    clock.now += 10  # then 1 step/s
    line.update(51, loss="0.25", data_wait="0.01 s")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[train] 40/100 steps | elapsed 0:00"
    assert lines[1] == "[train] 41/100 steps | loss 0.5 | elapsed 5:00"  # a 5-minute compile promises no 5 hours
    assert lines[2] == "[train] 51/100 steps | loss 0.25 | data wait 0.01 s | elapsed 5:10 | ETA 0:49"


def test_an_unknown_total_shows_the_count_and_rate_without_an_eta() -> None:
    clock, out = Clock(), io.StringIO()
    line = LineProgress("train", None, "steps", interval=0, stream=out, clock=clock)
    line.start()
    clock.now += 4
    line.update(8)
    assert out.getvalue().splitlines()[-1] == "[train] 8 steps | 2.00 steps/s | elapsed 0:04"


def test_after_a_failure_no_last_line_buries_the_error() -> None:
    clock, out = Clock(), io.StringIO()
    with pytest.raises(RuntimeError), LineProgress("x", 10, "clips", interval=1, stream=out, clock=clock) as line:
        clock.now += 5
        line.done = 3
        raise RuntimeError("boom")
    assert out.getvalue().splitlines() == ["[x] 0/10 clips | elapsed 0:00"]


def test_formats() -> None:
    assert [format_duration(s) for s in (0, 45.9, 61, 3599, 3600, 36061)] == [
        "0:00",
        "0:45",
        "1:01",
        "59:59",
        "1:00:00",
        "10:01:01",
    ]
    assert [format_rate(r) for r in (0.05123, 1.523, 11.04, 1234.4)] == ["0.0512", "1.52", "11.0", "1234"]


def test_the_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert progress_interval() == 30.0
    monkeypatch.setenv(INTERVAL_ENV, "2.5")
    assert progress_interval() == 2.5
    assert LineProgress("x", 1, "clips").interval == 2.5
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(INTERVAL_ENV, bad)
        with pytest.raises(UserError, match=f"{INTERVAL_ENV}='{bad}' is not a number of seconds"):
            progress_interval()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_in_a_terminal_lines_elsewhere(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0")
    with progress("evaluate", 2, "clips") as shown:  # pytest's captured stdout is no terminal
        shown.update(1, mean_psnr="30.00 dB")
    assert isinstance(shown, LineProgress)
    assert "[evaluate] 1/2 clips | mean psnr 30.00 dB | " in capsys.readouterr().out
    assert isinstance(progress("evaluate", 2, "clips", enabled=False), NoProgress)
    screen = Terminal()
    monkeypatch.setattr("sys.stdout", screen)
    with progress("evaluate", 2, "clips") as shown:
        shown.update(2)
    assert isinstance(shown, BarProgress) and "evaluate:" in screen.getvalue() and "/2 [" in screen.getvalue()
