"""RubricEvaluation and DeepJudgmentRubricAutoFail (spec/003 stages 11-12).

Stage 11 scores LLM, regex, callable and metric traits on the evaluation input. Non-fatal: a
failing trait records its error in `trait_errors` and the other traits still score.
- Dynamic rubrics: a rubric wire dict may carry `"dynamic_traits"` (trait dicts like `"traits"`).
  One batched judge call decides which concepts the response engages with; present ones are
  evaluated like static traits (`dynamic_rubric_promoted_traits`), absent ones are listed with the
  judge's reason in `dynamic_rubric_skipped_traits`. A concept the judge does not mention counts
  as present (the prompt's own rule: skipping a relevant evaluation is worse). A dynamic trait
  whose name clashes with a static one, or that does not validate, is an error for that trait
  (`trait_errors["dynamic:<name>"]` and a skip reason), never for the rubric. If the presence
  call fails, every dynamic trait is skipped with that reason.
- Deep judgment (`deep_judgment_rubric_mode`, see services/rubric/deep_judgment.py): deep-judged
  LLM traits get excerpts -> reasoning -> score; their scores also appear in `llm_trait_scores`,
  the other LLM traits' in `deep_judgment_rubric.standard_rubric_scores`.
- The judge's batch reply may be the asked-for `{trait: value}` or the reference's
  `{"scores": {trait: value}}`; a one-trait call may answer `{"result": v}` / `{"score": v}`.

Stage 12 (DeepJudgmentRubricAutoFail): deep judgment ran and some traits have no valid excerpt
(and no abstention) -> `signals.dj_rubric_autofail`, which the fold turns into verify_result
False. Both stages record their status in `state.stages`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from services.rubric.deep_judgment import evaluate_dj_traits, resolve_trait_configs
from shared.core import prompts
from shared.core.events import Job, State
from shared.core.rubric import AnyTrait, Rubric
from shared.core.stage import SANDBOX_SCOPE, evaluation_text, record
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import LLMError, add_usage, usage_entry
from shared.runtime.search import SearchTool
from shared.templates.calls import run_callable_trait, run_regex_trait

log = logging.getLogger("veribus.rubric")
STAGE = "rubric_evaluation"
AUTOFAIL_STAGE = "deep_judgment_rubric_autofail"
_SINGLE_KEYS = ("result", "score", "label", "value")


def _llm_trait_schema(trait: Any) -> dict[str, Any]:
    if trait.kind == "boolean":
        return {"type": "boolean", "description": trait.description or trait.name}
    if trait.kind == "literal":
        return {"type": "string", "enum": list(_classes(trait)), "description": trait.description or trait.name}
    return {
        "type": "integer", "minimum": trait.min_score, "maximum": trait.max_score,
        "description": trait.description or trait.name,
    }


def _classes(trait: Any) -> list[str]:
    classes = trait.classes or []
    return list(classes.keys()) if isinstance(classes, dict) else list(classes)


def _coerce(trait: Any, value: Any) -> tuple[int | bool, str | None]:
    """Judge value -> (score, label for literal traits); raises ValueError on a wrong type."""
    if trait.kind == "boolean":
        if isinstance(value, bool):
            return value, None
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no"):
            return value.strip().lower() in ("true", "yes"), None
        raise ValueError(f"trait {trait.name!r}: expected true/false, got {value!r}")
    if trait.kind == "literal":
        classes = _classes(trait)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(classes):
            return value, classes[value]
        if isinstance(value, str):
            for i, c in enumerate(classes):
                if c.lower() == value.strip().lower():
                    return i, c
        raise ValueError(f"trait {trait.name!r}: {value!r} is not one of {classes}")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"trait {trait.name!r}: expected an integer score, got {value!r}")
    score = int(round(float(value)))
    lo, hi = trait.min_score, trait.max_score
    return max(lo, min(hi, score)) if lo is not None and hi is not None else score, None


async def _llm_traits(job: Job, text: str, traits: list[Any], llm: LLMClient, out: dict[str, Any]) -> None:
    strategy = job.options.get("rubric_evaluation_strategy", "batch")
    groups = [traits] if strategy == "batch" else [[t] for t in traits]

    async def run_group(group: list[Any]) -> None:
        schema = {
            "type": "object",
            "properties": {t.name: _llm_trait_schema(t) for t in group},
            "required": [t.name for t in group],
            "additionalProperties": False,
        }
        msgs = prompts.rubric_messages(job.question_text, text, group, schema, job.options)
        try:
            reply = await llm.complete(job.parsing, msgs, stage="rubric_evaluation", response_schema=schema,
                                       schema_name="rubric", validate=_is_object)
        except LLMError as exc:
            for t in group:
                out["errors"][t.name] = str(exc)
            return
        out["usage"] = add_usage(out["usage"], usage_entry(reply)) if out["usage"] else usage_entry(reply)
        values = _trait_values(reply.parsed, group)
        for t in group:
            try:
                if t.name not in values:
                    raise ValueError(f"trait {t.name!r}: judge returned no value")
                score, label = _coerce(t, values[t.name])
                out["llm"][t.name] = score
                if label is not None:
                    out["labels"][t.name] = label
            except ValueError as exc:
                out["errors"][t.name] = str(exc)

    await asyncio.gather(*(run_group(g) for g in groups))


def _trait_values(parsed: dict[str, Any], group: list[Any]) -> dict[str, Any]:
    """Trait name -> judge value, from `{trait: v}`, the reference's `{"scores": {trait: v}}` and
    `{"classifications": [{"trait_name", "class_name"}]}` (literal traits), or (one trait) `{"result": v}`."""
    names = {t.name for t in group}
    if names & parsed.keys():
        return parsed
    scores = parsed.get("scores")
    classified = parsed.get("classifications")
    if isinstance(scores, dict) or isinstance(classified, list | dict):
        out = dict(scores) if isinstance(scores, dict) else {}
        if isinstance(classified, dict):
            out.update(classified)
        elif isinstance(classified, list):
            for item in classified:
                if isinstance(item, dict) and "trait_name" in item:
                    out[str(item["trait_name"])] = item.get("class_name")
        return out
    if len(group) == 1:
        for key in _SINGLE_KEYS:
            if key in parsed:
                return {group[0].name: parsed[key]}
    return parsed


def _is_object(obj: Any) -> Any:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object keyed by trait name")
    return obj


def _metrics(tp: int, fp: int, fn: int, tn: int | None, wanted: list[str]) -> dict[str, float]:
    def div(a: float, b: float) -> float:
        return round(a / b, 6) if b else 0.0

    vals: dict[str, float] = {"tp": float(tp), "fp": float(fp), "fn": float(fn)}
    if tn is not None:
        vals["tn"] = float(tn)
    precision, recall = div(tp, tp + fp), div(tp, tp + fn)
    all_metrics = {
        "precision": precision,
        "recall": recall,
        "f1": div(2 * precision * recall, precision + recall),
    }
    if tn is not None:
        all_metrics["specificity"] = div(tn, tn + fp)
        all_metrics["accuracy"] = div(tp + tn, tp + tn + fp + fn)
    for m in wanted or ["precision", "recall", "f1"]:
        if m in all_metrics:
            vals[m] = all_metrics[m]
    return vals


def _as_list(value: Any) -> list[str]:
    if not isinstance(value, list):
        return []
    out: list[str] = []
    for x in value:
        text = str(x).strip()
        if text and text not in out:
            out.append(text)
    return out


def confusion_from_reply(trait: Any, parsed: dict[str, Any]) -> dict[str, list[str]]:
    """The judge's tp/fn/fp/tn lists (tp and fp as found in the answer, fn and tn as instruction
    content), as the reference records them; tn is empty in tp_only mode. Our older shape
    `{"found": [...], "extra_items": [...]}` is still read: found instructions count as tp, the
    rest of the instructions as fn, extra items as fp."""
    full = trait.evaluation_mode == "full_matrix"
    if any(k in parsed for k in ("tp", "fn", "fp", "tn")):
        return {"tp": _as_list(parsed.get("tp")), "fn": _as_list(parsed.get("fn")),
                "fp": _as_list(parsed.get("fp")), "tn": _as_list(parsed.get("tn")) if full else []}
    expected = list(trait.tp_instructions or [])
    negatives = list(trait.tn_instructions or []) if full else []
    found = {x.lower() for x in _as_list(parsed.get("found"))}
    return {
        "tp": [i for i in expected if i.lower() in found],
        "fn": [i for i in expected if i.lower() not in found],
        "fp": [i for i in negatives if i.lower() in found] if full else _as_list(parsed.get("extra_items")),
        "tn": [i for i in negatives if i.lower() not in found],
    }


def _is_confusion_reply(obj: Any) -> Any:
    obj = _is_object(obj)
    if not any(k in obj for k in ("tp", "fn", "fp", "tn", "found")):
        raise ValueError("expected the confusion lists tp, fn, fp (and tn in full-matrix mode)")
    return obj


async def _metric_trait(job: Job, text: str, trait: Any, llm: LLMClient, out: dict[str, Any]) -> None:
    full = trait.evaluation_mode == "full_matrix"
    schema = prompts.metric_schema(full)
    msgs = prompts.metric_messages(job.question_text, text, trait, job.options)
    try:
        reply = await llm.complete(job.parsing, msgs, stage="rubric_evaluation", response_schema=schema,
                                   schema_name="metric", validate=_is_confusion_reply)
    except LLMError as exc:
        out["errors"][trait.name] = str(exc)
        return
    out["usage"] = add_usage(out["usage"], usage_entry(reply)) if out["usage"] else usage_entry(reply)
    lists = confusion_from_reply(trait, reply.parsed)
    out["metric"][trait.name] = _metrics(len(lists["tp"]), len(lists["fp"]), len(lists["fn"]),
                                         len(lists["tn"]) if full else None, list(trait.metrics or []))
    out["confusion"][trait.name] = lists


async def evaluate_rubric(job: Job, state: State, llm: LLMClient, search_tool: SearchTool | None = None) -> State:
    """Stages 11-12: RubricEvaluation and DeepJudgmentRubricAutoFail.

    Requires: `job.rubric` (static and dynamic traits), `evaluation_text(state)`, signals
    `trace_validation_failed` and `abstention`, `job.options` (`rubric_*`, deep judgment).
    Produces: `rubric` (llm, regex, callable and metric trait scores, labels, dynamic trait
    outcome), `deep_judgment_rubric`, `usage["rubric_evaluation"]`, signal
    `dj_rubric_autofail` (the fold fails the result on it); two stage records.
    Calls: `llm.complete` for LLM and metric traits and dynamic presence checks; the template
    sandbox for callable traits; `search_tool` (default: the registry lookup of
    `deep_judgment_search_tool`) for deep-judged traits.
    """
    t = time.time()
    if state.error:
        record(state, STAGE, "skipped", t, "upstream error")
        record(state, AUTOFAIL_STAGE, "skipped", t, "upstream error")
        return state
    rubric = Rubric.from_wire(job.rubric) if job.rubric else Rubric()
    dynamic_raw = (job.rubric or {}).get("dynamic_traits") or []
    if rubric.is_empty() and not dynamic_raw:
        record(state, STAGE, "skipped", t, "no rubric traits")
        record(state, AUTOFAIL_STAGE, "skipped", t, "no rubric traits")
        return state
    use_full = bool(job.options.get("use_full_trace_for_rubric", True))
    if state.signals.trace_validation_failed and not use_full:
        why = "trace validation failed and use_full_trace_for_rubric is false"
        record(state, STAGE, "skipped", t, why)
        record(state, AUTOFAIL_STAGE, "skipped", t, why)
        return state

    text = evaluation_text(state, use_full)
    out: dict[str, Any] = {"llm": {}, "labels": {}, "errors": {}, "metric": {}, "confusion": {}, "usage": {}}
    promoted: list[str] | None = None
    skipped: dict[str, str] | None = None
    if dynamic_raw:
        rubric, promoted, skipped = await _resolve_dynamic(job, state, text, rubric, dynamic_raw, llm, out)
    has = {"llm": bool(rubric.llm_traits), "regex": bool(rubric.regex_traits),
           "callable": bool(rubric.callable_traits), "metric": bool(rubric.metric_traits)}
    # traits the checkpoint could not define completely fail on their own, before any scoring
    for trait in rubric.all_traits():
        if trait.load_error:
            out["errors"][trait.name] = f"trait not evaluable: {trait.load_error}"
    dj_configs, dj_config_errors = resolve_trait_configs(
        job.options, [lt for lt in rubric.llm_traits if lt.name not in out["errors"]], job.question_id)
    out["errors"].update(dj_config_errors)
    broken = set(out["errors"])
    rubric = rubric.model_copy(update={
        "llm_traits": [t for t in rubric.llm_traits if t.name not in broken],
        "regex_traits": [t for t in rubric.regex_traits if t.name not in broken],
        "callable_traits": [t for t in rubric.callable_traits if t.name not in broken],
        "metric_traits": [t for t in rubric.metric_traits if t.name not in broken],
    })
    dj_traits = [lt for lt in rubric.llm_traits if lt.name in dj_configs]
    std_traits = [lt for lt in rubric.llm_traits if lt.name not in dj_configs]
    regex_scores: dict[str, bool] = {}
    for rt in rubric.regex_traits:  # in the sandbox: a pattern can backtrack for hours
        try:
            regex_scores[rt.name] = await run_regex_trait(rt.pattern, text, rt.case_sensitive, rt.invert_result,
                                                          scope=SANDBOX_SCOPE.get(),
                                                          timeout_s=job.options.get("template_timeout_s"))
        except Exception as exc:  # a bad pattern fails only its own trait
            out["errors"][rt.name] = f"{type(exc).__name__}: {exc}"
    callable_scores: dict[str, bool | int] = {}

    async def run_callable(ct: Any) -> None:
        try:
            if not ct.callable_code:
                raise ValueError(f"callable trait {ct.name!r} has no callable_code")
            value = await run_callable_trait(ct.callable_code, text, ct.kind, scope=SANDBOX_SCOPE.get(),
                                             timeout_s=job.options.get("template_timeout_s"))
            if getattr(ct, "invert_result", False) and isinstance(value, bool):
                value = not value
            callable_scores[ct.name] = value
        except Exception as exc:
            out["errors"][ct.name] = f"{type(exc).__name__}: {exc}"

    dj_out: list[Any] = []

    async def run_dj() -> None:
        dj_out.append(await evaluate_dj_traits(job, text, dj_traits, dj_configs, llm, _coerce, search_tool))

    await asyncio.gather(
        *(run_callable(ct) for ct in rubric.callable_traits),
        *([_llm_traits(job, text, std_traits, llm, out)] if std_traits else []),
        *(_metric_trait(job, text, mt, llm, out) for mt in rubric.metric_traits),
        *([run_dj()] if dj_traits else []),
    )
    if dj_out:
        dj = dj_out[0]
        dj.section["standard_rubric_scores"] = {lt.name: out["llm"][lt.name] for lt in std_traits
                                                if lt.name in out["llm"]} if std_traits else None
        out["llm"].update(dj.scores)
        out["labels"].update(dj.labels)
        out["errors"].update(dj.errors)
        state.deep_judgment_rubric = dj.section
        if dj.usage:
            state.usage["deep_judgment_rubric"] = dj.usage
    state.rubric = {
        "rubric_evaluation_performed": True,
        "rubric_evaluation_strategy": job.options.get("rubric_evaluation_strategy", "batch"),
        "llm_trait_scores": out["llm"] if rubric.llm_traits or has["llm"] else None,
        "llm_trait_labels": out["labels"] or None,
        "regex_trait_scores": regex_scores if rubric.regex_traits or has["regex"] else None,
        "callable_trait_scores": callable_scores if rubric.callable_traits or has["callable"] else None,
        "metric_trait_scores": out["metric"] if rubric.metric_traits or has["metric"] else None,
        "metric_trait_confusion_lists": out["confusion"] if rubric.metric_traits or has["metric"] else None,
        "trait_errors": out["errors"] or None,
        "trait_provenance": trait_provenance(job.rubric, promoted),
        "dynamic_rubric_promoted_traits": promoted,
        "dynamic_rubric_skipped_traits": skipped,
    }
    if out["usage"]:
        state.usage["rubric_evaluation"] = out["usage"]
    if out["errors"]:
        log.warning("result %s: %d rubric trait(s) failed: %s", job.result_id, len(out["errors"]), out["errors"])
    record(state, STAGE, "performed", t, f"{len(out['errors'])} trait error(s)" if out["errors"] else "")
    deep_judgment_rubric_autofail(job, state)
    return state


def trait_provenance(wire: dict[str, Any] | None, promoted: list[str] | None) -> dict[str, str] | None:
    """Where each of the job's traits came from (failed ones included): `global` (the benchmark's
    rubric), `question_specific` (the question's own), or `dynamic` (promoted by the presence
    check). The plan records the global names on the wire (`provenance`); the rest are the question's."""
    given = (wire or {}).get("provenance") or {}
    names = [str(t.get("name")) for t in (wire or {}).get("traits") or [] if isinstance(t, dict) and t.get("name")]
    out = {n: str(given.get(n, "question_specific")) for n in names}
    out.update({n: "dynamic" for n in promoted or []})
    return out or None


