"""Our plain YAML/JSON benchmark format, and the reference's Question,Answer CSV import (see
`shared.core.benchmark.model` for the format)."""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from shared.core.benchmark.checks import check_template, validation_message
from shared.core.benchmark.jsonld import Parsed
from shared.core.benchmark.question import BenchmarkError, Question, first_words
from shared.core.ids import question_id_for
from shared.core.rubric import (
    CallableTrait,
    LLMRubricTrait,
    MetricRubricTrait,
    RegexTrait,
    Rubric,
    RubricError,
)

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
# ---- plain YAML / JSON format ------------------------------------------------------------------


@dataclass
class _QPos:
    line: int  # 1-based line of the question's entry
    template_offset: int | None  # file line of template line k = template_offset + k ('|' blocks only)


def yaml_load(text: str, path: Path) -> tuple[Any, list[_QPos]]:
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
    msg = validation_message(err) if isinstance(err, ValidationError) else str(err)
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


def read_rubric_file(path: Path) -> Rubric:
    """A global rubric from its own YAML or JSON file (`veribus run --rubric`): the `rubric:`
    block of a plain benchmark, either alone or under a top-level `rubric` key."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise BenchmarkError(f"{path}: cannot read the rubric file: {e.strerror or e}", path=str(path)) from e
    data, _ = yaml_load(text, path)  # YAML reads JSON too
    if isinstance(data, dict) and set(data) == {"rubric"}:
        data = data["rubric"]
    rubric = _rubric_from_plain(data, path, "rubric file")
    if rubric is None:
        raise BenchmarkError(f"{path}: the rubric file has no traits", path=str(path), field="rubric")
    return rubric


def rubric_to_plain(rubric: Rubric) -> dict[str, Any]:
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


def read_plain(data: Any, path: Path, positions: list[_QPos] | None) -> Parsed:
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
    return (
        {
            "name": str(name) if name else path.stem,
            "description": str(data.get("description") or ""),
            "version": str(data.get("version") or "0.1.0"),
            "global_rubric": global_rubric,
            "metadata": metadata,
        },
        questions,
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
    template = check_template(template_raw, path, label, qid, line_hint=offset)
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


class YamlDumper(yaml.SafeDumper):
    """Writes multi-line strings (templates, source callables) as `|` blocks."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


YamlDumper.add_representer(str, _represent_str)


# ---- CSV (reference import: Question,Answer columns) ---------------------------------------------


def read_csv(text: str, path: Path) -> Parsed:
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
    return {"name": path.stem, "description": f"Imported from {path.name}"}, questions
