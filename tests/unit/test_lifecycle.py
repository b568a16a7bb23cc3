"""Run lifecycle logic without a bus: attempt keys of re-runs, token accounting, the run-control
gate (cancel, budget) and the harness around it with an in-memory JetStream fake, and the
regrade planner."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from shared.control import lifecycle
from shared.control.deployment import Deployment
from shared.control.runner import RunInputError
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import Settings
from shared.core.ids import compute_result_id
from shared.core.stage import stage_error
from shared.core.usage import UsageTally
from shared.runtime import costcontrol, runcontrol
from shared.runtime.harness import StageService
from tests.conftest import EXAMPLE, REFERENCE

# ------------------------------------------------------------------------------ fakes


@dataclass
class _Msg:
    data: bytes


@dataclass
class _Entry:
    value: bytes
    revision: int


class FakeKV:
    def __init__(self, conflicts: int = 0) -> None:
        self.data: dict[str, _Entry] = {}
        self.rev = 0
        self.conflicts = conflicts  # updates refused as if another process got there first

    async def get(self, key: str) -> _Entry:
        if key not in self.data:
            raise KeyNotFoundError
        return self.data[key]

    async def create(self, key: str, value: bytes) -> int:
        if key in self.data:
            raise KeyWrongLastSequenceError
        self.rev += 1
        self.data[key] = _Entry(value, self.rev)
        return self.rev

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        if self.conflicts > 0:
            self.conflicts -= 1
            self.rev += 1
            self.data[key] = _Entry(str(int(self.data[key].value) + 1).encode(), self.rev)  # a rival's +1
            raise KeyWrongLastSequenceError
        if self.data[key].revision != last:
            raise KeyWrongLastSequenceError
        self.rev += 1
        self.data[key] = _Entry(value, self.rev)
        return self.rev


@dataclass
class _Ack:
    duplicate: bool = False


@dataclass
class FakeJS:
    """The few JetStream calls the harness and RunControl make, in memory."""

    last: dict[str, bytes] = field(default_factory=dict)
    published: list[events.Envelope] = field(default_factory=list)
    kv: FakeKV = field(default_factory=FakeKV)
    gets: int = 0
    fail: bool = False

    async def get_last_msg(self, stream: str, subject: str, direct: bool = False) -> _Msg:
        self.gets += 1
        if self.fail:
            raise ConnectionError("server away")
        if subject not in self.last:
            raise NotFoundError
        return _Msg(self.last[subject])

    async def publish(self, subject: str, data: bytes, stream: str | None = None,
                      headers: dict[str, str] | None = None) -> _Ack:
        env = events.decode(data, subject)  # published envelopes name their ids by subject
        assert headers == {"Nats-Msg-Id": env.event_id}
        self.published.append(env)
        self.last[subject] = data
        return _Ack()

    async def key_value(self, bucket: str) -> FakeKV:
        return self.kv

    def put_event(self, env: events.Envelope) -> None:
        self.last[env.subject] = events.encode(env)


def _job(result_id: str = "r1", run_id: str = "run1", **kw: Any) -> events.Job:
    return events.Job(run_id=run_id, result_id=result_id, answer_id="a1", question_id="q1", question_text="2+2?",
                      answering=events.ModelSpec(model_name="openai/a"), parsing=events.ModelSpec(model_name="openai/j"),
                      timestamp="2026-01-01T00:00:00+00:00", **kw)


def _usage(*pairs: tuple[str, int]) -> dict[str, dict[str, Any]]:
    return {k: {"input_tokens": n - 1, "output_tokens": 1, "total_tokens": n, "model": "m"} for k, n in pairs}


def _run_requested(run_id: str = "run1", budget: int | None = None) -> events.Envelope:
    cfg = {"budget_tokens": budget} if budget is not None else {}
    return events.make_envelope(events.RUN_REQUESTED, run_id, events.RUN_KEY,
                                events.RunRequested(run_id=run_id, timestamp="t", job_count=1, answer_count=1,
                                                    config=cfg), "test")


def _control(run_id: str = "run1", **kw: Any) -> events.Envelope:
    return events.make_envelope(events.RUN_CANCELLED, run_id, events.RUN_KEY, events.RunControlChange(**kw),
                                "test")


# ------------------------------------------------------------------------------ attempt keys


def test_attempt_key_of_first_runs_and_resumed_runs() -> None:
    first = events.make_envelope(events.ANSWER_GENERATED, "run1", "r1", events.StageEvent(_job(), events.State()), "t")
    assert runcontrol.attempt_key(first) == "" and first.attempt_key == ""
    resumed = events.make_envelope(events.ANSWER_GENERATED, "run1", "r1", events.StageEvent(_job(), events.State()),
                                   "t", attempt_key="resume-ab12")
    assert runcontrol.attempt_key(resumed) == "resume-ab12"
    assert resumed.event_id == "r1:answer.generated:resume-ab12", "the id is derived from the field"
    run_level = events.make_envelope(events.RUN_REQUESTED, "run1", events.RUN_KEY, _run_requested().payload, "t")
    assert runcontrol.attempt_key(run_level) == ""


def test_events_published_before_the_field_keep_their_attempt() -> None:
    """An event stored before `attempt_key` was an envelope field carries the key only in its id."""
    first = events.make_envelope(events.ANSWER_GENERATED, "run1", "r1", events.StageEvent(_job(), events.State()), "t")
    wire = msgspec.json.decode(events.encode(first))
    assert "attempt_key" not in wire, "a first run's envelope is written as before"
    wire["event_id"] += ":resume-ab12"
    old = events.decode(msgspec.json.encode(wire))
    assert old.attempt_key == "" and runcontrol.attempt_key(old) == "resume-ab12"
    foreign = msgspec.structs.replace(first, event_id="republished-" + first.event_id)
    assert runcontrol.attempt_key(foreign) == ""


def test_carry_attempt_key_marks_each_output_once() -> None:
    outs = [events.make_envelope(events.TEMPLATE_PARSED, "run1", "r1", {}, "t"),
            events.make_envelope(events.TEMPLATE_PARSED, "run1", "r2", {}, "t")]
    runcontrol.carry_attempt_key("resume-1", outs)
    runcontrol.carry_attempt_key("resume-1", outs)
    assert [o.event_id for o in outs] == ["r1:template.parsed:resume-1", "r2:template.parsed:resume-1"]
    assert [o.attempt_key for o in outs] == ["resume-1", "resume-1"]
    assert runcontrol.carry_attempt_key("", outs)[0].event_id == "r1:template.parsed:resume-1"


# ------------------------------------------------------------------------------ token accounting


def test_tokens_spent_is_the_growth_of_the_state_usage() -> None:
    ev_in = events.StageEvent(_job(), events.State(usage=_usage(("answer_generation", 30))))
    before = runcontrol.tokens_before(ev_in)
    out_state = events.State(usage=_usage(("answer_generation", 30), ("parsing", 120)))
    out = events.make_envelope(events.TEMPLATE_PARSED, "run1", "r1", events.StageEvent(_job(), out_state), "t")
    assert before == 30 and runcontrol.tokens_spent(before, [out]) == 120


def test_fan_out_answer_counts_once_and_other_events_not_at_all() -> None:
    state = events.State(usage=_usage(("answer_generation", 40)))
    outs = [events.make_envelope(events.ANSWER_GENERATED, "run1", rid, events.StageEvent(_job(rid), state), "t")
            for rid in ("r1", "r2", "r3")]
    failed = events.make_envelope(events.STAGE_FAILED, "run1", "r1",
                                  events.StageFailed(error=stage_error("x", ValueError("boom"))), "t")
    req = events.AnswerRequested(jobs=[_job("r1"), _job("r2"), _job("r3")])
    assert runcontrol.tokens_spent(runcontrol.tokens_before(req), [*outs, failed]) == 40


def test_usage_tokens_ignores_the_total_entry_and_falls_back_to_in_plus_out() -> None:
    usage = {"parsing": {"input_tokens": 5, "output_tokens": 2}, "total": {"total_tokens": 999}}
    assert runcontrol.usage_tokens(usage) == 7
    assert runcontrol.usage_tokens(None) == 0


def test_budget_helpers_validate() -> None:
    run = events.RunRequested(run_id="r", timestamp="t", job_count=1, answer_count=1, config={"x": 1})
    runcontrol.set_budget(run, 5000)
    assert run.config == {"x": 1, "budget_tokens": 5000}
    runcontrol.set_budget(run, None)
    assert run.config["budget_tokens"] == 5000
    with pytest.raises(ValueError, match="positive"):
        runcontrol.set_budget(run, 0)
    data = {"budget_tokens": 100, "replicate_count": 2}
    assert runcontrol.pop_budget(data) == 100 and data == {"replicate_count": 2}
    for bad in (-1, "lots", True, 1.5):
        with pytest.raises(ValueError, match="budget_tokens"):
            runcontrol.pop_budget({"budget_tokens": bad})


# ------------------------------------------------------------------------------ the run-control gate


async def test_gate_stops_a_cancelled_run_and_a_resume_lifts_it() -> None:
    js = FakeJS()
    js.put_event(_run_requested())
    ctl = runcontrol.RunControl(lambda: js, ttl_s=60.0)
    assert await ctl.stop_reason("run1") is None
    js.put_event(_control(cancelled=True, reason="operator"))
    assert await ctl.stop_reason("run1") is None, "cached within the ttl"
    stop = await ctl.stop_reason("run1", published_at=time.time() + 1)  # a request newer than the cache
    assert stop is None, "a not-cancelled view read before a newer request is not re-read"
    ctl2 = runcontrol.RunControl(lambda: js, ttl_s=60.0)
    stop = await ctl2.stop_reason("run1")
    assert isinstance(stop, runcontrol.RunCancelled) and "cancelled" in str(stop) and "operator" in str(stop)
    js.put_event(_control(cancelled=False, reason="resumed"))
    gets = js.gets
    assert await ctl2.stop_reason("run1", published_at=time.time() - 3600) is not None, "old request: cache holds"
    assert js.gets == gets
    assert await ctl2.stop_reason("run1", published_at=time.time() + 1) is None, "newer request: read again"


@dataclass
class HeldJS(FakeJS):
    """FakeJS whose reads, while `hold` is set, take their answer as they are asked and return it
    only once `hold` is released: a reply in flight while something else is published."""

    hold: asyncio.Event | None = None
    asked: asyncio.Event = field(default_factory=asyncio.Event)

    async def get_last_msg(self, stream: str, subject: str, direct: bool = False) -> _Msg:
        hold = self.hold
        try:
            answer: _Msg | NotFoundError = await super().get_last_msg(stream, subject, direct)
        except NotFoundError as exc:
            answer = exc
        if hold is not None:
            self.asked.set()
            await hold.wait()
        if isinstance(answer, NotFoundError):
            raise answer
        return answer


async def test_a_read_in_flight_when_a_resume_raises_the_budget_does_not_count_as_newer() -> None:
    """`resume` publishes the raised budget, then its requests. A read of the run's state asked
    before the raise and answered after the requests were published has not seen the raise: a
    request must not be stopped by the old budget it carries."""
    js = HeldJS(kv=FakeKV())
    js.put_event(_run_requested(budget=100))
    js.put_event(_control(cancelled=False, reason="resumed"))  # an earlier resume that raised nothing
    states = runcontrol.RunStates(lambda: js, ttl_s=60.0)
    ctl = runcontrol.RunControl(lambda: js, states=states, usage_ttl_s=0.0)
    ctl.record_usage("run1", 150)
    await ctl.flush()
    assert isinstance(await ctl.stop_reason("run1"), runcontrol.BudgetExhausted)
    states.ttl_s = 0.0  # the next gate reads the run's state again...
    js.hold = release = asyncio.Event()
    in_flight = asyncio.create_task(states.get("run1"))
    await js.asked.wait()  # ...and the server has answered it, before the raise
    js.hold = None  # reads asked from now on answer at once
    js.put_event(_control(cancelled=False, reason="resumed", budget_tokens=1000))  # the resume's raise
    await asyncio.sleep(0.002)
    published_at = time.time()  # then its requests
    await asyncio.sleep(0.002)
    release.set()  # the answer arrives after the requests were published
    assert (await in_flight).control.budget_tokens is None
    states.ttl_s = 60.0
    gets = js.gets
    assert await ctl.stop_reason("run1", published_at=published_at) is None, "stopped by the budget before the raise"
    assert js.gets > gets, "read again"
    assert await ctl.budget("run1") == 1000


class HeldKV(FakeKV):
    """FakeKV whose reads wait for `hold`, when it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hold: asyncio.Event | None = None
        self.asked = asyncio.Event()

    async def get(self, key: str) -> _Entry:
        if self.hold is not None:
            self.asked.set()
            await self.hold.wait()
        return await super().get(key)


