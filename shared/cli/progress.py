"""Progress of a run while it goes: done/total, passed, failed, errors, retries, rate and ETA.

`RunProgress` counts results as they arrive (pure: the clock is passed in) and formats one
line. `ProgressPrinter` writes it: on a terminal one line redrawn in place, when piped (CI) a
plain line every `interval_s` seconds (and one at the end), so logs stay readable.
`StackWatch` names the local stack's processes that are DEAD while a run is followed (a warning
line once per death, `DEAD: ...` on the progress line), looking at most every `every_s` seconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from shared.control.processes import is_nats
from shared.control.stack import StackState
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
    dead: list[str] = field(default_factory=list)  # the local stack's processes that are not running
    seen: set[str] = field(default_factory=set)
    # rubric_only: a result passes on its rubric traits' mean (as the summary scores it), said on the line
    by_rubric: bool = False
    trait_ranges: Mapping[str, tuple[float, float]] | None = None

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
        elif (score_of(result, self.trait_ranges) or 0.0) >= 1.0:
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
        return (f"{self.done}/{self.total} done ({pct:.0f}%), {self.passed} passed{' by the rubric' if self.by_rubric else ''}, "
                f"{self.failed} failed, "
                f"{self.errors} errors, {self.retrying} retrying, {rate:.1f}/s, {eta}, "
                f"elapsed {_duration(now - self.started)}" + (f", DEAD: {', '.join(self.dead)}" if self.dead else ""))


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

    def note(self, text: str) -> None:
        """A line of its own (a warning), above the progress line on a terminal."""
        if self.tty and self._width:
            self.out.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.out.write(text + "\n")
        self.out.flush()
        if self.tty:
            self.update(force=True)

    def finish(self) -> None:
        self.update(force=True)
        if self.tty:
            self.out.write("\n")
            self.out.flush()


WATCH_EVERY_S = 2.0  # how often a followed run looks at the local stack's processes


class StackWatch:
    """The processes of the local stack in `home` that are DEAD while a run is followed: `check`
    returns a warning line once per death (and a note when one runs again, after `veribus up`),
    naming the process, its PID, what waits for it and `veribus up`; `dead` is what is down now.
    Looks (stack.json and each PID's identity) at most every `every_s` seconds."""

    def __init__(self, home: Path, *, every_s: float = WATCH_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 load: Callable[[Path], StackState | None] | None = None) -> None:
        self.home = home
        self.every_s = every_s
        self.clock = clock
        self.load = load or StackState.load
        self.dead: list[str] = []
        self._said: dict[str, int] = {}  # process name -> the PID whose death was said
        self._next = -1e18

    def check(self) -> list[str]:
        now = self.clock()
        if now < self._next:
            return []
        self._next = now + self.every_s
        try:
            state = self.load(self.home)
        except (OSError, ValueError, TypeError):  # stack.json being rewritten (`veribus up`), or gone
            return []
        if state is None:
            return []
        dead = state.dead()
        self.dead = [p.name for p in dead]
        lines = [f"note: the local stack's {name} is running again" for name in sorted(self._said)
                 if name not in self.dead]
        self._said = {name: pid for name, pid in self._said.items() if name in self.dead}
        for p in dead:
            if self._said.get(p.name) != p.pid:
                self._said[p.name] = p.pid
                lines.append(f"warning: the local stack's {p.name} is DEAD (pid {p.pid} exited): "
                             f"{_waits_for(state, p.name)}; `veribus up` restarts it")
        return lines


def _waits_for(state: StackState, name: str) -> str:
    """What a run loses while the stack's process `name` is dead."""
    if is_nats(name):
        alive = [p.name for p in state.nats_procs() if p.alive()]
        return f"{', '.join(alive)} carry on the bus" if alive else "the bus is gone, and the run with it"
    if name == "simulator":
        return "the simulated models' calls fail and are retried"
    service = name.split("-")[0]
    others = [p.name for p in state.replicas_of(service) if p.name != name and p.alive()]
    if others:
        return f"{', '.join(others)} carry on its work"
    if service == "projector":
        return "results are not written to ClickHouse meanwhile (the stream keeps them; it writes them when back)"
    return "the run's jobs wait for it at that stage"
