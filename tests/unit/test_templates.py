"""Templates (validate, verify, regex, granular, VerifiedField) and callable traits, run in a real
sandbox with small limits; plus the in-process helpers (`compile_check`, `regex_trait_score`).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import msgspec
import pytest

from shared.templates.calls import (
    CallableTraitError,
    TemplateInfo,
    VerifyOutcome,
    regex_trait_score,
    run_callable_trait,
    run_verify,
    validate_template,
)
from shared.templates.sandbox import Sandbox
from shared.templates.static_checks import compile_check
from tests.support.pools import reaped_pool

CHECKPOINTS = Path(__file__).resolve().parents[3] / "shared" / "reference" / "karenina" / "checkpoints"
TIMEOUT_S = 4.0  # generous: a loaded shared machine must not turn a memory or crash case into a timeout
LOOP_TIMEOUT_S = 1.0  # the pool of the endless-loop cases: any wall limit stops them, a short one sooner
MEMORY_MB = 256


@pytest.fixture(scope="module")
def sb() -> Iterator[Sandbox]:
    with reaped_pool(workers=2, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB) as pool:
        yield pool


@pytest.fixture(scope="module")
def sb_loop() -> Iterator[Sandbox]:
    """The pool the endless loops run in (wall limit `LOOP_TIMEOUT_S`)."""
    with reaped_pool(workers=1, timeout_s=LOOP_TIMEOUT_S, memory_mb=MEMORY_MB) as pool:
        yield pool


def _pool(request: pytest.FixtureRequest, loops: bool) -> Sandbox:
    return request.getfixturevalue("sb_loop" if loops else "sb")


def _checkpoint_templates() -> list[tuple[str, str]]:
    out = []
    for path in sorted(CHECKPOINTS.glob("*.jsonld")):
        data = json.loads(path.read_text())
        for el in data["dataFeedElement"]:
            out.append((f"{path.stem}:{el['@id'].rsplit(':', 1)[-1]}", el["item"]["hasPart"]["text"]))
    return out


def _callable_traits() -> dict[str, tuple[str, str]]:
    data = json.loads((CHECKPOINTS / "with_rubrics.jsonld").read_text())
    out = {}
    for rating in data["rating"]:
        if rating.get("additionalType") == "karenina:GlobalCallableTrait":
            props = {p["name"]: p["value"] for p in rating["additionalProperty"]}
            out[rating["name"]] = (props["callable_code"], props["kind"])
    return out


REFERENCE_TEMPLATES = _checkpoint_templates()


def _wrong(value: Any) -> Any:
    """A value of the same type that no reference template accepts."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 7
    if isinstance(value, str):
        return "zzz unrelated"
    if isinstance(value, list):
        return ["zzz"]
    raise AssertionError(f"no wrong value for {value!r}")


async def _serves(sb: Sandbox) -> None:
    info = await validate_template(REFERENCE_TEMPLATES[0][1], "q", sandbox=sb)
    assert info.ok, info.error


# --------------------------------------------------------------------------- reference checkpoints


def test_the_checkpoints_hold_templates() -> None:
    assert len(REFERENCE_TEMPLATES) == 10  # 1 + 5 + 1 + 3


@pytest.mark.parametrize(("name", "code"), REFERENCE_TEMPLATES, ids=[n for n, _ in REFERENCE_TEMPLATES])
async def test_reference_template_validates_and_verifies(sb: Sandbox, name: str, code: str) -> None:
    assert compile_check(code) is None
    info = await validate_template(code, name, sandbox=sb)
    assert info.ok, info.error
    assert info.class_name == "Answer"
    assert info.ground_truth and set(info.ground_truth) == set(info.field_names)
    assert set(info.json_schema["properties"]) == set(info.field_names)
    assert info.json_schema["required"] == info.field_names
    assert not {"id", "correct"} & set(info.json_schema["properties"])
    assert info.has_verify_granular is False and info.regex_patterns == {} and info.composition_strategy is None

    right = await run_verify(code, dict(info.ground_truth), name, "raw text", sandbox=sb)
    assert right.error is None and right.field_verification_error is None
    assert right.template_verification_performed is True
    assert right.verify_result is True and right.field_verification_result is True
    assert right.parsed_llm_response == info.ground_truth
    assert right.parsed_gt_response == info.ground_truth
    assert right.regex_validations_performed is False and right.regex_overall_success is None

    wrong = await run_verify(code, {k: _wrong(v) for k, v in info.ground_truth.items()}, name, "", sandbox=sb)
    assert wrong.error is None and wrong.verify_result is False
    assert wrong.parsed_gt_response == info.ground_truth