async def test_a_gate_decides_on_one_read_while_another_gate_reads_the_run_again() -> None:
    """Two requests of a resumed run at once: one gate holds the run's state read before the
    resume's raise, and waits on its usage read; meanwhile the other gate reads the run again and
    sees the raise. The first must not be stopped by the old budget, as it would if it took the
    budget of the first read and the read time of the second."""
    kv = HeldKV()
    js = FakeJS(kv=kv)
    js.put_event(_run_requested(budget=100))
    ctl = runcontrol.RunControl(lambda: js, ttl_s=60.0, usage_ttl_s=0.0)
    ctl.record_usage("run1", 150)
    await ctl.flush()
    assert isinstance(await ctl.stop_reason("run1"), runcontrol.BudgetExhausted)
    js.put_event(_control(cancelled=False, reason="resumed", budget_tokens=1000))  # the resume's raise
    await asyncio.sleep(0.002)
    published_at = time.time()  # then its requests
    kv.hold = release = asyncio.Event()
    first = asyncio.create_task(ctl.stop_reason("run1", published_at=published_at))
    await kv.asked.wait()  # the first gate waits on the counter, holding the old read
    kv.hold = None
    assert await ctl.stop_reason("run1", published_at=published_at) is None  # the second reads again
    release.set()
    assert await first is None, "stopped by the budget before the raise"


async def test_a_stop_is_lifted_by_a_failed_read_of_a_newer_request_only() -> None:
    """A stop (cancel, spent budget) read before a request was published is read again for it;
    when that read fails the gate fails open, as every failed read does; a request older than
    the stop's read is still stopped while the server is away."""
    for control, stop_type in ((_control(cancelled=True, reason="operator"), runcontrol.RunCancelled),
                               (None, runcontrol.BudgetExhausted)):
        js = FakeJS(kv=FakeKV())
        js.put_event(_run_requested(budget=100))
        if control is not None:
            js.put_event(control)
        ctl = runcontrol.RunControl(lambda js=js: js, ttl_s=60.0, usage_ttl_s=60.0)
        ctl.record_usage("run1", 150)
        await ctl.flush()
        read_at = time.time()
        assert isinstance(await ctl.stop_reason("run1"), stop_type)
        js.fail = True
        assert isinstance(await ctl.stop_reason("run1", published_at=read_at - 1), stop_type), "older request"
        gets = js.gets
        await asyncio.sleep(0.002)  # a request published after the stop's read, on any clock's grain
        assert await ctl.stop_reason("run1", published_at=time.time()) is None, f"{stop_type.__name__}: fails open"
        assert js.gets > gets, "the newer request's read was tried"


