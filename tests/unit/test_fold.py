"""The fold and the finalizer's join, without a bus."""

from __future__ import annotations

import asyncio

from services.finalization.stage import try_finalize
from shared.core import events
from shared.core.fold import fold_result
from shared.core.ids import compute_result_id
from shared.core.models import VerificationResultMetadata


def make_job(mode: str = "template_only", **kw) -> events.Job:
    a = events.ModelSpec(model_name="openai/answerer")
    p = events.ModelSpec(model_name="openai/judge")
    ts = "2026-01-01T00:00:00+00:00"
    rid = compute_result_id("q1", a.canonical_key, p.canonical_key, ts, None)
    return events.Job(run_id="r1", result_id=rid, answer_id="a1", question_id="q1", question_text="What?",
                      answering=a, parsing=p, timestamp=ts, evaluation_mode=mode, **kw)


def test_result_id_matches_metadata_computation() -> None:
    job = make_job()
    r = fold_result(job, events.State(template={"verify_result": True}), None, 1.0)
    again = VerificationResultMetadata.compute_result_id(
        r.metadata.question_id, r.metadata.answering, r.metadata.parsing, r.metadata.timestamp, r.metadata.replicate)
    assert r.metadata.result_id == job.result_id == again
    assert len(again) == 16


def test_template_only_fold_sums_usage_and_keeps_sections() -> None:
    job = make_job()
    st = events.State(
        template={"raw_llm_response": "4", "verify_result": True, "template_verification_performed": True},
        usage={"answer_generation": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
               "parsing": {"input_tokens": 20, "output_tokens": 4, "total_tokens": 24}},
        started_at=100.0,
    )
    r = fold_result(job, st, None, 101.5)
    assert r.template is not None and r.template.verify_result is True
    assert r.rubric is None
    assert r.template.usage_metadata["total"] == {"input_tokens": 30, "output_tokens": 9, "total_tokens": 39}
    assert r.metadata.execution_time == 1.5
    assert r.metadata.completed_without_errors and r.metadata.error is None
    assert r.metadata.evaluation_mode == "template_only"


def test_error_makes_partial_result() -> None:
    job = make_job()
    st = events.State(template={"raw_llm_response": "x"},
                      error=events.StageError(stage="parse_template", type="LLMError", message="timeout after 3 attempts"))
    r = fold_result(job, st, None, 2.0)
    assert r.metadata.completed_without_errors is False
    assert r.metadata.error == "parse_template: LLMError: timeout after 3 attempts"
    assert r.metadata.failure["category"] == "timeout"
    assert r.template.raw_llm_response == "x"


def test_rubric_only_has_no_template_and_dj_rubric_autofail_overrides() -> None:
    job = make_job("rubric_only")
    rs = events.State(rubric={"rubric_evaluation_performed": True, "regex_trait_scores": {"cites": True}})
    r = fold_result(job, None, rs, 1.0)
    assert r.template is None and r.rubric.regex_trait_scores == {"cites": True}
    job2 = make_job("template_and_rubric")
    ts = events.State(template={"verify_result": True})
    rs2 = events.State(rubric={"rubric_evaluation_performed": True}, signals={"dj_rubric_autofail": True})
    assert fold_result(job2, ts, rs2, 1.0).template.verify_result is False


def test_join_waits_for_the_other_branch() -> None:
    job = make_job("template_and_rubric")
    t_ev = events.StageEvent(job=job, state=events.State(template={"verify_result": True}))
    r_ev = events.StageEvent(job=job, state=events.State(rubric={"rubric_evaluation_performed": True}))
    store: dict[str, events.StageEvent] = {}

    async def lookup(subject: str) -> events.StageEvent | None:
        return store.get(subject)

    assert asyncio.run(try_finalize(events.TEMPLATE_VERIFIED, t_ev, lookup)) is None
    store[events.subject(events.TEMPLATE_VERIFIED, job.run_id, job.result_id)] = t_ev
    result = asyncio.run(try_finalize(events.RUBRIC_EVALUATED, r_ev, lookup))
    assert result is not None and result.template.verify_result is True and result.rubric is not None


def test_template_only_finalizes_without_lookup() -> None:
    job = make_job()
    ev = events.StageEvent(job=job, state=events.State(template={"verify_result": False}))

    async def lookup(subject: str) -> events.StageEvent | None:
        raise AssertionError("template_only must not wait for a rubric branch")

    result = asyncio.run(try_finalize(events.TEMPLATE_VERIFIED, ev, lookup))
    assert result is not None and result.template.verify_result is False


def test_envelope_round_trip_and_schema_version() -> None:
    job = make_job()
    env = events.make_envelope(events.ANSWER_GENERATED, job.run_id, job.result_id,
                               events.StageEvent(job=job, state=events.State()), "test/1")
    back = events.decode(events.encode(env))
    assert back.event_id == f"{job.result_id}:answer.generated"
    assert back.subject == f"vb.answer.generated.r1.{job.result_id}"
    assert events.payload_as(back, events.StageEvent).job.question_id == "q1"
    env.schema_version = 99
    import pytest

    with pytest.raises(events.SchemaVersionError, match="schema_version 99"):
        events.decode(events.encode(env))
