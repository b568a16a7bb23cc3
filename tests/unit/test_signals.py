"""Typed stage signals keep the wire format: events published when `State.signals` was an
untyped dict decode into `Signals`, and what is published now reads back as the same JSON
object (the keys an older consumer looks up)."""

from __future__ import annotations

import json

import msgspec
import pytest

from shared.core import events
from shared.core.signals import Signals
from shared.core.stage import evaluation_text

JOB = events.Job(run_id="run1", result_id="r1", answer_id="a1", question_id="q1", question_text="2+2?",
                 answering=events.ModelSpec(model_name="m"), parsing=events.ModelSpec(model_name="j"),
                 timestamp="2026-01-01T00:00:00+00:00")

OLD_SIGNALS = {"parsed": {"value": 4}, "abstention": True, "field_verification_result": False,
               "agent_trace": True, "final_ai_message": "It is 4.", "rubric_error": "judge away"}


def _old_wire(signals: dict) -> bytes:
    """An envelope as the untyped-dict code published it: `signals` a plain JSON object."""
    env = events.make_envelope(events.TEMPLATE_PARSED, "run1", "r1", events.StageEvent(JOB, events.State()), "old/1")
    payload = json.loads(bytes(env.payload))
    payload["state"]["signals"] = signals
    env.payload = msgspec.Raw(json.dumps(payload).encode())
    return events.encode(env)


def test_old_events_decode_into_typed_signals() -> None:
    ev = events.payload_as(events.decode(_old_wire(OLD_SIGNALS)), events.StageEvent)
    sig = ev.state.signals
    assert isinstance(sig, Signals)
    assert (sig.parsed, sig.abstention, sig.field_verification_result) == ({"value": 4}, True, False)
    assert sig.rubric_error == "judge away" and sig.insufficient is False and sig.recursion_limit is False
    assert evaluation_text(ev.state, use_full_trace=False) == "It is 4."


def test_an_unknown_signal_from_another_version_is_ignored() -> None:
    ev = events.payload_as(events.decode(_old_wire({"abstention": True, "some_future_flag": 1})), events.StageEvent)
    assert ev.state.signals == Signals(abstention=True)


def test_new_events_carry_the_old_keys_and_leave_defaults_out() -> None:
    state = events.State(signals=Signals(parsed={"value": 4}, abstention=True, field_verification_result=False))
    env = events.make_envelope(events.TEMPLATE_PARSED, "run1", "r1", events.StageEvent(JOB, state), "new/1")
    as_json = json.loads(bytes(events.decode(events.encode(env)).payload))
    assert as_json["state"]["signals"] == {"parsed": {"value": 4}, "abstention": True,
                                           "field_verification_result": False}


@pytest.mark.parametrize("wrong", [{"abstention": "yes"}, {"parsed": [1, 2]}, {"final_ai_message": 5}])
def test_a_mistyped_signal_is_refused_naming_the_field(wrong: dict) -> None:
    env = events.decode(_old_wire(wrong))
    with pytest.raises(msgspec.ValidationError, match=next(iter(wrong))):
        events.payload_as(env, events.StageEvent)

