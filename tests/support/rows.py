"""Builders for the row tests: a complete synthetic VerificationResult (ids computed as the spec
says) and a stage event envelope with a given stage log."""

from __future__ import annotations

from typing import Any

from shared.core import events
from shared.core.models import (
    ModelIdentity,
    VerificationResult,
    VerificationResultDeepJudgment,
    VerificationResultMetadata,
    VerificationResultRubric,
    VerificationResultTemplate,
)

TIMESTAMP = "2026-04-21T12:00:00+00:00"


def make_result(
    question: str = "q1",
    model: str = "gpt-4o",
    judge: str = "gpt-4o-mini",
    replicate: int | None = 1,
    verify: bool | None = True,
    *,
    error: str | None = None,
    rubric: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
    tools: list[str] | None = None,
    mode: str = "template_only",
    run_name: str | None = "run-a",
) -> VerificationResult:
    """A synthetic but complete VerificationResult (ids computed as the spec says)."""
    answering = ModelIdentity(interface="litellm", model_name=model, tools=tools or [])
    parsing = ModelIdentity(interface="litellm", model_name=judge)
    rid = VerificationResultMetadata.compute_result_id(question, answering, parsing, TIMESTAMP, replicate)
    meta = VerificationResultMetadata(
        question_id=question, question_text=f"What is {question}?", answering=answering, parsing=parsing,
        timestamp=TIMESTAMP, result_id=rid, replicate=replicate, run_name=run_name, execution_time=1.25,
        completed_without_errors=error is None, error=error, keywords=["k1", "k2"], evaluation_mode=mode,
        failure={"category": "error", "stage": "parse_template", "reason": error} if error else None,
    )
    template = VerificationResultTemplate(
        raw_llm_response=f"answer to {question}", template_verification_performed=verify is not None,
        verify_result=verify, verify_granular_result=0.5 if verify is not None else None,
        parsed_gt_response={"target": "BCL2"}, parsed_llm_response={"target": "BCL2" if verify else "X"},
        field_results={"target": bool(verify)}, embedding_check_performed=True, embedding_similarity_score=0.91,
        abstention_check_performed=True, abstention_detected=False,
        usage_metadata=usage,
    )
    rub = VerificationResultRubric(rubric_evaluation_performed=True, rubric_evaluation_strategy="batch", **rubric) \
        if rubric is not None else None
    return VerificationResult(
        metadata=meta, template=template, rubric=rub,
        deep_judgment=VerificationResultDeepJudgment(deep_judgment_enabled=True, deep_judgment_performed=True,
                                                     extracted_excerpts={"target": [{"text": "BCL2"}]}),
    )


USAGE = {
    "answer_generation": {"input_tokens": 150, "output_tokens": 200, "total_tokens": 350, "model": "gpt-4o"},
    "parsing": {"input_tokens": 200, "output_tokens": 80, "total_tokens": 280},
    "total": {"input_tokens": 350, "output_tokens": 280, "total_tokens": 630},
}
RUBRIC = {
    "llm_trait_scores": {"clarity": 4, "safety": True},
    "llm_trait_labels": {"tone": "formal"},
    "regex_trait_scores": {"has_citations": False},
    "callable_trait_scores": {"under_150w": True},
    "metric_trait_scores": {"drug_coverage": {"precision": 1.0, "recall": 0.75}},
}


def stage_env(event_type: str, rid: str, stages: list[tuple[str, str, float, float]],
               usage: dict[str, Any] | None = None, status: str = "performed",
               error: events.StageError | None = None) -> events.Envelope:
    job = events.Job(
        run_id="run1", result_id=rid, answer_id="a", question_id="q", question_text="?",
        answering=events.ModelSpec(model_name="m"), parsing=events.ModelSpec(model_name="j"), timestamp=TIMESTAMP,
    )
    state = events.State(
        stages=[events.StageRecord(stage=s, status=st, started_at=a, ended_at=b) for s, st, a, b in stages],  # type: ignore[arg-type]
        usage=usage or {}, error=error,
    )
    return events.make_envelope(event_type, "run1", rid, events.StageEvent(job=job, state=state, status=status), "test/1")  # type: ignore[arg-type]
