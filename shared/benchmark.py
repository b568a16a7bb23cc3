"""Benchmarks: questions, templates and rubrics, loaded from the reference's JSON-LD checkpoints,
from our plain YAML/JSON format, or from the reference's Question,Answer CSV import.

Loading never executes user code: templates are only compiled (syntax check, with the line of
the error), callable traits only decoded. Every problem is raised as `BenchmarkError` whose
message names the file, the question (id and first words) and the field, so the CLI can refuse
a bad benchmark before anything is published.

Plain format (YAML, or JSON of the same shape):

    name: my-benchmark
    description: ...
    version: 0.1.0
    rubric:                       # global rubric (optional), grouped by trait type
      llm_traits: [{name, description, kind: boolean|score|literal, min_score, max_score, classes, ...}]
      regex_traits: [{name, description, pattern, case_sensitive, invert_result, higher_is_better}]
      callable_traits: [{name, description, kind, callable_code: <python source | base64>, ...}]
      metric_traits: [{name, evaluation_mode, metrics, tp_instructions, tn_instructions}]
      # or, equivalently, one flat list:  traits: [{type: llm|regex|callable|metric, name, ...}]
    questions:
      - id: q1                    # optional; default md5(question text)
        question: What is 2+2?
        answer: "4"               # the raw (ground-truth) answer text
        template: |               # python source; or template_file: path relative to this file
          ...
        keywords: [math]
        finished: true            # default true; unfinished questions are skipped and counted
        rubric: {...}             # question-specific traits, same shape as the global rubric
        few_shot_examples: [{question: ..., answer: ...}]
        metadata: {...}
"""

from __future__ import annotations

import ast
import base64
import csv
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.ids import question_id_for, template_id_for
from shared.rubric import (
    CallableTrait,
    LLMRubricTrait,
    MetricRubricTrait,
    RegexTrait,
    Rubric,
    RubricError,
)

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
SIMULATED_ANSWER = "Simulated answer"

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
_TOP_KEYS = {"name", "description", "version", "creator", "rubric", "questions", "metadata"}
_Q_KEYS = {
    "id", "question", "text", "answer", "raw_answer", "template", "template_file", "keywords",
    "finished", "rubric", "few_shot_examples", "metadata",
}
_RUBRIC_GROUPS: dict[str, type[BaseModel]] = {
    "llm_traits": LLMRubricTrait,
    "regex_traits": RegexTrait,
    "callable_traits": CallableTrait,
    "metric_traits": MetricRubricTrait,
}
_WIRE_TO_GROUP = {"llm": "llm_traits", "regex": "regex_traits", "callable": "callable_traits", "metric": "metric_traits"}


