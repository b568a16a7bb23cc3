"""The fold: a job plus the states its branches reached -> the VerificationResult.

Written once, used by the finalizer (live) and by anything that rebuilds results from the
event log. Override order follows spec/003: guard auto-fails and deep-judgment auto-fails
force verify_result to False; only the embedding check may raise a field failure to a pass
(applied in the verification stage before this fold).
"""

from __future__ import annotations

import re
from typing import Any

from shared.core.events import Job, StageError, State
from shared.core.models import (
    FAILURE_GROUP_OF,
    ModelIdentity,
    VerificationResult,
    VerificationResultDeepJudgment,
    VerificationResultDeepJudgmentRubric,
    VerificationResultMetadata,
    VerificationResultRubric,
    VerificationResultTemplate,
)
from shared.core.prompts import answering_system_prompt
from shared.core.usage import total_extras

TOKEN_KEYS = ("input_tokens", "output_tokens", "total_tokens")

# The reference's failure taxonomy (metadata.failure): leaf category -> group.
FAILURE_GROUPS: dict[str, str] = FAILURE_GROUP_OF
VERDICT_GROUPS = frozenset({"content", "autofail", "abstained"})
_RETRY_KINDS = ("timeout", "connection", "rate_limit", "server_error")
# our auto-fail signals -> (category, the reference's stage name)
_AUTOFAIL_SIGNALS = (
    ("recursion_limit", "recursion_limit", "RecursionLimitAutoFail"),
    ("trace_validation_failed", "trace_validation", "TraceValidationAutoFail"),
    ("dj_autofail", "deep_judgment", "DeepJudgmentAutoFail"),
    ("dj_rubric_autofail", "deep_judgment_rubric", "DeepJudgmentRubricAutoFail"),
)
_KIND = re.compile(r"\s*(" + "|".join(_RETRY_KINDS) + r")\b")
_ATTEMPTS = re.compile(r"after (\d+) attempt")


def needs_template(job: Job) -> bool:
    return job.evaluation_mode != "rubric_only"


def needs_rubric(job: Job) -> bool:
    return job.evaluation_mode != "template_only"


def identity(spec: Any, answering: bool) -> ModelIdentity:
    return ModelIdentity(
        interface=spec.interface, model_name=spec.model_name, tools=spec.tools if answering else [],
        config_id=spec.id or None,
    )


def _stage_usage(*states: State | None) -> dict[str, Any]:
    """Usage entries by stage over both branches (the shared stages appear once)."""
    usage: dict[str, Any] = {}
    for st in states:
        if st is not None:
            usage.update(st.usage)
    return usage


def merge_usage(*states: State | None) -> dict[str, Any] | None:
    """usage_metadata: the stage entries (without their retry tallies) and their total."""
    usage = {k: {f: v for f, v in e.items() if f != "retries"} if isinstance(e, dict) else e
             for k, e in _stage_usage(*states).items()}
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
    """`stage: type: message`: what went wrong and where, in one line."""
    return f"{err.stage}: {err.type}: {err.message}"


def _trim(text: str | None) -> str:
    return (text or "").strip()[:500]


def _failure_entry(category: str, stage: str, reason: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"category": category, "stage": stage, "reason": _trim(reason) or category,
            "details": details, "group": FAILURE_GROUPS[category]}


def error_kind(err: StageError) -> str | None:
    """The model-call error kind a stage error carries (`rate_limit: model ...`), if any."""
    m = _KIND.match(err.message)
    return m.group(1) if m else None


def retry_counts(err: StageError | None, job: Job, usage: dict[str, Any] | None = None) -> dict[str, dict[str, int]]:
    """Retries spent per error category, as the reference records them (`{category: {used, budget}}`):
    the retries of calls that then succeeded (tallied by the model client on each stage's usage
    entry) plus those of a call that failed for good. The budget is the model's `max_retries`."""
    out: dict[str, dict[str, int]] = {}

    def add(kind: str, used: int, stage: str) -> None:
        model = job.answering if stage in ("answer_generation", "generate_answer") else job.parsing
        entry = out.setdefault(kind, {"used": 0, "budget": 0})
        entry["used"] += used
        entry["budget"] = max(entry["budget"], int(model.max_retries))

    for stage, entry in (usage or {}).items():
        for kind, n in ((entry.get("retries") if isinstance(entry, dict) else None) or {}).items():
            add(str(kind), int(n), stage)
    kind = error_kind(err) if err is not None else None
    if err is not None and kind is not None:
        m = _ATTEMPTS.search(err.message)
        add(kind, max(0, int(m.group(1)) - 1) if m else 0, err.stage)
    return out


