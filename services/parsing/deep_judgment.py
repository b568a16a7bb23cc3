"""Deep judgment for templates (spec/003 stage 7, `deep_judgment_enabled`): excerpts -> reasoning ->
parameters, filling every `VerificationResultDeepJudgment` field.

1. **excerpts** - the judge quotes, per template attribute, up to
   `deep_judgment_max_excerpts_per_attribute` verbatim passages with a confidence (low|medium|high).
   Each quote is checked against the evaluated text with THE fuzzy rule of `shared.runtime.search`
   (rapidfuzz partial ratio >= `deep_judgment_fuzzy_match_threshold`, the same function rubric deep
   judgment uses). Quotes that are not found are sent back to the judge, named with their match
   scores, up to `deep_judgment_excerpt_retry_attempts` times; what is still not found is dropped.
   An attribute left without a valid quote is listed in `attributes_without_excerpts` (the
   verification stage's DeepJudgmentAutoFail then fails the result).
   - optional search (`deep_judgment_search_enabled`): every quote is looked up with the named
     `SearchTool` and the judge rates its hallucination risk (one batched call); an attribute's
     risk is the highest of its quotes' ("high" when it has none: nothing in the response backs it).
2. **reasoning** - per attribute, what value the evidence supports and why (from the quotes only).
3. **parameters** - the normal structured parse of the response, with the quotes and reasoning
   added as evidence, validated like a plain parse (usage key "parsing").

Improvements over the reference, all deliberate:
- retries are *targeted*: the follow-up asks again only for the attributes whose quotes failed
  (smaller prompts, cheaper), continuing the same conversation, and names each failed quote
  with its score instead of a generic error; earlier valid quotes of those attributes are kept;
- a judge "no evidence" entry (empty text + explanation) is not retried and its explanation is
  handed to the reasoning stage, so `attribute_reasoning` says why an attribute has no excerpt;
- `attributes_without_excerpts` is computed once from the final excerpts (the reference can list
  an attribute twice when retries happen);
- stage 3 parses the response itself with the evidence alongside (the reference parses the
  reasoning text only, which loses values the reasoning did not restate);
- a failed search or hallucination assessment is logged and skipped, not fatal.
Usage: stages 1-2 (+ assessment) under usage key "deep_judgment", stage 3 under "parsing".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.core import prompts
from shared.core.events import Job
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import LLMError, LLMReply, add_usage, usage_entry
from shared.runtime.search import (
    SearchTool,
    SearchToolError,
    assess_hallucination,
    attach_search_results,
    get_search_tool,
    max_risk,
    validate_excerpts,
)
from shared.templates.calls import TemplateInfo

log = logging.getLogger("veribus.deep_judgment")


@dataclass
class DeepJudgmentOutcome:
    """What the three stages produced; `error` set means the parse failed (fatal for the result)."""

    section: dict[str, Any]
    parsed: dict[str, Any] | None = None
    usage: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: LLMError | None = None


def base_section(options: dict[str, Any]) -> dict[str, Any]:
    """The section of a job with deep judgment on, before (or without) running it."""
    return {
        "deep_judgment_enabled": True,
        "deep_judgment_performed": False,
        "extracted_excerpts": None,
        "attribute_reasoning": None,
        "deep_judgment_stages_completed": [],
        "deep_judgment_model_calls": 0,
        "deep_judgment_excerpt_retry_count": 0,
        "attributes_without_excerpts": None,
        "deep_judgment_search_enabled": bool(options.get("deep_judgment_search_enabled", False)),
        "hallucination_risk_assessment": None,
    }


def template_attributes(info: TemplateInfo) -> dict[str, str]:
    """Attribute name -> what to look for (the field description), in template order."""
    props: dict[str, Any] = (info.json_schema or {}).get("properties") or {}
    names = [n for n in info.field_names if n in props] or list(props)
    return {n: str(props[n].get("description") or props[n].get("title") or n) for n in names}


def _container(obj: Any) -> Any:
    if not isinstance(obj, dict | list):
        raise ValueError("expected a JSON object keyed by attribute name")
    return obj


def _object(obj: Any) -> Any:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object keyed by attribute name")
    return obj


def entries_by_attribute(reply: Any, attributes: list[str]) -> dict[str, Any]:
    """The judge's excerpt entries per attribute. Accepts the asked-for `{attr: [...]}`, the same
    wrapped in `{"excerpts": ...}`, and a flat `[{"attribute": attr, "text": ...}]` list."""
    if isinstance(reply, dict) and "excerpts" in reply and "excerpts" not in attributes:
        reply = reply["excerpts"]
    out: dict[str, Any] = {a: [] for a in attributes}
    if isinstance(reply, list):
        for item in reply:
            if isinstance(item, dict):
                name = item.get("attribute") or item.get("attribute_name") or item.get("name")
                if name in out:
                    out[name].append(item)
        return out
    if isinstance(reply, dict):
        for a in attributes:
            value = reply.get(a)
            if isinstance(value, list | dict | str):
                out[a] = value
            # anything else (a number, null) carries no quote: no excerpts for that attribute
    return out


def _reasoning_text(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("reasoning", "")
    return "" if value is None else str(value)


class _Calls:
    """Counts model calls and sums their usage under one key."""

    def __init__(self) -> None:
        self.count = 0
        self.usage: dict[str, Any] = {}

    def add(self, reply: LLMReply | None = None, error: LLMError | None = None) -> None:
        self.count += 1
        entry = usage_entry(reply) if reply is not None else (dict(error.usage) if error and error.usage else {})
        if entry:
            self.usage = add_usage(self.usage, entry) if self.usage else entry


async def deep_judgment_parse(
    job: Job, text: str, info: TemplateInfo, llm: LLMClient, validate: Callable[[Any], Any],
    search_tool: SearchTool | None = None,
) -> DeepJudgmentOutcome:
    """Run excerpts -> reasoning -> parameters for one job (see module docstring)."""
    opts = job.options
    threshold = float(opts.get("deep_judgment_fuzzy_match_threshold", 0.80))
    max_n = int(opts.get("deep_judgment_max_excerpts_per_attribute", 3))
    retries = int(opts.get("deep_judgment_excerpt_retry_attempts", 2))
    section = base_section(opts)
    stages: list[str] = section["deep_judgment_stages_completed"]
    attrs = template_attributes(info)
    names = list(attrs)
    dj, parse_calls = _Calls(), _Calls()
    outcome = DeepJudgmentOutcome(section=section)

    def finish(error: LLMError | None = None) -> DeepJudgmentOutcome:
        section["deep_judgment_model_calls"] = dj.count + parse_calls.count
        if dj.usage:
            outcome.usage["deep_judgment"] = dj.usage
        if parse_calls.usage:
            outcome.usage["parsing"] = parse_calls.usage
        outcome.error = error
        return outcome

    # ---- stage 1: excerpts, validated, with targeted retries
    msgs = prompts.deep_judgment_excerpt_messages(job.question_text, text, attrs, max_n, opts,
                                                  job.parsing.system_prompt)
    try:
        reply = await llm.complete(job.parsing, msgs, stage="deep_judgment_excerpts",
                                   response_schema=prompts.excerpt_schema(names, max_n), schema_name="excerpts",
                                   validate=_container)
    except LLMError as exc:
        dj.add(error=exc)
        return finish(exc)
    dj.add(reply)
    valid: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, list[dict[str, Any]]] = {}
    notes: dict[str, str] = {}
    for name, entries in entries_by_attribute(reply.parsed, names).items():
        valid[name], failed[name], note = validate_excerpts(entries, text, threshold, max_n)
        if note:
            notes[name] = note
    convo, last_text, retry_count = msgs, reply.text, 0
    for _ in range(retries):
        pending = [n for n in names if failed[n]]
        if not pending:
            break
        scope = "the attribute" + ("s " if len(pending) > 1 else " ") + ", ".join(pending)
        convo = convo + [
            {"role": "assistant", "content": last_text},
            {"role": "user", "content": prompts.excerpt_retry_feedback({n: failed[n] for n in pending}, threshold, scope)},
        ]
        retry_count += 1
        try:
            reply = await llm.complete(job.parsing, convo, stage="deep_judgment_excerpts",
                                       response_schema=prompts.excerpt_schema(pending, max_n), schema_name="excerpts",
                                       validate=_container)
        except LLMError as exc:  # keep what is valid so far; the missing attributes fail on their own
            dj.add(error=exc)
            log.warning("result %s: deep judgment excerpt retry failed: %s", job.result_id, exc)
            break
        dj.add(reply)
        last_text = reply.text
        for name, entries in entries_by_attribute(reply.parsed, pending).items():
            new_valid, failed[name], note = validate_excerpts(entries, text, threshold, max_n)
            have = {e["text"] for e in valid[name]}
            valid[name] = (valid[name] + [e for e in new_valid if e["text"] not in have])[:max_n]
            if note:
                notes[name] = note
    for name in names:
        if failed[name]:
            log.info("result %s: dropped %d excerpt(s) of %r not found in the response", job.result_id,
                     len(failed[name]), name)
    missing = [n for n in names if not valid[n]]
    section.update(extracted_excerpts=valid, attributes_without_excerpts=missing,
                   deep_judgment_excerpt_retry_count=retry_count)
    stages.append("excerpts")

    # ---- optional: search-enhanced hallucination risk
    if section["deep_judgment_search_enabled"]:
        await _assess(job, llm, valid, section, stages, dj, search_tool)

    # ---- stage 2: reasoning per attribute
    reasoning_schema = {"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names}
    try:
        reply = await llm.complete(
            job.parsing,
            prompts.deep_judgment_reasoning_messages(job.question_text, attrs, valid, notes, opts,
                                                     job.parsing.system_prompt),
            stage="deep_judgment_reasoning", response_schema=reasoning_schema, schema_name="reasoning",
            validate=_object,
        )
    except LLMError as exc:
        dj.add(error=exc)
        return finish(exc)
    dj.add(reply)
    reasoning = {n: _reasoning_text(reply.parsed[n]) for n in names if n in reply.parsed}
    section["attribute_reasoning"] = reasoning
    stages.append("reasoning")

    # ---- stage 3: parameters (the structured parse, informed by the evidence)
    schema = info.json_schema or {}
    try:
        reply = await llm.complete(
            job.parsing,
            prompts.deep_judgment_parameters_messages(job.question_text, text, schema, valid, reasoning, opts,
                                                      job.parsing.system_prompt),
            stage="parsing", response_schema=schema, schema_name=info.class_name or "Answer", validate=validate,
        )
    except LLMError as exc:
        parse_calls.add(error=exc)
        return finish(exc)
    parse_calls.add(reply)
    stages.append("parameters")
    section["deep_judgment_performed"] = True
    outcome.parsed = reply.parsed
    return finish()


async def _assess(job: Job, llm: LLMClient, valid: dict[str, list[dict[str, Any]]], section: dict[str, Any],
                  stages: list[str], dj: _Calls, search_tool: SearchTool | None) -> None:
    """Search every quote, then one judge call rating each quote's hallucination risk."""
    name = str(job.options.get("deep_judgment_search_tool") or "local")
    try:
        tool = search_tool or get_search_tool(name)
    except SearchToolError as exc:
        log.warning("result %s: deep judgment search skipped: %s", job.result_id, exc)
        return
    items = [(attr, ex) for attr, exs in valid.items() for ex in exs]
    if not await attach_search_results(tool, [ex for _a, ex in items]):
        return
    if items:
        dj.count += 1
        reply = await assess_hallucination(llm, job.parsing, job.question_text, items, job.options,
                                           stage="deep_judgment_hallucination")
        if reply is None:
            return
        entry = usage_entry(reply)
        dj.usage = add_usage(dj.usage, entry) if dj.usage else entry
        stages.append("excerpt_hallucination_assessment")
    section["hallucination_risk_assessment"] = {
        attr: max_risk([ex["hallucination_risk"] for ex in exs if "hallucination_risk" in ex])
        for attr, exs in valid.items()
    }
