"""`veribus report RUN --html FILE`: one self-contained HTML page about a run.

No JavaScript, no external files: the charts are inline SVG drawn here, each followed by the
table it was drawn from. Sections:

1. pass rate per answering model with Wilson 95% intervals;
2. a heat map of pass rate, model x question (replicates and judges pooled), hardest first;
3. rubric trait score distributions per model;
4. token usage per stage (from `usage_metadata`) and latency per stage (from the `events`
   table's stage records via `v_stage_latency`), plus end-to-end time per model;
5. pass@k / pass^k across replicates and the flakiest questions;
6. errors grouped by stage and error type, one example each (also summarised in a banner on top);
7. an appendix per question: ground truth and every result's response, collapsed.

A simulated run (models served by the offline LLM simulator) carries a SIMULATED banner.
"""

from __future__ import annotations

import html
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.analysis.export import rubric_definition_from_store
from shared.analysis.report import summarize, trait_score
from shared.analysis.stats import Proportion, pass_at_k_report
from shared.core.models import VerificationResult
from shared.core.outcome import error_kind
from shared.store.reads import ResultFilter, iter_result_json, open_source, resolve_run

if TYPE_CHECKING:
    from shared.core.config import Settings
    from shared.store.reads import RowSource

PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D", "#FF9DA6",
           "#BAB0AC"]
MAX_HEAT_COLUMNS = 120


@dataclass
class RunData:
    """Everything the page shows about one run."""

    run_id: str
    results: list[VerificationResult]
    run_name: str | None = None
    benchmark_name: str = ""
    config: dict[str, Any] | None = None
    rubric_definition: dict[str, Any] | None = None
    stage_latency: list[dict[str, Any]] = field(default_factory=list)
    simulated: bool | None = None