def classify_failure(job: Job, template_state: State | None, rubric_state: State | None,
                     template: dict[str, Any] | None) -> dict[str, Any] | None:
    """The reference's failure verdict, by its rule order: auto-fails, content, exhausted retries,
    abstention/sufficiency, template validation, parsing, any other error; None for a pass."""
    states = [st for st in (template_state, rubric_state) if st is not None]
    for flag, category, stage in _AUTOFAIL_SIGNALS:
        if any(getattr(st.signals, flag) for st in states):
            return _failure_entry(category, stage, f"auto-fail at stage {stage}")
    tmpl = template or {}
    if tmpl.get("template_verification_performed") and tmpl.get("verify_result") is False:
        return _failure_entry("content", "verify_template", "verify_template returned False")
    error = (template_state.error if template_state else None) or (rubric_state.error if rubric_state else None)
    if error is not None:
        kind = error_kind(error)
        if kind is not None:
            return _failure_entry(kind, error.stage, f"{kind} retries exhausted",
                                  {"error_message": error.message, "retry_counts": retry_counts(
                                      error, job, _stage_usage(template_state, rubric_state))})
    if tmpl.get("abstention_detected"):
        return _failure_entry("abstention", "abstention_check", tmpl.get("abstention_reasoning") or "model abstained")
    if tmpl.get("sufficiency_check_performed") and tmpl.get("sufficiency_detected") is False:
        return _failure_entry("sufficiency", "sufficiency_check",
                              tmpl.get("sufficiency_reasoning") or "insufficient response")
    if error is not None:
        if error.stage == "validate_template":
            return _failure_entry("template_validation", "validate_template", error.message)
        if error.stage == "parse_template":
            return _failure_entry("parsing", "parse_template", error.message, {"error_message": error.message})
        return _failure_entry("unexpected_error", error.stage, error.message, {"error_message": error.message})
    return None


def completed_from_failure(failure: dict[str, Any] | None) -> bool:
    """A result completed without errors unless its failure is an error (retries exhausted, a
    system failure): a wrong answer, an auto-fail and an abstention are verdicts - every stage did
    its work and verify_result is False - so they count against accuracy, not as errors."""
    return failure is None or failure.get("group") in VERDICT_GROUPS


def fold_result(job: Job, template_state: State | None, rubric_state: State | None, finalized_at: float) -> VerificationResult:
    base = template_state or rubric_state or State()
    error = (template_state.error if template_state else None) or (rubric_state.error if rubric_state else None)
    started = base.started_at or finalized_at
    answering = identity(job.answering, True)
    parsing = identity(job.parsing, False)
    template_fields: dict[str, Any] | None = None
    if needs_template(job):
        template_fields = dict(base.template)
        if rubric_state is not None and rubric_state.signals.dj_rubric_autofail:
            template_fields["verify_result"] = False
    failure = classify_failure(job, template_state, rubric_state, template_fields)
    metadata = VerificationResultMetadata(
        question_id=job.question_id,
        template_id=job.template_id,
        failure=failure,
        retry_counts=retry_counts(error, job, _stage_usage(template_state, rubric_state)),
        question_text=job.question_text,
        raw_answer=job.raw_answer,
        keywords=job.keywords,
        answering=answering,
        parsing=parsing,
        # as the reference: an answering model without one gets the default instruction (and is sent
        # it); a judge's own system prompt is recorded only when configured
        answering_system_prompt=answering_system_prompt(job.answering.system_prompt),
        parsing_system_prompt=job.parsing.system_prompt,
        execution_time=round(max(0.0, finalized_at - started), 6),
        timestamp=job.timestamp,
        result_id=job.result_id,
        run_name=job.run_name,
        replicate=job.replicate,
        completed_without_errors=error is None and completed_from_failure(failure),
        error=_error_text(error) if error else None,
        few_shot_enabled=bool(job.few_shot_examples),
        few_shot_example_count=len(job.few_shot_examples),
        evaluation_mode=job.evaluation_mode,
    )
    usage = merge_usage(template_state, rubric_state if rubric_state is not template_state else None)

    template = None
    deep_judgment = None
    if template_fields is not None:
        tfields = template_fields
        tfields["usage_metadata"] = usage
        template = VerificationResultTemplate(**tfields)
        if template_state is not None and template_state.deep_judgment is not None:
            deep_judgment = VerificationResultDeepJudgment(**template_state.deep_judgment)

    rubric = None
    deep_judgment_rubric = None
    if needs_rubric(job) and rubric_state is not None:
        if rubric_state.rubric is not None and not rubric_state.signals.rubric_error:
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
        used_full_trace=bool(root.get("used_full_trace", False)),
        trace_extraction_error=root.get("trace_extraction_error"),
    )