def _presence_verdicts(parsed: Any) -> dict[str, tuple[bool, str]]:
    """Trait name -> (present, reasoning) from `{"results": [...]}`, a bare list, or `{name: bool}`."""
    items = parsed.get("results") if isinstance(parsed, dict) and "results" in parsed else parsed
    out: dict[str, tuple[bool, str]] = {}
    if isinstance(items, list):
        for it in items:
            if isinstance(it, dict) and (it.get("trait_name") or it.get("name")) is not None:
                present = it.get("present", True)
                if isinstance(present, str):
                    present = present.strip().lower() not in ("false", "no", "absent")
                out[str(it.get("trait_name") or it.get("name"))] = (bool(present), str(it.get("reasoning") or ""))
    elif isinstance(items, dict):
        for name, value in items.items():
            if isinstance(value, bool):
                out[str(name)] = (value, "")
            elif isinstance(value, dict) and "present" in value:
                out[str(name)] = (bool(value["present"]), str(value.get("reasoning") or ""))
    return out


async def _resolve_dynamic(job: Job, state: State, text: str, static: Rubric, raw_traits: Any, llm: LLMClient,
                           out: dict[str, Any]) -> tuple[Rubric, list[str], dict[str, str]]:
    """Presence check of the dynamic traits; returns (static + promoted rubric, promoted names, skipped)."""
    skipped: dict[str, str] = {}
    static_names = set(static.trait_names())
    candidates: list[AnyTrait] = []
    if not isinstance(raw_traits, list):
        raw_traits = [raw_traits]
    for i, raw in enumerate(raw_traits):
        label = str(raw.get("name") or f"dynamic_traits[{i}]") if isinstance(raw, dict) else f"dynamic_traits[{i}]"
        try:
            trait = Rubric.from_wire({"traits": [raw]}).all_traits()[0]
        except ValueError as exc:  # RubricError, pydantic ValidationError
            out["errors"][f"dynamic:{label}"] = f"invalid dynamic trait: {exc}"[:1000]
            skipped[label] = "error: invalid trait definition"
            continue
        if trait.name in static_names or any(c.name == trait.name for c in candidates):
            where = "a static rubric trait" if trait.name in static_names else "another dynamic trait"
            out["errors"][f"dynamic:{trait.name}"] = f"dynamic trait name clashes with {where}"
            skipped[trait.name] = f"error: name clashes with {where}"
            continue
        candidates.append(trait)
    if not candidates:
        return static, [], skipped
    concepts = [(c.name, c.description or c.name) for c in candidates]
    try:
        reply = await llm.complete(job.parsing, prompts.rubric_presence_messages(job.question_text, text, concepts,
                                                                                 job.options),
                                   stage="rubric_presence_check", response_schema=prompts.PRESENCE_SCHEMA,
                                   schema_name="concept_presence", validate=_presence_container)
    except LLMError as exc:
        log.warning("result %s: dynamic rubric presence check failed: %s", job.result_id, exc)
        for c in candidates:
            skipped[c.name] = f"presence check failed: {exc}"[:300]
        return static, [], skipped
    state.usage["rubric_presence_check"] = usage_entry(reply)
    verdicts = _presence_verdicts(reply.parsed)
    promoted: list[AnyTrait] = []
    for c in candidates:
        present, why = verdicts.get(c.name, (True, ""))
        if present:
            promoted.append(c)
        else:
            skipped[c.name] = f"concept not present: {why}" if why else "concept not present"
    merged = static.merge(Rubric.from_traits(promoted)) if promoted else static
    return merged, [c.name for c in promoted], skipped


