"""Progress of long loops, readable in a terminal and in a log file alike.

In a terminal a bar redraws in place. Piped to a file (Slurm, torchrun and every batch system write logs that
way) a bar shows nothing until it ends, or a wall of carriage returns; there :class:`LineProgress` prints one
plain line every :func:`progress_interval` seconds instead::

    [reconstruct] 48/120 frames | 1.52 frames/s | elapsed 0:31 | ETA 0:47

:func:`progress` picks one by whether stdout is a terminal. Everything goes to stdout, flushed at once.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol, TextIO

from .errors import UserError

INTERVAL_ENV = "TOKENIZER_POSTTRAIN_PROGRESS_INTERVAL"
"""Environment variable: seconds between two progress lines when stdout is not a terminal (0: a line at every
update)."""
DEFAULT_INTERVAL = 30.0
"""Seconds between two progress lines by default: a 10-hour run writes about 1,200 lines."""


def progress_interval() -> float:
    """Seconds between progress lines: :data:`INTERVAL_ENV` when set, else :data:`DEFAULT_INTERVAL`."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise UserError(
            f"{INTERVAL_ENV}={text!r} is not a number of seconds: set it to e.g. 30 (0 prints at every update), "
            "or unset it"
        )
    return value


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stdout) is a terminal, where a bar can redraw in place."""
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def format_duration(seconds: float) -> str:
    """``M:SS`` under an hour, ``H:MM:SS`` from there on (``0:45``, ``12:03``, ``2:01:07``)."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_rate(rate: float) -> str:
    """Three significant digits without an exponent (``0.0512``, ``1.52``, ``11.0``, ``1234``)."""
    if rate >= 100:
        return f"{rate:.0f}"
    if rate >= 10:
        return f"{rate:.1f}"
    if rate >= 1:
        return f"{rate:.2f}"
    return f"{rate:.3g}"


class Reporter(Protocol):
    """What a loop calls on its progress, whatever shows it: ``update`` after each piece of work (``done``:
    the count so far; ``fields``: more ``name=text`` to show), ``close`` at the end."""

    def update(self, done: int, **fields: str) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Reporter: ...

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None: ...


class LineProgress:
    """Plain progress lines for a log file: ``[name] done/total unit | fields | rate | elapsed | ETA``.

    :meth:`start` prints the first line at once (the log shows the loop began), :meth:`update` the first piece
    done (the work moves; how long the first, often slowest, piece took) and then at most one line every
    ``interval`` seconds (default :func:`progress_interval`), :meth:`close` a last one when the loop took
    longer than that (a short loop leaves just its first lines: the command's own result line follows).
    ``start``: the count the loop starts from (a resumed run's step), which the rate and ETA leave out.
    ``rate``: whether to show ``done`` per second (off where a field says it better, e.g. clips/s).
    """

    def __init__(
        self,
        name: str,
        total: int | None,
        unit: str,
        *,
        start: int = 0,
        interval: float | None = None,
        rate: bool = True,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.total = total if total and total > 0 else None
        self.unit = unit
        self.interval = progress_interval() if interval is None else interval
        self.show_rate = rate
        self.stream = stream
        self.clock = clock
        self.done = self.first = start
        self.began = clock()
        self.base: tuple[float, int] | None = None  # (time, count) of the first update: see line()
        self.last_printed: float | None = None
        self.printed_done: int | None = None
        self.lines = 0

    def start(self, **fields: str) -> None:
        """Print the first line (``done`` is the start count): the log shows the loop began."""
        self.began = self.clock()
        self._print(self.done, fields)

    def due(self) -> bool:
        """Whether the next :meth:`update` with more done prints (callers skip gathering costly fields
        otherwise): the first one after the start, then one ``interval`` after the last line."""
        if self.base is None or self.last_printed is None:
            return True
        return self.clock() - self.last_printed >= self.interval

    def update(self, done: int, **fields: str) -> None:
        """Record ``done``; print a line when ``interval`` seconds have passed since the last one."""
        first = self.base is None and done > self.first
        if first:
            self.base = (self.clock(), done)
        self.done = done
        if first or self.due():
            self._print(done, fields)

    def close(self, **fields: str) -> None:
        """Print the last count, unless already printed or the loop was short (under one interval)."""
        if self.printed_done != self.done and self.clock() - self.began >= self.interval:
            self._print(self.done, fields)

    def __enter__(self) -> LineProgress:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is None:  # after a failure the error says what happened; a count would bury it
            self.close()

    def line(self, done: int, fields: dict[str, str] | None = None) -> str:
        """The text of the line for ``done``, with ``fields`` (``data_wait`` is shown as ``data wait``)."""
        count = f"{done}/{self.total}" if self.total is not None else f"{done}"
        parts = [f"[{self.name}] {count} {self.unit}"]
        parts += [f"{key.replace('_', ' ')} {value}" for key, value in (fields or {}).items()]
        now = self.clock()
        elapsed = now - self.began
        # The rate from the first update on, once there is a later one: the first piece of work (a compile,
        # the loader starting) is often far slower than the rest, and would drag the ETA for hours.
        measured = self.base is not None and done > self.base[1]
        if measured:
            since, counted = self.base[0], done - self.base[1]
        else:
            since, counted = self.began, done - self.first
        speed = counted / (now - since) if now > since else 0.0
        if self.show_rate and done > self.first:
            parts.append(f"{format_rate(speed)} {self.unit}/s")
        parts.append(f"elapsed {format_duration(elapsed)}")
        # No ETA from the first piece alone: a 73 s compile once promised 35 minutes for a 30-step run.
        if self.total is not None and done < self.total and speed > 0 and measured:
            parts.append(f"ETA {format_duration((self.total - done) / speed)}")
        return " | ".join(parts)

    def _print(self, done: int, fields: dict[str, str]) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        print(self.line(done, fields), file=stream, flush=True)
        self.last_printed, self.printed_done = self.clock(), done
        self.lines += 1


class BarProgress:
    """A tqdm bar on stdout, for a terminal; cleared when done (the command's result line takes its place)."""

    def __init__(self, name: str, total: int | None, unit: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, desc=name, unit=unit.rstrip("s") or unit, file=sys.stdout, dynamic_ncols=True, leave=False
        )
        self.done = 0

    def update(self, done: int, **fields: str) -> None:
        """Move the bar to ``done``; ``fields`` as its postfix."""
        self.bar.update(done - self.done)
        self.done = done
        if fields:
            self.bar.set_postfix_str(", ".join(f"{k} {v}" for k, v in fields.items()), refresh=False)

    def close(self) -> None:
        """Clear the bar."""
        self.bar.close()

    def __enter__(self) -> BarProgress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


class NoProgress:
    """Shows nothing (progress turned off)."""

    def update(self, done: int, **fields: str) -> None:
        """Nothing."""

    def close(self) -> None:
        """Nothing."""

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: Any) -> None:  # noqa: ANN401 - nothing to handle
        pass


def progress(name: str, total: int | None, unit: str, enabled: bool = True) -> Reporter:
    """The progress of a loop of ``total`` (None: unknown) ``unit``: a bar when stdout is a terminal, else
    :class:`LineProgress` lines; nothing when not ``enabled``. Use as a context manager."""
    if not enabled:
        return NoProgress()
    if is_terminal():
        return BarProgress(name, total, unit)
    return LineProgress(name, total, unit)
