"""Gates (parsing, evaluation, exit codes, JUnit XML) and the spec/004 report outputs (summary,
results.jsonl lines, console block, files, multi-run aggregate stats) on the 36-result grid."""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from shared.analysis import report
from shared.analysis.gates import (
    EXIT_GATE_FAILED,
    EXIT_OK,
    Gate,
    GateError,
    check_gates,
    evaluate_gates,
    gates_from_config,
    known_metrics,
    parse_gate,
    summary_criterion,
)
from shared.analysis.html_report import RunData
from shared.analysis.junit import junit_xml
from shared.analysis.report import PassCriterion
from shared.cli import analysis as cli_analysis
from shared.cli import commands as cli
from shared.cli.analysis import add_run_options, apply_gates, validate_run_gates
from shared.control import stack
from shared.core.models import VerificationResult
from tests.conftest import EXAMPLE
from tests.support.results import grid_results, make, spec_results

GRID_PASSED, GRID_ATTEMPTED, GRID_TOTAL = 23, 35, 36


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "gate"), [
    ("accuracy>=0.8", Gate("accuracy", "gte", 0.8)),
    (" avg_score > 0.7 ", Gate("avg_score", "gt", 0.7)),
    ("error_rate<=5%", Gate("error_rate", "lte", 0.05)),
    ("accuracy gte 0.6", Gate("accuracy", "gte", 0.6)),
    ("pass_rate:litellm:gpt-4o>=0.9", Gate("pass_rate:litellm:gpt-4o", "gte", 0.9)),
    ("clarity >= 0.6 pass >= 0.75", Gate("clarity", "gte", 0.6, "gte", 0.75)),
    ("Safe Response == 1", Gate("Safe Response", "eq", 1.0)),
    ("errors<1", Gate("errors", "lt", 1.0)),
])
def test_parse_gate(text: str, gate: Gate) -> None:
    assert parse_gate(text) == gate


@pytest.mark.parametrize("text", ["accuracy ~ 0.8", ">=0.8", "accuracy>=", "accuracy>=high", ""])
def test_malformed_gates_are_input_errors(text: str) -> None:
    with pytest.raises(GateError):
        parse_gate(text)
    assert issubclass(GateError, ValueError)  # the CLI maps ValueError to exit 2


def test_gates_from_a_run_config() -> None:
    cfg = {"gates": ["accuracy>=0.6", {"metric": "clarity", "op": "gte", "value": 0.5}],
           "gate": {"metric_key": "cites", "metric": "accuracy", "op": "gte", "value": 0.6, "pass_op": "gte",
                    "pass_value": 1}}
    gates = gates_from_config(cfg)
    assert gates == [Gate("accuracy", "gte", 0.6), Gate("clarity", "gte", 0.5),
                     Gate("cites", "gte", 0.6, "gte", 1.0, "accuracy")]
    assert gates_from_config({}) == [] and gates_from_config(None) == []
    for bad in ({"gates": "accuracy>=1"}, {"gates": [{"op": "gte", "value": 1}]}, {"gates": [{"metric": "a"}]},
                {"gates": [{"metric": "a", "op": "about", "value": 1}]}, {"gates": [3]}, {"gate": "x"}):
        with pytest.raises(GateError):
            gates_from_config(bad)


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "actual", "passed"), [
    ("accuracy>=0.6", GRID_PASSED / GRID_ATTEMPTED, True),
    ("accuracy>=0.7", GRID_PASSED / GRID_ATTEMPTED, False),
    ("avg_score>=0.65", GRID_PASSED / GRID_ATTEMPTED, True),
    ("avg_score_total>=0.65", GRID_PASSED / GRID_TOTAL, False),
    ("pass_rate>=0.6", GRID_PASSED / GRID_ATTEMPTED, True),
    ("pass_rate:litellm:model-b>=0.75", 13 / 17, True),
    ("accuracy:model-a>0.6", 10 / 18, False),
    ("error_rate<=0.05", 1 / 36, True),
    ("errors==1", 1.0, True),
    ("safe==1", 1.0, True),
    ("clarity>=0.6 pass>=0.5", GRID_PASSED / GRID_ATTEMPTED, True),
    ("coverage>0.62", (23 * 0.667 + 12 * 0.5) / 35, False),
])
def test_gate_values_on_the_grid(text: str, actual: float, passed: bool) -> None:
    rep = evaluate_gates(grid_results(), [parse_gate(text)])
    o = rep.outcomes[0]
    assert o.actual == pytest.approx(actual) and o.passed is passed and rep.passed is passed
    assert rep.exit_code == (EXIT_OK if passed else EXIT_GATE_FAILED)
    assert o.line.startswith(f"Gate ({parse_gate(text).label()}): {'PASSED' if passed else 'FAILED'}")