async def test_reference_answers_in_judge_shape(sb: Sandbox) -> None:
    """The kind of values a judge returns (casing, extra keys, id) verify like the reference."""
    code = dict(REFERENCE_TEMPLATES)["with_rubrics:rq001"]
    ok = await run_verify(code, {"gene_name": "bcl2", "gene_function": "An Anti-Apoptotic regulator",
                                 "id": "judge-made-this-up", "reasoning": "extra key"}, "rq001", sandbox=sb)
    assert ok.verify_result is True
    assert ok.parsed_llm_response == {"gene_name": "bcl2", "gene_function": "An Anti-Apoptotic regulator"}
    code = dict(REFERENCE_TEMPLATES)["with_rubrics:rq002"]  # celsius == 100 OR fahrenheit == 212
    half = await run_verify(code, {"celsius": 99, "fahrenheit": 212}, "rq002", sandbox=sb)
    assert half.verify_result is True
    coerced = await run_verify(code, {"celsius": "100", "fahrenheit": 0}, "rq002", sandbox=sb)
    assert coerced.verify_result is True and coerced.parsed_llm_response == {"celsius": 100, "fahrenheit": 0}


# --------------------------------------------------------------------------- validation errors

TEMPLATE_OK = '''
from karenina.schemas.entities import BaseAnswer
from pydantic import Field

class Answer(BaseAnswer):
    result: int = Field(description="The result")

    def model_post_init(self, __context):
        self.correct = {"result": 4}

    def verify(self) -> bool:
        return self.result == self.correct["result"]
'''


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("class Answer(BaseAnswer):\n    x: int\n    def verify(self)\n        return True\n",
         "syntax error at line 3: expected ':'"),
        ("from karenina.schemas.entities import BaseAnswer\nclass Reply(dict):\n    pass\n", "no class named Answer"),
        ("class Answer:\n    def verify(self):\n        return True\n",
         "Answer is not a BaseAnswer/pydantic model (it must subclass BaseAnswer)"),
        ("from pydantic import BaseModel\nclass Answer(BaseModel):\n    x: int\n    def verify(self):\n        return True\n",
         "Answer is not a BaseAnswer/pydantic model (it must subclass BaseAnswer)"),
        ("from karenina.schemas.entities import BaseAnswer\nclass Answer(BaseAnswer):\n    x: int = 1\n",
         "Answer has no verify() method"),
        ("x = 1\ny = 2\nz = x / (y - 2)\n", "error executing template: ZeroDivisionError: division by zero (line 3)"),
        ("import karenina.not_a_module\n", "error executing template: ModuleNotFoundError"),
        ("from karenina.schemas.entities import BaseAnswer\nclass Answer(BaseAnswer):\n    x: int = 0\n"
         "    def model_post_init(self, ctx):\n        self.correct = [1]\n    def verify(self):\n        return True\n",
         "Answer.correct must be a dict, model_post_init set a list"),
        ("import sys\nsys.exit(2)\n", "template called sys.exit(2)"),
        ("   ", "template code is empty"),
    ],
    ids=["syntax", "no-answer", "not-a-model", "plain-pydantic", "no-verify", "raises", "bad-import",
         "correct-not-dict", "sys-exit", "empty"],
)
async def test_invalid_templates_are_named(sb: Sandbox, code: str, message: str) -> None:
    info = await validate_template(code, "q", sandbox=sb)
    assert info.ok is False
    assert info.error is not None and info.error.startswith(message), info.error


def test_compile_check_runs_nothing() -> None:
    assert compile_check(TEMPLATE_OK) is None
    assert compile_check("import os\nos._exit(3)\n") is None  # compiled, not executed: we are still here
    assert compile_check("def f(:\n    pass\n") == "syntax error at line 1: invalid syntax (def f(:)"
    assert compile_check("x = 1\n\x00") is not None


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("while True:\n    pass\n", f"template exceeded {LOOP_TIMEOUT_S} s wall time"),
        ("x = 'a' * 10**10\n", f"memory limit {MEMORY_MB} MB exceeded"),
        ("import os\nos._exit(3)\n", "worker exited with code 3"),
    ],
    ids=["loop", "memory", "os-exit"],
)
async def test_hostile_template_definitions(request: pytest.FixtureRequest, code: str, message: str) -> None:
    sb = _pool(request, "while True" in code)
    info = await validate_template(code, "q", sandbox=sb)
    assert info == TemplateInfo(ok=False, error=message)
    await _serves(sb)


