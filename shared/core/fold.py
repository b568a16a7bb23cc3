"""The fold: a job plus the states its branches reached -> the VerificationResult.

Written once, used by the finalizer (live) and by anything that rebuilds results from the
event log. Override order follows spec/003: guard auto-fails and deep-judgment auto-fails
force verify_result to False; only the embedding check may raise a field failure to a pass
(applied in the verification stage before this fold).
"""

from __future__ import annotations

from typing import Any

from shared.core.events import Job, StageError, State
from shared.core.models import (
    ModelIdentity,
    VerificationResult,
    VerificationResultDeepJudgment,
    VerificationResultDeepJudgmentRubric,
    VerificationResultMetadata,
    VerificationResultRubric,
    VerificationResultTemplate,
)
from shared.core.usage import total_extras

TOKEN_KEYS = ("input_tokens", "output_tokens", "total_tokens")

# error stage -> failure category of the reference export format (metadata.failure)
_FAILURE_GROUPS = {"generate_answer": "generation", "parse_template": "parsing", "validate_template": "template"}


def needs_template(job: Job) -> bool:
    return job.evaluation_mode != "rubric_only"


def needs_rubric(job: Job) -> bool:
    return job.evaluation_mode != "template_only"


def identity(spec: Any, answering: bool) -> ModelIdentity:
    return ModelIdentity(
        interface=spec.interface, model_name=spec.model_name, tools=spec.tools if answering else [],
        config_id=spec.id or None,
    )


def merge_usage(*states: State | None) -> dict[str, Any] | None:
    usage: dict[str, Any] = {}
    for st in states:
        if st is not None:
            usage.update(st.usage)
    if not usage:
        return None
    total: dict[str, Any] = {k: 0 for k in TOKEN_KEYS}
    for entry in usage.values():
        for k in TOKEN_KEYS:
            total[k] += int(entry.get(k) or 0)
    total.update(total_extras(usage.values()))  # model calls, cached replies, cost (shared.core.usage)
    usage["total"] = total
    return usage


def _error_text(err: StageError) -> str:
    return f"{err.stage}: {err.type}: {err.message}"


def _failure(err: StageError) -> dict[str, Any]:
    msg = err.message.lower()
    category = "timeout" if "timeout" in msg or "timed out" in msg else (
        "rate_limit" if "429" in msg or "rate limit" in msg else "error")
    return {
        "category": category, "stage": err.stage, "reason": err.message[:500],
        "details": {"type": err.type, "attempt": err.attempt},
        "group": _FAILURE_GROUPS.get(err.stage, "pipeline"),
    }


def fold_result(job: Job, template_state: State | None, rubric_state: State | None, finalized_at: float) -> VerificationResult:
    base = template_state or rubric_state or State()
    error = (template_state.error if template_state else None) or (rubric_state.error if rubric_state else None)
    started = base.started_at or finalized_at
    answering = identity(job.answering, True)
    parsing = identity(job.parsing, False)
    metadata = VerificationResultMetadata(
        question_id=job.question_id,
        template_id=job.template_id,
        failure=_failure(error) if error else None,
        question_text=job.question_text,
        raw_answer=job.raw_answer,
        keywords=job.keywords,
        answering=answering,
        parsing=parsing,
        answering_system_prompt=job.answering.system_prompt,
        parsing_system_prompt=job.parsing.system_prompt,
        execution_time=round(max(0.0, finalized_at - started), 6),
        timestamp=job.timestamp,
        result_id=job.result_id,
        run_name=job.run_name,
        replicate=job.replicate,
        completed_without_errors=error is None,
        error=_error_text(error) if error else None,
        few_shot_enabled=bool(job.few_shot_examples),
        few_shot_example_count=len(job.few_shot_examples),
        evaluation_mode=job.evaluation_mode,
    )
    usage = merge_usage(template_state, rubric_state if rubric_state is not template_state else None)

    template = None
    deep_judgment = None
    if needs_template(job):
        tfields = dict(base.template)
        if rubric_state is not None and rubric_state.signals.get("dj_rubric_autofail"):
            tfields["verify_result"] = False
        tfields["usage_metadata"] = usage
        template = VerificationResultTemplate(**tfields)
        if template_state is not None and template_state.deep_judgment is not None:
            deep_judgment = VerificationResultDeepJudgment(**template_state.deep_judgment)

    rubric = None
    deep_judgment_rubric = None
    if needs_rubric(job) and rubric_state is not None:
        if rubric_state.rubric is not None and not rubric_state.signals.get("rubric_error"):
            rubric = VerificationResultRubric(**rubric_state.rubric)
        if rubric_state.deep_judgment_rubric is not None:
            deep_judgment_rubric = VerificationResultDeepJudgmentRubric(**rubric_state.deep_judgment_rubric)

    root = base.root
    return VerificationResult(
        metadata=metadata,
        template=template,
        rubric=rubric,
        deep_judgment=deep_judgment,
        deep_judgment_rubric=deep_judgment_rubric,
        evaluation_input=root.get("evaluation_input"),
        used_full_trace=bool(root.get("used_full_trace", True)),
        trace_extraction_error=root.get("trace_extraction_error"),
    )
