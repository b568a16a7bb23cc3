"""The viewer's reads: one function per thing a page shows, each one bounded query (an
aggregate, or a LIMITed page), so nothing grows with the size of a run.

`src` is anything with `async query(sql, params) -> QueryResult` (`shared.cli.view.source.ViewSource`,
or a test's wrapper around a Store)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Protocol

from shared.analysis.stats import Proportion, mcnemar_exact, newcombe_paired_diff
from shared.cli.view.filters import Filters
from shared.core.config import config_uses_simulator
from shared.core.outcome import VERIFY_RAISED
from shared.core.usage import NOT_RECORDED, NOT_RECORDED_RUBRIC_ONLY
from shared.core.verdict import (
    SQL_ERRORED,
    SQL_FAILED,
    SQL_PASSED,
    SQL_VERDICT,
    SQL_VERIFIED,
    SQL_VERIFY_RAISED,
)
from shared.store.engine import QueryResult
from shared.store.event_usage import EVENTS_SOURCE, event_usage_sql, usage_from_rows
from shared.store.resumed import RESULTS_SQL as RESUMED_RESULTS_SQL
from shared.store.resumed import STOPPED_SQL, results_sql

PAGE_SIZE = 50
HEAT_QUESTIONS = 40
LIVE_WINDOW_S = 120.0  # a run with missing results and an event this recent is "running"
FLIPS_LIMIT = 200


class AsyncSource(Protocol):
    async def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult: ...


def _rate(passed: int, n: int) -> Proportion:
    return Proportion.of(int(passed or 0), int(n or 0))


def _models_from_config(raw: str | None, key: str) -> list[str]:
    try:
        cfg = json.loads(raw) if raw else {}
    except (TypeError, ValueError):
        return []
    return [str(m.get("model_name", "")) for m in cfg.get(key, []) or [] if isinstance(m, dict)]


def _simulated_config(raw: str | None) -> bool:
    try:
        cfg = json.loads(raw) if raw else {}
    except (TypeError, ValueError):
        return False
    return config_uses_simulator(cfg if isinstance(cfg, dict) else None)


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------

RUNS_SQL = """
SELECT
    if(u.run_id != '', u.run_id, r.run_id)          AS run_id,
    ifNull(u.run_name, r.run_name)                   AS run_name,
    u.requested_at                                   AS requested_at,
    u.job_count                                      AS job_count,
    u.benchmark_name                                 AS benchmark_name,
    u.evaluation_mode                                AS evaluation_mode,
    u.config_json                                    AS config_json,
    r.done                                           AS done,
    r.passed                                         AS passed,
    r.verified                                       AS verified,
    r.errors                                         AS errors,
    r.models                                         AS result_models,
    r.simulated                                      AS simulated
FROM (SELECT run_id, run_name, requested_at, job_count, benchmark_name, evaluation_mode, config_json
      FROM runs FINAL) AS u
FULL OUTER JOIN
     (SELECT run_id, any(run_name) AS run_name, countIf(NOT rerun) AS done, countIf({passed}) AS passed,
             countIf({verified}) AS verified, countIf({errored} AND NOT rerun) AS errors,
             groupUniqArray(10)(answering_model) AS models,
             countIf(answering_interface = 'simulator' OR parsing_interface = 'simulator') > 0 AS simulated
      FROM {results} GROUP BY run_id) AS r
