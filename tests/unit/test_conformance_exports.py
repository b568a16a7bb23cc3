"""Conformance of exports: records produced from the reference checkpoints (tests/support
pipeline) are exported in every format and read back with `VerificationResultSet.from_file`; the
CSV has the reference exporter's columns and value formats first; the JSON has the reference's
2.2 keys (results_export_full.json); a CSV written in the reference's own layout reads back.
"""

from __future__ import annotations

import asyncio
import csv
import json
from pathlib import Path
from typing import Any

import pytest

from shared.analysis.export import export_results
from shared.analysis.resultset import VerificationResultSet
from shared.control.runner import plan_run
from shared.core.benchmark import Benchmark
from shared.core.config import ModelConfig, VerificationConfig
from shared.core.models import VerificationResult
from shared.core.rubric import LLMRubricTrait, MetricRubricTrait, Rubric
from tests.conftest import CHECKPOINTS, REFERENCE
from tests.support.conformance import ByQuestion, ScriptedJudge, run_job

REF_FULL = REFERENCE / "export_format" / "results_export_full.json"

# The reference exporter's header (karenina results_exporter.export_verification_results_csv):
# 12 columns, then rubric_<global trait> (sorted), question_specific_rubrics, then 41 columns.
REFERENCE_HEAD = [
    "question_id", "success", "error", "question_text", "raw_llm_response", "parsed_gt_response",
    "parsed_llm_response", "template_verification_performed", "verify_result", "verify_granular_result",
    "rubric_evaluation_performed", "keywords",
]
REFERENCE_TAIL = [
    "answering_model", "parsing_model", "replicate", "execution_time", "timestamp", "answering_system_prompt",
    "parsing_system_prompt", "run_name", "export_timestamp", "karenina_version", "job_id",
    "embedding_check_performed", "embedding_similarity_score", "embedding_override_applied", "embedding_model_used",
    "answering_mcp_servers", "deep_judgment_enabled", "deep_judgment_performed", "extracted_excerpts",
    "attribute_reasoning", "deep_judgment_stages_completed", "deep_judgment_model_calls",
    "deep_judgment_excerpt_retry_count", "attributes_without_excerpts", "deep_judgment_search_enabled",
    "hallucination_risk_assessment", "deep_judgment_rubric_performed", "extracted_rubric_excerpts",
    "rubric_trait_reasoning", "deep_judgment_rubric_scores", "standard_rubric_scores", "trait_metadata",
    "traits_without_valid_excerpts", "rubric_hallucination_risk_assessment", "total_deep_judgment_model_calls",
    "total_traits_evaluated", "total_excerpt_retries", "metric_trait_confusion_lists", "metric_trait_metrics",
    "usage_metadata", "agent_metrics",
]
GLOBAL_TRAITS = ["Accuracy", "Clarity", "Completeness", "ContainsCitations", "HasCitations", "HasNumbers",
                 "ResponseLength"]

TRACES = {
    "urn:karenina:test:rq001": "BCL2 is an anti-apoptotic proto-oncogene [1]; it blocks apoptosis in lymphoma.",
    "urn:karenina:test:rq002": "Water boils at 100 degrees Celsius, which is 212 degrees Fahrenheit.",
    "urn:karenina:test:rq003": "I am unable to provide geographic information.",
}
PARSED = ByQuestion({
    "What is BCL2 and what role does it play in cancer?": {"gene_name": "BCL2", "gene_function": "anti-apoptotic"},
    "What is the boiling point of water at sea level?": {"celsius": 100, "fahrenheit": 212},
})


def _rubric_reply(messages: list[dict[str, Any]]) -> dict[str, Any]:
    if "Metric trait: Hallmarks" in messages[-1]["content"]:
        return {"tp": ["apoptosis"], "fn": ["mentions cancer"], "fp": ["lymphoma"]}
    return {"Clarity": 4, "Accuracy": True, "Completeness": 3, "Tone": "Technical"}


