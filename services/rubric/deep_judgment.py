"""Deep judgment for rubric LLM traits (spec/003 stage 11) and its per-trait configuration.

Which traits, and with which settings (`resolve_trait_configs`, by `deep_judgment_rubric_mode`):
- `disabled`: none (the default; nothing here runs).
- `enable_all`: every LLM trait, with the run's defaults: excerpts on, at most
  `RUBRIC_MAX_EXCERPTS_DEFAULT` (7, the reference's rubric default) excerpts, the run's
  `deep_judgment_fuzzy_match_threshold` / `deep_judgment_excerpt_retry_attempts`, search when
  `deep_judgment_search_enabled`.
- `use_checkpoint`: the traits' own `deep_judgment_*` fields (None -> the defaults above).
- `custom`: `deep_judgment_rubric_config = {"traits": {name: {enabled, excerpt_enabled,
  max_excerpts, fuzzy_match_threshold, excerpt_retry_attempts, search_enabled}}}`; the
  reference's layout (`"global"` instead of `"traits"`, plus `"question_specific": {question_id:
  {name: {...}}}`, which wins) is read too. A trait not named is not deep-judged. An invalid
  entry is an error for that trait only (recorded in `trait_errors`).

Per trait (`evaluate_dj_traits`; traits run concurrently, the reference runs them one by one):
1. excerpts (when excerpt_enabled): verbatim quotes bearing on the trait, validated with THE
   fuzzy rule of `shared.runtime.search` (the one template deep judgment uses); when none is valid the
   judge is told which quotes failed (with scores) and asked again, up to excerpt_retry_attempts.
   Still none -> the trait is not scored and is listed in `traits_without_valid_excerpts`
   (DeepJudgmentRubricAutoFail then fails the result).
   - search_enabled: quotes are searched and the judge rates their hallucination risk in ONE
     call per trait (the reference: one call per quote); overall risk = the highest.
2. reasoning: free text, from the quotes (or the whole response when excerpts are off).
3. score: the trait's value as the reasoning concludes (boolean / score in range / literal class).
A judge call that fails for good (outage, unusable output) is an error of that trait, not an
excerpt failure: infrastructure trouble must not be reported as an ungrounded score.
Usage of all of it goes under usage key "deep_judgment_rubric".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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

log = logging.getLogger("veribus.rubric.deep_judgment")

RUBRIC_MAX_EXCERPTS_DEFAULT = 7
MODES = ("disabled", "enable_all", "use_checkpoint", "custom")


@dataclass(frozen=True)
class TraitDJConfig:
    """Resolved deep-judgment settings of one trait."""

    excerpt_enabled: bool = True
    max_excerpts: int = RUBRIC_MAX_EXCERPTS_DEFAULT
    fuzzy_match_threshold: float = 0.80
    excerpt_retry_attempts: int = 2
    search_enabled: bool = False


class _CustomEntry(BaseModel):
    """One trait's entry of `deep_judgment_rubric_config` (custom mode)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    excerpt_enabled: bool = True
    max_excerpts: int | None = Field(default=None, ge=1)
    fuzzy_match_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    excerpt_retry_attempts: int | None = Field(default=None, ge=0)
    search_enabled: bool = False


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def resolve_trait_configs(
    options: dict[str, Any], traits: list[Any], question_id: str
) -> tuple[dict[str, TraitDJConfig], dict[str, str]]:
    """(deep-judged trait name -> settings, trait name -> configuration error) for the LLM traits."""
    mode = options.get("deep_judgment_rubric_mode") or "disabled"
    if mode == "disabled" or not traits:
        return {}, {}
    fuzzy = float(options.get("deep_judgment_fuzzy_match_threshold", 0.80))
    retries = int(options.get("deep_judgment_excerpt_retry_attempts", 2))
    configs: dict[str, TraitDJConfig] = {}
    errors: dict[str, str] = {}
    if mode == "enable_all":
        search = bool(options.get("deep_judgment_search_enabled", False))
        for t in traits:
            configs[t.name] = TraitDJConfig(True, RUBRIC_MAX_EXCERPTS_DEFAULT, fuzzy, retries, search)
    elif mode == "use_checkpoint":
        for t in traits:
            if t.deep_judgment_enabled:
                configs[t.name] = TraitDJConfig(
                    t.deep_judgment_excerpt_enabled, _pick(t.deep_judgment_max_excerpts, RUBRIC_MAX_EXCERPTS_DEFAULT),
                    _pick(t.deep_judgment_fuzzy_match_threshold, fuzzy),
                    _pick(t.deep_judgment_excerpt_retry_attempts, retries), t.deep_judgment_search_enabled,
                )
    elif mode == "custom":
        cfg = options.get("deep_judgment_rubric_config") or {}
        per_question = ((cfg.get("question_specific") or {}).get(question_id) or {}) if isinstance(cfg, dict) else {}
        general = {**(cfg.get("global") or {}), **(cfg.get("traits") or {})} if isinstance(cfg, dict) else {}
        for t in traits:
            raw = per_question.get(t.name, general.get(t.name))
            if raw is None:
                continue
            try:
                entry = _CustomEntry.model_validate(raw)
            except ValidationError as exc:
                errors[t.name] = f"invalid deep_judgment_rubric_config entry: {exc.errors()[0].get('msg', exc)}"
                continue
            if entry.enabled:
                configs[t.name] = TraitDJConfig(
                    entry.excerpt_enabled, _pick(entry.max_excerpts, RUBRIC_MAX_EXCERPTS_DEFAULT),
                    _pick(entry.fuzzy_match_threshold, fuzzy), _pick(entry.excerpt_retry_attempts, retries),
                    entry.search_enabled,
                )
    else:
        raise ValueError(f"deep_judgment_rubric_mode must be one of {MODES}, got {mode!r}")
    return configs, errors


