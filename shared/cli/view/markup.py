"""The viewer's HTML building blocks, shared by its pages: escaping (`_e`), number and time
formatting, deep-link URLs, tables, badges and the page frame. Everything shown is escaped here;
links are built with `urllib.parse.quote`, never by pasting raw values."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode

from shared.analysis.html_svg import _esc, _fmt
from shared.analysis.stats import Proportion, percent
from shared.cli.view.filters import Filters

# escaping and number formatting are the static report's, so the two tell numbers the same way
_e = _esc
_n = _fmt


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{percent(v):.1f}%"


def _ci(p: Proportion) -> str:
    return "–" if p.rate is None else f"{_pct(p.rate)} [{_pct(p.ci_low)}, {_pct(p.ci_high)}]"


def _when(v: Any) -> str:
    if isinstance(v, datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(v, str) and len(v) >= 19 and v[10] == "T":
        return v[:19].replace("T", " ")
    return "–" if v in (None, "") else str(v)


def run_url(run_id: str, f: Filters | None = None, anchor: str = "", **extra: Any) -> str:
    qs = (f or Filters()).query_string(**extra)
    return f"/run/{quote(run_id, safe='')}" + (f"?{qs}" if qs else "") + (f"#{anchor}" if anchor else "")


def sample_url(run_id: str, result_id: str, f: Filters | None = None) -> str:
    """A sample; with filters, its previous / next links walk the filtered results list."""
    qs = f.query_string() if f is not None else ""
    return f"/run/{quote(run_id, safe='')}/sample/{quote(result_id, safe='')}" + (f"?{qs}" if qs else "")


def compare_url(**params: Any) -> str:
    return "/compare?" + urlencode({k: v for k, v in params.items() if v})


def _table(columns: Sequence[str], rows: Iterable[Sequence[Any]], cls: str = "", tid: str = "") -> str:
    """Cells are escaped unless they are `Raw`."""
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, Raw) else _e(_n(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    attrs = (f' class="{cls}"' if cls else "") + (f' id="{tid}"' if tid else "")
    return f"<table{attrs}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class Raw(str):
    """Already-escaped HTML."""


def _a(href: str, text: Any, cls: str = "") -> Raw:
    c = f' class="{cls}"' if cls else ""
    return Raw(f'<a href="{_e(href)}"{c}>{_e(text)}</a>')


def _badge(text: str, kind: str) -> Raw:
    return Raw(f'<span class="badge {kind}">{_e(text)}</span>')


def _verdict(v: Any, completed: Any = True, raised: Any = False) -> Raw:
    """A sample's verdict badge: an error (not completed, or its verify() raised) is never a fail
    (`shared.core.verdict.errored`, as every count has it)."""
    if not completed or raised:
        return _badge("error", "err")
    if v is None:
        return _badge("no verdict", "muted")
    return _badge("pass", "pass") if v else _badge("fail", "fail")


def page(title: str, body: str, *, live: bool = False, active: str = "") -> str:
    """The frame of every page: nav, CSS and JS from /static (shipped in the package)."""
    on = ' class="on"'
    nav = "".join(f'<a href="{href}"{on if active == key else ""}>{label}</a>'
                  for key, href, label in (("runs", "/", "Runs"), ("compare", "/compare", "Compare")))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{_e(title)} · veribus</title><link rel="stylesheet" href="/static/view.css">'
            f'<script src="/static/view.js" defer></script></head>'
            f'<body data-live="{1 if live else 0}"><header><b>veribus</b> view {nav}</header>'
            f'<main id="main">{body}</main></body></html>')


def error_page(status: int, message: str) -> str:
    return page(f"{status}", f"<h1>{status}</h1><p class='error' id='problem'>{_e(message)}</p>"
                             f"<p><a href='/'>All runs</a></p>")


def _kv(pairs: Sequence[tuple[str, Any]], tid: str = "") -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{v if isinstance(v, Raw) else _e(_n(v))}</td></tr>" for k, v in pairs)
    return (f"<table class='kv' id='{tid}'>" if tid else "<table class='kv'>") + f"<tbody>{rows}</tbody></table>"
