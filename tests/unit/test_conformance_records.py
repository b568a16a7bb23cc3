"""Conformance: the reference checkpoints (minimal, multi_question, with_rubrics) run unchanged
through every stage function with manual traces and a scripted judge, and each record is compared
with what spec/001, spec/002 and the reference (its exports, its failure taxonomy, its default
prompts) say it must hold.

Expected values are written here from those sources, not read back from our code: the template
ids are the md5 of the stripped template text (the reference's `generate_template_id`), the
failure entries are the reference's `{category, stage, reason, details, group}`, the default
answering instruction is recorded on the result, regex fields without regex checks are `{}` /
`True`, `used_full_trace` is the configured choice (False by default).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest

from shared.control.runner import plan_run
from shared.core import prompts
from shared.core.benchmark import Benchmark
from shared.core.config import ModelConfig, VerificationConfig
from shared.core.models import VerificationResult
from shared.core.rubric import LLMRubricTrait, MetricRubricTrait, Rubric
from shared.runtime.llm.reply import LLMError
from tests.conftest import CHECKPOINTS
from tests.support.conformance import ByQuestion, ScriptedJudge, run_job

TIMESTAMP = "2026-04-21T12:00:00+00:00"
JUDGE = "openai/judge-model"

# md5 of each checkpoint template with its surrounding whitespace stripped, as the reference computes it
MINIMAL_TEMPLATE_ID = "e3d03eb093dc7fa6ed83aa4825fb9506"


def _bench(name: str) -> Benchmark:
    return Benchmark.load(CHECKPOINTS / f"{name}.jsonld")


def _jobs(bench: Benchmark, traces: dict[str, Any], **config: Any) -> list[Any]:
    """Jobs as `veribus run` plans them. minimal.jsonld marks its one question neither finished nor
    unfinished, so it is planned with --include-unfinished (multi_question's unfinished mq005 is not)."""
    cfg = VerificationConfig(
        answering_models=[ModelConfig(model_name="manual-answers", interface="manual", manual_traces=traces)],
        parsing_models=[ModelConfig(model_name=JUDGE, max_retries=2)], **config,
    )
    plan = plan_run(bench, cfg, run_id="conformance", timestamp=TIMESTAMP,
                    include_unfinished=bench.name == "minimal-test")
    return [j for r in plan.requests for j in r.jobs]


def _run(job: Any, judge: ScriptedJudge) -> VerificationResult:
    return asyncio.run(run_job(job, judge, finalized_at=1.0))


def _md5_stripped(text: str) -> str:
    return hashlib.md5(text.strip().encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------- minimal


def test_minimal_pass_record_matches_the_spec_field_by_field() -> None:
    bench = _bench("minimal")
    (q,) = bench.questions
    (job,) = _jobs(bench, {q.id: "2 + 2 = 4. The answer is 4."})
    judge = ScriptedJudge({"parsing": {"result": 4}})
    r = _run(job, judge)
    m, t = r.metadata, r.template
    assert t is not None
    # identification (spec/001 Identification Fields)
    assert m.question_id == "urn:karenina:test:q001" and m.question_text == "What is 2+2?"
    assert m.template_id == MINIMAL_TEMPLATE_ID == _md5_stripped(q.template_code or "")
    assert m.template_id != hashlib.md5((q.template_code or "").encode()).hexdigest()  # the text has a trailing newline
    assert m.raw_answer == "4" and m.keywords == ["arithmetic", "math"]
    assert len(m.result_id) == 16 and int(m.result_id, 16) >= 0
    assert m.timestamp == TIMESTAMP and m.replicate is None and m.evaluation_mode == "template_only"
    # models and the prompts actually used
    assert (m.answering.interface, m.answering.model_name, m.answering.tools) == ("manual", "manual-answers", [])
    assert (m.parsing.model_name, m.parsing.tools) == (JUDGE, [])
    assert m.answering_system_prompt == prompts.DEFAULT_ANSWERING_SYSTEM_PROMPT
    assert m.parsing_system_prompt is None  # none configured for the judge: null, as the reference
    # execution
    assert m.completed_without_errors is True and m.error is None and m.failure is None
    assert m.retry_counts == {} and m.few_shot_enabled is False and m.few_shot_example_count == 0
    # template section
    assert t.raw_llm_response == "2 + 2 = 4. The answer is 4." and t.trace_messages == []
    assert t.parsed_llm_response == {"result": 4} and t.parsed_gt_response == {"result": 4}
    assert t.template_verification_performed is True and t.verify_result is True
    assert (t.regex_validations_performed, t.regex_validation_results, t.regex_validation_details,
            t.regex_overall_success, t.regex_extraction_results) == (False, {}, {}, True, {})
    assert t.abstention_check_performed is False and t.abstention_detected is None
    assert t.sufficiency_check_performed is False and t.embedding_check_performed is False
    assert t.usage_metadata is not None and t.usage_metadata["total"]["total_tokens"] == 15
    # root: the configured choice (use_full_trace_for_template defaults to False)
    assert r.used_full_trace is False and r.evaluation_input == t.raw_llm_response and r.trace_extraction_error is None
    assert r.rubric is None and r.deep_judgment is None and r.deep_judgment_rubric is None


def test_minimal_wrong_answer_is_a_content_failure_that_completed() -> None:
    bench = _bench("minimal")
    (job,) = _jobs(bench, {bench.questions[0].id: "It is 5."})
    r = _run(job, ScriptedJudge({"parsing": {"result": 5}}))
    assert r.template is not None and r.template.verify_result is False
    assert r.metadata.failure == {"category": "content", "stage": "verify_template",
                                  "reason": "verify_template returned False", "details": None, "group": "content"}
    assert r.metadata.completed_without_errors is True and r.metadata.error is None


def test_abstention_records_the_reference_failure_as_a_verdict() -> None:
    bench = _bench("minimal")
    (job,) = _jobs(bench, {bench.questions[0].id: "I can't answer arithmetic questions."}, abstention_enabled=True)
    reasoning = 'Quote: "I can\'t answer arithmetic questions." No committed answer.'
    judge = ScriptedJudge({"abstention_check": {"reasoning": reasoning, "abstention_detected": True}})
    r = _run(job, judge)
    t = r.template
    assert t is not None and t.abstention_check_performed and t.abstention_detected is True
    assert t.abstention_override_applied is True and t.abstention_reasoning == reasoning
    assert t.verify_result is False and t.parsed_llm_response is None  # parsing and verify skipped
    assert r.metadata.failure == {"category": "abstention", "stage": "abstention_check", "reason": reasoning,
                                  "details": None, "group": "abstained"}
    assert r.metadata.completed_without_errors is True and r.metadata.error is None  # a verdict, not an error
    assert [s for s, _ in judge.calls] == ["abstention_check"]


def test_insufficient_response_is_a_sufficiency_failure() -> None:
    bench = _bench("minimal")
    (job,) = _jobs(bench, {bench.questions[0].id: "Arithmetic is fun."}, sufficiency_enabled=True)
    judge = ScriptedJudge({"sufficiency_check": {"reasoning": "result: nothing maps to it", "sufficient": False}})
    r = _run(job, judge)
    t = r.template
    assert t is not None and t.sufficiency_check_performed and t.sufficiency_detected is False
    assert t.sufficiency_override_applied is True and t.verify_result is False
    assert r.metadata.failure is not None
    assert {k: r.metadata.failure[k] for k in ("category", "stage", "group")} == {
        "category": "sufficiency", "stage": "sufficiency_check", "group": "abstained"}
    # the judge was asked about the required fields, by name
    (msgs,) = judge.prompts("sufficiency_check")
    assert "Required fields: result" in msgs[-1]["content"]


def test_exhausted_timeouts_are_a_retry_failure_with_retry_counts() -> None:
    bench = _bench("minimal")
    (job,) = _jobs(bench, {bench.questions[0].id: "4"})
    err = LLMError("timeout", f"timeout: model {JUDGE} at stage parsing failed after 3 attempt(s) (no HTTP status): "
                   "Timeout", model=JUDGE, stage="parsing", attempts=3)
    r = _run(job, ScriptedJudge({"parsing": err}))
    f = r.metadata.failure
    assert f is not None and (f["category"], f["stage"], f["group"]) == ("timeout", "parse_template", "retry")
    assert f["reason"] == "timeout retries exhausted"
    assert r.metadata.retry_counts == {"timeout": {"used": 2, "budget": 2}} == f["details"]["retry_counts"]
    assert r.metadata.completed_without_errors is False and r.metadata.error is not None


def test_a_judge_reply_that_never_validates_is_a_parsing_failure() -> None:
    bench = _bench("minimal")
    (job,) = _jobs(bench, {bench.questions[0].id: "4"})
    err = LLMError("bad_output", "bad_output: model gave no valid JSON after 3 replies", model=JUDGE, stage="parsing")
    r = _run(job, ScriptedJudge({"parsing": err}))
    f = r.metadata.failure
    assert f is not None and (f["category"], f["stage"], f["group"]) == ("parsing", "parse_template", "system")
    assert r.metadata.retry_counts == {}


def test_deep_judgment_without_grounded_excerpts_is_an_autofail() -> None:
    bench = _bench("minimal")
    (job,) = _jobs(bench, {bench.questions[0].id: "The sum is 4."}, deep_judgment_enabled=True,
                   deep_judgment_excerpt_retry_attempts=0)
    judge = ScriptedJudge({
        "deep_judgment_excerpts": {"result": [{"text": "the total is four", "confidence": "high"}]},
        "deep_judgment_reasoning": {"result": "No quote supports a value."},
        "parsing": {"result": 4},
    })
    r = _run(job, judge)
    assert r.deep_judgment is not None and r.deep_judgment.attributes_without_excerpts == ["result"]
    assert r.template is not None and r.template.verify_result is False
    f = r.metadata.failure
    assert f is not None and (f["category"], f["stage"], f["group"]) == ("deep_judgment", "DeepJudgmentAutoFail",
                                                                         "autofail")
    # the last stage parsed the reasoning, not the response
    (final,) = judge.prompts("parsing")
    assert "No quote supports a value." in final[-1]["content"] and "The sum is 4." not in final[-1]["content"]


# ------------------------------------------------------------------------------- multi_question

MQ_TRACES = {
    "urn:karenina:test:mq001": "Water boils at 100 degrees Celsius.",
    "urn:karenina:test:mq002": "Red, green and blue.",
    "urn:karenina:test:mq003": "William Shakespeare wrote it.",
    "urn:karenina:test:mq004": "The symbol is au.",
}
MQ_PARSED = ByQuestion({
    "What is the boiling point of water in Celsius?": {"temperature": 100},
    "List three primary colors.": {"colors": ["Red", "Green", "Blue"]},
    "Who wrote Romeo and Juliet?": {"author": "William Shakespeare"},
    "What is the chemical symbol for gold?": {"symbol": "au"},
})


def test_multi_question_records() -> None:
    bench = _bench("multi_question")
    jobs = _jobs(bench, MQ_TRACES, evaluation_mode="template_and_rubric")
    # mq005 is unfinished: not planned
    assert sorted(j.question_id for j in jobs) == sorted(MQ_TRACES)
    results = {j.question_id: _run(j, ScriptedJudge({"parsing": MQ_PARSED})) for j in jobs}
    verdicts = {q: r.template.verify_result for q, r in results.items() if r.template}
    assert verdicts == {"urn:karenina:test:mq001": True, "urn:karenina:test:mq002": True,
                        "urn:karenina:test:mq003": True, "urn:karenina:test:mq004": False}
    for q in bench.questions:
        if q.id in results:
            assert results[q.id].metadata.template_id == _md5_stripped(q.template_code or "")
            assert results[q.id].metadata.keywords == q.keywords
    gold = results["urn:karenina:test:mq004"]
    assert gold.metadata.failure is not None and gold.metadata.failure["category"] == "content"
    # the checkpoint's callable traits carry no code: each fails on its own, the record says so and why
    rb = gold.rubric
    assert rb is not None and rb.rubric_evaluation_performed
    assert set(rb.trait_errors or {}) == {"Completeness", "Case Sensitivity"}
    assert all("not evaluable" in e for e in (rb.trait_errors or {}).values())
    assert rb.trait_provenance == {"Completeness": "global", "Case Sensitivity": "question_specific"}
    assert results["urn:karenina:test:mq001"].rubric is not None
    assert results["urn:karenina:test:mq001"].rubric.trait_provenance == {"Completeness": "global"}


# ------------------------------------------------------------------------------- with_rubrics

RQ_TRACE = "BCL2 is an anti-apoptotic proto-oncogene [1]; it blocks apoptosis in lymphoma cells."
TONE = LLMRubricTrait(name="Tone", kind="literal", description="The register of the answer",
                      classes={"Technical": "uses domain terms without explaining them",
                               "Lay": "explains for a non-specialist reader"})
HALLMARKS = MetricRubricTrait(name="Hallmarks", evaluation_mode="tp_only", metrics=["precision", "recall", "f1"],
                              tp_instructions=["mentions apoptosis", "mentions cancer"])


def _rubric_bench() -> Benchmark:
    bench = _bench("with_rubrics")
    q = bench.questions[0]
    q.rubric = (q.rubric or Rubric()).merge(Rubric(llm_traits=[TONE], metric_traits=[HALLMARKS]))
    return bench


def test_with_rubrics_every_trait_kind_with_provenance_and_confusion_lists() -> None:
    bench = _rubric_bench()
    jobs = _jobs(bench, {"urn:karenina:test:rq001": RQ_TRACE}, evaluation_mode="template_and_rubric")
    (job,) = [j for j in jobs if j.question_id == "urn:karenina:test:rq001"]
    judge = ScriptedJudge({
        "parsing": {"gene_name": "BCL2", "gene_function": "anti-apoptotic proto-oncogene"},
        # the reference's reply shapes: {"scores": ...} for the batch, {"classifications": [...]} for literals
        "rubric_evaluation": lambda msgs: (
            {"tp": ["apoptosis", "lymphoma"], "fn": [], "fp": []} if "Metric trait: Hallmarks" in msgs[-1]["content"]
            else {"scores": {"Clarity": 4, "Accuracy": True, "Completeness": 3},
                  "classifications": [{"trait_name": "Tone", "class_name": "Technical"}]}),
    })
    r = _run(job, judge)
    rb = r.rubric
    assert rb is not None and r.template is not None and r.template.verify_result is True
    assert rb.llm_trait_scores == {"Clarity": 4, "Accuracy": True, "Completeness": 3, "Tone": 0}
    assert rb.llm_trait_labels == {"Tone": "Technical"}
    # regex and callable traits scored on the trace itself: a citation marker [1] and digits are present
    assert rb.regex_trait_scores == {"HasCitations": True, "HasNumbers": True}
    assert rb.callable_trait_scores == {"ContainsCitations": True, "ResponseLength": 1}  # 12 words < 20
    # confusion lists hold what was found in the answer, and the metrics follow from their sizes
    assert rb.metric_trait_confusion_lists == {"Hallmarks": {"tp": ["apoptosis", "lymphoma"], "fn": [], "fp": [],
                                                             "tn": []}}
    assert rb.metric_trait_scores == {"Hallmarks": {"tp": 2.0, "fp": 0.0, "fn": 0.0, "precision": 1.0,
                                                    "recall": 1.0, "f1": 1.0}}
    assert rb.trait_provenance == {
        "Clarity": "global", "Accuracy": "global", "Completeness": "global", "HasCitations": "global",
        "HasNumbers": "global", "ContainsCitations": "global", "ResponseLength": "global",
        "Tone": "question_specific", "Hallmarks": "question_specific"}
    assert rb.rubric_evaluation_strategy == "batch" and not rb.trait_errors
    # the literal trait's class descriptions and the metric's meaning of fp reached the judge
    text = "\n".join(m[-1]["content"] for m in judge.prompts("rubric_evaluation"))
    assert "uses domain terms without explaining them" in text and "explains for a non-specialist reader" in text
    assert "mentions apoptosis" in text and "look like valid answers" in text


def test_rubric_only_mode_has_no_template_section() -> None:
    bench = _bench("with_rubrics")
    jobs = _jobs(bench, {"urn:karenina:test:rq003": "Paris [1]."}, evaluation_mode="rubric_only")
    (job,) = [j for j in jobs if j.question_id == "urn:karenina:test:rq003"]
    r = _run(job, ScriptedJudge({"rubric_evaluation": {"Clarity": 5, "Accuracy": True, "Completeness": 5}}))
    assert r.template is None and r.metadata.template_id == "no_template"
    assert r.rubric is not None and r.rubric.llm_trait_scores == {"Clarity": 5, "Accuracy": True, "Completeness": 5}
    assert r.metadata.failure is None and r.metadata.completed_without_errors


@pytest.mark.parametrize("use_full", [True, False])
def test_used_full_trace_is_the_configured_choice(use_full: bool) -> None:
    bench = _bench("minimal")
    (job,) = _jobs(bench, {bench.questions[0].id: "4"}, use_full_trace_for_template=use_full)
    r = _run(job, ScriptedJudge({"parsing": {"result": 4}}))
    assert r.used_full_trace is use_full


def test_a_configured_answering_prompt_is_recorded_as_is() -> None:
    bench = _bench("minimal")
    cfg = VerificationConfig(
        answering_models=[ModelConfig(model_name="openai/answerer", system_prompt="Answer with a number only.")],
        parsing_models=[ModelConfig(model_name=JUDGE, system_prompt="Extract carefully.")])
    (job,) = [j for r in plan_run(bench, cfg, run_id="c", timestamp=TIMESTAMP, include_unfinished=True).requests
              for j in r.jobs]
    judge = ScriptedJudge({"answer_generation": "4", "parsing": {"result": 4}})
    r = _run(job, judge)
    assert r.metadata.answering_system_prompt == "Answer with a number only."
    assert r.metadata.parsing_system_prompt == "Extract carefully."
    (gen,) = judge.prompts("answer_generation")
    assert gen[0] == {"role": "system", "content": "Answer with a number only."}


def test_the_default_answering_prompt_is_sent_when_none_is_configured() -> None:
    bench = _bench("minimal")
    cfg = VerificationConfig(answering_models=[ModelConfig(model_name="openai/answerer")],
                             parsing_models=[ModelConfig(model_name=JUDGE)])
    (job,) = [j for r in plan_run(bench, cfg, run_id="c", timestamp=TIMESTAMP, include_unfinished=True).requests
              for j in r.jobs]
    judge = ScriptedJudge({"answer_generation": "4", "parsing": {"result": 4}})
    r = _run(job, judge)
    (gen,) = judge.prompts("answer_generation")
    assert gen[0] == {"role": "system", "content": prompts.DEFAULT_ANSWERING_SYSTEM_PROMPT}
    assert gen[-1] == {"role": "user", "content": "What is 2+2?"}
    assert r.metadata.answering_system_prompt == prompts.DEFAULT_ANSWERING_SYSTEM_PROMPT


# ------------------------------------------------------------------------------- every failure category


def _minimal_job() -> Any:
    bench = _bench("minimal")
    (job,) = _jobs(bench, {bench.questions[0].id: "4"})
    return job


def _state(signals: dict[str, Any] | None = None, template: dict[str, Any] | None = None,
           error: tuple[str, str] | None = None) -> Any:
    from shared.core import events

    return events.State(
        template={"raw_llm_response": "4", **(template or {})}, signals=signals or {},
        error=events.StageError(stage=error[0], type="LLMError", message=error[1]) if error else None)


FAILURE_CASES = [
    # (template state, rubric state) -> (category, stage, group) the reference records
    ("recursion_limit", _state({"recursion_limit": True}), None, ("recursion_limit", "RecursionLimitAutoFail", "autofail")),
    ("trace_validation", _state({"trace_validation_failed": True}), None,
     ("trace_validation", "TraceValidationAutoFail", "autofail")),
    ("deep_judgment", _state({"dj_autofail": True}), None, ("deep_judgment", "DeepJudgmentAutoFail", "autofail")),
    ("deep_judgment_rubric", _state(), _state({"dj_rubric_autofail": True}),
     ("deep_judgment_rubric", "DeepJudgmentRubricAutoFail", "autofail")),
    ("content", _state(template={"template_verification_performed": True, "verify_result": False}), None,
     ("content", "verify_template", "content")),
    ("connection", _state(error=("generate_answer", "connection: model m at stage answer_generation failed after 5 "
                                 "attempt(s) (no HTTP status): refused")), None, ("connection", "generate_answer", "retry")),
    ("rate_limit", _state(error=("parse_template", "rate_limit: model j failed after 3 attempt(s) (HTTP 429)")), None,
     ("rate_limit", "parse_template", "retry")),
    ("server_error", _state(error=("parse_template", "server_error: model j failed after 3 attempt(s) (HTTP 503)")),
     None, ("server_error", "parse_template", "retry")),
    ("abstention", _state(template={"abstention_check_performed": True, "abstention_detected": True,
                                    "abstention_reasoning": "refused"}), None, ("abstention", "abstention_check", "abstained")),
    ("sufficiency", _state(template={"sufficiency_check_performed": True, "sufficiency_detected": False}), None,
     ("sufficiency", "sufficiency_check", "abstained")),
    ("template_validation", _state(error=("validate_template", "template invalid: SyntaxError")), None,
     ("template_validation", "validate_template", "system")),
    ("parsing", _state(error=("parse_template", "bad_output: no valid JSON")), None, ("parsing", "parse_template", "system")),
    ("unexpected_error", _state(error=("verify_template", "ZeroDivisionError: division by zero")), None,
     ("unexpected_error", "verify_template", "system")),
]


@pytest.mark.parametrize(("template_state", "rubric_state", "expected"), [c[1:] for c in FAILURE_CASES],
                         ids=[c[0] for c in FAILURE_CASES])
def test_every_failure_category_has_its_stage_and_group(template_state: Any, rubric_state: Any,
                                                        expected: tuple[str, str, str]) -> None:
    from shared.core.fold import fold_result

    job = _minimal_job()
    r = fold_result(job, template_state, rubric_state, 1.0)
    f = r.metadata.failure
    assert f is not None and (f["category"], f["stage"], f["group"]) == expected
    assert set(f) == {"category", "stage", "reason", "details", "group"} and f["reason"]
    # verdicts (wrong answer, auto-fail, abstention) completed; retry and system failures are errors
    assert r.metadata.completed_without_errors is (expected[2] in ("content", "autofail", "abstained"))
    assert (r.metadata.error is None) is (expected[2] in ("content", "autofail", "abstained"))
    if expected[2] == "retry":
        used = {"connection": 4, "rate_limit": 2, "server_error": 2}[expected[0]]
        assert r.metadata.retry_counts == {expected[0]: {"used": used, "budget": 2 if expected[1] != "generate_answer"
                                                         else job.answering.max_retries}}


def test_retries_that_ended_in_success_are_counted_per_category() -> None:
    from shared.core.fold import fold_result

    job = _minimal_job()
    state = _state(template={"template_verification_performed": True, "verify_result": True})
    state.usage = {
        "answer_generation": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7},
        "parsing": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
                    "retries": {"rate_limit": 2, "timeout": 1}},
    }
    r = fold_result(job, state, None, 1.0)
    assert r.metadata.failure is None and r.metadata.completed_without_errors
    assert r.metadata.retry_counts == {"rate_limit": {"used": 2, "budget": 2}, "timeout": {"used": 1, "budget": 2}}
    # usage_metadata keeps the reference's shape: token counts only
    assert r.template is not None and r.template.usage_metadata == {
        "answer_generation": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7},
        "parsing": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
        "total": {"input_tokens": 15, "output_tokens": 7, "total_tokens": 22}}