@pytest.fixture(scope="module")
def results() -> list[VerificationResult]:
    """with_rubrics.jsonld (+ a literal and a metric trait on rq001), template_and_rubric, with
    abstention on: two passes and an abstention, every rubric trait kind."""
    bench = Benchmark.load(CHECKPOINTS / "with_rubrics.jsonld")
    q = bench.questions[0]
    q.rubric = (q.rubric or Rubric()).merge(Rubric(
        llm_traits=[LLMRubricTrait(name="Tone", kind="literal", description="register",
                                   classes={"Technical": "domain terms", "Lay": "plain words"})],
        metric_traits=[MetricRubricTrait(name="Hallmarks", evaluation_mode="tp_only",
                                         metrics=["precision", "recall", "f1"],
                                         tp_instructions=["mentions apoptosis", "mentions cancer"])]))
    cfg = VerificationConfig(
        answering_models=[ModelConfig(model_name="manual-answers", interface="manual", manual_traces=TRACES)],
        parsing_models=[ModelConfig(model_name="openai/judge")], evaluation_mode="template_and_rubric",
        abstention_enabled=True, run_name="conformance")
    plan = plan_run(bench, cfg, run_id="conf-run", timestamp="2026-04-21T12:00:00+00:00")
    abstain = ByQuestion({
        "What is BCL2 and what role does it play in cancer?": {"reasoning": "committed", "abstention_detected": False},
        "What is the boiling point of water at sea level?": {"reasoning": "committed", "abstention_detected": False},
        "What is the capital of France?": {"reasoning": 'Quote: "I am unable to provide"', "abstention_detected": True},
    })
    judge = ScriptedJudge({"parsing": PARSED, "abstention_check": abstain, "rubric_evaluation": _rubric_reply})
    out = [asyncio.run(run_job(j, judge, finalized_at=1.0)) for r in plan.requests for j in r.jobs]
    assert len(out) == 3
    return sorted(out, key=lambda r: r.metadata.question_id)


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "parquet"])
def test_every_export_format_round_trips(results: list[VerificationResult], tmp_path: Path, fmt: str) -> None:
    out = tmp_path / f"results.{fmt}"
    assert export_results(results, fmt, out, run_id="conf-run").rows == 3
    back = VerificationResultSet.from_file(out).results
    assert back == results
    # the fields this issue is about survive every format
    rq1, rq2, rq3 = back
    assert rq3.metadata.failure is not None and rq3.metadata.failure["group"] == "abstained"
    assert rq1.rubric is not None and rq1.rubric.trait_provenance is not None
    assert rq1.rubric.metric_trait_confusion_lists == {"Hallmarks": {"tp": ["apoptosis"], "fn": ["mentions cancer"],
                                                                     "fp": ["lymphoma"], "tn": []}}
    assert rq2.template is not None and rq2.template.regex_overall_success is True


