"""Benchmark model and loaders: reference checkpoints, CSV, our YAML format, round trips, errors."""

from __future__ import annotations

import base64
import json
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from infra.simulator.from_benchmark import simulator_script_for, template_ground_truth
from shared.core.benchmark.model import Benchmark
from shared.core.benchmark.question import BenchmarkError
from shared.core.ids import question_id_for
from shared.core.rubric import (
    CallableTrait,
    LLMRubricTrait,
    MetricRubricTrait,
    RegexTrait,
    Rubric,
    RubricError,
    classify_callable_code,
)

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO.parent / "shared" / "reference" / "karenina"
CHECKPOINTS = REFERENCE / "checkpoints"
EXAMPLE = REPO / "examples" / "example.yaml"
EXAMPLE_SCRIPT = REPO / "examples" / "example.simulator.yaml"

needs_reference = pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason="reference checkpoints not present")

TEMPLATE = textwrap.dedent(
    """\
    from karenina.schemas.entities import BaseAnswer
    from pydantic import Field


    class Answer(BaseAnswer):
        value: int = Field(description="the value")

        def model_post_init(self, __context):
            self.correct = {"value": 4}

        def verify(self) -> bool:
            return self.value == self.correct["value"]
    """
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    return p


def minimal_plain(**question: Any) -> dict[str, Any]:
    q = {"id": "q1", "question": "What is two plus two?", "answer": "4", "template": TEMPLATE}
    q.update(question)
    return {"name": "t", "questions": [q]}


def load_error(tmp_path: Path, data: Any, name: str = "b.yaml") -> BenchmarkError:
    p = tmp_path / name
    if name.endswith((".json", ".jsonld")):
        p.write_text(json.dumps(data), encoding="utf-8")
    else:
        p.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    with pytest.raises(BenchmarkError) as ei:
        Benchmark.load(p)
    assert str(p) in str(ei.value)
    return ei.value


# ---- reference checkpoints ---------------------------------------------------------------


@needs_reference
def test_minimal_checkpoint() -> None:
    b = Benchmark.load(CHECKPOINTS / "minimal.jsonld")
    assert b.name == "minimal-test" and b.version == "0.1.0"
    assert [q.id for q in b.questions] == ["urn:karenina:test:q001"]  # the DataFeedItem @id
    q = b.questions[0]
    assert q.text == "What is 2+2?" and q.raw_answer == "4"
    assert q.keywords == ["arithmetic", "math"]
    assert q.template_code and "class Answer(BaseAnswer)" in q.template_code
    # no `finished` property: the reference reads that as unfinished
    assert q.finished is False and b.finished_questions() == [] and b.unfinished_questions() == [q]
    assert b.global_rubric is None and q.rubric is None
    assert q.metadata["jsonld_ids"]["template"] == "urn:karenina:test:q001-template"


@needs_reference
def test_multi_question_checkpoint() -> None:
    b = Benchmark.load(CHECKPOINTS / "multi_question.jsonld")
    assert len(b) == 5
    assert [q.finished for q in b.questions] == [True, True, True, True, False]
    assert [q.id for q in b.unfinished_questions()] == ["urn:karenina:test:mq005"]
    assert all(q.template_code for q in b.questions)
    # global callable trait without code: loaded, marked, scored 1..5 from best/worstRating
    assert b.global_rubric is not None
    (g,) = b.global_rubric.callable_traits
    assert (g.name, g.kind, g.min_score, g.max_score) == ("Completeness", "score", 1, 5)
    assert g.callable_code is None and g.load_error and "no callable_code" in g.load_error
    # mq004's question-specific callable trait has no callable_code either: loaded and marked
    mq004 = b.get_question("urn:karenina:test:mq004")
    assert mq004.rubric is not None
    (t,) = mq004.rubric.callable_traits
    assert (t.name, t.kind) == ("Case Sensitivity", "boolean")
    assert t.load_error and "Case Sensitivity" in t.load_error
    merged = b.rubric_for(mq004)
    assert merged is not None and merged.trait_names() == ["Completeness", "Case Sensitivity"]
    problems = b.validate()
    assert any("mq004" in p and "Case Sensitivity" in p for p in problems)


@needs_reference
def test_with_rubrics_checkpoint_trait_types() -> None:
    b = Benchmark.load(CHECKPOINTS / "with_rubrics.jsonld")
    assert len(b) == 3 and all(q.finished for q in b.questions)
    r = b.global_rubric
    assert r is not None
    assert [(t.name, t.kind, t.min_score, t.max_score) for t in r.llm_traits] == [
        ("Clarity", "score", 1, 5),
        ("Accuracy", "boolean", None, None),
        ("Completeness", "score", 1, 5),
    ]
    assert all(t.higher_is_better and not t.deep_judgment_enabled for t in r.llm_traits)
    assert [(t.name, t.pattern, t.case_sensitive, t.invert_result) for t in r.regex_traits] == [
        ("HasCitations", r"\[\d+\]", True, False),
        ("HasNumbers", r"\d+", True, False),
    ]
    contains, length = r.callable_traits
    assert (contains.name, contains.kind, contains.code_format) == ("ContainsCitations", "boolean", "source")
    assert contains.function_names() == ["evaluate"]
    assert "re.search" in (contains.source_code() or "")
    assert (length.kind, length.min_score, length.max_score) == ("score", 1, 5)
    assert r.metric_traits == []
    assert b.validate() == []


@needs_reference
def test_with_results_checkpoint_keeps_stored_results() -> None:
    b = Benchmark.load(CHECKPOINTS / "with_results.jsonld")
    (q,) = b.questions
    assert q.id == "urn:karenina:test:q002" and q.finished
    assert q.metadata["custom_metadata"]["verification_results"]["template_result"]["passed"] is True
    assert b.metadata["properties"]["last_verification_run"] == "2025-01-11T12:00:00Z"
    assert q.rubric is not None
    (citations,) = q.rubric.regex_traits
    assert citations.name == "Citations" and citations.load_error and "no pattern" in citations.load_error


@needs_reference
def test_reference_csv_import() -> None:
    b = Benchmark.load(REFERENCE / "sample_questions.csv")
    assert len(b) == 5 and b.name == "sample_questions"
    q = b.questions[0]
    assert q.text == "What is the capital of France?"
    assert q.raw_answer == "Paris is the capital of France."
    assert q.id == question_id_for(q.text) and q.template_code is None and q.template_id == "no_template"


@needs_reference
@pytest.mark.parametrize("name", ["minimal", "multi_question", "with_results", "with_rubrics"])
def test_checkpoint_round_trips(tmp_path: Path, name: str) -> None:
    b = Benchmark.load(CHECKPOINTS / f"{name}.jsonld")
    again = Benchmark.load(b.save_jsonld(tmp_path / "out.jsonld"))
    assert again.essentials() == b.essentials()
    from_yaml = Benchmark.load(b.save_yaml(tmp_path / "out.yaml"))
    assert from_yaml.model_dump() == b.model_dump()


@needs_reference
def test_saved_checkpoint_has_the_reference_rating_shape(tmp_path: Path) -> None:
    src = CHECKPOINTS / "with_rubrics.jsonld"
    saved = json.loads(Benchmark.load(src).save_jsonld(tmp_path / "o.jsonld").read_text())
    original = json.loads(src.read_text())
    assert saved["@type"] == "DataFeed" and saved["@context"] == original["@context"]
    for o, n in zip(original["rating"], saved["rating"], strict=True):
        assert (o["name"], o["additionalType"], o["bestRating"], o["worstRating"]) == (
            n["name"], n["additionalType"], n["bestRating"], n["worstRating"])
        oprops = {p["name"]: p["value"] for p in o["additionalProperty"]}
        nprops = {p["name"]: p["value"] for p in n["additionalProperty"]}
        assert {k: v for k, v in nprops.items() if k in oprops} == oprops  # callable_code stays base64
    item = saved["dataFeedElement"][0]
    assert item["@id"] == "urn:karenina:test:rq001"
    assert item["item"]["hasPart"]["@type"] == "SoftwareSourceCode"
    assert {"name": "finished", "value": True, "@type": "PropertyValue"} in item["item"]["additionalProperty"]


@needs_reference
def test_simulator_script_for_reference_checkpoint() -> None:
    b = Benchmark.load(CHECKPOINTS / "multi_question.jsonld")
    script = simulator_script_for(b)
    by_text = {e["match"]: e for e in script["questions"]}
    assert len(by_text) == 5
    assert by_text["What is the boiling point of water in Celsius?"]["parsed"] == {"temperature": 100}
    assert by_text["List three primary colors."]["parsed"] == {"colors": ["red", "green", "blue"]}
    assert by_text["Who wrote Romeo and Juliet?"]["parsed"] == {"author": "William Shakespeare"}
    assert by_text["What is the chemical symbol for gold?"]["parsed"] == {"symbol": "Au"}
    assert by_text["Calculate: 15 * 7"] == {"match": "Calculate: 15 * 7", "answer": "105", "parsed": {"result": 105}}
    rubrics = simulator_script_for(Benchmark.load(CHECKPOINTS / "with_rubrics.jsonld"))
    assert rubrics["questions"][0]["judge"] == {"Clarity": 5, "Accuracy": True, "Completeness": 5}


# ---- our example benchmark ----------------------------------------------------------------


def test_example_loads() -> None:
    b = Benchmark.load(EXAMPLE)
    assert len(b) == 20
    assert len(b.finished_questions()) == 18
    assert [q.id for q in b.unfinished_questions()] == ["ex-draft-prime", "ex-draft-tokyo"]
    assert b.validate() == []
    g = b.global_rubric
    assert g is not None
    assert [(t.name, t.kind) for t in g.llm_traits] == [("Clarity", "score"), ("AnswersDirectly", "boolean")]
    assert [t.name for t in g.regex_traits] == ["NoApology"]
    (concise,) = g.callable_traits
    assert concise.code_format == "source" and concise.function_names() == ["evaluate"]
    salt = b.get_question("ex-chem-salt")
    assert salt.rubric is not None and salt.rubric.trait_names() == ["NamesTheCompound"]
    merged = b.rubric_for(salt)
    assert merged is not None and len(merged.trait_names()) == 5
    assert all(q.template_code for q in b.finished_questions())


def test_example_round_trips(tmp_path: Path) -> None:
    b = Benchmark.load(EXAMPLE)
    again = Benchmark.load(b.save_yaml(tmp_path / "again.yaml"))
    assert again.model_dump() == b.model_dump()
    via_jsonld = Benchmark.load(b.save_jsonld(tmp_path / "again.jsonld"))
    assert via_jsonld.essentials() == b.essentials()
    # plain JSON of the same shape as YAML is accepted too
    plain_json = tmp_path / "again.json"
    plain_json.write_text(json.dumps(b.to_plain()), encoding="utf-8")
    assert Benchmark.load(plain_json).model_dump() == b.model_dump()


@pytest.fixture
def karenina_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for the sandbox's karenina alias, so these tests can run the example templates."""

    class BaseAnswer(BaseModel):
        model_config = ConfigDict(extra="allow")
        id: str | None = None

    entities = types.ModuleType("karenina.schemas.entities")
    entities.BaseAnswer = BaseAnswer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "karenina", types.ModuleType("karenina"))
    monkeypatch.setitem(sys.modules, "karenina.schemas", types.ModuleType("karenina.schemas"))
    monkeypatch.setitem(sys.modules, "karenina.schemas.entities", entities)


