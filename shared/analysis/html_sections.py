"""The static report's sections, each drawn from a `RunDigest` (one pass over the results,
aggregates only) rather than from the results themselves; the appendix streams the responses
of the questions it shows, a few questions at a time."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from shared.analysis.html_digest import RunDigest, TraitTally
from shared.analysis.html_svg import (
    _color,
    _esc,
    _fmt,
    _legend,
    _pct,
    _Raw,
    _short,
    _table,
    svg_grouped_bars,
    svg_question_heatmap,
    svg_rate_bars,
)
from shared.analysis.stats import Proportion, pass_at_k_from_outcomes
from shared.analysis.stored import for_questions
from shared.core.models import VerificationResult
from shared.core.usage import NOT_RECORDED, format_usd, money, recorded
from shared.core.verdict import errored, verdict_of
from shared.store.event_usage import EVENTS_SOURCE

MAX_HEAT_COLUMNS = 120
MAX_APPENDIX_RESPONSES = 2000
APPENDIX_BATCH_RESPONSES = 100  # responses fetched together (whole questions, at least one)


def _digest(data: RunDigest | Iterable[VerificationResult]) -> RunDigest:
    return data if isinstance(data, RunDigest) else RunDigest.of(data)


def section_pass_rates(data: RunDigest | Iterable[VerificationResult]) -> str:
    d = _digest(data)
    counts = d.per_model  # passed, verdicts, results, errors
    rows = [(m, Proportion.of(c[0], c[1])) for m, c in sorted(counts.items())]
    if not any(p.n for _, p in rows):
        return "<p class='muted'>No template verdicts in this run (rubric_only, or every job errored).</p>"
    chart = svg_rate_bars(rows, "Pass rate per answering model (bars) with Wilson 95% intervals (whiskers)")
    table = _table(["answering model", "results", "errors", "verdicts", "passed", "pass rate", "95% CI low",
                    "95% CI high"],
                   [(m, counts[m][2], counts[m][3], p.n, p.successes, _pct(p.rate), _pct(p.ci_low), _pct(p.ci_high))
                    for m, p in rows])
    return chart + table


def section_heatmap(data: RunDigest | Iterable[VerificationResult]) -> str:
    d = _digest(data)
    cells, per_q, texts = d.cells, d.per_q, d.texts
    if not any(n for _, n in per_q.values()):
        return "<p class='muted'>No template verdicts to map.</p>"
    order = d.hardest_first()
    note = ""
    if len(order) > MAX_HEAT_COLUMNS:
        note = (f"<p class='muted'>Showing the {MAX_HEAT_COLUMNS} hardest of {len(order)} questions; the table "
                f"below lists them all.</p>")
    shown = order[:MAX_HEAT_COLUMNS]
    models = sorted(d.models)
    chart = svg_question_heatmap([(q, texts.get(q, "")) for q in shown], models,
                                 {k: (v[0], v[1]) for k, v in cells.items()},
                                 "Pass rate, question × answering model (hardest questions first)")
    rows = []
    for i, q in enumerate(order, 1):
        p = per_q[q]
        row: list[Any] = [i, _Raw(f"<span title='{_esc(q)}'>{_esc(_short(q, 20))}</span>"), _short(texts.get(q, ""), 70)]
        for m in models:
            c = cells.get((m, q), [0, 0])
            row.append(_Raw(f"<span class='cell' style='background:{_color(c[0] / c[1] if c[1] else None)}'>"
                            f"{c[0]}/{c[1]}</span>"))
        row.append(_pct(p[0] / p[1] if p[1] else None))
        rows.append(row)
    table = _table(["#", "question id", "question", *models, "all models"], rows)
    return chart + note + f"<details><summary>Table: pass counts per question and model ({len(order)} questions)</summary>{table}</details>"


def error_groups(data: RunDigest | Iterable[VerificationResult]) -> list[dict[str, Any]]:
    """Errored results grouped by (stage, type): count, the questions, and the first example
    (question, error). The grouping is `shared.core.outcome.error_kind`'s, the same as the console
    and summary.json: a template whose verify() raised is its own group, apart from plain fails."""
    return _digest(data).error_groups()


def section_errors(data: RunDigest | Iterable[VerificationResult]) -> str:
    groups = error_groups(data)
    if not groups:
        return "<p class='muted'>No errors: every job completed.</p>"
    return _table(["stage", "type", "results", "questions", "example question", "example error"],
                  [(g["stage"], g["type"], g["count"], len(g["questions"]), _short(g["example_question"], 70),
                    _Raw(f"<code>{_esc(_short(g['example'], 400))}</code>")) for g in groups],
                  "Errored results by stage and error type (one example each)")


def _json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, default=str)


def _response(r: VerificationResult) -> str:
    m, t = r.metadata, r.template
    v = verdict_of(r)
    verdict = "error" if errored(r) else ("no verdict" if v is None else "pass" if v else "fail")
    body = f"<pre>{_esc((t.raw_llm_response if t else '') or '(no response)')}</pre>"
    if m.error:
        body += f"<p class='errtext'>{_esc(m.error)}</p>"
    if t and t.parsed_llm_response is not None:
        body += f"<p class='muted'>judge's parse: <code>{_esc(_json(t.parsed_llm_response))}</code></p>"
    return (f"<details class='resp'><summary><span class='v {verdict.replace(' ', '')}'>{verdict}</span> "
            f"{_esc(m.answering_model)} · judge {_esc(m.parsing_model)}"
            f"{f' · replicate {m.replicate}' if m.replicate is not None else ''}</summary>{body}</details>")


def iter_appendix(results: Iterable[VerificationResult], d: RunDigest,
                  limit: int = MAX_APPENDIX_RESPONSES) -> Iterator[str]:
    """Per question (hardest first): ground truth and each result's response, all collapsed; at
    most `limit` responses, with a note saying how many of how many. HTML chunks, one per
    question, fetched in batches of about `APPENDIX_BATCH_RESPONSES` responses, so a caller
    writing them to a file holds one batch of responses at a time."""
    if d.total > limit:
        yield (f"<p class='muted' id='appendix-note'>Showing the first {limit:,} of {d.total:,} responses "
               "(hardest questions first); <code>veribus view</code> browses them all.</p>")
    budget: list[tuple[str, int]] = []  # (question, responses shown)
    left = limit
    for q in d.hardest_first():
        if left <= 0:
            break
        take = min(left, d.q_results[q])
        budget.append((q, take))
        left -= take
    for batch in _batches(budget):
        by_q: dict[str, list[VerificationResult]] = {q: [] for q, _ in batch}
        room = dict(batch)
        for r in for_questions(results, [q for q, _ in batch]):
            rs = by_q[r.metadata.question_id]
            if len(rs) < room[r.metadata.question_id]:
                rs.append(r)
        for q, _ in batch:
            rs = by_q.pop(q)
            if not rs:
                continue
            p = d.per_q.get(q, [0, 0])
            gt = rs[0].metadata.raw_answer
            yield (f"<details class='q'><summary><b>{_esc(d.texts.get(q) or q)}</b> <span class='muted'>{_esc(q)} · "
                   f"{p[0]}/{p[1]} passed</span></summary>"
                   + (f"<p>ground truth: <code>{_esc(gt)}</code></p>" if gt else "")
                   + "".join(_response(r) for r in rs) + "</details>")


def _batches(budget: Sequence[tuple[str, int]]) -> Iterator[list[tuple[str, int]]]:
    """Consecutive questions whose responses add up to about `APPENDIX_BATCH_RESPONSES`."""
    batch: list[tuple[str, int]] = []
    size = 0
    for q, n in budget:
        if batch and size + n > APPENDIX_BATCH_RESPONSES:
            yield batch
            batch, size = [], 0
        batch.append((q, n))
        size += n
    if batch:
        yield batch


def section_appendix(results: Sequence[VerificationResult]) -> str:
    """The appendix as one string (see `iter_appendix`)."""
    return "".join(iter_appendix(results, RunDigest.of(results)))


def _sort_key(v: Any) -> tuple[int, Any]:
    if isinstance(v, bool):
        return (0, int(v))
    if isinstance(v, int | float):
        return (1, v)
    return (2, str(v))


def section_traits(data: RunDigest | Iterable[VerificationResult]) -> str:
    """Per trait: value distribution per model (booleans true/false, scores by value, metric
    traits by mean metric)."""
    d = _digest(data)
    if not d.traits:
        return "<p class='muted'>No rubric scores in this run.</p>"
    models = sorted(d.models)
    charts: list[str] = []
    table_rows: list[list[Any]] = []
    empty = TraitTally()
    for name in sorted(d.traits):
        per_model = d.traits[name]
        kind = d.trait_kinds[name]
        if kind == "metric":
            metrics = sorted({k for t in per_model.values() for k in t.metric_sum})
            series = [(m, [per_model[m].metric_sum.get(k, 0.0) / per_model[m].n if m in per_model and per_model[m].n
                           else 0.0 for k in metrics]) for m in models]
            charts.append(svg_grouped_bars(metrics, series, f"{name} (metric trait: mean per metric)", "{:.2g}"))
            for m in models:
                t = per_model.get(m, empty)
                for k in metrics:
                    n = t.metric_n.get(k, 0)
                    table_rows.append([name, kind + f" · {k}", m, n, t.metric_sum.get(k, 0.0) / n if n else None, ""])
            continue
        cats: list[Any] = sorted({c for t in per_model.values() for c in t.buckets}, key=_sort_key)
        series = [(m, [float(per_model.get(m, empty).buckets[c]) for c in cats]) for m in models]
        charts.append(svg_grouped_bars([_fmt(c) for c in cats], series, f"{name} ({kind}): count per value", "{:.0f}",
                                       integer=True))
        for m in models:
            t = per_model.get(m, empty)
            dist = ", ".join(f"{_fmt(c)}: {n}" for c, n in sorted(t.buckets.items(), key=lambda kv: _sort_key(kv[0])))
            table_rows.append([name, kind, m, t.n, (t.num_sum / t.num_n) if t.num_n else None, dist])
    grid = "".join(f"<div class='chart'>{c}</div>" for c in charts)
    table = _table(["trait", "kind", "answering model", "n", "mean", "distribution"], table_rows)
    return _legend(models) + f"<div class='grid'>{grid}</div>" + table


def _latency_by_stage(lat: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    by_stage: dict[str, dict[str, float]] = {}
    for x in lat:
        if x.get("status") not in (None, "performed"):
            continue  # skipped stages take no time worth charting (they stay in the table)
        s = by_stage.setdefault(str(x["stage"]), {"n": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0, "total": 0.0})
        s["n"] += float(x.get("n") or 0)
        s["p50"] = max(s["p50"], float(x.get("p50_ms") or 0.0))
        s["p95"] = max(s["p95"], float(x.get("p95_ms") or 0.0))
        s["max"] = max(s["max"], float(x.get("max_ms") or 0.0))
        s["total"] += float(x.get("total_ms") or 0.0)
    return by_stage


def section_usage_latency(data: RunDigest | Iterable[VerificationResult],
                          stage_latency: Sequence[Mapping[str, Any]]) -> str:
    d = _digest(data)
    tokens = d.tokens
    parts: list[str] = []
    if tokens:
        stages = sorted(tokens, key=lambda s: -(tokens[s][0] + tokens[s][1]))
        parts.append("<div class='grid'><div class='chart'>" + svg_grouped_bars(
            stages, [("input tokens", [float(tokens[s][0]) for s in stages]),
                     ("output tokens", [float(tokens[s][1]) for s in stages])],
            "Tokens per stage (sum over results)", "{:,.0f}", width=560) + _legend(["input tokens", "output tokens"])
            + "</div>")
    else:
        parts.append("<div class='grid'>")
    lat = [dict(x) for x in stage_latency if x.get("stage")]
    by_stage = _latency_by_stage(lat)
    if by_stage:
        order = sorted(by_stage, key=lambda s: -by_stage[s]["p95"])
        parts.append("<div class='chart'>" + svg_grouped_bars(
            order, [("p50 ms", [by_stage[s]["p50"] for s in order]), ("p95 ms", [by_stage[s]["p95"] for s in order])],
            "Latency per stage (ms, from the events table)", "{:,.0f}", width=560) + _legend(["p50 ms", "p95 ms"])
            + "</div>")
    parts.append("</div>")
    if tokens:
        parts.append(_table(["stage", "results", "input tokens", "output tokens", "total tokens"],
                            [(s, tokens[s][2], tokens[s][0], tokens[s][1], tokens[s][0] + tokens[s][1])
                             for s in sorted(tokens)], "Token usage per stage"))
    elif d.total and d.errored == d.total:
        parts.append("<p class='muted'>No token usage: every job errored before a model reported usage "
                     "(see the errors section).</p>")
    else:
        parts.append("<p class='muted'>No token usage recorded (manual traces, or usage not reported).</p>")
    if lat:
        parts.append(_table(["event", "stage", "status", "n", "p50 ms", "p95 ms", "max ms", "total ms"],
                            [(x.get("event_type"), x.get("stage"), x.get("status"), x.get("n"), x.get("p50_ms"),
                              x.get("p95_ms"), x.get("max_ms"), x.get("total_ms")) for x in lat],
                            "Stage latency (events table)"))
    else:
        parts.append("<p class='muted'>No stage events available (results loaded from a file).</p>")
    parts.append(_table(["answering model", "results", "p50 s", "p95 s", "max s"], d.e2e_table(),
                        "End-to-end execution time per result"))
    return "".join(parts)


def _unpriced(models: Sequence[str]) -> str:
    """What a total leaves out: the models without a price (the sum is the priced calls' only)."""
    return (f" <span class='muted'>(priced calls only; unknown for {_esc(', '.join(models))}: no price)</span>"
            if models else "")


def cost_from_events_html(cost_usd: float, calls: int, cached: int, unknown: Sequence[str], why: str) -> str:
    """A run's total cost and calls from its stage events (its results carry no usage section:
    `why`), with no breakdown: the HTML report's and the viewer's cost section then."""
    return (f"<p id='cost-total'>Total cost: <b>{money(cost_usd)}</b> · {calls:,} model calls · {cached:,} cached "
            f"replies{_unpriced(unknown)}</p><p class='muted' id='usage-source'>From the run's stage events: "
            f"{_esc(why)}, so there is no breakdown per model and stage.</p>")


def usage_not_recorded_html(why: str) -> str:
    """Neither the results nor the store know the calls and the cost (`why`)."""
    return f"<p class='muted' id='no-usage'>Model calls and cost not recorded: {_esc(why)}.</p>"


def section_cost(data: RunDigest | Iterable[VerificationResult], usage: Mapping[str, Any] | None = None) -> str:
    """Total cost, and cost, calls and tokens per model and stage (from the usage entries). When
    the results carry no usage section (rubric_only), `usage` (the summary's) says so, or gives
    the run's totals from its stage events."""
    d = _digest(data)
    rows = [(model, stage, *v) for (model, stage), v in sorted(d.cost.items())]
    if not rows and usage is not None and recorded(usage) and usage.get("source") == EVENTS_SOURCE:
        return cost_from_events_html(usage["cost_usd"], usage["model_calls"], usage["cached_replies"],
                                     usage.get("cost_unknown_models") or [], usage.get("not_recorded") or NOT_RECORDED)
    if not rows and usage is not None and not recorded(usage):
        return usage_not_recorded_html(usage.get("not_recorded") or NOT_RECORDED)
    if not rows or not any(r[2] or r[3] or r[4] or r[5] for r in rows):
        return "<p class='muted'>No model calls recorded: no cost to show.</p>"
    total = sum(r[4] for r in rows)
    unknown = sorted({r[0] for r in rows if r[5]})
    per_model: dict[str, float] = {}
    for r in rows:
        per_model[r[0]] = per_model.get(r[0], 0.0) + r[4]
    head = f"<p id='cost-total'>Total cost: <b>{money(total)}</b>{_unpriced(unknown)}</p>"
    by_model = _table(["model", "cost USD"], [(m, format_usd(c)) for m, c in sorted(per_model.items())],
                      "Cost per model")
    by_stage = _table(["model", "stage", "model calls", "cached replies", "cost USD", "entries without price",
                       "tokens"], [(r[0], r[1], int(r[2]), int(r[3]), format_usd(r[4]), int(r[5]), int(r[6]))
                                   for r in rows], "Cost per model and stage")
    return head + by_model + by_stage


def section_replicates(data: RunDigest | Iterable[VerificationResult]) -> str:
    d = _digest(data)
    rep = pass_at_k_from_outcomes({k: (v[0], v[1]) for k, v in d.replicates.items()})
    if not rep.per_model or max((m["max_replicates"] for m in rep.per_model), default=0) < 2:
        return "<p class='muted'>One verdict per question and model: no replicate statistics.</p>"
    ks = [k for k in rep.ks if k <= max(m["max_replicates"] for m in rep.per_model)][:6]
    cols = ["answering model", "judge", "questions", "flaky questions"] + [f"pass@{k}" for k in ks] + [f"pass^{k}" for k in ks]
    rows = [[m["answering_model"], m["parsing_model"], m["questions"], m["flaky_questions"],
             *[m[f"pass@{k}"] for k in ks], *[m[f"pass^{k}"] for k in ks]] for m in rep.per_model]
    flaky = sorted((q for q in rep.per_question if q["flaky"]), key=lambda q: -q["flakiness"])[:25]
    ftable = _table(["answering model", "judge", "question", "passed", "n", "flakiness"],
                    [(q["answering_model"], q["parsing_model"], q["question_id"], q["passed"], q["n"], q["flakiness"])
                     for q in flaky], "Flakiest questions (1 = a 50/50 split across replicates)") if flaky else \
        "<p class='muted'>No flaky questions: every replicate agreed.</p>"
    return _table(cols, rows, "Unbiased pass@k (any of k passes) and pass^k (all k pass)") + ftable
