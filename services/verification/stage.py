"""VerifyTemplate, EmbeddingCheck and DeepJudgmentAutoFail (spec/003 stages 8-10).

verify_result = field verification AND regex verification; the guards' auto-fails force it
to False; the embedding check may only turn a failed *field* verification into a pass.
"""

from __future__ import annotations

import time
from typing import Any

from shared.events import Job, State
from shared.service import record, stage_error
from shared.templates import run_verify

STAGE = "verify_template"

_OUTCOME_FIELDS = (
    "template_verification_performed", "verify_result", "verify_granular_result", "field_verification_error",
    "parsed_llm_response", "parsed_gt_response", "field_results", "composition_strategy",
    "regex_validations_performed", "regex_validation_results", "regex_validation_details",
    "regex_overall_success", "regex_extraction_results",
)


def _apply_guard_overrides(state: State) -> str | None:
    """The guards' verdicts (spec/003 override table); returns why verification is skipped."""
    sig = state.signals
    tmpl = state.template
    for flag, why in (
        ("recursion_limit", "recursion limit reached"),
        ("abstention", "abstention detected"),
        ("trace_validation_failed", "trace validation failed"),
        ("insufficient", "response insufficient"),
    ):
        if sig.get(flag):
            tmpl["verify_result"] = False
            sig["field_verification_result"] = False
            return why
    return None


async def verify_template(job: Job, state: State) -> State:
    t = time.time()
    if state.error:
        record(state, STAGE, "skipped", t, "upstream error")
        return state
    why = _apply_guard_overrides(state)
    if why:
        record(state, STAGE, "skipped", t, why)
        record(state, "embedding_check", "skipped", t, why)
        record(state, "deep_judgment_autofail", "skipped", t, why)
        return state
    parsed: dict[str, Any] | None = state.signals.get("parsed")
    if parsed is None or not job.template_code:
        record(state, STAGE, "skipped", t, "nothing parsed")
        return state
    outcome = await run_verify(
        job.template_code, parsed, job.question_id, state.template.get("raw_llm_response", ""),
        template_id=job.template_id, timeout_s=job.options.get("template_timeout_s"),
    )
    if getattr(outcome, "error", None):
        state.error = stage_error(STAGE, ValueError(outcome.error))
        record(state, STAGE, "failed", t, str(outcome.error)[:300])
        return state
    for name in _OUTCOME_FIELDS:
        state.template[name] = getattr(outcome, name, None)
    field_ok = getattr(outcome, "field_verification_result", None)
    state.signals["field_verification_result"] = bool(outcome.verify_result if field_ok is None else field_ok)
    record(state, STAGE, "performed", t)
    record(state, "embedding_check", "skipped", time.time(), "embedding check disabled"
           if not job.options.get("embedding_check_enabled") else "field verification passed")
    record(state, "deep_judgment_autofail", "skipped", time.time(), "deep judgment not performed")
    return state