ON u.run_id = r.run_id
WHERE {cond}
ORDER BY ifNull(toFloat64(u.requested_at), 0) DESC, run_id DESC
LIMIT {limit} OFFSET {offset}
"""


async def runs(src: AsyncSource, q: str = "", page: int = 0, page_size: int = PAGE_SIZE) -> dict[str, Any]:
    """One page of runs, newest first, with progress, pass rate and a state."""
    cond, params = "1", {}
    if q:
        cond = ("(positionCaseInsensitiveUTF8(run_id, {q:String}) > 0 OR "
                "positionCaseInsensitiveUTF8(ifNull(run_name, ''), {q:String}) > 0 OR "
                "positionCaseInsensitiveUTF8(ifNull(benchmark_name, ''), {q:String}) > 0)")
        params["q"] = q
    res = await src.query(RUNS_SQL.format(cond=cond, limit=int(page_size) + 1, offset=int(page) * int(page_size),
                                          passed=SQL_PASSED, verified=SQL_VERIFIED, errored=SQL_ERRORED,
                                          results=RESUMED_RESULTS_SQL),
                          params)
    rows = res.as_dicts()
    more = len(rows) > page_size
    rows = rows[:page_size]
    ids = [r["run_id"] for r in rows]
    last: dict[str, Any] = {}
    stopped: set[str] = set()
    if ids:
        # stopped: the newest run control stops the run (a `resume` publishes one that lifts it)
        ev = await src.query("SELECT run_id, max(occurred_at), dateDiff('second', max(occurred_at), now64(6)), "
                             f"{STOPPED_SQL} FROM events WHERE run_id IN {{ids:Array(String)}} GROUP BY run_id",
                             {"ids": ids})
        last = {r[0]: (r[1], r[2]) for r in ev.rows}
        stopped = {r[0] for r in ev.rows if r[3]}
    out = []
    for r in rows:
        jobs = int(r["job_count"] or 0)
        done = int(r["done"] or 0)
        models = _models_from_config(r["config_json"], "answering_models") or list(r["result_models"] or [])
        judges = _models_from_config(r["config_json"], "parsing_models")
        age = last.get(r["run_id"], (None, None))[1]
        out.append({
            "run_id": r["run_id"], "run_name": r["run_name"], "requested_at": r["requested_at"] if jobs else None,
            "benchmark": r["benchmark_name"] or "", "mode": r["evaluation_mode"] or "",
            "models": models, "judges": judges, "jobs": jobs, "done": done, "errors": int(r["errors"] or 0),
            "rate": _rate(r["passed"], r["verified"]),
            "simulated": bool(r["simulated"]) or _simulated_config(r["config_json"]),
            "last_event": last.get(r["run_id"], (None, None))[0],
            "state": run_state(jobs, done, age, r["run_id"] in stopped),
        })
    return {"runs": out, "more": more, "page": page}


def run_state(jobs: int, done: int, seconds_since_last_event: float | None, cancelled: bool = False) -> str:
    """finished | running | cancelled | incomplete (results missing, nothing happening). A run
    whose newest control is a cancel is cancelled, every job ended or not: its stopped jobs end as
    cancelled results, so it was shown "finished" (`veribus runs` said cancelled)."""
    if cancelled:
        return "cancelled"
    if jobs and done >= jobs:
        return "finished"
    if not jobs and done:
        return "finished"  # results without a run row (imported or rebuilt partially)
    if seconds_since_last_event is not None and seconds_since_last_event <= LIVE_WINDOW_S:
        return "running"
    return "incomplete"


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------


async def resolve(src: AsyncSource, run: str) -> str | None:
    """A run id, or the latest run with that name -> run id; None when the store has neither."""
    res = await src.query(
        "SELECT run_id FROM (SELECT run_id, requested_at AS at FROM runs FINAL WHERE run_id = {r:String} "
        "OR run_name = {r:String} UNION ALL SELECT run_id, max(ingested_at) AS at FROM verification_results "
        "FINAL WHERE run_id = {r:String} OR run_name = {r:String} GROUP BY run_id) "
        "ORDER BY (run_id = {r:String}) DESC, at DESC LIMIT 1", {"r": run})
    return str(res.rows[0][0]) if res.rows else None


async def run_header(src: AsyncSource, run_id: str) -> dict[str, Any]:
    info = await src.query("SELECT run_name, benchmark_name, evaluation_mode, requested_at, job_count, config_json "
                           "FROM runs FINAL WHERE run_id = {r:String} LIMIT 1", {"r": run_id})
    tot = await src.query(
        f"SELECT count(), countIf({SQL_PASSED}), countIf({SQL_FAILED}), "
        f"countIf(NOT {SQL_VERIFIED}), countIf({SQL_ERRORED}), sum(input_tokens), "
        "sum(output_tokens), uniqExact(question_id), any(run_name), "
        "countIf(answering_interface = 'simulator' OR parsing_interface = 'simulator') > 0, "
        "groupUniqArray(50)(answering_model), groupUniqArray(50)(parsing_model), groupUniqArrayArray(200)(keywords), "
        "countIf(length(usage_stage) = 0) FROM verification_results FINAL WHERE run_id = {r:String}", {"r": run_id})
    n, passed, failed, no_verdict, errors, tin, tout, questions, rname, sim, models, judges, kws, without = tot.rows[0]
    tokens_recorded = True
    if n and without == n:  # no result carries a usage section (rubric_only): the run's stage events
        ev = await src.query(event_usage_sql(), {"r": run_id})
        found = usage_from_rows(ev.rows)
        tin, tout = (found["input_tokens"], found["output_tokens"]) if found else (0, 0)
        tokens_recorded = found is not None
    h: dict[str, Any] = {"run_id": run_id, "run_name": rname, "benchmark": "", "mode": "", "requested_at": None,
                         "jobs": 0, "config": None}
    if info.rows:
        name, bench, mode, at, jobs, cfg = info.rows[0]
        h.update(run_name=name or rname, benchmark=bench, mode=mode, requested_at=at, jobs=int(jobs or 0))
        try:
            h["config"] = json.loads(cfg) if cfg else None
        except (TypeError, ValueError):
            h["config"] = None
        sim = bool(sim) or _simulated_config(cfg)
    ev = await src.query("SELECT dateDiff('second', max(occurred_at), now64(6)), "
                         f"{STOPPED_SQL}, countIf(event_type = 'run.cancelled') > 0 "
                         "FROM events WHERE run_id = {r:String}", {"r": run_id})
    age, cancelled, controlled = ev.rows[0] if ev.rows else (None, 0, 0)
    done = int(n)
    if done and controlled and not cancelled:  # a resume's lift: the results it runs again are not done
        rerun = await src.query(f"SELECT countIf(rerun) FROM {results_sql('run_id = {r:String}')}", {"r": run_id})
        done -= int(rerun.rows[0][0] or 0) if rerun.rows else 0
    h.update(results=int(n), passed=int(passed), failed=int(failed), no_verdict=int(no_verdict),
             errors=int(errors), input_tokens=int(tin or 0), output_tokens=int(tout or 0), questions=int(questions),
             tokens_recorded=tokens_recorded,
             simulated=bool(sim), models=sorted(models), judges=sorted(judges),
             keywords=sorted(k for k in kws if k), rate=_rate(passed, int(n) - int(no_verdict)),
             state=run_state(h["jobs"], done, age if n or h["jobs"] else None, bool(cancelled)))
    return h


async def rates_by(src: AsyncSource, run_id: str, column: str, f: Filters) -> list[dict[str, Any]]:
    """Pass rate with its Wilson interval per answering model (`column="answering_model"`) or judge."""
    if column not in ("answering_model", "parsing_model"):
        raise ValueError(f"cannot group by {column!r}")
    cond, params = f.sql()
    res = await src.query(
        f"SELECT {column}, count(), countIf({SQL_ERRORED}), countIf({SQL_VERIFIED}), "
        f"countIf({SQL_PASSED}) FROM verification_results FINAL WHERE run_id = {{r:String}} AND {cond} "
        f"GROUP BY {column} ORDER BY {column} LIMIT 200", {"r": run_id, **params})
    return [{"name": r[0], "results": int(r[1]), "errors": int(r[2]), "rate": _rate(r[4], r[3])} for r in res.rows]


async def heatmap(src: AsyncSource, run_id: str, f: Filters, page: int = 0,
                  per_page: int = HEAT_QUESTIONS) -> dict[str, Any]:
    """Questions (hardest first, one page) x answering models: passed / verdicts per cell."""
    cond, params = f.sql()
    p = {"r": run_id, **params}
    qs = await src.query(
        f"SELECT question_id, any(question_text), countIf({SQL_PASSED}), countIf({SQL_VERIFIED}), "
        f"countIf({SQL_ERRORED}) FROM verification_results FINAL "
        f"WHERE run_id = {{r:String}} AND {cond} GROUP BY question_id "
        f"ORDER BY if(countIf({SQL_VERIFIED}) = 0, 2, countIf({SQL_PASSED}) / "
        f"countIf({SQL_VERIFIED})), question_id "
        f"LIMIT {int(per_page) + 1} OFFSET {int(page) * int(per_page)}", p)
    rows = qs.rows[:per_page]
    total = (await src.query("SELECT uniqExact(question_id) FROM verification_results FINAL "
                             f"WHERE run_id = {{r:String}} AND {cond}", p)).rows[0][0]
    ids = [r[0] for r in rows]
    cells: dict[tuple[str, str], dict[str, int]] = {}
    models: list[str] = []
    if ids:
        res = await src.query(
            f"SELECT question_id, answering_model, countIf({SQL_PASSED}), countIf({SQL_VERIFIED}), "
            f"count(), countIf({SQL_ERRORED}), any(result_id) FROM verification_results FINAL "
            f"WHERE run_id = {{r:String}} AND {cond} AND question_id IN {{hq:Array(String)}} "
            "GROUP BY question_id, answering_model", {**p, "hq": ids})
        for q, m, ps, n, total_n, err, rid in res.rows:
            cells[(q, m)] = {"passed": int(ps), "n": int(n), "results": int(total_n), "errors": int(err),
                             "result_id": rid}
        models = sorted({m for _, m in cells})
    questions = [{"id": r[0], "text": r[1], "rate": _rate(r[2], r[3]), "errors": int(r[4])} for r in rows]
    return {"questions": questions, "models": models, "cells": cells, "total": int(total), "page": page,
            "more": len(qs.rows) > per_page}


# result errors as every output counts them (shared.core.verdict.SQL_ERRORED), grouped as
# shared.core.outcome.error_kind groups them: a template whose verify() raised (it completed
# without errors) under verify_template / "verify() raised: <exception type>"
ERRORS_SQL = """
SELECT if(completed_without_errors, 'verify_template', ifNull(failure_stage, '')) AS stage,
       if(completed_without_errors,
          concat('""" + VERIFY_RAISED + """: ', if(extract(ifNull(field_verification_error, ''),
                 'Field verification failed: ([A-Za-z0-9_]+):') AS raised = '', 'Exception', raised)),
          if(length(splitByString(': ', ifNull(error, ''))) >= 3, splitByString(': ', ifNull(error, ''))[2],
             ifNull(failure_category, 'error'))) AS type,
       count() AS n, any(if(completed_without_errors, field_verification_error, error)) AS example,
       any(result_id) AS example_id
