"""The result-set analysis API against the shapes and numbers of `spec/002` §7-10, and a
2 answering models x 2 judges x 3 replicates grid (pure: no bus, no database)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from shared.analysis.aggregators import list_aggregators
from shared.analysis.files import iter_results_from_file
from shared.analysis.resultset import VerificationResultSet
from shared.analysis.rubric_results import RubricResults
from shared.analysis.template_results import TEMPLATE_COLUMNS, TemplateResults
from shared.core.models import (
    VerificationResultDeepJudgment,
    VerificationResultDeepJudgmentRubric,
)
from tests.conftest import REFERENCE
from tests.support.results import CLAUDE, GPT, HAIKU, USAGE, grid_results, make, rows, spec_results

# --------------------------------------------------------------------------------------------
# VerificationResultSet
# --------------------------------------------------------------------------------------------


def test_set_iteration_len_indexing_and_filter_as_in_the_spec() -> None:
    rs = VerificationResultSet(spec_results())
    assert len(rs) == 4
    assert [r.metadata.question_id for r in rs] == ["q1", "q1", "q2", "q2"]
    assert rs[0].metadata.question_text == "What is the putative target of venetoclax?"
    assert isinstance(rs[1:3], VerificationResultSet) and len(rs[1:3]) == 2
    filtered = rs.filter(question_ids=["q1"], completed_only=True)
    assert isinstance(filtered, VerificationResultSet) and len(filtered) == 2
    # model filters accept the display string or the bare model name
    assert len(rs.filter(answering_models=[f"langchain:{GPT}"])) == 2
    assert len(rs.filter(answering_models=[GPT])) == 2
    assert len(rs.filter(parsing_models=[HAIKU], run_names=["spec"])) == 4
    assert len(rs.filter(run_names=["other"])) == 0


def test_grouping_as_in_the_spec() -> None:
    rs = VerificationResultSet(spec_results())
    by_q = rs.group_by_question()
    assert {k: len(v) for k, v in by_q.items()} == {"q1": 2, "q2": 2}
    assert all(isinstance(v, VerificationResultSet) for v in by_q.values())
    by_m = rs.group_by_model()
    assert {k: len(v) for k, v in by_m.items()} == {f"langchain:{CLAUDE}": 2, f"langchain:{GPT}": 2}
    assert list(rs.group_by_model(by="parsing")) == [f"langchain:{HAIKU}"]
    assert set(rs.group_by_model(by="both")) == {f"langchain:{CLAUDE} / langchain:{HAIKU}",
                                                 f"langchain:{GPT} / langchain:{HAIKU}"}
    grid = VerificationResultSet(grid_results())
    assert {k: len(v) for k, v in grid.group_by_replicate().items()} == {1: 12, 2: 12, 3: 12}
    with pytest.raises(ValueError):
        rs.group_by_model(by="nope")  # type: ignore[arg-type]


def test_filter_by_sections_and_replicates() -> None:
    grid = VerificationResultSet(grid_results())
    assert len(grid) == 36
    assert len(grid.filter(replicates=[3])) == 12
    assert len(grid.filter(completed_only=True)) == 35
    assert len(grid.filter(has_rubric=True)) == 35
    assert len(grid.filter(has_template=True)) == 35  # the errored job has no verdict
    assert len(grid.filter(has_judgment=True)) == 0


def test_summary_counts_and_wilson() -> None:
    s = VerificationResultSet(grid_results()).get_summary()
    assert s["num_results"] == 36 and s["num_errors"] == 1 and s["num_completed"] == 35
    assert s["num_questions"] == 3 and s["num_answering_models"] == 2 and s["num_parsing_models"] == 2
    assert s["replicates"] == [1, 2, 3]
    # model-a: 6 (q1) + 4 (q2) + 0 = 10 of 18; model-b: 2 + 6 + 5 = 13 of 17
    assert s["num_verdicts"] == 35 and s["num_passed"] == 23
    lo, hi = s["pass_rate_ci95"]
    assert lo < 23 / 35 < hi


# --------------------------------------------------------------------------------------------
# TemplateResults
# --------------------------------------------------------------------------------------------


def test_template_summary_is_exactly_the_spec_example() -> None:
    tr = VerificationResultSet(spec_results()).get_template_results()
    assert isinstance(tr, TemplateResults) and len(tr) == 4
    assert tr.get_template_summary() == {
        "num_results": 4, "num_passed": 3, "num_failed": 1, "pass_rate": 0.75, "num_with_embedding": 1,
        "num_with_regex": 0, "num_with_abstention": 0, "num_questions": 2,
    }


def test_template_dataframe_has_the_spec_columns_and_rows() -> None:
    df = VerificationResultSet(spec_results()).get_template_results().to_dataframe()
    assert len(df) == 4 and len(df.columns) == 34
    assert list(df.columns) == TEMPLATE_COLUMNS
    view = df[["question_id", "field_name", "gt_value", "llm_value", "field_match", "verify_result"]]
    assert view.values.tolist() == [
        ["q1", "target", "BCL2", "BCL2", True, True],
        ["q1", "target", "BCL2", "BCL2", True, False],
        ["q2", "target", "BCL2", "BCL2", True, True],
        ["q2", "target", "BCL2", "BCL2", True, True],
    ]
    assert df["field_type"].tolist() == ["str"] * 4
    assert df["result_index"].tolist() == [0, 1, 2, 3]


def test_template_dataframe_explodes_fields_and_keeps_results_without_fields() -> None:
    rs = [make("q1", GPT, False, parsed={"a": 1, "b": "x"}, gt={"a": 1, "b": "y", "c": None}),
          make("q2", GPT, None, error="parse_template: bad json", with_template=False)]
    df = TemplateResults(rs).to_dataframe()
    assert [r[0] for r in rows(df, ["field_name"])] == ["a", "b", "c", None]
    assert df["field_match"].tolist()[:3] == [True, False, False]  # c is missing from the extraction
    assert df["field_type"].tolist()[:2] == ["int", "str"]
    assert df.iloc[3]["completed_without_errors"] is False or not df.iloc[3]["completed_without_errors"]


def test_aggregate_pass_rate_as_in_the_spec_and_filters() -> None:
    tr = VerificationResultSet(spec_results()).get_template_results()
    assert tr.aggregate_pass_rate(by="question_id") == {"q1": 0.5, "q2": 1.0}
    assert tr.aggregate_pass_rate(by="answering_model") == {f"langchain:{CLAUDE}": 1.0, f"langchain:{GPT}": 0.5}
    assert len(tr.filter(passed_only=True)) == 3 and len(tr.filter(failed_only=True)) == 1
    assert isinstance(tr.filter(passed_only=True), TemplateResults)
    assert tr.aggregate_embedding_scores(strategy="mean", by="question_id") == {"q1": 0.92}


def test_pass_rate_table_carries_wilson_intervals() -> None:
    table = VerificationResultSet(grid_results()).pass_rates(by="answering_model")
    assert list(table.columns) == ["answering_model", "passed", "n", "pass_rate", "ci_low", "ci_high"]
    rows = {r.answering_model: r for r in table.itertuples()}
    a = rows["litellm:model-a"]
    assert (a.passed, a.n) == (10, 18)
    assert a.ci_low < 10 / 18 < a.ci_high
    by_rep = VerificationResultSet(grid_results()).get_template_results().aggregate_pass_rate(by="replicate")
    assert set(by_rep) == {1, 2, 3}


def test_regex_and_usage_dataframes() -> None:
    regex = {"regex_validations_performed": True, "regex_validation_results": {"gene": True, "year": False},
             "regex_validation_details": {"gene": {"pattern": r"BCL\d", "match_type": "exact", "expected": "BCL2",
                                                   "matches_found": ["BCL2"], "match_count": 1},
                                          "year": {"pattern": r"\d{4}", "match_type": "contains", "expected": "2016",
                                                   "matches_found": [], "match_count": 0}},
             "regex_overall_success": False}
    tr = TemplateResults([make("q1", GPT, True, regex=regex, usage=USAGE), make("q2", GPT, True)])
    rdf = tr.to_regex_dataframe()
    assert rows(rdf, ["pattern_name", "pattern_regex", "matched", "extracted_value"]) == [
        ["gene", r"BCL\d", True, ["BCL2"]], ["year", r"\d{4}", False, []]]
    assert tr.aggregate_regex_success_rate(by="question_id") == {"q1": {"gene": 1.0, "year": 0.0}}
    udf = tr.to_usage_dataframe()
    assert rows(udf, ["usage_stage", "input_tokens", "output_tokens", "total_tokens", "model_used"]) == [
        ["answer_generation", 100, 50, 150, "m"], ["parsing", 80, 20, 100, None]]
    totals = tr.to_usage_dataframe(totals_only=True)
    assert "usage_stage" not in totals.columns and totals["total_tokens"].tolist() == [250]


# --------------------------------------------------------------------------------------------
# RubricResults
# --------------------------------------------------------------------------------------------


def test_trait_summary_is_exactly_the_spec_example() -> None:
    rr = VerificationResultSet(spec_results()).get_rubrics_results()
    assert isinstance(rr, RubricResults) and len(rr) == 4
    assert rr.get_trait_summary() == {
        "num_results": 4, "llm_traits": ["clarity", "safety"], "regex_traits": ["has_citations"],
        "callable_traits": ["under_150w"], "metric_traits": ["drug_coverage"], "num_questions": 2,
    }


def test_rubric_dataframe_rows_as_in_the_spec() -> None:
    rr = VerificationResultSet(spec_results()).get_rubrics_results()
    df = rr.to_dataframe()
    assert len(df) == 19
    got = rows(df, ["question_id", "trait_name", "trait_score", "trait_type"])
    assert got[:10] == [
        ["q1", "safety", True, "llm_binary"], ["q1", "clarity", 4, "llm_score"],
        ["q1", "has_citations", True, "regex"], ["q1", "under_150w", True, "callable"],
        ["q1", "drug_coverage", 3.0, "metric"], ["q1", "drug_coverage", 1.0, "metric"],
        ["q1", "drug_coverage", 0.0, "metric"], ["q1", "drug_coverage", 1.0, "metric"],
        ["q1", "drug_coverage", 0.75, "metric"], ["q1", "drug_coverage", 0.857, "metric"],
    ]
    assert got[10:13] == [["q1", "safety", True, "llm_binary"], ["q1", "clarity", 3, "llm_score"],
                          ["q1", "has_citations", False, "regex"]]
    metric = df[df["trait_type"] == "metric"]
    assert metric["metric_name"].tolist() == ["tp", "fn", "fp", "precision", "recall", "f1"]
    assert metric[["confusion_tp", "confusion_fp", "confusion_fn", "confusion_tn"]].iloc[0].tolist() == [3, 0, 1, 0]
    for col in ("trait_name", "trait_score", "trait_label", "trait_type", "metric_name", "confusion_tp"):
        assert col in df.columns


def test_rubric_dataframe_by_trait_type() -> None:
    rr = VerificationResultSet(spec_results()).get_rubrics_results()
    llm = rr.to_dataframe(trait_type="llm")
    assert len(llm) == 8
    assert rows(llm, ["question_id", "answering_model", "trait_name", "trait_score"]) == [
        ["q1", f"langchain:{CLAUDE}", "safety", True], ["q1", f"langchain:{CLAUDE}", "clarity", 4],
        ["q1", f"langchain:{GPT}", "safety", True], ["q1", f"langchain:{GPT}", "clarity", 3],
        ["q2", f"langchain:{CLAUDE}", "safety", True], ["q2", f"langchain:{CLAUDE}", "clarity", 5],
        ["q2", f"langchain:{GPT}", "safety", True], ["q2", f"langchain:{GPT}", "clarity", 4],
    ]
    assert len(rr.to_dataframe(trait_type="llm_score")) == 4
    assert len(rr.to_dataframe(trait_type="llm_binary")) == 4
    assert len(rr.to_dataframe(trait_type="regex")) == 4
    assert len(rr.to_dataframe(trait_type="callable")) == 1
    assert len(rr.to_dataframe(trait_type="metric")) == 6
    with pytest.raises(ValueError):
        rr.to_dataframe(trait_type="nope")  # type: ignore[arg-type]


def test_literal_traits_carry_their_label() -> None:
    r = make("q1", GPT, True, rubric={"llm_trait_scores": {"tone": 1, "clarity": 4},
                                      "llm_trait_labels": {"tone": "Professional"}})
    df = RubricResults([r]).to_dataframe(trait_type="llm_literal")
    assert rows(df, ["trait_name", "trait_score", "trait_label", "trait_type"]) == [
        ["tone", 1, "Professional", "llm_literal"]]
    assert RubricResults([r]).to_dataframe(trait_type="llm_score")["trait_name"].tolist() == ["clarity"]


def test_rubric_aggregation_as_in_the_spec() -> None:
    rr = VerificationResultSet(spec_results()).get_rubrics_results()
    assert rr.aggregate_llm_traits(strategy="mean", by="question_id") == {
        "q1": {"clarity": 3.5, "safety": 1.0}, "q2": {"clarity": 4.5, "safety": 1.0}}
    assert rr.aggregate_regex_traits(strategy="majority_vote", by="answering_model") == {
        f"langchain:{CLAUDE}": {"has_citations": True}, f"langchain:{GPT}": {"has_citations": False}}
    # threshold: 1 of 2 true passes when the bar is below a half
    assert rr.aggregate_regex_traits(strategy="majority_vote", by="answering_model", threshold=0.4)[
        f"langchain:{GPT}"] == {"has_citations": True}
    assert rr.aggregate_callable_traits(strategy="first", by="question_id") == {"q1": {"under_150w": True}}
    assert rr.aggregate_metric_traits(metric_name="recall", by="question_id") == {"q1": {"drug_coverage": 0.75}}
    assert rr.aggregate_metric_traits(by="answering_model")[f"langchain:{CLAUDE}"]["drug_coverage"]["f1"] == 0.857


def test_every_builtin_strategy() -> None:
    rr = VerificationResultSet(spec_results()).get_rubrics_results()
    assert rr.aggregate_llm_traits(strategy="median", by="question_id")["q1"]["clarity"] == 3.5
    assert rr.aggregate_llm_traits(strategy="mode", by="question_id")["q2"]["safety"] is True
    assert rr.aggregate_llm_traits(strategy="count", by="question_id")["q1"]["clarity"] == {4: 1, 3: 1}
    assert rr.aggregate_llm_traits(strategy="first", by="answering_model")[f"langchain:{GPT}"]["clarity"] == 3
    with pytest.raises(KeyError):
        rr.aggregate_llm_traits(strategy="nope")


def test_custom_aggregator_registration_as_in_the_spec() -> None:
    class WeightedMeanAggregator:
        def aggregate(self, series: Any, **kwargs: Any) -> Any:
            return float(pd.to_numeric(series).mean())

    rr = VerificationResultSet(spec_results()).get_rubrics_results()
    rr.register_aggregator("weighted_mean", WeightedMeanAggregator())
    assert rr.list_aggregators() == ["mean", "median", "mode", "majority_vote", "first", "count", "weighted_mean"]
    assert rr.aggregate_llm_traits(strategy="weighted_mean", by="question_id") == {
        "q1": {"clarity": 3.5, "safety": 1.0}, "q2": {"clarity": 4.5, "safety": 1.0}}
    assert "weighted_mean" not in list_aggregators()  # registered on that view only
    with pytest.raises(ValueError):
        rr.register_aggregator("mean", WeightedMeanAggregator())
    with pytest.raises(TypeError):
        rr.register_aggregator("bad", object())  # type: ignore[arg-type]


def test_rubric_dataframe_keeps_errored_results_visible() -> None:
    rr = VerificationResultSet(grid_results()).get_rubrics_results()
    df = rr.to_dataframe()
    empty = df[df["trait_name"].isna()]
    assert len(empty) == 1 and not empty.iloc[0]["completed_without_errors"]
    # 35 rubric results x (clarity, safe, cites, 3 metrics)
    assert len(df) == 35 * 6 + 1
    assert rr.aggregate_llm_traits(by="replicate")[1]["safe"] == 1.0


def test_rubric_deep_judgment_columns() -> None:
    djr = VerificationResultDeepJudgmentRubric(
        deep_judgment_rubric_performed=True, rubric_trait_reasoning={"clarity": "clear and direct"},
        extracted_rubric_excerpts={"clarity": [{"text": "The target is BCL2.", "confidence": "high"}]},
        rubric_hallucination_risk_assessment={"clarity": {"overall_risk": "low", "per_excerpt_risks": ["low"]}},
        deep_judgment_rubric_scores={"clarity": 4})
    r = make("q1", GPT, True, rubric={"llm_trait_scores": {"clarity": 4}}, deep_rubric=djr)
    df = VerificationResultSet([r]).get_rubrics_results(include_deep_judgment=True).to_dataframe()
    assert rows(df, ["trait_reasoning", "trait_hallucination_risk"]) == [["clear and direct", "low"]]
    assert json.loads(df.iloc[0]["trait_excerpts"])[0]["text"] == "The target is BCL2."


# --------------------------------------------------------------------------------------------
# Judgment views
# --------------------------------------------------------------------------------------------


def _deep() -> VerificationResultDeepJudgment:
    return VerificationResultDeepJudgment(
        deep_judgment_enabled=True, deep_judgment_performed=True, deep_judgment_model_calls=3,
        deep_judgment_search_enabled=True,
        extracted_excerpts={"target": [{"text": "BCL2 inhibitor", "confidence": "high", "similarity_score": 0.95,
                                        "hallucination_risk": "none"},
                                       {"text": "venetoclax binds BCL2", "confidence": "medium",
                                        "similarity_score": 0.81, "hallucination_risk": "low"}],
                            "tissue": []},
        attribute_reasoning={"target": "stated twice", "tissue": "not mentioned"},
        hallucination_risk_assessment={"target": "low", "tissue": "high"},
        deep_judgment_stages_completed=["excerpts", "reasoning", "parameters"],
    )


def test_judgment_dataframe_excerpts_reasoning_and_risk() -> None:
    rs = VerificationResultSet([make("q1", GPT, True, deep=_deep()), make("q2", GPT, True)])
    jr = rs.get_judgment_results()
    df = jr.to_dataframe()
    assert rows(df, ["question_id", "attribute_name", "excerpt_index", "excerpt_text", "attribute_overall_risk"]) == [
        ["q1", "target", 0, "BCL2 inhibitor", "low"], ["q1", "target", 1, "venetoclax binds BCL2", "low"],
        ["q1", "tissue", None, None, "high"], ["q2", None, None, None, None]]
    assert df.iloc[0]["attribute_match"] is True or df.iloc[0]["attribute_match"] == True  # noqa: E712
    assert df["attribute_reasoning"].tolist()[:3] == ["stated twice", "stated twice", "not mentioned"]
    ex = jr.get_extracted_excerpts(attribute_name="target")
    assert len(next(iter(ex.values()))["target"]) == 2
    assert list(jr.get_reasoning().values()) == [{"target": "stated twice", "tissue": "not mentioned"}]
    risk = jr.to_hallucination_risk_dataframe()
    assert rows(risk, ["attribute_name", "risk"]) == [["target", "low"], ["tissue", "high"]]
    assert jr.aggregate_hallucination_risk_distribution(by="question_id") == {"q1": {"high": 1, "low": 1}}
    assert jr.get_processing_metrics()["total_model_calls"] == 3
    assert len(jr.filter(with_search_only=True)) == 1


def test_rubric_judgment_dataframe_one_row_per_trait_per_excerpt() -> None:
    djr = VerificationResultDeepJudgmentRubric(
        deep_judgment_rubric_performed=True,
        extracted_rubric_excerpts={"clarity": [{"text": "a", "confidence": "high"}, {"text": "b", "confidence": "low"}],
                                   "safety": []},
        rubric_trait_reasoning={"clarity": "ok", "safety": "no evidence"},
        deep_judgment_rubric_scores={"clarity": 4, "safety": False}, standard_rubric_scores={"tone": True},
        trait_metadata={"clarity": {"model_calls": 3, "excerpt_retry_count": 1, "had_excerpts": True,
                                    "excerpt_validation_failed": False, "stages_completed": ["excerpt_extraction"]},
                        "safety": {"model_calls": 2, "excerpt_retry_count": 2, "excerpt_validation_failed": True}},
        traits_without_valid_excerpts=["safety"],
        rubric_hallucination_risk_assessment={"clarity": {"overall_risk": "low", "per_excerpt_risks": ["low", "none"]}},
    )
    rj = VerificationResultSet([make("q1", GPT, True, deep_rubric=djr), make("q2", GPT, True)]).get_rubric_judgments_results()
    df = rj.to_dataframe()
    assert rows(df, ["trait_name", "excerpt_index", "excerpt_text", "trait_score", "trait_validation_failed"]) == [
        ["clarity", 0, "a", 4, False], ["clarity", 1, "b", 4, False], ["safety", None, None, False, True]]
    assert [r[0] for r in rows(df, ["trait_overall_risk"])] == ["low", "low", None]
    assert rj.get_excerpt_count_summary() == {"clarity": {"results": 1, "total_excerpts": 2, "mean_excerpts": 2.0},
                                              "safety": {"results": 1, "total_excerpts": 0, "mean_excerpts": 0.0}}
    assert rj.get_retry_summary()["safety"] == {"results": 1, "total_retries": 2, "validation_failures": 1}


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def test_reads_the_reference_exports() -> None:
    full = VerificationResultSet.from_file(REFERENCE / "export_format" / "results_export_full.json")
    assert [r.metadata.question_id for r in full] == ["q-unicode", "q-timeout"]
    ok, timeout = full.results
    assert ok.metadata.completed_without_errors and ok.metadata.error is None
    # format 2.2 records failures in metadata.failure only: read as an error
    assert not timeout.metadata.completed_without_errors
    assert timeout.metadata.error == "generate_answer: timeout exceeded"
    assert len(VerificationResultSet.from_file(REFERENCE / "export_format" / "results_export_empty.json")) == 0


def test_reads_jsonl_lists_and_report_lines(tmp_path: Path) -> None:
    rs = spec_results()
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text("\n".join(r.model_dump_json() for r in rs) + "\n")
    assert [r.metadata.result_id for r in iter_results_from_file(jsonl)] == [r.metadata.result_id for r in rs]
    lst = tmp_path / "r.json"
    lst.write_text(json.dumps([r.model_dump(mode="json") for r in rs]))
    assert len(VerificationResultSet.from_file(lst)) == 4
    report_lines = tmp_path / "results.jsonl"
    report_lines.write_text("\n".join(json.dumps({"sample": {}, "result": r.model_dump(mode="json")}) for r in rs))
    assert VerificationResultSet.from_file(report_lines)[2] == rs[2]
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "results"}')  # once read as 0 results: refused, naming why
    with pytest.raises(ValueError, match=r"bad.json: not a results file: 1 item\(s\), none of them a result"):
        VerificationResultSet.from_file(bad)


def test_flat_dataframe_and_view_filters() -> None:
    rs = VerificationResultSet(spec_results())
    df = rs.to_dataframe()
    assert len(df) == 4 and {"result_id", "verify_result", "trait.clarity", "trait.drug_coverage.f1"} <= set(df.columns)
    assert df["trait.clarity"].tolist() == [4.0, 3.0, 5.0, 4.0]
    rr = rs.get_rubrics_results()
    assert len(rr.filter(trait_names=["under_150w"])) == 1 and len(rr.filter(question_ids=["q2"])) == 2
    abst = [make("q1", GPT, False), make("q2", GPT, True)]
    abst[0].template.abstention_check_performed = True  # type: ignore[union-attr]
    abst[0].template.abstention_detected = True  # type: ignore[union-attr]
    assert TemplateResults(abst).aggregate_abstention_rate(by="question_id") == {"q1": 1.0}
    assert TemplateResults(abst).get_verification_results(question_id="q2") == {abst[1].metadata.result_id: True}


def test_every_output_of_a_run_shows_the_same_wilson_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """1 of 1 passed: the lower Wilson limit is 20.6549...%. summary.json and the console block
    once had 20.65 rounded again (20.6) while `veribus results` and the HTML report said 20.7;
    now every output rounds once, in `stats.percent`."""
    from shared.analysis import report
    from shared.cli.commands import main

    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    results = [make("q1", GPT, True)]
    report.write_outputs(tmp_path / "run", "s", "r1", results, report.summarize(results), {}, False)
    assert main(["results", str(tmp_path / "run" / "results.jsonl")]) == 0
    shown = capsys.readouterr().out
    assert main(["report", str(tmp_path / "run" / "results.jsonl"), "--html", str(tmp_path / "r.html"),
                 "--output", str(tmp_path / "again")]) == 0
    console = capsys.readouterr().out
    html = (tmp_path / "r.html").read_text()
    written = json.loads((tmp_path / "again" / "summary.json").read_text())["metrics"]
    assert "100.0%  [20.7, 100.0]" in shown                      # veribus results
    assert "Pass: 100.0% (95% CI 20.7-100.0%)" in console         # the console block of run / report
    assert written["pass_rate_ci95"] == [20.7, 100.0] == written["per_model"][0]["pass_rate_ci95"]
    assert "<td>20.7%</td><td>100.0%</td>" in html                # the HTML report's table
    for text in (shown, console, html):
        assert "20.6" not in text
