"""A RUN argument -> a run id. Every command takes a run id or a run name: an exact id wins; a
name means its most recent run, and when several runs share the name the CLI says so (which
one it took, and how many there are).

`pick` is the pure rule; `runs_in_stream` (the source of truth, for commands that publish) and
`runs_in_store` (ClickHouse, for the analysis commands) list the candidates; `list_runs` is the
`veribus runs` table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.control.streams import run_requests
from shared.core.config import Settings
from shared.core.verdict import SQL_ERRORED, SQL_FAILED, SQL_PASSED, has_verdicts
from shared.runtime import bus
from shared.store.reads import run_query
from shared.store.resumed import RESULTS_SQL as RESUMED_RESULTS_SQL
from shared.store.resumed import stopped_sql


class RunNotFound(LookupError, ValueError):
    """No run has this id or name (an input error: exit 2)."""


@dataclass(frozen=True)
class RunRef:
    run_id: str
    run_name: str | None
    started: str  # ISO timestamp of run.requested


@dataclass
class Picked:
    run_id: str
    note: str | None = None  # set when a name matched several runs


def pick(ref: str, runs: Sequence[RunRef]) -> Picked:
    """The run `ref` names: an exact run id, else the most recent run with that name."""
    for r in runs:
        if r.run_id == ref:
            return Picked(r.run_id)
    named = sorted((r for r in runs if r.run_name == ref), key=lambda r: r.started, reverse=True)
    if not named:
        raise RunNotFound(f"no run {ref!r}: no run has that id or name" + ("" if runs else " (there are no runs yet)"))
    chosen = named[0]
    if len(named) == 1:
        return Picked(chosen.run_id)
    others = ", ".join(r.run_id for r in named[1:4]) + (" ..." if len(named) > 4 else "")
    return Picked(chosen.run_id, f"name {ref!r} matches {len(named)} runs; using the most recent, "
                                 f"{chosen.run_id} (started {chosen.started}); others: {others}. "
                                 "Pass a run id to choose another.")


def next_regrade_name(base: str, names: Sequence[str | None]) -> str:
    """`<base>-regrade-N` with N one more than any existing regrade of `base`."""
    prefix = f"{base}-regrade-"
    used = [int(n[len(prefix):]) for n in names if n and n.startswith(prefix) and n[len(prefix):].isdigit()]
    return f"{prefix}{max(used, default=0) + 1}"


async def runs_in_stream(settings: Settings) -> list[RunRef]:
    """Every run.requested in the stream (one per run: the newest message per subject)."""
    async with bus.session(settings, connect_timeout=2, within=10.0, **bus.ONE_TRY) as nc:  # never a hang
        js = nc.jetstream()
        await bus.ensure_stream(js)
        runs, _ = await run_requests(js)
        return [RunRef(run.run_id, run.run_name, run.timestamp) for run in runs]


def runs_in_store(settings: Settings) -> list[RunRef]:
    res = run_query(settings, "SELECT run_id, run_name, toString(requested_at) FROM runs FINAL")
    return [RunRef(str(r[0]), r[1], str(r[2])) for r in res.rows]


def resolve(settings: Settings, ref: str, *, stream: bool) -> Picked:
    """`ref` -> run id, from the stream (`stream=True`) or from ClickHouse."""
    runs = asyncio.run(runs_in_stream(settings)) if stream else runs_in_store(settings)
    return pick(ref, runs)


# `passed`, `failed` and `errors` as every output counts them (shared.core.verdict: an error is
# never a pass nor a fail; a template whose verify() raised is an error); a stopped result that a
# `resume` runs again (`shared.store.resumed`) is not done, and counts as `resumed` only
RUNS_SQL = """
SELECT r.run_id, r.run_name, toString(r.requested_at) AS started, r.job_count AS jobs,
       countIf(v.result_id != '' AND NOT v.rerun) AS done,
       countIf(v.result_id != '' AND v.is_pass) AS passed,
       countIf(v.result_id != '' AND v.is_fail) AS failed,
       countIf(v.result_id != '' AND v.is_error AND NOT v.rerun) AS errors,
       countIf(""" + stopped_sql("v.error", frozenset({"RunCancelled"})) + """ AND NOT v.rerun) AS cancelled,
       countIf(""" + stopped_sql("v.error", frozenset({"BudgetExhausted"})) + """ AND NOT v.rerun) AS budget_stopped,
       countIf(v.result_id != '' AND v.rerun) AS resumed,
       any(r.parent_run_id) AS parent,
       any(r.evaluation_mode) AS mode
FROM (SELECT * FROM runs FINAL) AS r
LEFT JOIN (SELECT run_id, result_id, """ + SQL_PASSED + """ AS is_pass, """ + SQL_FAILED + """ AS is_fail,
                  """ + SQL_ERRORED + """ AS is_error, error, rerun
           FROM """ + RESUMED_RESULTS_SQL + """) AS v ON v.run_id = r.run_id
GROUP BY r.run_id, r.run_name, started, jobs
ORDER BY started DESC
LIMIT {limit:UInt32}
"""


def run_state(row: dict[str, Any]) -> str:
    """running | cancelled | budget-stopped | done with errors | done. A run a `resume` is
    running again is running until its re-run jobs have results (whatever stopped it before)."""
    if row.get("resumed"):
        return "running"
    if row["cancelled"]:
        return "cancelled"
    if row["budget_stopped"]:
        return "budget-stopped"
    if row["done"] < row["jobs"]:
        return "running"
    return "done, errors" if row["errors"] else "done"


def list_runs(settings: Settings, limit: int | None = 50) -> list[dict[str, Any]]:
    """The most recent `limit` runs, newest first; every run when `limit` is 0 or None (a
    negative limit is refused: ValueError). A rubric_only run's `passed` and `failed` are None:
    its results have no template verdict to count (`shared.core.verdict`)."""
    if limit is not None and int(limit) < 0:
        raise ValueError(f"the number of runs to list must be >= 0 (0: every run), got {limit}")
    if limit:
        res = run_query(settings, RUNS_SQL, {"limit": int(limit)})
    else:
        res = run_query(settings, RUNS_SQL.replace("LIMIT {limit:UInt32}", ""))
    rows = [dict(zip(res.columns, r, strict=False)) for r in res.rows]
    for row in rows:
        for k in ("jobs", "done", "passed", "failed", "errors", "cancelled", "budget_stopped", "resumed"):
            row[k] = int(row[k] or 0)
        row["state"] = run_state(row)
        if not has_verdicts(row.get("mode")):
            row["passed"] = row["failed"] = None
    return rows


def format_runs(rows: Sequence[dict[str, Any]]) -> str:
    cols = ["run_id", "run_name", "started", "jobs", "done", "passed", "errors", "state"]
    table = [[str(r.get(c) if r.get(c) is not None else "-") for c in cols] for r in rows]
    widths = [max([len(c)] + [len(t[i]) for t in table]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=False))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths, strict=False)) for t in table]
    return "\n".join(lines)