FROM verification_results FINAL
WHERE run_id = {{r:String}} AND """ + SQL_ERRORED + """ AND {cond}
GROUP BY stage, type ORDER BY n DESC, stage, type LIMIT 50
"""


async def errors(src: AsyncSource, run_id: str, f: Filters) -> dict[str, Any]:
    """Result errors grouped by stage and type (count, one example each), plus stage give-ups and
    dead letters from the events."""
    cond, params = f.sql()
    res = await src.query(ERRORS_SQL.format(cond=cond), {"r": run_id, **params})
    groups = [{"stage": r[0], "type": r[1], "count": int(r[2]), "example": r[3] or "", "result_id": r[4]}
              for r in res.rows]
    ev = await src.query(
        "SELECT event_type, stage, error_type, count(), any(error_message), any(result_id) FROM events FINAL "
        "WHERE run_id = {r:String} AND event_type IN ('stage.failed', 'dead.letter') "
        "GROUP BY event_type, stage, error_type ORDER BY count() DESC LIMIT 50", {"r": run_id})
    events = [{"event": r[0], "stage": r[1], "type": r[2], "count": int(r[3]), "example": r[4] or "",
               "result_id": r[5]} for r in ev.rows]
    return {"groups": groups, "events": events}


async def traits(src: AsyncSource, run_id: str, f: Filters) -> list[dict[str, Any]]:
    """Per trait x answering model: n, mean, and the share of 1 (true) for boolean traits."""
    cond, params = f.sql()
    res = await src.query(
        "SELECT trait.1 AS kind, trait.2 AS name, answering_model, count(), avg(trait.3), min(trait.3), "
        "max(trait.3), countIf(trait.3 = 1) / count() FROM verification_results FINAL "
        "ARRAY JOIN arrayConcat("
        "arrayMap((k, v) -> ('llm', k, v), mapKeys(llm_trait_scores), mapValues(llm_trait_scores)), "
        "arrayMap((k, v) -> ('regex', k, v), mapKeys(regex_trait_scores), mapValues(regex_trait_scores)), "
        "arrayMap((k, v) -> ('callable', k, v), mapKeys(callable_trait_scores), mapValues(callable_trait_scores)), "
        "arrayFlatten(arrayMap((k, m) -> arrayMap((mk, mv) -> ('metric', concat(k, '.', mk), mv), mapKeys(m), "
        "mapValues(m)), mapKeys(metric_trait_scores), mapValues(metric_trait_scores)))) AS trait "
        f"WHERE run_id = {{r:String}} AND {cond} GROUP BY kind, name, answering_model "
        "ORDER BY name, answering_model LIMIT 2000", {"r": run_id, **params})
    return [{"kind": r[0], "name": r[1], "model": r[2], "n": int(r[3]), "mean": r[4], "min": r[5], "max": r[6],
             "share_one": r[7]} for r in res.rows]


async def stage_latency(src: AsyncSource, run_id: str) -> list[dict[str, Any]]:
    res = await src.query("SELECT stage, n, performed, skipped, failed, p50_ms, p95_ms, max_ms, total_ms "
                          "FROM v_stage_latency_by_stage WHERE run_id = {r:String} ORDER BY p95_ms DESC LIMIT 100",
                          {"r": run_id})
    return res.as_dicts()


async def tokens_by_stage(src: AsyncSource, run_id: str, f: Filters) -> list[dict[str, Any]]:
    cond, params = f.sql()
    res = await src.query(
        "SELECT stage, count(), sum(inp), sum(outp) FROM verification_results FINAL "
        "ARRAY JOIN usage_stage AS stage, usage_input_tokens AS inp, usage_output_tokens AS outp "
        f"WHERE run_id = {{r:String}} AND {cond} GROUP BY stage ORDER BY sum(inp + outp) DESC LIMIT 100",
        {"r": run_id, **params})
    return [{"stage": r[0], "results": int(r[1]), "input_tokens": int(r[2]), "output_tokens": int(r[3])}
            for r in res.rows]


async def cost(src: AsyncSource, run_id: str, f: Filters) -> dict[str, Any]:
    """Money and calls (the columns of infra/clickhouse/006_cost.sql): the run's total, and per
    model and stage from the usage arrays (indexed, so rows projected before the cost columns
    existed read a NULL cost instead of breaking the join)."""
    cond, params = f.sql()
    p = {"r": run_id, **params}
    tot = await src.query(
        "SELECT sum(ifNull(cost_usd, 0)), sum(model_calls), sum(cached_replies), "
        "countIf(cost_usd IS NULL AND model_calls > 0), countIf(cost_usd IS NOT NULL), count(), "
        "countIf(length(usage_stage) = 0), countIf(length(usage_stage) = 0 AND NOT has_template) "
        f"FROM verification_results FINAL WHERE run_id = {{r:String}} AND {cond}", p)
    usd, calls, cached, unpriced, priced, n, without, no_template = \
        tot.rows[0] if tot.rows else (0.0, 0, 0, 0, 0, 0, 0, 0)
    if n and without == n:  # no result carries a usage section (rubric_only): the run's stage events
        why = NOT_RECORDED_RUBRIC_ONLY if no_template == n else NOT_RECORDED
        ev = await src.query(event_usage_sql(cond), p)
        found = usage_from_rows(ev.rows)
        out: dict[str, Any] = {"source": EVENTS_SOURCE if found else "none", "not_recorded": why, "by_stage": [],
                               "by_model": [], "priced_results": 0, "unpriced_results": 0}
        if found:
            out.update(total_usd=found["cost_usd"], calls=found["model_calls"], cached=found["cached_replies"],
                       unknown_models=found["cost_unknown_models"],
                       tokens=found["input_tokens"] + found["output_tokens"])
        return out
    res = await src.query(
        "SELECT usage_model[i] AS model, usage_stage[i] AS stage, count(), sum(ifNull(usage_cost_usd[i], 0)), "
        "countIf(usage_cost_usd[i] IS NULL), sum(usage_input_tokens[i] + usage_output_tokens[i]) "
        "FROM verification_results FINAL ARRAY JOIN arrayEnumerate(usage_stage) AS i "
        f"WHERE run_id = {{r:String}} AND {cond} GROUP BY model, stage ORDER BY model, stage LIMIT 500", p)
    rows = [{"model": r[0], "stage": r[1], "entries": int(r[2]), "cost_usd": float(r[3] or 0.0),
             "unpriced": int(r[4]), "tokens": int(r[5] or 0)} for r in res.rows]
    per_model: dict[str, float] = {}
    for r in rows:
        per_model[r["model"]] = per_model.get(r["model"], 0.0) + r["cost_usd"]
    # the total is the priced entries' sum, as the HTML report and the console summary add it up:
    # a result's own cost_usd is NULL when any one of its calls has no price, and summing those
    # alone would leave out the priced calls of every such result
    total = sum(r["cost_usd"] for r in rows) if rows else float(usd or 0.0)
    return {"total_usd": total, "calls": int(calls or 0), "cached": int(cached or 0),
            "unpriced_results": int(unpriced or 0), "priced_results": int(priced or 0), "by_stage": rows,
            "by_model": [{"model": m, "cost_usd": c} for m, c in sorted(per_model.items())],
            "unknown_models": sorted({r["model"] for r in rows if r["unpriced"]})}


SAMPLE_COLUMNS = ("result_id, question_id, question_text, answering_model, parsing_model, replicate, verify_result, "
                  f"completed_without_errors, {SQL_VERIFY_RAISED} AS verify_raised, "
                  "substring(ifNull(error, ''), 1, 200) AS error, execution_time, "
                  "total_tokens, substring(raw_llm_response, 1, 160) AS response")


async def samples(src: AsyncSource, run_id: str, f: Filters, page: int = 0,
                  page_size: int = PAGE_SIZE) -> dict[str, Any]:
    """One page of the run's results (short columns only) and how many match."""
    cond, params = f.sql()
    p = {"r": run_id, **params}
    res = await src.query(
        f"SELECT {SAMPLE_COLUMNS} FROM verification_results FINAL WHERE run_id = {{r:String}} AND {cond} "
        f"ORDER BY question_id, answering_model, parsing_model, ifNull(replicate, 0), result_id "
        f"LIMIT {int(page_size)} OFFSET {int(page) * int(page_size)}", p)
    total = (await src.query(f"SELECT count() FROM verification_results FINAL WHERE run_id = {{r:String}} AND {cond}",
                             p)).rows[0][0]
    return {"rows": res.as_dicts(), "total": int(total), "page": page, "page_size": page_size}


