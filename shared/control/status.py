"""The problems of one run (stage failures, dead letters, result errors) for `veribus status RUN`, and how
far ClickHouse is behind the stream (`store_lag`), so a read never passes stale rows off as the whole story."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from nats.js.errors import NotFoundError

from shared.control.streams import PROJECTOR_DURABLE, subject_counts
from shared.core import events
from shared.core.config import Settings
from shared.core.verdict import SQL_ERRORED, SQL_FAILED, SQL_PASSED, SQL_VERIFY_RAISED
from shared.runtime import bus
from shared.store.reads import run_query
from shared.store.resumed import stopped_sql

log = logging.getLogger("veribus.status")


def run_counts(settings: Settings, run_id: str) -> dict[str, int]:
    """results, passed, failed and errors of a run's stored results, as every output counts them
    (shared.core.verdict: a template whose verify() raised is an error, not a fail)."""
    res = run_query(settings, f"SELECT count() AS results, countIf({SQL_PASSED}) AS passed, "
                              f"countIf({SQL_FAILED}) AS failed, countIf({SQL_ERRORED}) AS errors "
                              "FROM verification_results FINAL WHERE run_id = {run:String}", {"run": run_id})
    return {c: int(v or 0) for c, v in zip(res.columns, res.rows[0], strict=False)}


def run_problems(settings: Settings, run_id: str, limit: int = 20) -> dict[str, Any]:
    """Stage give-ups, dead letters and result errors of a run (for `veribus status RUN`)."""
    p = {"run": run_id}
    failed = run_query(settings, "SELECT stage, error_type, error_message, result_id FROM events FINAL "
                                 "WHERE run_id = {run:String} AND event_type = 'stage.failed' "
                                 f"ORDER BY occurred_at LIMIT {int(limit)}", p).rows
    n_failed = run_query(settings, "SELECT count() FROM events FINAL WHERE run_id = {run:String} "
                                   "AND event_type = 'stage.failed'", p).rows[0][0]
    dead = run_query(settings, "SELECT stage, error_message, reason FROM events FINAL WHERE run_id = {run:String} "
                               f"AND event_type = 'dead.letter' ORDER BY occurred_at LIMIT {int(limit)}", p).rows
    n_dead = run_query(settings, "SELECT count() FROM events FINAL WHERE run_id = {run:String} "
                                 "AND event_type = 'dead.letter'", p).rows[0][0]
    # result errors as every output counts them (shared.core.verdict.SQL_ERRORED): a template whose
    # verify() raised is listed by its field_verification_error
    errors = run_query(settings, f"SELECT substring(if({SQL_VERIFY_RAISED} AND completed_without_errors, "
                                 "field_verification_error, ifNull(error, '')), 1, 120) AS e, count() "
                                 "FROM verification_results FINAL WHERE (run_id = {run:String} OR run_name = "
                                 f"{{run:String}}) AND {SQL_ERRORED} GROUP BY e ORDER BY count() DESC "
                                 f"LIMIT {int(limit)}", p).rows
    budget_rows = run_query(settings, "SELECT JSONExtractInt(config_json, 'budget_tokens') FROM runs FINAL "
                                      "WHERE run_id = {run:String}", p).rows
    budget = int(budget_rows[0][0]) if budget_rows and budget_rows[0][0] else None
    spent = stopped = 0
    if budget is not None:
        over = stopped_sql("error", frozenset({"BudgetExhausted"}))
        spent, stopped = run_query(settings, f"SELECT sum(total_tokens), countIf({over}) FROM verification_results "
                                             "FINAL WHERE run_id = {run:String}", p).rows[0]
    return {
        "budget_tokens": budget,
        "tokens_spent": int(spent or 0),
        "budget_stopped": int(stopped or 0),
        "stage_failed": int(n_failed),
        "stage_failures": [{"stage": r[0], "type": r[1], "message": r[2], "result_id": r[3]} for r in failed],
        "dead_letters": int(n_dead),
        "dead_letter_list": [{"consumer": r[0], "error": r[1], "subject": r[2]} for r in dead],
        "errors": [{"error": r[0], "count": int(r[1])} for r in errors],
    }


def format_run_problems(problems: dict[str, Any]) -> str:
    lines = []
    if problems.get("budget_tokens") is not None:
        lines.append(f"  token budget: {problems['budget_tokens']}; spent by finalized results: "
                     f"{problems['tokens_spent']}; {problems['budget_stopped']} job(s) not generated "
                     "(budget exhausted)")
    lines.append(f"  stage give-ups: {problems['stage_failed']}")
    for f in problems["stage_failures"]:
        lines.append(f"    {f['stage']}: {f['type']}: {f['message'][:160]} (result {f['result_id']})")
    lines.append(f"  dead letters: {problems['dead_letters']}")
    for d in problems["dead_letter_list"]:
        lines.append(f"    {d['consumer']}: {d['error'][:160]} ({d['subject']})")
    if problems["errors"]:
        lines.append("  result errors:")
        for e in problems["errors"]:
            lines.append(f"    {e['count']:>6}  {e['error']}")
    return "\n".join(lines)


# ---- how far ClickHouse is behind the stream (the projector dead or behind) ----

@dataclass
class StoreLag:
    """What the stream holds that ClickHouse may not yet: `pending` events the projector has not
    written (its durable consumer's pending + unacknowledged; None when it has none yet), and,
    for one run, `streamed` results finalized in the stream."""

    pending: int | None = None
    streamed: int | None = None


LAG_CONNECT_S = 4.0  # the connect; the whole read is bounded by LAG_READ_S
LAG_READ_S = 15.0


async def _read_lag(settings: Settings, run_id: str | None) -> StoreLag:
    async with bus.session(settings, name="veribus-store-lag", connect_timeout=2, within=LAG_CONNECT_S,
                           **bus.ONE_TRY) as nc:
        js = nc.jetstream(timeout=5.0)
        streamed = None
        if run_id is not None:
            streamed = len(await subject_counts(js, events.subject(events.RESULT_FINALIZED, run_id, "*")))
        try:
            ci = await js.consumer_info(events.STREAM, PROJECTOR_DURABLE)
        except NotFoundError:
            return StoreLag(None, streamed)
        return StoreLag(int(ci.num_pending or 0) + int(ci.num_ack_pending or 0), streamed)


def store_lag(settings: Settings, run_id: str | None = None) -> StoreLag | None:
    """The stream's side of the comparison (see StoreLag); None when the bus cannot be read
    (nothing listens: known at once; a server that does not answer: within LAG_READ_S)."""
    if not bus.server_reachable(settings.nats_url):
        return None
    try:
        return asyncio.run(asyncio.wait_for(_read_lag(settings, run_id), timeout=LAG_READ_S))
    except Exception as exc:  # noqa: BLE001 - nothing to compare with: the caller says nothing
        log.debug("store_lag: %s", exc)
        return None
