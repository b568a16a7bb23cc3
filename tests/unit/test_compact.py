"""The lean `result.finalized`: a result travels without its default values and comes back key
for key and byte for byte, events written before (full results) still read, and the projector's
row is the same either way."""

from __future__ import annotations

import json

import msgspec
import pytest

from shared.analysis.resultset import VerificationResultSet
from shared.core import events
from shared.core.compact import compact, expand
from shared.core.models import VerificationResult
from shared.store.rows import RESULT_COLUMNS, project_envelopes
from tests.conftest import REFERENCE
from tests.support.results import grid_results, spec_results

REF_FULL = REFERENCE / "export_format" / "results_export_full.json"


def _dumps() -> list[dict]:
    results = [*spec_results(), *grid_results(),
               *VerificationResultSet.from_file(REF_FULL).results]
    return [r.model_dump(mode="json") for r in results]


@pytest.mark.parametrize("dump", _dumps())
def test_expand_restores_the_dump_exactly(dump: dict) -> None:
    small = compact(dump)
    back = expand(small)
    assert json.dumps(back) == json.dumps(dump)  # same keys, same order, same values
    assert len(json.dumps(small)) < len(json.dumps(dump))
    assert VerificationResult.model_validate(small).model_dump(mode="json") == dump


def test_defaults_are_left_out_and_falsy_values_that_differ_are_kept() -> None:
    dump = spec_results()[0].model_dump(mode="json")
    dump["template"]["verify_result"] = False  # default None: kept
    dump["template"]["embedding_similarity_score"] = 0.0  # default None: kept
    dump["metadata"]["few_shot_example_count"] = 0  # default 0: left out
    dump["used_full_trace"] = False  # default True: kept
    small = compact(dump)
    assert small["template"]["verify_result"] is False
    assert small["template"]["embedding_similarity_score"] == 0.0
    assert "few_shot_example_count" not in small["metadata"]
    assert "caveats" not in small["metadata"] and "scenario_id" not in small["metadata"]
    assert small["used_full_trace"] is False
    assert small["metadata"]["answering"].get("interface", "litellm") == dump["metadata"]["answering"]["interface"]
    assert json.dumps(expand(small)) == json.dumps(dump)


def test_extra_fields_of_reference_files_survive() -> None:
    dump = spec_results()[0].model_dump(mode="json")
    dump["metadata"]["from_a_newer_reference"] = {"x": None}
    dump["future_section"] = None
    assert json.dumps(expand(compact(dump))) == json.dumps(dump)


def _finalized(payload: object) -> events.Envelope:
    return events.make_envelope(events.RESULT_FINALIZED, "20250101T000000-aaaaaaaa", "0123456789abcdef",
                                payload, "finalization/test")


def test_wire_payload_is_compact_and_decodes_to_the_full_dump() -> None:
    dump = spec_results()[1].model_dump(mode="json")
    lean_env = _finalized(events.ResultFinalized.wire(dump))
    old_env = _finalized(events.ResultFinalized(result=dump))  # as finalizers wrote it before
    assert len(lean_env.payload) < len(old_env.payload) * 0.6
    for env in (lean_env, old_env):
        again = events.decode(events.encode(env))
        assert json.dumps(events.payload_as(again, events.ResultFinalized).result) == json.dumps(dump)
    lean_row, old_row = (dict(zip(RESULT_COLUMNS, project_envelopes([e]).results[0], strict=True))
                         for e in (lean_env, old_env))
    assert lean_row["result_json"] == old_row["result_json"] == msgspec.json.encode(dump)
    assert {k: v for k, v in lean_row.items() if k != "version"} == {k: v for k, v in old_row.items() if k != "version"}


def _stage_event() -> events.StageEvent:
    job = events.Job(run_id="20250101T000000-aaaaaaaa", result_id="0123456789abcdef", answer_id="fedcba9876543210",
                     question_id="q1", question_text="What is 2+2?",
                     answering=events.ModelSpec(model_name="openai/a"), parsing=events.ModelSpec(model_name="openai/j"),
                     timestamp="2025-01-01T00:00:00+00:00")
    state = events.State(started_at=1_750_000_000.123456, stages=[
        events.StageRecord(stage="generate_answer", status="performed", started_at=1_750_000_000.123456,
                           ended_at=1_750_000_000.623457),
        events.StageRecord(stage="abstention_check", status="skipped", reason="abstention_enabled is false",
                           started_at=1_750_000_000.7, ended_at=1_750_000_000.700001)])
    return events.StageEvent(job=job, state=state)


def test_published_envelope_names_its_ids_by_subject_and_decodes_whole() -> None:
    ev = _stage_event()
    env = events.make_envelope(events.ANSWER_GENERATED, ev.job.run_id, ev.job.result_id,
                               msgspec.structs.replace(ev, state=events.lean_state(ev.state)), "generation/test")
    data = events.wire(env)
    assert ev.job.result_id.encode() not in data.split(b'"payload"')[0]  # the subject says it
    assert len(data) < len(events.encode(env))
    back = events.decode(data, env.subject)
    assert (back.event_id, back.event_type, back.run_id, back.result_id) == (
        env.event_id, env.event_type, env.run_id, env.result_id)
    with pytest.raises(events.InvalidEvent, match="subject"):
        events.decode(data)  # a published envelope is read with its subject
    with pytest.raises(events.InvalidEvent, match="not vb"):
        events.decode(data, "vb.answer.generated")
    with pytest.raises(events.InvalidEvent, match="result_id"):
        events.decode(data, "vb.answer.generated.20250101T000000-aaaaaaaa.bad result")
    # the stage log comes back as records, to the microsecond
    st = events.payload_as(back, events.StageEvent).state
    assert [(r.stage, r.status, r.reason) for r in st.stages] == [(r.stage, r.status, r.reason) for r in ev.state.stages]
    for got, want in zip(st.stages, ev.state.stages, strict=True):
        assert abs(got.started_at - want.started_at) < 2e-6 and abs(got.ended_at - want.ended_at) < 2e-6
    assert st.log == []


def test_an_event_id_that_does_not_follow_from_the_ids_is_kept() -> None:
    env = events.make_envelope(events.DEAD_LETTER, "run1", "res1",
                               events.DeadLetter(subject="vb.x.y.run1.res1", consumer="c", error="e", deliveries=1), "t")
    env.event_id = "res1:dead.letter:parsing-abc123"
    back = events.decode(events.wire(env), env.subject)
    assert back.event_id == "res1:dead.letter:parsing-abc123"


def test_lean_state_encodes_the_compact_log() -> None:
    wire = msgspec.json.encode(events.lean_state(_stage_event().state))
    assert b'"stages"' not in wire and b'"log":[["generate_answer","performed","",0.0,0.500001]' in wire


def test_lean_state_leaves_out_empty_template_defaults_and_the_fold_restores_them() -> None:
    from shared.core.fold import fold_result

    ev = _stage_event()
    ev.state.template = {"raw_llm_response": "4", "trace_messages": [], "answering_mcp_servers": None,
                         "verify_result": False, "regex_validation_results": {}, "abstention_detected": None}
    lean = events.lean_state(ev.state)
    assert lean.template == {"raw_llm_response": "4", "verify_result": False, "regex_validation_results": {}}
    full = fold_result(ev.job, ev.state, None, 1_750_000_001.0).model_dump(mode="json")
    thin = fold_result(ev.job, lean, None, 1_750_000_001.0).model_dump(mode="json")
    assert full == thin