def _answer_class(code: str) -> Any:
    ns: dict[str, Any] = {}
    exec(compile(code, "<template>", "exec"), ns)  # test-only: our own example templates
    return ns["Answer"]


@pytest.mark.usefixtures("karenina_alias")
def test_example_simulator_script_gives_a_mixed_run() -> None:
    b = Benchmark.load(EXAMPLE)
    script = yaml.safe_load(EXAMPLE_SCRIPT.read_text(encoding="utf-8"))
    by_text = {e["match"]: e for e in script["questions"]}
    assert set(by_text) == {q.text for q in b.questions}
    outcomes: dict[str, bool] = {}
    for q in b.finished_questions():
        entry = by_text[q.text]
        answer_cls = _answer_class(q.template_code or "")
        outcomes[q.id] = answer_cls(**entry["parsed"]).verify()
        rubric = b.rubric_for(q)
        assert rubric is not None
        assert set(entry["judge"]) == {t.name for t in rubric.llm_traits}
        clarity = next(t for t in rubric.llm_traits if t.name == "Clarity")
        assert clarity.min_score <= entry["judge"]["Clarity"] <= clarity.max_score  # type: ignore[operator]
    failed = sorted(k for k, ok in outcomes.items() if not ok)
    assert failed == ["ex-astro-galilean", "ex-history-apollo11", "ex-space-great-wall"]
    assert 0.75 <= sum(outcomes.values()) / len(outcomes) <= 0.9
    # the default script (ground truth read with ast) verifies every finished question
    default = {e["match"]: e for e in simulator_script_for(b)["questions"]}
    for q in b.finished_questions():
        assert _answer_class(q.template_code or "")(**default[q.text]["parsed"]).verify(), q.id