def test_csv_has_the_reference_header_and_value_formats(results: list[VerificationResult], tmp_path: Path) -> None:
    out = tmp_path / "results.csv"
    export_results(results, "csv", out, run_id="conf-run")
    with out.open(newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = list(reader.fieldnames or []), list(reader)
    expected = REFERENCE_HEAD + [f"rubric_{t}" for t in GLOBAL_TRAITS] + ["question_specific_rubrics"] + REFERENCE_TAIL
    assert len(REFERENCE_HEAD + REFERENCE_TAIL) == 53
    assert header[:len(expected)] == expected and len(expected) == 61
    assert header[-1] == "result_json" and len(set(header)) == len(header)
    rq1, rq2, rq3 = rows
    # the reference's value formats: Python booleans, JSON for structures, str() for global trait scores
    assert (rq1["success"], rq3["success"]) == ("True", "True")  # an abstention is a verdict, not an error
    assert rq1["template_verification_performed"] == "True" and rq1["verify_result"] == "true"
    assert json.loads(rq1["parsed_llm_response"]) == {"gene_name": "BCL2", "gene_function": "anti-apoptotic"}
    assert json.loads(rq1["keywords"]) == ["biology", "genetics", "cancer"]
    assert (rq1["rubric_Clarity"], rq1["rubric_Accuracy"], rq1["rubric_HasCitations"]) == ("4", "True", "True")
    assert json.loads(rq1["question_specific_rubrics"])["Tone"] == 0
    assert json.loads(rq1["metric_trait_confusion_lists"])["Hallmarks"]["fp"] == ["lymphoma"]
    assert rq1["answering_model"] == "manual:manual-answers" and rq1["parsing_model"] == "litellm:openai/judge"
    assert rq1["answering_system_prompt"] and rq1["parsing_system_prompt"] == ""
    assert rq1["deep_judgment_enabled"] == "False" and rq1["deep_judgment_model_calls"] == "0"
    assert rq1["extracted_excerpts"] == "" and rq1["job_id"] == "conf-run"
    assert json.loads(rq1["usage_metadata"])["total"]["total_tokens"] > 0
    assert rq3["verify_result"] == "false" and rq3["error"] == ""
    # ours follow, after the reference's
    assert header.index("failure_category") > len(expected) and rq3["failure_category"] == "abstention"


def test_json_export_has_the_reference_keys(results: list[VerificationResult], tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    rubric = Benchmark.load(CHECKPOINTS / "with_rubrics.jsonld").global_rubric
    assert rubric is not None
    export_results(results, "json", out, job_id="conf-run", rubric_definition=rubric.model_dump(mode="json",
                                                                                                 exclude_none=True))
    ours = json.loads(out.read_text())
    ref = json.loads(REF_FULL.read_text())
    assert set(ref) == set(ours) and ours["format_version"] == ref["format_version"] == "2.2"
    assert set(ref["metadata"]) <= set(ours["metadata"])
    assert set(ref["metadata"]["job_summary"]) <= set(ours["metadata"]["job_summary"])
    defn = ours["shared_data"]["rubric_definition"]
    assert list(defn)[:5] == ["llm_traits", "regex_traits", "callable_traits", "metric_traits", "agentic_traits"]
    assert "dynamic_traits" not in defn and defn["agentic_traits"] == []
    clarity = next(t for t in defn["llm_traits"] if t["name"] == "Clarity")
    assert "classes" in clarity and clarity["classes"] is None  # null-valued keys kept
    for section in ("metadata", "template"):
        ref_keys = set(ref["results"][0][section])
        for r in ours["results"]:
            assert ref_keys <= set(r[section]), (section, sorted(ref_keys - set(r[section])))
    assert set(ref["results"][0]) <= set(ours["results"][0])


def _reference_csv_rows() -> tuple[list[str], list[list[Any]]]:
    """Two rows as the reference's exporter writes them (its header, Python bools, JSON structures,
    str() rubric cells, an empty cell for a false verify_result), one global and one
    question-specific trait."""
    header = REFERENCE_HEAD + ["rubric_clarity", "question_specific_rubrics"] + REFERENCE_TAIL
    common = {
        "answering_model": "langchain:gpt-4o", "parsing_model": "langchain:gpt-4o-mini",
        "execution_time": 1.5, "timestamp": "2026-04-21T12:00:00+00:00", "answering_system_prompt":
        "You are an expert assistant. Answer the question accurately and concisely.", "parsing_system_prompt": "",
        "run_name": "ref-run", "export_timestamp": "2026-04-21 12:00:00 UTC", "karenina_version": "0.9",
        "job_id": "job-1", "embedding_check_performed": False, "embedding_similarity_score": "",
        "embedding_override_applied": False, "embedding_model_used": "", "answering_mcp_servers": "",
        "deep_judgment_enabled": False, "deep_judgment_performed": False, "deep_judgment_model_calls": 0,
        "deep_judgment_excerpt_retry_count": 0, "deep_judgment_search_enabled": False,
        "deep_judgment_rubric_performed": False, "total_deep_judgment_model_calls": 0, "total_traits_evaluated": 0,
        "total_excerpt_retries": 0, "agent_metrics": "",
    }
    one = {**common, "question_id": "q1", "success": True, "error": "", "question_text": "What is 2+2?",
           "raw_llm_response": "4", "parsed_gt_response": '{"result": 4}', "parsed_llm_response": '{"result": 4}',
           "template_verification_performed": True, "verify_result": "true", "verify_granular_result": "",
           "rubric_evaluation_performed": True, "keywords": '["math"]', "rubric_clarity": "4",
           "question_specific_rubrics": '{"cov": {"precision": 1.0, "recall": 0.5}}', "replicate": 2,
           "metric_trait_confusion_lists": '{"cov": {"tp": ["four"], "fn": ["two"], "fp": [], "tn": []}}',
           "metric_trait_metrics": '{"cov": {"precision": 1.0, "recall": 0.5}}',
           "usage_metadata": '{"total": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}'}
    two = {**common, "question_id": "q2", "success": False, "error": "parse_template: bad output",
           "question_text": "Capital of France?", "raw_llm_response": "Paris", "parsed_gt_response": "",
           "parsed_llm_response": "", "template_verification_performed": False, "verify_result": "",
           "verify_granular_result": "", "rubric_evaluation_performed": False, "keywords": "", "rubric_clarity": "",
           "question_specific_rubrics": "{}", "replicate": "", "metric_trait_confusion_lists": "",
           "metric_trait_metrics": "", "usage_metadata": ""}
    for row in (one, two):
        for name in ("extracted_excerpts", "attribute_reasoning", "deep_judgment_stages_completed",
                     "attributes_without_excerpts", "hallucination_risk_assessment", "extracted_rubric_excerpts",
                     "rubric_trait_reasoning", "deep_judgment_rubric_scores", "standard_rubric_scores",
                     "trait_metadata", "traits_without_valid_excerpts", "rubric_hallucination_risk_assessment"):
            row.setdefault(name, "")
    assert all(set(header) == set(r) for r in (one, two))
    return header, [[r[c] for c in header] for r in (one, two)]


def test_from_file_reads_a_reference_csv(tmp_path: Path) -> None:
    header, rows = _reference_csv_rows()
    path = tmp_path / "reference.csv"
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)  # csv.writer writes Python's str(): True/False, as the reference's DictWriter does
        w.writerow(header)
        w.writerows(rows)
    one, two = VerificationResultSet.from_file(path).results
    m = one.metadata
    assert (m.question_id, m.question_text, m.replicate, m.run_name, m.keywords) == (
        "q1", "What is 2+2?", 2, "ref-run", ["math"])
    assert (m.answering.interface, m.answering.model_name, m.parsing.model_name) == ("langchain", "gpt-4o",
                                                                                     "gpt-4o-mini")
    assert m.completed_without_errors is True and m.execution_time == 1.5 and len(m.result_id) == 16
    assert m.answering_system_prompt is not None and m.parsing_system_prompt is None
    t = one.template
    assert t is not None and t.verify_result is True and t.parsed_llm_response == {"result": 4}
    assert t.template_verification_performed is True and t.usage_metadata == {
        "total": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}
    rb = one.rubric
    assert rb is not None and rb.llm_trait_scores == {"clarity": 4}
    assert rb.metric_trait_scores == {"cov": {"precision": 1.0, "recall": 0.5}}
    assert rb.metric_trait_confusion_lists == {"cov": {"tp": ["four"], "fn": ["two"], "fp": [], "tn": []}}
    assert one.deep_judgment is None and one.deep_judgment_rubric is None
    assert two.metadata.completed_without_errors is False and two.metadata.error == "parse_template: bad output"
    assert two.template is not None and two.template.verify_result is None and two.rubric is None
    assert two.metadata.replicate is None and two.metadata.keywords is None


def test_from_file_refuses_a_csv_that_is_not_a_results_file(tmp_path: Path) -> None:
    path = tmp_path / "other.csv"
    path.write_text("Question,Answer\nWhat is 2+2?,4\n")
    with pytest.raises(ValueError, match="not a results CSV.*Question, Answer"):
        VerificationResultSet.from_file(path)
    bad = tmp_path / "bad.csv"
    header, rows = _reference_csv_rows()
    rows[0][header.index("success")] = "maybe"
    with bad.open("w", newline="") as fh:
        csv.writer(fh).writerows([header, *rows])
    with pytest.raises(ValueError, match=r"bad.csv:2: .*not a boolean: 'maybe'"):
        VerificationResultSet.from_file(bad)