class BenchmarkError(Exception):
    """A benchmark that cannot be used; the message says where (file, question, field) and why."""

    def __init__(
        self, message: str, *, path: str | None = None, question_id: str | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.question_id = question_id
        self.field = field


def first_words(text: str, limit: int = 40) -> str:
    """A short, single-line preview of a question for messages."""
    one_line = " ".join(str(text).split())
    return one_line if len(one_line) <= limit else one_line[: limit - 1].rstrip() + "…"


class Question(BaseModel):
    """One benchmark question: text, ground-truth answer, template source and its own rubric."""

    model_config = ConfigDict(extra="forbid")

    id: str
    text: str
    raw_answer: str | None = None
    template_code: str | None = None
    keywords: list[str] = Field(default_factory=list)
    finished: bool = True
    rubric: Rubric | None = None
    few_shot_examples: list[dict[str, str]] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def template_id(self) -> str:
        return template_id_for(self.template_code)

    def label(self) -> str:
        """`question <id> ('<first words>')`: how messages name this question."""
        return f"question {self.id} ({first_words(self.text)!r})"


class Benchmark(BaseModel):
    """A set of questions plus a global rubric. `source` is where it was loaded from (not content)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    version: str = "0.1.0"
    questions: list[Question] = Field(default_factory=list)
    global_rubric: Rubric | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    source: Path | None = Field(default=None, exclude=True)

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> Benchmark:
        """Load by extension: .jsonld/.json (JSON-LD checkpoint or plain JSON), .yaml/.yml, .csv."""
        p = Path(path)
        if not p.exists():
            raise BenchmarkError(f"{p}: benchmark file not found", path=str(p))
        if not p.is_file():
            raise BenchmarkError(f"{p}: not a file", path=str(p))
        suffix = p.suffix.lower()
        try:
            text = p.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as e:
            raise BenchmarkError(f"{p}: not UTF-8 text (byte {e.start}): {e.reason}", path=str(p)) from e
        except OSError as e:
            raise BenchmarkError(f"{p}: cannot read: {e.strerror or e}", path=str(p)) from e
        try:
            if suffix in (".jsonld", ".json"):
                data = _json_load(text, p)
                if suffix == ".jsonld" or _looks_like_jsonld(data):
                    bench = _from_jsonld(data, p)
                else:
                    bench = _from_plain(data, p, positions=None)
            elif suffix in (".yaml", ".yml"):
                data, positions = _yaml_load(text, p)
                bench = _from_plain(data, p, positions=positions)
            elif suffix == ".csv":
                bench = _from_csv(text, p)
            else:
                raise BenchmarkError(
                    f"{p}: unsupported benchmark file type {suffix or '(none)'!r}; "
                    "expected .jsonld, .json, .yaml, .yml or .csv",
                    path=str(p),
                )
        except BenchmarkError:
            raise
        except Exception as e:  # a loader bug must still reach the user as a named, readable problem
            raise BenchmarkError(f"{p}: could not load benchmark: {type(e).__name__}: {e}", path=str(p)) from e
        bench.source = p
        bench.check_sizes()
        return bench

    def check_sizes(self) -> None:
        """Refuse questions, templates or answers over the wire limits (`shared.limits`), all of
        them named at once, before anything is published."""
        from shared.limits import question_problems

        problems = [x for q in self.questions for x in question_problems(q.id, q.text, q.template_code, q.raw_answer)]
        if problems:
            where = f"{self.source}: " if self.source else ""
            raise BenchmarkError(f"{where}refused before publishing, over the size limits:\n  " + "\n  ".join(problems),
                                 path=str(self.source) if self.source else None)

    # ---- saving --------------------------------------------------------------------------

    def save_yaml(self, path: str | Path) -> Path:
        """Write the plain format (templates as block text); `load` reads it back equal."""
        p = Path(path)
        p.write_text(
            yaml.dump(self.to_plain(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100),
            encoding="utf-8",
        )
        return p

    def save_jsonld(self, path: str | Path) -> Path:
        """Write a JSON-LD checkpoint in the reference's format (readable by karenina)."""
        p = Path(path)
        p.write_text(json.dumps(self.to_jsonld(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return p

    def to_plain(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["version"] = self.version
        if self.metadata:
            out["metadata"] = self.metadata
        if self.global_rubric is not None and not self.global_rubric.is_empty():
            out["rubric"] = _rubric_to_plain(self.global_rubric)
        qs: list[dict[str, Any]] = []
        for q in self.questions:
            d: dict[str, Any] = {"id": q.id, "question": q.text}
            if q.raw_answer is not None:
                d["answer"] = q.raw_answer
            if q.keywords:
                d["keywords"] = list(q.keywords)
            d["finished"] = q.finished
            if q.template_code is not None:
                d["template"] = q.template_code
            if q.rubric is not None and not q.rubric.is_empty():
                d["rubric"] = _rubric_to_plain(q.rubric)
            if q.few_shot_examples:
                d["few_shot_examples"] = [dict(x) for x in q.few_shot_examples]
            if q.metadata:
                d["metadata"] = q.metadata
            qs.append(d)
        out["questions"] = qs
        return out

    def to_jsonld(self) -> dict[str, Any]:
        now = datetime.now(UTC).isoformat()
        md = self.metadata
        doc: dict[str, Any] = {
            "@context": JSONLD_CONTEXT,
            "@type": "DataFeed",
            "@id": md.get("jsonld_id") or f"urn:veribus:benchmark:{question_id_for(self.name)}",
            "name": self.name,
            "description": self.description,
            "version": self.version,
            "creator": md.get("creator") or "veribus",
            "dateCreated": md.get("date_created") or now,
            "dateModified": md.get("date_modified") or now,
        }
        if self.global_rubric is not None and not self.global_rubric.is_empty():
            doc["rating"] = [_trait_to_rating(t, "Global") for t in self.global_rubric.all_traits()]
        doc["dataFeedElement"] = [_question_to_item(q, now) for q in self.questions]
        props = dict(md.get("properties") or {})
        props.setdefault("benchmark_format_version", FORMAT_VERSION)
        doc["additionalProperty"] = [_prop(k, v) for k, v in props.items()]
        return doc

    # ---- queries -------------------------------------------------------------------------

    def finished_questions(self) -> list[Question]:
        return [q for q in self.questions if q.finished]

    def unfinished_questions(self) -> list[Question]:
        return [q for q in self.questions if not q.finished]

    def get_question(self, question_id: str) -> Question:
        for q in self.questions:
            if q.id == question_id:
                return q
        raise KeyError(f"no question with id {question_id!r} in benchmark {self.name!r}")

    def question_ids(self) -> list[str]:
        return [q.id for q in self.questions]

    def rubric_for(self, question: Question) -> Rubric | None:
        """The question's effective rubric (global + its own), None when it has no traits at all."""
        base = self.global_rubric or Rubric()
        merged = base.merge(question.rubric)
        return None if merged.is_empty() else merged

    def __len__(self) -> int:
        return len(self.questions)

    def essentials(self) -> dict[str, Any]:
        """What a benchmark means, independent of file format (for round-trip comparisons)."""
        return {
            "name": self.name,
            "description": self.description,
            "version": self.version,
            "global_rubric": (self.global_rubric or Rubric()).to_wire(),
            "questions": [
                {
                    "id": q.id,
                    "text": q.text,
                    "raw_answer": q.raw_answer,
                    "template_code": q.template_code,
                    "keywords": list(q.keywords),
                    "finished": q.finished,
                    "rubric": (q.rubric or Rubric()).to_wire(),
                    "few_shot_examples": q.few_shot_examples,
                }
                for q in self.questions
            ],
        }

    def validate(self) -> list[str]:  # type: ignore[override]  # pydantic's classmethod is deprecated
        """Problems that do not stop loading but will bite at run time (empty list = none)."""
        where = str(self.source) if self.source else self.name
        problems: list[str] = []
        seen: set[str] = set()
        if not self.questions:
            problems.append(f"{where}: the benchmark has no questions")
        if self.questions and not self.finished_questions():
            problems.append(f"{where}: no question is marked finished; nothing would run")
        for t in (self.global_rubric or Rubric()).all_traits():
            problems.extend(_trait_problems(t, f"{where}: global rubric"))
        for q in self.questions:
            label = f"{where}: {q.label()}"
            if q.id in seen:
                problems.append(f"{label}: id: duplicate question id")
            seen.add(q.id)
            if not q.text.strip():
                problems.append(f"{label}: question: empty question text")
            if q.template_code is None:
                if q.finished:
                    problems.append(f"{label}: template: none (only rubric_only runs can use this question)")
            else:
                try:
                    tree = ast.parse(q.template_code, filename=f"<template {q.id}>")
                except SyntaxError as e:
                    problems.append(f"{label}: template: SyntaxError at template line {e.lineno}: {e.msg}")
                else:
                    if not any(isinstance(n, ast.ClassDef) and n.name == "Answer" for n in tree.body):
                        problems.append(f"{label}: template: defines no top-level class named Answer")
            if q.rubric is not None:
                for t in q.rubric.all_traits():
                    problems.extend(_trait_problems(t, f"{label}: rubric"))
            try:
                self.rubric_for(q)
            except RubricError as e:
                problems.append(f"{label}: rubric: {e}")
        return problems


def _trait_problems(trait: Any, where: str) -> list[str]:
    out: list[str] = []
    if trait.load_error:
        out.append(f"{where}: trait {trait.name!r}: {trait.load_error}")
    elif isinstance(trait, CallableTrait) and trait.code_format == "source":
        if not trait.function_names():
            out.append(f"{where}: trait {trait.name!r}: callable_code defines no function")
    return out


# ---- simulator script ------------------------------------------------------------------------


def template_ground_truth(template_code: str | None) -> dict[str, Any] | None:
    """The literal dict a template assigns to `self.correct`, read with `ast` (never executed)."""
    if not template_code:
        return None
    try:
        tree = ast.parse(template_code)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr == "correct"
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and value is not None
            ):
                try:
                    found = ast.literal_eval(value)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    continue
                if isinstance(found, dict):
                    return found
    return None


def _default_judge_value(trait: LLMRubricTrait) -> Any:
    if trait.kind == "boolean":
        return trait.higher_is_better
    if trait.kind == "literal":
        names = trait.class_names()
        return names[-1] if trait.higher_is_better else names[0]
    return trait.max_score if trait.higher_is_better else trait.min_score


def simulator_script_for(benchmark: Benchmark) -> dict[str, Any]:
    """A default LLM-simulator script: right answers, parsed = template ground truth, best judge scores.

    Lets any benchmark (reference checkpoints included) run offline against the simulator.
    """
    entries: list[dict[str, Any]] = []
    for q in benchmark.questions:
        entry: dict[str, Any] = {"match": q.text, "answer": q.raw_answer or SIMULATED_ANSWER}
        truth = template_ground_truth(q.template_code)
        if truth is not None:
            entry["parsed"] = truth
        try:
            rubric = benchmark.rubric_for(q)
        except RubricError:
            rubric = None
        if rubric is not None and rubric.llm_traits:
            entry["judge"] = {t.name: _default_judge_value(t) for t in rubric.llm_traits}
        entries.append(entry)
    return {"questions": entries}


# ---- helpers shared by the readers -------------------------------------------------------------


def _json_load(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchmarkError(
            f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}", path=str(path)
        ) from e


def _looks_like_jsonld(data: Any) -> bool:
    return isinstance(data, dict) and (
        "@context" in data or data.get("@type") in ("DataFeed", "Dataset") or "dataFeedElement" in data
    )


def _validation_message(err: ValidationError) -> str:
    parts: list[str] = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()))
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _check_template(code: Any, path: Path, label: str, qid: str, line_hint: int | None = None) -> str | None:
    """Template must be a string that compiles (not executed). '' means no template."""
    if code is None:
        return None
    if not isinstance(code, str):
        raise BenchmarkError(
            f"{path}: {label}: template: expected Python source text, got {type(code).__name__}",
            path=str(path), question_id=qid, field="template",
        )
    if not code.strip():
        return None
    try:
        compile(code, f"<template {qid}>", "exec")
    except SyntaxError as e:
        file_line = f", file line {line_hint + (e.lineno or 1)}" if line_hint is not None else ""
        raise BenchmarkError(
            f"{path}: {label}: template: does not compile: SyntaxError at template line {e.lineno}{file_line}: {e.msg}",
            path=str(path), question_id=qid, field="template",
        ) from e
    except ValueError as e:  # e.g. null bytes in source
        raise BenchmarkError(
            f"{path}: {label}: template: does not compile: {e}", path=str(path), question_id=qid, field="template"
        ) from e
    return code


def _finish(bench_kwargs: dict[str, Any], questions: list[Question], path: Path) -> Benchmark:
    seen: dict[str, Question] = {}
    for q in questions:
        if q.id in seen:
            raise BenchmarkError(
                f"{path}: {q.label()}: id: duplicate question id (also used by {seen[q.id].label()}); "
                "give each question a distinct id",
                path=str(path), question_id=q.id, field="id",
            )
        seen[q.id] = q
    bench = Benchmark(questions=questions, **bench_kwargs)
    for q in questions:
        try:
            bench.rubric_for(q)
        except RubricError as e:
            raise BenchmarkError(f"{path}: {q.label()}: rubric: {e}", path=str(path), question_id=q.id, field="rubric") from e
    return bench


# ---- JSON-LD checkpoint (reference format) ---------------------------------------------------


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
        raise BenchmarkError(f"{path}: {tlabel}: {_validation_message(e)}", path=str(path)) from e


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
        raise BenchmarkError(f"{path}: {where}: rubric: {_validation_message(e)}", path=str(path)) from e


def _from_jsonld(data: Any, path: Path) -> Benchmark:
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
    return _finish(
        {
            "name": name if isinstance(name, str) and name else path.stem,
            "description": str(data.get("description") or ""),
            "version": str(data.get("version") or "0.1.0"),
            "global_rubric": global_rubric,
            "metadata": meta,
        },
        questions,
        path,
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
    template = _check_template(template_raw, path, label, qid)
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


def _prop(name: str, value: Any) -> dict[str, Any]:
    return {"@type": "PropertyValue", "name": name, "value": value}


def _trait_to_rating(trait: Any, scope: str) -> dict[str, Any]:
    props: list[dict[str, Any]] = []
    rating: dict[str, Any] = {"@type": "Rating", "name": trait.name}
    if trait.description is not None:
        rating["description"] = trait.description
    if isinstance(trait, LLMRubricTrait):
        if trait.kind == "literal":
            atype, best, worst = "LLMRubricTrait", float(trait.max_score or 0), 0.0
            props += [_prop("kind", "literal"), _prop("classes", trait.classes)]
        else:
            atype = "RubricTrait"
            best, worst = (1.0, 0.0) if trait.kind == "boolean" else (float(trait.max_score), float(trait.min_score))
            # explicit kind: a 0..1 score trait would otherwise read back as boolean
            props.append(_prop("kind", trait.kind))
        for f in _LLM_DJ_FIELDS:
            value = getattr(trait, f)
            if value is not None:
                props.append(_prop(f, value))
        props.append(_prop("higher_is_better", trait.higher_is_better))
    elif isinstance(trait, RegexTrait):
        atype, best, worst = "RegexTrait", 1.0, 0.0
        if trait.load_error is None:
            props.append(_prop("pattern", trait.pattern))
        props += [
            _prop("case_sensitive", trait.case_sensitive),
            _prop("invert_result", trait.invert_result),
            _prop("higher_is_better", trait.higher_is_better),
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
            props.append(_prop("callable_code", code))
        props += [
            _prop("kind", trait.kind),
            _prop("invert_result", trait.invert_result),
            _prop("higher_is_better", trait.higher_is_better),
        ]
        if trait.kind == "score":
            if trait.min_score is not None:
                props.append(_prop("min_score", trait.min_score))
            if trait.max_score is not None:
                props.append(_prop("max_score", trait.max_score))
    else:
        atype, best, worst = "MetricRubricTrait", 1.0, 0.0
        props += [
            _prop("metrics", list(trait.metrics)),
            _prop("repeated_extraction", trait.repeated_extraction),
            _prop("evaluation_mode", trait.evaluation_mode),
            _prop("tp_instructions", list(trait.tp_instructions)),
        ]
        if trait.tn_instructions:
            props.append(_prop("tn_instructions", list(trait.tn_instructions)))
    rating["bestRating"] = best
    rating["worstRating"] = worst
    rating["additionalType"] = f"karenina:{scope}{atype}"
    rating["additionalProperty"] = props
    return rating


def _question_to_item(q: Question, now: str) -> dict[str, Any]:
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
        question["rating"] = [_trait_to_rating(t, "QuestionSpecific") for t in q.rubric.all_traits()]
    props = [_prop("finished", q.finished)]
    for key in ("author", "sources"):
        if md.get(key) is not None:
            value = md[key]
            props.append(_prop(key, value if isinstance(value, str) else json.dumps(value)))
    if q.few_shot_examples:
        props.append(_prop("few_shot_examples", json.dumps(q.few_shot_examples)))
    for k, v in (md.get("custom_metadata") or {}).items():
        props.append(_prop(f"custom_{k}", v))
    for k, v in (md.get("properties") or {}).items():
        props.append(_prop(k, v))
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


# ---- plain YAML / JSON format ------------------------------------------------------------------


@dataclass
class _QPos:
    line: int  # 1-based line of the question's entry
    template_offset: int | None  # file line of template line k = template_offset + k ('|' blocks only)


def _yaml_load(text: str, path: Path) -> tuple[Any, list[_QPos]]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = e.problem or e.context or str(e)
        raise BenchmarkError(f"{path}: invalid YAML{at}: {problem}", path=str(path)) from e
    except yaml.YAMLError as e:
        raise BenchmarkError(f"{path}: invalid YAML: {e}", path=str(path)) from e
    finally:
        loader.dispose()
    return data, _question_positions(node)


def _question_positions(root: Any) -> list[_QPos]:
    if not isinstance(root, yaml.MappingNode):
        return []
    for key, value in root.value:
        if isinstance(key, yaml.ScalarNode) and key.value == "questions" and isinstance(value, yaml.SequenceNode):
            out: list[_QPos] = []
            for qn in value.value:
                offset = None
                if isinstance(qn, yaml.MappingNode):
                    for k, v in qn.value:
                        if isinstance(k, yaml.ScalarNode) and k.value == "template" and isinstance(v, yaml.ScalarNode):
                            if v.style == "|":
                                offset = v.start_mark.line + 1
                out.append(_QPos(qn.start_mark.line + 1, offset))
            return out
    return []


def _trait_error(path: Path, where: str, loc: str, name: Any, err: ValidationError | RubricError | str) -> BenchmarkError:
    msg = _validation_message(err) if isinstance(err, ValidationError) else str(err)
    named = f" ({name})" if isinstance(name, str) and name else ""
    return BenchmarkError(f"{path}: {where}: {loc}{named}: {msg}", path=str(path), field=loc)


def _rubric_from_plain(raw: Any, path: Path, where: str) -> Rubric | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BenchmarkError(f"{path}: {where}: rubric: expected a mapping of trait lists, got {type(raw).__name__}")
    groups: dict[str, list[Any]] = {g: [] for g in _RUBRIC_GROUPS}
    unknown = set(raw) - set(_RUBRIC_GROUPS) - {"traits", "dynamic_traits"}
    if unknown:
        raise BenchmarkError(
            f"{path}: {where}: rubric: unknown key(s) {sorted(unknown)}; expected {sorted(_RUBRIC_GROUPS)} or traits",
            path=str(path), field="rubric",
        )
    entries: list[tuple[str, str, Any]] = []  # (group, location, raw trait)
    for group in _RUBRIC_GROUPS:
        items = raw.get(group) or []
        if not isinstance(items, list):
            raise BenchmarkError(f"{path}: {where}: rubric.{group}: expected a list", path=str(path), field=group)
        entries += [(group, f"rubric.{group}[{i}]", t) for i, t in enumerate(items)]
    flat = raw.get("traits") or []
    if not isinstance(flat, list):
        raise BenchmarkError(f"{path}: {where}: rubric.traits: expected a list", path=str(path), field="traits")
    for i, t in enumerate(flat):
        loc = f"rubric.traits[{i}]"
        if not isinstance(t, dict):
            raise _trait_error(path, where, loc, None, f"expected a mapping, got {type(t).__name__}")
        tag = t.get("type")
        if tag not in _WIRE_TO_GROUP:
            raise _trait_error(path, where, loc, t.get("name"), f"type: unknown trait type {tag!r} "
                               f"(expected one of {sorted(_WIRE_TO_GROUP)})")
        entries.append((_WIRE_TO_GROUP[tag], loc, {k: v for k, v in t.items() if k != "type"}))
    for group, loc, t in entries:
        if not isinstance(t, dict):
            raise _trait_error(path, where, loc, None, f"expected a mapping, got {type(t).__name__}")
        try:
            groups[group].append(_RUBRIC_GROUPS[group].model_validate(t))
        except ValidationError as e:
            raise _trait_error(path, where, loc, t.get("name"), e) from e
    dynamic = raw.get("dynamic_traits") or []
    if not isinstance(dynamic, list):
        raise BenchmarkError(f"{path}: {where}: rubric.dynamic_traits: expected a list", path=str(path),
                             field="dynamic_traits")
    for i, t in enumerate(dynamic):  # validated now, so a bad one is refused before a run
        loc = f"rubric.dynamic_traits[{i}]"
        if not isinstance(t, dict) or t.get("type") not in _WIRE_TO_GROUP:
            raise _trait_error(path, where, loc, t.get("name") if isinstance(t, dict) else None,
                               f"expected a mapping with type one of {sorted(_WIRE_TO_GROUP)}")
        try:
            _RUBRIC_GROUPS[_WIRE_TO_GROUP[t["type"]]].model_validate({k: v for k, v in t.items() if k != "type"})
        except ValidationError as e:
            raise _trait_error(path, where, loc, t.get("name"), e) from e
    if not any(groups.values()) and not dynamic:
        return None
    try:
        return Rubric(**groups, dynamic_traits=[dict(t) for t in dynamic])
    except ValidationError as e:
        raise _trait_error(path, where, "rubric", None, e) from e


def _rubric_to_plain(rubric: Rubric) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group in _RUBRIC_GROUPS:
        traits = getattr(rubric, group)
        if traits:
            # required fields (name, kind of LLM traits) have no default, so they are always written
            dumped = [t.model_dump(mode="json", exclude_none=True, exclude_defaults=True) for t in traits]
            for t, d in zip(traits, dumped, strict=True):
                if isinstance(t, LLMRubricTrait) and t.kind == "score":  # the range, even when 1..5
                    d["min_score"], d["max_score"] = t.min_score, t.max_score
            out[group] = dumped
    if rubric.dynamic_traits:
        out["dynamic_traits"] = [dict(t) for t in rubric.dynamic_traits]
    return out


def _from_plain(data: Any, path: Path, positions: list[_QPos] | None) -> Benchmark:
    if data is None:
        raise BenchmarkError(f"{path}: the file is empty", path=str(path))
    if not isinstance(data, dict):
        raise BenchmarkError(
            f"{path}: top level must be a mapping with 'name' and 'questions', got {type(data).__name__}",
            path=str(path),
        )
    unknown = sorted(set(map(str, data)) - _TOP_KEYS)
    if unknown:
        raise BenchmarkError(
            f"{path}: unknown top-level key(s) {unknown}; expected some of {sorted(_TOP_KEYS)}", path=str(path)
        )
    raw_questions = data.get("questions")
    if raw_questions is None:
        raise BenchmarkError(f"{path}: questions: missing (a list of questions)", path=str(path), field="questions")
    if not isinstance(raw_questions, list):
        raise BenchmarkError(f"{path}: questions: expected a list, got {type(raw_questions).__name__}",
                             path=str(path), field="questions")
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise BenchmarkError(f"{path}: metadata: expected a mapping", path=str(path), field="metadata")
    if data.get("creator") is not None:
        metadata = {**metadata, "creator": data["creator"]}
    global_rubric = _rubric_from_plain(data.get("rubric"), path, "global rubric")
    questions: list[Question] = []
    for i, raw in enumerate(raw_questions):
        pos = positions[i] if positions and i < len(positions) else None
        questions.append(_question_from_plain(raw, i, path, pos))
    name = data.get("name")
    return _finish(
        {
            "name": str(name) if name else path.stem,
            "description": str(data.get("description") or ""),
            "version": str(data.get("version") or "0.1.0"),
            "global_rubric": global_rubric,
            "metadata": metadata,
        },
        questions,
        path,
    )


def _question_from_plain(raw: Any, index: int, path: Path, pos: _QPos | None) -> Question:
    at = f" (line {pos.line})" if pos else ""
    where = f"questions[{index}]{at}"
    if not isinstance(raw, dict):
        raise BenchmarkError(f"{path}: {where}: expected a mapping, got {type(raw).__name__}", path=str(path))
    text = raw.get("question", raw.get("text"))
    if not isinstance(text, str) or not text.strip():
        ident = f" id {raw['id']}" if raw.get("id") is not None else ""
        problem = "missing question text" if text is None or text == "" else f"expected text, got {type(text).__name__}"
        raise BenchmarkError(f"{path}: {where}{ident}: question: {problem}", path=str(path),
                             question_id=str(raw["id"]) if raw.get("id") is not None else None, field="question")
    qid = str(raw["id"]) if raw.get("id") not in (None, "") else question_id_for(text)
    label = f"question {qid} ({first_words(text)!r}){at}"

    def fail(field: str, problem: str) -> BenchmarkError:
        return BenchmarkError(f"{path}: {label}: {field}: {problem}", path=str(path), question_id=qid, field=field)

    unknown = sorted(set(map(str, raw)) - _Q_KEYS)
    if unknown:
        raise fail(unknown[0], f"unknown field(s) {unknown}; expected some of {sorted(_Q_KEYS)}")
    answer = raw.get("answer", raw.get("raw_answer"))
    if isinstance(answer, bool):  # `answer: No` is a YAML boolean; its original spelling is lost
        raise fail("answer", f"read as the boolean {answer} (YAML turns yes/no/on/off into booleans); quote it")
    if isinstance(answer, int | float):
        answer = str(answer)
    elif answer is not None and not isinstance(answer, str):
        raise fail("answer", f"expected text, got {type(answer).__name__}")
    if raw.get("template") is not None and raw.get("template_file") is not None:
        raise fail("template", "give either template or template_file, not both")
    template_raw = raw.get("template")
    offset = pos.template_offset if pos else None
    if raw.get("template_file") is not None:
        tf = raw["template_file"]
        if not isinstance(tf, str):
            raise fail("template_file", f"expected a path, got {type(tf).__name__}")
        tpath = (path.parent / tf).resolve()
        try:
            template_raw = tpath.read_text(encoding="utf-8")
        except OSError as e:
            raise fail("template_file", f"cannot read {tpath}: {e.strerror or e}") from e
        offset = None
    template = _check_template(template_raw, path, label, qid, line_hint=offset)
    keywords = raw.get("keywords") or []
    if isinstance(keywords, str):
        keywords = [k.strip() for k in keywords.split(",") if k.strip()]
    if not isinstance(keywords, list):
        raise fail("keywords", f"expected a list of strings, got {type(keywords).__name__}")
    finished = raw.get("finished", True)
    if not isinstance(finished, bool):
        raise fail("finished", f"expected true or false, got {finished!r}")
    few_shot = raw.get("few_shot_examples") or []
    if not isinstance(few_shot, list) or not all(isinstance(x, dict) for x in few_shot):
        raise fail("few_shot_examples", "expected a list of {question, answer} mappings")
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise fail("metadata", "expected a mapping")
    return Question(
        id=qid,
        text=text,
        raw_answer=answer,
        template_code=template,
        keywords=[str(k) for k in keywords],
        finished=finished,
        rubric=_rubric_from_plain(raw.get("rubric"), path, label),
        few_shot_examples=[{str(k): str(v) for k, v in x.items()} for x in few_shot],
        metadata=metadata,
    )


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (templates, source callables) as `|` blocks."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_Dumper.add_representer(str, _represent_str)


# ---- CSV (reference import: Question,Answer columns) ---------------------------------------------


def _from_csv(text: str, path: Path) -> Benchmark:
    reader = csv.DictReader(text.splitlines())
    if not reader.fieldnames:
        raise BenchmarkError(f"{path}: empty CSV (expected a header row with Question,Answer)", path=str(path))
    cols = {c.strip().lower(): c for c in reader.fieldnames if c}
    qcol = cols.get("question")
    if qcol is None:
        raise BenchmarkError(
            f"{path}: CSV header has no Question column (found: {', '.join(reader.fieldnames)})",
            path=str(path), field="Question",
        )
    acol = cols.get("answer")
    idcol = cols.get("id") or cols.get("question_id")
    kwcol = cols.get("keywords")
    questions: list[Question] = []
    try:
        rows = list(reader)
    except csv.Error as e:
        raise BenchmarkError(f"{path}: invalid CSV at line {reader.line_num}: {e}", path=str(path)) from e
    for n, row in enumerate(rows, start=2):
        qtext = (row.get(qcol) or "").strip()
        if not qtext:
            if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
                continue  # blank line
            raise BenchmarkError(f"{path}: row at line {n}: Question: missing question text",
                                 path=str(path), field="Question")
        qid = (row.get(idcol) or "").strip() if idcol else ""
        kw = (row.get(kwcol) or "") if kwcol else ""
        questions.append(
            Question(
                id=qid or question_id_for(qtext),
                text=qtext,
                raw_answer=(row.get(acol) or "").strip() if acol else None,
                keywords=[k.strip() for k in re.split(r"[;,]", kw) if k.strip()],
                # no templates in a CSV: these questions run in rubric_only mode, so they count as ready
                finished=True,
            )
        )
    return _finish({"name": path.stem, "description": f"Imported from {path.name}"}, questions, path)
