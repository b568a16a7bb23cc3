"""HTML of the viewer's sample page: one result, every check with its reasoning, the judge's
parse beside the expected values, rubric scores and the stage timeline."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from shared.cli.view.filters import Filters
from shared.cli.view.markup import (
    Raw,
    _a,
    _badge,
    _e,
    _kv,
    _n,
    _table,
    _verdict,
    _when,
    page,
    run_url,
    sample_url,
)

# --------------------------------------------------------------------------------------------
# Sample
# --------------------------------------------------------------------------------------------


def _pre(v: Any, cls: str = "") -> str:
    text = v if isinstance(v, str) else json.dumps(v, indent=2, ensure_ascii=False, default=str)
    return f"<pre class='{cls}'>{_e(text)}</pre>"


def _parse_table(t: Mapping[str, Any]) -> str:
    gt = t.get("parsed_gt_response") or {}
    llm = t.get("parsed_llm_response") or {}
    fr = t.get("field_results") or {}
    keys = list(dict.fromkeys([*gt.keys(), *llm.keys()]))
    if not keys:
        return "<p class='muted'>No parse (the judge did not fill the template).</p>"
    rows = []
    for k in keys:
        ok = fr.get(k)
        mark = _badge("match", "pass") if ok is True else _badge("differs", "fail") if ok is False else Raw("")
        rows.append((k, Raw(_pre(gt.get(k), "small")), Raw(_pre(llm.get(k), "small")), mark))
    return _table(["field", "expected (ground truth)", "judge's parse", ""], rows, "parse", "parse")


def _checks(t: Mapping[str, Any], res: Mapping[str, Any]) -> str:
    rows: list[tuple[str, Any, Any]] = []
    if t.get("abstention_check_performed"):
        rows.append(("abstention", _badge("abstained", "fail") if t.get("abstention_detected") else
                     _badge("answered", "pass"), t.get("abstention_reasoning") or ""))
    if t.get("sufficiency_check_performed"):
        rows.append(("sufficiency", _badge("sufficient", "pass") if t.get("sufficiency_detected") else
                     _badge("insufficient", "fail"), t.get("sufficiency_reasoning") or ""))
    if t.get("embedding_check_performed"):
        rows.append(("embedding", f"similarity {_n(t.get('embedding_similarity_score'))}"
                     + (" · override applied" if t.get("embedding_override_applied") else ""),
                     t.get("embedding_model_used") or ""))
    if t.get("regex_validations_performed"):
        rows.append(("regex", _badge("ok", "pass") if t.get("regex_overall_success") else _badge("failed", "fail"),
                     json.dumps(t.get("regex_validation_results") or {})))
    if t.get("recursion_limit_reached"):
        rows.append(("recursion limit", _badge("reached", "fail"), ""))
    dj = res.get("deep_judgment") or {}
    if dj.get("deep_judgment_performed"):
        for attr, excerpts in (dj.get("extracted_excerpts") or {}).items():
            quotes = "".join(f"<blockquote>{_e(x.get('text', x) if isinstance(x, dict) else x)}</blockquote>"
                             for x in excerpts or [])
            reasoning = (dj.get("attribute_reasoning") or {}).get(attr, "")
            risk = (dj.get("hallucination_risk_assessment") or {}).get(attr)
            rows.append((f"deep judgment · {attr}", Raw(quotes or "<span class='muted'>no excerpt</span>"),
                         reasoning + (f" (hallucination risk: {risk})" if risk else "")))
    if not rows:
        return "<p class='muted'>No checks ran for this result.</p>"
    return _table(["check", "outcome", "reasoning / detail"],
                  [(k, v if isinstance(v, Raw) else Raw(_e(v)), Raw(f"<span class='reason'>{_e(r)}</span>"))
                   for k, v, r in rows], "checks", "checks")


def _rubric(rub: Mapping[str, Any] | None, djr: Mapping[str, Any] | None) -> str:
    if not rub or not rub.get("rubric_evaluation_performed"):
        return "<p class='muted'>No rubric evaluation.</p>"
    labels = rub.get("llm_trait_labels") or {}
    reasoning = (djr or {}).get("rubric_trait_reasoning") or {}
    rows = []
    for kind in ("llm", "regex", "callable", "metric"):
        for name, v in (rub.get(f"{kind}_trait_scores") or {}).items():
            rows.append((name, kind, Raw(_pre(v, "small")) if isinstance(v, dict) else v, labels.get(name, ""),
                         reasoning.get(name, "")))
    for name, e in (rub.get("trait_errors") or {}).items():
        rows.append((name, "error", Raw(f"<span class='error'>{_e(e)}</span>"), "", ""))
    return _table(["trait", "kind", "score", "label", "reasoning"], rows, "rubric", "rubric-scores")


def _timeline(stages: Sequence[Mapping[str, Any]]) -> str:
    if not stages:
        return "<p class='muted'>No stage records.</p>"
    end = max((s["start_ms"] + s["duration_ms"] for s in stages), default=1.0) or 1.0
    bars = []
    for s in stages:
        left = 100 * s["start_ms"] / end
        width = max(0.4, 100 * s["duration_ms"] / end)
        bars.append(f"<div class='tl-row'><span class='tl-name'>{_e(s['stage'])} <i>{_e(s['status'])}</i></span>"
                    f"<span class='tl-track'><span class='tl-bar {_e(s['status'])}' style='left:{left:.2f}%;"
                    f"width:{width:.2f}%'></span></span><span class='tl-ms'>{s['duration_ms']:,.1f} ms</span></div>")
    return f"<div class='timeline' id='timeline'>{''.join(bars)}</div>"


def sample_page(run_id: str, s: Mapping[str, Any], f: Filters | None = None) -> str:
    res = s["result"]
    m = res.get("metadata") or {}
    t = res.get("template") or {}
    title = m.get("question_text") or m.get("question_id")
    answering = m.get("answering") or {}
    parsing = m.get("parsing") or {}
    am = f"{answering.get('interface', '')}:{answering.get('model_name', '')}"
    pm = f"{parsing.get('interface', '')}:{parsing.get('model_name', '')}"
    sim = " " + _badge("SIMULATED", "sim") if "simulator" in (answering.get("interface"), parsing.get("interface")) else ""
    verdict = _verdict(t.get("verify_result"), m.get("completed_without_errors", True),
                       t.get("field_verification_error"))
    err = (f"<div class='error' id='error'><b>Error</b> {_e(m.get('error'))}</div>" if m.get("error") else "")
    trace = t.get("trace_messages") or []
    usage = t.get("usage_metadata") or {}
    usage_rows = [(k, v.get("model", "") if isinstance(v, dict) else "", v.get("input_tokens") if isinstance(v, dict) else "",
                   v.get("output_tokens") if isinstance(v, dict) else "") for k, v in usage.items()]
    siblings = " ".join(str(_a(sample_url(run_id, r), f"#{i + 1}")) for i, r in enumerate(s["siblings"]))
    f = f or Filters()
    walk = []
    if s.get("prev"):
        walk.append(str(_a(sample_url(run_id, s["prev"], f), "← previous", "prev")))
    if s.get("next"):
        walk.append(str(_a(sample_url(run_id, s["next"], f), "next →", "next")))
    scope = " (filtered)" if f.active() else ""
    body = [
        f"<p class='crumbs'>{_a('/', 'Runs')} › {_a(run_url(run_id, f, anchor='samples'), run_id)} › sample"
        f"{' · ' + ' '.join(walk) + f' <span class=muted>in the results list{scope}</span>' if walk else ''}</p>",
        f"<h1 id='question'>{_e(title)}{sim} {verdict}</h1>", err,
        _kv([("question id", m.get("question_id")), ("result id", m.get("result_id")), ("answering model", am),
             ("judge", pm), ("replicate", m.get("replicate")), ("mode", m.get("evaluation_mode")),
             ("keywords", ", ".join(m.get("keywords") or [])), ("execution time s", m.get("execution_time")),
             ("other results for this question", Raw(siblings or "–"))], "meta"),
        "<h2>Ground truth</h2>", _pre(m.get("raw_answer") or "(none recorded)", "gt"),
        "<h2>Answer</h2>", _pre(t.get("raw_llm_response") or "(empty)", "answer"),
    ]
    if trace:
        body.append(f"<details><summary>Full trace ({len(trace)} messages)</summary>{_pre(trace)}</details>")
    body += [
        "<h2>Judge's parse beside the expected values</h2>", _parse_table(t),
        "<h2>Verification</h2>",
        _kv([("verify result", verdict), ("granular result", t.get("verify_granular_result")),
             ("template verification performed", t.get("template_verification_performed")),
             ("template validation error", t.get("template_validation_error")),
             ("field verification error", t.get("field_verification_error"))], "verify"),
        "<h2>Checks</h2>", _checks(t, res),
        "<h2>Rubric</h2>", _rubric(res.get("rubric"), res.get("deep_judgment_rubric")),
        "<h2>Stage timeline</h2>", _timeline(s["stages"]),
        "<h2>Tokens</h2>", _table(["stage", "model", "input", "output"], usage_rows) if usage_rows else
        "<p class='muted'>No token usage recorded.</p>",
        "<h2>Events</h2>", _table(["event", "at", "producer", "attempt", "status", "reason", "error"],
                                  [(e["event_type"], _when(e["occurred_at"]), e["producer"], e["attempt"], e["status"],
                                    e["reason"], f"{e['error_type']}: {e['error_message']}" if e["error_type"] else "")
                                   for e in s["events"]], "events", "events"),
        f"<details><summary>Raw result JSON</summary>{_pre(res)}</details>",
    ]
    return page(str(title), "".join(body), active="runs")
