"""Guards before parsing (spec/003 stages 3-6): RecursionLimitAutoFail, TraceValidationAutoFail,
AbstentionCheck, SufficiencyCheck, with the spec's skip cascade. Judge failures here are
non-fatal: they are logged on the state and the pipeline goes on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shared.core import prompts
from shared.core.events import Job, State
from shared.core.stage import evaluation_text, record, require_fields
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import LLMError, usage_entry

log = logging.getLogger("veribus.guards")


def final_ai_message(trace: list[dict[str, Any]]) -> str:
    """The last AI message of an agent trace; raises ValueError when the trace does not end in one."""
    if not trace:
        raise ValueError("empty trace: no final AI message")
    last = trace[-1]
    if last.get("role") not in ("assistant", "ai"):
        raise ValueError(f"trace ends with a {last.get('role')!r} message, not an AI message")
    if last.get("tool_calls"):
        raise ValueError("trace ends with an AI message that requests tool calls, not an answer")
    content = last.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not content or not str(content).strip():
        raise ValueError("final AI message is empty")
    return str(content)



async def check_guards(job: Job, state: State, llm: LLMClient, template_schema: dict[str, Any] | None) -> State:
    """Stages 3-6 (RecursionLimitAutoFail, TraceValidationAutoFail, AbstentionCheck,
    SufficiencyCheck) on the answer's state, updated in place and returned.

    Requires: `state.template.raw_llm_response` (and `trace_messages`, `recursion_limit_reached`
    for agent answers); `job.options` (`abstention_enabled`, `sufficiency_enabled`,
    `use_full_trace_*`); `template_schema` for the sufficiency check.
    Produces: signals `recursion_limit`, `agent_trace`, `final_ai_message`,
    `trace_validation_failed`, `abstention`, `insufficient`; `template.abstention_*` and
    `template.sufficiency_*`; `root.evaluation_input`, `root.used_full_trace`; four stage records.
    Calls: `llm.complete` with the parsing model for the abstention and the sufficiency checks
    (when enabled and not skipped); nothing else.
    """
    opts = job.options
    tmpl = state.template
    sig = state.signals
    if state.error:
        for stage in ("recursion_limit_autofail", "trace_validation_autofail", "abstention_check", "sufficiency_check"):
            record(state, stage, "skipped", time.time(), "upstream error")
        return state

    # 3. RecursionLimitAutoFail
    t = time.time()
    if tmpl.get("recursion_limit_reached"):
        sig.recursion_limit = True
        log.warning("result %s: recursion limit reached -> verify_result=False", job.result_id)
        record(state, "recursion_limit_autofail", "performed", t, "recursion limit reached")
    else:
        record(state, "recursion_limit_autofail", "skipped", t, "recursion limit not reached")

    # 4. TraceValidationAutoFail (MCP agent traces only; manual traces are trusted)
    t = time.time()
    trace = tmpl.get("trace_messages") or []
    is_agent = bool(job.answering.mcp_servers) and job.answering.interface != "manual"
    sig.agent_trace = is_agent
    if is_agent:
        try:
            sig.final_ai_message = final_ai_message(trace)
            record(state, "trace_validation_autofail", "performed", t, "trace valid")
        except ValueError as exc:
            sig.trace_validation_failed = True
            state.root["trace_extraction_error"] = str(exc)
            log.warning("result %s: trace validation failed: %s", job.result_id, exc)
            record(state, "trace_validation_autofail", "performed", t, f"trace invalid: {exc}")
    else:
        record(state, "trace_validation_autofail", "skipped", t, "not an MCP agent trace")

    template_mode = job.evaluation_mode != "rubric_only"
    use_full = bool(opts.get("use_full_trace_for_template", False)) if template_mode else bool(
        opts.get("use_full_trace_for_rubric", True))
    # as the reference records it: the configured choice, also for plain replies (whose final AI
    # message is the whole reply, so "not the full trace" is what was evaluated)
    state.root["used_full_trace"] = use_full
    state.root["evaluation_input"] = evaluation_text(state, use_full)
    text = state.root["evaluation_input"]

    # 5. AbstentionCheck
    t = time.time()
    if not opts.get("abstention_enabled"):
        record(state, "abstention_check", "skipped", t, "abstention_enabled is false")
    elif sig.recursion_limit:
        record(state, "abstention_check", "skipped", t, "recursion limit reached")
    else:
        try:
            reply = await llm.complete(
                job.parsing, prompts.abstention_messages(job.question_text, text, opts),
                stage="abstention_check", response_schema=prompts.ABSTENTION_SCHEMA,
                schema_name="abstention", validate=require_fields(["abstention_detected"]),
            )
            detected = bool(reply.parsed["abstention_detected"])
            tmpl["abstention_check_performed"] = True
            tmpl["abstention_detected"] = detected
            tmpl["abstention_reasoning"] = str(reply.parsed.get("reasoning") or "")
            tmpl["abstention_override_applied"] = detected
            sig.abstention = detected
            state.usage["abstention_check"] = usage_entry(reply)
            if detected:
                log.warning("result %s: abstention detected -> verify_result=False", job.result_id)
            record(state, "abstention_check", "performed", t, "abstention detected" if detected else "")
        except LLMError as exc:
            log.warning("result %s: abstention check failed (non-fatal): %s", job.result_id, exc)
            record(state, "abstention_check", "failed", t, str(exc)[:300])

    # 6. SufficiencyCheck (template modes only)
    t = time.time()
    if not opts.get("sufficiency_enabled"):
        record(state, "sufficiency_check", "skipped", t, "sufficiency_enabled is false")
    elif not template_mode:
        record(state, "sufficiency_check", "skipped", t, "rubric_only mode has no template")
    elif sig.recursion_limit or sig.trace_validation_failed or sig.abstention:
        record(state, "sufficiency_check", "skipped", t, "recursion limit, trace failure or abstention")
    elif not template_schema:
        record(state, "sufficiency_check", "failed", t, "template schema unavailable")
    else:
        try:
            reply = await llm.complete(
                job.parsing, prompts.sufficiency_messages(job.question_text, text, template_schema, opts),
                stage="sufficiency_check", response_schema=prompts.SUFFICIENCY_SCHEMA,
                schema_name="sufficiency", validate=_sufficiency_verdict,
            )
            sufficient = bool(reply.parsed["sufficient"])
            tmpl["sufficiency_check_performed"] = True
            tmpl["sufficiency_detected"] = sufficient
            tmpl["sufficiency_reasoning"] = str(reply.parsed.get("reasoning") or "")
            tmpl["sufficiency_override_applied"] = not sufficient
            sig.insufficient = not sufficient
            state.usage["sufficiency_check"] = usage_entry(reply)
            record(state, "sufficiency_check", "performed", t, "" if sufficient else "insufficient")
        except LLMError as exc:
            log.warning("result %s: sufficiency check failed (non-fatal): %s", job.result_id, exc)
            record(state, "sufficiency_check", "failed", t, str(exc)[:300])
    return state


_SUFFICIENCY_KEYS = ("sufficient", "is_sufficient", "sufficiency_detected")


def _sufficiency_verdict(obj: Any) -> Any:
    """The verdict under our key or the names other judges (the reference's included) use for it."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    for key in _SUFFICIENCY_KEYS:
        if isinstance(obj.get(key), bool):
            return {**obj, "sufficient": obj[key]}
    raise ValueError(f"missing boolean field: one of {', '.join(_SUFFICIENCY_KEYS)}")


