"""Progress of long commands, as plain lines on stderr.

Plain lines rather than a live bar: they read the same in a terminal, a log file, CI and a
notebook (a live bar prints nothing until the end where stdout is not a terminal). The time
left is estimated from the items done so far on this machine, never from a constant measured
on another one, and is not said until one item has finished.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from klotski_sim.util.units import span_text

MIN_INTERVAL_S = 5.0  # between two lines, unless an item took longer (a line per item then)


def say(text: str, stream: TextIO | None = None) -> None:
    """One progress line on stderr (or `stream`), flushed at once."""
    print(text, file=stream or sys.stderr, flush=True)


class Progress:
    """`done()` once per finished item of `total`; prints `WHAT: i/N LABEL, T elapsed, about R left`
    at most every MIN_INTERVAL_S seconds, and always for the first and the last item."""

    def __init__(
        self,
        what: str,
        total: int,
        done: int = 0,
        enabled: bool = True,
        out: Callable[[str], None] = say,
        clock: Callable[[], float] = time.monotonic,
        min_interval_s: float = MIN_INTERVAL_S,
    ) -> None:
        self.what, self.total, self.count, self.enabled = what, total, done, enabled
        self.out, self.clock, self.min_interval_s = out, clock, min_interval_s
        self.already, self.started = done, clock()
        self.last_line: float | None = None

    def done(self, label: str = "") -> None:
        self.count += 1
        now = self.clock()
        first, last = self.count == self.already + 1, self.count >= self.total
        if not self.enabled or not (
            first or last or self.last_line is None or now - self.last_line >= self.min_interval_s
        ):
            return
        self.last_line = now
        self.out(self.line(now, label))

    def line(self, now: float, label: str = "") -> str:
        elapsed = now - self.started
        text = f"{self.what}: {self.count}/{self.total}{' ' + label if label else ''}, {span_text(elapsed)}"
        finished_here = self.count - self.already
        if finished_here > 0 and self.count < self.total:
            left = elapsed / finished_here * (self.total - self.count)
            text += f", about {span_text(left)} left"
        return text