def _esc(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.{digits}g}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def _table(columns: Sequence[str], rows: Iterable[Sequence[Any]], caption: str = "") -> str:
    head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, _Raw) else _esc(_fmt(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    cap = f"<caption>{_esc(caption)}</caption>" if caption else ""
    return f'<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


class _Raw(str):
    """Already-escaped HTML for a table cell."""


def _short(text: str, n: int = 48) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _color(rate: float | None) -> str:
    """Red (0) -> amber (0.5) -> green (1); grey without data."""
    if rate is None:
        return "#e0e0e0"
    r = max(0.0, min(1.0, rate))
    if r < 0.5:
        a, b, t = (215, 48, 39), (254, 224, 139), r / 0.5
    else:
        a, b, t = (254, 224, 139), (26, 152, 80), (r - 0.5) / 0.5
    c = tuple(round(x + (y - x) * t) for x, y in zip(a, b, strict=True))
    return f"#{c[0]:02x}{c[1]:02x}{c[2]:02x}"


# --------------------------------------------------------------------------------------------
# Charts
# --------------------------------------------------------------------------------------------


def svg_rate_bars(rows: Sequence[tuple[str, Proportion]], title: str) -> str:
    """Horizontal bars (rate) with Wilson whiskers, one per label."""
    label_w, bar_w, row_h, top = 300, 460, 30, 34
    h = top + row_h * max(1, len(rows)) + 34
    w = label_w + bar_w + 110
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" aria-label="{_esc(title)}">',
           f'<text x="8" y="20" class="t">{_esc(title)}</text>']
    x0 = label_w
    for i in range(0, 11, 2):
        x = x0 + bar_w * i / 10
        out.append(f'<line x1="{x}" y1="{top - 4}" x2="{x}" y2="{h - 28}" class="grid"/>'
                   f'<text x="{x}" y="{h - 12}" class="ax" text-anchor="middle">{i * 10}%</text>')
    for i, (label, p) in enumerate(rows):
        y = top + i * row_h
        rate = p.rate if p.rate is not None else 0.0
        color = PALETTE[i % len(PALETTE)]
        out.append(f'<text x="{label_w - 8}" y="{y + 18}" text-anchor="end" class="lb">{_esc(_short(label, 44))}'
                   f'<title>{_esc(label)}</title></text>')
        out.append(f'<rect x="{x0}" y="{y + 5}" width="{bar_w * rate:.1f}" height="{row_h - 10}" fill="{color}" '
                   f'opacity="0.85"><title>{_esc(label)}: {p.successes}/{p.n} = {_pct(p.rate)}</title></rect>')
        lo, hi = x0 + bar_w * p.ci_low, x0 + bar_w * p.ci_high
        cy = y + row_h / 2
        out.append(f'<line x1="{lo:.1f}" y1="{cy}" x2="{hi:.1f}" y2="{cy}" class="ci"/>'
                   f'<line x1="{lo:.1f}" y1="{cy - 6}" x2="{lo:.1f}" y2="{cy + 6}" class="ci"/>'
                   f'<line x1="{hi:.1f}" y1="{cy - 6}" x2="{hi:.1f}" y2="{cy + 6}" class="ci"/>')
        out.append(f'<text x="{x0 + bar_w + 8}" y="{y + 18}" class="val">{_pct(p.rate)} (n={p.n})</text>')
    out.append("</svg>")
    return "".join(out)


def svg_heatmap(rows: Sequence[str], cols: Sequence[str], cells: Mapping[tuple[str, str], tuple[int, int]],
                title: str) -> str:
    """Model x question grid coloured by pass rate; a tooltip per cell gives passed/n."""
    label_w, top = 260, 40
    cell = max(6, min(28, 800 // max(1, len(cols))))
    w = max(label_w + cell * len(cols) + 20, label_w + 11 * 24 + 160, 8 + 7 * len(title))
    h = top + cell * len(rows) + 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" aria-label="{_esc(title)}">',
           f'<text x="8" y="20" class="t">{_esc(title)}</text>']
    for j, q in enumerate(cols):
        if cell >= 14:
            x = label_w + j * cell + cell / 2
            out.append(f'<text x="{x}" y="{top - 4}" class="ax" text-anchor="middle">{j + 1}<title>{_esc(q)}</title></text>')
    for i, m in enumerate(rows):
        y = top + i * cell
        out.append(f'<text x="{label_w - 6}" y="{y + cell * 0.7}" text-anchor="end" class="lb">'
                   f'{_esc(_short(m, 40))}<title>{_esc(m)}</title></text>')
        for j, q in enumerate(cols):
            passed, n = cells.get((m, q), (0, 0))
            rate = passed / n if n else None
            out.append(f'<rect x="{label_w + j * cell}" y="{y}" width="{cell - 1}" height="{cell - 1}" '
                       f'fill="{_color(rate)}"><title>{_esc(m)} · {_esc(q)}: {passed}/{n}</title></rect>')
    ly = top + cell * len(rows) + 18
    for k in range(11):
        out.append(f'<rect x="{label_w + k * 24}" y="{ly}" width="24" height="12" fill="{_color(k / 10)}"/>')
    out.append(f'<text x="{label_w - 6}" y="{ly + 10}" text-anchor="end" class="ax">pass rate 0%</text>'
               f'<text x="{label_w + 11 * 24 + 6}" y="{ly + 10}" class="ax">100%</text>'
               f'<rect x="{label_w + 11 * 24 + 50}" y="{ly}" width="12" height="12" fill="{_color(None)}"/>'
               f'<text x="{label_w + 11 * 24 + 68}" y="{ly + 10}" class="ax">no verdict</text>')
    out.append("</svg>")
    return "".join(out)


def svg_grouped_bars(categories: Sequence[str], series: Sequence[tuple[str, Sequence[float]]], title: str,
                     fmt: str = "{:g}", width: int = 420, height: int = 190, integer: bool = False) -> str:
    """Vertical grouped bars: one group per category, one bar per series."""
    left, top, bottom = 46, 28, 44
    plot_w, plot_h = width - left - 10, height - top - bottom
    vmax, step = _nice_axis(max([v for _, vals in series for v in vals] + [0.0]), integer=integer)
    ticks = int(round(vmax / step))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="{_esc(title)}"><text x="6" y="16" class="t2">{_esc(_short(title, 60))}</text>']
    for k in range(ticks + 1):
        v = step * k
        y = top + plot_h - plot_h * k / ticks
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" class="ax">{_axis_label(v)}</text>')
    ng = max(1, len(categories))
    gw = plot_w / ng
    bw = max(2.0, (gw - 8) / max(1, len(series)))
    for gi, cat in enumerate(categories):
        gx = left + gi * gw + 4
        for si, (name, vals) in enumerate(series):
            v = vals[gi] if gi < len(vals) else 0.0
            bh = plot_h * (v / vmax if vmax else 0)
            out.append(f'<rect x="{gx + si * bw:.1f}" y="{top + plot_h - bh:.1f}" width="{bw - 1:.1f}" '
                       f'height="{bh:.1f}" fill="{PALETTE[si % len(PALETTE)]}"><title>{_esc(name)} · {_esc(cat)}: '
                       f'{fmt.format(v)}</title></rect>')
        out.append(f'<text x="{gx + (gw - 8) / 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle" class="ax">'
                   f'{_esc(_short(cat, max(4, int(gw / 6))))}<title>{_esc(cat)}</title></text>')
    out.append("</svg>")
    return "".join(out)


def _nice_axis(vmax: float, target: int = 4, integer: bool = False) -> tuple[float, float]:
    """(axis top, tick step): a step of 1, 2, 2.5 or 5 x 10^k giving about `target` ticks
    (whole steps only for counts)."""
    if vmax <= 0:
        return (4.0, 1.0) if integer else (1.0, 0.25)
    raw = vmax / target
    mag = 10 ** math.floor(math.log10(raw))
    mults = (1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)
    step = next(m * mag for m in mults if m * mag >= raw)
    if integer:
        step = max(1.0, float(round(step)))
    return step * math.ceil(vmax / step - 1e-9), step


def _axis_label(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:g}"


def _legend(names: Sequence[str]) -> str:
    items = "".join(f'<span class="key"><i style="background:{PALETTE[i % len(PALETTE)]}"></i>{_esc(n)}</span>'
                    for i, n in enumerate(names))
    return f'<div class="legend">{items}</div>'


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def _models(results: Sequence[VerificationResult]) -> list[str]:
    return sorted({r.metadata.answering_model for r in results})


def section_pass_rates(results: Sequence[VerificationResult]) -> str:
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # passed, verdicts, results, errors
    for r in results:
        c = counts[r.metadata.answering_model]
        c[2] += 1
        if not r.metadata.completed_without_errors:
            c[3] += 1
        v = r.template.verify_result if r.template else None
        if v is not None:
            c[1] += 1
            c[0] += 1 if v else 0
    rows = [(m, Proportion.of(c[0], c[1])) for m, c in sorted(counts.items())]
    if not any(p.n for _, p in rows):
        return "<p class='muted'>No template verdicts in this run (rubric_only, or every job errored).</p>"
    chart = svg_rate_bars(rows, "Pass rate per answering model (bars) with Wilson 95% intervals (whiskers)")
    table = _table(["answering model", "results", "errors", "verdicts", "passed", "pass rate", "95% CI low",
                    "95% CI high"],
                   [(m, counts[m][2], counts[m][3], p.n, p.successes, _pct(p.rate), _pct(p.ci_low), _pct(p.ci_high))
                    for m, p in rows])
    return chart + table


def svg_question_heatmap(questions: Sequence[tuple[str, str]], models: Sequence[str],
                         cells: Mapping[tuple[str, str], tuple[int, int]], title: str) -> str:
    """Question x answering model grid coloured by pass rate: one row per question, labelled
    with the question's text (its id in the tooltip), one column per model."""
    label_w, top, row_h, col_w = 430, 40, 18, 120
    w = label_w + col_w * max(1, len(models)) + 20
    h = top + row_h * len(questions) + 44
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" aria-label="{_esc(title)}">',
           f'<text x="8" y="20" class="t">{_esc(title)}</text>']
    for j, m in enumerate(models):
        x = label_w + j * col_w + col_w / 2
        out.append(f'<text x="{x}" y="{top - 6}" class="ax" text-anchor="middle">{_esc(_short(m.split(":", 1)[-1], 20))}'
                   f'<title>{_esc(m)}</title></text>')
    for i, (qid, text) in enumerate(questions):
        y = top + i * row_h
        out.append(f'<text x="{label_w - 6}" y="{y + row_h * 0.7}" text-anchor="end" class="lb">'
                   f'{_esc(_short(text or qid, 64))}<title>{_esc(qid)}: {_esc(text)}</title></text>')
        for j, m in enumerate(models):
            passed, n = cells.get((m, qid), (0, 0))
            rate = passed / n if n else None
            x = label_w + j * col_w
            out.append(f'<rect x="{x}" y="{y}" width="{col_w - 2}" height="{row_h - 2}" fill="{_color(rate)}">'
                       f'<title>{_esc(m)} · {_esc(text or qid)}: {passed}/{n}</title></rect>'
                       f'<text x="{x + col_w / 2}" y="{y + row_h * 0.68}" text-anchor="middle" class="ax">'
                       f'{passed}/{n}</text>')
    ly = top + row_h * len(questions) + 16
    for k in range(11):
        out.append(f'<rect x="{label_w + k * 24}" y="{ly}" width="24" height="12" fill="{_color(k / 10)}"/>')
    out.append(f'<text x="{label_w - 6}" y="{ly + 10}" text-anchor="end" class="ax">pass rate 0%</text>'
               f'<text x="{label_w + 11 * 24 + 6}" y="{ly + 10}" class="ax">100%</text>'
               f'<rect x="{label_w + 11 * 24 + 50}" y="{ly}" width="12" height="12" fill="{_color(None)}"/>'
               f'<text x="{label_w + 11 * 24 + 68}" y="{ly + 10}" class="ax">no verdict</text>')
    out.append("</svg>")
    return "".join(out)


def _question_cells(results: Sequence[VerificationResult]) -> tuple[dict[tuple[str, str], list[int]],
                                                                     dict[str, list[int]], dict[str, str]]:
    cells: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    per_q: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    texts: dict[str, str] = {}
    for r in results:
        v = r.template.verify_result if r.template else None
        q = r.metadata.question_id
        texts.setdefault(q, r.metadata.question_text)
        cells.setdefault((r.metadata.answering_model, q), [0, 0])
        per_q.setdefault(q, [0, 0])
        if v is None:
            continue
        cells[(r.metadata.answering_model, q)][1] += 1
        cells[(r.metadata.answering_model, q)][0] += 1 if v else 0
        per_q[q][1] += 1
        per_q[q][0] += 1 if v else 0
    return cells, per_q, texts


def _hardest_first(per_q: Mapping[str, list[int]]) -> list[str]:
    return sorted(per_q, key=lambda q: (per_q[q][0] / per_q[q][1] if per_q[q][1] else 2.0, q))


def section_heatmap(results: Sequence[VerificationResult]) -> str:
    cells, per_q, texts = _question_cells(results)
    if not any(n for _, n in per_q.values()):
        return "<p class='muted'>No template verdicts to map.</p>"
    order = _hardest_first(per_q)
    note = ""
    if len(order) > MAX_HEAT_COLUMNS:
        note = (f"<p class='muted'>Showing the {MAX_HEAT_COLUMNS} hardest of {len(order)} questions; the table "
                f"below lists them all.</p>")
    shown = order[:MAX_HEAT_COLUMNS]
    models = _models(results)
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


def error_groups(results: Sequence[VerificationResult]) -> list[dict[str, Any]]:
    """Errored results grouped by (stage, type): count and the first example (question, error).
    The grouping is `shared.core.outcome.error_kind`'s, the same as the console and summary.json:
    a template whose verify() raised is its own group, apart from plain fails."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        kind = error_kind(r)
        if kind is None:
            continue
        stage, etype, message = kind
        m = r.metadata
        g = groups.setdefault((stage, etype), {"stage": stage, "type": etype, "count": 0, "questions": set(),
                                               "example": message,
                                               "example_question": m.question_text or m.question_id})
        g["count"] += 1
        g["questions"].add(m.question_id)
    return sorted(groups.values(), key=lambda g: (-g["count"], g["stage"], g["type"]))


def section_errors(results: Sequence[VerificationResult]) -> str:
    groups = error_groups(results)
    if not groups:
        return "<p class='muted'>No errors: every job completed.</p>"
    return _table(["stage", "type", "results", "questions", "example question", "example error"],
                  [(g["stage"], g["type"], g["count"], len(g["questions"]), _short(g["example_question"], 70),
                    _Raw(f"<code>{_esc(_short(g['example'], 400))}</code>")) for g in groups],
                  "Errored results by stage and error type (one example each)")


MAX_APPENDIX_RESPONSES = 2000


def section_appendix(results: Sequence[VerificationResult]) -> str:
    """Per question (hardest first): ground truth and each result's response, all collapsed."""
    by_q: dict[str, list[VerificationResult]] = defaultdict(list)
    for r in results:
        by_q[r.metadata.question_id].append(r)
    _, per_q, texts = _question_cells(results)
    shown = 0
    parts: list[str] = []
    for q in _hardest_first(per_q):
        rs = sorted(by_q[q], key=lambda r: (r.metadata.answering_model, r.metadata.parsing_model,
                                            r.metadata.replicate or 0))
        p = per_q[q]
        first = rs[0].metadata
        items = []
        for r in rs:
            if shown >= MAX_APPENDIX_RESPONSES:
                break
            shown += 1
            m, t = r.metadata, r.template
            v = t.verify_result if t else None
            verdict = "error" if not m.completed_without_errors else ("no verdict" if v is None else
                                                                       "pass" if v else "fail")
            body = f"<pre>{_esc((t.raw_llm_response if t else '') or '(no response)')}</pre>"
            if m.error:
                body += f"<p class='errtext'>{_esc(m.error)}</p>"
            if t and t.parsed_llm_response is not None:
                body += f"<p class='muted'>judge's parse: <code>{_esc(_json(t.parsed_llm_response))}</code></p>"
            items.append(f"<details class='resp'><summary><span class='v {verdict.replace(' ', '')}'>{verdict}</span> "
                         f"{_esc(m.answering_model)} · judge {_esc(m.parsing_model)}"
                         f"{f' · replicate {m.replicate}' if m.replicate is not None else ''}</summary>{body}</details>")
        if not items:
            break
        gt = first.raw_answer
        parts.append(f"<details class='q'><summary><b>{_esc(texts.get(q) or q)}</b> <span class='muted'>{_esc(q)} · "
                     f"{p[0]}/{p[1]} passed</span></summary>"
                     + (f"<p>ground truth: <code>{_esc(gt)}</code></p>" if gt else "") + "".join(items) + "</details>")
    note = (f"<p class='muted'>Responses of the first {MAX_APPENDIX_RESPONSES} results shown (of {len(results)}); "
            "`veribus view` browses them all.</p>") if len(results) > MAX_APPENDIX_RESPONSES else ""
    return note + "".join(parts)


def _json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, default=str)


