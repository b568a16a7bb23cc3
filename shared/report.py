"""Report outputs (spec/004): per-result grades, the run summary, and the files in `--output DIR`.

A sample's score is 1.0 when its template verification passed and 0.0 otherwise; in
rubric_only mode it is the mean of its rubric traits normalised to 0..1. A result that did not
complete without errors counts in `total` but not in `total_attempted`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shared.models import VerificationResult


def _trait_norm(value: Any, lo: float | None = None, hi: float | None = None) -> float | None:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        if lo is not None and hi is not None and hi > lo:
            return max(0.0, min(1.0, (float(value) - lo) / (hi - lo)))
        return None
    return None


def score_of(r: VerificationResult, trait_ranges: dict[str, tuple[float, float]] | None = None) -> float | None:
    """0..1 score of one result, or None when it was not attempted (error)."""
    if not r.metadata.completed_without_errors:
        return None
    if r.template is not None and r.template.verify_result is not None:
        return 1.0 if r.template.verify_result else 0.0
    if r.rubric is not None:
        vals = []
        for name, v in r.rubric.get_all_trait_scores().items():
            lo, hi = (trait_ranges or {}).get(name, (None, None))
            n = _trait_norm(v, lo, hi)
            if n is not None:
                vals.append(n)
        return sum(vals) / len(vals) if vals else None
    return None


def rationale_of(r: VerificationResult) -> str:
    if not r.metadata.completed_without_errors:
        return f"error: {r.metadata.error}"
    t = r.template
    if t is None:
        return "rubric only"
    for flag, why in (
        (t.abstention_override_applied, "abstention detected"),
        (t.sufficiency_override_applied, "response insufficient"),
        (t.recursion_limit_reached, "recursion limit reached"),
        (t.embedding_override_applied, "embedding check judged the answer equivalent"),
    ):
        if flag:
            return why
    if t.field_verification_error:
        return f"verify() raised: {t.field_verification_error}"
    return f"verify() -> {t.verify_result}; parsed {t.parsed_llm_response} vs expected {t.parsed_gt_response}"


def result_line(r: VerificationResult) -> dict[str, Any]:
    """One results.jsonl line: the spec/004 sample/submission/grade shape plus the full result."""
    score = score_of(r)
    grades: dict[str, Any] = {}
    if r.template is not None and r.template.verify_result is not None:
        grades["accuracy"] = {"score": 1.0 if r.template.verify_result else 0.0, "rationale": rationale_of(r)}
    if r.rubric is not None:
        for name, v in r.rubric.get_all_trait_scores().items():
            grades[name] = {"score": v, "rationale": "rubric trait"}
    usage = (r.template.usage_metadata if r.template else None) or {}
    return {
        "sample": {
            "id": r.metadata.question_id, "input": r.metadata.question_text,
            "ground_truth": r.metadata.raw_answer, "replicate": r.metadata.replicate,
        },
        "submission": r.template.raw_llm_response if r.template else r.evaluation_input,
        "grade": {"score": score, "rationale": rationale_of(r)},
        "grades": grades,
        "trajectory": r.template.trace_messages if r.template else [],
        "model_name": r.metadata.answering_model,
        "judge_name": r.metadata.parsing_model,
        "usage": usage,
        "result": r.model_dump(mode="json"),
    }


def summarize(results: list[VerificationResult], unfinished_skipped: int = 0) -> dict[str, Any]:
    """Run metrics: totals, attempted, scores, pass counts, per model."""
    total = len(results)
    scores = [score_of(r) for r in results]
    attempted = [s for s in scores if s is not None]
    passed = sum(1 for s in attempted if s >= 1.0)
    per_model: dict[str, dict[str, Any]] = defaultdict(lambda: {"total": 0, "attempted": 0, "passed": 0, "errors": 0})
    for r, s in zip(results, scores, strict=True):
        m = per_model[r.metadata.answering_model]
        m["total"] += 1
        if s is None:
            m["errors"] += 1
        else:
            m["attempted"] += 1
            m["passed"] += 1 if s >= 1.0 else 0
    for m in per_model.values():
        m["pass_rate"] = round(m["passed"] / m["attempted"], 4) if m["attempted"] else None
    return {
        "total": total,
        "total_attempted": len(attempted),
        "avg_score_attempted": round(sum(attempted) / len(attempted), 4) if attempted else 0.0,
        "avg_score_total": round(sum(attempted) / total, 4) if total else 0.0,
        "passed_attempts": passed,
        "failed_attempts": len(attempted) - passed,
        "errors": total - len(attempted),
        "unfinished_questions_skipped": unfinished_skipped,
        "by_metric": {
            "accuracy": {
                "avg_score_attempted": round(sum(attempted) / len(attempted), 4) if attempted else 0.0,
                "pass_rate": round(100.0 * passed / len(attempted), 2) if attempted else 0.0,
                "passed_attempts": passed,
                "failed_attempts": len(attempted) - passed,
            }
        },
        "per_model": dict(sorted(per_model.items())),
    }


def write_outputs(
    out_dir: Path, suite: str, run_id: str, results: list[VerificationResult], summary: dict[str, Any],
    config: dict[str, Any], simulated: bool,
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {"suite_name": suite, "run_id": run_id, "timestamp": datetime.now(UTC).isoformat(),
              "version": "0.1.0", "simulated": simulated}
    (out_dir / "header.json").write_text(json.dumps(header, indent=2))
    body = {"suite": suite, "run_id": run_id, "simulated": simulated, "config": config, "metrics": summary,
            "gates_passed": summary.get("gates_passed", True)}
    (out_dir / "summary.json").write_text(json.dumps(body, indent=2, default=str))
    with (out_dir / "results.jsonl").open("w") as fh:
        for r in sorted(results, key=lambda r: (r.metadata.question_id, r.metadata.answering_model,
                                                r.metadata.parsing_model, r.metadata.replicate or 0)):
            fh.write(json.dumps(result_line(r), default=str) + "\n")