def test_template_ground_truth_reads_literals_only() -> None:
    assert template_ground_truth(TEMPLATE) == {"value": 4}
    computed = TEMPLATE.replace('self.correct = {"value": 4}', "self.correct = {'value': 2 + 2 if True else 0}")
    assert template_ground_truth(computed) is None
    assert template_ground_truth("def broken(:\n") is None
    assert template_ground_truth(None) is None


# ---- plain format details -----------------------------------------------------------------


def test_defaults_and_template_file(tmp_path: Path) -> None:
    (tmp_path / "tpl.py").write_text(TEMPLATE, encoding="utf-8")
    p = write(
        tmp_path,
        "b.yaml",
        """\
        name: files
        questions:
          - question: What is two plus two?
            answer: 4
            template_file: tpl.py
          - question: Say hi.
        """,
    )
    b = Benchmark.load(p)
    first, second = b.questions
    assert first.id == question_id_for("What is two plus two?")
    assert first.raw_answer == "4" and first.template_code == TEMPLATE and first.finished
    assert second.template_code is None and second.raw_answer is None
    assert b.source == p


def test_loading_never_runs_template_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit(3)\n" + TEMPLATE
    b = Benchmark.load(write(tmp_path, "b.yaml", yaml.safe_dump(minimal_plain(template=code))))
    assert b.questions[0].template_code == code
    assert not marker.exists()


