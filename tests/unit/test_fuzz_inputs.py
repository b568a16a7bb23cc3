"""Invariant 4 (bad input is refused before publishing), fuzzed with hypothesis: the JSON-LD and
YAML loaders and `veribus run` with malformed configs and options. Every bad input gives a clear
error naming the question/field - a BenchmarkError from the loaders, exit code 2 and one
`veribus: error:` message from the CLI - never a traceback, and nothing is started or published.
"""

from __future__ import annotations

import copy
import json
import string
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from shared.cli import commands as cli
from shared.control import runner, stack
from shared.control.credentials import PROVIDER_KEYS
from shared.core.benchmark.model import Benchmark
from shared.core.benchmark.question import BenchmarkError
from shared.core.config import INTERFACES
from tests.conftest import CHECKPOINTS, EXAMPLE

# no .hypothesis/ folder in the repo (its caches go to the temp dir); database=None: every run
# explores afresh, within its budget
set_hypothesis_home_dir(str(Path(tempfile.gettempdir()) / "veribus-hypothesis"))
FUZZ = settings(max_examples=80, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=12)

CHECKPOINT = json.loads((CHECKPOINTS / "multi_question.jsonld").read_text())
EXAMPLE_DOC = yaml.safe_load(EXAMPLE.read_text())
# the inputs are written with libyaml's dumper when there is one (the loader under test reads them
# either way; the pure-Python dumper would take most of each example's time)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _dump(doc: Any, **kw: Any) -> str:
    return yaml.dump(doc, Dumper=_DUMPER, **kw)


def _load(path: Path) -> Benchmark | BenchmarkError:
    """Load; the only exception allowed out of the loader is BenchmarkError."""
    try:
        return Benchmark.load(path)
    except BenchmarkError as exc:
        assert str(exc).strip(), "an empty error message"
        assert str(path) in str(exc), "the message names the file"
        return exc


# ---------------------------------------------------------------------------------- JSON-LD


@FUZZ
@given(doc=json_values)
def test_jsonld_any_json_document(tmp_path: Path, doc: Any) -> None:
    path = tmp_path / "fuzz.jsonld"
    path.write_text(json.dumps(doc))
    _load(path)


