"""A run that `resume` is running again is running, in `runs`, `status RUN` and the viewer.

The user's report: after `veribus cancel` and `veribus resume`, `veribus runs` said "cancelled"
(its cancelled results were still the newest rows) and the viewer "finished" (every job had a
row) while the resumed jobs ran. Stored here as the projector stores them (results with their
event time as version, the run-control events in `events`), on the real engine: a cancel, two
cancelled results, then the resume's lift; then the re-run's results; and a second run cancelled
again after its lift, which is cancelled, not running.
"""

from __future__ import annotations

import time

import pytest

from shared.cli.view import queries
from shared.control.runref import list_runs
from shared.core import events
from shared.core.config import Settings
from shared.core.models import VerificationResult
from shared.store.engine import Store
from shared.store.rows import result_to_row
from tests.support.analysis_store import AsyncStoreSource
from tests.support.results import GPT, make

RESUMED = "20260601T090000-resume01"
RECANCELLED = "20260601T090000-resume02"
CANCELLED = "generate_answer: RunCancelled: cancelled: run {run} was cancelled before this answer was generated"


def _control(run: str, cancelled: bool, at: float, n: int) -> events.Envelope:
    env = events.make_envelope(events.RUN_CANCELLED, run, events.RUN_KEY,
                               events.RunControlChange(cancelled=cancelled, reason="test", at=at), "test")
    env.occurred_at, env.event_id = at, f"{run}:run.cancelled:{n}"
    return env


def _results(run: str, cancelled: bool) -> list[VerificationResult]:
    first = make("s1", GPT, True, run_name=run)
    rest = [make(q, GPT, None if cancelled else True, run_name=run,
                 error=CANCELLED.format(run=run) if cancelled else None) for q in ("s2", "s3")]
    return [first, *rest] if cancelled else rest


def _store_run(store: Store, run: str, at: float, rows: list[VerificationResult]) -> None:
    store.insert_results([result_to_row(r, run, version=int(at * 1e6)) for r in rows])


@pytest.fixture(scope="module")
def stored(store: Store) -> Store:
    now = time.time()
    for run in (RESUMED, RECANCELLED):
        store.insert_runs([events.RunRequested(run_id=run, timestamp="2026-06-01T09:00:00Z", job_count=3,
                                               answer_count=3, run_name=run, benchmark_name="b",
                                               evaluation_mode="template_only", config={})])
        _store_run(store, run, now - 20, _results(run, cancelled=True))  # s1 passed, s2 and s3 cancelled
        controls = [_control(run, True, now - 30, 1), _control(run, False, now - 2, 2)]  # cancel, then resume
        if run == RECANCELLED:
            controls.append(_control(run, True, now - 1, 3))  # cancelled again before any re-run ended
        store.insert_events(controls)
    return store


def _listed(settings: Settings, run: str) -> dict:
    (row,) = [r for r in list_runs(settings, limit=0) if r["run_id"] == run]
    return row


async def _viewer(stored: Store, run: str) -> tuple[str, str]:
    src = AsyncStoreSource(stored)
    listed = {r["run_id"]: r for r in (await queries.runs(src))["runs"]}
    return listed[run]["state"], (await queries.run_header(src, run))["state"]


async def test_a_resumed_run_is_running_until_its_re_run_jobs_have_results(settings: Settings, stored: Store) -> None:
    row = _listed(settings, RESUMED)
    assert await _viewer(stored, RESUMED) == ("running", "running")  # were "finished", both
    assert (row["state"], row["done"], row["cancelled"], row["errors"]) == ("running", 1, 0, 0)  # "cancelled", 3, 2, 2
    assert row["resumed"] == 2

    _store_run(stored, RESUMED, time.time(), _results(RESUMED, cancelled=False))  # the re-run's results
    row = _listed(settings, RESUMED)
    assert (row["state"], row["done"], row["resumed"], row["passed"]) == ("done", 3, 0, 3)
    assert await _viewer(stored, RESUMED) == ("finished", "finished")


async def test_a_run_cancelled_again_after_its_resume_is_cancelled(settings: Settings, stored: Store) -> None:
    row = _listed(settings, RECANCELLED)
    assert (row["state"], row["done"], row["resumed"], row["cancelled"]) == ("cancelled", 3, 0, 2)
    listed, header = await _viewer(stored, RECANCELLED)
    # the viewer as `runs`: every job has its result, and the run was cancelled (it said "finished")
    assert (listed, header) == ("cancelled", "cancelled")
