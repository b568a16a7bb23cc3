"""The reference's JSON-LD checkpoint format (`.jsonld`): read into questions, and written back."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from shared.core.benchmark.checks import check_template, validation_message
from shared.core.benchmark.question import BenchmarkError, Question, first_words
from shared.core.ids import question_id_for
from shared.core.rubric import (
    CallableTrait,
    LLMRubricTrait,
    MetricRubricTrait,
    RegexTrait,
    Rubric,
)

Parsed = tuple[dict[str, Any], list[Question]]  # Benchmark keyword arguments, questions


JSONLD_CONTEXT: dict[str, Any] = {
    "@version": 1.1,
    "@vocab": "https://schema.org/",
    "karenina": "urn:karenina:vocab:",
    "dataFeedElement": {"@id": "dataFeedElement", "@container": "@set"},
    "item": {"@id": "item", "@type": "@id"},
    "acceptedAnswer": {"@id": "acceptedAnswer", "@type": "@id"},
    "rating": {"@id": "contentRating", "@container": "@set"},
    "additionalProperty": {"@id": "additionalProperty", "@container": "@set"},
    "keywords": {"@id": "keywords", "@container": "@set"},
}
FORMAT_VERSION = "3.0.0-jsonld"


_TRAIT_KINDS = {  # additionalType (without scope prefix) -> our trait type
    "RubricTrait": "llm",
    "LLMRubricTrait": "llm",
    "RegexTrait": "regex",
    "CallableTrait": "callable",
    "MetricRubricTrait": "metric",
}
_LLM_DJ_FIELDS = (
    "deep_judgment_enabled",
    "deep_judgment_excerpt_enabled",
    "deep_judgment_max_excerpts",
    "deep_judgment_fuzzy_match_threshold",
    "deep_judgment_excerpt_retry_attempts",
    "deep_judgment_search_enabled",
)
_Q_KNOWN_PROPS = {"finished", "author", "sources", "few_shot_examples"}
def json_load(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchmarkError(
            f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}", path=str(path)
        ) from e


def looks_like_jsonld(data: Any) -> bool:
    return isinstance(data, dict) and (
        "@context" in data or data.get("@type") in ("DataFeed", "Dataset") or "dataFeedElement" in data
    )


def _props(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in node.get("additionalProperty") or []:
        if isinstance(p, dict) and isinstance(p.get("name"), str):
            out[p["name"]] = p.get("value")
    return out


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, ValueError):
            return value
    return value


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _trait_from_rating(rating: Any, path: Path, where: str, index: int) -> Any:
    if not isinstance(rating, dict):
        raise BenchmarkError(f"{path}: {where}: rating[{index}]: expected an object, got {type(rating).__name__}")
    name = rating.get("name")
    if not isinstance(name, str) or not name.strip():
        raise BenchmarkError(f"{path}: {where}: rating[{index}]: name: missing trait name", field="name")
    tlabel = f"{where}: trait {name!r}"
    additional = rating.get("additionalType")
    base = str(additional or "GlobalRubricTrait").removeprefix("karenina:")
    for scope in ("Global", "QuestionSpecific"):
        if base.startswith(scope):
            base = base[len(scope):]
            break
    kind_tag = _TRAIT_KINDS.get(base)
    if kind_tag is None:
        raise BenchmarkError(
            f"{path}: {tlabel}: additionalType: unknown or unsupported trait type {additional!r} "
            f"(supported: {', '.join(sorted(_TRAIT_KINDS))} with a Global/QuestionSpecific prefix)",
            path=str(path), field="additionalType",
        )
    props = _props(rating)
    best, worst = _num(rating.get("bestRating")), _num(rating.get("worstRating"))
    looks_boolean = best == 1 and worst == 0
    fields: dict[str, Any] = {"name": name, "description": rating.get("description")}
    model: type[BaseModel]
    if kind_tag == "llm":
        model = LLMRubricTrait
        kind = props.get("kind") or ("boolean" if looks_boolean else "score")
        fields["kind"] = kind
        if kind == "score":
            # `is not None` on purpose: a worstRating of 0 is a real lower bound
            fields["min_score"] = int(worst) if worst is not None else 1
            fields["max_score"] = int(best) if best is not None else 5
        elif kind == "literal":
            fields["classes"] = _maybe_json(props.get("classes"))
        for f in _LLM_DJ_FIELDS:
            value = props.get(f, rating.get(f))
            if value is not None:
                fields[f] = value
        fields.setdefault("deep_judgment_excerpt_enabled", False)  # the reference reader's default
        if "higher_is_better" in props:
            fields["higher_is_better"] = props["higher_is_better"]
    elif kind_tag == "regex":
        model = RegexTrait
        pattern = props.get("pattern")
        if pattern in (None, ""):
            fields["load_error"] = f"regex trait {name!r} has no pattern in the checkpoint; it cannot be evaluated"
        else:
            fields["pattern"] = pattern
        for f in ("case_sensitive", "invert_result", "higher_is_better"):
            if f in props:
                fields[f] = props[f]
    elif kind_tag == "callable":
        model = CallableTrait
        kind = props.get("kind") or ("boolean" if looks_boolean else "score")
        fields["kind"] = kind
        code = props.get("callable_code")
        if code in (None, ""):
            fields["load_error"] = (
                f"callable trait {name!r} has no callable_code in the checkpoint; it cannot be evaluated"
            )
        else:
            fields["callable_code"] = code
        if kind == "score":
            lo, hi = props.get("min_score"), props.get("max_score")
            fields["min_score"] = lo if lo is not None else (int(worst) if worst is not None else None)
            fields["max_score"] = hi if hi is not None else (int(best) if best is not None else None)
        for f in ("invert_result", "higher_is_better"):
            if f in props:
                fields[f] = props[f]
    else:
        model = MetricRubricTrait
        for f in ("metrics", "tp_instructions", "tn_instructions"):
            if f in props:
                fields[f] = _maybe_json(props[f])
        for f in ("evaluation_mode", "repeated_extraction"):
            if f in props:
                fields[f] = props[f]
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise BenchmarkError(f"{path}: {tlabel}: {validation_message(e)}", path=str(path)) from e


def _rubric_from_ratings(ratings: Any, path: Path, where: str) -> Rubric | None:
    if ratings is None:
        return None
    if not isinstance(ratings, list):
        raise BenchmarkError(f"{path}: {where}: rating: expected a list, got {type(ratings).__name__}")
    traits = [_trait_from_rating(r, path, where, i) for i, r in enumerate(ratings)]
    if not traits:
        return None
    try:
        return Rubric.from_traits(traits)
    except ValidationError as e:
        raise BenchmarkError(f"{path}: {where}: rubric: {validation_message(e)}", path=str(path)) from e


def read_jsonld(data: Any, path: Path) -> Parsed:
    if not isinstance(data, dict):
        raise BenchmarkError(f"{path}: not a JSON-LD checkpoint: top level is {type(data).__name__}, not an object")
    items = data.get("dataFeedElement", data.get("hasPart"))
    if items is None:
        raise BenchmarkError(f"{path}: not a JSON-LD checkpoint: no dataFeedElement list", field="dataFeedElement")
    if not isinstance(items, list):
        raise BenchmarkError(f"{path}: dataFeedElement: expected a list, got {type(items).__name__}")
    global_rubric = _rubric_from_ratings(data.get("rating"), path, "global rubric")
    questions = [_question_from_item(item, i, path) for i, item in enumerate(items)]
    meta: dict[str, Any] = {}
    for src, dst in (("@id", "jsonld_id"), ("creator", "creator"), ("dateCreated", "date_created"),
                     ("dateModified", "date_modified")):
        if data.get(src) is not None:
            meta[dst] = data[src]
    top_props = _props(data)
    if top_props:
        meta["properties"] = top_props
    name = data.get("name")
    return (
        {
            "name": name if isinstance(name, str) and name else path.stem,
            "description": str(data.get("description") or ""),
            "version": str(data.get("version") or "0.1.0"),
            "global_rubric": global_rubric,
            "metadata": meta,
        },
        questions,
    )


def _question_from_item(item: Any, index: int, path: Path) -> Question:
    where = f"dataFeedElement[{index}]"
    if not isinstance(item, dict):
        raise BenchmarkError(f"{path}: {where}: expected an object, got {type(item).__name__}")
    q = item.get("item")
    item_id = item.get("@id")
    if not isinstance(q, dict):
        raise BenchmarkError(
            f"{path}: {where} ({item_id or 'no @id'}): item: missing Question object", field="item"
        )
    text = q.get("text")
    if not isinstance(text, str) or not text.strip():
        raise BenchmarkError(
            f"{path}: {where} ({item_id or 'no @id'}): item.text: missing question text",
            question_id=item_id, field="text",
        )
    qid = str(item_id) if item_id else question_id_for(text)
    label = f"question {qid} ({first_words(text)!r})"
    accepted = q.get("acceptedAnswer")
    raw_answer = accepted.get("text") if isinstance(accepted, dict) else accepted
    if raw_answer is not None and not isinstance(raw_answer, str):
        raw_answer = str(raw_answer)
    part = q.get("hasPart")
    if isinstance(part, list):
        part = next((p for p in part if isinstance(p, dict)), None)
    template_raw = part.get("text") if isinstance(part, dict) else None
    template = check_template(template_raw, path, label, qid)
    keywords = q.get("keywords", item.get("keywords")) or []
    if isinstance(keywords, str):
        keywords = [k.strip() for k in keywords.split(",") if k.strip()]
    if not isinstance(keywords, list):
        raise BenchmarkError(f"{path}: {label}: keywords: expected a list of strings, got {type(keywords).__name__}",
                             question_id=qid, field="keywords")
    if not isinstance(q.get("additionalProperty") or [], list):
        raise BenchmarkError(
            f"{path}: {label}: additionalProperty: expected a list of PropertyValue objects, "
            f"got {type(q.get('additionalProperty')).__name__}", question_id=qid, field="additionalProperty")
    props = _props(q)
    few_shot = _maybe_json(props.get("few_shot_examples")) or []
    if not isinstance(few_shot, list):
        raise BenchmarkError(f"{path}: {label}: few_shot_examples: expected a list", question_id=qid)
    meta: dict[str, Any] = {}
    for src, dst in (("dateCreated", "date_created"), ("dateModified", "date_modified")):
        if item.get(src) is not None:
            meta[dst] = item[src]
    if isinstance(part, dict) and part.get("name"):
        meta["template_name"] = part["name"]
    node_ids = {
        k: v
        for k, v in (
            ("question", q.get("@id")),
            ("answer", accepted.get("@id") if isinstance(accepted, dict) else None),
            ("template", part.get("@id") if isinstance(part, dict) else None),
        )
        if v
    }
    if node_ids:
        meta["jsonld_ids"] = node_ids
    for key in ("author", "sources"):
        if props.get(key) is not None:
            meta[key] = _maybe_json(props[key])
    custom = {k.removeprefix("custom_"): v for k, v in props.items() if k.startswith("custom_")}
    if custom:
        meta["custom_metadata"] = custom
    other = {k: v for k, v in props.items() if k not in _Q_KNOWN_PROPS and not k.startswith("custom_")}
    if other:
        meta["properties"] = other
    return Question(
        id=qid,
        text=text,
        raw_answer=raw_answer,
        template_code=template,
        keywords=[str(k) for k in keywords],
        # the reference treats a question without a `finished` property as unfinished
        finished=_as_bool(props.get("finished", False)),
        rubric=_rubric_from_ratings(q.get("rating"), path, label),
        few_shot_examples=[{str(k): str(v) for k, v in ex.items()} for ex in few_shot if isinstance(ex, dict)],
        metadata=meta,
    )


def jsonld_prop(name: str, value: Any) -> dict[str, Any]:
    return {"@type": "PropertyValue", "name": name, "value": value}


def trait_to_rating(trait: Any, scope: str) -> dict[str, Any]:
    props: list[dict[str, Any]] = []
    rating: dict[str, Any] = {"@type": "Rating", "name": trait.name}
    if trait.description is not None:
        rating["description"] = trait.description
    if isinstance(trait, LLMRubricTrait):
        if trait.kind == "literal":
            atype, best, worst = "LLMRubricTrait", float(trait.max_score or 0), 0.0
            props += [jsonld_prop("kind", "literal"), jsonld_prop("classes", trait.classes)]
        else:
            atype = "RubricTrait"
            best, worst = (1.0, 0.0) if trait.kind == "boolean" else (float(trait.max_score), float(trait.min_score))
            # explicit kind: a 0..1 score trait would otherwise read back as boolean
            props.append(jsonld_prop("kind", trait.kind))
        for f in _LLM_DJ_FIELDS:
            value = getattr(trait, f)
            if value is not None:
                props.append(jsonld_prop(f, value))
        props.append(jsonld_prop("higher_is_better", trait.higher_is_better))
    elif isinstance(trait, RegexTrait):
        atype, best, worst = "RegexTrait", 1.0, 0.0
        if trait.load_error is None:
            props.append(jsonld_prop("pattern", trait.pattern))
        props += [
            jsonld_prop("case_sensitive", trait.case_sensitive),
            jsonld_prop("invert_result", trait.invert_result),
            jsonld_prop("higher_is_better", trait.higher_is_better),
        ]
    elif isinstance(trait, CallableTrait):
        atype = "CallableTrait"
        if trait.kind == "boolean":
            best, worst = 1.0, 0.0
        else:
            best = float(trait.max_score) if trait.max_score is not None else 5.0
            worst = float(trait.min_score) if trait.min_score is not None else 1.0
        if trait.callable_code:
            code = trait.callable_code
            if trait.code_format == "source":  # the reference stores base64 text
                code = base64.b64encode(code.encode("utf-8")).decode("ascii")
            props.append(jsonld_prop("callable_code", code))
        props += [
            jsonld_prop("kind", trait.kind),
            jsonld_prop("invert_result", trait.invert_result),
            jsonld_prop("higher_is_better", trait.higher_is_better),
        ]
        if trait.kind == "score":
            if trait.min_score is not None:
                props.append(jsonld_prop("min_score", trait.min_score))
            if trait.max_score is not None:
                props.append(jsonld_prop("max_score", trait.max_score))
    else:
        atype, best, worst = "MetricRubricTrait", 1.0, 0.0
        props += [
            jsonld_prop("metrics", list(trait.metrics)),
            jsonld_prop("repeated_extraction", trait.repeated_extraction),
            jsonld_prop("evaluation_mode", trait.evaluation_mode),
            jsonld_prop("tp_instructions", list(trait.tp_instructions)),
        ]
        if trait.tn_instructions:
            props.append(jsonld_prop("tn_instructions", list(trait.tn_instructions)))
    rating["bestRating"] = best
    rating["worstRating"] = worst
    rating["additionalType"] = f"karenina:{scope}{atype}"
    rating["additionalProperty"] = props
    return rating


def question_to_item(q: Question, now: str) -> dict[str, Any]:
    md = q.metadata
    ids = md.get("jsonld_ids") or {}
    question: dict[str, Any] = {"@type": "Question"}
    if ids.get("question"):
        question["@id"] = ids["question"]
    question["text"] = q.text
    answer: dict[str, Any] = {"@type": "Answer"}
    if ids.get("answer"):
        answer["@id"] = ids["answer"]
    answer["text"] = q.raw_answer if q.raw_answer is not None else ""
    question["acceptedAnswer"] = answer
    part: dict[str, Any] = {"@type": "SoftwareSourceCode"}
    if ids.get("template"):
        part["@id"] = ids["template"]
    part["name"] = md.get("template_name") or f"{first_words(q.text, 30)} Answer Template"
    part["text"] = q.template_code or ""
    part["programmingLanguage"] = "Python"
    question["hasPart"] = part
    if q.rubric is not None and not q.rubric.is_empty():
        question["rating"] = [trait_to_rating(t, "QuestionSpecific") for t in q.rubric.all_traits()]
    props = [jsonld_prop("finished", q.finished)]
    for key in ("author", "sources"):
        if md.get(key) is not None:
            value = md[key]
            props.append(jsonld_prop(key, value if isinstance(value, str) else json.dumps(value)))
    if q.few_shot_examples:
        props.append(jsonld_prop("few_shot_examples", json.dumps(q.few_shot_examples)))
    for k, v in (md.get("custom_metadata") or {}).items():
        props.append(jsonld_prop(f"custom_{k}", v))
    for k, v in (md.get("properties") or {}).items():
        props.append(jsonld_prop(k, v))
    question["additionalProperty"] = props
    if q.keywords:
        question["keywords"] = list(q.keywords)
    return {
        "@type": "DataFeedItem",
        "@id": q.id,
        "dateCreated": md.get("date_created") or now,
        "dateModified": md.get("date_modified") or now,
        "item": question,
    }
