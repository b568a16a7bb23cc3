"""Exports from results in memory: JSON in the reference's format 2.2 (read by the same reader
as the reference's own files), JSONL, CSV and Parquet round trips."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from shared.analysis.export import FORMAT_VERSION, export_results, verification_config_of
from shared.analysis.files import iter_results_from_file
from shared.analysis.resultset import VerificationResultSet
from shared.core.models import VerificationResult
from tests.conftest import REFERENCE
from tests.unit.test_results import grid_results, spec_results

REF_DIR = REFERENCE / "export_format"
REF_FULL = REF_DIR / "results_export_full.json"
REF_EMPTY = REF_DIR / "results_export_empty.json"
CONFIG = {"answering_models": [{"model_name": "openai/gpt-4o", "temperature": 0.7, "interface": "litellm"}],
          "parsing_models": [{"model_name": "gpt-4o-mini", "temperature": 0.0, "interface": "litellm"}],
          "replicate_count": 3, "evaluation_mode": "template_and_rubric"}


def _read_export(path: Path) -> tuple[dict[str, Any], list[VerificationResult]]:
    """One reader for every JSON export: the whole document (json) and its results (our loader)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    return doc, list(iter_results_from_file(path))


def _shape(doc: dict[str, Any]) -> dict[str, Any]:
    results = doc["results"]
    return {
        "top": sorted(doc),
        "metadata": sorted(doc["metadata"]),
        "verification_config": sorted(k for k in doc["metadata"]["verification_config"]
                                      if k in ("answering_models", "parsing_models")),
        "model_entry": sorted(doc["metadata"]["verification_config"]["answering_models"][0]),
        "job_summary_core": sorted(k for k in doc["metadata"]["job_summary"]
                                   if k in ("total_questions", "successful_count", "failed_count", "start_time",
                                            "end_time", "total_duration", "is_complete")),
        "shared_data": sorted(doc["shared_data"]),
        "result_sections": sorted(results[0]) if results else None,
    }


def test_our_json_export_has_the_reference_shape(tmp_path: Path) -> None:
    out = tmp_path / "ours.json"
    rubric = {"llm_traits": [{"name": "clarity", "kind": "score", "min_score": 1, "max_score": 5}]}
    stats = export_results(spec_results(), "json", out, job_id="run-1", config=CONFIG, rubric_definition=rubric)
    assert stats.rows == 4 and stats.format == "json" and stats.bytes == out.stat().st_size

    ref_doc, ref_results = _read_export(REF_FULL)
    our_doc, our_results = _read_export(out)
    assert _shape(our_doc) == _shape(ref_doc)
    assert our_doc["format_version"] == ref_doc["format_version"] == FORMAT_VERSION
    assert our_doc["metadata"]["karenina_version"].startswith("veribus ")
    assert our_doc["metadata"]["job_id"] == "run-1"
    assert our_doc["metadata"]["job_summary"]["total_questions"] == 4
    defn = our_doc["shared_data"]["rubric_definition"]
    assert list(defn) == ["llm_traits", "regex_traits", "callable_traits", "metric_traits", "agentic_traits"]
    (clarity,) = defn["llm_traits"]
    assert {k: clarity[k] for k in rubric["llm_traits"][0]} == rubric["llm_traits"][0]
    assert clarity["classes"] is None and "description" in clarity  # null-valued keys kept, as the reference
    # every result carries the sections and the metadata fields the reference's do
    ref_meta = set(ref_doc["results"][0]["metadata"])
    our_meta = set(our_doc["results"][0]["metadata"])
    assert ref_meta - our_meta <= {"scenario_id", "scenario_node", "scenario_turn", "scenario_path"}
    assert {"question_id", "template_id", "result_id", "answering", "parsing", "timestamp", "execution_time",
            "replicate", "run_name", "failure"} <= our_meta
    assert set(ref_doc["results"][0]["template"]) & set(our_doc["results"][0]["template"]) >= {
        "raw_llm_response", "parsed_llm_response", "verify_result", "usage_metadata"}
    # and both load through the same reader into the same model
    assert len(ref_results) == 2 and our_results == spec_results()


def test_json_export_is_one_result_per_line_like_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "ours.json"
    export_results(grid_results(), "json", out)
    lines = out.read_text().splitlines()
    ref_lines = REF_FULL.read_text().splitlines()
    assert lines[0].startswith('{"format_version": "2.2",') and lines[0].endswith(',"results":[')
    assert ref_lines[0].endswith(',"results":[')
    assert lines[-1] == ref_lines[-1] == "]}"
    assert len(lines) == 36 + 2
    assert all(json.loads(line.rstrip(","))["metadata"] for line in lines[1:-1])


