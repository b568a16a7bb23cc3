"""Waiting for a run: its finalized results, counted on the stream (one result.finalized subject per
result), and its rows in the store (`wait_projected`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from shared.control.streams import subject_counts
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus
from shared.store.reads import run_query

log = logging.getLogger("veribus.lifecycle")


async def wait_for_results(
    settings: Settings, run_id: str, *, result_ids: Iterable[str] | None = None, count: int | None = None,
    baseline: dict[str, int] | None = None, timeout: float = 600.0, poll_s: float = 0.5,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[int, bool]:
    """Wait until each of `result_ids` has a newer `result.finalized` than in `baseline`
    (subject counts), or until the run has `count` finalized results. Returns (done, timed_out)."""
    ids = set(result_ids or ())
    base = baseline or {}
    want = len(ids) if ids else int(count or 0)
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        done = 0
        while True:
            try:
                counts = await subject_counts(js, events.subject(events.RESULT_FINALIZED, run_id, "*"))
            except Exception as exc:  # noqa: BLE001 - a reconnecting server: ask again
                log.debug("wait_for_results: %s", exc)
                counts = None
            if counts is not None:
                by_id = {s.rsplit(".", 1)[-1]: n for s, n in counts.items()}
                if ids:
                    done = sum(1 for r in ids if by_id.get(r, 0) > base.get(r, 0))
                else:
                    done = len(by_id)
                if progress:
                    progress(done, want)
                if done >= want:
                    return done, False
            if time.monotonic() > deadline:
                return done, True
            await asyncio.sleep(poll_s)


async def finalized_counts(settings: Settings, run_id: str) -> dict[str, int]:
    """result_id -> number of result.finalized messages in the stream (1 when exactly once)."""
    async with bus.session(settings) as nc:
        counts = await subject_counts(nc.jetstream(), events.subject(events.RESULT_FINALIZED, run_id, "*"))
    return {s.rsplit(".", 1)[-1]: n for s, n in counts.items()}


PROJECTED_SQL = "SELECT count() FROM verification_results FINAL WHERE run_id = {r:String}"


def projected_rows(settings: Settings, run_id: str) -> int:
    """The run's result rows in the store now."""
    return int(run_query(settings, PROJECTED_SQL, {"r": run_id}).rows[0][0])


def wait_projected(settings: Settings, run_id: str, expected: int, *, timeout: float = 30.0,
                   first_poll_s: float = 0.02, max_poll_s: float = 0.25) -> bool:
    """Wait until the store has `expected` result rows of the run (what `veribus run` does before
    its summary, so queries right after see them); False when `timeout` ran out. Polls soon and
    then less often: the projector usually inserts the last rows within its batch timeout
    (0.5 s), and a fixed 0.2 s poll added up to 0.2 s to every run a user waits for."""
    deadline = time.monotonic() + timeout
    poll = first_poll_s
    while True:
        try:
            if projected_rows(settings, run_id) >= expected:
                return True
        except Exception as exc:  # noqa: BLE001 - the projector is still starting: ask again
            log.debug("wait_projected: %s", exc)
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        poll = min(max_poll_s, poll * 1.5)