def section_traits(results: Sequence[VerificationResult]) -> str:
    """Per trait: value distribution per model (booleans true/false, scores by value, metric
    traits by mean metric)."""
    values: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    kinds: dict[str, str] = {}
    for r in results:
        rub = r.rubric
        if rub is None or not rub.rubric_evaluation_performed:
            continue
        model = r.metadata.answering_model
        labels = rub.llm_trait_labels or {}
        for kind, scores in (("llm", rub.llm_trait_scores), ("regex", rub.regex_trait_scores),
                             ("callable", rub.callable_trait_scores), ("metric", rub.metric_trait_scores)):
            for name, v in (scores or {}).items():
                kinds.setdefault(name, "literal" if name in labels else kind)
                values[name][model].append(labels.get(name, v) if name in labels else v)
    if not values:
        return "<p class='muted'>No rubric scores in this run.</p>"
    models = _models(results)
    charts: list[str] = []
    table_rows: list[list[Any]] = []
    for name in sorted(values):
        per_model = values[name]
        kind = kinds[name]
        if kind == "metric":
            metrics = sorted({k for vs in per_model.values() for v in vs if isinstance(v, dict) for k in v})
            series = []
            for m in models:
                vs = [v for v in per_model.get(m, []) if isinstance(v, dict)]
                series.append((m, [sum(float(v.get(k, 0.0)) for v in vs) / len(vs) if vs else 0.0 for k in metrics]))
            charts.append(svg_grouped_bars(metrics, series, f"{name} (metric trait: mean per metric)", "{:.2g}"))
            for m in models:
                vs = [v for v in per_model.get(m, []) if isinstance(v, dict)]
                for k in metrics:
                    vals = [float(v[k]) for v in vs if isinstance(v.get(k), int | float)]
                    table_rows.append([name, kind + f" · {k}", m, len(vals),
                                       sum(vals) / len(vals) if vals else None, ""])
            continue
        all_vals = [v for vs in per_model.values() for v in vs]
        cats: list[Any] = sorted({_bucket(v) for v in all_vals}, key=_sort_key)
        series = [(m, [float(Counter(_bucket(v) for v in per_model.get(m, []))[c]) for c in cats]) for m in models]
        charts.append(svg_grouped_bars([_fmt(c) for c in cats], series, f"{name} ({kind}): count per value", "{:.0f}",
                                       integer=True))
        for m in models:
            vs = per_model.get(m, [])
            nums = [trait_score(v) if isinstance(v, bool) else float(v) for v in vs
                    if isinstance(v, int | float) and not isinstance(v, str)]
            dist = ", ".join(f"{_fmt(c)}: {n}" for c, n in sorted(Counter(_bucket(v) for v in vs).items(),
                                                                  key=lambda kv: _sort_key(kv[0])))
            table_rows.append([name, kind, m, len(vs), (sum(nums) / len(nums)) if nums else None, dist])
    grid = "".join(f"<div class='chart'>{c}</div>" for c in charts)
    table = _table(["trait", "kind", "answering model", "n", "mean", "distribution"], table_rows)
    return _legend(models) + f"<div class='grid'>{grid}</div>" + table


