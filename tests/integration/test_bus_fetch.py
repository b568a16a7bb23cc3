"""The consuming side of the bus against a real nats-server: nats-py's `next_msg` fast path
(`shared.runtime.nats_patches`) and the harness's pipelined pull loop (`shared.runtime.pump.Pump`):
every message handled and acked once, never more handlers at once than the service's workers,
redelivery of what a handler failed, and a stop that lets handlers in flight finish."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest
from nats import errors as nats_errors

from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus
from shared.runtime.harness import StageService

pytestmark = pytest.mark.integration


async def test_next_msg_returns_queued_messages_in_order_then_times_out(nats_server: Any) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        sub = await nc.subscribe("t.fast")
        for i in range(50):
            await nc.publish("t.fast", str(i).encode())
        await nc.flush()
        await asyncio.sleep(0.1)  # all 50 are in the subscription's queue now
        got = [int((await sub.next_msg(timeout=1)).data) for _ in range(50)]
        assert got == list(range(50))
        assert sub.pending_bytes == 0 and sub.pending_msgs == 0
        with pytest.raises(nats_errors.TimeoutError):
            await sub.next_msg(timeout=0.05)
        await nc.publish("t.fast", b"late")  # an empty queue still waits for the next one
        assert (await sub.next_msg(timeout=2)).data == b"late"
    finally:
        await nc.close()


async def test_request_fast_path_replies_times_out_and_forgets(nats_server: Any) -> None:
    """The request fast path (`shared.runtime.nats_patches`): replies reach their own requests
    when many are in flight, a request nobody answers in time raises nats' TimeoutError, and
    neither leaves an entry behind (a reply that comes after its request gave up finds nothing)."""
    nc = await nats.connect(nats_server.url)
    held: list[Any] = []
    try:
        async def echo(msg: Any) -> None:
            await msg.respond(b"re:" + msg.data)

        async def hold(msg: Any) -> None:
            held.append(msg)  # answered only after the request gave up

        await nc.subscribe("t.echo", cb=echo)
        await nc.subscribe("t.hold", cb=hold)
        replies = await asyncio.gather(*(nc.request("t.echo", str(i).encode(), timeout=5) for i in range(200)))
        assert [r.data for r in replies] == [f"re:{i}".encode() for i in range(200)]
        with pytest.raises(nats_errors.TimeoutError):
            await nc.request("t.hold", b"late", timeout=0.2)
        assert held and not nc._resp_map
        await held[0].respond(b"too late")
        await nc.flush()
        assert (await nc.request("t.echo", b"next", timeout=5)).data == b"re:next"
        assert not nc._resp_map
    finally:
        await nc.close()


def _request(i: int) -> events.Envelope:
    job = events.Job(run_id="run1", result_id=f"r{i}", answer_id=f"r{i}", question_id=f"q{i}", question_text="2+2?",
                     answering=events.ModelSpec(model_name="openai/a"), parsing=events.ModelSpec(model_name="openai/j"),
                     timestamp="2026-01-01T00:00:00+00:00")
    return events.make_envelope(events.ANSWER_REQUESTED, "run1", f"r{i}", events.AnswerRequested(jobs=[job]), "cli")


async def test_pump_handles_each_message_once_within_its_workers(nats_server: Any, tmp_path: Any) -> None:
    settings = Settings(home=tmp_path, nats_url=nats_server.url, consumer_max_deliver=3)
    nc = await bus.connect(settings)
    js = nc.jetstream()
    await bus.ensure_stream(js, settings)
    svc = StageService("generation", settings)
    svc.bind(js)
    running, peak, handled = 0, 0, []
    failed_once: set[str] = set()

    @svc.handles(events.ANSWER_REQUESTED, events.AnswerRequested, max_workers=4, durable="pump-test")
    async def handler(env: events.Envelope, req: events.AnswerRequested) -> list[events.Envelope]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(0.01)
            if env.result_id == "r7" and "r7" not in failed_once:
                failed_once.add("r7")
                raise RuntimeError("transient")  # nacked, redelivered, handled the second time
            handled.append(env.result_id)
            return []
        finally:
            running -= 1

    try:
        await bus.publish_many(js, [_request(i) for i in range(60)])
        await svc._start_pumps()
        for _ in range(300):
            if len(handled) >= 60:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)  # acks reach the server
        info = await js.consumer_info(events.STREAM, "pump-test")
    finally:
        await svc._stop_pumps()
        await svc.control.close()
        await svc.cost_control.close()
        await nc.close()
    assert sorted(handled) == sorted(f"r{i}" for i in range(60)), "each message handled once, r7 after its retry"
    assert peak <= 4, f"{peak} handlers ran at once with 4 workers"
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert info.delivered.consumer_seq == 61, "60 deliveries and one redelivery: only the failed message came back"


async def test_pump_stop_lets_handlers_in_flight_finish(nats_server: Any, tmp_path: Any) -> None:
    settings = Settings(home=tmp_path, nats_url=nats_server.url)
    nc = await bus.connect(settings)
    js = nc.jetstream()
    await bus.ensure_stream(js, settings)
    svc = StageService("generation", settings)
    svc.bind(js)
    started = asyncio.Event()
    finished: list[str] = []

    @svc.handles(events.ANSWER_REQUESTED, events.AnswerRequested, max_workers=2, durable="pump-stop")
    async def handler(env: events.Envelope, req: events.AnswerRequested) -> list[events.Envelope]:
        started.set()
        await asyncio.sleep(0.5)
        finished.append(env.result_id)
        return []

    try:
        await bus.publish(js, _request(1))
        await svc._start_pumps()
        await asyncio.wait_for(started.wait(), 10)
        await svc._stop_pumps()  # while the handler sleeps
        await asyncio.sleep(0.3)
        info = await js.consumer_info(events.STREAM, "pump-stop")
    finally:
        await svc.control.close()
        await svc.cost_control.close()
        await nc.close()
    assert finished == ["r1"] and info.num_ack_pending == 0, "finished and acked before the pump let go"


async def _held_run(settings: Settings, durable: str, sleep_s: float, n: int = 3) -> tuple[dict[str, int], Any]:
    """`n` requests through a service whose handler takes `sleep_s` (longer than the ack wait):
    how often each was handled, and the consumer's state once they are done."""
    nc = await bus.connect(settings)
    js = nc.jetstream()
    await bus.ensure_stream(js, settings)
    svc = StageService("generation", settings)
    svc.bind(js)
    calls: dict[str, int] = {}
    done: set[str] = set()

    @svc.handles(events.ANSWER_REQUESTED, events.AnswerRequested, max_workers=8, durable=durable)
    async def handler(env: events.Envelope, req: events.AnswerRequested) -> list[events.Envelope]:
        calls[env.result_id] = calls.get(env.result_id, 0) + 1
        await asyncio.sleep(sleep_s)
        done.add(env.result_id)
        return []

    try:
        await bus.publish_many(js, [_request(i) for i in range(n)])
        await svc._start_pumps()
        for _ in range(200):
            if len(done) >= n:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # past another ack wait: a message let go would be delivered again by now
        info = await js.consumer_info(events.STREAM, durable)
    finally:
        await svc._stop_pumps()
        await svc.control.close()
        await svc.cost_control.close()
        await nc.close()
    return calls, info