@dataclass
class SlowJS(FakeJS):
    """FakeJS whose reads take a while, counting how many are in flight at once."""

    flying: int = 0
    peak: int = 0

    async def get_last_msg(self, stream: str, subject: str, direct: bool = False) -> _Msg:
        self.flying += 1
        self.peak = max(self.peak, self.flying)
        try:
            await asyncio.sleep(0.01)
            return await super().get_last_msg(stream, subject, direct)
        finally:
            self.flying -= 1


async def test_a_run_s_first_gate_reads_its_state_once_for_both_budgets() -> None:
    """The harness's token and money gates share one read of the run's state: a run's first
    message reads its config and its control subject side by side, once for both gates (three
    gets here: a control subject with no event yet is asked of the leader too), not twice in a
    row for each, and a cancel seen by one gate is the other's too."""
    js = SlowJS()
    js.put_event(_run_requested("run-shared", budget=100))
    service = _service(js)
    assert service.control.states is service.cost_control.states
    env = events.make_envelope(events.ANSWER_REQUESTED, "run-shared", "a1", events.AnswerRequested(jobs=[]), "cli")
    assert await service._stop_reason(env) is None
    assert js.gets == 3 and js.peak == 2
    assert await service.control.budget("run-shared") == 100 and await service.cost_control.budget("run-shared") is None
    assert js.gets == 3, "cached within the ttl, for both gates"
    # two reads for a run whose config is read for the first time alongside a cancel
    js.put_event(_run_requested("run-stopped"))
    js.put_event(_control("run-stopped", cancelled=True, reason="operator"))
    stopped = events.make_envelope(events.ANSWER_REQUESTED, "run-stopped", "a1", events.AnswerRequested(jobs=[]), "cli")
    stop = await service._stop_reason(stopped)
    assert isinstance(stop, runcontrol.RunCancelled) and "operator" in str(stop)
    assert js.gets == 5


async def test_gate_fails_open_when_the_server_is_away() -> None:
    js = FakeJS(fail=True)
    ctl = runcontrol.RunControl(lambda: js, ttl_s=0.0)
    assert await ctl.stop_reason("run1") is None
    assert await ctl.budget("run1") is None


async def test_budget_counter_is_shared_and_stops_dispatch() -> None:
    js = FakeJS(kv=FakeKV(conflicts=2))
    js.put_event(_run_requested(budget=100))
    a = runcontrol.RunControl(lambda: js, usage_ttl_s=0.0)
    b = runcontrol.RunControl(lambda: js, usage_ttl_s=0.0)
    assert await a.budget("run1") == 100
    a.record_usage("run1", 40)
    await a.flush()
    b.record_usage("run1", 30)
    await b.flush()  # two rival +1s force compare-and-set retries
    assert await a._read_counter("run1") == 72
    assert await a.stop_reason("run1") is None
    b.record_usage("run1", 28)  # not flushed yet: b sees it, a does not
    stop = await b.stop_reason("run1")
    assert isinstance(stop, runcontrol.BudgetExhausted) and "100-token budget" in str(stop)
    assert await a.stop_reason("run1") is None
    await b.close()
    assert isinstance(await a.stop_reason("run1"), runcontrol.BudgetExhausted)


async def test_a_control_event_can_raise_the_budget() -> None:
    js = FakeJS()
    js.put_event(_run_requested(budget=10))
    ctl = runcontrol.RunControl(lambda: js, ttl_s=0.0, usage_ttl_s=0.0)
    ctl.record_usage("run1", 50)
    assert isinstance(await ctl.stop_reason("run1"), runcontrol.BudgetExhausted)
    js.put_event(_control(cancelled=False, budget_tokens=1000))
    assert await ctl.stop_reason("run1") is None
    await ctl.close()


async def test_a_resume_raises_a_spent_money_budget() -> None:
    """`resume --max-cost-usd`: the control change's budget replaces the run's spent one; the
    money gate says nothing of a cancel (the token gate says that, once)."""
    js = FakeJS()
    js.put_event(events.make_envelope(events.RUN_REQUESTED, "run1", events.RUN_KEY, events.RunRequested(
        run_id="run1", timestamp="t", job_count=1, answer_count=1, config={"budget_cost_usd": 0.01}), "test"))
    ctl = costcontrol.CostControl(lambda: js, ttl_s=0.0, usage_ttl_s=0.0)
    assert await ctl.budget("run1") == 10_000  # micro-dollars
    ctl.record_usage("run1", 12_000)
    stop = await ctl.stop_reason("run1")
    assert isinstance(stop, runcontrol.BudgetExhausted) and "$0.012000 of its $0.010000 budget" in str(stop)
    js.put_event(_control(cancelled=False, reason="resumed", budget_cost_usd=0.05))
    assert await ctl.budget("run1") == 50_000 and await ctl.stop_reason("run1") is None
    js.put_event(_control(cancelled=False, reason="resumed", budget_tokens=5))  # a token change keeps the money budget
    assert await ctl.budget("run1") == 10_000
    js.put_event(_control(cancelled=True, reason="stop"))
    assert isinstance(await ctl.stop_reason("run1"), runcontrol.BudgetExhausted)  # its own reason, not the cancel
    await ctl.close()


async def test_resume_refuses_a_bad_budget_before_it_reaches_the_bus() -> None:
    settings = Settings(nats_url="nats://127.0.0.1:1")  # nothing listens: a connect would fail differently
    for kw, said in [({"budget_cost_usd": 0.0}, "positive amount"), ({"budget_cost_usd": float("inf")}, "positive"),
                     ({"budget_tokens": 0}, "positive number of tokens")]:
        with pytest.raises(ValueError, match=said):
            await lifecycle.resume(settings, "run1", **kw)


# ------------------------------------------------------------------------------ the harness


@dataclass
class _Meta:
    num_delivered: int


@dataclass
class _Raw:
    subject: str
    metadata: _Meta


class FakeMessage:
    def __init__(self, subject: str, delivered: int = 1) -> None:
        self.raw_message = _Raw(subject, _Meta(delivered))
        self.acked = False
        self.nacked: float | None = None

    async def ack(self) -> None:
        self.acked = True

    async def nack(self, delay: float | None = None) -> None:
        self.nacked = delay


def _service(js: FakeJS, name: str = "generation") -> StageService:
    """A fresh harness bound to the in-memory JetStream; tests register handlers on it with
    `handles` and drive them with `deliver`, as the subscription does."""
    svc = StageService(name)
    svc.bind(js)  # type: ignore[arg-type]
    return svc


def _generation_give_up() -> Any:
    """The generation service's give-up, as its app registered it (not a copy)."""
    from services.generation import app as generation

    return generation.service.subscriptions[events.ANSWER_REQUESTED].give_up


