"""ParseTemplate (spec/003 stage 7): the judge fills the template's schema from the response.
Fatal on failure (the job's template branch ends with an error); skipped after the guards'
cascade (recursion limit, trace failure, abstention, insufficiency).

With `deep_judgment_enabled` the parse is the three-stage deep judgment of
`services.parsing.deep_judgment` (excerpts -> reasoning -> parameters) and `state.deep_judgment`
holds every VerificationResultDeepJudgment field; a skipped or failed stage still leaves
`{"deep_judgment_enabled": True, "deep_judgment_performed": False, ...}` so the result says the
feature was on. With it off, nothing of deep judgment runs (one dict lookup).
"""

from __future__ import annotations

import time
from typing import Any

from services.parsing.deep_judgment import base_section, deep_judgment_parse
from shared.core import prompts
from shared.core.events import Job, State
from shared.core.stage import evaluation_text, record, require_fields, stage_error
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import LLMError, usage_entry
from shared.runtime.search import SearchTool
from shared.templates.calls import TemplateInfo

STAGE = "parse_template"


def skip_reason(state: State) -> str | None:
    sig = state.signals
    if state.error:
        return "upstream error"
    if sig.recursion_limit:
        return "recursion limit reached"
    if sig.trace_validation_failed:
        return "trace validation failed"
    if sig.abstention:
        return "abstention detected"
    if sig.insufficient:
        return "response insufficient"
    return None


def schema_validator(schema: dict[str, Any]):  # noqa: ANN201
    """Cheap in-process check of the judge's JSON (required fields present); the template's own
    pydantic validation runs in the sandbox at verification."""
    required = list(schema.get("required") or schema.get("properties", {}).keys())
    return require_fields(required, expected="a JSON object with the template's fields",
                          missing="required field(s)")


async def parse_template(job: Job, state: State, llm: LLMClient, info: TemplateInfo | None,
                         search_tool: SearchTool | None = None) -> State:
    """Stage 7, ParseTemplate: the judge fills the template's fields from the answer.

    Requires: `evaluation_text(state)` (the answer, or the agent's final message); the guards'
    signals (a skip when any fired); `info` (the template's schema and field descriptions);
    `job.parsing`, `job.options` (`deep_judgment_*`).
    Produces: signal `parsed` (the judge's fields); `usage["parsing"]` (and the deep-judgment
    usage); `deep_judgment` (excerpts, reasoning, hallucination risk) when enabled; the
    `parse_template` stage record; `error` when the judge fails (fatal, as in karenina).
    Calls: `llm.complete` (one structured call, or the deep-judgment rounds of
    `services.parsing.deep_judgment`); `search_tool` (default: the registry lookup of
    `deep_judgment_search_tool`) for search-enhanced deep judgment.
    """
    t = time.time()
    deep = bool(job.options.get("deep_judgment_enabled"))
    if deep:
        state.deep_judgment = base_section(job.options)
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
    if deep:
        return await _deep_parse(job, state, llm, info, text, t, search_tool)
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
    state.signals.parsed = reply.parsed
    state.usage["parsing"] = usage_entry(reply)
    record(state, STAGE, "performed", t)
    return state


async def _deep_parse(job: Job, state: State, llm: LLMClient, info: TemplateInfo, text: str, t: float,
                      search_tool: SearchTool | None) -> State:
    out = await deep_judgment_parse(job, text, info, llm, schema_validator(info.json_schema or {}), search_tool)
    state.deep_judgment = out.section
    state.usage.update(out.usage)
    if out.error is not None:
        state.error = stage_error(STAGE, out.error)
        record(state, STAGE, "failed", t, f"deep judgment: {out.error}"[:300])
        return state
    state.signals.parsed = out.parsed
    missing = out.section.get("attributes_without_excerpts") or []
    record(state, STAGE, "performed", t,
           f"deep judgment: no excerpts for {', '.join(missing)}" if missing else "deep judgment")
    return state
