"""A progress bar for long commands (``demo``, ``eval``, ``generate``), written to stderr.

On a terminal it redraws one line in place; elsewhere (a log, a pipe, a test) it writes a
line at most every ``interval`` seconds and one when the work is done, so a captured run
shows progress without flooding its log.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 24


class ProgressBar:
    """``update(done)`` for ``total`` units of work; ``rate_unit`` names what the rate
    counts (e.g. tokens, with ``update(done, rate_count=tokens_so_far)``)."""

    def __init__(
        self,
        label: str,
        total: int,
        unit: str,
        rate_unit: str | None = None,
        stream: TextIO | None = None,
        interval: float | None = None,
    ) -> None:
        self.label, self.total, self.unit, self.rate_unit = label, max(total, 0), unit, rate_unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.1 if self.tty else 5.0)
        self.start = time.perf_counter()
        self._shown_at: float | None = None
        self._done = 0
        self._closed = False
        # (time, units) when the first units were done: the time before them (loading,
        # compiling) says nothing of the rate, so the estimate waits for units after them
        self._first: tuple[float, int] | None = None

    def line(self, done: int, rate_count: int | None = None) -> str:
        """The text of the bar for ``done`` units (``rate_count`` units of ``rate_unit``)."""
        frac = min(1.0, done / self.total) if self.total else 1.0
        filled = round(frac * WIDTH)
        elapsed = time.perf_counter() - self.start
        text = (
            f"{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {done}/{self.total} {self.unit}"
        )
        if self.rate_unit is not None and rate_count is not None and elapsed > 0:
            text += f", {rate_count / elapsed:.1f} {self.rate_unit}/s"
        text += f", {elapsed:.0f} s"
        left = self.seconds_left(done)
        if left is not None:
            text += f", about {left:.0f} s left"
        return text

    def seconds_left(self, done: int, now: float | None = None) -> float | None:
        """The time the remaining units take at the rate since the first units were done;
        None until units after those give a rate (and once the work is done)."""
        now = time.perf_counter() if now is None else now
        if self._first is None:
            if done > 0:
                self._first = (now, done)
            return None
        since, first = self._first
        if done <= first or done >= self.total or now <= since:
            return None
        return (self.total - done) * (now - since) / (done - first)

    def update(self, done: int, rate_count: int | None = None) -> None:
        if self._closed:
            return
        self._done = done
        now = time.perf_counter()
        finished = done >= self.total
        if not finished and self._shown_at is not None and now - self._shown_at < self.interval:
            return
        self._shown_at = now
        text = self.line(done, rate_count)
        if self.tty:
            self.stream.write("\r" + text + ("\n" if finished else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        if finished:
            self._closed = True

    def finish(self, done: int | None = None, rate_count: int | None = None) -> None:
        """The last line: ``done`` units (default: the total), even when work ended short of
        the total it was sized for (e.g. requests that stopped at an end-of-sequence)."""
        if self._closed:
            return
        if done is not None and done < self.total:
            self.total = done
        self.update(self.total, rate_count)

    def close(self) -> None:
        """End a bar that stopped short of its total (an error, a stop): keep its last line."""
        if not self._closed and self.tty and self._shown_at is not None:
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True


class StageBars:
    """One bar per stage of a long job (``progress(stage, done, total)`` callbacks, e.g.
    an evaluation's), made when the stage first reports and closed on exit."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.bars: dict[str, ProgressBar] = {}

    def update(self, stage: str, done: int, total: int) -> None:
        if stage not in self.bars:
            self.bars[stage] = ProgressBar(
                f"{self.label} {stage}", total, "tokens", rate_unit="tokens"
            )
        self.bars[stage].update(done, rate_count=done)

    def __enter__(self) -> StageBars:
        return self

    def __exit__(self, *exc) -> None:
        for bar in self.bars.values():
            bar.close()