@dataclass
class TraitOutcome:
    name: str
    metadata: dict[str, Any]
    score: int | bool | None = None
    label: str | None = None
    reasoning: str | None = None
    excerpts: list[dict[str, Any]] | None = None
    risk: dict[str, Any] | None = None
    no_valid_excerpts: bool = False
    error: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)


@dataclass
class DJRubricOutcome:
    """What deep judgment found for the rubric's deep-judged traits."""

    section: dict[str, Any]
    scores: dict[str, int | bool]
    labels: dict[str, str]
    errors: dict[str, str]
    usage: dict[str, Any]


def _container(obj: Any) -> Any:
    if not isinstance(obj, dict | list):
        raise ValueError("expected a JSON object")
    return obj


def _criteria(trait: Any) -> str:
    text = trait.description or trait.name
    if trait.kind == "literal":
        text += "\nClasses: " + "; ".join(f"{k}: {v}" for k, v in (trait.classes or {}).items())
    return text


def _score_schema(trait: Any) -> tuple[dict[str, Any], str]:
    if trait.kind == "boolean":
        prop, kind = {"type": "boolean"}, "boolean (true/false)"
        key = "result"
    elif trait.kind == "literal":
        names = trait.class_names()
        prop, kind, key = {"type": "string", "enum": names}, "one of: " + ", ".join(names), "label"
    else:
        prop = {"type": "integer", "minimum": trait.min_score, "maximum": trait.max_score}
        kind, key = f"integer score from {trait.min_score} to {trait.max_score}", "score"
    return {"type": "object", "properties": {key: prop}, "required": [key], "additionalProperties": False}, kind


def _score_value(parsed: Any, trait: Any) -> Any:
    """The value in a score reply: {"result"|"score"|"label"|"value"|<trait name>: v}, a lone key, or a bare value."""
    if not isinstance(parsed, dict):
        return parsed
    for key in ("result", "score", "label", "value", "class", trait.name):
        if key in parsed:
            return parsed[key]
    if len(parsed) == 1:
        return next(iter(parsed.values()))
    raise ValueError(f"trait {trait.name!r}: the judge returned no score")


