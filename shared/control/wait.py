"""Waiting for a run's finalized results, counted on the stream (one result.finalized subject per result)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from shared.control.streams import subject_counts
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus

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
    nc = await bus.connect(settings)
    try:
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
    finally:
        await nc.close()


async def finalized_counts(settings: Settings, run_id: str) -> dict[str, int]:
    """result_id -> number of result.finalized messages in the stream (1 when exactly once)."""
    nc = await bus.connect(settings)
    try:
        counts = await subject_counts(nc.jetstream(), events.subject(events.RESULT_FINALIZED, run_id, "*"))
    finally:
        await nc.close()
    return {s.rsplit(".", 1)[-1]: n for s, n in counts.items()}
