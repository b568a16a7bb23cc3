"""A run's model calls, cached replies, tokens and cost from its stage events, for results that
carry no usage section.

In rubric_only mode a result has no `template`, and `usage_metadata` lives there (spec/001), so
its results say nothing of the calls made for them; the `events` table still has each stage
event's tokens and cost (columns filled from the stage's own usage entries,
`shared.store.rows.EVENT_USAGE_KEYS`) and, in its payload, the entries themselves with their
`model_calls` and `cached_replies`. The figure is counted as the results count theirs: per job;
an answer shared by several judges counts its call and cost on its first job only (the others'
entries are `shared_reply`s), so each call is counted once.

`event_usage_sql(cond)` is one aggregate query (`cond` narrows the run's results, for the
viewer's filters); `usage_from_rows` turns its row into the shape of
`shared.core.usage.UsageTally.as_dict`, with `source: "events"`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shared.core.usage import NOT_RECORDED, recorded, usd
from shared.store.rows import EVENT_USAGE_KEYS

EVENTS_SOURCE = "events"


def _per_event(field: str, kind: str) -> str:
    """multiIf over the event types: the sum of `field` over the event's own usage entries."""
    arms = []
    for event_type, keys in EVENT_USAGE_KEYS.items():
        parts = [f"JSONExtract{kind}(payload, 'state', 'usage', '{k}', '{field}')" for k in keys]
        arms.append(f"event_type = '{event_type}', " + " + ".join(parts))
    zero = "0" if kind == "UInt" else "''"
    return f"multiIf({', '.join(arms)}, {zero})"


def _model() -> str:
    """The model of the event's first usage entry that names one (else its stage key)."""
    arms = []
    for event_type, keys in EVENT_USAGE_KEYS.items():
        names = [f"nullIf(JSONExtractString(payload, 'state', 'usage', '{k}', 'model'), '')" for k in keys]
        arms.append(f"event_type = '{event_type}', coalesce({', '.join(names)}, '{keys[0]}')")
    return f"multiIf({', '.join(arms)}, '')"


def event_usage_sql(cond: str = "1") -> str:
    """One row: events, calls, cached replies, cost (priced entries), events with calls and no
    price, their models, input and output tokens, over the stage events of run `{r:String}`
    whose result matches `cond` (a condition on `verification_results` columns; "1": all)."""
    types = ", ".join(f"'{t}'" for t in EVENT_USAGE_KEYS)
    results = ("" if cond.strip() == "1" else
               f" AND result_id IN (SELECT result_id FROM verification_results FINAL WHERE run_id = {{r:String}} "
               f"AND {cond})")
    return (
        "SELECT count(), sum(calls), sum(cached), sum(ifNull(cost_usd, 0)), countIf(cost_usd IS NULL AND calls > 0), "
        "groupUniqArrayIf(20)(model, cost_usd IS NULL AND calls > 0), sum(ifNull(input_tokens, 0)), "
        "sum(ifNull(output_tokens, 0)) FROM ("
        f"SELECT cost_usd, input_tokens, output_tokens, {_per_event('model_calls', 'UInt')} AS calls, "
        f"{_per_event('cached_replies', 'UInt')} AS cached, {_model()} AS model "
        f"FROM events FINAL WHERE run_id = {{r:String}} AND event_type IN ({types}){results})")


def usage_from_rows(rows: Sequence[Sequence[Any]] | None) -> dict[str, Any] | None:
    """The usage (calls, cached replies, cost rounded once, models without a price, tokens) of
    `event_usage_sql`'s rows; None when the run has no stage events with usage (nothing recorded)."""
    row = rows[0] if rows else None
    if not row or not int(row[0] or 0):
        return None
    events, calls, cached, cost, _unpriced, unknown, tin, tout = row
    if not int(calls or 0) and not int(cached or 0) and not int(tin or 0) and not int(tout or 0):
        return None
    return {"model_calls": int(calls or 0), "cached_replies": int(cached or 0), "cost_usd": usd(float(cost or 0.0)),
            "cost_unknown_models": sorted(str(m) for m in unknown or []), "input_tokens": int(tin or 0),
            "output_tokens": int(tout or 0), "source": EVENTS_SOURCE}


def with_event_usage(usage: dict[str, Any], run_id: str, query: Callable[[str, dict[str, Any]], Any]) -> dict[str, Any]:
    """`usage` when its results recorded it; else the run's stage events' figures (keeping
    `not_recorded`, why the results could not tell), when the store has them. `query(sql,
    params)` reads the store (`shared.store.reads.run_query` bound to the settings, a source's
    `query`). A store that cannot answer leaves `usage` as it is: "not recorded", never zero."""
    if recorded(usage):
        return usage
    try:
        res = query(event_usage_sql(), {"r": run_id})
    except Exception:  # noqa: BLE001 - the figure stays "not recorded"; the report itself goes on
        return usage
    found = usage_from_rows(res.rows)
    if found is None:
        return usage
    found["not_recorded"] = usage.get("not_recorded") or NOT_RECORDED
    found["results_without_usage"] = usage.get("results_without_usage", 0)
    return found
