"""ParseTemplate (spec/003 stage 7): the judge fills the template's schema from the response.
Fatal on failure (the job's template branch ends with an error); skipped after the guards'
cascade (recursion limit, trace failure, abstention, insufficiency).
"""

from __future__ import annotations

import time
from typing import Any

from services.guards.stage import evaluation_text
from shared import prompts
from shared.events import Job, State
from shared.llm import LLMClient, LLMError, usage_entry
from shared.service import record, stage_error
from shared.templates import TemplateInfo

STAGE = "parse_template"


def skip_reason(state: State) -> str | None:
    sig = state.signals
    if state.error:
        return "upstream error"
    if sig.get("recursion_limit"):
        return "recursion limit reached"
    if sig.get("trace_validation_failed"):
        return "trace validation failed"
    if sig.get("abstention"):
        return "abstention detected"
    if sig.get("insufficient"):
        return "response insufficient"
    return None


def schema_validator(schema: dict[str, Any]):  # noqa: ANN201
    """Cheap in-process check of the judge's JSON (required fields present); the template's own
    pydantic validation runs in the sandbox at verification."""
    required = list(schema.get("required") or schema.get("properties", {}).keys())

    def check(obj: Any) -> Any:
        if not isinstance(obj, dict):
            raise ValueError("expected a JSON object with the template's fields")
        missing = [k for k in required if k not in obj]
        if missing:
            raise ValueError(f"missing required field(s): {', '.join(missing)}")
        return obj

    return check


async def parse_template(job: Job, state: State, llm: LLMClient, info: TemplateInfo | None) -> State:
    t = time.time()
    reason = skip_reason(state)
    if reason:
        record(state, STAGE, "skipped", t, reason)
        return state
    if info is None or not info.ok:
        err = (info.error if info else None) or "template missing"
        state.template["template_validation_error"] = err
        state.error = stage_error("validate_template", ValueError(f"template invalid: {err}"))
        record(state, STAGE, "failed", t, err[:300])
        return state
    text = evaluation_text(state, bool(job.options.get("use_full_trace_for_template", False)))
    msgs = prompts.parsing_messages(job.question_text, text, info.json_schema, job.options, job.parsing.system_prompt)
    try:
        reply = await llm.complete(
            job.parsing, msgs, stage="parsing", response_schema=info.json_schema,
            schema_name=info.class_name or "Answer", validate=schema_validator(info.json_schema),
        )
    except LLMError as exc:
        state.error = stage_error(STAGE, exc)
        record(state, STAGE, "failed", t, str(exc)[:300])
        return state
    state.signals["parsed"] = reply.parsed
    state.usage["parsing"] = usage_entry(reply)
    record(state, STAGE, "performed", t)
    return state
