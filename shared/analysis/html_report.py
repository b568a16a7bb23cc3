"""`veribus report RUN --html FILE`: one self-contained HTML page about a run.

No JavaScript, no external files: the charts are inline SVG (`html_svg`), each followed by the
table it was drawn from. Sections (`html_sections`):

1. pass rate per answering model with Wilson 95% intervals;
2. a heat map of pass rate, model x question (replicates and judges pooled), hardest first;
3. rubric trait score distributions per model;
4. token usage per stage (from `usage_metadata`) and latency per stage (from the `events`
   table's stage records via `v_stage_latency`), plus end-to-end time per model; then cost: the
   total, and per model and stage (model calls, cached replies, USD);
5. pass@k / pass^k across replicates and the flakiest questions;
6. errors grouped by stage and error type, one example each (also summarised in a banner on top);
7. an appendix per question: ground truth and every result's response, collapsed (the first
   `MAX_APPENDIX_RESPONSES`, with a note when there are more).

A simulated run (models served by the offline LLM simulator) carries a SIMULATED banner.

Memory: a run read from the store is a `StoredResults` (paged, never held); the page is drawn
from one pass that keeps aggregates (`RunDigest`, `SummaryTally`), and `write_html` writes the
appendix to the file a few questions at a time.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.analysis.export import rubric_definition_from_store
from shared.analysis.html_digest import RunDigest
from shared.analysis.html_sections import (
    MAX_APPENDIX_RESPONSES,
    MAX_HEAT_COLUMNS,
    error_groups,
    iter_appendix,
    section_appendix,
    section_cost,
    section_errors,
    section_heatmap,
    section_pass_rates,
    section_replicates,
    section_traits,
    section_usage_latency,
)
from shared.analysis.html_svg import (
    PALETTE,
    _esc,
    _fmt,
    _pct,
    _short,
    svg_grouped_bars,
    svg_question_heatmap,
    svg_rate_bars,
)
from shared.analysis.report import SummaryTally
from shared.analysis.stored import StoredResults
from shared.core.config import config_uses_simulator
from shared.core.models import VerificationResult
from shared.core.usage import money, recorded
from shared.store.reads import ResultFilter, open_source, resolve_run

if TYPE_CHECKING:
    from shared.core.config import Settings
    from shared.store.reads import RowSource

__all__ = ["MAX_APPENDIX_RESPONSES", "MAX_HEAT_COLUMNS", "PALETTE", "RunData", "error_groups", "iter_html", "load_run",
           "load_run_data", "render_html", "section_appendix", "section_cost", "section_errors", "section_heatmap",
           "section_pass_rates", "section_replicates", "section_traits", "section_usage_latency", "svg_grouped_bars",
           "svg_question_heatmap", "svg_rate_bars", "write_html"]


@dataclass
class RunData:
    """Everything the page shows about one run. `results` is a list (a file) or `StoredResults`
    (the store: read page by page on each pass, never held)."""

    run_id: str
    results: Sequence[VerificationResult] | StoredResults
    run_name: str | None = None
    benchmark_name: str = ""
    config: dict[str, Any] | None = None
    rubric_definition: dict[str, Any] | None = None
    stage_latency: list[dict[str, Any]] = field(default_factory=list)
    simulated: bool | None = None
    unfinished_skipped: list[str] = field(default_factory=list)  # questions its plan left out
    closer: Callable[[], None] | None = field(default=None, repr=False)

    def close(self) -> None:
        """Release the store the results are read from (a no-op for a file)."""
        if self.closer is not None:
            self.closer()
            self.closer = None


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




def _digest_and_summary(results: Iterable[VerificationResult], summary: Mapping[str, Any] | None,
                        digest: RunDigest | None) -> tuple[RunDigest, Mapping[str, Any]]:
    """The sections' digest and the run summary: as given, else both from one pass."""
    if digest is not None and summary is not None:
        return digest, summary
    d = RunDigest.for_results(results)
    tally = SummaryTally() if summary is None else None
    for r in results:
        d.add(r)
        if tally is not None:
            tally.add(r)
    return (digest or d), (tally.summary() if tally is not None else summary)  # type: ignore[return-value]


