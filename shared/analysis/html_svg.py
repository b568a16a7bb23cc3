"""The static report's drawing kit: HTML escaping and number formats, one table helper, and
the inline SVG charts (rate bars with Wilson whiskers, heat maps, grouped bars). Nothing here
reads results: the sections (`html_sections`) hand in counts. `veribus view` reuses the charts."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shared.analysis.stats import Proportion, percent

PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D", "#FF9DA6",
           "#BAB0AC"]


def _esc(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{percent(v):.1f}%"


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
    out.append(_rate_legend(label_w, top + row_h * len(questions) + 16))
    out.append("</svg>")
    return "".join(out)


def _rate_legend(x0: float, y: float) -> str:
    """The colour key under both heat maps: eleven steps from 0% to 100%, and 'no verdict'."""
    steps = "".join(f'<rect x="{x0 + k * 24}" y="{y}" width="24" height="12" fill="{_color(k / 10)}"/>'
                    for k in range(11))
    end = x0 + 11 * 24
    return (steps + f'<text x="{x0 - 6}" y="{y + 10}" text-anchor="end" class="ax">pass rate 0%</text>'
            f'<text x="{end + 6}" y="{y + 10}" class="ax">100%</text>'
            f'<rect x="{end + 50}" y="{y}" width="12" height="12" fill="{_color(None)}"/>'
            f'<text x="{end + 68}" y="{y + 10}" class="ax">no verdict</text>')
