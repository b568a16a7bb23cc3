"""Conformance with real judge replies: the recorded claude-haiku-4-5 replies of the reference
(/work/shared/reference/karenina/llm_responses/claude-haiku-4-5/) are fed back as model output through
our stage functions, with the real `LLMClient` (its JSON extraction, validation and usage accounting);
only litellm's transport is replaced by a double that returns the recorded text.

Each recorded file holds the reference's request (question, response, schema/traits) and the reply;
the test rebuilds the same job from the request and checks our stages read the reply correctly:
fenced JSON, the rubric's `{"scores": ...}` / `{"result": ...}` / `{"score": ...}` shapes, abstention
refusals, and deep-judgment excerpt JSON. Expected values come from an independent parse of the reply
(fence-stripped `json.loads`) and, for verification, from the questions' known answers.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.guards.stage import check_guards
from services.parsing.stage import parse_template
from services.rubric.stage import evaluate_rubric
from services.verification.stage import verify_template
from shared.core import events
from shared.core.ids import template_id_for
from shared.core.rubric import LLMRubricTrait, Rubric
from shared.runtime.llm import transport as llm_transport
from shared.runtime.llm.client import LLMClient
from shared.templates.calls import validate_template
from tests.conftest import LLM_RESPONSES

# ---------------------------------------------------------------- recorded files


def recorded(*scenarios: str) -> list[Any]:
    files = sorted(p for s in scenarios for p in (LLM_RESPONSES / s).glob("*.json"))
    assert files, f"no recorded replies for {scenarios} under {LLM_RESPONSES}"
    return [pytest.param(p, id=f"{p.parent.name}/{p.stem[:8]}") for p in files]


def load(path: Path) -> tuple[str, str, str]:
    """(system text, user text, reply text) of a recorded exchange."""
    data = json.loads(path.read_text(encoding="utf-8"))
    msgs = data["request"]["messages"]
    system = next(m["content"] for m in msgs if "system" in m["type"].lower())
    user = next(m["content"] for m in msgs if "human" in m["type"].lower())
    return system, user, data["response"]["content"]


def between(text: str, start: str, end: str) -> str:
    i = text.index(start) + len(start)
    return text[i:text.index(end, i)].strip()


def oracle(reply: str) -> Any:
    """The reply's JSON, parsed independently of shared.runtime.llm.reply.extract_json."""
    body = re.sub(r"^```(?:json)?\s*|\s*```$", "", reply.strip())
    return json.loads(body)


# ---------------------------------------------------------------- the transport double