def iter_html(data: RunData, gate_lines: Sequence[str] = (), *, summary: Mapping[str, Any] | None = None,
              digest: RunDigest | None = None, appendix_limit: int = MAX_APPENDIX_RESPONSES) -> Iterator[str]:
    """The page in chunks: everything but the appendix from one pass over the results (none
    when the caller hands in the `digest` and the default-criterion `summary` it gathered in its
    own pass), then the appendix question by question."""
    d, s = _digest_and_summary(data.results, summary, digest)
    title = f"veribus report — {data.run_name or data.run_id}"
    simulated = bool(data.simulated) or d.simulated
    sim = "<span class='badge sim'>SIMULATED LLM</span>" if simulated else ""
    banner = ("<div class='banner sim' id='simulated'>SIMULATED: the answers and judgments in this report come from "
              "the offline LLM simulator, not from a real model.</div>") if simulated else ""
    groups = d.error_groups()
    n_err = sum(g["count"] for g in groups)
    if n_err:
        top = groups[0]
        banner += (f"<div class='banner err'>{n_err} of {d.total} results errored; most often "
                   f"{_esc(top['stage'])} / {_esc(top['type'])} ({top['count']}): "
                   f"{_esc(_short(top['example'], 200))} — see section 6.</div>")
    gates = "".join(f"<li><span class='badge {'pass' if 'PASSED' in g else 'fail'}'>"
                    f"{'PASSED' if 'PASSED' in g else 'FAILED'}</span> {_esc(g)}</li>" for g in gate_lines)
    cfg = data.config or {}
    models = ", ".join(sorted({m.get("model_name", "") for m in cfg.get("answering_models", [])})) or \
        ", ".join(sorted(d.models))
    judges = ", ".join(sorted({m.get("model_name", "") for m in cfg.get("parsing_models", [])})) or \
        ", ".join(sorted(d.judges))
    usage = s["usage"]
    kpis = [("results", s["total"]), ("attempted", s["total_attempted"]), ("errors", s["errors"]),
            ("passed" + (" by the rubric" if s.get("passed_by_rubric") else ""),
             f"{s['passed_attempts']} ({_pct(s['passed_attempts'] / (s['total_attempted'] or 1))})"),
            ("avg score", f"{s['avg_score_attempted']:.3f}"),
            ("questions", len(d.per_q)),
            ("model calls", f"{usage['model_calls']} (+{usage['cached_replies']} cached)" if recorded(usage)
             else "not recorded"),
            ("cost", money(usage["cost_usd"]) + ("*" if usage["cost_unknown_models"] else "") if recorded(usage)
             else "not recorded")]
    kpi_html = "".join(f"<div class='kpi'><b>{_esc(_fmt(v))}</b><span>{_esc(k)}</span></div>" for k, v in kpis)
    yield (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_esc(title)}</title>"
           f"<style>{CSS}</style></head><body>")
    yield from (
        f"<h1>{_esc(title)}{sim}</h1>",
        f"<p class='muted'>run id {_esc(data.run_id)} · benchmark {_esc(data.benchmark_name or '–')} · "
        f"mode {_esc(cfg.get('evaluation_mode', '–'))} · answering {_esc(models)} · judges {_esc(judges)} · "
        f"generated {_esc(datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC'))}</p>",
        banner, f"<div class='kpis'>{kpi_html}</div>",
        f"<ul>{gates}</ul>" if gates else "",
        (f"<p class='muted'>* cost unknown for {_esc(', '.join(usage['cost_unknown_models']))} "
         "(no price in litellm's map or the run config)</p>") if usage["cost_unknown_models"] else "",
        "<h2>1. Pass rate per model</h2>", section_pass_rates(d),
        "<h2>2. Questions × models</h2>", section_heatmap(d),
        "<h2>3. Rubric trait scores</h2>", section_traits(d),
        "<h2>4. Token usage and latency per stage</h2>", section_usage_latency(d, data.stage_latency),
        "<h3 id='cost'>Cost per model and stage</h3>", section_cost(d, s.get("usage")),
        "<h2>5. Replicates: pass@k and flakiness</h2>", section_replicates(d),
        "<h2>6. Errors by stage and type</h2>", section_errors(d),
        "<h2>7. Appendix: questions and responses</h2>",
    )
    yield from iter_appendix(data.results, d, appendix_limit)
    yield "</body></html>"