@FUZZ
@given(data=st.binary(max_size=200))
def test_jsonld_any_bytes(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.jsonld"
    path.write_bytes(data)
    _load(path)


ITEM_PATHS = [("item",), ("item", "text"), ("item", "acceptedAnswer"), ("item", "hasPart"), ("item", "hasPart", "text"),
              ("item", "additionalProperty"), ("item", "keywords"), ("item", "rating"), ("@id",)]


@FUZZ
@given(index=st.integers(0, len(CHECKPOINT["dataFeedElement"]) - 1), where=st.sampled_from(ITEM_PATHS),
       value=json_values, delete=st.booleans())
def test_jsonld_mutated_question_is_named(tmp_path: Path, index: int, where: tuple[str, ...], value: Any,
                                          delete: bool) -> None:
    # known loader gap, pinned by test_jsonld_scalar_list_fields_name_the_question below
    assume(not (where[-1] in ("additionalProperty", "keywords") and isinstance(value, bool | int | float)
                and value and not delete))
    doc = copy.deepcopy(CHECKPOINT)
    item = doc["dataFeedElement"][index]
    original_id = item["@id"]
    node = item
    for key in where[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    assume(isinstance(node, dict))
    if delete:
        node.pop(where[-1], None)
    else:
        node[where[-1]] = value
    path = tmp_path / "mutated.jsonld"
    path.write_text(json.dumps(doc))
    got = _load(path)
    if isinstance(got, BenchmarkError):
        msg = str(got)
        names = {f"dataFeedElement[{index}]", str(original_id)}
        if where == ("@id",) and not delete and value:
            names.add(str(value))
        assert any(n in msg for n in names), msg


@pytest.mark.parametrize("field", ["additionalProperty", "keywords"])
def test_jsonld_scalar_list_fields_name_the_question(tmp_path: Path, field: str) -> None:
    doc = copy.deepcopy(CHECKPOINT)
    doc["dataFeedElement"][1]["item"][field] = True
    path = tmp_path / "scalar.jsonld"
    path.write_text(json.dumps(doc))
    got = _load(path)
    assert isinstance(got, BenchmarkError)
    assert doc["dataFeedElement"][1]["@id"] in str(got) and field in str(got), str(got)


@FUZZ
@given(value=json_values)
def test_jsonld_mutated_global_rubric_is_named(tmp_path: Path, value: Any) -> None:
    doc = copy.deepcopy(CHECKPOINT)
    doc["rating"] = value
    path = tmp_path / "rubric.jsonld"
    path.write_text(json.dumps(doc))
    got = _load(path)
    if isinstance(got, BenchmarkError):
        assert "global rubric" in str(got) or "rating" in str(got), str(got)


# ---------------------------------------------------------------------------------- YAML


@FUZZ
@given(text=st.text(alphabet=string.printable, max_size=300))
def test_yaml_any_text(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    _load(path)


@FUZZ
@given(doc=json_values)
def test_yaml_any_structure(tmp_path: Path, doc: Any) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(_dump(doc))
    _load(path)


QUESTION_FIELDS = ["question", "answer", "template", "keywords", "finished", "few_shot_examples", "rubric",
                   "metadata", "template_file"]


@FUZZ
@given(index=st.integers(0, len(EXAMPLE_DOC["questions"]) - 1), field=st.sampled_from(QUESTION_FIELDS),
       value=json_values)
def test_yaml_mutated_question_names_question_and_field(tmp_path: Path, index: int, field: str, value: Any) -> None:
    doc = copy.deepcopy(EXAMPLE_DOC)
    q = doc["questions"][index]
    if field == "template_file":
        q.pop("template", None)
    q[field] = value
    path = tmp_path / "mutated.yaml"
    path.write_text(_dump(doc, sort_keys=False))
    got = _load(path)
    if isinstance(got, BenchmarkError):
        msg = str(got)
        assert q["id"] in msg or f"questions[{index}]" in msg, msg
        fields = {field, "question", "template", "rubric", "trait"}
        assert any(f in msg for f in fields), msg


@FUZZ
@given(template=st.text(max_size=200))
def test_yaml_bad_template_text_names_the_question(tmp_path: Path, template: str) -> None:
    doc = copy.deepcopy(EXAMPLE_DOC)
    doc["questions"][2]["template"] = template
    path = tmp_path / "tmpl.yaml"
    path.write_text(_dump(doc, sort_keys=False))
    got = _load(path)
    if isinstance(got, BenchmarkError):
        assert doc["questions"][2]["id"] in str(got), str(got)


# ---------------------------------------------------------------------------------- the CLI


@pytest.fixture
def no_publish(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Whatever happens, nothing starts a stack or publishes: such calls are recorded and refused."""
    calls: list[str] = []

    def refuse(name: str) -> Any:
        def fn(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called for input that should have been refused")
        return fn

    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    for var in (v for names in PROVIDER_KEYS.values() for v in names):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(stack, "up", refuse("stack.up"))
    monkeypatch.setattr(runner, "submit", refuse("runner.submit"))
    monkeypatch.setattr(stack, "running_stack", lambda settings: None)
    return calls


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse: usage + error, exit 2
        code = int(exc.code or 0)
    out = capsys.readouterr()
    text = out.err + out.out
    assert "Traceback" not in text, text
    return code, out.err


GOOD_MODELS = {"answering_models": [{"model_name": "openai/a"}], "parsing_models": [{"model_name": "openai/j"}]}


def _not(values: st.SearchStrategy[Any], *bad: Any) -> st.SearchStrategy[Any]:
    return values.filter(lambda v: v not in bad)


non_numeric_text = st.text(min_size=1, max_size=10).filter(lambda s: not s.strip().lstrip("+-").replace(".", "").isdigit())
BAD_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "replicate_count": st.one_of(st.integers(max_value=0), st.integers(min_value=1001), non_numeric_text,
                                 st.lists(st.integers(), max_size=2), st.booleans()),  # `true` was read as 1
    "evaluation_mode": _not(st.text(max_size=20), "template_only", "template_and_rubric", "rubric_only"),
    "rubric_evaluation_strategy": _not(st.text(max_size=20), "batch", "sequential"),
    "template_timeout_s": st.one_of(st.floats(max_value=0, allow_nan=False), non_numeric_text),
    "embedding_check_threshold": st.one_of(st.floats(min_value=1.001, allow_nan=False, allow_infinity=False),
                                           st.floats(max_value=-0.001, allow_nan=False, allow_infinity=False)),
    "abstention_enabled": st.one_of(non_numeric_text.filter(
        lambda s: s.lower() not in ("true", "false", "yes", "no", "on", "off", "t", "f", "y", "n")),
        st.lists(st.booleans(), min_size=1, max_size=2)),
}
MODEL_BAD_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_concurrency": st.one_of(st.integers(max_value=0), st.booleans()),
    "max_tokens": st.integers(max_value=0),
    "temperature": st.floats(max_value=-0.001, allow_nan=False, allow_infinity=False),
    # a typo of an interface was taken, and the error it caused later named a missing API key
    "interface": st.text(max_size=12).filter(lambda v: v not in INTERFACES),
    "timeout": st.floats(max_value=0, allow_nan=False),
    "max_retries": st.integers(max_value=-1),
    "no_such_option": json_values,
}


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_run_with_a_malformed_config_is_refused(tmp_path: Path, no_publish: list[str],
                                                capsys: pytest.CaptureFixture[str], data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["field", "model", "unknown", "not_a_mapping", "bad_yaml"]))
    config: Any = copy.deepcopy(GOOD_MODELS)
    if kind == "field":
        field = data.draw(st.sampled_from(sorted(BAD_FIELDS)))
        config[field] = data.draw(BAD_FIELDS[field])
        expect = [field]
    elif kind == "model":
        field = data.draw(st.sampled_from(sorted(MODEL_BAD_FIELDS)))
        which = data.draw(st.sampled_from(["answering_models", "parsing_models"]))
        config[which][0][field] = data.draw(MODEL_BAD_FIELDS[field])
        expect = [which, field]
    elif kind == "unknown":
        field = data.draw(st.from_regex(r"[a-z][a-z_]{2,15}", fullmatch=True).filter(
            lambda k: k not in cli_config_fields() and k not in ("gates", "budget_tokens")))
        config[field] = data.draw(json_values)
        expect = [field]
    elif kind == "not_a_mapping":
        # (a falsy document - 0, false, '' - reads as an empty config: refused for its missing models)
        config = data.draw(st.one_of(st.lists(scalars, min_size=1, max_size=3), st.integers().filter(bool),
                                     st.text(min_size=1).filter(lambda s: bool(_yaml_or_none(s))
                                                                and not isinstance(_yaml_or_none(s), dict))))
        expect = ["run config"]
    else:
        config = None
        expect = ["not valid YAML"]
    cfg = tmp_path / "run.yaml"
    if kind == "bad_yaml":
        cfg.write_text(data.draw(st.sampled_from(["a: [1, 2", "key: value\n  bad: indent", "{unclosed", ": :\n- x"])))
    else:
        cfg.write_text(_dump(config))
    code, err = _run_cli(["run", str(EXAMPLE), "--config", str(cfg), "--api-base", "http://127.0.0.1:9/v1"], capsys)
    assert code == 2, err
    assert err.startswith("veribus: error:"), err
    assert all(e in err for e in expect), (expect, err)
    assert no_publish == []


def _yaml_or_none(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def cli_config_fields() -> set[str]:
    from shared.core.config import VerificationConfig

    return set(VerificationConfig.model_fields)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(["--replicates", "--mode", "--strategy", "--timeout"]),
       value=st.text(alphabet=string.ascii_letters + string.digits + "-_.", min_size=1, max_size=8))
def test_run_with_malformed_options_is_refused(no_publish: list[str], capsys: pytest.CaptureFixture[str],
                                               option: str, value: str) -> None:
    valid = {"--mode": {"template_only", "template_and_rubric", "rubric_only"}, "--strategy": {"batch", "sequential"}}
    if option in valid:
        assume(value not in valid[option])
    if option == "--replicates":
        assume(not value.isdigit() or int(value) == 0 or int(value) > 1000)
    if option == "--timeout":
        assume(_not_a_float(value))
    code, err = _run_cli(["run", str(EXAMPLE), "--simulate", option, value], capsys)
    assert code == 2, err
    assert option.lstrip("-").split("-")[0] in err or "replicate_count" in err, err
    assert no_publish == []


def _not_a_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return True
    return False


@FUZZ
@given(doc=json_values)
def test_run_with_a_malformed_benchmark_is_refused(tmp_path: Path, no_publish: list[str],
                                                   capsys: pytest.CaptureFixture[str], doc: Any) -> None:
    path = tmp_path / "bench.yaml"
    path.write_text(_dump(doc))
    try:
        Benchmark.load(path)
        assume(False)  # a document that happens to be a valid benchmark is not this test's subject
    except BenchmarkError:
        pass
    code, err = _run_cli(["run", str(path), "--simulate"], capsys)
    assert code == 2 and err.startswith("veribus: error:") and str(path) in err, err
    assert no_publish == []


@pytest.mark.parametrize("argv", [["--model", "openai/m1", "--model", "openai/m1"],
                                  ["--model", "openai/m1", "--judge", "openai/j", "--judge", "openai/j"]])
def test_a_model_named_twice_is_refused_before_anything_starts(argv: list[str], no_publish: list[str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """One model listed twice made the same result ids twice: half the jobs vanished into the
    other half and the run never completed (it waited for results that could not come)."""
    code, err = _run_cli(["run", str(EXAMPLE), "--api-base", "http://127.0.0.1:9/v1", *argv], capsys)
    assert code == 2, err
    option = "--judge" if "--judge" in argv else "--model"
    assert err.startswith(f"veribus: error: {option}: entries 1 and 2 are the same model ("), err
    assert "overwrite each other's results" in err
    assert no_publish == []


def test_a_benchmark_without_questions_says_so(tmp_path: Path, no_publish: list[str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A header-only CSV was told to pass --include-unfinished, which cannot help: it has no questions."""
    empty = tmp_path / "empty.csv"
    empty.write_text("Question,Answer\n")
    code, err = _run_cli(["run", str(empty), "--simulate"], capsys)
    assert code == 2, err
    assert f"0 jobs to run: the benchmark has no questions (read from {empty})" in err, err
    assert "--include-unfinished" not in err
    assert no_publish == []
