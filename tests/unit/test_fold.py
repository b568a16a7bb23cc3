"""The fold and the finalizer's join, without a bus."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from services.finalization.stage import try_finalize
from shared.core import events
from shared.core.fold import fold_result
from shared.core.ids import compute_result_id
from shared.core.models import VerificationResultMetadata
from shared.core.signals import Signals


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
    rs2 = events.State(rubric={"rubric_evaluation_performed": True}, signals=Signals(dj_rubric_autofail=True))
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


class _LaggingStream:
    """A replicated stream seen through nats-py's `get_last_msg`: a direct get is answered from a
    replica's copy (`replica`), a plain get by the leader (`leader`); subject -> message."""

    def __init__(self, leader: dict[str, events.Envelope], replica: dict[str, events.Envelope]) -> None:
        self.leader, self.replica = leader, replica
        self.asked: list[str] = []

    async def get_last_msg(self, stream: str, subject: str, direct: bool = False) -> Any:
        from nats.js.errors import NotFoundError

        self.asked.append("replica" if direct else "leader")
        env = (self.replica if direct else self.leader).get(subject)
        if env is None:
            raise NotFoundError
        return SimpleNamespace(data=events.encode(env))


def test_the_join_asks_the_leader_when_the_replica_missed_the_other_branch() -> None:
    """Both branch events published together; the handler's direct get is served by a replica
    that has not applied the template branch yet. A miss there is not an answer: the leader is
    asked, it holds the branch, and the job finalizes (trusting the replica, neither handler
    would have, and the job would never end)."""
    from shared.runtime import bus

    job = make_job("template_and_rubric")
    t_ev = events.StageEvent(job=job, state=events.State(template={"verify_result": True}))
    r_ev = events.StageEvent(job=job, state=events.State(rubric={"rubric_evaluation_performed": True}))
    t_subject = events.subject(events.TEMPLATE_VERIFIED, job.run_id, job.result_id)
    t_env = events.make_envelope(events.TEMPLATE_VERIFIED, job.run_id, job.result_id, t_ev, "test")
    js = _LaggingStream(leader={t_subject: t_env}, replica={})

    async def lookup(subject: str) -> events.StageEvent | None:
        env = await bus.last_event(js, subject)  # type: ignore[arg-type]
        return events.payload_as(env, events.StageEvent) if env else None

    result = asyncio.run(try_finalize(events.RUBRIC_EVALUATED, r_ev, lookup))
    assert result is not None and result.template.verify_result is True
    assert js.asked == ["replica", "leader"]
    # nothing anywhere: still None (the other branch has not ended), after asking both
    js2 = _LaggingStream(leader={}, replica={})
    assert asyncio.run(bus.last_event(js2, t_subject)) is None and js2.asked == ["replica", "leader"]
    # a replica hit is the answer: the leader is not asked
    js3 = _LaggingStream(leader={}, replica={t_subject: t_env})
    assert asyncio.run(bus.last_event(js3, t_subject)) is not None and js3.asked == ["replica"]


def test_a_replica_holding_only_the_earlier_attempt_is_not_the_answer() -> None:
    """A resumed job's join must read its own attempt's branch event. A replica's copy that holds
    only the broken first attempt's event is checked against the leader, whose newest is the
    resumed attempt's; with the leader also on the old attempt, there is no branch yet."""
    from shared.runtime import harness, runcontrol

    job = make_job("template_and_rubric")
    t_ev = events.StageEvent(job=job, state=events.State(template={"verify_result": True}))
    subject = events.subject(events.TEMPLATE_VERIFIED, job.run_id, job.result_id)
    old = events.make_envelope(events.TEMPLATE_VERIFIED, job.run_id, job.result_id, t_ev, "test")
    new = events.make_envelope(events.TEMPLATE_VERIFIED, job.run_id, job.result_id, t_ev, "test")
    runcontrol.carry_attempt_key("k2", [new])
    service = harness.StageService("finalization")
    token = harness.ATTEMPT_KEY.set("k2")
    try:
        service._js = _LaggingStream(leader={subject: new}, replica={subject: old})  # type: ignore[assignment]
        got = asyncio.run(service.last_event(subject))
        assert got is not None and got.attempt_key == "k2"
        service._js = _LaggingStream(leader={subject: old}, replica={subject: old})  # type: ignore[assignment]
        assert asyncio.run(service.last_event(subject)) is None
    finally:
        harness.ATTEMPT_KEY.reset(token)