async def test_harness_gates_answer_requests_of_a_cancelled_run() -> None:
    """Through the generation service as registered: a cancelled run's answer request is not
    handled (no model is asked: the model here has no endpoint); its jobs end with the stop."""
    from services.generation import app as generation

    js = FakeJS()
    js.put_event(_run_requested("run-gated"))
    js.put_event(_control("run-gated", cancelled=True, reason="stop"))
    service = generation.service
    service.bind(js)  # type: ignore[arg-type]
    req = events.AnswerRequested(jobs=[_job("r1", "run-gated"), _job("r2", "run-gated")])
    env = events.make_envelope(events.ANSWER_REQUESTED, "run-gated", "a1", req, "cli")
    msg = FakeMessage(env.subject)
    await service.deliver(events.ANSWER_REQUESTED, events.encode(env), msg)  # type: ignore[arg-type]
    assert msg.acked and msg.nacked is None
    assert [e.event_type for e in js.published] == [events.ANSWER_GENERATED] * 2
    assert [e.result_id for e in js.published] == ["r1", "r2"]
    for out in js.published:
        ev = events.payload_as(out, events.StageEvent)
        assert ev.status == "failed" and ev.state.error is not None and ev.state.error.type == "RunCancelled"
        assert "stop" in ev.state.error.message