async def test_a_handler_slower_than_the_ack_wait_keeps_its_message(nats_server: Any, tmp_path: Any) -> None:
    """The pump marks a message still being handled in progress every third of the ack wait:
    with a 1 s ack wait and 3.5 s handlers no message is delivered a second time (before, each
    came back every second while its first handler still ran, and a model call was paid again)."""
    settings = Settings(home=tmp_path, nats_url=nats_server.url, consumer_ack_wait_s=1.0)
    calls, info = await _held_run(settings, "held", sleep_s=3.5)
    assert calls == {"r0": 1, "r1": 1, "r2": 1}, f"handled more than once: {calls}"
    assert info.num_redelivered == 0 and info.num_ack_pending == 0
    assert info.delivered.consumer_seq == 3


async def test_a_handler_held_past_its_limit_lets_its_message_go(nats_server: Any, tmp_path: Any) -> None:
    """A handler still running after `consumer_max_hold_s` is taken for stuck: its message is no
    longer kept, and the ack wait delivers it again (to another replica, or here to this one)."""
    settings = Settings(home=tmp_path, nats_url=nats_server.url, consumer_ack_wait_s=1.0, consumer_max_hold_s=1.0)
    calls, _ = await _held_run(settings, "stuck", sleep_s=3.5, n=1)
    assert calls["r0"] >= 2, "a message held past the limit is delivered again after the ack wait"


