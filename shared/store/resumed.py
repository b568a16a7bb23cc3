"""Which stored results a `resume` is running again, in SQL over the veribus tables.

A `resume` that re-runs a run's cancelled or budget-stopped jobs (or, with `--errors`, its
errored ones) first lifts the stop (a `run.cancelled` event with `cancelled: false`,
`shared.control.lifecycle.resume`), then publishes them again. Until each has a newer result,
its newest row in `verification_results` is still the old one, so a count of stopped rows called
a resumed run "cancelled" while it ran, and a count of rows called it finished. The stream's side of the same rule is `lifecycle.run_finished`.

`RESULTS_SQL` (`results_sql` for some rows) is `verification_results FINAL` with one more column, `rerun`: a result older than
the run's newest control event, when that event is a resume's lift that runs it again (a stopped
result, unless `--no-stopped`; an errored one with `--errors`). A stop published after the lift
(a cancel again) ends the re-run: its rows are what they were, not re-running.
"""

from __future__ import annotations

from shared.runtime.runcontrol import STOP_ERROR_TYPES


def stopped_sql(error: str = "error", types: frozenset[str] = STOP_ERROR_TYPES) -> str:
    """A result that only records that its run stopped dispatching (a cancel, a budget: `types`
    narrows it to some), by its `error` column, as `shared.control.lifecycle._stopped` reads it
    from the stream."""
    return "(" + " OR ".join(f"positionCaseInsensitive(ifNull({error}, ''), ': {t}: ') > 0"
                             for t in sorted(types)) + ")"


# a run-control event's payload stops the run (its payload omits `cancelled` when true, the default)
_STOPS = "ifNull(JSONExtract(payload, 'cancelled', 'Nullable(Bool)'), true)"

# an aggregate over a run's `events` rows: its newest run-control event stops it (a cancel, or a
# budget change that keeps a cancel), where a resume's lifts it
STOPPED_SQL = f"(countIf(event_type = 'run.cancelled') > 0 AND argMaxIf({_STOPS}, occurred_at, event_type = 'run.cancelled'))"

# per run: the time (µs, as `verification_results.version`) of its newest run-control event when
# that event lifts a stop, else 0; and what that lift runs again (`events.RunControlChange`)
LIFTS_SQL = f"""(SELECT run_id, if(argMax({_STOPS}, occurred_at), 0, toUnixTimestamp64Micro(max(occurred_at))) AS lifted_us,
          argMax(JSONExtractBool(payload, 'skips_stopped'), occurred_at) AS skips_stopped,
          argMax(JSONExtractBool(payload, 'reruns_errors'), occurred_at) AS reruns_errors
   FROM events FINAL WHERE event_type = 'run.cancelled' GROUP BY run_id)"""

# as `shared.control.lifecycle.reruns`: a stopped result unless the lift skips them, an errored one
# (not a stop; a verify() that raised completed) when it re-runs errors
_RERUN = (f"res.version < lifts.lifted_us AND if({stopped_sql('res.error')}, NOT lifts.skips_stopped, "
          "lifts.reruns_errors AND NOT res.completed_without_errors)")



def results_sql(where: str = "1") -> str:
    """`verification_results FINAL` rows matching `where` (SQL over its columns: one run's, say,
    so a page about one run does not read every run's) with the `rerun` column."""
    return f"""(SELECT res.*, {_RERUN} AS rerun
   FROM (SELECT * FROM verification_results FINAL WHERE {where}) AS res
   LEFT JOIN {LIFTS_SQL} AS lifts ON lifts.run_id = res.run_id)"""


RESULTS_SQL = results_sql()