# ---- errors name the file, the question and the field ------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match="not found"):
        Benchmark.load(tmp_path / "nope.yaml")


def test_unsupported_extension(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match="unsupported benchmark file type '.txt'"):
        Benchmark.load(write(tmp_path, "b.txt", "x"))


def test_invalid_json_reports_line_and_column(tmp_path: Path) -> None:
    p = write(tmp_path, "b.jsonld", '{\n  "name": "x",\n  "dataFeedElement": [,]\n}\n')
    with pytest.raises(BenchmarkError, match=r"invalid JSON at line 3, column 23"):
        Benchmark.load(p)


def test_invalid_yaml_reports_line_and_column(tmp_path: Path) -> None:
    p = write(tmp_path, "b.yaml", "name: x\nquestions:\n  - question: [unclosed\n    answer: 4\n")
    with pytest.raises(BenchmarkError, match=r"invalid YAML at line \d+, column \d+") as ei:
        Benchmark.load(p)
    assert str(p) in str(ei.value)


def test_missing_question_text_yaml(tmp_path: Path) -> None:
    data = {"name": "t", "questions": [{"question": "Fine?", "answer": "y"}, {"id": "q2", "answer": "4"}]}
    err = load_error(tmp_path, data)
    assert "questions[1] (line 5) id q2: question: missing question text" in err.message
    assert err.field == "question" and err.question_id == "q2"


