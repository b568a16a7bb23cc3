"""HTML of the viewer's runs, run and compare pages: pure functions of the data
`shared.cli.view.queries` returns. The building blocks (escaping, links, tables, the frame) are in
`shared.cli.view.markup`, the sample page in `shared.cli.view.sample_page`. Charts reuse the
inline-SVG helpers of the static report."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from shared.analysis.html_sections import cost_from_events_html, usage_not_recorded_html
from shared.analysis.html_svg import PALETTE, _color, svg_grouped_bars, svg_rate_bars
from shared.analysis.stats import percent
from shared.cli.view.filters import STATUSES, Filters
from shared.cli.view.markup import (
    Raw,
    _a,
    _badge,
    _ci,
    _e,
    _kv,
    _n,
    _pct,
    _table,
    _verdict,
    _when,
    compare_url,
    page,
    run_url,
    sample_url,
)
from shared.cli.view.queries import fmt_p
from shared.core.usage import format_usd, money
from shared.core.verdict import has_verdicts
from shared.store.event_usage import EVENTS_SOURCE

# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


def _state(state: str) -> Raw:
    kind = {"finished": "pass", "running": "run", "cancelled": "muted", "incomplete": "fail"}.get(state, "muted")
    return _badge(state, kind)


def runs_page(data: Mapping[str, Any], q: str, bus: Mapping[str, Any] | None, backend: str) -> str:
    rows = []
    for r in data["runs"]:
        progress = (f"<progress max='{max(1, r['jobs'])}' value='{r['done']}'></progress> " if r["jobs"] else "")
        rows.append([
            Raw(str(_a(run_url(r["run_id"]), r["run_name"] or r["run_id"], "run-link"))
                + (" " + _badge("SIMULATED", "sim") if r["simulated"] else "")
                + f"<div class='sub'>{_e(r['run_id'])}</div>"),
            _when(r["requested_at"]), r["benchmark"], Raw(_e(", ".join(r["models"]))),
            r["jobs"] or "–", Raw(progress + _e(_n(r["done"]))), Raw(_e(_ci(r["rate"]))),
            Raw(f"<span class='{'errn' if r['errors'] else ''}'>{r['errors']:,}</span>"), _state(r["state"]),
        ])
    live = any(r["state"] == "running" for r in data["runs"])
    table = _table(["run", "requested", "benchmark", "models", "jobs", "done", "pass rate [95% CI]", "errors",
                    "state"], rows, "runs", "runs") if rows else _no_runs(q, data["page"])
    pager = ""
    if data["page"] or data["more"]:
        prev = _a("/?" + urlencode({"q": q, "page": data["page"] - 1}), "← newer") if data["page"] else ""
        nxt = _a("/?" + urlencode({"q": q, "page": data["page"] + 1}), "older →") if data["more"] else ""
        pager = f"<p class='pager'>{prev} {nxt}</p>"
    search = (f"<form class='filters' method='get' action='/'><input type='search' name='q' value='{_e(q)}' "
              f"placeholder='run id, name or benchmark' aria-label='search runs'><button>Search</button></form>")
    return page("Runs", f"<h1>Runs</h1>{search}<div id='live'>{_bus_strip(bus, backend)}{table}{pager}</div>",
                live=live, active="runs")


def _no_runs(q: str, page_no: int) -> str:
    """What an empty runs list means: a search that matched nothing, a page past the last, or
    a store without runs (only the last is "no runs in the store")."""
    if page_no:
        first = _a("/?" + urlencode({"q": q} if q else {}), "the first page")
        return (f"<p class='muted' id='no-runs'>No runs on page {page_no + 1}"
                f"{' for ' + _e(repr(q)) if q else ''}: it is past the last one; go to {first}.</p>")
    if q:
        return (f"<p class='muted' id='no-runs'>No run matches {_e(repr(q))} (run id, name or benchmark); "
                f"{_a('/', 'all runs')}.</p>")
    return "<p class='muted' id='no-runs'>No runs in the store.</p>"


def _bus_strip(bus: Mapping[str, Any] | None, backend: str) -> str:
    if bus is None:
        return f"<p class='muted bus'>store: {_e(backend)} · bus: not connected</p>"
    cons = " · ".join(f"{_e(c['name'])} {c['pending']:,} pending / {c['in_flight']:,} in flight"
                      for c in bus["consumers"] if c["pending"] or c["in_flight"])
    return (f"<p class='muted bus' id='bus'>store: {_e(backend)} · bus: {bus['messages']:,} messages in the stream"
            f"{' · ' + cons if cons else ' · no backlog'}</p>")


# --------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------


def _filter_form(action: str, f: Filters, h: Mapping[str, Any]) -> str:
    def select(name: str, label: str, options: Sequence[str], current: str) -> str:
        opts = "".join(f"<option value='{_e(o)}'{' selected' if o == current else ''}>{_e(o or 'any')}</option>"
                       for o in ["", *options])
        return f"<label>{label} <select name='{name}' id='f-{name}'>{opts}</select></label>"

    return (f"<form class='filters' id='filters' method='get' action='{_e(action)}'>"
            + select("model", "model", h.get("models", []), f.model)
            + select("judge", "judge", h.get("judges", []), f.judge)
            + select("keyword", "keyword", h.get("keywords", []), f.keyword)
            + select("status", "status", list(STATUSES), f.status)
            + f"<label>search <input type='search' id='f-q' name='q' value='{_e(f.q)}' "
              f"placeholder='question, response, error'></label><button id='apply'>Apply</button>"
            + (f" {_a(action, 'clear filters')}" if f.active() else "") + "</form>")


def _kpis(h: Mapping[str, Any]) -> str:
    verdicts = has_verdicts(h.get("mode"))  # rubric_only: no template verdicts, never "passed 0"
    items = [("results", f"{h['results']:,}" + (f" / {h['jobs']:,}" if h["jobs"] else "")),
             ("pass rate", _ci(h["rate"])), ("passed", h["passed"] if verdicts else "–"),
             ("failed", h["failed"] if verdicts else "–"),
             ("errors", h["errors"]), ("questions", h["questions"]),
             ("tokens", f"{h['input_tokens'] + h['output_tokens']:,}" if h.get("tokens_recorded", True)
              else "not recorded")]
    return "<div class='kpis'>" + "".join(f"<div class='kpi'><b>{_e(_n(v))}</b><span>{_e(k)}</span></div>"
                                          for k, v in items) + "</div>"


_SVG_SIZE = re.compile(r'^<svg xmlns="http://www.w3.org/2000/svg" width="([\d.]+)" height="([\d.]+)"')


def _fit(svg: str) -> str:
    """An SVG that scales down to its box (a viewBox from its width and height)."""
    return _SVG_SIZE.sub(lambda m: f'{m.group(0)} viewBox="0 0 {m.group(1)} {m.group(2)}"', svg, count=1)


def _rates_section(rows: Sequence[Mapping[str, Any]], what: str, run_id: str, f: Filters, key: str) -> str:
    if not rows:
        return "<p class='muted'>No results match.</p>"
    chart = _fit(svg_rate_bars([(r["name"], r["rate"]) for r in rows], f"Pass rate per {what} with Wilson 95% intervals")) \
        if any(r["rate"].n for r in rows) else "<p class='muted'>No template verdicts.</p>"
    table = _table([what, "results", "errors", "verdicts", "passed", "pass rate", "95% CI"],
                   [(_a(run_url(run_id, f.with_(**{key: r["name"]})), r["name"]), r["results"], r["errors"],
                     r["rate"].n, r["rate"].successes, _pct(r["rate"].rate),
                     "–" if r["rate"].rate is None else f"{_pct(r['rate'].ci_low)} – {_pct(r['rate'].ci_high)}")
                    for r in rows])
    return f"<div class='chart'>{chart}</div>{table}"


def _heatmap_section(heat: Mapping[str, Any], run_id: str, f: Filters, hpage: int) -> str:
    if not heat["questions"] and hpage and heat["total"]:
        last = (heat["total"] - 1) // 40
        return (f"<p class='muted'>{heat['total']:,} questions · page {hpage + 1} is past the last one "
                f"({last + 1}): {_a(run_url(run_id, f, hpage=last, anchor='heat'), 'go to the last page')}</p>")
    if not heat["questions"]:
        return "<p class='muted'>No results match.</p>"
    models = heat["models"]
    head = "".join(f"<th class='m'>{_a(run_url(run_id, f.with_(model=m)), m)}</th>" for m in models)
    body = []
    for q in heat["questions"]:
        label = q["text"] or q["id"]
        cells = []
        for m in models:
            c = heat["cells"].get((q["id"], m))
            if c is None:
                cells.append("<td class='hc'></td>")
                continue
            rate = c["passed"] / c["n"] if c["n"] else None
            text = f"{c['passed']}/{c['n']}" + (f" ({c['errors']}✗)" if c["errors"] else "")
            href = (sample_url(run_id, c["result_id"]) if c["results"] == 1
                    else run_url(run_id, f.with_(model=m, q=q["id"]), anchor="samples"))
            cells.append(f"<td class='hc' style='background:{_color(rate)}'><a href='{_e(href)}' "
                         f"title='{_e(m)} · {_e(label)}: {_e(text)}'>{_e(text)}</a></td>")
        qlink = run_url(run_id, f.with_(q=q["id"]))
        body.append(f"<tr><th class='q'><a href='{_e(qlink)}' title='{_e(q['id'])}'>{_e(_short(label, 90))}</a>"
                    f"<div class='sub'>{_e(q['id'])}</div></th>{''.join(cells)}<td>{_e(_ci(q['rate']))}</td></tr>")
    table = (f"<table class='heat' id='heatmap'><thead><tr><th>question (hardest first)</th>{head}<th>all models</th>"
             f"</tr></thead><tbody>{''.join(body)}</tbody></table>")
    pager = []
    if hpage:
        pager.append(_a(run_url(run_id, f, hpage=hpage - 1, anchor="heat"), "← easier"))
    if heat["more"]:
        pager.append(_a(run_url(run_id, f, hpage=hpage + 1, anchor="heat"), "harder → next questions"))
    shown = f"questions {hpage * 40 + 1}–{hpage * 40 + len(heat['questions'])} of {heat['total']:,}"
    legend = ("<div class='legend'>" + "".join(f"<i style='background:{_color(k / 10)}'></i>" for k in range(11))
              + " 0% → 100% pass · grey: no verdict</div>")
    return f"<p class='muted'>{shown} {' '.join(pager)}</p>{legend}<div class='scroll'>{table}</div>"


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _errors_section(err: Mapping[str, Any], run_id: str, f: Filters) -> str:
    if not err["groups"] and not err["events"]:
        return "<p class='muted' id='no-errors'>No errors.</p>"
    parts = []
    if err["groups"]:
        parts.append(_table(["stage", "type", "results", "example"], [
            (g["stage"] or "–", g["type"], _a(run_url(run_id, f.with_(status="errored"), anchor="samples"), g["count"]),
             Raw(f"<code>{_e(_short(g['example'], 240))}</code> " + str(_a(sample_url(run_id, g["result_id"]), "open"))))
            for g in err["groups"]], "errors", "errors"))
    if err["events"]:
        parts.append(_table(["event", "stage", "type", "count", "example"], [
            (e["event"], e["stage"], e["type"], e["count"], Raw(f"<code>{_e(_short(e['example'], 240))}</code>"))
            for e in err["events"]]))
    return "".join(parts)


def _traits_section(traits: Sequence[Mapping[str, Any]]) -> str:
    if not traits:
        return "<p class='muted'>No rubric scores.</p>"
    models = sorted({t["model"] for t in traits})
    names = sorted({t["name"] for t in traits})
    by = {(t["name"], t["model"]): t for t in traits}
    kinds = {t["name"]: t["kind"] for t in traits}
    charts = []
    for kind_group in ("score", "share"):
        cats = [n for n in names if (kind_group == "share") == _is_boolean(by, n, models)]
        if not cats:
            continue
        series = []
        for m in models:
            vals = []
            for n in cats:
                t = by.get((n, m))
                vals.append(float((t["share_one"] if kind_group == "share" else t["mean"]) or 0.0) if t else 0.0)
            series.append((m, vals))
        title = "Share true per trait and model" if kind_group == "share" else "Mean score per trait and model"
        charts.append(f"<div class='chart'>{svg_grouped_bars(cats, series, title, '{:.2f}', width=max(420, 90 * len(cats)))}"
                      "</div>")
    legend = "<div class='legend'>" + "".join(
        f"<span class='key'><i style='background:{PALETTE[i % len(PALETTE)]}'></i>{_e(m)}</span>"
        for i, m in enumerate(models)) + "</div>"
    table = _table(["trait", "kind", "model", "n", "mean", "min", "max", "share true"],
                   [(t["name"], kinds[t["name"]], t["model"], t["n"], t["mean"], t["min"], t["max"], _pct(t["share_one"]))
                    for t in traits], "traits", "traits")
    return legend + f"<div class='grid'>{''.join(charts)}</div>" + table


def _is_boolean(by: Mapping[tuple[str, str], Mapping[str, Any]], name: str, models: Sequence[str]) -> bool:
    ts = [by[(name, m)] for m in models if (name, m) in by]
    return all((t["min"] or 0) >= 0 and (t["max"] or 0) <= 1 for t in ts)


def _latency_section(lat: Sequence[Mapping[str, Any]], tokens: Sequence[Mapping[str, Any]]) -> str:
    parts = ["<div class='grid'>"]
    if lat:
        order = [x["stage"] for x in lat]
        parts.append("<div class='chart'>" + svg_grouped_bars(
            order, [("p50 ms", [float(x["p50_ms"] or 0) for x in lat]), ("p95 ms", [float(x["p95_ms"] or 0) for x in lat])],
            "Latency per stage (ms)", "{:,.0f}", width=560) + "</div>")
    if tokens:
        parts.append("<div class='chart'>" + svg_grouped_bars(
            [t["stage"] for t in tokens], [("input", [float(t["input_tokens"]) for t in tokens]),
                                           ("output", [float(t["output_tokens"]) for t in tokens])],
            "Tokens per stage", "{:,.0f}", width=560) + "</div>")
    parts.append("</div>")
    if lat:
        parts.append(_table(["stage", "n", "performed", "skipped", "failed", "p50 ms", "p95 ms", "max ms", "total ms"],
                            [(x["stage"], x["n"], x["performed"], x["skipped"], x["failed"], x["p50_ms"], x["p95_ms"],
                              x["max_ms"], x["total_ms"]) for x in lat], "latency", "latency"))
    else:
        parts.append("<p class='muted'>No stage events for this run.</p>")
    if tokens:
        parts.append(_table(["stage", "results", "input tokens", "output tokens"],
                            [(t["stage"], t["results"], t["input_tokens"], t["output_tokens"]) for t in tokens]))
    else:
        parts.append("<p class='muted'>No token usage recorded by any result shown.</p>")
    return "".join(parts)


def _cost_section(cost: Mapping[str, Any] | None) -> str:
    """Total cost, then per model and per model and stage (when any result carries a price); for
    results without a usage section (rubric_only), the run's stage events' totals, or that they
    are not recorded."""
    if cost and cost.get("source") == EVENTS_SOURCE:
        return cost_from_events_html(cost["total_usd"], cost["calls"], cost["cached"], cost.get("unknown_models") or [],
                                     cost["not_recorded"])
    if cost and cost.get("source") == "none":
        return usage_not_recorded_html(cost["not_recorded"])
    if not cost or not (cost["priced_results"] or cost["calls"]):
        return "<p class='muted' id='no-cost'>No cost recorded for these results (no model calls, or no prices).</p>"
    unknown = cost.get("unknown_models") or []
    unpriced = (f" <span class='muted'>(priced calls only; unknown for {_e(', '.join(unknown))}: no price; "
                f"{cost['unpriced_results']:,} results without a full price)</span>"
                if unknown else (f" <span class='muted'>({cost['unpriced_results']:,} results without a price)</span>"
                                 if cost["unpriced_results"] else ""))
    head = (f"<p id='cost-total'>Total cost: <b>{money(cost['total_usd'])}</b> · {cost['calls']:,} model calls · "
            f"{cost['cached']:,} cached replies{unpriced}</p>")
    by_model = _table(["model", "cost USD"], [(m["model"], format_usd(m["cost_usd"])) for m in cost["by_model"]],
                      "cost", "cost-by-model")
    by_stage = _table(["model", "stage", "entries", "cost USD", "entries without price", "tokens"],
                      [(r["model"], r["stage"], r["entries"], format_usd(r["cost_usd"]), r["unpriced"], r["tokens"])
                       for r in cost["by_stage"]], "cost", "cost-by-stage")
    return "<div class='cols'><section>" + head + by_model + "</section><section>" + by_stage + "</section></div>"


def _samples_section(s: Mapping[str, Any], run_id: str, f: Filters, page_no: int) -> str:
    rows = [(_a(sample_url(run_id, r["result_id"], f), _short(r["question_text"] or r["question_id"], 70), "sample-link"),
             r["answering_model"], r["parsing_model"], r["replicate"],
             _verdict(r["verify_result"], r["completed_without_errors"], r.get("verify_raised")),
             Raw(f"<span class='sub'>{_e(_short(r['error'] or r['response'], 110))}</span>"),
             r["execution_time"], r["total_tokens"]) for r in s["rows"]]
    table = _table(["question", "model", "judge", "rep", "verdict", "response / error", "time s", "tokens"], rows,
                   "samples", "samples-table") if rows else "<p class='muted' id='no-samples'>No results match.</p>"
    last = max(0, (s["total"] - 1) // s["page_size"])
    if page_no > last:  # a page past the end (an old link, a hand-made URL): say so, link to the last
        return (f"<p class='muted' id='samples-count'>{s['total']:,} results match · page {page_no + 1} is past "
                f"the last one ({last + 1}): "
                f"{_a(run_url(run_id, f, page=last, anchor='samples'), 'go to the last page')}</p>"
                "<p class='muted' id='no-samples'>No results on this page.</p>")
    pager = []
    if page_no:
        pager.append(_a(run_url(run_id, f, page=page_no - 1, anchor="samples"), "← previous"))
    if page_no < last:
        pager.append(_a(run_url(run_id, f, page=page_no + 1, anchor="samples"), "next →"))
    first = page_no * s["page_size"] + 1 if s["rows"] else 0
    return (f"<p class='muted' id='samples-count'>{s['total']:,} results match · showing {first:,}–"
            f"{page_no * s['page_size'] + len(s['rows']):,} {' '.join(pager)}</p>{table}")


def run_page(h: Mapping[str, Any], f: Filters, *, models: Sequence[Mapping[str, Any]],
             judges: Sequence[Mapping[str, Any]], heat: Mapping[str, Any], err: Mapping[str, Any],
             traits: Sequence[Mapping[str, Any]], lat: Sequence[Mapping[str, Any]],
             tokens: Sequence[Mapping[str, Any]], samples: Mapping[str, Any], page_no: int, hpage: int,
             cost: Mapping[str, Any] | None = None) -> str:
    run_id = h["run_id"]
    title = h["run_name"] or run_id
    sim = (" " + _badge("SIMULATED", "sim")) if h["simulated"] else ""
    cfg = h.get("config") or {}
    compare = ""
    if len(h["models"]) >= 2:
        compare = " · " + str(_a(compare_url(run=run_id, a=h["models"][0], b=h["models"][1]),
                                 "compare the first two models", "compare-link"))
    meta = (f"<p class='muted'>run {_e(run_id)} · benchmark {_e(h['benchmark'] or '–')} · mode "
            f"{_e(h['mode'] or cfg.get('evaluation_mode') or '–')} · requested {_e(_when(h['requested_at']))} · "
            f"state {_state(h['state'])}{compare}</p>")
    note = ("<p class='note' id='filtered-note'>Filtered: the run's totals just below and the stage latency are "
            "for the whole run; every other section shows only matching results.</p>") if f.active() else ""
    body = [
        f"<h1>{_e(title)}{sim}</h1>", meta, _filter_form(run_url(run_id), f, h), note,
        "<div id='live'>", _kpis(h),
        "<div class='cols'><section><h2 id='rates'>Pass rate per answering model</h2>",
        _rates_section(models, "answering model", run_id, f, "model"),
        "</section><section><h2 id='judges'>Pass rate per judge</h2>", _rates_section(judges, "judge", run_id, f, "judge"),
        "</section></div>",
        "<h2 id='heat'>Questions × models</h2>", _heatmap_section(heat, run_id, f, hpage),
        "<h2 id='errs'>Errors by stage and type</h2>", _errors_section(err, run_id, f),
        "<h2 id='rubric'>Rubric traits</h2>", _traits_section(traits),
        "<h2 id='perf'>Latency and tokens per stage</h2>", _latency_section(lat, tokens),
        "<h2 id='cost'>Cost per model and stage</h2>", _cost_section(cost),
        "<h2 id='samples'>Results</h2>", _samples_section(samples, run_id, f, page_no),
        "</div>",
    ]
    return page(title, "".join(body), live=h["state"] == "running", active="runs")


# --------------------------------------------------------------------------------------------
# Compare
# --------------------------------------------------------------------------------------------


def compare_page(form: Mapping[str, str], runs: Sequence[Mapping[str, Any]], models: Sequence[str],
                 result: Mapping[str, Any] | None, problem: str = "") -> str:
    def run_select(name: str, label: str) -> str:
        cur = form.get(name, "")
        opts = "".join(f"<option value='{_e(r['run_id'])}'{' selected' if r['run_id'] == cur else ''}>"
                       f"{_e(r['run_name'] or r['run_id'])} · {_e(r['run_id'])}</option>" for r in runs)
        blank = "<option value=''>(same run)</option>" if name == "run_b" else ""
        return f"<label>{label} <select name='{name}' id='c-{name}'>{blank}{opts}</select></label>"

    def model_select(name: str, label: str) -> str:
        cur = form.get(name, "")
        opts = "".join(f"<option value='{_e(m)}'{' selected' if m == cur else ''}>{_e(m)}</option>"
                       for m in ["", *models])
        return f"<label>{label} <select name='{name}' id='c-{name}'>{opts}</select></label>"

    formhtml = ("<form class='filters' id='compare-form' method='get' action='/compare'>"
                + run_select("run", "run A") + model_select("a", "model A") + run_select("run_b", "run B")
                + model_select("b", "model B") + "<button id='c-go'>Compare</button></form>"
                + "<p class='muted'>Two models of one run: pick run A and models A and B. Two runs: pick runs A and B "
                  "(and optionally a model on each). Pairs are matched by question, replicate and judge (a run of one "
                  "replicate is replicate 1).</p>")
    body = ["<h1>Compare</h1>", formhtml]
    if problem:
        body.append(f"<p class='error' id='problem'>{_e(problem)}</p>")
    if result is not None:
        body.append(_compare_result(form, result))
    return page("Compare", "".join(body), active="compare")


def _compare_result(form: Mapping[str, str], r: Mapping[str, Any]) -> str:
    run_a, run_b = form.get("run", ""), form.get("run_b") or form.get("run", "")
    la = f"A: {form.get('a') or 'all models'} ({run_a})"
    lb = f"B: {form.get('b') or 'all models'} ({run_b})"
    if not r["pairs"]:
        return (f"<p class='error' id='problem'>No paired verdicts: {_e(la)} and {_e(lb)} share no (question, "
                f"replicate, judge) with a verdict.</p>")
    sig = "significant at 5%" if r["mcnemar_p"] < 0.05 else "not significant at 5%"
    summary = _kv([
        ("paired jobs", f"{r['pairs']:,} (unpaired: A {r['unpaired_a']:,}, B {r['unpaired_b']:,})"),
        (la, _ci(r["rate_a"])), (lb, _ci(r["rate_b"])),
        ("both pass / A only / B only / both fail", f"{r['both_pass']} / {r['a_only']} / {r['b_only']} / {r['both_fail']}"),
        ("difference A − B (95% CI, Newcombe)",
         f"{percent(r['difference']):+.1f} points [{percent(r['ci_low']):+.1f}, {percent(r['ci_high']):+.1f}]"),
        ("exact McNemar p", f"{fmt_p(r['mcnemar_p'])} ({sig})"),
    ], "compare-summary")
    chart = svg_rate_bars([(la, r["rate_a"]), (lb, r["rate_b"])], "Pass rate on the paired jobs (Wilson 95%)")
    flips = _table(["question", "judge", "rep"] + (["model"] if r["by_model"] else []) + ["A", "B"],
                   [(_a(sample_url(run_a, f["a_rid"]), _short(f["question_text"] or f["question_id"], 80)),
                     f["judge"], f["replicate"], *([f["model"]] if r["by_model"] else []),
                     Raw(f"<a href='{_e(sample_url(run_a, f['a_rid']))}'>{_verdict(f['a'])}</a>"),
                     Raw(f"<a href='{_e(sample_url(run_b, f['b_rid']))}'>{_verdict(f['b'])}</a>"))
                    for f in r["flips"]], "flips", "flips") if r["flips"] else "<p class='muted'>No flips.</p>"
    more = (f"<p class='muted'>showing {len(r['flips'])} of {r['flips_total']} flips</p>"
            if r["flips_total"] > len(r["flips"]) else "")
    return (f"{summary}<div class='chart'>{chart}</div><h2 id='flip-head'>Per-question flips "
            f"({r['flips_total']:,})</h2>{more}{flips}")
