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
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from shared.core.benchmark.checks import trait_problems
from shared.core.benchmark.jsonld import (
    FORMAT_VERSION,
    JSONLD_CONTEXT,
    json_load,
    jsonld_prop,
    looks_like_jsonld,
    question_to_item,
    read_jsonld,
    trait_to_rating,
)
from shared.core.benchmark.plain import (
    YamlDumper,
    read_csv,
    read_plain,
    read_rubric_file,
    rubric_to_plain,
    yaml_load,
)
from shared.core.benchmark.question import BenchmarkError, Question
from shared.core.ids import question_id_for
from shared.core.limits import question_problems
from shared.core.rubric import (
    Rubric,
    RubricError,
)


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
    def load(cls, path: str | Path, rubric: str | Path | None = None) -> Benchmark:
        """Load by extension: .jsonld/.json (JSON-LD checkpoint or plain JSON), .yaml/.yml, .csv.
        `rubric`: a rubric file whose traits join the global rubric (`--rubric`: `with_global_rubric`)."""
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
                data = json_load(text, p)
                if suffix == ".jsonld" or looks_like_jsonld(data):
                    parsed = read_jsonld(data, p)
                else:
                    parsed = read_plain(data, p, positions=None)
            elif suffix in (".yaml", ".yml"):
                data, positions = yaml_load(text, p)
                parsed = read_plain(data, p, positions=positions)
            elif suffix == ".csv":
                parsed = read_csv(text, p)
            else:
                raise BenchmarkError(
                    f"{p}: unsupported benchmark file type {suffix or '(none)'!r}; "
                    "expected .jsonld, .json, .yaml, .yml or .csv",
                    path=str(p),
                )
            bench = _finish(*parsed, p)
        except BenchmarkError:
            raise
        except Exception as e:  # a loader bug must still reach the user as a named, readable problem
            raise BenchmarkError(f"{p}: could not load benchmark: {type(e).__name__}: {e}", path=str(p)) from e
        bench.source = p
        bench.check_sizes()
        if rubric is not None:
            try:
                bench = bench.with_global_rubric(read_rubric_file(Path(rubric)), str(rubric))
            except RubricError as e:
                raise BenchmarkError(str(e), path=str(rubric), field="rubric") from e
        return bench

    def check_sizes(self) -> None:
        """Refuse questions, templates or answers over the wire limits (`shared.core.limits`),
        all of them named at once, before anything is published."""
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
            yaml.dump(self.to_plain(), Dumper=YamlDumper, sort_keys=False, allow_unicode=True, width=100),
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
            out["rubric"] = rubric_to_plain(self.global_rubric)
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
                d["rubric"] = rubric_to_plain(q.rubric)
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
            doc["rating"] = [trait_to_rating(t, "Global") for t in self.global_rubric.all_traits()]
        doc["dataFeedElement"] = [question_to_item(q, now) for q in self.questions]
        props = dict(md.get("properties") or {})
        props.setdefault("benchmark_format_version", FORMAT_VERSION)
        doc["additionalProperty"] = [jsonld_prop(k, v) for k, v in props.items()]
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

    def with_global_rubric(self, extra: Rubric, source: str) -> Benchmark:
        """This benchmark with `extra`'s traits added to its global rubric (`veribus run --rubric`).
        A trait name the global rubric or a question's own rubric already has is refused, naming it."""
        names = set(extra.trait_names())
        for where, rubric in [("the benchmark's global rubric", self.global_rubric),
                              *((f"the rubric of question {q.id!r}", q.rubric) for q in self.questions)]:
            clash = sorted(names & set((rubric or Rubric()).trait_names()))
            if clash:
                raise RubricError(f"{source}: trait(s) {', '.join(map(repr, clash))} already in {where}")
        out = self.model_copy(update={"global_rubric": (self.global_rubric or Rubric()).merge(extra)})
        out.source = self.source
        return out

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
            problems.extend(trait_problems(t, f"{where}: global rubric"))
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
                    problems.extend(trait_problems(t, f"{label}: rubric"))
            try:
                self.rubric_for(q)
            except RubricError as e:
                problems.append(f"{label}: rubric: {e}")
        return problems


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