def test_missing_question_text_jsonld(tmp_path: Path) -> None:
    data = {"@type": "DataFeed", "name": "t", "dataFeedElement": [{"@id": "urn:x:q9", "item": {"@type": "Question"}}]}
    err = load_error(tmp_path, data, "b.jsonld")
    assert "dataFeedElement[0] (urn:x:q9): item.text: missing question text" in err.message


def test_template_not_a_string(tmp_path: Path) -> None:
    err = load_error(tmp_path, minimal_plain(template=42))
    assert "question q1 ('What is two plus two?')" in err.message
    assert "template: expected Python source text, got int" in err.message


def test_template_that_does_not_compile_names_the_line(tmp_path: Path) -> None:
    bad = TEMPLATE.replace("def verify(self) -> bool:", "def verify(self) -> bool")
    bad_line = bad.splitlines().index("    def verify(self) -> bool") + 1
    p = write(tmp_path, "b.yaml", yaml.dump(minimal_plain(template=bad), default_style=None, sort_keys=False,
                                            Dumper=_BlockDumper))
    with pytest.raises(BenchmarkError) as ei:
        Benchmark.load(p)
    msg = ei.value.message
    assert "question q1 ('What is two plus two?')" in msg and "template: does not compile" in msg
    assert f"SyntaxError at template line {bad_line}" in msg
    file_lines = p.read_text().splitlines()
    file_line = int(msg.split("file line ")[1].split(":")[0])
    assert file_lines[file_line - 1].strip() == "def verify(self) -> bool"


class _BlockDumper(yaml.SafeDumper):
    pass


_BlockDumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def test_template_error_in_checkpoint(tmp_path: Path) -> None:
    data = {
        "@type": "DataFeed",
        "name": "t",
        "dataFeedElement": [{
            "@id": "urn:x:q1",
            "item": {"text": "What is up?", "hasPart": {"text": "class Answer(:\n    pass\n"}},
        }],
    }
    err = load_error(tmp_path, data, "b.jsonld")
    assert "question urn:x:q1 ('What is up?'): template: does not compile: SyntaxError at template line 1" in err.message


def test_undecodable_callable_code(tmp_path: Path) -> None:
    data = minimal_plain()
    data["rubric"] = {"callable_traits": [{"name": "Short", "kind": "boolean", "callable_code": "def f(:"}]}
    err = load_error(tmp_path, data)
    assert "global rubric: rubric.callable_traits[0] (Short)" in err.message
    assert "callable_code is neither base64 nor valid Python source" in err.message


def test_undecodable_callable_code_in_checkpoint(tmp_path: Path) -> None:
    bogus = base64.b64encode(b"\xff\xfe not python").decode()
    data = {
        "@type": "DataFeed", "name": "t", "dataFeedElement": [],
        "rating": [{"@type": "Rating", "name": "Odd", "bestRating": 1, "worstRating": 0,
                    "additionalType": "karenina:GlobalCallableTrait",
                    "additionalProperty": [{"name": "callable_code", "value": bogus}]}],
    }
    err = load_error(tmp_path, data, "b.jsonld")
    assert "global rubric: trait 'Odd'" in err.message and "callable_code is not decodable" in err.message


def test_invalid_regex(tmp_path: Path) -> None:
    data = minimal_plain(rubric={"regex_traits": [{"name": "Cites", "pattern": "[unclosed"}]})
    err = load_error(tmp_path, data)
    assert "question q1 ('What is two plus two?')" in err.message
    assert "rubric.regex_traits[0] (Cites)" in err.message and "pattern: invalid regex '[unclosed'" in err.message


def test_unknown_trait_type_in_checkpoint(tmp_path: Path) -> None:
    data = {
        "@type": "DataFeed", "name": "t",
        "dataFeedElement": [{"@id": "urn:x:q1", "item": {
            "text": "What is up?", "hasPart": {"text": TEMPLATE},
            "rating": [{"name": "Agent", "bestRating": 1, "worstRating": 0,
                        "additionalType": "karenina:QuestionSpecificAgenticRubricTrait"}]}}],
    }
    err = load_error(tmp_path, data, "b.jsonld")
    assert "question urn:x:q1 ('What is up?'): trait 'Agent': additionalType" in err.message
    assert "unsupported trait type 'karenina:QuestionSpecificAgenticRubricTrait'" in err.message