async def test_harness_propagates_attempt_key_and_accounts_tokens() -> None:
    js = FakeJS()
    js.put_event(_run_requested(budget=10_000))
    svc = _service(js, "parsing")

    @svc.handles(events.GUARDS_CHECKED, events.StageEvent)
    async def handler(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
        ev.state.usage["parsing"] = {"input_tokens": 90, "output_tokens": 10, "total_tokens": 100}  # in place
        return [svc.emit(events.TEMPLATE_PARSED, ev.job, events.StageEvent(ev.job, ev.state))]

    ev = events.StageEvent(_job(), events.State(usage=_usage(("answer_generation", 25))))
    env = events.make_envelope(events.GUARDS_CHECKED, "run1", "r1", ev, "guards", attempt_key="resume-x1")
    msg = FakeMessage(env.subject)
    await svc.deliver(events.GUARDS_CHECKED, events.encode(env), msg)  # type: ignore[arg-type]
    assert msg.acked and js.published[0].event_id == "r1:template.parsed:resume-x1"
    assert js.published[0].attempt_key == "resume-x1"
    assert await svc.control.usage("run1") == 100, "the parsing call's 100 tokens, not the answer's 25 again"
    await svc.control.close()
    other_process = runcontrol.RunControl(lambda: js, usage_ttl_s=0.0)
    assert await other_process.usage("run1") == 100, "flushed to the shared counter on close"


async def test_harness_skip_acks_without_reading_contents_or_handling() -> None:
    """A job the stage has no branch for (the rubric service and a template-only job) is acked
    before its contents are read: its lean job points at content the store does not have, which
    hydrating would fail on, and the handler is never called. Other jobs are handled."""
    js = FakeJS()
    svc = _service(js, "rubric")
    handled: list[str] = []

    @svc.handles(events.GUARDS_CHECKED, events.StageEvent,
                 skip=lambda ev: ev.job.evaluation_mode == "template_only")
    async def handler(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
        handled.append(ev.job.result_id)
        return []

    lean = msgspec.structs.replace(_job("r1", evaluation_mode="template_only"), refs={"q": "c_missing"})
    env = events.make_envelope(events.GUARDS_CHECKED, "run1", "r1", events.StageEvent(lean, events.State()), "guards")
    msg = FakeMessage(env.subject)
    await svc.deliver(events.GUARDS_CHECKED, events.encode(env), msg)  # type: ignore[arg-type]
    assert msg.acked and msg.nacked is None and handled == [] and js.published == []

    both = _job("r2", evaluation_mode="template_and_rubric")
    env = events.make_envelope(events.GUARDS_CHECKED, "run1", "r2", events.StageEvent(both, events.State()), "guards")
    msg = FakeMessage(env.subject)
    await svc.deliver(events.GUARDS_CHECKED, events.encode(env), msg)  # type: ignore[arg-type]
    assert msg.acked and handled == ["r2"]


async def test_harness_retries_then_records_the_give_up() -> None:
    js = FakeJS()
    svc = _service(js)
    last_delivery = svc.settings.consumer_max_deliver

    @svc.handles(events.ANSWER_REQUESTED, events.AnswerRequested, give_up=_generation_give_up())
    async def broken(env: events.Envelope, req: events.AnswerRequested) -> list[events.Envelope]:
        raise KeyError("bug")

    env = events.make_envelope(events.ANSWER_REQUESTED, "run1", "a1", events.AnswerRequested(jobs=[_job()]), "cli")
    first = FakeMessage(env.subject, delivered=1)
    await svc.deliver(events.ANSWER_REQUESTED, events.encode(env), first)  # type: ignore[arg-type]
    assert first.nacked == 0.5 and not first.acked and js.published == []
    last = FakeMessage(env.subject, delivered=last_delivery)
    await svc.deliver(events.ANSWER_REQUESTED, events.encode(env), last)  # type: ignore[arg-type]
    assert last.acked
    assert [e.event_type for e in js.published] == [events.STAGE_FAILED, events.ANSWER_GENERATED]
    assert events.payload_as(js.published[0], events.StageFailed).error.type == "KeyError"
    gave_up = events.payload_as(js.published[1], events.StageEvent)
    assert gave_up.status == "failed" and gave_up.state.error is not None
    assert (gave_up.state.error.stage, gave_up.state.error.type) == ("generate_answer", "KeyError")


async def test_the_last_delivery_records_the_give_up_without_handling() -> None:
    """The server's last delivery of a job (every earlier one cut off by a stop or a crash) is not
    handled again, since the job may be what kills the process: `stage.failed` and the stage's
    fallback are published, then the message is acked. One delivery earlier it is still handled."""
    js = FakeJS()
    svc = _service(js)
    last = svc.settings.consumer_max_deliver + svc.settings.consumer_max_interrupted + 1
    handled: list[int] = []

    @svc.handles(events.ANSWER_REQUESTED, events.AnswerRequested, give_up=_generation_give_up())
    async def handler(env: events.Envelope, req: events.AnswerRequested) -> list[events.Envelope]:
        handled.append(env.attempt)
        return []

    env = events.make_envelope(events.ANSWER_REQUESTED, "run1", "a1", events.AnswerRequested(jobs=[_job()]), "cli")
    assert svc.subscriptions[events.ANSWER_REQUESTED].config.max_deliver == last + 1  # type: ignore[union-attr]
    before = FakeMessage(env.subject, delivered=last - 1)
    await svc.deliver(events.ANSWER_REQUESTED, events.encode(env), before)  # type: ignore[arg-type]
    assert before.acked and len(handled) == 1 and js.published == []
    final = FakeMessage(env.subject, delivered=last)
    await svc.deliver(events.ANSWER_REQUESTED, events.encode(env), final)  # type: ignore[arg-type]
    assert final.acked and final.nacked is None and len(handled) == 1
    assert [e.event_type for e in js.published] == [events.STAGE_FAILED, events.ANSWER_GENERATED]
    error = events.payload_as(js.published[0], events.StageFailed).error
    assert error.type == "DeliveriesExhausted" and f"delivered {last} times" in error.message
    gave_up = events.payload_as(js.published[1], events.StageEvent)
    assert gave_up.status == "failed" and gave_up.state.error is not None
    assert gave_up.state.error.type == "DeliveriesExhausted"


async def test_dead_letter_ids_are_the_same_in_every_process() -> None:
    js = FakeJS()
    subject = events.subject(events.ANSWER_REQUESTED, "run1", "zz")
    handled: list[str] = []
    for _ in range(2):  # two processes of the same service
        svc = _service(js)

        @svc.handles(events.ANSWER_REQUESTED, events.AnswerRequested)
        async def handler(env: events.Envelope, req: events.AnswerRequested) -> list[events.Envelope]:
            handled.append(env.event_id)
            return []

        msg = FakeMessage(subject, delivered=svc.settings.consumer_max_deliver)
        await svc.deliver(events.ANSWER_REQUESTED, b"\x00nope", msg)  # type: ignore[arg-type]
        assert msg.acked
    a, b = js.published
    assert handled == []
    assert a.event_type == events.DEAD_LETTER and a.event_id == b.event_id
    assert a.event_id.startswith("zz:dead.letter:generation:")


# ------------------------------------------------------------------------------ regrade planning


def _answers(bench: Benchmark, run_id: str = "old") -> list[events.StageEvent]:
    out = []
    for q in bench.finished_questions():
        job = events.Job(run_id=run_id, result_id=f"old-{q.id}", answer_id=f"ans-{q.id}", question_id=q.id,
                         question_text=q.text, answering=events.ModelSpec(model_name="openai/a"),
                         parsing=events.ModelSpec(model_name="openai/j"), timestamp="2026-01-01T00:00:00+00:00",
                         template_code=q.template_code, template_id="old-tid", evaluation_mode="template_only")
        state = events.State(template={"raw_llm_response": f"answer to {q.id}"},
                             usage=_usage(("answer_generation", 12)), started_at=1.0)
        out.append(events.StageEvent(job, state))
    return out


def test_regrade_jobs_take_new_templates_and_keep_answers() -> None:
    bench = Benchmark.load(EXAMPLE)
    parent = events.RunRequested(run_id="old", timestamp="t0", job_count=18, answer_count=18,
                                 evaluation_mode="template_only", config={"evaluation_mode": "template_only"},
                                 benchmark_name="veribus-example")
    answers = _answers(bench)
    smaller = bench.model_copy(update={"questions": bench.questions[:5]})
    plan = lifecycle.regrade_jobs(parent, answers, benchmark=smaller, mode="template_and_rubric", run_id="new",
                                  timestamp="2026-02-02T00:00:00+00:00")
    kept = {q.id for q in smaller.finished_questions()}
    assert {ev.job.question_id for ev in plan.generated} == kept
    assert sorted(plan.skipped_not_in_benchmark) == sorted(q.id for q in bench.finished_questions() if q.id not in kept)
    for ev in plan.generated:
        q = smaller.get_question(ev.job.question_id)
        assert ev.job.run_id == "new" and ev.job.template_code == q.template_code and ev.job.template_id != "old-tid"
        assert ev.job.result_id == compute_result_id(q.id, "litellm:openai/a:", "litellm:openai/j:",
                                                     "2026-02-02T00:00:00+00:00", None)
        assert ev.job.rubric and ev.job.evaluation_mode == "template_and_rubric"
        assert ev.state.template["raw_llm_response"] == f"answer to {q.id}" and ev.state.started_at > 1.0
    ev0 = plan.run_event
    assert ev0.parent_run_id == "old" and ev0.job_count == len(kept) and ev0.config["regraded_from"] == "old"


def test_a_regrade_does_not_count_the_regraded_runs_calls_and_cost_again() -> None:
    """The user's report: a regrade's summary said "Model calls: 36, $1.151" for 18 judge calls: its
    results carried the stored answers' answer_generation entries as they were, so every regrade
    counted (and charged) the parent's answering calls again. The stored answer keeps its tokens
    and becomes a reply served without a call, at $0 in the regrade."""
    bench = Benchmark.load(EXAMPLE)
    parent = events.RunRequested(run_id="old", timestamp="t0", job_count=18, answer_count=18,
                                 evaluation_mode="template_only")
    answers = _answers(bench)
    for ev in answers:
        ev.state.usage["answer_generation"].update(model_calls=2, cached_replies=0, cost_usd=0.0625)
    plan = lifecycle.regrade_jobs(parent, answers, run_id="new")
    entries = [ev.state.usage["answer_generation"] for ev in plan.generated]
    assert entries and all(e == {"input_tokens": 11, "output_tokens": 1, "total_tokens": 12, "model": "m",
                                 "model_calls": 0, "cached_replies": 1, "cost_usd": 0.0} for e in entries)
    # the parent's own answers are untouched: its calls and cost are counted there, once
    assert all(ev.state.usage["answer_generation"]["model_calls"] == 2 for ev in answers)
    tally = UsageTally()
    for e in entries:
        tally.add({"template": {"usage_metadata": {"answer_generation": e}}})
    assert (tally.as_dict()["model_calls"], tally.as_dict()["cached_replies"], tally.as_dict()["cost_usd"]) == (
        0, len(entries), 0.0)


def test_regrade_refuses_bad_templates_and_missing_rubrics() -> None:
    bench = Benchmark.load(EXAMPLE)
    parent = events.RunRequested(run_id="old", timestamp="t0", job_count=1, answer_count=1,
                                 evaluation_mode="template_only")
    answers = _answers(bench)
    broken = bench.model_copy(deep=True)
    broken.questions[0].template_code = "class Answer(:\n    pass\n"
    with pytest.raises(RunInputError, match=broken.questions[0].id):
        lifecycle.regrade_jobs(parent, answers, benchmark=broken)
    with pytest.raises(RunInputError, match="needs rubric traits"):
        lifecycle.regrade_jobs(parent, answers, mode="rubric_only")  # the stored jobs carry no rubric


def test_regrade_with_the_runs_own_benchmark_keeps_its_unfinished_questions() -> None:
    """A run made with --include-unfinished (the reference's minimal.jsonld has no `finished`
    property: every question is unfinished) regraded with the same benchmark: every stored answer
    is regraded. Only finished questions were looked up, so all of them were "not in the new
    benchmark" and the CLI said the run "has no stored answers to regrade"."""
    bench = Benchmark.load(REFERENCE / "checkpoints" / "minimal.jsonld")
    assert not bench.finished_questions()
    parent = events.RunRequested(run_id="old", timestamp="t0", job_count=1, answer_count=1,
                                 evaluation_mode="template_only")
    answers = _answers(bench.model_copy(update={"questions": [q.model_copy(update={"finished": True})
                                                             for q in bench.questions]}))
    plan = lifecycle.regrade_jobs(parent, answers, benchmark=bench, run_id="new")
    assert [ev.job.question_id for ev in plan.generated] == [q.id for q in bench.questions]
    assert plan.skipped_not_in_benchmark == []
    # only the templates of answered questions must compile: a broken draft nobody answered is no refusal
    bench = Benchmark.load(EXAMPLE)
    drafts = bench.model_copy(deep=True)
    for q in drafts.unfinished_questions():
        q.template_code = "class Answer(:\n    pass\n"
    plan = lifecycle.regrade_jobs(parent, _answers(bench), benchmark=drafts, run_id="new")
    assert len(plan.generated) == len(bench.finished_questions())


def test_stopped_results_are_recognised() -> None:
    def final(error: str | None) -> events.Envelope:
        result = {"metadata": {"error": error}}
        return events.make_envelope(events.RESULT_FINALIZED, "r", "x", events.ResultFinalized(result=result), "t")

    assert lifecycle._stopped(final("generate_answer: RunCancelled: cancelled: run r was cancelled"))
    assert lifecycle._stopped(final("generate_answer: BudgetExhausted: budget exhausted: ..."))
    assert not lifecycle._stopped(final("generate_answer: LLMError: timeout"))
    assert not lifecycle._stopped(final(None))


def test_event_loop_not_leaked() -> None:
    """RunControl's flusher is a task of the loop that recorded usage; closing drains it."""

    async def main() -> dict[str, int]:
        js = FakeJS()
        ctl = runcontrol.RunControl(lambda: js, flush_s=0.01)
        ctl.record_usage("run1", 5)
        await asyncio.sleep(0.05)
        await ctl.close()
        return {k: int(v.value) for k, v in js.kv.data.items()}

    assert asyncio.run(main()) == {"run1": 5}


def test_run_control_changes_are_typed_and_old_ones_decode() -> None:
    """`run.cancelled` carries cancel, resume and budget changes as one typed payload; a payload
    written before the type moved to the catalogue (plain JSON) decodes into it."""
    old = events.make_envelope(events.RUN_CANCELLED, "run1", events.RUN_KEY,
                               {"cancelled": False, "reason": "resumed", "budget_tokens": 500, "at": 1.5}, "cli/0.1.0")
    change = events.payload_as(events.decode(events.encode(old)), events.RunControlChange)
    assert (change.cancelled, change.budget_tokens, change.at, change.action) == (False, 500, 1.5, "resume")
    assert events.RunControlChange(reason="operator").action == "cancel"
    assert events.RunControlChange(cancelled=False, budget_tokens=9).action == "budget"
    with pytest.raises(msgspec.ValidationError, match="budget_tokens"):
        events.payload_as(events.make_envelope(events.RUN_CANCELLED, "run1", events.RUN_KEY,
                                               {"budget_tokens": "lots"}, "x"), events.RunControlChange)


@pytest.mark.parametrize("key", ["../../etc", "resume x", "r" * 65, "resume-other"])
def test_a_forged_attempt_key_is_refused_at_decode(key: str) -> None:
    """An attempt key is a plain token and the end of the event id: a forged one (a path, spaces,
    oversized, or one the id does not carry) never reaches a handler."""
    env = events.make_envelope(events.ANSWER_REQUESTED, "run1", "a1", events.AnswerRequested(jobs=[_job()]), "cli",
                               attempt_key="resume-ab12")
    wire = msgspec.json.decode(events.encode(env))
    wire["attempt_key"] = key
    with pytest.raises(ValueError, match="attempt_key"):
        events.decode(msgspec.json.encode(wire))
    assert events.decode(events.encode(env)).attempt_key == "resume-ab12"



class _IdleConsumerOnALaggingCopy:
    """The JetStream calls the lag checks make: one durable (`name`) whose counts say nothing is
    pending or unacknowledged, acknowledged up to `floor`, filtered on `filter_subject` (None:
    the whole stream); `leader_has`: filter -> the leader's last sequence on it (a plain message
    get, which only the leader answers)."""

    def __init__(self, name: str, floor: int, filter_subject: str | None, leader_has: dict[str, int]) -> None:
        from types import SimpleNamespace

        self.name, self.leader_has = name, leader_has
        self.info = SimpleNamespace(num_pending=0, num_ack_pending=0, ack_floor=SimpleNamespace(stream_seq=floor),
                                    config=SimpleNamespace(filter_subject=filter_subject, filter_subjects=None))
        self.asked: list[tuple[int, str, bool]] = []

    async def consumer_info(self, stream: str, durable: str) -> Any:
        if durable != self.name:
            raise NotFoundError
        return self.info

    async def get_msg(self, stream: str, seq: int, subject: str, next: bool) -> Any:  # noqa: A002
        from types import SimpleNamespace

        self.asked.append((seq, subject, next))
        if self.leader_has.get(subject, 0) >= seq:
            return SimpleNamespace(seq=self.leader_has[subject])
        raise NotFoundError


def test_a_consumer_is_caught_up_only_when_the_leader_has_nothing_past_its_ack_floor() -> None:
    """`projections rebuild` waits for the projector's consumer. Its counts are its own member's
    copy: nothing pending there, all acknowledged up to 110, while the leader holds message 150,
    is not caught up; with the leader holding nothing past 110, it is."""
    from shared.control import rebuild

    def Stream(leader_last: int) -> _IdleConsumerOnALaggingCopy:  # noqa: N802
        return _IdleConsumerOnALaggingCopy("projector", 110, None, {events.STREAM_SUBJECTS[0]: leader_last})

    behind = Stream(150)
    assert asyncio.run(rebuild._consumer_caught_up(behind, "projector")) is False  # type: ignore[arg-type]
    assert behind.asked == [(111, events.STREAM_SUBJECTS[0], True)]
    assert asyncio.run(rebuild._consumer_caught_up(Stream(110), "projector")) is True  # type: ignore[arg-type]


def test_a_durable_whose_copy_lags_still_counts_as_queued() -> None:
    """`resume` refuses to publish while the services have messages queued. A stage consumer on a
    member whose copy lags says 0 pending and 0 unacknowledged; the leader holds a message on its
    filter past the last one it delivered, so it counts as queued (1, at least). With nothing
    there, it is idle."""
    from shared.control import streams

    def Stream(leader_has: dict[str, int]) -> _IdleConsumerOnALaggingCopy:  # noqa: N802
        return _IdleConsumerOnALaggingCopy("parsing", 500, "vb.answer.generated.>", leader_has)

    behind = Stream({"vb.answer.generated.>": 510})
    assert asyncio.run(streams.queued_for_services(behind)) == {"parsing": 1}  # type: ignore[arg-type]
    assert [(subject, seq) for seq, subject, _ in behind.asked] == [("vb.answer.generated.>", 501)]
    assert asyncio.run(streams.queued_for_services(Stream({"vb.answer.generated.>": 500}))) == {}  # type: ignore[arg-type]


def test_regrade_with_a_benchmark_of_other_questions_says_so(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Every stored answer skipped as not in --benchmark: the CLI names that and the run's
    questions (exit 2), not "has no stored answers to regrade" (the run has them)."""
    from shared.cli import lifecycle as cli_lifecycle
    from shared.cli.commands import build_parser

    bench = Benchmark.load(EXAMPLE)
    parent = events.RunRequested(run_id="old", timestamp="t0", job_count=18, answer_count=18,
                                 evaluation_mode="template_only")
    other = REFERENCE / "checkpoints" / "with_rubrics.jsonld"

    async def plan_regrade(settings: Settings, run_id: str, *, benchmark: Benchmark | None = None,
                           **_: Any) -> lifecycle.RegradePlan:
        return lifecycle.regrade_jobs(parent, _answers(bench), benchmark=benchmark, run_id="new")

    monkeypatch.setattr(cli_lifecycle, "deployment", lambda: Deployment("none", Settings()))
    monkeypatch.setattr(cli_lifecycle, "resolve_run_arg", lambda settings, run, stream: run)
    monkeypatch.setattr(cli_lifecycle.lifecycle, "plan_regrade", plan_regrade)
    args = build_parser().parse_args(["regrade", "old", "--benchmark", str(other), "--simulate"])
    assert cli_lifecycle.cmd_regrade(args) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"veribus: error: none of the 18 stored answer(s) of run old is to a question of {other} "
                           "(the run's questions: ex-arith-multiply, "), line
    assert "no stored answers" not in line


def test_regrade_and_resume_take_the_rubric_file_with_their_benchmark(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    """A run started with `run --rubric FILE` is regraded (or resumed from its benchmark) with the
    same traits: `--rubric` joins `--benchmark`; alone it is refused, naming what is missing."""
    from shared.cli import lifecycle as cli_lifecycle
    from shared.cli.commands import build_parser

    rubric = tmp_path / "extra.yaml"
    rubric.write_text("llm_traits:\n  - name: Correct\n    description: Gives the reference answer.\n    kind: boolean\n")
    seen: dict[str, Any] = {}

    async def plan_regrade(settings: Settings, run_id: str, *, benchmark: Benchmark | None = None,
                           **_: Any) -> lifecycle.RegradePlan:
        seen["benchmark"] = benchmark
        raise lifecycle.LifecycleError("stop here")

    monkeypatch.setattr(cli_lifecycle, "deployment", lambda: Deployment("none", Settings()))
    monkeypatch.setattr(cli_lifecycle, "resolve_run_arg", lambda settings, run, stream: run)
    monkeypatch.setattr(cli_lifecycle.lifecycle, "plan_regrade", plan_regrade)
    args = build_parser().parse_args(["regrade", "old", "--benchmark", str(EXAMPLE), "--rubric", str(rubric)])
    assert cli_lifecycle.cmd_regrade(args) == 2 and "stop here" in capsys.readouterr().err
    assert "Correct" in seen["benchmark"].global_rubric.trait_names()
    assert "Clarity" in seen["benchmark"].global_rubric.trait_names()
    for argv in (["regrade", "old", "--rubric", str(rubric)], ["resume", "old", "--rubric", str(rubric)]):
        assert getattr(cli_lifecycle, f"cmd_{argv[0]}")(build_parser().parse_args(argv)) == 2
        assert "--rubric adds traits to the benchmark given with --benchmark" in capsys.readouterr().err


# ------------------------------------------------------------------------------ regrade: simulator script, comparison


def _fake_regrade_bus(monkeypatch: pytest.MonkeyPatch, plan_of: Any, calls: list[Any],
                      old: dict[str, Any] | None = None, new: dict[str, Any] | None = None,
                      settings: Settings | None = None) -> Any:
    """`cmd_regrade` without a bus: the plan from `plan_of(benchmark)`, publishing and waiting recorded in
    `calls`, the runs' results `old` / `new`."""
    from shared.cli import lifecycle as cli_lifecycle

    async def plan_regrade(settings: Settings, run_id: str, *, benchmark: Benchmark | None = None,
                           **_: Any) -> lifecycle.RegradePlan:
        return plan_of(benchmark)

    async def submit_regrade(settings: Settings, plan: lifecycle.RegradePlan) -> int:
        calls.append(("submit", plan.run_id))
        return len(plan.generated)

    async def wait_for_results(settings: Settings, run_id: str, *, result_ids: list[str], **_: Any) -> tuple[int, bool]:
        return len(result_ids), False

    async def run_results(settings: Settings, run_id: str) -> dict[str, Any]:
        return (new if run_id == "new" else old) or {}

    monkeypatch.setattr(cli_lifecycle, "deployment", lambda: Deployment("none", settings or Settings()))
    monkeypatch.setattr(cli_lifecycle, "resolve_run_arg", lambda settings, run, stream: run)
    monkeypatch.setattr(cli_lifecycle, "base_reachable", lambda base: None)
    monkeypatch.setattr(cli_lifecycle.lifecycle, "plan_regrade", plan_regrade)
    monkeypatch.setattr(cli_lifecycle.lifecycle, "submit_regrade", submit_regrade)
    monkeypatch.setattr(cli_lifecycle.lifecycle, "run_results", run_results)
    monkeypatch.setattr(cli_lifecycle.wait, "wait_for_results", wait_for_results)
    monkeypatch.setattr(cli_lifecycle, "post_script", lambda base, script: calls.append(("script", base, script)))
    return cli_lifecycle


def test_regrade_simulate_posts_the_graded_benchmark_s_script_before_publishing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`regrade --simulate` gives the simulator the script of what it grades, as `run --simulate`
    does: a simulator restarted since the run (no script) parsed every stored answer with made-up
    values and the regrade reported them as changed verdicts, exit 0. Without --benchmark the script
    comes from the stored run's questions; with it, from that file and its .simulator.yaml."""
    from infra.simulator.from_benchmark import simulator_script_for, template_ground_truth
    from shared.cli.commands import build_parser

    bench = Benchmark.load(EXAMPLE)
    parent = events.RunRequested(run_id="old", timestamp="t0", job_count=18, answer_count=18,
                                 evaluation_mode="template_only", benchmark_name=bench.name)
    calls: list[Any] = []
    cli = _fake_regrade_bus(
        monkeypatch, lambda b: lifecycle.regrade_jobs(parent, _answers(bench), benchmark=b, run_id="new"), calls,
        settings=Settings(simulator_url="http://127.0.0.1:9/v1"))
    args = build_parser().parse_args(["regrade", "old", "--simulate", "--run-name", "rg", "--no-wait"])
    assert cli.cmd_regrade(args) == 0, capsys.readouterr().err
    assert [c[0] for c in calls] == ["script", "submit"]  # before anything is published
    _, base, script = calls[0]
    assert base == "http://127.0.0.1:9/v1"
    by_match = {e["match"]: e for e in script["questions"]}
    finished = bench.finished_questions()
    assert set(by_match) == {q.text for q in finished}
    for q in finished:
        assert by_match[q.text].get("parsed") == template_ground_truth(q.template_code), q.id

    # --benchmark: that file's script, with the .simulator.yaml beside it merged in (as `run` does)
    copy = tmp_path / "bench.yaml"
    bench.save_yaml(copy)
    first = finished[0]
    (tmp_path / "bench.simulator.yaml").write_text(
        f"questions:\n  - match: {first.text!r}\n    judge_errors: [500]\n")
    calls.clear()
    args = build_parser().parse_args(["regrade", "old", "--simulate", "--benchmark", str(copy), "--run-name", "rg",
                                      "--no-wait"])
    assert cli.cmd_regrade(args) == 0, capsys.readouterr().err
    assert [c[0] for c in calls] == ["script", "submit"]
    by_match = {e["match"]: e for e in calls[0][2]["questions"]}
    assert set(by_match) == {e["match"] for e in simulator_script_for(Benchmark.load(copy))["questions"]}
    assert by_match[first.text]["judge_errors"] == [500]
    assert by_match[first.text]["parsed"] == template_ground_truth(first.template_code)

    # judges not on the simulator: nothing is posted
    calls.clear()
    monkeypatch.setattr(cli, "credential_problems", lambda models, services_environ=None, **where: [])
    args = build_parser().parse_args(["regrade", "old", "--run-name", "rg", "--no-wait"])
    assert cli.cmd_regrade(args) == 0, capsys.readouterr().err
    assert [c[0] for c in calls] == ["submit"]


def test_regrade_simulate_refuses_when_the_simulator_takes_no_script(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from shared.cli import lifecycle as cli_lifecycle
    from shared.cli.commands import build_parser

    bench = Benchmark.load(EXAMPLE)
    parent = events.RunRequested(run_id="old", timestamp="t0", job_count=18, answer_count=18,
                                 evaluation_mode="template_only")
    calls: list[Any] = []
    cli = _fake_regrade_bus(monkeypatch, lambda b: lifecycle.regrade_jobs(parent, _answers(bench), run_id="new"),
                            calls, settings=Settings(simulator_url="http://127.0.0.1:9/v1"))

    def refuse(base: str, script: dict) -> None:
        raise RuntimeError(f"cannot load the benchmark's script into the simulator at {base}: 500")

    monkeypatch.setattr(cli_lifecycle, "post_script", refuse)
    args = build_parser().parse_args(["regrade", "old", "--simulate", "--run-name", "rg"])
    assert cli.cmd_regrade(args) == 2
    assert "regrade refused before publishing: cannot load the benchmark's script" in capsys.readouterr().err
    assert calls == []  # nothing published


def test_graded_benchmark_is_the_stored_questions_once_each() -> None:
    bench = Benchmark.load(EXAMPLE)
    parent = events.RunRequested(run_id="old", timestamp="t0", job_count=36, answer_count=36,
                                 evaluation_mode="template_only", benchmark_name="stored")
    answers = _answers(bench)
    twice = answers + [msgspec.structs.replace(ev, job=msgspec.structs.replace(ev.job, result_id=ev.job.result_id + "b",
                                                                               replicate=2)) for ev in answers]
    plan = lifecycle.regrade_jobs(parent, twice, run_id="new")
    graded = lifecycle.graded_benchmark(plan)
    assert graded.name == "stored"
    assert [(q.id, q.text, q.template_code) for q in graded.questions] == [
        (q.id, q.text, q.template_code) for q in bench.finished_questions()]
    # a rubric the jobs carry is the script's judge traits
    plan = lifecycle.regrade_jobs(parent, answers, benchmark=bench, mode="template_and_rubric", run_id="new")
    graded = lifecycle.graded_benchmark(plan)
    q = graded.questions[0]
    assert graded.rubric_for(q) is not None
    assert graded.rubric_for(q).trait_names() == bench.rubric_for(bench.get_question(q.id)).trait_names()


def _result(qid: str, verdict: bool | None, *, error: bool = False, model: str = "openai/a",
            raised: str | None = None) -> Any:
    from shared.core.models import (
        ModelIdentity,
        VerificationResult,
        VerificationResultMetadata,
        VerificationResultTemplate,
    )

    meta = VerificationResultMetadata(
        question_id=qid, answering=ModelIdentity(model_name=model), parsing=ModelIdentity(model_name="openai/j"),
        result_id=f"{qid}-{model}", completed_without_errors=not error, error="boom" if error else None)
    tmpl = VerificationResultTemplate(verify_result=verdict, template_verification_performed=verdict is not None,
                                      field_verification_error=raised)
    return VerificationResult(metadata=meta, template=tmpl)


def test_compare_runs_with_errored_and_graded_results_of_one_question() -> None:
    """A question with an errored result beside a graded one (two answering models): the changes
    were sorted as (qid, verdict, verdict) tuples, and None < True raised TypeError after the
    regrade was published (exit 3)."""
    old = [_result("q1", True, model="openai/a"), _result("q1", None, error=True, model="openai/b"),
           _result("q2", False), _result("q3", True), _result("q4", True),
           _result("q6", False, raised="ZeroDivisionError")]
    new = [_result("q1", None, error=True, model="openai/a"), _result("q1", True, model="openai/b"),
           _result("q2", False, raised="ZeroDivisionError"), _result("q3", True), _result("q4", False),
           _result("q5", True), _result("q6", None, error=True)]
    cmp = lifecycle.compare_runs(old, new)
    assert cmp["compared"] == 6
    assert cmp["changed"] == [("q1", "error", "passed"), ("q1", "passed", "error"), ("q4", "passed", "failed")]
    assert (cmp["errors_before"], cmp["errors_after"]) == (2, 3)  # q2's verify() raising is an error now
    assert lifecycle.outcome_label(_result("q", None)) == "no verdict"


def test_regrade_with_errored_and_graded_results_prints_the_changes(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI path of the above: the change summary, errors counted, and the regrade's own exit
    code (4: a job in error), never 3."""
    from shared.cli.commands import build_parser

    bench = Benchmark.load(EXAMPLE)
    parent = events.RunRequested(run_id="old", timestamp="t0", job_count=2, answer_count=2,
                                 evaluation_mode="template_only")
    old = [_result("q1", True, model="openai/a"), _result("q1", None, error=True, model="openai/b")]
    new = [_result("q1", None, error=True, model="openai/a"), _result("q1", True, model="openai/b")]
    calls: list[Any] = []
    cli = _fake_regrade_bus(monkeypatch, lambda b: lifecycle.regrade_jobs(parent, _answers(bench)[:2], run_id="new"),
                            calls, old={r.metadata.result_id: r for r in old},
                            new={r.metadata.result_id: r for r in new})
    monkeypatch.setattr(cli, "credential_problems", lambda models, services_environ=None, **where: [])
    args = build_parser().parse_args(["regrade", "old", "--run-name", "rg", "--timeout", "5"])
    assert cli.cmd_regrade(args) == 4
    out = capsys.readouterr().out
    assert "2/2 finalized: 1 passed, 1 error(s)" in out
    assert "verify_result changed for 2 of 2 job(s); in error: 1 before, 1 now" in out
    assert "    q1: error -> passed\n    q1: passed -> error\n" in out


# ------------------------------------------------------------------------------ what a resume runs again


async def test_a_control_that_leaves_a_budget_unset_keeps_the_one_in_force() -> None:
    """`resume --max-cost-usd 8` raised a spent budget; a later `cancel`, or a `resume --errors`
    without a budget, published a control without one, and the run's config's spent budget was
    in force again (the next jobs were stopped at once). What a control leaves unset now keeps
    what the newest control had; what it sets replaces it."""
    js = FakeJS()
    js.put_event(_control(cancelled=False, reason="resumed", budget_cost_usd=8.0, budget_tokens=900))
    await lifecycle.publish_control(js, "run1", events.RunControlChange(cancelled=True, reason="stop"))
    await lifecycle.publish_control(js, "run1", events.RunControlChange(cancelled=False, budget_tokens=1200))
    cancel, lift = (events.payload_as(e, events.RunControlChange) for e in js.published)
    assert (cancel.cancelled, cancel.budget_cost_usd, cancel.budget_tokens) == (True, 8.0, 900)
    assert (lift.cancelled, lift.budget_cost_usd, lift.budget_tokens) == (False, 8.0, 1200)
    ctl = costcontrol.CostControl(lambda: js, ttl_s=0.0, usage_ttl_s=0.0)
    js.put_event(events.make_envelope(events.RUN_REQUESTED, "run1", events.RUN_KEY, events.RunRequested(
        run_id="run1", timestamp="t", job_count=1, answer_count=1, config={"budget_cost_usd": 0.01}), "test"))
    assert await ctl.budget("run1") == 8_000_000  # micro-dollars: the raised budget, not the config's
    await ctl.close()


def _final(error: str | None, ok: bool) -> events.Envelope:
    meta = {"completed_without_errors": ok, "error": error}
    return events.make_envelope(events.RESULT_FINALIZED, "run1", "r1",
                                events.ResultFinalized(result={"metadata": meta}), "test")


def test_what_a_resume_runs_again() -> None:
    """A lift runs stopped results again unless it skips them (`--no-stopped`), errored ones only
    with `--errors`; a result that completed (a template whose verify() raised included) never."""
    cancelled = _final("generate_answer: RunCancelled: cancelled: run run1 was cancelled", False)
    over = _final("generate_answer: BudgetExhausted: budget exhausted: run run1 has used 9 of its 5", False)
    failed = _final("generate_answer: ServerError: simulated server error 500 after 3 attempt(s)", False)
    completed = _final(None, True)
    plain = events.RunControlChange(cancelled=False)
    errors = events.RunControlChange(cancelled=False, reruns_errors=True)
    only_errors = events.RunControlChange(cancelled=False, reruns_errors=True, skips_stopped=True)
    table = {(name, lift): lifecycle.reruns(c, env)
             for name, env in (("cancelled", cancelled), ("over", over), ("failed", failed), ("completed", completed))
             for lift, c in (("plain", plain), ("errors", errors), ("only_errors", only_errors))}
    assert [k for k, v in table.items() if v] == [
        ("cancelled", "plain"), ("cancelled", "errors"), ("over", "plain"), ("over", "errors"),
        ("failed", "errors"), ("failed", "only_errors")]
    # an old lift, published before these fields, reads as it meant: stopped results run again
    old = events.payload_as(_control(cancelled=False, reason="resumed"), events.RunControlChange)
    assert lifecycle.reruns(old, cancelled) and not lifecycle.reruns(old, failed)