def _presence_container(obj: Any) -> Any:
    if not isinstance(obj, dict | list):
        raise ValueError('expected {"results": [{"trait_name", "present", "reasoning"}]}')
    return obj


def deep_judgment_rubric_autofail(job: Job, state: State) -> None:
    """Stage 12: deep-judged traits without a valid excerpt fail the result (via the fold)."""
    t = time.time()
    dj = state.deep_judgment_rubric
    if not dj or not dj.get("deep_judgment_rubric_performed"):
        record(state, AUTOFAIL_STAGE, "skipped", t, "deep judgment rubric not performed")
    elif state.signals.abstention:
        record(state, AUTOFAIL_STAGE, "skipped", t, "abstention detected")
    elif not dj.get("traits_without_valid_excerpts"):
        record(state, AUTOFAIL_STAGE, "skipped", t, "no traits missing excerpts")
    else:
        missing = list(dj["traits_without_valid_excerpts"])
        meta = dj.get("trait_metadata") or {}
        state.signals.dj_rubric_autofail = True
        log.warning("result %s: deep judgment rubric auto-fail: no valid excerpts for %s -> verify_result=False",
                    job.result_id, ", ".join(f"{n} ({meta.get(n, {}).get('excerpt_retry_count', 0)} retries)"
                                             for n in missing))
        record(state, AUTOFAIL_STAGE, "performed", t, f"no valid excerpts for {', '.join(missing)}"[:300])