def test_empty_export_matches_the_reference_empty_file(tmp_path: Path) -> None:
    out = tmp_path / "empty.json"
    assert export_results([], "json", out).rows == 0
    ours, ref = json.loads(out.read_text()), json.loads(REF_EMPTY.read_text())
    assert sorted(ours) == sorted(ref) and ours["results"] == ref["results"] == []
    assert out.read_text().splitlines()[1:] == ["", "]}"] == REF_EMPTY.read_text().splitlines()[1:]
    assert VerificationResultSet.from_file(out).results == []


def test_reference_results_round_trip_through_our_export(tmp_path: Path) -> None:
    _, ref_results = _read_export(REF_FULL)
    out = tmp_path / "again.json"
    export_results(ref_results, "json", out)
    _, back = _read_export(out)
    assert back == ref_results
    assert back[1].metadata.scenario_id is None  # the reference's 2.2 scenario fields are kept (null)
    assert back[1].template is not None and back[1].template.response_timeout_partial is False
    assert not back[1].metadata.completed_without_errors


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_json_and_jsonl_round_trip(tmp_path: Path, fmt: str) -> None:
    rs = grid_results()
    out = tmp_path / f"r.{fmt}"
    assert export_results(rs, fmt, out).rows == 36
    assert VerificationResultSet.from_file(out).results == rs
    if fmt == "jsonl":
        assert len(out.read_text().splitlines()) == 36


def test_csv_has_the_reference_columns_first_then_ours(tmp_path: Path) -> None:
    out = tmp_path / "r.csv"
    export_results(spec_results(), "csv", out, run_id="run-1")
    with out.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4
    cols = list(rows[0])
    # no provenance on these results: every trait is question-specific, as the reference treats them
    assert cols[:12] == ["question_id", "success", "error", "question_text", "raw_llm_response", "parsed_gt_response",
                         "parsed_llm_response", "template_verification_performed", "verify_result",
                         "verify_granular_result", "rubric_evaluation_performed", "keywords"]
    assert cols[12] == "question_specific_rubrics" and cols[13:54][-1] == "agent_metrics" and len(cols[12:54]) == 42
    assert len(set(cols)) == len(cols) and cols[-1] == "result_json"
    for c in ("trait.clarity", "trait.safety", "trait.has_citations", "trait.under_150w", "trait.drug_coverage.f1",
              "answering_model", "input_tokens", "run_id", "result_id", "template_id"):
        assert c in cols[54:] or c == "answering_model"
    assert [r["verify_result"] for r in rows] == ["true", "false", "true", "true"]
    assert [r["success"] for r in rows] == ["True"] * 4  # the reference's boolean format
    assert [r["completed_without_errors"] for r in rows] == ["True"] * 4
    assert [r["trait.clarity"] for r in rows] == ["4.0", "3.0", "5.0", "4.0"]
    assert json.loads(rows[0]["question_specific_rubrics"])["clarity"] == 4
    assert rows[1]["trait.drug_coverage.f1"] == "" and rows[0]["trait.drug_coverage.f1"] == "0.857"
    assert rows[0]["run_id"] == "run-1" and rows[0]["keywords"] == ""  # empty list: empty cell, as the reference


def test_parquet_keeps_typed_columns_and_the_whole_result(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    rs = grid_results()
    out = tmp_path / "r.parquet"
    assert export_results(rs, "parquet", out).rows == 36
    table = pq.read_table(out)
    assert table.num_rows == 36
    assert str(table.schema.field("verify_result").type) == "bool"
    assert str(table.schema.field("trait.clarity").type) == "double"
    assert str(table.schema.field("keywords").type).startswith("list<")
    data = table.to_pylist()
    assert sum(1 for d in data if d["verify_result"] is None) == 1
    assert [VerificationResult.model_validate_json(d["result_json"]) for d in data] == rs
    assert {d["trait.cites"] for d in data} == {0.0, 1.0, None}


def test_unknown_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown export format"):
        export_results(spec_results(), "xlsx", tmp_path / "x.xlsx")


def test_verification_config_in_the_reference_shape() -> None:
    cfg = verification_config_of(CONFIG)
    assert cfg["answering_models"] == [{"provider": "openai", "name": "openai/gpt-4o", "temperature": 0.7,
                                        "interface": "litellm"}]
    assert cfg["parsing_models"][0]["provider"] is None and cfg["replicate_count"] == 3