def render_html(data: RunData, gate_lines: Sequence[str] = (), *, summary: Mapping[str, Any] | None = None,
                digest: RunDigest | None = None) -> str:
    """The whole page as one string (no external resources)."""
    return "".join(iter_html(data, gate_lines, summary=summary, digest=digest))


def write_html(path: str | Path, data: RunData, gate_lines: Sequence[str] = (), *,
               summary: Mapping[str, Any] | None = None, digest: RunDigest | None = None) -> Path:
    """Write the page chunk by chunk (the appendix never sits in memory whole)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as fh:
        for chunk in iter_html(data, gate_lines, summary=summary, digest=digest):
            fh.write(chunk)
    return p


# --------------------------------------------------------------------------------------------
# Loading a run
# --------------------------------------------------------------------------------------------


def load_run_data(source: RowSource, run: str, *, page_size: int = 500) -> RunData:
    """A run's config, rubric and stage latency from one row source, and its results as
    `StoredResults` over that source (read page by page while the source stays open)."""
    run_id = resolve_run(source, run)
    return _run_data(source, run_id, StoredResults(source, ResultFilter(run_id=run_id), page_size=page_size))


def _run_data(source: RowSource, run_id: str, results: StoredResults) -> RunData:
    info = source.query("SELECT run_name, benchmark_name, config_json, unfinished_skipped FROM runs FINAL "
                        "WHERE run_id = {r:String}", {"r": run_id})
    run_name, bench, config, unfinished = None, "", None, []
    if info.rows:
        run_name, bench, raw, unfinished = info.rows[0]
        try:
            config = json.loads(raw) if raw else None
        except (TypeError, ValueError):
            config = None
    if not run_name:
        named = source.query("SELECT any(run_name) FROM verification_results FINAL WHERE run_id = {r:String}",
                             {"r": run_id})
        run_name = named.rows[0][0] if named.rows else None
    lat = source.query("SELECT event_type, stage, status, n, p50_ms, p95_ms, max_ms, total_ms FROM v_stage_latency "
                       "WHERE run_id = {r:String} ORDER BY p95_ms DESC", {"r": run_id})
    # simulated when a row was answered or judged by the simulator (a regrade's judge, say), or
    # its config names the simulator
    sim = source.query("SELECT countIf(answering_interface = 'simulator' OR parsing_interface = 'simulator') > 0 "
                       "FROM verification_results FINAL WHERE run_id = {r:String}", {"r": run_id})
    simulated = bool(sim.rows and sim.rows[0][0]) or config_uses_simulator(config)
    return RunData(run_id=run_id, results=results, run_name=run_name or None, benchmark_name=bench or "",
                   config=config, rubric_definition=rubric_definition_from_store(source, run_id),
                   stage_latency=lat.as_dicts(), simulated=simulated,
                   unfinished_skipped=[str(q) for q in unfinished or []])


def load_run(settings: Settings, run: str, *, page_size: int = 500) -> RunData:
    """`load_run_data` against the configured store (projector over NATS, server, or chdb). The
    source stays open for the results' passes until `RunData.close()` (or process exit). A run
    whose models pointed at the local stack's LLM simulator is marked simulated."""
    stack = contextlib.ExitStack()
    try:
        source = stack.enter_context(open_source(settings))
        data = load_run_data(source, run, page_size=page_size)
    except BaseException:
        stack.close()
        raise
    data.closer = stack.close
    if settings.simulator_url and data.config and not data.simulated:
        sim = settings.simulator_url.rstrip("/")
        data.simulated = any(str(m.get("api_base") or "").rstrip("/") == sim
                             for key in ("answering_models", "parsing_models") for m in data.config.get(key, []))
    return data