def _bucket(v: Any) -> Any:
    if isinstance(v, float) and not v.is_integer():
        return round(v, 1)
    if isinstance(v, float):
        return int(v)
    return v


def _sort_key(v: Any) -> tuple[int, Any]:
    if isinstance(v, bool):
        return (0, int(v))
    if isinstance(v, int | float):
        return (1, v)
    return (2, str(v))


def section_usage_latency(results: Sequence[VerificationResult], stage_latency: Sequence[Mapping[str, Any]]) -> str:
    tokens: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in results:
        usage = (r.template.usage_metadata if r.template else None) or {}
        for stage, e in usage.items():
            if stage == "total" or not isinstance(e, dict):
                continue
            t = tokens[stage]
            t[0] += int(e.get("input_tokens") or 0)
            t[1] += int(e.get("output_tokens") or 0)
            t[2] += 1
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
    by_stage: dict[str, dict[str, float]] = {}
    if lat:
        for x in lat:
            if x.get("status") not in (None, "performed"):
                continue  # skipped stages take no time worth charting (they stay in the table)
            d = by_stage.setdefault(str(x["stage"]), {"n": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0, "total": 0.0})
            d["n"] += float(x.get("n") or 0)
            d["p50"] = max(d["p50"], float(x.get("p50_ms") or 0.0))
            d["p95"] = max(d["p95"], float(x.get("p95_ms") or 0.0))
            d["max"] = max(d["max"], float(x.get("max_ms") or 0.0))
            d["total"] += float(x.get("total_ms") or 0.0)
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
    elif results and all(not r.metadata.completed_without_errors for r in results):
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
    e2e: dict[str, list[float]] = defaultdict(list)
    for r in results:
        e2e[r.metadata.answering_model].append(float(r.metadata.execution_time or 0.0))
    parts.append(_table(["answering model", "results", "p50 s", "p95 s", "max s"],
                        [(m, len(v), _quantile(v, 0.5), _quantile(v, 0.95), max(v)) for m, v in sorted(e2e.items())],
                        "End-to-end execution time per result"))
    return "".join(parts)


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def section_replicates(results: Sequence[VerificationResult]) -> str:
    rep = pass_at_k_report(results)
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