class _Tracker:
    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = meta
        self.usage: dict[str, Any] = {}

    def add(self, reply: LLMReply | None = None, error: LLMError | None = None) -> None:
        self.meta["model_calls"] += 1
        entry = usage_entry(reply) if reply is not None else (dict(error.usage) if error and error.usage else {})
        if entry:
            self.usage = add_usage(self.usage, entry) if self.usage else entry


async def _evaluate_trait(
    job: Job, text: str, trait: Any, cfg: TraitDJConfig, llm: LLMClient, coerce: Callable[[Any, Any], tuple[Any, Any]],
    search_tool: SearchTool | None,
) -> TraitOutcome:
    meta: dict[str, Any] = {"stages_completed": [], "model_calls": 0, "had_excerpts": cfg.excerpt_enabled,
                            "excerpt_retry_count": 0, "excerpt_validation_failed": False}
    out = TraitOutcome(trait.name, meta)
    calls = _Tracker(meta)
    criteria = _criteria(trait)

    def fail(exc: Exception) -> TraitOutcome:
        out.error = f"deep judgment: {exc}"[:1000]
        meta["error"] = out.error
        out.usage = calls.usage
        return out

    excerpts: list[dict[str, Any]] | None = None
    if cfg.excerpt_enabled:
        convo = prompts.rubric_trait_excerpt_messages(job.question_text, text, trait.name, criteria,
                                                      cfg.max_excerpts, job.options)
        valid: list[dict[str, Any]] = []
        for attempt in range(cfg.excerpt_retry_attempts + 1):
            try:
                reply = await llm.complete(job.parsing, convo, stage="deep_judgment_rubric_excerpts",
                                           response_schema=prompts.TRAIT_EXCERPT_SCHEMA, schema_name="trait_excerpts",
                                           validate=_container)
            except LLMError as exc:
                calls.add(error=exc)
                return fail(exc)
            calls.add(reply)
            entries = reply.parsed.get("excerpts") if isinstance(reply.parsed, dict) else reply.parsed
            valid, failed, _note = validate_excerpts(entries or [], text, cfg.fuzzy_match_threshold, cfg.max_excerpts)
            if valid or attempt == cfg.excerpt_retry_attempts:
                break
            meta["excerpt_retry_count"] += 1
            feedback = (prompts.excerpt_retry_feedback({trait.name: failed}, cfg.fuzzy_match_threshold,
                                                       f"evidence for the trait {trait.name}")
                        if failed else "You returned no excerpts. Quote at least one exact passage of the response "
                                       "that bears on the trait (supporting or contradicting it). JSON only.")
            convo = convo + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": feedback}]
        if not valid:
            meta["excerpt_validation_failed"] = True
            out.no_valid_excerpts = True
            out.usage = calls.usage
            log.warning("result %s: rubric trait %r has no valid excerpt after %d retr%s", job.result_id, trait.name,
                        meta["excerpt_retry_count"], "y" if meta["excerpt_retry_count"] == 1 else "ies")
            return out
        excerpts = out.excerpts = valid
        meta["stages_completed"].append("excerpt_extraction")
        if cfg.search_enabled:
            await _assess(job, llm, trait.name, excerpts, out, calls, search_tool)

    try:
        reply = await llm.complete(
            job.parsing,
            prompts.rubric_trait_reasoning_messages(job.question_text, None if excerpts is not None else text,
                                                    trait.name, criteria, excerpts,
                                                    (out.risk or {}).get("overall_risk"), job.options),
            stage="deep_judgment_rubric_reasoning",
        )
    except LLMError as exc:
        calls.add(error=exc)
        return fail(exc)
    calls.add(reply)
    out.reasoning = reply.text.strip()
    meta["stages_completed"].append("reasoning_generation")

    schema, kind_text = _score_schema(trait)
    try:
        reply = await llm.complete(
            job.parsing,
            prompts.rubric_trait_score_messages(job.question_text, trait.name, criteria, kind_text, out.reasoning,
                                                schema, job.options),
            stage="deep_judgment_rubric_score", response_schema=schema, schema_name="trait_score",
            validate=lambda obj: coerce(trait, _score_value(obj, trait)),
        )
    except LLMError as exc:
        calls.add(error=exc)
        return fail(exc)
    calls.add(reply)
    out.score, out.label = reply.parsed
    meta["stages_completed"].append("score_extraction")
    out.usage = calls.usage
    return out