def test_unknown_trait_type_in_yaml(tmp_path: Path) -> None:
    err = load_error(tmp_path, minimal_plain(rubric={"traits": [{"type": "vibes", "name": "V"}]}))
    assert "rubric.traits[0] (V): type: unknown trait type 'vibes'" in err.message


def test_unquoted_yes_no_answer_is_refused(tmp_path: Path) -> None:
    p = write(tmp_path, "b.yaml", "name: t\nquestions:\n  - id: q1\n    question: Is it?\n    answer: No\n")
    with pytest.raises(BenchmarkError, match=r"question q1 \('Is it\?'\) \(line 3\): answer: read as the boolean"):
        Benchmark.load(p)


def test_unknown_question_field(tmp_path: Path) -> None:
    err = load_error(tmp_path, minimal_plain(anwser="4"))
    assert "question q1" in err.message and "anwser" in err.message


def test_duplicate_question_ids(tmp_path: Path) -> None:
    data = minimal_plain()
    data["questions"].append({"id": "q1", "question": "Another?"})
    err = load_error(tmp_path, data)
    assert "question q1 ('Another?')" in err.message and "duplicate question id" in err.message


def test_trait_name_clash_between_global_and_question(tmp_path: Path) -> None:
    data = minimal_plain(rubric={"regex_traits": [{"name": "Dup", "pattern": "x"}]})
    data["rubric"] = {"llm_traits": [{"name": "Dup", "kind": "boolean"}]}
    err = load_error(tmp_path, data)
    assert "question q1" in err.message and "trait name clash" in err.message and "'Dup'" in err.message


def test_validate_lists_problems_without_raising(tmp_path: Path) -> None:
    no_class = "x = 1\n"
    b = Benchmark.load(write(tmp_path, "b.yaml", yaml.safe_dump(minimal_plain(template=no_class))))
    problems = b.validate()
    assert any("q1" in p and "no top-level class named Answer" in p for p in problems)


# ---- rubric models ---------------------------------------------------------------------------


def test_zero_min_score_is_kept_through_files(tmp_path: Path) -> None:
    rubric = {
        "llm_traits": [{"name": "Zero2Ten", "kind": "score", "min_score": 0, "max_score": 10},
                       {"name": "ZeroOne", "kind": "score", "min_score": 0, "max_score": 1}],
        "callable_traits": [{"name": "Len", "kind": "score", "min_score": 0, "max_score": 3,
                             "callable_code": "def evaluate(t):\n    return min(len(t) // 10, 3)\n"}],
    }
    b = Benchmark.load(write(tmp_path, "b.yaml", yaml.safe_dump({**minimal_plain(), "rubric": rubric})))
    for again in (Benchmark.load(b.save_jsonld(tmp_path / "o.jsonld")), Benchmark.load(b.save_yaml(tmp_path / "o.yaml"))):
        r = again.global_rubric
        assert r is not None
        assert [(t.kind, t.min_score, t.max_score) for t in r.llm_traits] == [("score", 0, 10), ("score", 0, 1)]
        assert (r.callable_traits[0].min_score, r.callable_traits[0].max_score) == (0, 3)


def test_llm_trait_validation() -> None:
    with pytest.raises(ValidationError, match="min_score"):
        LLMRubricTrait(name="x", kind="score", min_score=5, max_score=1)
    with pytest.raises(ValidationError, match="at least 2 classes"):
        LLMRubricTrait(name="x", kind="literal", classes={"only": "one"})
    lit = LLMRubricTrait(name="tone", kind="literal", classes=["negative", "neutral", "positive"])
    assert (lit.min_score, lit.max_score, lit.class_names()) == (0, 2, ["negative", "neutral", "positive"])
    assert lit.class_index("Positive") == 2 and lit.class_index("other") == -1
    boolean = LLMRubricTrait(name="b", kind="boolean")
    assert (boolean.min_score, boolean.max_score) == (None, None)