# --------------------------------------------------------------------------- verification

HOSTILE_VERIFY = '''
from karenina.schemas.entities import BaseAnswer
from pydantic import Field

class Answer(BaseAnswer):
    value: int = Field(description="v")
    mode: str = Field(default="ok", description="m")

    def model_post_init(self, __context):
        self.correct = {"value": 1}

    def verify(self) -> bool:
        if self.mode == "raise":
            return {}["missing"]
        if self.mode == "loop":
            while True:
                pass
        if self.mode == "memory":
            hog = []
            while True:
                hog.append(" " * 20_000_000)  # big steps: the cap, not a loaded machine, decides
        if self.mode == "exit":
            import os
            os._exit(3)
        return self.value == self.correct["value"]

    def verify_granular(self) -> float:
        return 0.5
'''


async def test_verify_raising_is_not_fatal(sb: Sandbox) -> None:
    out = await run_verify(HOSTILE_VERIFY, {"value": 1, "mode": "raise"}, "q", sandbox=sb)
    assert out.error is None
    assert out.template_verification_performed is True
    assert out.verify_result is False and out.field_verification_result is False
    assert out.field_verification_error == "Field verification failed: KeyError: 'missing' (line 14)"
    assert out.verify_granular_result is None  # skipped after verify() raised
    assert out.parsed_llm_response == {"value": 1, "mode": "raise"} and out.parsed_gt_response == {"value": 1}
    ok = await run_verify(HOSTILE_VERIFY, {"value": 1}, "q", sandbox=sb)
    assert ok.verify_result is True and ok.verify_granular_result == 0.5


@pytest.mark.parametrize(
    ("mode", "message"),
    [("loop", f"template exceeded {LOOP_TIMEOUT_S} s wall time"),
     ("memory", f"memory limit {MEMORY_MB} MB exceeded"), ("exit", "worker exited with code 3")],
)
async def test_hostile_verify_is_stopped(request: pytest.FixtureRequest, mode: str, message: str) -> None:
    sb = _pool(request, mode == "loop")
    out = await run_verify(HOSTILE_VERIFY, {"value": 1, "mode": mode}, "q", sandbox=sb)
    assert out == VerifyOutcome(error=message)
    again = await run_verify(HOSTILE_VERIFY, {"value": 1}, "q", sandbox=sb)
    assert again.verify_result is True


async def test_parsed_dict_must_fit_the_template(sb: Sandbox) -> None:
    out = await run_verify(TEMPLATE_OK, {"result": "four"}, "q", sandbox=sb)
    assert out.template_verification_performed is False and out.verify_result is None
    assert out.error is not None and out.error.startswith("parsed response does not match the template: field 'result'")
    missing = await run_verify(TEMPLATE_OK, {}, "q", sandbox=sb)
    assert missing.error is not None and "field 'result': Field required" in missing.error
    broken = await run_verify("class Answer(:\n", {"result": 4}, "q", sandbox=sb)
    assert broken.error == "template invalid: syntax error at line 1: invalid syntax (class Answer(:)"


async def test_outcome_is_json_serialisable(sb: Sandbox) -> None:
    out = await run_verify(TEMPLATE_OK, {"result": 4}, "q", sandbox=sb)
    assert msgspec.json.decode(msgspec.json.encode(out))["verify_result"] is True
    info = await validate_template(TEMPLATE_OK, "q", sandbox=sb)
    assert msgspec.json.decode(msgspec.json.encode(info))["ground_truth"] == {"result": 4}


