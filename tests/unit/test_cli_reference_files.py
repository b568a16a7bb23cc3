"""The reference's exports read as RUN by the analysis commands (`RUN` may be a results file):
no deployment is asked, and nothing points at a store the file's rows are not in."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.cli.commands import main
from tests.conftest import REFERENCE

FULL = REFERENCE / "export_format" / "results_export_full.json"


def test_report_of_a_reference_export_points_at_no_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """It printed `run id: results_export_full - rows: veribus query "SELECT * ... WHERE run_id =
    'results_export_full'"`, a query that finds nothing: the rows are in the file."""
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    assert main(["report", str(FULL)]) == 4  # q-timeout ended in error (format 2.2: metadata.failure)
    out = capsys.readouterr().out
    assert "Total samples: 2" in out and "Errors: 1" in out and "1 x generate_answer / timeout" in out
    assert "veribus query" not in out and "run id:" not in out, out
    assert not (tmp_path / "home").exists()  # no stack, no chdb folder made for a file


def test_an_errored_result_is_never_a_pass_in_any_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """q-timeout has a `failure` of category timeout (an error: completed_without_errors is
    derived False) beside `verify_result: true`. `results` counted it passed (2/2) while `report`
    said 1 attempted, 1 passed, 1 error: now every output says 1 passed, 1 error."""
    import json

    from shared.analysis.html_digest import RunDigest
    from shared.analysis.resultset import VerificationResultSet
    from shared.analysis.stats import compare_models, pass_at_k_report

    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    assert main(["results", str(FULL)]) == 0
    table = capsys.readouterr().out
    assert "2 results, 1 errors" in table and "1/1" in table and "2/2" not in table, table
    assert main(["results", str(FULL), "--format", "json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert (js["summary"]["num_passed"], js["summary"]["num_verdicts"], js["summary"]["num_errors"]) == (1, 1, 1)
    assert [(r["passed"], r["n"]) for r in js["pass_rates"]] == [(1, 1)]
    assert main(["report", str(FULL), "--html", str(tmp_path / "r.html"), "--output", str(tmp_path / "out"),
                 "--max-errors", "1", "--gate", "accuracy>=1"]) == 0
    console = capsys.readouterr().out
    assert "Passed: 1 (100.0%)" in console and "Errors: 1" in console and "Failed: 0" in console, console
    metrics = json.loads((tmp_path / "out" / "summary.json").read_text())["metrics"]
    assert (metrics["passed_attempts"], metrics["errors"], metrics["per_model"][0]["passed_samples"]) == (1, 1, 1)
    lines = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert {x["sample"]["id"]: x["grade"]["score"] for x in lines} == {"q-unicode": 1.0, "q-timeout": 0.0}
    html = (tmp_path / "r.html").read_text()
    # the HTML page's per-model table: results, errors, verdicts, passed
    assert "<td>langchain:gpt-4o</td><td>2</td><td>1</td><td>1</td><td>1</td>" in html
    assert "q-timeout · 0/0 passed" in html
    assert main(["compare", str(FULL), "--model-a", "gpt-4o", "--model-b", "gpt-4o", "--format", "json"]) == 0
    cmp = json.loads(capsys.readouterr().out)
    assert (cmp["pairs"], cmp["both_pass"]) == (1, 1)

    rs = VerificationResultSet.from_file(FULL)
    tr = rs.get_template_results()
    assert (tr.get_template_summary()["num_passed"], tr.get_template_summary()["num_failed"]) == (1, 0)
    assert tr.aggregate_pass_rate(by="question_id") == {"q-unicode": 1.0}
    assert [r.metadata.question_id for r in tr.filter(passed_only=True)] == ["q-unicode"]
    assert compare_models(rs.results, "gpt-4o", "gpt-4o").pairs == 1
    assert [(q["question_id"], q["n"]) for q in pass_at_k_report(rs.results).per_question] == [("q-unicode", 1)]
    d = RunDigest.of(rs.results)
    assert d.per_model["langchain:gpt-4o"][:4] == [1, 1, 2, 1]  # passed, verdicts, results, errors


@pytest.mark.parametrize(("name", "content", "says"), [
    ("bad.json", "{}\n", "not a results file: 1 item(s), none of them a result"),
    ("other.jsonl", '{"a": 1}\n{"b": 2}\n', "not a results file: 2 item(s), none of them a result"),
    ("list.json", '[{"x": 1}]', "not a results file: 1 item(s), none of them a result"),
    ("bad.parquet", "not parquet at all", "not a Parquet file (a Parquet file starts with the bytes PAR1)"),
    ("empty.jsonl", "", "holds no results"),
])
def test_a_file_that_holds_no_result_is_bad_input_for_results_as_for_report(
        name: str, content: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`results bad.json` with `{}` in it said `0 results` and exit 0 (JSON without a result was
    skipped item by item), where `report` said exit 2; a garbage .parquet was 'line 1: not JSON'."""
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    path = tmp_path / name
    path.write_text(content)
    for command in ("results", "report"):
        assert main([command, str(path)]) == 2, command
        err = capsys.readouterr().err
        assert says in err, (command, err)


def test_a_missing_results_file_is_named_as_a_file_not_as_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    assert main(["results", str(tmp_path / "nofile.json")]) == 2
    err = capsys.readouterr().err
    assert f"no results file {tmp_path / 'nofile.json'}: no such file" in err and "no run" not in err, err