# --------------------------------------------------------------------------------------------
# One sample
# --------------------------------------------------------------------------------------------


SAMPLE_ORDER = "(question_id, answering_model, parsing_model, ifNull(replicate, 0), result_id)"


async def neighbours(src: AsyncSource, run_id: str, result_id: str, f: Filters) -> tuple[str | None, str | None]:
    """The results before and after this one in the run page's (filtered) results order."""
    cond, params = f.sql()
    p = {"r": run_id, "id": result_id, **params}
    me = (f"(SELECT {SAMPLE_ORDER} FROM verification_results FINAL WHERE run_id = {{r:String}} "
          f"AND result_id = {{id:String}} LIMIT 1)")
    out: list[str | None] = []
    for op, direction in (("<", "DESC"), (">", "ASC")):
        res = await src.query(
            f"SELECT result_id FROM verification_results FINAL WHERE run_id = {{r:String}} AND {cond} "
            f"AND {SAMPLE_ORDER} {op} {me} ORDER BY question_id {direction}, answering_model {direction}, "
            f"parsing_model {direction}, ifNull(replicate, 0) {direction}, result_id {direction} LIMIT 1", p)
        out.append(str(res.rows[0][0]) if res.rows else None)
    return out[0], out[1]


async def sample(src: AsyncSource, run_id: str, result_id: str) -> dict[str, Any] | None:
    """The full result (its JSON), the stage records and the events of one result."""
    res = await src.query("SELECT result_json FROM verification_results FINAL WHERE run_id = {r:String} "
                          "AND result_id = {id:String} LIMIT 1", {"r": run_id, "id": result_id})
    if not res.rows:
        return None
    blob = res.rows[0][0]
    result = json.loads(blob.decode() if isinstance(blob, bytes | bytearray) else blob)
    ev = await src.query(
        "SELECT event_type, occurred_at, producer, attempt, status, reason, error_type, error_message, duration_ms, "
        "input_tokens, output_tokens FROM events FINAL WHERE run_id = {r:String} AND result_id = {id:String} "
        "ORDER BY occurred_at LIMIT 200", {"r": run_id, "id": result_id})
    # older events repeat earlier stage records: each (stage, start) once, from the first event carrying it
    st = await src.query(
        "SELECT rec_stage, argMin(rec_status, occurred_at), rec_started, argMin(rec_ended, occurred_at) "
        "FROM events FINAL ARRAY JOIN stage_names AS rec_stage, stage_statuses AS rec_status, "
        "stage_started AS rec_started, stage_ended AS rec_ended "
        "WHERE run_id = {r:String} AND result_id = {id:String} GROUP BY rec_stage, rec_started "
        "ORDER BY rec_started, rec_stage LIMIT 200", {"r": run_id, "id": result_id})
    stages: list[dict[str, Any]] = []
    t0 = min((r[2] for r in st.rows), default=0.0)
    for name, status, a, b in st.rows:
        stages.append({"stage": name, "status": status, "start_ms": (a - t0) * 1000,
                       "duration_ms": max(0.0, (b - a) * 1000) if b and a else 0.0})
    nav = await src.query(
        "SELECT result_id FROM verification_results FINAL WHERE run_id = {r:String} AND question_id = {q:String} "
        "AND result_id != {id:String} ORDER BY answering_model, parsing_model, replicate LIMIT 20",
        {"r": run_id, "q": result["metadata"]["question_id"], "id": result_id})
    return {"result": result, "events": ev.as_dicts(), "stages": stages, "siblings": [r[0] for r in nav.rows]}