def test_missing_metrics_and_models_fail_with_a_reason() -> None:
    rep = evaluate_gates(grid_results(), [parse_gate("nonexistent>=0.5"), parse_gate("accuracy:nobody>=0.1")])
    assert not rep.passed and [o.actual for o in rep.outcomes] == [None, None]
    assert "no attempted sample has metric" in rep.outcomes[0].detail
    assert "no results for model" in rep.outcomes[1].detail
    assert evaluate_gates(grid_results(), []).passed  # no gates: nothing to fail


def test_summary_criterion_follows_the_first_gate() -> None:
    assert summary_criterion([]) == (PassCriterion("gte", 1.0), {})
    assert summary_criterion([parse_gate("avg_score>=0.7")])[0] == PassCriterion("gte", 0.7)
    overall, per = summary_criterion([parse_gate("clarity>=0.6 pass>=0.5")])
    assert overall == PassCriterion("gte", 0.5) and per == {"clarity": PassCriterion("gte", 0.5)}


def test_junit_has_a_testcase_per_gate_and_per_sample(tmp_path: Path) -> None:
    rs = grid_results()
    rep = evaluate_gates(rs, [parse_gate("accuracy>=0.6"), parse_gate("accuracy>=0.7")])
    root = ET.fromstring(junit_xml(rep, rs))
    gates, samples = root.findall("testsuite")
    assert gates.get("tests") == "2" and gates.get("failures") == "1"
    assert [tc.find("failure") is None for tc in gates.findall("testcase")] == [True, False]
    assert samples.get("tests") == "36" and samples.get("failures") == str(GRID_ATTEMPTED - GRID_PASSED)
    assert samples.get("errors") == "1"
    errored = [tc for tc in samples.findall("testcase") if tc.find("error") is not None]
    assert len(errored) == 1 and "TimeoutError" in errored[0].find("error").get("message")  # type: ignore[union-attr]


def test_junit_counts_a_raised_verify_as_an_error_and_says_the_runs_outcome() -> None:
    """A verify() that raised was a `<failure>` "score 0 fails >= 1" (the console counts it in
    errors); a run with jobs missing at --timeout had an all-green file beside exit 3."""
    raised = make("q3", "m", False)
    assert raised.template is not None
    raised.template.field_verification_error = "boom"
    rs = [make("q1", "m", True), make("q2", "m", False), raised]
    rep = evaluate_gates(rs, [])
    outcome = {"exit_code": 3, "reasons": ["1 of 4 job(s) have no result at --timeout"]}
    root = ET.fromstring(junit_xml(rep, rs, outcome=outcome))
    _gates, samples, run = root.findall("testsuite")
    assert (samples.get("tests"), samples.get("failures"), samples.get("errors")) == ("3", "1", "1")
    errors = [tc.find("error") for tc in samples.findall("testcase") if tc.find("error") is not None]
    assert len(errors) == 1 and errors[0].get("type") == "VerifyRaised" and "boom" in errors[0].get("message")  # type: ignore[union-attr,operator]
    assert (run.get("name"), run.get("failures")) == ("veribus.outcome", "1")
    assert run.find("testcase/failure").get("message") == "1 of 4 job(s) have no result at --timeout"  # type: ignore[union-attr]
    ok = ET.fromstring(junit_xml(rep, rs, outcome={"exit_code": 0, "reasons": []})).findall("testsuite")[2]
    assert ok.get("failures") == "0" and ok.find("testcase/failure") is None


def _run_args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    add_run_options(p)
    return p.parse_args(list(argv))