async def test_nothing_a_template_does_survives_its_call() -> None:
    """Every call runs in a fresh process forked from a clean zygote: a template that leaves
    marks in builtins (at class-body time, at verify time) finds none of them on its next call,
    and the same template id with different code is compiled from the code it is given."""
    counting = ("import builtins\nbuiltins.__dict__.setdefault('_vb_compiles', []).append(1)\n"
                "_seen = len(builtins._vb_compiles)\n" + TEMPLATE_OK.replace(
                    "return self.result == self.correct[\"result\"]",
                    "return self.result == self.correct[\"result\"] and _seen == 1"))
    assert "_seen == 1" in counting
    pool = Sandbox(workers=1, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    try:
        assert (await validate_template(counting, "q", template_id="tid-1", sandbox=pool)).ok
        verdicts = [(await run_verify(counting, {"result": v}, "q", template_id="tid-1", sandbox=pool)).verify_result
                    for v in (4, 5, 4, 4)]
        assert verdicts == [True, False, True, True]  # `_seen` is 1 on every call: a fresh interpreter each time
        reply = await pool.call("exec", code="import builtins\nresult = hasattr(builtins, '_vb_compiles')")
        assert reply == {"ok": True, "value": False}
        changed = TEMPLATE_OK.replace('"result": 4', '"result": 5')
        out = await run_verify(changed, {"result": 5}, "q", template_id="tid-1", sandbox=pool)
        assert out.verify_result is True
    finally:
        await pool.close()


async def test_template_styles_of_the_reference(sb: Sandbox) -> None:
    """ground_truth() instead of model_post_init, a custom class name, postponed annotations, the
    names the reference pre-binds (no import of BaseAnswer), Literal and Optional fields."""
    code = '''
from __future__ import annotations

from typing import Literal

class DrugTarget(BaseAnswer):
    target: str = Field(description="Protein target")
    kind: Literal["inhibitor", "agonist"] = Field(description="Mechanism")
    note: Optional[str] = None

    def ground_truth(self):
        self.correct = {"target": "BCL2", "kind": "inhibitor"}

    def verify(self) -> bool:
        return self.target.upper().replace("-", "") == self.correct["target"] and self.kind == self.correct["kind"]
'''
    info = await validate_template(code, "q", sandbox=sb)
    assert info.ok, info.error
    assert info.class_name == "DrugTarget"
    assert info.ground_truth == {"target": "BCL2", "kind": "inhibitor"}
    assert info.json_schema["properties"]["kind"]["enum"] == ["inhibitor", "agonist"]
    assert info.field_names == ["target", "kind", "note"] and info.json_schema["required"] == ["target", "kind"]
    out = await run_verify(code, {"target": "Bcl-2", "kind": "inhibitor"}, "q", sandbox=sb)
    assert out.verify_result is True and out.parsed_llm_response == {"target": "Bcl-2", "kind": "inhibitor",
                                                                     "note": None}
    assert (await run_verify(code, {"target": "Bcl-2", "kind": "agonist"}, "q", sandbox=sb)).verify_result is False


# --------------------------------------------------------------------------- granular, VerifiedField

DECLARATIVE = '''
from karenina.schemas.entities import BaseAnswer, VerifiedField
from karenina.schemas.entities.primitives import BooleanMatch, ExactMatch, NumericTolerance, SetContainment
from karenina.schemas.entities.composition import AnyOf, AllOf, AtLeastN, FieldCheck

class Answer(BaseAnswer):
    target: str = VerifiedField(description="Target protein", ground_truth="BCL2",
                                verify_with=ExactMatch(normalize=["lowercase", "strip", "remove_punctuation"]))
    approved: bool = VerifiedField(description="FDA approved?", ground_truth=True, verify_with=BooleanMatch(),
                                   weight=2.0)
    dose_mg: float = VerifiedField(description="Dose in mg", ground_truth=400, verify_with=NumericTolerance(tolerance=0.1))
    genes: list[str] = VerifiedField(description="Genes", ground_truth=["BCL2", "MCL1"],
                                     verify_with=SetContainment(mode="superset"))
    STRATEGY
'''


@pytest.mark.parametrize(
    ("strategy", "label", "verify", "granular"),
    [
        ("", "all_of", False, 3.0 / 5.0),
        ("class VerificationStrategy:\n        verify_strategy = AnyOf(conditions=[FieldCheck(field='approved'),"
         " FieldCheck(field='target')])", "any_of", True, 1.0 / 5.0),
        ("class VerificationStrategy:\n        verify_strategy = AtLeastN(n=2, conditions=[FieldCheck(field='target'),"
         " FieldCheck(field='dose_mg'), FieldCheck(field='genes')])", "at_least_n(2)", True, 2.0 / 5.0),
    ],
    ids=["default-all-of", "any-of", "at-least-n"],
)
async def test_verified_fields_and_composition(
    sb: Sandbox, strategy: str, label: str, verify: bool, granular: float
) -> None:
    code = DECLARATIVE.replace("STRATEGY", strategy)
    info = await validate_template(code, "q", sandbox=sb)
    assert info.ok, info.error
    assert info.composition_strategy == label and info.has_verify_granular is True
    assert info.ground_truth == {"target": "BCL2", "approved": True, "dose_mg": 400, "genes": ["BCL2", "MCL1"]}
    assert "__verification__" not in json.dumps(info.json_schema)  # ground truth never reaches the judge
    assert "BCL2" not in json.dumps(info.json_schema)
    parsed = {"target": " Bcl2. ", "approved": False, "dose_mg": 430.0, "genes": ["MCL1", "BCL2", "TP53"]}
    out = await run_verify(code, parsed, "q", sandbox=sb)
    assert out.error is None and out.field_verification_error is None
    assert out.field_results == {"target": True, "approved": False, "dose_mg": True, "genes": True}
    assert out.composition_strategy == label
    assert out.verify_result is verify
    assert out.verify_granular_result == pytest.approx(granular)


# --------------------------------------------------------------------------- regex checks

REGEX_TEMPLATE = '''
from karenina.schemas.entities import BaseAnswer
from pydantic import Field

class Answer(BaseAnswer):
    year: str = Field(description="Year of discovery")

    def ground_truth(self):
        self.correct = {"year": "1928"}
        self.regex = {
            "year": {"pattern": r"\\b1928\\b", "expected": "1928", "match_type": "exact"},
            "citations": {"pattern": r"\\[\\d+\\]", "expected": 2, "match_type": "count"},
            "names": {"pattern": r"\\b(Fleming|Florey|Chain)\\b", "expected": ["Fleming", "Florey"], "match_type": "all"},
        }

    def verify(self) -> bool:
        return "1928" in self.year
'''


async def test_regex_validations(sb: Sandbox) -> None:
    info = await validate_template(REGEX_TEMPLATE, "q", sandbox=sb)
    assert info.ok, info.error
    assert info.regex_patterns == {"year": r"\b1928\b", "citations": r"\[\d+\]",
                                   "names": r"\b(Fleming|Florey|Chain)\b"}
    good_text = "Fleming found it in 1928 [1]; Florey and Chain purified it [2]."
    good = await run_verify(REGEX_TEMPLATE, {"year": "1928"}, "q", good_text, sandbox=sb)
    assert good.regex_validations_performed is True
    assert good.regex_validation_results == {"year": True, "citations": True, "names": True}
    assert good.regex_overall_success is True and good.verify_result is True
    assert good.regex_extraction_results == {"year": ["1928"], "citations": ["[1]", "[2]"],
                                             "names": ["Fleming", "Florey", "Chain"]}
    assert good.regex_validation_details["citations"]["match_count"] == 2
    assert good.regex_validation_details["year"]["pattern"] == r"\b1928\b"
    assert good.regex_validation_details["year"]["expected"] == "1928"

    # fields right, regex wrong: verify_result = field AND regex
    bad = await run_verify(REGEX_TEMPLATE, {"year": "1928"}, "q", "Fleming, 1928 [1].", sandbox=sb)
    assert bad.field_verification_result is True
    assert bad.regex_validation_results == {"year": True, "citations": False, "names": False}
    assert bad.regex_overall_success is False and bad.verify_result is False
    assert "Missing".lower() in bad.regex_validation_details["names"]["failure_reason"].lower()


async def test_regex_only_template(sb: Sandbox) -> None:
    code = '''
class Answer(BaseAnswer):
    def model_post_init(self, __context):
        self.regex = {"mechanism": {"pattern": r"\\b(activates|inhibits)\\b", "expected": "inhibits",
                                    "match_type": "contains"}}
'''
    info = await validate_template(code, "q", sandbox=sb)
    assert info.ok, info.error
    assert info.field_names == [] and info.regex_patterns == {"mechanism": r"\b(activates|inhibits)\b"}
    yes = await run_verify(code, {}, "q", "The drug inhibits BCL2", sandbox=sb)
    assert yes.verify_result is True and yes.regex_extraction_results == {"mechanism": ["inhibits"]}
    no = await run_verify(code, {}, "q", "The drug activates BCL2", sandbox=sb)
    assert no.verify_result is False and no.field_verification_result is True


# --------------------------------------------------------------------------- callable traits


async def test_reference_callable_traits(sb: Sandbox) -> None:
    traits = _callable_traits()
    code, kind = traits["ContainsCitations"]
    assert kind == "boolean"
    assert await run_callable_trait(code, "BCL2 is anti-apoptotic [1].", kind, sandbox=sb) is True
    assert await run_callable_trait(code, "BCL2 is anti-apoptotic.", kind, sandbox=sb) is False
    code, kind = traits["ResponseLength"]
    assert kind == "score"
    assert await run_callable_trait(code, "short answer", kind, sandbox=sb) == 1
    assert await run_callable_trait(code, " ".join(["word"] * 60), kind, sandbox=sb) == 3
    assert await run_callable_trait(code, " ".join(["word"] * 500), kind, min_score=1, max_score=5, sandbox=sb) == 5


async def test_cloudpickled_callable(sb: Sandbox) -> None:
    def has_doi(trace: str) -> bool:
        import re

        return re.search(r"10\.\d{4,}/", trace) is not None

    pickled = base64.b64encode(cloudpickle.dumps(has_doi)).decode("ascii")
    assert await run_callable_trait(pickled, "see doi 10.1000/xyz", "boolean", sandbox=sb) is True
    assert await run_callable_trait(pickled, "no reference", "boolean", sandbox=sb) is False
    def _count_words(trace: str) -> int:
        return min(len(trace.split()), 10)

    raw = cloudpickle.dumps(_count_words)  # raw pickle bytes, as the reference keeps them in memory
    assert await run_callable_trait(raw, "one two three", "score", sandbox=sb) == 3


async def test_plain_source_callable(sb: Sandbox) -> None:
    src = "def evaluate(trace: str) -> bool:\n    return 'BCL2' in trace\n"
    assert await run_callable_trait(src, "BCL2 inhibitor", "boolean", sandbox=sb) is True
    single = "import math\n\ndef score_it(text):\n    return math.floor(len(text) / 4)\n"
    assert await run_callable_trait(single, "12345678", "score", sandbox=sb) == 2


@pytest.mark.parametrize(
    ("code", "kind", "message"),
    [
        ("def evaluate(t):\n    return 'yes'\n", "boolean", "callable trait of kind 'boolean' returned str, expected bool"),
        ("def evaluate(t):\n    return None\n", "score", "callable trait of kind 'score' returned NoneType, expected int"),
        ("def evaluate(t):\n    return 1 / 0\n", "boolean", "callable trait raised ZeroDivisionError: division by zero"),
        ("def evaluate(t):\n    while True:\n        pass\n", "boolean",
         f"callable trait exceeded {LOOP_TIMEOUT_S} s wall time"),
        ("def evaluate(t):\n    return 'a' * 10**10\n", "boolean", f"memory limit {MEMORY_MB} MB exceeded"),
        ("def evaluate(t)\n    return True\n", "boolean", "callable trait source: syntax error at line 1"),
        ("x = 1\n", "boolean", "callable trait source must define evaluate(trace: str)"),
        ("def evaluate(t):\n    return 9\n", "score", "score 9 is above max_score 5"),
        ("def evaluate(t):\n    return True\n", "literal", "unknown callable trait kind 'literal'"),
    ],
    ids=["bool-kind-wrong-type", "score-kind-wrong-type", "raises", "loop", "memory", "syntax", "no-function",
         "above-max", "bad-kind"],
)
async def test_callable_trait_errors(request: pytest.FixtureRequest, code: str, kind: str, message: str) -> None:
    sb = _pool(request, "while True" in code)
    with pytest.raises(CallableTraitError) as err:
        await run_callable_trait(code, "some text", kind, min_score=1, max_score=5, sandbox=sb)
    assert str(err.value).startswith(message), str(err.value)
    await _serves(sb)


def test_regex_trait_score() -> None:
    assert regex_trait_score(r"\[\d+\]", "see [12]", case_sensitive=True, invert=False) is True
    assert regex_trait_score(r"\[\d+\]", "see [12]", case_sensitive=True, invert=True) is False
    assert regex_trait_score("bcl2", "BCL2 binds", case_sensitive=True, invert=False) is False
    assert regex_trait_score("bcl2", "BCL2 binds", case_sensitive=False, invert=False) is True
    assert regex_trait_score("sorry", "Here is the answer", case_sensitive=False, invert=True) is True


async def test_verify_round_trip_cost(sb: Sandbox) -> None:
    """Repeated run_verify calls keep their verdict; the parent's CPU per call (encode, IPC,
    decode, msgspec.convert) is printed as a measurement, not asserted."""
    await sb.start()
    code = dict(REFERENCE_TEMPLATES)["with_rubrics:rq001"]
    parsed = {"gene_name": "BCL2", "gene_function": "anti-apoptotic protein"}
    for _ in range(5):
        await run_verify(code, parsed, "q", "raw", template_id="rq001", sandbox=sb)
    n = 30
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        out = await run_verify(code, parsed, "q", "raw", template_id="rq001", sandbox=sb)
    cpu = (time.process_time() - cpu0) / n
    wall = (time.perf_counter() - wall0) / n
    assert out.verify_result is True
    print(f"run_verify: parent CPU {cpu * 1e6:.0f} us/call, round trip {wall * 1e6:.0f} us")


def _int_answer(value: int) -> str:
    return ("class Answer(BaseAnswer):\n    value: int\n\n"
            "    def model_post_init(self, __context):\n"
            f"        self.correct = {{'value': {value}}}\n\n"
            "    def verify(self) -> bool:\n        return self.value == self.correct['value']\n")


def test_worker_class_cache_drops_the_modules_it_evicts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's class cache (which counts the entries per module instead of scanning
    sys.modules) removes exactly the modules no cached class lives in any more, and no other
    module (trusted code, run in-process on purpose)."""
    import sys
    import types

    from shared.templates import calls

    monkeypatch.setattr(calls, "_CACHE_MAX", 2)
    monkeypatch.setattr(calls, "_CLASSES", type(calls._CLASSES)())
    monkeypatch.setattr(calls, "_MODULE_USERS", {})
    monkeypatch.setitem(sys.modules, "veribus_template_not_cached", types.ModuleType("veribus_template_not_cached"))
    before = {m for m in sys.modules if m.startswith("veribus_template_")}
    first = calls._template_class(_int_answer(1), "t1")
    shared_code = calls._template_class(_int_answer(1), "t1-copy")  # same code, other id: same module
    assert first.__module__ == shared_code.__module__ and first.__module__ in sys.modules
    calls._template_class(_int_answer(2), "t2")  # evicts t1; t1-copy still lives in the module
    assert first.__module__ in sys.modules
    replaced = calls._template_class(_int_answer(3), "t2")  # same id, new code: t2's old module goes
    gone = {m for m in sys.modules if m.startswith("veribus_template_")} - before
    assert gone == {first.__module__, replaced.__module__}
    calls._template_class(_int_answer(4), "t4")  # evicts t1-copy: nothing lives in t1's module now
    assert first.__module__ not in sys.modules
    assert "veribus_template_not_cached" in sys.modules  # not the cache's to drop
    assert calls._MODULE_USERS == {c.__module__: 1 for _, c, _ in calls._CLASSES.values()}
    for name in {m for m in sys.modules if m.startswith("veribus_template_")} - before:
        del sys.modules[name]


_SCHEMA_TEMPLATES = [
    ("defaults", "import datetime, enum\nfrom typing import Literal\n\nclass Kind(enum.Enum):\n    A = 'a'\n    B = 'b'\n\n"
                 "class Inner(BaseModel):\n    x: float = float('inf')\n\n"
                 "class Answer(BaseAnswer):\n    n: int = 3\n    f: float = float('nan')\n    s: str = 'x'\n"
                 "    b: bool = True\n    when: datetime.date = datetime.date(2020, 1, 2)\n    kind: Kind = Kind.B\n"
                 "    lit: Literal['p', 'q'] = 'q'\n    items: list[Inner] = [Inner()]\n    opt: int | None = None\n"
                 "    big: int = 10 ** 30\n    tags: set[str] = {'t'}\n\n"
                 "    def verify(self) -> bool:\n        return True\n"),
    ("aliases", "class Answer(BaseAnswer):\n    model_config = ConfigDict(json_schema_mode_override='serialization')\n"
                "    value: int = Field(2, alias='Value', description='d')\n\n"
                "    def verify(self) -> bool:\n        return True\n"),
]


@pytest.fixture
def karenina_aliases() -> Iterator[None]:
    """The reference's import names, in this process for one test only (other tests check that
    a service process never has them)."""
    import sys

    from shared.templates import answer

    before = set(sys.modules)
    answer.install_karenina_aliases()
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            if name == "karenina" or name.startswith("karenina."):
                del sys.modules[name]


@pytest.mark.parametrize("name,code", [*REFERENCE_TEMPLATES, *_SCHEMA_TEMPLATES])
def test_judge_schema_is_pydantics(name: str, code: str, karenina_aliases: None) -> None:
    """The judge's schema (built with a cheaper generator) is the one pydantic's own generator
    builds, minus our internal fields (trusted templates, compiled in-process on purpose)."""
    import sys

    from pydantic.json_schema import GenerateJsonSchema

    from shared.templates import answer, calls

    code = "from pydantic import BaseModel, ConfigDict\n" + code
    cls = calls._compile_template(code, "veribus_template_schema_test")
    try:
        got = cls.judge_json_schema()
        with pytest.MonkeyPatch.context() as mp:  # the same method, with pydantic's default generator
            mp.setattr(answer, "_MODEL_JSON_SCHEMA", None)
            expected = cls.judge_json_schema()
        assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)
        assert json.dumps(got, sort_keys=True) == json.dumps(
            _without_internal(cls.model_json_schema(schema_generator=GenerateJsonSchema)), sort_keys=True)
    finally:
        sys.modules.pop("veribus_template_schema_test", None)


def _without_internal(schema: dict[str, Any]) -> dict[str, Any]:
    from shared.templates.answer import _VERIFICATION_KEY, INTERNAL_FIELDS, _strip_key

    for name in INTERNAL_FIELDS:
        schema.get("properties", {}).pop(name, None)
    if "required" in schema:
        schema["required"] = [r for r in schema["required"] if r not in INTERNAL_FIELDS] or None
        if schema["required"] is None:
            del schema["required"]
    schema.pop("additionalProperties", None)
    _strip_key(schema, _VERIFICATION_KEY)
    return schema


def test_base_answer_fields_are_what_pydantic_builds() -> None:
    """BaseAnswer hands pydantic ready-made schemas for `id` and `correct` (cheaper per
    template class); a template built on it validates, dumps and describes itself exactly as one
    built on the plain annotations does."""
    import re

    from pydantic import BaseModel, Field, ValidationError
    from pydantic.json_schema import SkipJsonSchema

    from shared.templates.answer import BaseAnswer

    class Plain(BaseModel):
        model_config = BaseAnswer.model_config
        id: str | None = None
        correct: SkipJsonSchema[dict[str, Any] | None] = Field(default=None, exclude=True)

        def model_post_init(self, context: Any, /) -> None:
            return None

    def answer_on(base: type[BaseModel]) -> type[BaseModel]:
        class Answer(base):  # type: ignore[misc, valid-type]
            value: int = Field(description="v")
        return Answer

    ours, plain = answer_on(BaseAnswer), answer_on(Plain)

    def shape(cls: type[BaseModel]) -> str:
        text = json.dumps(cls.__pydantic_core_schema__, default=repr, sort_keys=True)
        return re.sub(r"at 0x[0-9a-f]+|:\d+|\b(BaseAnswer|Plain)\b", "", text)

    assert shape(ours) == shape(plain)
    assert ours.model_json_schema() == plain.model_json_schema()
    for data in ({"value": 1}, {"value": "2", "id": "q"}, {"value": 3, "id": None, "correct": {"a": 1}}):
        assert ours.model_validate(data).model_dump() == plain.model_validate(data).model_dump()
    for bad in ({"value": 1, "id": 5}, {"value": 1, "correct": [1]}, {"value": 1, "correct": {1: 2}}):
        errors = []
        for cls in (ours, plain):
            try:
                cls.model_validate(bad)
                errors.append(None)
            except ValidationError as exc:
                errors.append(exc.errors(include_url=False))
        assert errors[0] == errors[1], bad


def test_a_template_does_not_rebind_the_next_ones_names() -> None:
    """A template defining a Primitive named like one of ours (it registers itself) leaves the
    names the next template of the same sandbox process starts with as they were (trusted code,
    in-process on purpose)."""
    import sys

    from shared.templates import answer, calls

    ours = answer.template_namespace()["ExactMatch"]
    shadow = ("class ExactMatch(ExactMatch):\n    def check(self, extracted, expected):\n        return True\n\n"
              "class Answer(BaseAnswer):\n    value: int\n\n    def verify(self) -> bool:\n        return True\n")
    try:
        calls._compile_template(shadow, "veribus_template_shadow_test")
        assert answer._PRIMITIVES["ExactMatch"] is not ours  # what the attack changes
        assert answer.template_namespace()["ExactMatch"] is ours
    finally:
        answer._PRIMITIVES["ExactMatch"] = ours
        sys.modules.pop("veribus_template_shadow_test", None)


async def test_call_processes_start_with_no_template(sb: Sandbox) -> None:
    """The zygote warms pydantic up with a template of its own before it forks; a call process
    inherits none of it: an empty class cache and no template module."""
    probe = ("import sys\nimport shared.templates.calls as c\n"
             "result = [len(c._CLASSES), len(c._MODULE_USERS), sorted(m for m in sys.modules if m.startswith('veribus_template_'))]")
    assert await sb.call("exec", code=probe) == {"ok": True, "value": [0, 0, []]}
    assert await sb.call("exec", code=probe, scope="fresh-run") == {"ok": True, "value": [0, 0, []]}