async def _assess(job: Job, llm: LLMClient, trait_name: str, excerpts: list[dict[str, Any]], out: TraitOutcome,
                  calls: _Tracker, search_tool: SearchTool | None) -> None:
    name = str(job.options.get("deep_judgment_search_tool") or "local")
    try:
        tool = search_tool or get_search_tool(name)
    except SearchToolError as exc:
        log.warning("result %s: rubric deep judgment search skipped: %s", job.result_id, exc)
        return
    if not await attach_search_results(tool, excerpts):
        return
    calls.meta["model_calls"] += 1
    reply = await assess_hallucination(llm, job.parsing, job.question_text, [(trait_name, ex) for ex in excerpts],
                                       job.options, stage="deep_judgment_rubric_hallucination")
    if reply is None:
        return
    entry = usage_entry(reply)
    calls.usage = add_usage(calls.usage, entry) if calls.usage else entry
    risks = [ex["hallucination_risk"] for ex in excerpts]
    out.risk = {"overall_risk": max_risk(risks), "per_excerpt_risks": risks}
    calls.meta["stages_completed"].append("hallucination_assessment")


async def evaluate_dj_traits(
    job: Job, text: str, traits: list[Any], configs: dict[str, TraitDJConfig], llm: LLMClient,
    coerce: Callable[[Any, Any], tuple[Any, Any]], search_tool: SearchTool | None = None,
) -> DJRubricOutcome:
    """Deep-judge `traits` (all in `configs`) concurrently; `coerce(trait, value) -> (score, label)`
    turns the judge's value into the trait's score (and raises ValueError when it cannot)."""
    results = await asyncio.gather(*(
        _evaluate_trait(job, text, t, configs[t.name], llm, coerce, search_tool) for t in traits
    ))
    scores: dict[str, int | bool] = {}
    labels: dict[str, str] = {}
    errors: dict[str, str] = {}
    usage: dict[str, Any] = {}
    excerpts: dict[str, list[dict[str, Any]]] = {}
    reasoning: dict[str, str] = {}
    risks: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.usage:
            usage = add_usage(usage, r.usage) if usage else dict(r.usage)
        if r.error:
            errors[r.name] = r.error
            continue
        if r.no_valid_excerpts:
            errors[r.name] = (f"deep judgment: no valid excerpt after {r.metadata['excerpt_retry_count']} "
                              "retries; trait not scored")
            continue
        scores[r.name] = r.score  # type: ignore[assignment]
        if r.label is not None:
            labels[r.name] = r.label
        if r.reasoning is not None:
            reasoning[r.name] = r.reasoning
        if r.excerpts is not None:
            excerpts[r.name] = r.excerpts
        if r.risk is not None:
            risks[r.name] = r.risk
    section = {
        "deep_judgment_rubric_performed": True,
        "extracted_rubric_excerpts": excerpts or None,
        "rubric_trait_reasoning": reasoning or None,
        "deep_judgment_rubric_scores": scores,
        "trait_metadata": {r.name: r.metadata for r in results},
        "traits_without_valid_excerpts": [r.name for r in results if r.no_valid_excerpts],
        "rubric_hallucination_risk_assessment": risks or None,
        "total_deep_judgment_model_calls": sum(r.metadata["model_calls"] for r in results),
        "total_traits_evaluated": len(results),
        "total_excerpt_retries": sum(r.metadata["excerpt_retry_count"] for r in results),
    }
    return DJRubricOutcome(section=section, scores=scores, labels=labels, errors=errors, usage=usage)
