"""The reference's CSV layout: its 53 columns (plus `rubric_<trait>` per global trait and one
`question_specific_rubrics` column), with its value formats, written from a `VerificationResult`
and read back into one.

Formats, as the reference writes them: plain booleans as Python's `True`/`False`; structured
values (parsed responses, keywords, excerpts, usage, ...) as JSON, and an empty cell when the
value is empty or missing; `rubric_<trait>` cells as Python's `str()` of the score (`True`, `4`,
`{'precision': 1.0}`); `question_specific_rubrics` as a JSON object. One deliberate difference:
`verify_result` False is written `false` (the reference writes an empty cell, which cannot be
told apart from "not verified").

Reading a reference CSV back is lossy where the CSV is: it does not say which kind a rubric trait
is, so scores land in `llm_trait_scores` (dict values in `metric_trait_scores`), and
`template_id` is not in it. Our own CSV export also carries `result_json`, so it reads back exactly.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shared.core.models import ModelIdentity, VerificationResult, VerificationResultMetadata

HEAD = [
    "question_id", "success", "error", "question_text", "raw_llm_response", "parsed_gt_response",
    "parsed_llm_response", "template_verification_performed", "verify_result", "verify_granular_result",
    "rubric_evaluation_performed", "keywords",
]
TAIL = [
    "answering_model", "parsing_model", "replicate", "execution_time", "timestamp", "answering_system_prompt",
    "parsing_system_prompt", "run_name", "export_timestamp", "karenina_version", "job_id",
    "embedding_check_performed", "embedding_similarity_score", "embedding_override_applied", "embedding_model_used",
    "answering_mcp_servers",
    "deep_judgment_enabled", "deep_judgment_performed", "extracted_excerpts", "attribute_reasoning",
    "deep_judgment_stages_completed", "deep_judgment_model_calls", "deep_judgment_excerpt_retry_count",
    "attributes_without_excerpts", "deep_judgment_search_enabled", "hallucination_risk_assessment",
    "deep_judgment_rubric_performed", "extracted_rubric_excerpts", "rubric_trait_reasoning",
    "deep_judgment_rubric_scores", "standard_rubric_scores", "trait_metadata", "traits_without_valid_excerpts",
    "rubric_hallucination_risk_assessment", "total_deep_judgment_model_calls", "total_traits_evaluated",
    "total_excerpt_retries",
    "metric_trait_confusion_lists", "metric_trait_metrics", "usage_metadata", "agent_metrics",
]
QUESTION_SPECIFIC = "question_specific_rubrics"
RUBRIC_PREFIX = "rubric_"
_DJ = ["extracted_excerpts", "attribute_reasoning", "deep_judgment_stages_completed", "attributes_without_excerpts",
       "hallucination_risk_assessment"]
_DJR = ["extracted_rubric_excerpts", "rubric_trait_reasoning", "deep_judgment_rubric_scores",
        "standard_rubric_scores", "trait_metadata", "traits_without_valid_excerpts",
        "rubric_hallucination_risk_assessment"]
_DJR_COUNTS = ["total_deep_judgment_model_calls", "total_traits_evaluated", "total_excerpt_retries"]


def columns(global_traits: Sequence[str], question_traits: Sequence[str]) -> list[str]:
    """The reference's header: 12 columns, `rubric_<trait>` per global trait (sorted), the
    question-specific column when any trait is question-specific, then 41 more."""
    cols = list(HEAD) + [RUBRIC_PREFIX + t for t in sorted(set(global_traits))]
    if question_traits:
        cols.append(QUESTION_SPECIFIC)
    return cols + list(TAIL)


def trait_split(results: Iterable[VerificationResult]) -> tuple[list[str], list[str]]:
    """(global, question-specific) trait names over these results, by `rubric.trait_provenance`;
    a trait without provenance is question-specific, as the reference treats traits when it is
    given no global rubric."""
    glob: set[str] = set()
    other: set[str] = set()
    for r in results:
        if r.rubric is None:
            continue
        prov = r.rubric.trait_provenance or {}
        for name in r.rubric.get_all_trait_scores():
            (glob if prov.get(name) == "global" else other).add(name)
    return sorted(glob), sorted(other - glob)


def _json(value: Any) -> str:
    """JSON for a structured value; empty (the reference's `if not data`) for an empty one."""
    if not value:
        return ""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _verdict(value: Any) -> str:
    return "" if value is None else json.dumps(value)


def row(result: VerificationResult, global_traits: Sequence[str], question_traits: Sequence[str],
        export_meta: Mapping[str, Any]) -> list[Any]:
    """One result as the reference's CSV row (values in `columns(...)` order)."""
    m, t, rb = result.metadata, result.template, result.rubric
    dj, djr = result.deep_judgment, result.deep_judgment_rubric
    scores = rb.get_all_trait_scores() if rb else {}
    out: dict[str, Any] = {
        "question_id": m.question_id, "success": m.completed_without_errors, "error": m.error or "",
        "question_text": m.question_text, "raw_llm_response": t.raw_llm_response if t else "",
        "parsed_gt_response": _json(t.parsed_gt_response if t else None),
        "parsed_llm_response": _json(t.parsed_llm_response if t else None),
        "template_verification_performed": t.template_verification_performed if t else False,
        "verify_result": _verdict(t.verify_result if t else None),
        "verify_granular_result": _verdict(t.verify_granular_result if t else None),
        "rubric_evaluation_performed": rb.rubric_evaluation_performed if rb else False,
        "keywords": _json(m.keywords),
        "answering_model": m.answering_model, "parsing_model": m.parsing_model,
        "replicate": m.replicate or "", "execution_time": m.execution_time, "timestamp": m.timestamp,
        "answering_system_prompt": m.answering_system_prompt or "", "parsing_system_prompt": m.parsing_system_prompt or "",
        "run_name": m.run_name or "",
        "export_timestamp": export_meta.get("export_timestamp", ""),
        "karenina_version": export_meta.get("karenina_version", ""), "job_id": export_meta.get("job_id") or "",
        "embedding_check_performed": t.embedding_check_performed if t else False,
        "embedding_similarity_score": (t.embedding_similarity_score or "") if t else "",
        "embedding_override_applied": t.embedding_override_applied if t else False,
        "embedding_model_used": (t.embedding_model_used or "") if t else "",
        "answering_mcp_servers": _json(t.answering_mcp_servers if t else None),
        "deep_judgment_enabled": dj.deep_judgment_enabled if dj else False,
        "deep_judgment_performed": dj.deep_judgment_performed if dj else False,
        "deep_judgment_model_calls": dj.deep_judgment_model_calls if dj else 0,
        "deep_judgment_excerpt_retry_count": dj.deep_judgment_excerpt_retry_count if dj else 0,
        "deep_judgment_search_enabled": dj.deep_judgment_search_enabled if dj else False,
        "deep_judgment_rubric_performed": djr.deep_judgment_rubric_performed if djr else False,
        "metric_trait_confusion_lists": _json(rb.metric_trait_confusion_lists if rb else None),
        "metric_trait_metrics": _json(rb.metric_trait_scores if rb else None),
        "usage_metadata": _json(t.usage_metadata if t else None),
        "agent_metrics": _json(t.agent_metrics if t else None),
    }
    for name in _DJ:
        out[name] = _json(getattr(dj, name) if dj else None)
    for name in _DJR:
        out[name] = _json(getattr(djr, name) if djr else None)
    for name in _DJR_COUNTS:
        out[name] = getattr(djr, name) if djr else 0
    for name in global_traits:
        out[RUBRIC_PREFIX + name] = str(scores[name]) if name in scores else ""
    if question_traits:
        out[QUESTION_SPECIFIC] = json.dumps({n: scores[n] for n in question_traits if n in scores})
    return [out[c] for c in columns(global_traits, question_traits)]


# ------------------------------------------------------------------------------------ reading


def parse_bool(text: str | None) -> bool | None:
    """`True`/`False` (the reference), `true`/`false`, `1`/`0`; None for an empty cell."""
    if text is None:
        return None
    s = text.strip().lower()
    if s in ("true", "1"):
        return True
    if s in ("false", "0"):
        return False
    if not s:
        return None
    raise ValueError(f"not a boolean: {text!r}")


def parse_json(text: str | None) -> Any:
    """A JSON cell; None when empty."""
    if text is None or not text.strip():
        return None
    return json.loads(text)


def parse_score(text: str) -> Any:
    """A `rubric_<trait>` cell (Python `str()` of the score): True, 4, 0.5 or a dict."""
    s = text.strip()
    if not s:
        return None
    try:
        return ast.literal_eval(s)
    except (ValueError, SyntaxError):
        return s


def _identity(display: str, answering: bool) -> dict[str, Any]:
    """`interface:model[+[tools]]` (ModelIdentity.display_string) -> identity fields."""
    base, tools = display, []
    if display.endswith("]") and "+[" in display:
        base, raw = display.rsplit("+[", 1)
        tools = [x for x in raw[:-1].split(",") if x]
    interface, _, name = base.partition(":")
    if not name:
        interface, name = "unknown", base
    return {"interface": interface, "model_name": name, "tools": tools if answering else []}


def is_reference_header(header: Sequence[str]) -> bool:
    return list(header[:len(HEAD)]) == HEAD and set(TAIL) <= set(header)


def result_from_row(rec: Mapping[str, str]) -> VerificationResult:
    """A reference CSV row (a `csv.DictReader` record) -> VerificationResult, as far as the CSV says."""
    def b(name: str, default: bool = False) -> bool:
        v = parse_bool(rec.get(name))
        return default if v is None else v

    answering = ModelIdentity(**_identity(rec.get("answering_model", ""), True))
    parsing = ModelIdentity(**_identity(rec.get("parsing_model", ""), False))
    replicate = int(rec["replicate"]) if (rec.get("replicate") or "").strip() else None
    timestamp = rec.get("timestamp", "")
    metadata = {
        "question_id": rec["question_id"], "template_id": rec.get("template_id") or "no_template",
        "question_text": rec.get("question_text", ""), "keywords": parse_json(rec.get("keywords")),
        "answering": answering, "parsing": parsing,
        "answering_system_prompt": rec.get("answering_system_prompt") or None,
        "parsing_system_prompt": rec.get("parsing_system_prompt") or None,
        "execution_time": float(rec.get("execution_time") or 0.0), "timestamp": timestamp,
        "result_id": rec.get("result_id") or VerificationResultMetadata.compute_result_id(
            rec["question_id"], answering, parsing, timestamp, replicate),
        "run_name": rec.get("run_name") or None, "replicate": replicate,
        "completed_without_errors": b("success", True), "error": rec.get("error") or None,
    }
    template = {
        "raw_llm_response": rec.get("raw_llm_response", ""),
        "parsed_gt_response": parse_json(rec.get("parsed_gt_response")),
        "parsed_llm_response": parse_json(rec.get("parsed_llm_response")),
        "template_verification_performed": b("template_verification_performed"),
        "verify_result": parse_json(rec.get("verify_result")),
        "verify_granular_result": parse_json(rec.get("verify_granular_result")),
        "embedding_check_performed": b("embedding_check_performed"),
        "embedding_similarity_score": float(rec["embedding_similarity_score"])
        if (rec.get("embedding_similarity_score") or "").strip() else None,
        "embedding_override_applied": b("embedding_override_applied"),
        "embedding_model_used": rec.get("embedding_model_used") or None,
        "answering_mcp_servers": parse_json(rec.get("answering_mcp_servers")),
        "usage_metadata": parse_json(rec.get("usage_metadata")),
        "agent_metrics": parse_json(rec.get("agent_metrics")),
    }
    data: dict[str, Any] = {"metadata": metadata, "template": template}
    if b("rubric_evaluation_performed"):
        scores: dict[str, Any] = {k[len(RUBRIC_PREFIX):]: parse_score(v) for k, v in rec.items()
                                  if k.startswith(RUBRIC_PREFIX) and k != "rubric_evaluation_performed"
                                  and v is not None and v.strip()}
        scores.update(parse_json(rec.get(QUESTION_SPECIFIC)) or {})
        metric = {k: v for k, v in scores.items() if isinstance(v, dict)}
        metric.update(parse_json(rec.get("metric_trait_metrics")) or {})
        llm = {k: v for k, v in scores.items() if not isinstance(v, dict) and v is not None}
        data["rubric"] = {
            "rubric_evaluation_performed": True, "llm_trait_scores": llm or None, "metric_trait_scores": metric or None,
            "metric_trait_confusion_lists": parse_json(rec.get("metric_trait_confusion_lists")),
        }
    if b("deep_judgment_enabled"):
        data["deep_judgment"] = {
            "deep_judgment_enabled": True, "deep_judgment_performed": b("deep_judgment_performed"),
            "deep_judgment_model_calls": int(rec.get("deep_judgment_model_calls") or 0),
            "deep_judgment_excerpt_retry_count": int(rec.get("deep_judgment_excerpt_retry_count") or 0),
            "deep_judgment_search_enabled": b("deep_judgment_search_enabled"),
            **{name: parse_json(rec.get(name)) for name in _DJ},
        }
    if b("deep_judgment_rubric_performed"):
        data["deep_judgment_rubric"] = {
            "deep_judgment_rubric_performed": True,
            **{name: parse_json(rec.get(name)) for name in _DJR},
            **{name: int(rec.get(name) or 0) for name in _DJR_COUNTS},
        }
    return VerificationResult.model_validate(data)