class FakeLitellm:
    """Stands in for the litellm module: `acompletion` answers with `route(messages)`."""

    def __init__(self) -> None:
        self.route: Any = None
        self.requests: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []

    async def acompletion(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        self.requests.append((messages, kwargs))
        text = self.route(messages)
        message = SimpleNamespace(content=text, tool_calls=None)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)],
                               usage={"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120})


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeLitellm:
    double = FakeLitellm()
    monkeypatch.setattr(llm_transport, "_litellm", double)
    return double


def make_job(question: str, template: str | None = None, rubric: Rubric | None = None, mode: str = "template_only",
             options: dict[str, Any] | None = None) -> events.Job:
    return events.Job(
        run_id="r", result_id="res-ref", answer_id="a", question_id="q-ref", question_text=question,
        answering=events.ModelSpec(model_name="anthropic/claude-haiku-4-5"),
        parsing=events.ModelSpec(model_name="anthropic/claude-haiku-4-5"), timestamp="2026-01-13T00:00:00+00:00",
        evaluation_mode=mode, template_code=template, template_id=template_id_for(template) if template else "no_template",
        rubric=rubric.to_wire() if rubric else None, options=options or {},
    )


def status(state: events.State, stage: str) -> tuple[str, str]:
    rec = [r for r in state.stages if r.stage == stage][-1]
    return rec.status, rec.reason


_PY = {"string": "str", "integer": "int", "boolean": "bool", "number": "float"}


def template_code(fields: dict[str, tuple[str, str]], correct: dict[str, Any]) -> str:
    """An Answer template with `fields` (name -> (python type, description)) that checks `correct`."""
    lines = ["from karenina.schemas.entities import BaseAnswer", "from pydantic import Field", "",
             "class Answer(BaseAnswer):"]
    lines += [f"    {name}: {typ} = Field(description={desc!r})" for name, (typ, desc) in fields.items()]
    lines += ["", "    def model_post_init(self, __context):", f"        self.correct = {correct!r}", "",
              "    def verify(self) -> bool:",
              "        return all(getattr(self, k) == v for k, v in self.correct.items())", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- template parsing (fenced JSON)

# the questions' known answers (what a correct response must contain), independent of the replies
KNOWN_ANSWERS: dict[str, dict[str, Any]] = {
    "What is the approved gene symbol, chromosome location, and function of the B-cell leukemia/lymphoma 2 gene?":
        {"gene_symbol": "BCL2", "chromosome": "18q21.33"},
    "What is the approved gene symbol, chromosome location, and primary function of the BCL2 gene?":
        {"gene_symbol": "BCL2", "chromosome": "18q21.33"},
    "What is BCL2 and what role does it play in cancer?": {"gene_name": "BCL2"},
    "Does the Earth orbit the Sun?": {"is_correct": True},
    "What is 2+2?": {"result": 4},
    "Is the statement 'All squares are rectangles' true or false?": {"is_true": True},
}


@pytest.mark.parametrize("path", recorded("template_parsing", "e2e_template", "e2e_template_simple",
                                          "e2e_template_multifield"))
def test_template_parsing_replies(path: Path, fake: FakeLitellm) -> None:
    _system, user, reply = load(path)
    question = between(user, "**ORIGINAL QUESTION:**", "**RESPONSE TO PARSE:**")
    response = between(user, "**RESPONSE TO PARSE:**", "**JSON SCHEMA")
    schema = json.loads(between(user, "```json", "```"))
    fields = {n: (_PY[p["type"]], p.get("description", "")) for n, p in schema["properties"].items() if n != "id"}
    code = template_code(fields, KNOWN_ANSWERS[question])
    fake.route = lambda messages: reply
    expected = oracle(reply)

    async def run() -> events.State:
        info = await validate_template(code, "q-ref")
        assert info.ok and list(info.json_schema["properties"]) == list(fields)
        j = make_job(question, code)
        st = await parse_template(j, events.State(template={"raw_llm_response": response}), LLMClient(), info)
        return await verify_template(j, st)

    st = asyncio.run(run())
    assert st.error is None and st.signals.parsed == expected  # fenced JSON, extra "id": null kept as sent
    assert st.template["parsed_llm_response"] == {k: v for k, v in expected.items() if k != "id"}
    assert st.template["verify_result"] is True
    # priced from litellm's map: 100 x $1/M in + 20 x $5/M out
    assert st.usage["parsing"] == {"input_tokens": 100, "output_tokens": 20, "total_tokens": 120,
                                   "model": "anthropic/claude-haiku-4-5", "model_calls": 1, "cached_replies": 0,
                                   "cost_usd": 0.0002}
    sent = fake.requests[0][0][-1]["content"]
    assert question in sent and response in sent


# ---------------------------------------------------------------- abstention (refusals)


@pytest.mark.parametrize("path", recorded("abstention", "e2e_abstention"))
def test_abstention_replies(path: Path, fake: FakeLitellm) -> None:
    _system, user, reply = load(path)
    question = between(user, "<original_question>", "</original_question>")
    response = between(user, "<model_response>", "</model_response>")
    fake.route = lambda messages: reply
    expected = oracle(reply)
    j = make_job(question, template_code({"answer": ("str", "the answer")}, {}), options={"abstention_enabled": True})

    async def run() -> events.State:
        st = await check_guards(j, events.State(template={"raw_llm_response": response}), LLMClient(), None)
        return await parse_template(j, st, LLMClient(), None)

    st = asyncio.run(run())
    t = st.template
    assert t["abstention_check_performed"] is True
    assert t["abstention_detected"] is expected["abstention_detected"]
    assert t["abstention_reasoning"] == expected["reasoning"]
    assert t["abstention_override_applied"] is expected["abstention_detected"]
    if expected["abstention_detected"]:
        assert status(st, "parse_template") == ("skipped", "abstention detected")


def test_recorded_abstention_set_has_both_verdicts() -> None:
    verdicts = {oracle(load(p.values[0])[2])["abstention_detected"] for p in recorded("abstention", "e2e_abstention")}
    assert verdicts == {True, False}


# ---------------------------------------------------------------- rubric evaluation ({"scores": ...} / single)

_TRAIT_LINE = re.compile(r"^- \*\*(?P<name>[^*]+)\*\* \((?P<kind>boolean|score (?P<lo>\d+)-(?P<hi>\d+))\): (?P<desc>.*)$")


@pytest.mark.parametrize("path", recorded("rubric_evaluation", "e2e_rubric_batch"))
def test_batch_rubric_replies(path: Path, fake: FakeLitellm) -> None:
    _system, user, reply = load(path)
    traits = []
    for line in between(user, "**TRAITS TO EVALUATE:**", "**QUESTION:**").splitlines():
        m = _TRAIT_LINE.match(line.strip())
        if m:
            if m["kind"] == "boolean":
                traits.append(LLMRubricTrait(name=m["name"], kind="boolean", description=m["desc"]))
            else:
                traits.append(LLMRubricTrait(name=m["name"], kind="score", min_score=int(m["lo"]),
                                             max_score=int(m["hi"]), description=m["desc"]))
    assert traits
    question = between(user, "**QUESTION:**", "**ANSWER TO EVALUATE:**")
    answer = between(user, "**ANSWER TO EVALUATE:**", "**JSON SCHEMA")
    fake.route = lambda messages: reply
    j = make_job(question, rubric=Rubric(llm_traits=traits), mode="rubric_only",
                 options={"rubric_evaluation_strategy": "batch"})
    st = asyncio.run(evaluate_rubric(j, events.State(template={"raw_llm_response": answer}), LLMClient()))
    scores = st.rubric["llm_trait_scores"]
    assert scores == oracle(reply)["scores"] and st.rubric["trait_errors"] is None
    assert all(type(scores[t.name]) is (bool if t.kind == "boolean" else int) for t in traits)
    assert len(fake.requests) == 1


@pytest.mark.parametrize("path", recorded("e2e_rubric", "e2e_rubric_sequential"))
def test_single_trait_rubric_replies(path: Path, fake: FakeLitellm) -> None:
    _system, user, reply = load(path)
    name = between(user, "**TRAIT:**", "**CRITERIA:**")
    criteria = between(user, "**CRITERIA:**", "**JSON SCHEMA")
    boolean = '"title": "SingleBooleanScore"' in user
    trait = (LLMRubricTrait(name=name, kind="boolean", description=criteria) if boolean else
             LLMRubricTrait(name=name, kind="score", min_score=1, max_score=5, description=criteria))
    question = between(user, "**QUESTION:**", "**ANSWER TO EVALUATE:**")
    answer = between(user, "**ANSWER TO EVALUATE:**", "**TRAIT:**")
    fake.route = lambda messages: reply
    j = make_job(question, rubric=Rubric(llm_traits=[trait]), mode="rubric_only",
                 options={"rubric_evaluation_strategy": "sequential"})
    st = asyncio.run(evaluate_rubric(j, events.State(template={"raw_llm_response": answer}), LLMClient()))
    value = next(iter(oracle(reply).values()))  # {"result": true} or {"score": 5}
    assert st.rubric["llm_trait_scores"] == {name: value} and st.rubric["trait_errors"] is None


# ---------------------------------------------------------------- deep judgment excerpts

DJ_TEMPLATES: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "What is the boiling point of water at sea level?": ({"celsius": "int", "fahrenheit": "int"},
                                                         {"celsius": 100, "fahrenheit": 212}),
    "When was the first moon landing and who commanded the mission?": (
        {"year": "int", "month": "str", "commander": "str"}, {"year": 1969, "month": "July",
                                                              "commander": "Neil Armstrong"}),
}


def deep_judgment_case(path: Path) -> tuple[str, str, dict[str, str], str, str]:
    system, user, reply = load(path)
    question = between(user, "<original_question>", "</original_question>")
    response = between(user, "<response_to_analyze>", "</response_to_analyze>")
    block = between(system, "evidence to look for:", "# Extraction Protocol")
    attrs = dict(line[2:].split(": ", 1) for line in block.splitlines() if line.startswith("- "))
    return question, response, attrs, reply, system


def route_deep_judgment(reply: str, answers: dict[str, Any]) -> Any:
    """Stage 1 answers with the recorded reply; reasoning and parameters (not recorded) are scripted."""
    def route(messages: list[dict[str, Any]]) -> str:
        system = messages[0]["content"]
        if "You extract verbatim evidence" in system:
            return reply
        if "You explain, attribute by attribute" in system:
            return json.dumps({a: f"The excerpts state the {a}." for a in answers})
        return "```json\n" + json.dumps(answers) + "\n```"
    return route


async def deep_parse(question: str, response: str, attrs: dict[str, str], options: dict[str, Any]) -> events.State:
    types, correct = DJ_TEMPLATES[question]
    code = template_code({a: (types[a], attrs[a]) for a in attrs}, correct)
    j = make_job(question, code, options={"deep_judgment_enabled": True, **options})
    info = await validate_template(code, "q-ref")
    st = await parse_template(j, events.State(template={"raw_llm_response": response}), LLMClient(), info)
    return await verify_template(j, st)


@pytest.mark.parametrize("path", recorded("e2e_deep_judgment"))
def test_deep_judgment_excerpt_replies(path: Path, fake: FakeLitellm) -> None:
    question, response, attrs, reply, _system = deep_judgment_case(path)
    fake.route = route_deep_judgment(reply, DJ_TEMPLATES[question][1])
    st = asyncio.run(deep_parse(question, response, attrs, {}))
    dj = st.deep_judgment
    expected = oracle(reply)
    assert st.error is None and dj["deep_judgment_performed"] is True
    for attr in attrs:
        got = dj["extracted_excerpts"][attr]
        assert [(e["text"], e["confidence"]) for e in got] == [(e["text"], e["confidence"]) for e in expected[attr]]
        assert all(e["text"] in response and e["similarity_score"] == 1.0 for e in got)
    assert dj["attributes_without_excerpts"] == [] and dj["deep_judgment_excerpt_retry_count"] == 0
    assert dj["deep_judgment_stages_completed"] == ["excerpts", "reasoning", "parameters"]
    assert dj["deep_judgment_model_calls"] == 3 and len(fake.requests) == 3
    assert st.usage["deep_judgment"]["total_tokens"] == 240 and st.usage["parsing"]["total_tokens"] == 120
    assert st.template["verify_result"] is True
    assert status(st, "deep_judgment_autofail") == ("skipped", "no attributes missing excerpts")
    # our excerpt prompt carries the same attribute guidance the reference sent
    sent = fake.requests[0][0]
    assert all(f"- {a}: {d}" in sent[-1]["content"] for a, d in attrs.items()) and question in sent[-1]["content"]


def test_recorded_excerpts_that_do_not_match_the_response_autofail(fake: FakeLitellm) -> None:
    path = next(p.values[0] for p in recorded("e2e_deep_judgment")
                if "moon landing" in load(p.values[0])[1])
    question, response, attrs, reply, _system = deep_judgment_case(path)
    altered = response.replace("Neil Armstrong", "Buzz Aldrin")  # the recorded quote is no longer in the text
    fake.route = route_deep_judgment(reply, DJ_TEMPLATES[question][1])
    st = asyncio.run(deep_parse(question, altered, attrs, {"deep_judgment_excerpt_retry_attempts": 1}))
    dj = st.deep_judgment
    assert dj["attributes_without_excerpts"] == ["commander"] and dj["deep_judgment_excerpt_retry_count"] == 1
    retry = fake.requests[1][0]
    assert '"Neil Armstrong"' in retry[-1]["content"] and retry[-2]["role"] == "assistant"
    assert st.template["verify_result"] is False
    assert status(st, "deep_judgment_autofail") == ("performed", "no excerpts for commander")