def test_apply_gates_sets_the_summary_and_the_exit_code(tmp_path: Path) -> None:
    rs = grid_results()
    cfg = tmp_path / "run.yaml"
    cfg.write_text("replicate_count: 3\ngates:\n  - accuracy>=0.6\n")
    junit = tmp_path / "junit.xml"
    args = _run_args(tmp_path, "--config", str(cfg), "--gate", "error_rate<=0.05", "--junit", str(junit))
    assert [g.metric for g in validate_run_gates(args)] == ["error_rate", "accuracy"]
    summary = report.summarize(rs, 2)
    summary["dead_lettered"] = 0
    assert apply_gates(args, rs, summary) == EXIT_OK
    assert summary["gates_passed"] is True and len(summary["gates"]) == 2
    assert summary["unfinished_questions_skipped"] == 2 and summary["dead_lettered"] == 0
    assert summary["gate_lines"][0].startswith("Gate (error_rate <= 0.05): PASSED")
    assert ET.parse(junit).getroot().tag == "testsuites"

    failing = _run_args(tmp_path, "--gate", "accuracy>=0.9")
    s2 = report.summarize(rs)
    assert apply_gates(failing, rs, s2) == EXIT_GATE_FAILED and s2["gates_passed"] is False

    # an avg_score gate makes its value the per-sample pass bar for passed_attempts
    s3 = report.summarize(rs)
    apply_gates(_run_args(tmp_path, "--gate", "avg_score>=0.5"), rs, s3)
    assert s3["passed_attempts"] == GRID_PASSED

    with pytest.raises(GateError):
        validate_run_gates(_run_args(tmp_path, "--gate", "accuracy is great"))
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("gates: [{metric: accuracy, op: about, value: 1}]\n")
    with pytest.raises(GateError, match="bad.yaml"):
        validate_run_gates(_run_args(tmp_path, "--config", str(bad_cfg)))
    with pytest.raises(ValueError):
        validate_run_gates(_run_args(tmp_path, "--num-runs", "0"))


# --------------------------------------------------------------------------------------------
# Thresholds on a score trait's own scale (Clarity: 1-5, as in examples/example.yaml)
# --------------------------------------------------------------------------------------------

CLARITY = {"Clarity": (1.0, 5.0)}
CLARITY_RUBRIC = {"llm_traits": [{"name": "Clarity", "kind": "score", "min_score": 1, "max_score": 5},
                                 {"name": "AnswersDirectly", "kind": "boolean"}]}
MEAN_4_56 = [5] * 14 + [4] * 11  # raw mean 4.56: normalised (4.56 - 1) / 4 = 0.89
MEAN_3_9 = [4] * 9 + [3]  # raw mean 3.9: normalised 0.725


def _clarity_results(scores: list[int]) -> list[VerificationResult]:
    return [make(f"q{i}", "m", True, rubric={"llm_trait_scores": {"Clarity": s, "AnswersDirectly": True}})
            for i, s in enumerate(scores)]


def _on_scales(*texts: str, scales: dict[str, tuple[float, float]] | None = None) -> list[Gate]:
    """The gates as `veribus run` reads them once the benchmark's traits (and their scales) are known."""
    scales = CLARITY if scales is None else scales
    return check_gates([parse_gate(t) for t in texts], known_metrics({"Clarity", "AnswersDirectly", *scales}), (),
                       scales)


@pytest.mark.parametrize("text", ["Clarity>=6", "Clarity>5.5", "Clarity:m>=6", "Clarity>=0.5 pass>=6"])
def test_a_trait_threshold_off_the_trait_s_scale_is_refused_naming_the_scale(text: str) -> None:
    with pytest.raises(GateError, match="Clarity's 1–5 scale"):  # evaluated with the run's trait ranges
        evaluate_gates(_clarity_results(MEAN_4_56), [parse_gate(text)], CLARITY)
    with pytest.raises(GateError, match=rf"gate '{re.escape(text)}'.*Clarity's 1–5 scale"):
        _on_scales(text)  # checked before the run


