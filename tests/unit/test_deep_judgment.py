"""Deep judgment decisions, without a bus: ParseTemplate's excerpts -> reasoning -> parameters (stage 7),
DeepJudgmentAutoFail (10), rubric deep judgment and dynamic rubrics (11), DeepJudgmentRubricAutoFail (12),
the shared fuzzy excerpt rule and the local search tool.

The judge is a scripted double of `LLMClient.complete` (replies by stage); templates run in the real sandbox.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import services.parsing.deep_judgment as template_dj
import services.rubric.deep_judgment as rubric_dj
from services.parsing.stage import parse_template
from services.rubric.stage import evaluate_rubric
from services.verification.stage import verify_template
from shared.core import events
from shared.core.fold import fold_result
from shared.core.ids import template_id_for
from shared.core.models import VerificationResultDeepJudgment, VerificationResultDeepJudgmentRubric
from shared.core.rubric import LLMRubricTrait, RegexTrait, Rubric
from shared.runtime import search
from shared.runtime.llm.reply import LLMError, LLMReply, extract_json
from shared.templates.calls import validate_template

# ---------------------------------------------------------------- test doubles and builders


class Judge:
    """Scripted judge with `LLMClient.complete`'s contract. Per stage: a value, or a list consumed in
    order (the last one repeats). A value is a dict (the JSON reply), a string (reply text, JSON-extracted
    when the call is structured), a callable(messages) returning one of those, or an exception to raise."""

    def __init__(self, by_stage: dict[str, Any]) -> None:
        self.by_stage = {k: list(v) if isinstance(v, list) else [v] for k, v in by_stage.items()}
        self.calls: list[dict[str, Any]] = []

    def stage_calls(self, stage: str) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["stage"] == stage]

    async def complete(self, model: events.ModelSpec, messages: list[dict[str, Any]], *, stage: str,
                       response_schema: dict[str, Any] | None = None, validate: Any = None, **_: Any) -> LLMReply:
        self.calls.append({"stage": stage, "messages": messages, "schema": response_schema})
        queue = self.by_stage[stage]
        value = queue.pop(0) if len(queue) > 1 else queue[0]
        if callable(value) and not isinstance(value, dict | list):
            value = value(messages)
        if isinstance(value, Exception):
            raise value
        usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15, "model": model.model_name}
        text = value if isinstance(value, str) else json.dumps(value)
        if response_schema is None and validate is None:
            return LLMReply(text=text, usage=usage)
        obj = extract_json(value) if isinstance(value, str) else value
        return LLMReply(text=text, usage=usage, parsed=validate(obj) if validate else obj)


TEMPERATURE = '''
from karenina.schemas.entities import BaseAnswer
from pydantic import Field

class Answer(BaseAnswer):
    celsius: int = Field(description="Temperature in Celsius")
    fahrenheit: int = Field(description="Temperature in Fahrenheit")

    def model_post_init(self, __context):
        self.correct = {"celsius": 100, "fahrenheit": 212}

    def verify(self) -> bool:
        return self.celsius == self.correct["celsius"] and self.fahrenheit == self.correct["fahrenheit"]
'''
QUESTION = "What is the boiling point of water at sea level?"
RESPONSE = ("Water boils at 100 degrees Celsius, which is equivalent to 212 degrees Fahrenheit at standard "
            "atmospheric pressure (sea level).")
GOOD = {"celsius": [{"text": "Water boils at 100 degrees Celsius", "confidence": "high"}],
        "fahrenheit": [{"text": "212 degrees Fahrenheit", "confidence": "high"}]}
REASONING = {"celsius": "The response states 100 degrees Celsius.", "fahrenheit": "It states 212 Fahrenheit."}
PARSED = {"celsius": 100, "fahrenheit": 212}


def make_job(options: dict[str, Any] | None = None, rubric: Rubric | dict[str, Any] | None = None,
             mode: str = "template_only", template: str = TEMPERATURE, question: str = QUESTION) -> events.Job:
    wire = rubric.to_wire() if isinstance(rubric, Rubric) else rubric
    return events.Job(
        run_id="r", result_id="res-dj", answer_id="a", question_id="q1", question_text=question,
        answering=events.ModelSpec(model_name="openai/a"), parsing=events.ModelSpec(model_name="openai/judge"),
        timestamp="2026-01-01T00:00:00+00:00", evaluation_mode=mode, template_code=template,
        template_id=template_id_for(template), rubric=wire, options=options or {},
    )


def status(state: events.State, stage: str) -> tuple[str, str]:
    rec = [r for r in state.stages if r.stage == stage][-1]
    return rec.status, rec.reason


async def parse_and_verify(j: events.Job, judge: Judge, state: events.State | None = None,
                           search_tool: Any = None) -> events.State:
    info = await validate_template(j.template_code or "", j.question_id)
    st = state or events.State(template={"raw_llm_response": RESPONSE})
    st = await parse_template(j, st, judge, info, search_tool)  # type: ignore[arg-type]
    return await verify_template(j, st, judge)  # type: ignore[arg-type]


DJ_ON = {"deep_judgment_enabled": True}


# ---------------------------------------------------------------- the one fuzzy rule


def test_fuzzy_rule_accepts_verbatim_and_rejects_invented_quotes() -> None:
    text = "Water boils at 100 degrees Celsius,\nwhich is \u201cequivalent\u201d to 212 degrees Fahrenheit."
    assert search.excerpt_similarity("Water boils at 100 degrees Celsius", text) == 1.0
    # re-flowed whitespace and straightened quotes are still verbatim
    assert search.excerpt_similarity('Celsius, which is "equivalent" to', text) == 1.0
    # one changed character inside a long quote still matches under the default threshold
    ok, score = search.excerpt_matches("Water boils at 100 degree Celsius", text, 0.8)
    assert ok and 0.9 < score < 1.0
    ok, score = search.excerpt_matches("Ice melts at minus forty in Kelvin", text, 0.8)
    assert not ok and score < 0.6
    # padding a short answer with invented context cannot pass (full ratio when longer than the text)
    assert search.excerpt_similarity("The answer is 4 because two plus two is four, as proven by Euclid", "4") < 0.1
    assert search.excerpt_matches("", text, 0.0) == (False, 0.0)


def test_template_and_rubric_deep_judgment_share_one_rule() -> None:
    assert template_dj.validate_excerpts is search.validate_excerpts
    assert rubric_dj.validate_excerpts is search.validate_excerpts
    valid, failed, note = search.validate_excerpts(
        [{"text": "212 degrees Fahrenheit", "confidence": "HIGH"}, {"text": "212 degrees Fahrenheit"},
         {"text": "boils at 90 Kelvin in space", "confidence": "weird"},
         {"text": "", "confidence": "none", "explanation": "not stated"}],
        RESPONSE, 0.8, 3)
    assert valid == [{"text": "212 degrees Fahrenheit", "confidence": "high", "similarity_score": 1.0}]  # deduped
    assert [f["text"] for f in failed] == ["boils at 90 Kelvin in space"] and failed[0]["confidence"] == "medium"
    assert note == "not stated"


# ---------------------------------------------------------------- stage 7: template deep judgment


def test_deep_judgment_performed_fills_every_field_and_passes() -> None:
    judge = Judge({"deep_judgment_excerpts": GOOD, "deep_judgment_reasoning": REASONING, "parsing": PARSED})
    st = asyncio.run(parse_and_verify(make_job(DJ_ON), judge))
    dj = st.deep_judgment
    assert dj is not None and set(dj) == set(VerificationResultDeepJudgment.model_fields)
    assert dj["hallucination_risk_assessment"] is None
    assert dj["deep_judgment_enabled"] and dj["deep_judgment_performed"] and not dj["deep_judgment_search_enabled"]
    assert dj["deep_judgment_stages_completed"] == ["excerpts", "reasoning", "parameters"]
    assert dj["deep_judgment_model_calls"] == 3 and dj["deep_judgment_excerpt_retry_count"] == 0
    assert dj["attributes_without_excerpts"] == []
    assert dj["extracted_excerpts"]["celsius"] == [
        {"text": "Water boils at 100 degrees Celsius", "confidence": "high", "similarity_score": 1.0}]
    assert dj["attribute_reasoning"] == REASONING
    assert st.usage["deep_judgment"]["total_tokens"] == 30 and st.usage["parsing"]["total_tokens"] == 15
    assert st.template["verify_result"] is True
    assert status(st, "parse_template") == ("performed", "deep judgment")
    assert status(st, "deep_judgment_autofail") == ("skipped", "no attributes missing excerpts")
    # stage 2 sees the evidence; stage 3 parses the reasoning (as the reference does), not the response
    reasoning_prompt = judge.stage_calls("deep_judgment_reasoning")[0]["messages"][-1]["content"]
    assert "Water boils at 100 degrees Celsius" in reasoning_prompt and QUESTION in reasoning_prompt
    parse_prompt = judge.stage_calls("parsing")[0]["messages"][-1]["content"]
    assert RESPONSE not in parse_prompt and all(text in parse_prompt for text in REASONING.values())
    result = fold_result(make_job(DJ_ON), st, None, 2.0)
    assert result.deep_judgment is not None and result.deep_judgment.deep_judgment_performed
    assert result.template is not None and result.template.verify_result is True


def test_invalid_excerpt_is_retried_for_that_attribute_only_with_feedback() -> None:
    first = {"celsius": GOOD["celsius"],
             "fahrenheit": [{"text": "water freezes at 32 Fahrenheit in winter", "confidence": "high"}]}
    retry = {"fahrenheit": [{"text": "equivalent to 212 degrees Fahrenheit", "confidence": "medium"}]}
    judge = Judge({"deep_judgment_excerpts": [first, retry], "deep_judgment_reasoning": REASONING, "parsing": PARSED})
    st = asyncio.run(parse_and_verify(make_job(DJ_ON), judge))
    dj = st.deep_judgment
    assert dj["deep_judgment_excerpt_retry_count"] == 1 and dj["deep_judgment_model_calls"] == 4
    assert [e["text"] for e in dj["extracted_excerpts"]["fahrenheit"]] == ["equivalent to 212 degrees Fahrenheit"]
    assert dj["extracted_excerpts"]["fahrenheit"][0]["confidence"] == "medium"
    assert dj["attributes_without_excerpts"] == [] and st.template["verify_result"] is True
    second = judge.stage_calls("deep_judgment_excerpts")[1]
    assert list(second["schema"]["properties"]) == ["fahrenheit"]  # targeted retry
    feedback = second["messages"][-1]["content"]
    assert "water freezes at 32 Fahrenheit in winter" in feedback and "0.80" in feedback
    assert second["messages"][-2]["role"] == "assistant"  # the same conversation continues


def test_attribute_without_excerpts_after_retries_autofails() -> None:
    bad = {"celsius": GOOD["celsius"], "fahrenheit": [{"text": "it is 451 Fahrenheit", "confidence": "low"}]}
    judge = Judge({"deep_judgment_excerpts": bad, "deep_judgment_reasoning": REASONING, "parsing": PARSED})
    j = make_job({**DJ_ON, "deep_judgment_excerpt_retry_attempts": 2})
    st = asyncio.run(parse_and_verify(j, judge))
    dj = st.deep_judgment
    assert len(judge.stage_calls("deep_judgment_excerpts")) == 3 and dj["deep_judgment_excerpt_retry_count"] == 2
    assert dj["attributes_without_excerpts"] == ["fahrenheit"] and dj["extracted_excerpts"]["fahrenheit"] == []
    # the template's own check passes, the auto-fail overrides it
    assert st.template["verify_result"] is False and st.signals["field_verification_result"] is False
    assert status(st, "deep_judgment_autofail") == ("performed", "no excerpts for fahrenheit")
    assert status(st, "parse_template") == ("performed", "deep judgment: no excerpts for fahrenheit")
    assert fold_result(j, st, None, 2.0).template.verify_result is False


def test_no_evidence_entry_is_not_retried_and_reaches_the_reasoning() -> None:
    refusal = {"celsius": [{"text": "", "confidence": "none", "explanation": "Model refused to give a number"}],
               "fahrenheit": [{"text": "", "confidence": "none", "explanation": "Model refused"}]}
    judge = Judge({"deep_judgment_excerpts": refusal, "deep_judgment_reasoning": REASONING, "parsing": PARSED})
    j = make_job(DJ_ON)
    st = asyncio.run(parse_and_verify(j, judge, events.State(template={"raw_llm_response": "I can't say."})))
    dj = st.deep_judgment
    assert len(judge.stage_calls("deep_judgment_excerpts")) == 1 and dj["deep_judgment_excerpt_retry_count"] == 0
    assert dj["attributes_without_excerpts"] == ["celsius", "fahrenheit"]
    assert "Model refused to give a number" in judge.stage_calls("deep_judgment_reasoning")[0]["messages"][-1]["content"]
    assert st.template["verify_result"] is False


def test_deep_judgment_off_costs_no_call_and_autofail_is_skipped() -> None:
    judge = Judge({"parsing": PARSED})
    st = asyncio.run(parse_and_verify(make_job(), judge))
    assert [c["stage"] for c in judge.calls] == ["parsing"] and st.deep_judgment is None
    assert status(st, "deep_judgment_autofail") == ("skipped", "deep judgment disabled")
    assert status(st, "embedding_check") == ("skipped", "embedding check disabled")


def test_deep_judgment_skipped_on_abstention_keeps_enabled_flag() -> None:
    judge = Judge({})
    st = events.State(template={"raw_llm_response": "No."}, signals={"abstention": True})
    st = asyncio.run(parse_and_verify(make_job(DJ_ON), judge, st))
    assert judge.calls == [] and set(st.deep_judgment) == set(VerificationResultDeepJudgment.model_fields)
    assert st.deep_judgment["deep_judgment_enabled"] and not st.deep_judgment["deep_judgment_performed"]
    assert status(st, "parse_template") == ("skipped", "abstention detected")
    assert status(st, "deep_judgment_autofail") == ("skipped", "abstention detected")


def test_deep_judgment_judge_failure_is_fatal_like_parsing() -> None:
    judge = Judge({"deep_judgment_excerpts": GOOD,
                   "deep_judgment_reasoning": LLMError("server_error", "500 after 5 attempts")})
    st = asyncio.run(parse_and_verify(make_job(DJ_ON), judge))
    assert st.error is not None and st.error.stage == "parse_template" and "500" in st.error.message
    dj = st.deep_judgment
    assert dj["deep_judgment_stages_completed"] == ["excerpts"] and not dj["deep_judgment_performed"]
    assert dj["deep_judgment_model_calls"] == 2
    assert status(st, "deep_judgment_autofail") == ("skipped", "upstream error")


def write_corpus(root: Path) -> Path:
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "physics.txt").write_text(
        "Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea level.\n\n"
        "Ice melts at 0 degrees Celsius.\n", encoding="utf-8")
    (corpus / "facts.jsonl").write_text(
        json.dumps({"title": "Apollo 11", "text": "Neil Armstrong commanded Apollo 11, which landed in July 1969."})
        + "\nnot json\n" + json.dumps("Paris is the capital of France.") + "\n", encoding="utf-8")
    (corpus / "more.json").write_text(json.dumps([{"text": "The Great Wall of China is very long."}]), encoding="utf-8")
    return corpus


def test_local_search_tool_ranks_a_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = write_corpus(tmp_path)
    monkeypatch.setenv(search.CORPUS_ENV, str(corpus))
    search.register_search_tool("local", search.LocalCorpusSearch)  # fresh instance for this test's env
    tool = search.get_search_tool("local")
    assert isinstance(tool, search.SearchTool) and search.get_search_tool("local") is tool
    hits = asyncio.run(tool.search("who commanded Apollo 11"))
    assert hits[0] == "Apollo 11: Neil Armstrong commanded Apollo 11, which landed in July 1969."
    hits = asyncio.run(tool.search("Water boils at 100 degrees Celsius"))
    assert hits[0].startswith("Water boils at 100 degrees Celsius")
    assert len(search.LocalCorpusSearch(corpus).snippets()) == 5  # 2 paragraphs + 2 jsonl (1 bad line) + 1 json
    assert asyncio.run(tool.search("zzzz qqqq xxxx")) == []
    monkeypatch.delenv(search.CORPUS_ENV)
    with pytest.raises(search.SearchToolError, match=search.CORPUS_ENV):
        asyncio.run(search.LocalCorpusSearch().search("anything"))
    with pytest.raises(search.SearchToolError, match="unknown search tool"):
        search.get_search_tool("no-such-tool")


def test_search_enhanced_hallucination_risk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(search.CORPUS_ENV, str(write_corpus(tmp_path)))
    search.register_search_tool("local", search.LocalCorpusSearch)
    seen: list[str] = []

    def assess(messages: list[dict[str, Any]]) -> dict[str, Any]:
        prompt = messages[-1]["content"]
        seen.append(prompt)
        return {"excerpt_assessments": [
            {"excerpt_id": "0", "hallucination_risk": "none", "justification": "corpus confirms 100 C"},
            {"excerpt_id": "1", "hallucination_risk": "low", "justification": "corpus says 212 F"}]}

    judge = Judge({"deep_judgment_excerpts": GOOD, "deep_judgment_hallucination": assess,
                   "deep_judgment_reasoning": REASONING, "parsing": PARSED})
    st = asyncio.run(parse_and_verify(make_job({**DJ_ON, "deep_judgment_search_enabled": True}), judge))
    dj = st.deep_judgment
    assert dj["deep_judgment_search_enabled"] is True
    assert dj["deep_judgment_stages_completed"] == ["excerpts", "excerpt_hallucination_assessment", "reasoning",
                                                    "parameters"]
    ex = dj["extracted_excerpts"]["celsius"][0]
    assert "Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea level." in ex["search_results"]
    assert ex["hallucination_risk"] == "none" and ex["hallucination_justification"] == "corpus confirms 100 C"
    assert dj["hallucination_risk_assessment"] == {"celsius": "none", "fahrenheit": "low"}
    assert dj["deep_judgment_model_calls"] == 4
    assert "Water boils at 100 degrees Celsius (212" in seen[0]  # the judge saw the search results
    assert "hallucination risk: none" in judge.stage_calls("deep_judgment_reasoning")[0]["messages"][-1]["content"]
    VerificationResultDeepJudgment(**dj)


def test_search_tool_failure_is_not_fatal() -> None:
    class Broken:
        async def search(self, query: str) -> list[str]:
            raise ConnectionError("search backend down")

    judge = Judge({"deep_judgment_excerpts": GOOD, "deep_judgment_reasoning": REASONING, "parsing": PARSED})
    st = asyncio.run(parse_and_verify(make_job({**DJ_ON, "deep_judgment_search_enabled": True}), judge,
                                      search_tool=Broken()))
    assert st.error is None and st.deep_judgment["deep_judgment_performed"]
    assert st.deep_judgment.get("hallucination_risk_assessment") is None
    assert "search_results" not in st.deep_judgment["extracted_excerpts"]["celsius"][0]


# ---------------------------------------------------------------- stage 11: rubric deep judgment

RUBRIC_TEXT = "Water boils at 100 degrees Celsius. Always take care with boiling water: it can scald."
TRAITS = [
    LLMRubricTrait(name="clarity", kind="score", min_score=1, max_score=5, description="clear and precise"),
    LLMRubricTrait(name="safe", kind="boolean", description="warns about hazards"),
]


def trait_of(messages: list[dict[str, Any]]) -> str:
    content = messages[-1]["content"] if messages[-1]["role"] == "user" else ""
    for m in messages:
        if m["role"] == "user" and "Trait:" in m["content"]:
            content = m["content"]
            break
    return "safe" if "Trait: safe" in content else "clarity"


def rubric_judge(excerpts: Any = None, **extra: Any) -> Judge:
    good = {"clarity": {"excerpts": [{"text": "Water boils at 100 degrees Celsius", "confidence": "high"}]},
            "safe": {"excerpts": [{"text": "it can scald", "confidence": "high"}]}}
    return Judge({
        "deep_judgment_rubric_excerpts": excerpts or (lambda m: good[trait_of(m)]),
        "deep_judgment_rubric_reasoning": lambda m: f"Reasoning about {trait_of(m)}: the evidence supports it.",
        "deep_judgment_rubric_score": lambda m: {"result": True} if trait_of(m) == "safe" else {"score": 4},
        "rubric_evaluation": lambda m: {t: v for t, v in (("clarity", 3), ("safe", False)) if f"- {t} " in m[-1]["content"]},
        **extra,
    })


def eval_rubric(j: events.Job, judge: Judge, signals: dict[str, Any] | None = None, **kw: Any) -> events.State:
    st = events.State(template={"raw_llm_response": RUBRIC_TEXT}, signals=dict(signals or {}))
    return asyncio.run(evaluate_rubric(j, st, judge, **kw))  # type: ignore[arg-type]


def test_rubric_enable_all_deep_judges_every_llm_trait() -> None:
    rubric = Rubric(llm_traits=TRAITS, regex_traits=[RegexTrait(name="has_number", pattern=r"\d")])
    j = make_job({"deep_judgment_rubric_mode": "enable_all"}, rubric, "template_and_rubric")
    judge = rubric_judge()
    st = eval_rubric(j, judge)
    dj = st.deep_judgment_rubric
    assert set(VerificationResultDeepJudgmentRubric.model_fields) <= set(dj)
    assert dj["deep_judgment_rubric_performed"] and dj["deep_judgment_rubric_scores"] == {"clarity": 4, "safe": True}
    assert st.rubric["llm_trait_scores"] == {"clarity": 4, "safe": True}  # DJ scores are rubric scores too
    assert st.rubric["regex_trait_scores"] == {"has_number": True}
    assert dj["standard_rubric_scores"] is None and judge.stage_calls("rubric_evaluation") == []
    assert dj["extracted_rubric_excerpts"]["safe"] == [{"text": "it can scald", "confidence": "high", "similarity_score": 1.0}]
    assert dj["rubric_trait_reasoning"]["safe"].startswith("Reasoning about safe")
    assert dj["trait_metadata"]["clarity"] == {
        "stages_completed": ["excerpt_extraction", "reasoning_generation", "score_extraction"], "model_calls": 3,
        "had_excerpts": True, "excerpt_retry_count": 0, "excerpt_validation_failed": False}
    assert dj["traits_without_valid_excerpts"] == [] and dj["rubric_hallucination_risk_assessment"] is None
    assert (dj["total_deep_judgment_model_calls"], dj["total_traits_evaluated"], dj["total_excerpt_retries"]) == (6, 2, 0)
    assert st.usage["deep_judgment_rubric"]["total_tokens"] == 90
    assert status(st, "deep_judgment_rubric_autofail") == ("skipped", "no traits missing excerpts")
    # the reasoning of an excerpt trait is grounded in the quotes, not the whole response
    safe_reasoning = [c for c in judge.stage_calls("deep_judgment_rubric_reasoning") if trait_of(c["messages"]) == "safe"]
    assert '"it can scald"' in safe_reasoning[0]["messages"][-1]["content"]
    VerificationResultDeepJudgmentRubric(**dj)


def test_rubric_use_checkpoint_mixes_deep_and_standard_traits() -> None:
    traits = [TRAITS[0], TRAITS[1].model_copy(update={"deep_judgment_enabled": True,
                                                      "deep_judgment_excerpt_enabled": False})]
    j = make_job({"deep_judgment_rubric_mode": "use_checkpoint"}, Rubric(llm_traits=traits), "rubric_only")
    judge = rubric_judge()
    st = eval_rubric(j, judge)
    dj = st.deep_judgment_rubric
    assert dj["deep_judgment_rubric_scores"] == {"safe": True} and dj["standard_rubric_scores"] == {"clarity": 3}
    assert st.rubric["llm_trait_scores"] == {"clarity": 3, "safe": True}
    assert dj["trait_metadata"]["safe"]["stages_completed"] == ["reasoning_generation", "score_extraction"]
    assert dj["trait_metadata"]["safe"]["had_excerpts"] is False and dj["extracted_rubric_excerpts"] is None
    assert judge.stage_calls("deep_judgment_rubric_excerpts") == []
    reasoning_prompt = judge.stage_calls("deep_judgment_rubric_reasoning")[0]["messages"][-1]["content"]
    assert RUBRIC_TEXT in reasoning_prompt  # without excerpts the reasoning reads the response
    assert "- safe " not in judge.stage_calls("rubric_evaluation")[0]["messages"][-1]["content"]


def test_rubric_custom_mode_resolution() -> None:
    opts = {"deep_judgment_rubric_mode": "custom", "deep_judgment_fuzzy_match_threshold": 0.7,
            "deep_judgment_rubric_config": {
                "traits": {"clarity": {"enabled": True, "max_excerpts": 2}, "safe": {"enabled": True}},
                "question_specific": {"q1": {"safe": {"enabled": True, "fuzzy_match_threshold": 0.95,
                                                      "excerpt_retry_attempts": 0, "search_enabled": True}}}}}
    configs, errors = rubric_dj.resolve_trait_configs(opts, TRAITS, "q1")
    assert errors == {}
    assert configs["clarity"] == rubric_dj.TraitDJConfig(True, 2, 0.7, 2, False)
    assert configs["safe"] == rubric_dj.TraitDJConfig(True, rubric_dj.RUBRIC_MAX_EXCERPTS_DEFAULT, 0.95, 0, True)
    configs, _ = rubric_dj.resolve_trait_configs(opts, TRAITS, "other-question")
    assert configs["safe"].fuzzy_match_threshold == 0.7 and not configs["safe"].search_enabled
    opts["deep_judgment_rubric_config"] = {"traits": {"clarity": {"enabled": False}, "safe": {"max_excerpts": 0}}}
    configs, errors = rubric_dj.resolve_trait_configs(opts, TRAITS, "q1")
    assert configs == {} and "invalid deep_judgment_rubric_config entry" in errors["safe"]
    assert rubric_dj.resolve_trait_configs({"deep_judgment_rubric_mode": "disabled"}, TRAITS, "q1") == ({}, {})
    # an invalid entry is an error of that trait only; the other trait is scored normally
    j = make_job(opts, Rubric(llm_traits=TRAITS), "rubric_only")
    st = eval_rubric(j, rubric_judge())
    assert st.rubric["llm_trait_scores"] == {"clarity": 3} and "safe" in st.rubric["trait_errors"]
    assert st.deep_judgment_rubric is None


def test_rubric_trait_without_valid_excerpts_autofails_the_result() -> None:
    def excerpts(messages: list[dict[str, Any]]) -> dict[str, Any]:
        if trait_of(messages) == "safe":
            return {"excerpts": [{"text": "it is perfectly safe to drink lava", "confidence": "high"}]}
        return {"excerpts": [{"text": "Water boils at 100 degrees Celsius", "confidence": "high"}]}

    opts = {"deep_judgment_rubric_mode": "enable_all", "deep_judgment_excerpt_retry_attempts": 1}
    j = make_job(opts, Rubric(llm_traits=TRAITS), "template_and_rubric")
    judge = rubric_judge(excerpts)
    st = eval_rubric(j, judge)
    dj = st.deep_judgment_rubric
    assert dj["traits_without_valid_excerpts"] == ["safe"] and dj["deep_judgment_rubric_scores"] == {"clarity": 4}
    meta = dj["trait_metadata"]["safe"]
    assert meta["excerpt_validation_failed"] and meta["excerpt_retry_count"] == 1 and meta["model_calls"] == 2
    assert "safe" not in st.rubric["llm_trait_scores"] and "no valid excerpt" in st.rubric["trait_errors"]["safe"]
    safe_calls = [c for c in judge.stage_calls("deep_judgment_rubric_excerpts") if trait_of(c["messages"]) == "safe"]
    assert "drink lava" in safe_calls[1]["messages"][-1]["content"]  # feedback names the failed quote
    assert st.signals["dj_rubric_autofail"] is True
    assert status(st, "deep_judgment_rubric_autofail") == ("performed", "no valid excerpts for safe")
    template_state = events.State(template={"raw_llm_response": RUBRIC_TEXT, "verify_result": True})
    assert fold_result(j, template_state, st, 3.0).template.verify_result is False


def test_rubric_autofail_skipped_on_abstention_and_when_disabled() -> None:
    def excerpts(messages: list[dict[str, Any]]) -> dict[str, Any]:
        return {"excerpts": []}

    j = make_job({"deep_judgment_rubric_mode": "enable_all", "deep_judgment_excerpt_retry_attempts": 0},
                 Rubric(llm_traits=TRAITS[:1]), "template_and_rubric")
    st = eval_rubric(j, rubric_judge(excerpts), {"abstention": True})
    assert st.deep_judgment_rubric["traits_without_valid_excerpts"] == ["clarity"]
    assert status(st, "deep_judgment_rubric_autofail") == ("skipped", "abstention detected")
    assert "dj_rubric_autofail" not in st.signals
    off = make_job({}, Rubric(llm_traits=TRAITS), "template_and_rubric")
    judge = rubric_judge()
    st = eval_rubric(off, judge)
    assert st.deep_judgment_rubric is None and {c["stage"] for c in judge.calls} == {"rubric_evaluation"}
    assert status(st, "deep_judgment_rubric_autofail") == ("skipped", "deep judgment rubric not performed")


def test_rubric_judge_outage_is_a_trait_error_not_an_autofail() -> None:
    j = make_job({"deep_judgment_rubric_mode": "enable_all"}, Rubric(llm_traits=TRAITS[1:]), "rubric_only")
    st = eval_rubric(j, rubric_judge(LLMError("server_error", "503 after 5 attempts")))
    assert "503" in st.rubric["trait_errors"]["safe"] and st.deep_judgment_rubric["traits_without_valid_excerpts"] == []
    assert "dj_rubric_autofail" not in st.signals


def test_rubric_deep_judgment_search_rates_excerpts_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(search.CORPUS_ENV, str(write_corpus(tmp_path)))
    traits = [TRAITS[0].model_copy(update={"deep_judgment_enabled": True, "deep_judgment_search_enabled": True})]
    j = make_job({"deep_judgment_rubric_mode": "use_checkpoint"}, Rubric(llm_traits=traits), "rubric_only")
    judge = rubric_judge(deep_judgment_rubric_hallucination={"excerpt_assessments": [
        {"excerpt_id": "0", "hallucination_risk": "low", "justification": "matches the corpus"}]})
    st = eval_rubric(j, judge, search_tool=search.LocalCorpusSearch())
    dj = st.deep_judgment_rubric
    assert dj["rubric_hallucination_risk_assessment"] == {"clarity": {"overall_risk": "low", "per_excerpt_risks": ["low"]}}
    ex = dj["extracted_rubric_excerpts"]["clarity"][0]
    assert ex["hallucination_risk"] == "low" and "at sea level" in ex["search_results"]
    assert dj["trait_metadata"]["clarity"]["stages_completed"] == [
        "excerpt_extraction", "hallucination_assessment", "reasoning_generation", "score_extraction"]
    assert dj["trait_metadata"]["clarity"]["model_calls"] == 4 and len(judge.stage_calls("deep_judgment_rubric_hallucination")) == 1


# ---------------------------------------------------------------- stage 11: dynamic rubrics


def test_dynamic_rubric_presence_check_promotes_skips_and_flags_clashes() -> None:
    static = Rubric(llm_traits=TRAITS[1:])
    wire = static.to_wire()
    wire["dynamic_traits"] = [
        {"type": "llm", "name": "citations", "kind": "boolean", "description": "cites sources"},
        {"type": "regex", "name": "mentions_celsius", "pattern": "Celsius", "description": "talks about Celsius"},
        {"type": "llm", "name": "safe", "kind": "boolean", "description": "duplicate name"},
        {"type": "llm", "name": "broken", "kind": "score", "min_score": 5, "max_score": 1},
        {"type": "llm", "name": "tone", "kind": "boolean", "description": "friendly tone"},
    ]
    presence = {"results": [
        {"trait_name": "citations", "present": False, "reasoning": "no sources are cited"},
        {"trait_name": "mentions_celsius", "present": True, "reasoning": "states 100 C"}]}  # tone not mentioned

    judge = Judge({"rubric_presence_check": presence,
                   "rubric_evaluation": lambda m: {t: True for t in ("safe", "tone") if f"- {t} " in m[-1]["content"]}})
    st = eval_rubric(make_job({}, wire, "rubric_only"), judge)
    rb = st.rubric
    assert rb["dynamic_rubric_promoted_traits"] == ["mentions_celsius", "tone"]
    assert rb["dynamic_rubric_skipped_traits"]["citations"] == "concept not present: no sources are cited"
    assert rb["dynamic_rubric_skipped_traits"]["safe"] == "error: name clashes with a static rubric trait"
    assert rb["dynamic_rubric_skipped_traits"]["broken"] == "error: invalid trait definition"
    assert "clashes" in rb["trait_errors"]["dynamic:safe"] and "min_score" in rb["trait_errors"]["dynamic:broken"]
    assert rb["regex_trait_scores"] == {"mentions_celsius": True}
    assert rb["llm_trait_scores"] == {"safe": True, "tone": True}
    concepts = judge.stage_calls("rubric_presence_check")[0]["messages"][-1]["content"]
    assert "- citations: cites sources" in concepts and "duplicate name" not in concepts
    assert len(judge.stage_calls("rubric_presence_check")) == 1 and "rubric_presence_check" in st.usage


def test_dynamic_only_rubric_with_failed_presence_check_skips_all() -> None:
    wire = {"traits": [], "dynamic_traits": [{"type": "llm", "name": "citations", "kind": "boolean"}]}
    judge = Judge({"rubric_presence_check": LLMError("timeout", "timed out after 3 attempts")})
    st = eval_rubric(make_job({}, wire, "rubric_only"), judge)
    assert st.rubric["dynamic_rubric_promoted_traits"] == []
    assert st.rubric["dynamic_rubric_skipped_traits"]["citations"].startswith("presence check failed: timed out")
    assert st.rubric["llm_trait_scores"] is None and status(st, "rubric_evaluation")[0] == "performed"


def test_static_rubric_reports_no_dynamic_fields() -> None:
    st = eval_rubric(make_job({}, Rubric(llm_traits=TRAITS), "rubric_only"), rubric_judge())
    assert st.rubric["dynamic_rubric_promoted_traits"] is None and st.rubric["dynamic_rubric_skipped_traits"] is None


def test_rubric_deep_judgment_scores_literal_traits_with_labels() -> None:
    tone = LLMRubricTrait(name="tone", kind="literal", description="register of the answer",
                          classes={"formal": "formal register", "casual": "casual register"},
                          deep_judgment_enabled=True, deep_judgment_excerpt_enabled=False)
    judge = Judge({"deep_judgment_rubric_reasoning": "Short, friendly sentences: casual.",
                   "deep_judgment_rubric_score": "```json\n{\"label\": \"Casual\"}\n```"})
    j = make_job({"deep_judgment_rubric_mode": "use_checkpoint"}, Rubric(llm_traits=[tone]), "rubric_only")
    st = eval_rubric(j, judge)
    assert st.rubric["llm_trait_scores"] == {"tone": 1} and st.rubric["llm_trait_labels"] == {"tone": "casual"}
    assert st.deep_judgment_rubric["deep_judgment_rubric_scores"] == {"tone": 1}
    score_call = judge.stage_calls("deep_judgment_rubric_score")[0]
    assert score_call["schema"]["properties"]["label"]["enum"] == ["formal", "casual"]
    assert "Short, friendly sentences: casual." in score_call["messages"][-1]["content"]


def test_deep_judgment_autofail_skips_when_deep_judgment_did_not_run() -> None:
    from services.verification.stage import deep_judgment_autofail

    st = events.State(template={"verify_result": True})
    deep_judgment_autofail(make_job(DJ_ON), st)  # e.g. a state from before deep judgment was switched on
    assert status(st, "deep_judgment_autofail") == ("skipped", "deep judgment not performed")
    st.deep_judgment = {**template_dj.base_section(DJ_ON), "attributes_without_excerpts": ["celsius"]}
    deep_judgment_autofail(make_job(DJ_ON), st)  # listed attributes, but the parse never completed
    assert status(st, "deep_judgment_autofail") == ("skipped", "deep judgment not performed")
    assert st.template["verify_result"] is True
