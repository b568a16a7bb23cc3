"""CSV injection (OWASP): questions, model replies, model and run names are untrusted, and a
spreadsheet runs a cell that starts with `=`, `+`, `-`, `@` (tab, carriage return, after leading
whitespace, or full-width) as a formula. Every CSV veribus writes puts a `'` before such text and
leaves numbers alone; `--csv-raw` / `csv_raw=True` gives the cells back unchanged for programs;
JSON and JSONL are not touched. Attacked through the export API and the `veribus export` command
on results files, as a user would run them, with no deployment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shared.analysis.csv_cells import spreadsheet_safe
from shared.analysis.export import export_results
from shared.analysis.resultset import VerificationResultSet
from shared.cli.commands import main
from tests.support.csv_attack import PAYLOADS, attack_results, check_escaped, check_raw, read_csv


@pytest.fixture(autouse=True)
def _no_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)


@pytest.mark.parametrize("payload", PAYLOADS + ["\tplain", "\r", "\n=1", "  -x", "-inf", " -1", "＝", "@"])
def test_formula_text_gets_a_quote(payload: str) -> None:
    assert spreadsheet_safe(payload) == "'" + payload


@pytest.mark.parametrize("value", ["", "plain text", "a=b", "'=1", "{\"a\": \"=1\"}", "[\"=1\"]", "-1.5", "+3",
                                   "-2", "1e-3", "-.5", " text", -1.5, -2, 0, None, True, False])
def test_other_cells_are_left_as_they_are(value: Any) -> None:
    out = spreadsheet_safe(value)
    assert out == value and type(out) is type(value)


def test_export_api_quotes_formulas_and_keeps_numbers(tmp_path: Path) -> None:
    results = attack_results()
    safe, raw = tmp_path / "safe.csv", tmp_path / "raw.csv"
    assert export_results(results, "csv", safe, run_id="run-x").rows == len(PAYLOADS)
    check_escaped(safe, results)
    assert export_results(results, "csv", raw, run_id="run-x", csv_raw=True).rows == len(PAYLOADS)
    check_raw(raw, results)
    # veribus reads either back exactly (from result_json, which no quote touches)
    assert VerificationResultSet.from_file(safe).results == results
    assert VerificationResultSet.from_file(raw).results == results


def test_veribus_export_csv_from_a_results_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`veribus export FILE -o x.csv` (the command, its format taken from the suffix), with and
    without --csv-raw; and a CSV it wrote, exported again, is quoted once, not twice."""
    results = attack_results()
    seed = _seed(tmp_path, results)
    safe, raw, again = tmp_path / "safe.csv", tmp_path / "raw.csv", tmp_path / "again.csv"
    assert main(["export", str(seed), "--output", str(safe)]) == 0
    check_escaped(safe, results)
    assert main(["export", str(seed), "--format", "csv", "--output", str(raw), "--csv-raw"]) == 0
    check_raw(raw, results)
    assert main(["export", str(safe), "--output", str(again)]) == 0
    check_escaped(again, results)
    assert _cells(again) == _cells(safe)
    capsys.readouterr()


def _cells(path: Path) -> list[dict[str, str]]:
    """A CSV's rows without the cells that name the export itself (its time, its source file)."""
    return [{k: v for k, v in row.items() if k not in ("export_timestamp", "job_id")} for row in read_csv(path)[1]]


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet"])
def test_csv_raw_is_refused_for_other_formats(fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed = _seed(tmp_path, attack_results())
    out = tmp_path / f"x.{fmt}"
    assert main(["export", str(seed), "--output", str(out), "--csv-raw"]) == 2
    assert "--csv-raw" in capsys.readouterr().err and not out.exists()
    with pytest.raises(ValueError, match="csv format only"):
        export_results(attack_results(), fmt, out, csv_raw=True)


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_json_exports_keep_the_text_as_it_is(fmt: str, tmp_path: Path) -> None:
    """JSON follows the reference's format: the attacker's text is data there, never quoted."""
    results = attack_results()
    out = tmp_path / f"r.{fmt}"
    assert main(["export", str(_seed(tmp_path, results)), "--output", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    items = json.loads(text)["results"] if fmt == "json" else [json.loads(line) for line in text.splitlines()]
    assert sorted(i["metadata"]["question_text"] for i in items) == sorted(PAYLOADS)
    assert sorted(i["template"]["raw_llm_response"] for i in items) == sorted(PAYLOADS)
    assert "'=HYPERLINK" not in text and "\"'" not in text
    assert VerificationResultSet.from_file(out).results == results


def _seed(tmp_path: Path, results: list[Any]) -> Path:
    seed = tmp_path / "seed.jsonl"
    export_results(results, "jsonl", seed)
    return seed