@pytest.mark.parametrize(("scores", "passed"), [(MEAN_4_56, True), (MEAN_3_9, False)])
def test_a_trait_threshold_above_1_is_a_mean_on_the_trait_s_scale(scores: list[int], passed: bool,
                                                                   tmp_path: Path) -> None:
    rs, mean = _clarity_results(scores), sum(scores) / len(scores)
    assert evaluate_gates(rs, [parse_gate("Clarity>=4")], CLARITY).passed is passed  # with the run's trait ranges
    [gate] = _on_scales("Clarity>=4")
    assert gate.value == pytest.approx(0.75) and gate == parse_gate("Clarity>=0.75") == _on_scales("Clarity>=0.75")[0]
    rep = evaluate_gates(rs, [gate], CLARITY)
    assert rep.outcomes[0].actual == pytest.approx((mean - 1) / 4) and rep.passed is passed
    assert rep.exit_code == (EXIT_OK if passed else EXIT_GATE_FAILED)
    assert rep.outcomes[0].line.startswith(f"Gate (Clarity >= 0.75 (a mean of 4 on 1–5)): {'PASSED' if passed else 'FAILED'}")
    # `veribus run`'s path: the gates from --gate, evaluated with the benchmark's trait ranges
    summary = report.summarize(rs)
    code = apply_gates(_run_args(tmp_path, "--gate", "Clarity>=4"), rs, summary, CLARITY)
    assert code == (EXIT_OK if passed else EXIT_GATE_FAILED) and summary["gates_passed"] is passed
    # a per-sample pass bar is on the scale too: 14 of 25 samples score 5, none of the other 10
    share = evaluate_gates(rs, [parse_gate("Clarity>=0.5 pass>=5")], CLARITY).outcomes[0]
    assert share.actual == pytest.approx(14 / 25 if passed else 0.0) and share.passed is passed


def test_the_note_says_how_a_trait_threshold_was_read() -> None:
    four, pct, low, one = _on_scales("Clarity>=4", "Clarity>=70%", "Clarity>=0.5", "Clarity>=1")
    assert four.understood() == ("gate Clarity >= 0.75 (a mean of 4 on 1–5) (from 'Clarity>=4'; "
                                 "4 read on Clarity's 1–5 scale as 0.75)")
    assert pct.value == pytest.approx(0.7) and "70% of Clarity's 1–5 range: a mean of 3.8" in pct.understood()
    assert low.value == 0.5 and low.note is None  # 0.5 is not on the 1-5 scale: only the normalised reading
    # 1 is on the scale and in 0..1: read as normalised (a mean of 5), and the note says how to ask for 1
    assert one.value == 1.0 and "for a mean of 1 write 0%" in one.understood()
    assert "for a mean of 0.7 write 7%" in _on_scales("q>=0.7", scales={"q": (0.0, 10.0)})[0].understood()


def test_rate_thresholds_read_as_before_and_a_fractional_percentage_needs_its_sign() -> None:
    a, b, c = parse_gate("pass_rate>=80"), parse_gate("pass_rate>=80%"), parse_gate("pass_rate>=0.8")
    assert a == b == c and a.value == pytest.approx(0.8) and "80 read as 0.8 (80%)" in a.understood()
    assert parse_gate("pass_rate>=92.5%").value == pytest.approx(0.925)
    for text in ("accuracy>=1.5", "pass_rate>=92.5", "avg_score>3.5", "pass_rate>=0.9 pass>=2.5", "error_rate<=1.5"):
        with pytest.raises(GateError, match=r"not a whole percentage.*%"):
            parse_gate(text)
    # with the run's scales known, rates stay rates, and so do a boolean trait and a 0-1 score trait
    gates = _on_scales("pass_rate>=80", "AnswersDirectly>=80", "Binary>=80", "Clarity>=0.5 pass>=4",
                       scales={**CLARITY, "Binary": (0.0, 1.0)})
    assert [g.value for g in gates] == pytest.approx([0.8, 0.8, 0.8, 0.5]) and gates[3].pass_value == 0.75
    with pytest.raises(GateError, match="not a whole percentage"):  # a boolean trait has no scale to read it on
        _on_scales("AnswersDirectly>=1.5")
    assert _on_scales("Clarity>=3.5")[0].value == pytest.approx(0.625)  # on a 1-5 scale 3.5 is a mean


def _report_args(tmp_path: Path, *gates: str) -> tuple[argparse.Namespace, Path]:
    run = tmp_path / "run.json"  # a results file: no store is asked
    run.write_text("[]")
    out = tmp_path / "out"
    return argparse.Namespace(run=str(run), gate=list(gates), max_errors=None, quiet=True, output=str(out),
                              html=None, junit=None), out


@pytest.mark.parametrize("rubric", [CLARITY_RUBRIC, None])  # None: a file without its rubric (scores read on 1-5)
def test_veribus_report_reads_a_trait_gate_on_the_scale(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        rubric: dict[str, Any] | None) -> None:
    def data(scores: list[int]) -> RunData:
        return RunData(run_id="r", results=_clarity_results(scores), rubric_definition=rubric)

    args, out = _report_args(tmp_path, "Clarity>=6")
    with pytest.raises(GateError, match="Clarity's 1–5 scale"):
        cli_analysis._report(args, data(MEAN_4_56), None)
    assert not out.exists()  # refused before anything was written
    args, _ = _report_args(tmp_path, "Clarity>=4")
    assert cli_analysis._report(args, data(MEAN_4_56), None) == EXIT_OK
    assert "4 read on Clarity's 1–5 scale as 0.75" in capsys.readouterr().err
    assert cli_analysis._report(args, data(MEAN_3_9), None) == EXIT_GATE_FAILED