# --------------------------------------------------------------------------------------------
# Compare
# --------------------------------------------------------------------------------------------


@dataclass
class Side:
    run_id: str
    model: str = ""  # answering model; empty: every model of the run, paired by model too

    def sql(self, tag: str) -> tuple[str, dict[str, Any]]:
        cond = f"run_id = {{{tag}_r:String}} AND {SQL_VERIFIED}"
        params: dict[str, Any] = {f"{tag}_r": self.run_id}
        if self.model:
            cond += f" AND (answering_model = {{{tag}_m:String}} OR answering_model_name = {{{tag}_m:String}})"
            params[f"{tag}_m"] = self.model
        return cond, params


async def answering_models(src: AsyncSource, run_id: str) -> tuple[list[str], set[str]]:
    """A run's answering models as shown (`interface:model`), and every name a side may give
    for one of them (shown or bare model name, as `Side.sql` matches)."""
    res = await src.query("SELECT groupUniqArray(200)(answering_model), groupUniqArray(200)(answering_model_name) "
                          "FROM verification_results FINAL WHERE run_id = {r:String}", {"r": run_id})
    shown, names = res.rows[0] if res.rows else ([], [])
    return sorted(shown), set(shown) | set(names)


async def compare(src: AsyncSource, a: Side, b: Side, f: Filters) -> dict[str, Any]:
    """Paired verdicts of two sides, matched by (question, replicate, judge) — and answering
    model when neither side names one. Counts and flips are computed in ClickHouse."""
    by_model = not a.model and not b.model
    # a result without a replicate (a one-replicate run) is the first: paired with replicate 1
    # (shared.analysis.stats.paired_replicate)
    key = "question_id, ifNull(replicate, 1) AS rep, parsing_model" + (", answering_model" if by_model else "")
    using = "question_id, rep, parsing_model" + (", answering_model" if by_model else "")
    fcond, fparams = f.with_(model="" if not by_model else f.model).sql()
    ca, pa = a.sql("a")
    cb, pb = b.sql("b")
    sub = (f"SELECT {{key}}, any(question_text) AS qt, toUInt8(any({SQL_VERDICT})) AS v, any(result_id) AS rid "
           "FROM verification_results FINAL WHERE {cond} AND {fcond} GROUP BY {using}")
    sa = sub.format(key=key, cond=ca, fcond=fcond, using=using)
    sb = sub.format(key=key, cond=cb, fcond=fcond, using=using)
    params = {**pa, **pb, **fparams}
    counts = await src.query(
        f"SELECT count(), countIf(A.v = 1 AND B.v = 1), countIf(A.v = 1 AND B.v = 0), countIf(A.v = 0 AND B.v = 1) "
        f"FROM ({sa}) AS A INNER JOIN ({sb}) AS B USING ({using})", params)
    n, both, a_only, b_only = (int(x) for x in counts.rows[0])
    sizes = await src.query(f"SELECT (SELECT count() FROM ({sa})), (SELECT count() FROM ({sb}))", params)
    na, nb = (int(x) for x in sizes.rows[0])
    flips = await src.query(
        f"SELECT question_id, A.qt, rep, parsing_model, {'answering_model, ' if by_model else ''}A.v, B.v, A.rid, B.rid "
        f"FROM ({sa}) AS A INNER JOIN ({sb}) AS B USING ({using}) WHERE A.v != B.v "
        f"ORDER BY question_id, rep, parsing_model LIMIT {FLIPS_LIMIT}", params)
    flip_rows = []
    for r in flips.rows:
        r = list(r)
        model = r.pop(4) if by_model else ""
        flip_rows.append({"question_id": r[0], "question_text": r[1], "replicate": r[2], "judge": r[3],
                          "model": model, "a": bool(r[4]), "b": bool(r[5]), "a_rid": r[6], "b_rid": r[7]})
    both_fail = n - both - a_only - b_only
    out: dict[str, Any] = {"pairs": n, "both_pass": both, "a_only": a_only, "b_only": b_only, "both_fail": both_fail,
                           "unpaired_a": na - n, "unpaired_b": nb - n, "flips": flip_rows,
                           "flips_total": a_only + b_only, "by_model": by_model}
    if n:
        diff, lo, hi = newcombe_paired_diff(both, a_only, b_only, both_fail)
        out.update(rate_a=Proportion.of(both + a_only, n), rate_b=Proportion.of(both + b_only, n),
                   difference=diff, ci_low=lo, ci_high=hi, mcnemar_p=mcnemar_exact(a_only, b_only))
    return out


def fmt_p(p: float) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "–"
    return f"{p:.3g}" if p >= 0.001 else f"{p:.1e}"
