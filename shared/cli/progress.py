"""Progress of a run while it goes: done/total, passed, failed, errors, retries, rate and ETA.

`RunProgress` counts results as they arrive (pure: the clock is passed in) and formats one
line. `ProgressPrinter` writes it: on a terminal one line redrawn in place, when piped (CI) a
plain line every `interval_s` seconds (and one at the end), so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from shared.core.outcome import error_kind

if TYPE_CHECKING:
    from shared.core.models import VerificationResult


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


@dataclass
class RunProgress:
    total: int
    started: float
    done: int = 0
    passed: int = 0
    failed: int = 0
    errors: int = 0
    retrying: int = 0  # messages the services are retrying right now (redelivered, not yet acked)
    seen: set[str] = field(default_factory=set)

    def add(self, result: VerificationResult) -> None:
        """Count one finalized result (once per result id)."""
        # local import: shared.analysis (15 modules) would slow every command's start-up
        from shared.analysis.report import score_of

        rid = result.metadata.result_id
        if rid in self.seen:
            return
        self.seen.add(rid)
        self.done += 1
        if error_kind(result) is not None:
            self.errors += 1
        elif (score_of(result) or 0.0) >= 1.0:
            self.passed += 1
        else:
            self.failed += 1

    def rate(self, now: float) -> float:
        elapsed = now - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def line(self, now: float) -> str:
        rate = self.rate(now)
        left = self.total - self.done
        if left <= 0:
            eta = "done"
        elif rate > 0:
            eta = f"ETA {_duration(left / rate)}"
        else:
            eta = "ETA --"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (f"{self.done}/{self.total} done ({pct:.0f}%), {self.passed} passed, {self.failed} failed, "
                f"{self.errors} errors, {self.retrying} retrying, {rate:.1f}/s, {eta}, "
                f"elapsed {_duration(now - self.started)}")


class ProgressPrinter:
    """Writes a RunProgress to `out`: redrawn in place on a terminal, periodic lines when piped."""

    def __init__(self, progress: RunProgress, out: TextIO | None = None, *, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, tty: bool | None = None) -> None:
        self.progress = progress
        self.out = out or sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.interval_s = interval_s if not self.tty else 0.2
        self.clock = clock
        self._last = -1e18
        self._width = 0

    def update(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        text = self.progress.line(now)
        if self.tty:
            pad = max(0, self._width - len(text))
            self.out.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.out.write("progress: " + text + "\n")
        self.out.flush()

    def finish(self) -> None:
        self.update(force=True)
        if self.tty:
            self.out.write("\n")
            self.out.flush()