@pytest.fixture
def no_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """`veribus run` as far as starting a stack: there it stops (as at a Ctrl-C), nothing published."""
    calls: list[str] = []

    def stop(*args: Any, **kwargs: Any) -> Any:
        calls.append("stack.up")
        raise KeyboardInterrupt

    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    monkeypatch.setattr(stack, "running_stack", lambda settings: None)
    monkeypatch.setattr(stack, "degraded_stack", lambda settings: None)
    monkeypatch.setattr(stack, "up", stop)
    monkeypatch.setattr(stack, "down", lambda *a, **k: None)
    return calls


def test_veribus_run_refuses_a_gate_off_the_trait_s_scale_before_starting(
        no_stack: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", str(EXAMPLE), "--simulate", "--mode", "template_and_rubric"]
    assert cli.main([*argv, "--gate", "Clarity>=6"]) == 2
    err = capsys.readouterr().err
    assert "gate 'Clarity>=6'" in err and "Clarity's 1–5 scale" in err and no_stack == []
    cli.main([*argv, "--gate", "Clarity>=4", "--quiet"])  # stops where the stack would start
    err = capsys.readouterr().err
    assert no_stack == ["stack.up"]
    assert "gate Clarity >= 0.75 (a mean of 4 on 1–5) (from 'Clarity>=4'; 4 read on Clarity's 1–5 scale as 0.75)" in err


# --------------------------------------------------------------------------------------------
# Report outputs
# --------------------------------------------------------------------------------------------


def test_summary_metrics_on_the_grid() -> None:
    s = report.summarize(grid_results(), unfinished_skipped=1)
    assert (s["total"], s["total_attempted"], s["passed_attempts"], s["failed_attempts"], s["errors"]) == (
        36, 35, 23, 12, 1)
    assert s["avg_score_attempted"] == round(23 / 35, 4) and s["avg_score_total"] == round(23 / 36, 4)
    assert s["unfinished_questions_skipped"] == 1
    assert list(s["by_metric"]) == ["accuracy", "cites", "clarity", "coverage", "safe"]
    acc = s["by_metric"]["accuracy"]
    assert acc["pass_rate"] == round(100 * 23 / 35, 2) and acc["passed_attempts"] == 23 and acc["failed_attempts"] == 12
    assert acc["pass_rate_ci95"][0] < acc["pass_rate"] < acc["pass_rate_ci95"][1]
    assert s["by_metric"]["safe"]["avg_score_attempted"] == 1.0
    assert [m["model_name"] for m in s["per_model"]] == ["litellm:model-a", "litellm:model-b"]
    a, b = s["per_model"]
    assert (a["passed_samples"], a["failed_samples"], a["errors"]) == (10, 8, 0)
    assert (b["passed_samples"], b["failed_samples"], b["errors"], b["total"]) == (13, 4, 1, 18)
    assert b["avg_score_attempted"] == round(13 / 17, 4) and b["pass_rate"] == round(100 * 13 / 17, 2)


def test_sample_scores() -> None:
    ok = grid_results()[0]
    err = next(r for r in grid_results() if not r.metadata.completed_without_errors)
    assert report.score_of(ok) == 1.0
    assert not err.metadata.completed_without_errors and report.score_of(err) is None
    # rubric_only: the mean of the traits, scores scaled by their range
    rub = make("q9", "m", None, with_template=False, rubric={"llm_trait_scores": {"clarity": 4, "safe": True},
                                                                "regex_trait_scores": {"cites": False}})
    assert report.score_of(rub) == pytest.approx((0.75 + 1 + 0) / 3)
    assert report.score_of(rub, {"clarity": (0.0, 4.0)}) == pytest.approx((1 + 1 + 0) / 3)
    literal = make("q9", "m", True, rubric={"llm_trait_scores": {"tone": 2}, "llm_trait_labels": {"tone": "formal"}})
    assert "tone" not in report.metric_scores(literal)
    assert report.trait_ranges_from_rubric({"llm_traits": [{"name": "c", "kind": "score", "min_score": 0,
                                                            "max_score": 10}]}) == {"c": (0.0, 10.0)}


def test_results_jsonl_line_shape() -> None:
    rs = grid_results()
    line = report.result_line(rs[0])
    assert set(line) >= {"sample", "submission", "grade", "grades", "trajectory", "model_name", "usage", "result"}
    assert line["sample"]["id"] == "q1" and line["sample"]["ground_truth"] == "BCL2"
    assert line["grade"]["score"] == 1.0 and line["grades"]["accuracy"]["score"] == 1.0
    assert line["grades"]["clarity"] == {"score": 0.5, "rationale": "rubric trait", "value": 3}
    assert line["trajectory"][0][0] == {"role": "user", "content": rs[0].metadata.question_text}
    assert line["usage"]["total"]["total_tokens"] == 250 and line["model_name"] == "litellm:model-a"
    err = report.result_line(next(r for r in rs if not r.metadata.completed_without_errors))
    assert err["grade"]["score"] == 0.0 and err["grade"]["rationale"].startswith("Error: generate_answer")
    assert err["grade"]["metadata"]["error_type"] == "TimeoutError" and err["grades"] == {}


def test_console_block() -> None:
    rs = grid_results()
    s = report.summarize(rs)
    rep = evaluate_gates(rs, [parse_gate("accuracy>=0.6")])
    text = report.results_block(s, rep.lines)
    lines = text.splitlines()
    assert lines[:5] == ["Results:", "  Total samples: 36", "  Attempted: 35", "  Avg score: 0.64 (attempted: 0.66)",
                         "  Passed: 23 (65.7%)"]
    assert any(line.startswith("Gate (accuracy >= 0.6): PASSED") for line in lines)
    assert "Results by model:" in lines
    assert any("litellm:model-b" in line and "Pass: 76.5%" in line for line in lines)
    assert report.results_block(s, simulated=True).startswith("Results:  (SIMULATED LLM)")


def test_write_outputs_files(tmp_path: Path) -> None:
    rs = spec_results()
    s = report.summarize(rs)
    s["gates_passed"] = False
    report.write_outputs(tmp_path, "suite-x", "run-1", rs, s, {"replicate_count": 1}, simulated=True)
    header = json.loads((tmp_path / "header.json").read_text())
    assert header["suite_name"] == "suite-x" and header["simulated"] is True and "timestamp" in header
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["suite"] == "suite-x" and summary["gates_passed"] is False
    m = summary["metrics"]
    for key in ("total", "total_attempted", "avg_score_attempted", "avg_score_total", "passed_attempts",
                "failed_attempts", "by_metric", "per_model"):
        assert key in m
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["result"]["metadata"]["question_id"] == "q1"


def test_multi_run_outputs_and_aggregate_stats(tmp_path: Path) -> None:
    runs = []
    for k in range(3):
        rs = [r for i, r in enumerate(grid_results()) if i % 3 != k]  # a different third left out each time
        s = report.summarize(rs)
        s["gates_passed"] = k != 2
        runs.append((rs, s))
    stats = report.write_multi_run(tmp_path, runs, suite="grid", run_ids=["a", "b", "c"])
    for i in (1, 2, 3):
        assert {p.name for p in (tmp_path / f"run_{i}").iterdir()} == {"header.json", "summary.json", "results.jsonl"}
    on_disk = json.loads((tmp_path / "aggregate_stats.json").read_text())
    assert on_disk == json.loads(json.dumps(stats))
    assert (stats["num_runs"], stats["runs_passed"], stats["runs_failed"]) == (3, 2, 1)
    assert stats["pass_rate"] == round(200 / 3, 2)
    scores = [s["avg_score_attempted"] for _, s in runs]
    agg = stats["avg_score_attempted"]
    assert agg["mean"] == pytest.approx(sum(scores) / 3, abs=1e-6)
    assert agg["min"] == min(scores) and agg["max"] == max(scores)
    assert agg["ci95_low"] <= agg["mean"] <= agg["ci95_high"] and agg["std"] >= 0
    assert set(stats["per_metric"]) == {"accuracy", "cites", "clarity", "coverage", "safe"}
    assert set(stats["per_metric"]["accuracy"]) == {"avg_score_attempted", "pass_rate"}
    assert set(stats["per_model"]) == {"litellm:model-a", "litellm:model-b"}
