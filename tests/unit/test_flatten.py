"""Flattening results and envelopes into ClickHouse rows (pure: no bus, no database)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import msgspec
import pytest

from shared.core import events
from shared.core.config import Settings
from shared.core.models import (
    VerificationResult,
)
from shared.store.rows import (
    EVENT_COLUMNS,
    RESULT_COLUMNS,
    RUN_COLUMNS,
    event_row,
    project_envelopes,
    result_to_row,
    row_to_result,
    run_row,
    undecodable_row,
)
from tests.conftest import REFERENCE
from tests.support.rows import RUBRIC, TIMESTAMP, USAGE, make_result, stage_env


def test_result_row_has_every_column_and_typed_values() -> None:
    r = make_result(rubric=RUBRIC, usage=USAGE, tools=["search", "calc"])
    row = result_to_row(r, "run1", version=7)
    assert set(row) == set(RESULT_COLUMNS)
    assert row["run_id"] == "run1" and row["result_id"] == r.metadata.result_id and row["version"] == 7
    assert row["answering_model"] == r.metadata.answering_model == "litellm:gpt-4o+[calc,search]"
    assert row["parsing_model"] == r.metadata.parsing_model
    assert row["answering_tools"] == ["search", "calc"]
    assert row["verify_result"] is True and row["verify_granular_result"] == 0.5
    assert row["replicate"] == 1 and row["keywords"] == ["k1", "k2"]
    assert row["input_tokens"] == 350 and row["output_tokens"] == 280 and row["total_tokens"] == 630
    assert row["usage_stage"] == ["answer_generation", "parsing"]
    assert row["usage_model"] == ["gpt-4o", "gpt-4o-mini"]  # entry's model, else the stage's model name
    assert row["usage_input_tokens"] == [150, 200] and row["usage_output_tokens"] == [200, 80]
    assert row["llm_trait_scores"] == {"clarity": 4.0, "safety": 1.0}
    assert row["regex_trait_scores"] == {"has_citations": 0.0}
    assert row["callable_trait_scores"] == {"under_150w": 1.0}
    assert row["metric_trait_scores"] == {"drug_coverage": {"precision": 1.0, "recall": 0.75}}
    assert row["llm_trait_labels"] == {"tone": "formal"}
    assert row["has_rubric"] and row["rubric_evaluation_performed"] and row["deep_judgment_performed"]
    assert json.loads(row["rubric_json"])["llm_trait_scores"] == {"clarity": 4, "safety": True}
    assert json.loads(row["usage_json"]) == USAGE
    assert row["run_timestamp"] == int(1776772800 * 1e6)  # 2026-04-21T12:00:00Z in µs


def test_result_without_template_or_usage_or_verdict() -> None:
    r = make_result(verify=None, error="parse_template: ValueError: bad json")
    r.template = None
    row = result_to_row(r, "run1")
    assert row["has_template"] is False and row["verify_result"] is None
    assert row["completed_without_errors"] is False and row["error"].startswith("parse_template")
    assert row["failure_category"] == "error" and row["failure_stage"] == "parse_template"
    assert row["template_json"] == b"" and row["input_tokens"] == 0 and row["usage_stage"] == []
    assert abs(row["version"] - time.time() * 1e6) < 60e6  # defaults to now


def test_usage_without_total_is_summed() -> None:
    usage = {k: v for k, v in USAGE.items() if k != "total"}
    row = result_to_row(make_result(usage=usage), "r")
    assert (row["input_tokens"], row["output_tokens"], row["total_tokens"]) == (350, 280, 630)


def test_round_trip_through_result_json() -> None:
    r = make_result(rubric=RUBRIC, usage=USAGE)
    assert row_to_result(result_to_row(r, "run1")) == r
    assert row_to_result(result_to_row(r.model_dump(mode="json"), "run1")["result_json"]) == r


def test_round_trip_keeps_reference_extra_fields() -> None:
    data = json.loads((REFERENCE / "export_format" / "results_export_full.json").read_text())
    for item in data["results"]:
        original = VerificationResult.model_validate(item)
        back = row_to_result(result_to_row(original, "run1"))
        assert back == original
        assert back.model_dump(mode="json") == original.model_dump(mode="json")
        assert back.metadata.scenario_id is None  # the reference's 2.2 scenario fields, kept as null
        extra = VerificationResult.model_validate({**item, "metadata": {**item["metadata"], "future_field": 1}})
        assert row_to_result(result_to_row(extra, "run1")).metadata.model_extra == {"future_field": 1}



def test_event_row_of_a_stage_event() -> None:
    env = stage_env(
        events.TEMPLATE_PARSED, "r1",
        [("generate_answer", "performed", 10.0, 11.0), ("parse_template", "performed", 11.5, 12.0)],
        usage={"answer_generation": {"input_tokens": 5, "output_tokens": 6}, "parsing": {"input_tokens": 7, "output_tokens": 8}},
    )
    row = dict(zip(EVENT_COLUMNS, event_row(env), strict=True))
    assert row["event_id"] == env.event_id and row["subject"] == "vb.template.parsed.run1.r1"
    assert row["stage"] == "parsing" and row["status"] == "performed"
    assert (row["input_tokens"], row["output_tokens"]) == (7, 8)  # this stage's usage entry only
    assert row["stage_names"] == ["generate_answer", "parse_template"]
    assert row["stage_started"] == [10.0, 11.5] and row["stage_ended"] == [11.0, 12.0]
    assert row["occurred_at"] == round(env.occurred_at * 1e6)
    assert msgspec.json.decode(row["payload"])["state"]["stages"][1]["stage"] == "parse_template"


def test_event_row_of_failed_and_skipped_and_broken_payloads() -> None:
    err = events.StageError(stage="parsing", type="ValueError", message="bad json", attempt=3)
    failed = events.make_envelope(events.STAGE_FAILED, "run1", "r1", events.StageFailed(error=err), "p/1", attempt=3)
    row = dict(zip(EVENT_COLUMNS, event_row(failed), strict=True))
    assert (row["stage"], row["status"], row["error_type"], row["error_message"], row["attempt"]) == \
        ("parsing", "failed", "ValueError", "bad json", 3)

    skipped = stage_env(events.RUBRIC_EVALUATED, "r1", [], status="skipped")
    assert dict(zip(EVENT_COLUMNS, event_row(skipped), strict=True))["status"] == "skipped"

    broken = events.make_envelope(events.STAGE_FAILED, "run1", "r1", {"error": "not a struct"}, "p/1")
    row = dict(zip(EVENT_COLUMNS, event_row(broken), strict=True))
    assert row["status"] == "payload_invalid" and row["error_type"] == "ValidationError"


def test_undecodable_row_is_deterministic_per_message() -> None:
    a = undecodable_row("vb.answer.generated.runX.rid9", b"\xff not json", ValueError("boom"))
    b = undecodable_row("vb.answer.generated.runX.rid9", b"\xff not json", ValueError("boom"))
    c = undecodable_row("vb.answer.generated.runX.rid9", b"other", ValueError("boom"))
    ra = dict(zip(EVENT_COLUMNS, a, strict=True))
    assert a[0] == b[0] != c[0]
    assert (ra["event_type"], ra["run_id"], ra["result_id"], ra["stage"]) == ("undecodable", "runX", "rid9", "answer.generated")
    assert ra["error_type"] == "ValueError" and ra["payload"] == b"\xff not json"


def test_project_envelopes_folds_results_and_runs() -> None:
    r = make_result(usage=USAGE)
    fin = events.make_envelope(events.RESULT_FINALIZED, "run1", r.metadata.result_id,
                               events.ResultFinalized(result=r.model_dump(mode="json")), "finalization/1")
    run = events.make_envelope(events.RUN_REQUESTED, "run1", events.RUN_KEY, events.RunRequested(
        run_id="run1", timestamp=TIMESTAMP, job_count=3, answer_count=3, benchmark_name="b", config={"x": 1}), "cli/1")
    bad = events.make_envelope(events.RESULT_FINALIZED, "run1", "zz", {"result": [1, 2]}, "finalization/1")
    p = project_envelopes([fin, run, bad])
    assert len(p.events) == 3 and len(p.results) == 1 and len(p.runs) == 1
    resrow = dict(zip(RESULT_COLUMNS, p.results[0], strict=True))  # a projection keeps the values in column order
    assert resrow["version"] == round(fin.occurred_at * 1e6)
    assert row_to_result(resrow) == r
    assert resrow == result_to_row(r, "run1", version=resrow["version"])
    runrow = dict(zip(RUN_COLUMNS, p.runs[0], strict=True))
    assert runrow["job_count"] == 3 and json.loads(runrow["config_json"]) == {"x": 1}
    assert p.events[2][10] == "payload_invalid"
    assert dict(zip(RUN_COLUMNS, run_row({"run_id": "r", "timestamp": "t", "job_count": 1, "answer_count": 1}),
                    strict=True))["run_id"] == "r"


def test_projector_batch_never_raises_on_bad_messages() -> None:
    from shared.store.projection import Projector

    r = make_result()
    good = events.make_envelope(events.RESULT_FINALIZED, "run1", r.metadata.result_id,
                                events.ResultFinalized(result=r.model_dump(mode="json")), "f/1")
    wrong_version = events.encode(good).replace(b'"payload"', b'"schema_version":99,"payload"')
    msgs = [
        SimpleNamespace(subject=good.subject, data=events.encode(good)),
        SimpleNamespace(subject="vb.answer.generated.run1.x", data=b"{not json"),
        SimpleNamespace(subject=good.subject, data=wrong_version),
    ]
    proj = Projector(Settings())
    p = proj.project_batch(msgs)
    assert len(p.events) == 3 and len(p.results) == 1
    assert [e[1] for e in p.events] == ["result.finalized", "undecodable", "undecodable"]
    assert p.events[2][12] == "SchemaVersionError" and proj.stats.undecodable == 2


@pytest.mark.parametrize("n", [2000])
def test_projection_of_many_encoded_events(n: int) -> None:
    """Thousands of encoded events decode and project to one row each; the per-event CPU is
    printed as a measurement (`veribus bench` reports the projector's figures)."""
    envs = [
        stage_env(events.GUARDS_CHECKED, f"r{i}", [("generate_answer", "performed", 1.0, 2.0),
                                                  ("abstention_check", "skipped", 2.0, 2.0)])
        for i in range(n)
    ]
    data = [events.encode(e) for e in envs]
    t0 = time.process_time()
    p = project_envelopes(events.decode(d) for d in data)
    per_event = (time.process_time() - t0) / n
    print(f"projection: {per_event * 1e6:.0f} us CPU per event")
    assert len(p.events) == n and {row[0] for row in p.events} == {e.event_id for e in envs}