def test_regex_and_callable_validation() -> None:
    with pytest.raises(ValidationError, match="invalid regex"):
        RegexTrait(name="r", pattern="(")
    with pytest.raises(ValidationError, match="pattern: must not be empty"):
        RegexTrait(name="r")
    assert RegexTrait(name="r", load_error="no pattern").load_error == "no pattern"
    with pytest.raises(ValidationError, match="callable_code: required"):
        CallableTrait(name="c")
    src = "def evaluate(trace):\n    return True\n"
    assert CallableTrait(name="c", callable_code=src).source_code() == src
    b64 = base64.b64encode(src.encode()).decode()
    from_b64 = CallableTrait(name="c", callable_code=b64)
    assert from_b64.code_format == "source" and from_b64.callable_code == src
    pickled = CallableTrait(name="p", callable_code=b"\x80\x05\x95fake-pickle")
    assert pickled.code_format == "cloudpickle" and pickled.pickled_bytes() == b"\x80\x05\x95fake-pickle"
    assert classify_callable_code(b64)[0] == "base64_source"


def test_metric_trait_validation() -> None:
    ok = MetricRubricTrait(name="m", metrics=["precision", "recall"], tp_instructions=["mentions BCL2"])
    assert ok.evaluation_mode == "tp_only"
    with pytest.raises(ValidationError, match="need true negatives"):
        MetricRubricTrait(name="m", metrics=["accuracy"], tp_instructions=["a"])
    with pytest.raises(ValidationError, match="tn_instructions"):
        MetricRubricTrait(name="m", evaluation_mode="full_matrix", metrics=["accuracy"], tp_instructions=["a"])
    full = MetricRubricTrait(name="m", evaluation_mode="full_matrix", metrics=["accuracy", "specificity"],
                             tp_instructions=["a"], tn_instructions=["b"])
    assert full.tn_instructions == ["b"]


def test_rubric_merge_wire_and_names() -> None:
    g = Rubric(llm_traits=[LLMRubricTrait(name="Clarity", kind="score", min_score=0, max_score=4)])
    q = Rubric(
        regex_traits=[RegexTrait(name="Cites", pattern=r"\[\d+\]")],
        callable_traits=[CallableTrait(name="Len", kind="score", min_score=0, max_score=2,
                                       callable_code="def f(t):\n    return 1\n")],
        metric_traits=[MetricRubricTrait(name="Cover", metrics=["f1"], tp_instructions=["x"])],
    )
    merged = g.merge(q)
    assert merged.trait_names() == ["Clarity", "Cites", "Len", "Cover"]
    assert g.merge(None).trait_names() == ["Clarity"] and Rubric().is_empty() and not merged.is_empty()
    wire = merged.to_wire()
    assert [t["type"] for t in wire["traits"]] == ["llm", "regex", "callable", "metric"]
    assert Rubric.from_wire(json.loads(json.dumps(wire))) == merged
    assert Rubric.from_wire(None).is_empty()
    with pytest.raises(RubricError, match="trait name clash.*'Clarity'"):
        merged.merge(g)
    with pytest.raises(ValidationError, match="duplicate trait name 'Clarity'"):
        Rubric(llm_traits=g.llm_traits, regex_traits=[RegexTrait(name="Clarity", pattern="x")])
    with pytest.raises(RubricError, match="unknown trait type"):
        Rubric.from_wire({"traits": [{"type": "nope", "name": "x"}]})