# --------------------------------------------------------------------------------------------
# Page
# --------------------------------------------------------------------------------------------

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.muted{color:#777} .badge{display:inline-block;padding:2px 8px;border-radius:10px;font-size:12px;margin-left:8px}
.sim{background:#fff3cd;color:#7a5b00;border:1px solid #e6c86e} .pass{background:#e3f4e7;color:#1e6b34}
.fail{background:#fde2e1;color:#9b1c1c}
table{border-collapse:collapse;margin:10px 0 16px;font-size:12.5px}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f5f7} caption{text-align:left;font-weight:600;padding:4px 0;font-size:13px}
.kpis{display:flex;gap:14px;flex-wrap:wrap;margin:12px 0}
.kpi{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:120px}
.kpi b{display:block;font-size:20px} .kpi span{font-size:12px;color:#666}
.grid{display:flex;flex-wrap:wrap;gap:10px} .chart{border:1px solid #eee;border-radius:4px;padding:4px}
svg text{font-size:11px;fill:#333} svg .t{font-size:14px;font-weight:600} svg .t2{font-size:12px;font-weight:600}
svg .ax{font-size:10px;fill:#666} svg .lb{font-size:12px} svg .val{font-size:12px}
svg .grid{stroke:#e5e5e5;stroke-width:1} svg .ci{stroke:#222;stroke-width:1.6}
.legend{margin:4px 0 8px;font-size:12px} .key{margin-right:14px;white-space:nowrap}
.key i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
.cell{display:inline-block;min-width:34px;padding:0 3px;border-radius:3px}
details summary{cursor:pointer;color:#225;margin:6px 0}
.banner{padding:10px 14px;border-radius:6px;margin:10px 0;font-weight:600}
.banner.sim{background:#fff3cd;color:#7a5b00;border:1px solid #e6c86e}
.banner.err{background:#fde2e1;color:#9b1c1c;border:1px solid #f3b1ae}
details.q{border-bottom:1px solid #eee;padding:2px 0} details.resp{margin-left:18px}
details.resp pre{white-space:pre-wrap;background:#f8f8f8;border:1px solid #eee;padding:6px;max-height:360px;overflow:auto}
.v{display:inline-block;min-width:64px;font-size:11px;font-weight:600;text-align:center;border-radius:8px}
.v.pass{background:#e3f4e7;color:#1e6b34} .v.fail{background:#fde2e1;color:#9b1c1c}
.v.error{background:#4a1010;color:#fff} .v.noverdict{background:#eee;color:#555} .errtext{color:#9b1c1c}
"""


def render_html(data: RunData, gate_lines: Sequence[str] = ()) -> str:
    """The whole page as one string (no external resources)."""
    results = data.results
    s = summarize(results)
    title = f"veribus report — {data.run_name or data.run_id}"
    simulated = bool(data.simulated) or any("simulator" in (r.metadata.answering.interface, r.metadata.parsing.interface)
                                             for r in results)
    sim = "<span class='badge sim'>SIMULATED LLM</span>" if simulated else ""
    banner = ("<div class='banner sim' id='simulated'>SIMULATED: the answers and judgments in this report come from "
              "the offline LLM simulator, not from a real model.</div>") if simulated else ""
    n_err = sum(g["count"] for g in error_groups(results))
    if n_err:
        top = error_groups(results)[0]
        banner += (f"<div class='banner err'>{n_err} of {len(results)} results errored; most often "
                   f"{_esc(top['stage'])} / {_esc(top['type'])} ({top['count']}): "
                   f"{_esc(_short(top['example'], 200))} — see section 6.</div>")
    gates = "".join(f"<li><span class='badge {'pass' if 'PASSED' in g else 'fail'}'>"
                    f"{'PASSED' if 'PASSED' in g else 'FAILED'}</span> {_esc(g)}</li>" for g in gate_lines)
    cfg = data.config or {}
    models = ", ".join(sorted({m.get("model_name", "") for m in cfg.get("answering_models", [])})) or \
        ", ".join(_models(results))
    judges = ", ".join(sorted({m.get("model_name", "") for m in cfg.get("parsing_models", [])})) or \
        ", ".join(sorted({r.metadata.parsing_model for r in results}))
    kpis = [("results", s["total"]), ("attempted", s["total_attempted"]), ("errors", s["errors"]),
            ("passed", f"{s['passed_attempts']} ({s['pass_rate']:.1f}%)"),
            ("avg score", f"{s['avg_score_attempted']:.3f}"),
            ("questions", len({r.metadata.question_id for r in results})),
            ("model calls", f"{s['usage']['model_calls']} (+{s['usage']['cached_replies']} cached)"),
            ("cost USD", f"{s['usage']['cost_usd']:.4f}" + ("*" if s["usage"]["cost_unknown_models"] else ""))]
    kpi_html = "".join(f"<div class='kpi'><b>{_esc(_fmt(v))}</b><span>{_esc(k)}</span></div>" for k, v in kpis)
    body = [
        f"<h1>{_esc(title)}{sim}</h1>",
        f"<p class='muted'>run id {_esc(data.run_id)} · benchmark {_esc(data.benchmark_name or '–')} · "
        f"mode {_esc(cfg.get('evaluation_mode', '–'))} · answering {_esc(models)} · judges {_esc(judges)} · "
        f"generated {_esc(datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC'))}</p>",
        banner, f"<div class='kpis'>{kpi_html}</div>",
        f"<ul>{gates}</ul>" if gates else "",
        (f"<p class='muted'>* cost unknown for {_esc(', '.join(s['usage']['cost_unknown_models']))} "
         "(no price in litellm's map or the run config)</p>") if s["usage"]["cost_unknown_models"] else "",
        "<h2>1. Pass rate per model</h2>", section_pass_rates(results),
        "<h2>2. Questions × models</h2>", section_heatmap(results),
        "<h2>3. Rubric trait scores</h2>", section_traits(results),
        "<h2>4. Token usage and latency per stage</h2>", section_usage_latency(results, data.stage_latency),
        "<h2>5. Replicates: pass@k and flakiness</h2>", section_replicates(results),
        "<h2>6. Errors by stage and type</h2>", section_errors(results),
        "<h2>7. Appendix: questions and responses</h2>", section_appendix(results),
    ]
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_esc(title)}</title>"
            f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>")


def write_html(path: str | Path, data: RunData, gate_lines: Sequence[str] = ()) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_html(data, gate_lines), encoding="utf-8")
    return p


# --------------------------------------------------------------------------------------------
# Loading a run
# --------------------------------------------------------------------------------------------


def load_run_data(source: RowSource, run: str, *, page_size: int = 500) -> RunData:
    """A run's results, config, rubric and stage latency, from one row source."""

    run_id = resolve_run(source, run)
    results = [VerificationResult.model_validate_json(blob)
               for _, blob in iter_result_json(source, ResultFilter(run_id=run_id), page_size=page_size)]
    info = source.query("SELECT run_name, benchmark_name, config_json FROM runs FINAL WHERE run_id = {r:String}",
                        {"r": run_id})
    run_name, bench, config = None, "", None
    if info.rows:
        run_name, bench, raw = info.rows[0]
        try:
            config = json.loads(raw) if raw else None
        except (TypeError, ValueError):
            config = None
    lat = source.query("SELECT event_type, stage, status, n, p50_ms, p95_ms, max_ms, total_ms FROM v_stage_latency "
                       "WHERE run_id = {r:String} ORDER BY p95_ms DESC", {"r": run_id})
    return RunData(run_id=run_id, results=results, run_name=run_name or (results[0].metadata.run_name if results else None),
                   benchmark_name=bench or "", config=config,
                   rubric_definition=rubric_definition_from_store(source, run_id),
                   stage_latency=lat.as_dicts())


def load_run(settings: Settings, run: str) -> RunData:
    """`load_run_data` against the configured store (projector over NATS, server, or chdb). A
    run whose models pointed at the local stack's LLM simulator is marked simulated."""
    with open_source(settings) as source:
        data = load_run_data(source, run)
    if settings.simulator_url and data.config:
        sim = settings.simulator_url.rstrip("/")
        data.simulated = any(str(m.get("api_base") or "").rstrip("/") == sim
                             for key in ("answering_models", "parsing_models") for m in data.config.get(key, []))
    return data
