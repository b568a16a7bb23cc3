"""Each stage's decision table (performed / skipped / overridden), without a bus.

The LLM port is replaced by a scripted judge (a test double of `LLMClient.complete`); the
template sandbox is the real one."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from services.generation.stage import generate_answer
from services.guards.stage import check_guards, final_ai_message
from services.parsing.stage import parse_template
from services.rubric.stage import evaluate_rubric
from services.verification.stage import verify_template
from shared.core import events
from shared.core.fold import fold_result
from shared.core.ids import template_id_for
from shared.core.rubric import CallableTrait, LLMRubricTrait, MetricRubricTrait, RegexTrait, Rubric
from shared.runtime.llm.reply import LLMError
from shared.templates.calls import validate_template
from tests.support.conformance import ScriptedJudge

TEMPLATE = '''
from karenina.schemas.entities import BaseAnswer
from pydantic import Field

class Answer(BaseAnswer):
    result: int = Field(description="The numerical result")

    def model_post_init(self, __context):
        self.correct = {"result": 4}

    def verify(self) -> bool:
        return self.result == self.correct["result"]
'''


def job(mode: str = "template_only", options: dict[str, Any] | None = None, rubric: Rubric | None = None,
        **kw: Any) -> events.Job:
    return events.Job(
        run_id="r", result_id="res1", answer_id="a1", question_id="q1", question_text="What is 2+2?",
        answering=kw.pop("answering", events.ModelSpec(model_name="openai/a")),
        parsing=events.ModelSpec(model_name="openai/j"), timestamp="2026-01-01T00:00:00+00:00",
        evaluation_mode=mode, template_code=TEMPLATE, template_id=template_id_for(TEMPLATE),
        rubric=rubric.to_wire() if rubric else None, options=options or {}, **kw,
    )


def stage_status(state: events.State, stage: str) -> tuple[str, str]:
    rec = [r for r in state.stages if r.stage == stage][-1]
    return rec.status, rec.reason


async def pipeline(j: events.Job, llm: ScriptedJudge) -> events.State:
    info = await validate_template(j.template_code or "", j.question_id)
    state = await generate_answer(j, llm)  # type: ignore[arg-type]
    state = await check_guards(j, state, llm, info.json_schema)  # type: ignore[arg-type]
    state = await parse_template(j, state, llm, info)  # type: ignore[arg-type]
    return await verify_template(j, state)


def test_happy_path_verifies_and_records_usage() -> None:
    llm = ScriptedJudge({"answer_generation": "The answer is 4.", "parsing": {"result": 4}})
    st = asyncio.run(pipeline(job(), llm))
    assert st.error is None
    assert st.template["verify_result"] is True
    assert st.template["parsed_llm_response"] == {"result": 4}
    assert st.template["parsed_gt_response"] == {"result": 4}
    assert set(st.usage) == {"answer_generation", "parsing"}
    assert stage_status(st, "abstention_check")[0] == "skipped"
    # the judge prompt quotes the question and the response
    parse_prompt = llm.calls[-1][1][-1]["content"]
    assert "What is 2+2?" in parse_prompt and "The answer is 4." in parse_prompt


def test_wrong_answer_fails() -> None:
    llm = ScriptedJudge({"answer_generation": "5", "parsing": {"result": 5}})
    st = asyncio.run(pipeline(job(), llm))
    assert st.template["verify_result"] is False and st.error is None


def test_abstention_skips_sufficiency_parsing_and_verification() -> None:
    llm = ScriptedJudge({"answer_generation": "I cannot answer that.",
                       "abstention_check": {"abstention_detected": True, "reasoning": "refusal"},
                       "sufficiency_check": AssertionError("must not be called"),
                       "parsing": AssertionError("must not be called")})
    st = asyncio.run(pipeline(job(options={"abstention_enabled": True, "sufficiency_enabled": True}), llm))
    t = st.template
    assert t["abstention_check_performed"] and t["abstention_detected"] and t["abstention_override_applied"]
    assert t["abstention_reasoning"] == "refusal"
    assert stage_status(st, "sufficiency_check") == ("skipped", "recursion limit, trace failure or abstention")
    assert stage_status(st, "parse_template") == ("skipped", "abstention detected")
    assert stage_status(st, "verify_template") == ("skipped", "abstention detected")
    assert t["verify_result"] is False and st.error is None


def test_insufficient_response_skips_parsing() -> None:
    llm = ScriptedJudge({"answer_generation": "Numbers are fun.",
                       "sufficiency_check": {"sufficient": False, "reasoning": "no number"},
                       "parsing": AssertionError("must not be called")})
    st = asyncio.run(pipeline(job(options={"sufficiency_enabled": True}), llm))
    t = st.template
    assert t["sufficiency_check_performed"] and t["sufficiency_detected"] is False
    assert t["sufficiency_override_applied"] is True and t["verify_result"] is False
    assert stage_status(st, "parse_template") == ("skipped", "response insufficient")


def test_abstention_judge_failure_is_not_fatal() -> None:
    llm = ScriptedJudge({"answer_generation": "4",
                       "abstention_check": LLMError("server_error", "judge down: 500 after 3 attempts"),
                       "parsing": {"result": 4}})
    st = asyncio.run(pipeline(job(options={"abstention_enabled": True}), llm))
    assert stage_status(st, "abstention_check")[0] == "failed"
    assert st.template.get("abstention_check_performed", False) is False
    assert st.template["verify_result"] is True and st.error is None


def test_generation_error_is_fatal_and_cascades() -> None:
    llm = ScriptedJudge({"answer_generation": LLMError("rate_limit", "rate limited: 429 after 5 attempts")})
    st = asyncio.run(pipeline(job(), llm))
    assert st.error is not None and st.error.stage == "generate_answer" and "429" in st.error.message
    assert stage_status(st, "parse_template") == ("skipped", "upstream error")
    r = fold_result(job(), st, None, 1.0)
    assert r.metadata.completed_without_errors is False and "429" in r.metadata.error


def test_parse_failure_is_fatal() -> None:
    llm = ScriptedJudge({"answer_generation": "4", "parsing": LLMError("bad_output", "no JSON after 3 attempts")})
    st = asyncio.run(pipeline(job(), llm))
    assert st.error is not None and st.error.stage == "parse_template"
    assert stage_status(st, "verify_template") == ("skipped", "upstream error")


def test_manual_trace_needs_no_model_call() -> None:
    answering = events.ModelSpec(model_name="manual", interface="manual", manual_traces={"q1": "It is 4"})
    llm = ScriptedJudge({"answer_generation": AssertionError("no model call for manual traces"),
                       "parsing": {"result": 4}})
    st = asyncio.run(pipeline(job(answering=answering), llm))
    assert st.template["raw_llm_response"] == "It is 4" and st.template["verify_result"] is True
    assert "answer_generation" not in st.usage


def test_recursion_limit_autofails() -> None:
    llm = ScriptedJudge({"answer_generation": "4", "parsing": AssertionError("must not be called")})
    j = job()

    async def run() -> events.State:
        st = await generate_answer(j, llm)  # type: ignore[arg-type]
        st.template["recursion_limit_reached"] = True
        st = await check_guards(j, st, llm, None)  # type: ignore[arg-type]
        st = await parse_template(j, st, llm, None)  # type: ignore[arg-type]
        return await verify_template(j, st)

    st = asyncio.run(run())
    assert st.template["verify_result"] is False
    assert stage_status(st, "recursion_limit_autofail")[0] == "performed"
    assert stage_status(st, "parse_template") == ("skipped", "recursion limit reached")


def test_final_ai_message_extraction() -> None:
    assert final_ai_message([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "a"
    with pytest.raises(ValueError, match="tool"):
        final_ai_message([{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}])
    with pytest.raises(ValueError, match="not an AI message"):
        final_ai_message([{"role": "tool", "content": "x"}])


RUBRIC = Rubric(
    llm_traits=[
        LLMRubricTrait(name="clarity", kind="score", min_score=0, max_score=5, description="clear"),
        LLMRubricTrait(name="safe", kind="boolean", description="safe"),
        LLMRubricTrait(name="tone", kind="literal", classes={"formal": "formal", "casual": "casual"}),
    ],
    regex_traits=[RegexTrait(name="has_number", pattern=r"\d+"),
                  RegexTrait(name="no_sorry", pattern="sorry", case_sensitive=False, invert_result=True)],
    callable_traits=[
        CallableTrait(name="short", kind="boolean",
                      callable_code=base64.b64encode(b"def evaluate(trace: str) -> bool:\n    return len(trace) < 50").decode()),
        CallableTrait(name="broken", kind="boolean", callable_code="def evaluate(trace):\n    raise RuntimeError('boom')"),
    ],
    metric_traits=[MetricRubricTrait(name="colors", evaluation_mode="tp_only", metrics=["precision", "recall", "f1"],
                                     tp_instructions=["red", "green", "blue"])],
)


@pytest.mark.parametrize("strategy", ["batch", "sequential"])
def test_rubric_all_trait_types_and_isolated_failure(strategy: str) -> None:
    def llm_traits(messages: list[dict[str, Any]]) -> dict[str, Any]:
        content = messages[-1]["content"]
        if "Metric trait" in content:
            return {"found": ["red", "blue"], "extra_items": ["purple"]}
        out: dict[str, Any] = {}
        if "clarity" in content:
            out["clarity"] = 0
        if "- safe" in content:
            out["safe"] = True
        if "- tone" in content:
            out["tone"] = "casual"
        return out

    llm = ScriptedJudge({"rubric_evaluation": llm_traits})
    j = job("template_and_rubric", options={"rubric_evaluation_strategy": strategy}, rubric=RUBRIC)
    state = events.State(template={"raw_llm_response": "Red and blue, 2 of them."})
    st = asyncio.run(evaluate_rubric(j, state, llm))  # type: ignore[arg-type]
    rb = st.rubric
    assert rb["llm_trait_scores"] == {"clarity": 0, "safe": True, "tone": 1}  # min_score 0 kept
    assert rb["llm_trait_labels"] == {"tone": "casual"}
    assert rb["regex_trait_scores"] == {"has_number": True, "no_sorry": True}
    assert rb["callable_trait_scores"] == {"short": True}
    assert "boom" in rb["trait_errors"]["broken"]
    m = rb["metric_trait_scores"]["colors"]
    assert (m["tp"], m["fn"], m["fp"]) == (2.0, 1.0, 1.0)
    assert m["precision"] == pytest.approx(2 / 3, abs=1e-4) and m["recall"] == pytest.approx(2 / 3, abs=1e-4)
    assert rb["metric_trait_confusion_lists"]["colors"] == {"tp": ["red", "blue"], "fn": ["green"],
                                                             "fp": ["purple"], "tn": []}
    assert rb["rubric_evaluation_strategy"] == strategy
    expected_calls = 2 if strategy == "batch" else 4
    assert len(llm.calls) == expected_calls


def test_rubric_judge_failure_keeps_other_traits() -> None:
    llm = ScriptedJudge({"rubric_evaluation": LLMError("server_error", "500 after 4 attempts")})
    rubric = Rubric(llm_traits=[LLMRubricTrait(name="safe", kind="boolean")],
                    regex_traits=[RegexTrait(name="has_number", pattern=r"\d")])
    j = job("rubric_only", rubric=rubric)
    st = asyncio.run(evaluate_rubric(j, events.State(template={"raw_llm_response": "1"}), llm))  # type: ignore[arg-type]
    assert st.rubric["regex_trait_scores"] == {"has_number": True}
    assert st.rubric["llm_trait_scores"] == {} and "500" in st.rubric["trait_errors"]["safe"]


def test_rubric_skipped_without_traits_and_on_upstream_error() -> None:
    llm = ScriptedJudge({})
    st = asyncio.run(evaluate_rubric(job("template_and_rubric"), events.State(), llm))  # type: ignore[arg-type]
    assert st.rubric is None and stage_status(st, "rubric_evaluation") == ("skipped", "no rubric traits")
    err = events.State(error=events.StageError(stage="generate_answer", type="X", message="y"))
    st = asyncio.run(evaluate_rubric(job("template_and_rubric", rubric=RUBRIC), err, llm))  # type: ignore[arg-type]
    assert stage_status(st, "rubric_evaluation") == ("skipped", "upstream error")


def test_a_regex_trait_that_backtracks_for_hours_fails_alone_and_never_holds_the_loop() -> None:
    """A benchmark's pattern that backtracks exponentially on a 30-character answer (hours in
    `re`): it runs in the sandbox, ends at the question's wall time as that trait's error, the
    other traits are scored, and the service's event loop runs meanwhile."""
    rubric = Rubric(regex_traits=[RegexTrait(name="redos", pattern=r"(?:.|.)*Z"),
                                  RegexTrait(name="has_number", pattern=r"\d")])
    j = job("rubric_only", rubric=rubric, options={"template_timeout_s": 1.0})
    state = events.State(template={"raw_llm_response": "a" * 30 + " 2"})

    async def scored() -> tuple[events.State, int]:
        ticks = 0
        task = asyncio.ensure_future(evaluate_rubric(j, state, ScriptedJudge({})))  # type: ignore[arg-type]
        while not task.done():
            await asyncio.sleep(0.05)
            ticks += 1
        return task.result(), ticks

    st, ticks = asyncio.run(scored())
    assert st.rubric["regex_trait_scores"] == {"has_number": True}
    assert "wall time" in st.rubric["trait_errors"]["redos"], st.rubric["trait_errors"]
    assert ticks >= 3, "the event loop was held while the pattern ran"