def test_dynamic_traits_load_and_reach_the_job(tmp_path: Path) -> None:
    from shared.control.runner import plan_run
    from shared.core.config import ModelConfig, VerificationConfig

    path = tmp_path / "dyn.yaml"
    path.write_text(
        "name: dyn\nrubric:\n  regex_traits: [{name: HasNumber, pattern: '\\\\d'}]\n"
        "  dynamic_traits:\n    - {type: llm, name: MentionsSafety, kind: boolean, description: safety caveats}\n"
        "questions:\n  - {id: q1, question: 'Is it safe?', answer: 'yes'}\n")
    bench = Benchmark.load(path)
    assert bench.global_rubric is not None and bench.global_rubric.dynamic_traits[0]["name"] == "MentionsSafety"
    cfg = VerificationConfig(answering_models=[ModelConfig(model_name="a")], parsing_models=[ModelConfig(model_name="j")],
                             evaluation_mode="rubric_only")
    job = plan_run(bench, cfg).requests[0].jobs[0]
    assert job.rubric["dynamic_traits"] == [{"type": "llm", "name": "MentionsSafety", "kind": "boolean",
                                             "description": "safety caveats"}]
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nrubric:\n  dynamic_traits:\n    - {type: llm, name: X, kind: nope}\n"
                   "questions:\n  - {id: q1, question: 'Q?', answer: 'a'}\n")
    with pytest.raises(BenchmarkError, match="dynamic_traits"):
        Benchmark.load(bad)


def test_a_rubric_file_adds_global_traits_and_refuses_what_it_cannot_add(tmp_path: Path) -> None:
    """`veribus run --rubric FILE`: the `rubric:` block of a plain benchmark, alone or under a
    `rubric` key, in YAML or JSON; an empty file, a bad trait and a name already in use are
    refused naming the file and the trait."""
    from shared.core.benchmark.plain import read_rubric_file
    from shared.core.rubric import RubricError

    block = {"llm_traits": [{"name": "Correct", "description": "Gives the reference answer.", "kind": "boolean"}],
             "regex_traits": [{"name": "Cites", "description": "Has a citation.", "pattern": r"\[\d+\]"}]}
    (tmp_path / "alone.yaml").write_text(yaml.safe_dump(block))
    (tmp_path / "keyed.json").write_text(json.dumps({"rubric": block}))
    alone, keyed = read_rubric_file(tmp_path / "alone.yaml"), read_rubric_file(tmp_path / "keyed.json")
    assert alone == keyed and alone.trait_names() == ["Correct", "Cites"]

    b = Benchmark.load(EXAMPLE)
    before = b.global_rubric.trait_names()
    added = b.with_global_rubric(alone, "r.yaml")
    assert sorted(added.global_rubric.trait_names()) == sorted([*before, "Correct", "Cites"])
    assert b.global_rubric.trait_names() == before  # the loaded benchmark is left as it was
    assert all("Correct" in added.rubric_for(q).trait_names() for q in added.questions)

    (tmp_path / "empty.yaml").write_text("rubric: {}\n")
    with pytest.raises(BenchmarkError, match="empty.yaml: the rubric file has no traits"):
        read_rubric_file(tmp_path / "empty.yaml")
    (tmp_path / "bad.yaml").write_text("llm_traits:\n  - name: Broken\n    kind: score\n    min_score: 5\n    max_score: 1\n")
    with pytest.raises(BenchmarkError, match=r"bad.yaml: rubric file: rubric.llm_traits\[0\] \(Broken\)"):
        read_rubric_file(tmp_path / "bad.yaml")
    with pytest.raises(BenchmarkError, match="cannot read the rubric file"):
        read_rubric_file(tmp_path / "missing.yaml")
    clash = read_rubric_file(_write(tmp_path / "clash.yaml", {"llm_traits": [
        {"name": before[0], "description": "again", "kind": "boolean"}]}))
    with pytest.raises(RubricError, match=f"clash.yaml: trait\\(s\\) '{before[0]}' already in the benchmark's global rubric"):
        b.with_global_rubric(clash, "clash.yaml")
    own = next(q for q in b.questions if q.rubric and not q.rubric.is_empty())
    name = own.rubric.trait_names()[0]
    theirs = read_rubric_file(_write(tmp_path / "q.yaml", {"regex_traits": [
        {"name": name, "description": "again", "pattern": "x"}]}))
    with pytest.raises(RubricError, match=f"already in the rubric of question '{own.id}'"):
        b.with_global_rubric(theirs, "q.yaml")


def _write(path: Path, doc: Any) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path
