"""Conformance of the judge prompts: each prompt in shared/prompts.py is rendered for a real
checkpoint question (its text, its template's JSON schema, its rubric traits) and every piece of
information the reference gives its judge for that task must be in it - the wording is ours.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from shared.core import prompts
from shared.core.benchmark import Benchmark
from shared.core.rubric import LLMRubricTrait, MetricRubricTrait
from shared.templates.calls import validate_template
from tests.conftest import CHECKPOINTS

RESPONSE = "BCL2 is an anti-apoptotic proto-oncogene [1]; it blocks apoptosis in lymphoma cells."


@pytest.fixture(scope="module")
def bench() -> Benchmark:
    return Benchmark.load(CHECKPOINTS / "with_rubrics.jsonld")


@pytest.fixture(scope="module")
def question(bench: Benchmark) -> Any:
    return bench.questions[0]  # rq001, BCL2


@pytest.fixture(scope="module")
def schema(question: Any) -> dict[str, Any]:
    info = asyncio.run(validate_template(question.template_code, question.id))
    assert info.ok and info.json_schema
    return info.json_schema


def _text(msgs: list[dict[str, str]]) -> str:
    """All message contents, whitespace collapsed (line wrapping is not information)."""
    return " ".join(" ".join(m["content"] for m in msgs).split())


def test_answering_prompt_defaults_to_the_reference_instruction(question: Any) -> None:
    msgs = prompts.answer_messages(question.text, None, [{"question": "What is 1+1?", "answer": "2"}])
    assert msgs[0] == {"role": "system", "content": prompts.DEFAULT_ANSWERING_SYSTEM_PROMPT}
    default = prompts.DEFAULT_ANSWERING_SYSTEM_PROMPT.lower()
    assert "expert" in default and "answer" in default and "concise" in default
    assert msgs[1:] == [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"},
                        {"role": "user", "content": question.text}]
    assert prompts.answer_messages(question.text, "Be brief.", None)[0]["content"] == "Be brief."


def test_parsing_prompt_carries_question_response_and_schema(question: Any, schema: dict[str, Any]) -> None:
    text = _text(prompts.parsing_messages(question.text, RESPONSE, schema, {"prompt_config": {"parsing": "X1"}}, None))
    assert question.text in text and RESPONSE in text
    assert json.dumps(schema, sort_keys=True) in text
    assert "The gene symbol" in text and "Description of gene function" in text  # field descriptions
    assert "X1" in text  # prompt_config.parsing


def test_abstention_prompt_has_the_reference_procedure_and_output_shape(question: Any) -> None:
    msgs = prompts.abstention_messages(question.text, RESPONSE, {"prompt_config": {"abstention_detection": "X2"}})
    text = _text(msgs).lower()
    assert question.text.lower() in text and RESPONSE.lower() in text and "x2" in text
    # step 1: a verbatim disclaimer of the four kinds
    assert "word for word" in text
    for kind in ("cannot or will not act", "cannot reach the information", "does not know", "policy"):
        assert kind in text
    # step 2: commitment overrides the disclaimer; deflection without commitment is abstention
    assert "commit to an answer" in text and "a conditional" in text
    # step 3 default, and the distinctions
    assert "answer abstention_detected = false" in text
    assert "hedges about the answer itself" in text and "tool returned nothing" in text
    assert "evasive" not in text  # no "answers a different question" rule of our own
    # output: reasoning first, verdict second
    props = list(prompts.ABSTENTION_SCHEMA["properties"])
    assert props == ["reasoning", "abstention_detected"]
    assert json.dumps(prompts.ABSTENTION_SCHEMA) in _text(msgs)


def test_sufficiency_prompt_judges_required_fields_leniently(question: Any, schema: dict[str, Any]) -> None:
    text = _text(prompts.sufficiency_messages(question.text, RESPONSE, schema, {}))
    assert question.text in text and RESPONSE in text and json.dumps(schema, sort_keys=True) in text
    assert "Required fields: gene_name, gene_function" in text
    low = text.lower()
    assert "every required field" in low and "leniently" in low and "hedged, approximate or qualified" in low
    assert "optional fields" in low and "default" in low and "never makes a response insufficient" in low
    assert "unknown, unavailable" in low
    assert list(prompts.SUFFICIENCY_SCHEMA["properties"]) == ["reasoning", "sufficient"]


def test_rubric_prompt_carries_every_trait_and_the_literal_class_descriptions(bench: Benchmark,
                                                                             question: Any) -> None:
    rubric = bench.rubric_for(question)
    assert rubric is not None
    tone = LLMRubricTrait(name="Tone", kind="literal", description="The register",
                          classes={"Technical": "uses domain terms without explaining them",
                                   "Lay": "explains for a non-specialist reader"})
    traits = [*rubric.llm_traits, tone]
    schema = {"type": "object", "properties": {t.name: {} for t in traits}}
    text = _text(prompts.rubric_messages(question.text, RESPONSE, traits, schema, {}))
    assert question.text in text and RESPONSE in text
    for t in rubric.llm_traits:
        assert t.name in text and (t.description or "") in text
    clarity = next(t for t in rubric.llm_traits if t.name == "Clarity")
    assert f"integer from {clarity.min_score} (worst) to {clarity.max_score} (best)" in text
    accuracy = next(t for t in rubric.llm_traits if t.name == "Accuracy")
    if accuracy.kind == "boolean":
        assert "Accuracy [boolean" in text
    assert 'class 0 "Technical": uses domain terms without explaining them' in text
    assert 'class 1 "Lay": explains for a non-specialist reader' in text
    assert "exact name of one of the listed classes" in text


@pytest.mark.parametrize("mode", ["tp_only", "full_matrix"])
def test_metric_prompt_explains_tp_fp_fn_tn(question: Any, mode: str) -> None:
    trait = MetricRubricTrait(
        name="Hallmarks", description="Cancer hallmarks named", evaluation_mode=mode,
        metrics=["precision", "recall", "f1"] + (["specificity"] if mode == "full_matrix" else []),
        tp_instructions=["mentions apoptosis", "mentions proliferation"],
        tn_instructions=["mentions viruses"] if mode == "full_matrix" else [])
    msgs = prompts.metric_messages(question.text, RESPONSE, trait, {})
    text = _text(msgs)
    assert question.text in text and RESPONSE in text and "Cancer hallmarks named" in text
    assert "1. mentions apoptosis" in text and "2. mentions proliferation" in text
    low = text.lower()
    # what each list holds: tp/fp copied from the answer, fn/tn named from the instructions
    assert "tp (true positives): content that should be in the answer and is" in low
    assert "fn (false negatives): content that should be in the answer but is not" in low
    assert "tn (true negatives)" in low and "fp (false positives)" in low
    assert low.count("in the answer") >= 2 and "not the instruction text" in low
    assert "synonyms" in low and "no duplicates" in low
    schema = prompts.metric_schema(mode == "full_matrix")
    assert json.dumps(schema, sort_keys=True) in text
    if mode == "tp_only":
        assert "same kind or category as the expected ones" in low and "filler" in low
        assert set(schema["required"]) == {"tp", "fn", "fp"}
    else:
        assert "1. mentions viruses" in text and "match a true-negative instruction" in low
        assert set(schema["required"]) == {"tp", "fn", "fp", "tn"}


def test_deep_judgment_stages_carry_their_inputs(question: Any, schema: dict[str, Any]) -> None:
    attrs = {"gene_name": "The gene symbol", "gene_function": "Description of gene function"}
    ex = prompts.deep_judgment_excerpt_messages(question.text, RESPONSE, attrs, 3, {}, "Domain: oncology.")
    t1 = _text(ex)
    assert question.text in t1 and RESPONSE in t1 and "Domain: oncology." in t1
    assert all(f"- {k}: {v}" in t1 for k, v in attrs.items()) and "up to 3" in t1
    excerpts = {"gene_name": [{"text": "BCL2 is an anti-apoptotic proto-oncogene", "confidence": "high"}],
                "gene_function": []}
    rs = _text(prompts.deep_judgment_reasoning_messages(question.text, attrs, excerpts,
                                                        {"gene_function": "not stated"}, {}, None))
    assert "BCL2 is an anti-apoptotic proto-oncogene" in rs and "not stated" in rs and question.text in rs
    reasoning = {"gene_name": "The response names BCL2.", "gene_function": "It says anti-apoptotic."}
    final = _text(prompts.deep_judgment_parameters_messages(question.text, RESPONSE, schema, excerpts, reasoning,
                                                            {}, None))
    # the reference's last stage parses the reasoning
    assert all(r in final for r in reasoning.values()) and RESPONSE not in final
    assert json.dumps(schema, sort_keys=True) in final and question.text in final


def test_rubric_deep_judgment_prompts_carry_the_trait(bench: Benchmark, question: Any) -> None:
    rubric = bench.rubric_for(question)
    assert rubric is not None
    clarity = next(t for t in rubric.llm_traits if t.name == "Clarity")
    ex = _text(prompts.rubric_trait_excerpt_messages(question.text, RESPONSE, clarity.name, clarity.description or "",
                                                     2, {}))
    assert clarity.name in ex and (clarity.description or "") in ex and RESPONSE in ex and "up to 2" in ex
    rs = _text(prompts.rubric_trait_reasoning_messages(question.text, None, clarity.name, clarity.description or "",
                                                       [{"text": "BCL2 is", "confidence": "low"}], "medium", {}))
    assert '"BCL2 is"' in rs and "medium" in rs
    sc = _text(prompts.rubric_trait_score_messages(question.text, clarity.name, clarity.description or "",
                                                   "score 1-5", "It is clear.", {"type": "integer"}, {}))
    assert "It is clear." in sc and "score 1-5" in sc


def test_excerpt_retry_feedback_names_each_rejected_quote() -> None:
    text = prompts.excerpt_retry_feedback(
        {"gene_name": [{"text": "BCL-2 gene", "similarity_score": 0.42}]}, 0.8, "gene_name")
    assert '"BCL-2 gene"' in text and "0.42 < 0.80" in text and "gene_name" in text and "verbatim" in text


def test_hallucination_prompt_carries_claims_and_search_results(question: Any) -> None:
    items = [{"excerpt_id": "e1", "about": "gene_name", "excerpt": "BCL2 is anti-apoptotic",
              "search_results": "BCL2 inhibits apoptosis (UniProt P10415)"}]
    text = _text(prompts.hallucination_messages(question.text, items, {}))
    assert question.text in text and "[e1] about gene_name" in text and "BCL2 is anti-apoptotic" in text
    assert "UniProt P10415" in text
    for level in ("none", "low", "medium", "high"):
        assert f"{level} (" in text
    assert json.dumps(prompts.HALLUCINATION_SCHEMA) in text


def test_equivalence_prompt_carries_both_answers(question: Any) -> None:
    text = _text(prompts.equivalence_messages(question.text, question.raw_answer, '{"gene_name": "BCL-2"}', {}))
    assert question.text in text and question.raw_answer in text and '{"gene_name": "BCL-2"}' in text
    assert "more general or a more specific claim is NOT equivalent" in text


def test_presence_prompt_lists_every_concept(question: Any) -> None:
    concepts = [("Mechanism", "explains how BCL2 blocks apoptosis"), ("Clinical", "mentions venetoclax")]
    text = _text(prompts.rubric_presence_messages(question.text, RESPONSE, concepts, {}))
    assert question.text in text and RESPONSE in text
    assert "- Mechanism: explains how BCL2 blocks apoptosis" in text and "- Clinical: mentions venetoclax" in text
    assert "When uncertain, answer present" in text