async def test_a_changed_ack_wait_reaches_an_existing_durable_consumer(nats_server: Any, tmp_path: Any) -> None:
    """The server keeps a durable consumer's configuration, and binding to it changes nothing: a
    service started with another ack wait, max ack pending or max deliver updates it."""
    old = Settings(home=tmp_path, nats_url=nats_server.url, consumer_ack_wait_s=120.0)
    new = Settings(home=tmp_path, nats_url=nats_server.url, consumer_ack_wait_s=30.0,
                   consumer_max_ack_pending=64, consumer_max_deliver=3, consumer_max_interrupted=0)
    seen = []
    for settings in (old, new):
        nc = await bus.connect(settings)
        js = nc.jetstream()
        await bus.ensure_stream(js, settings)
        svc = StageService("generation", settings)
        svc.bind(js)

        @svc.handles(events.ANSWER_REQUESTED, events.AnswerRequested, durable="settled")
        async def handler(env: events.Envelope, req: events.AnswerRequested) -> list[events.Envelope]:
            return []

        try:
            await svc._start_pumps()
            cfg = (await js.consumer_info(events.STREAM, "settled")).config
            seen.append((cfg.ack_wait, cfg.max_ack_pending, cfg.max_deliver))
        finally:
            await svc._stop_pumps()
            await svc.control.close()
            await svc.cost_control.close()
            await nc.close()
    assert seen == [(120.0, 512, 27), (30.0, 64, 5)]  # max deliver: 5 + 20 interrupted + the give-up + a spare


async def test_a_job_cut_off_at_every_delivery_still_ends_with_its_give_up(nats_server: Any, tmp_path: Any) -> None:
    """A service stopped (or killed) while handling a job hands it back, and each time a delivery
    counts. Before, the server's deliveries ran out after `consumer_max_deliver` + 1 of them and
    the job was never seen again: no result, and a run that never ends. Now
    `consumer_max_interrupted` more are allowed, and the last one records the give-up without
    running the handler (a job that kills its process must not be run again): `stage.failed` and
    the generation stage's failed answer, so the result ends and says why."""
    from services.generation import app as generation  # its give-up, as the service registered it

    settings = Settings(home=tmp_path, nats_url=nats_server.url, consumer_max_deliver=1, consumer_max_interrupted=2,
                        shutdown_grace_s=0)
    give_up = generation.service.subscriptions[events.ANSWER_REQUESTED].give_up
    nc = await bus.connect(settings)
    js = nc.jetstream()
    await bus.ensure_stream(js, settings)
    entered: list[int] = []
    try:
        await bus.publish(js, _request(0))
        for life in range(4):  # four lives of the service: three cut off mid-job, then the last delivery
            svc = StageService("generation", settings)
            svc.bind(js)

            @svc.handles(events.ANSWER_REQUESTED, events.AnswerRequested, give_up=give_up, durable="cut-off")
            async def handler(env: events.Envelope, req: events.AnswerRequested, life: int = life) -> list[events.Envelope]:
                entered.append(life)
                await asyncio.Event().wait()  # a model call that never returns before the stop
                return []

            try:
                await svc._start_pumps()
                if life < 3:
                    for _ in range(100):
                        if len(entered) > life:
                            break
                        await asyncio.sleep(0.05)
                    assert len(entered) == life + 1, f"delivery {life + 1} never reached a handler"
                else:
                    failed = await _last(js, events.subject(events.STAGE_FAILED, "run1", "r0"))
                    answer = await _last(js, events.subject(events.ANSWER_GENERATED, "run1", "r0"))
            finally:
                await svc._stop_pumps()  # hands the message back: its nak is a delivery used
                await svc.control.close()
                await svc.cost_control.close()
        await asyncio.sleep(0.3)
        info = await js.consumer_info(events.STREAM, "cut-off")
    finally:
        await nc.close()
    assert entered == [0, 1, 2], "the last delivery is not handled again"
    error = events.payload_as(failed, events.StageFailed).error
    assert error.type == "DeliveriesExhausted" and "delivered 4 times" in error.message
    gave_up = events.payload_as(answer, events.StageEvent)
    assert gave_up.status == "failed" and gave_up.state.error is not None
    assert gave_up.state.error.type == "DeliveriesExhausted"
    assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0


async def _last(js: Any, subject: str) -> events.Envelope:
    """The newest event on `subject`, waited for up to 10 s."""
    for _ in range(100):
        try:
            return events.decode((await js.get_last_msg(events.STREAM, subject)).data, subject)
        except nats_errors.Error:
            await asyncio.sleep(0.1)
    raise AssertionError(f"nothing was published on {subject}")
