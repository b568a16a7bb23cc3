"""Invariant 3 (poison messages): an undecodable event, an event of a wrong schema version and a
handler that raises every time are retried a bounded number of times with backoff, then
dead-lettered or given up, with the error recorded as an event and visible in
`veribus status RUN`; the rest of the run completes.

The stack runs every service as a process except verification, which runs in this process
(the real harness and the real stage function) so one job can be made to hit a handler bug.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from services.verification.stage import STAGE, verify_template
from shared.control import runner, status, streams
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.runtime import bus
from shared.runtime.harness import StageService, stage_error
from shared.templates.sandbox import get_sandbox
from tests.conftest import REPO
from tests.integration.test_durability import (
    Stack,
    generated_benchmark,
    results_of,
    start_stack,
    stop_stack,
    sync,
    wait_projected,
    wait_results,
)

N = 20
MAX_DELIVER = 3


class InProcessService:
    """A StageService app run on its own event loop in a thread (stopped in teardown)."""

    def __init__(self, service: StageService) -> None:
        self.service = service
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.service.app.start(), self.loop).result(60)

    def stop(self) -> None:
        async def shutdown() -> None:
            await self.service.app.stop()
            await get_sandbox().close()  # the template workers this process started

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@dataclass
class Scenario:
    st: Stack
    run_id: str
    poison_rid: str
    calls: dict[str, list[float]]
    t_submit: float


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    home = tmp_path_factory.mktemp("poison") / "home"
    st = start_stack(home, replicas={"verification": 0},
                     extra_env={"VERIBUS_CONSUMER_MAX_DELIVER": str(MAX_DELIVER), "VERIBUS_CONSUMER_ACK_WAIT_S": "5"})
    svc = StageService("verification", st.settings.model_copy())
    calls: dict[str, list[float]] = {}
    poison: dict[str, str] = {}

    def give_up(env: events.Envelope, ev: events.StageEvent, exc: BaseException) -> list[events.Envelope]:
        ev.state.error = ev.state.error or stage_error(STAGE, exc)
        return [svc.emit(events.TEMPLATE_VERIFIED, ev.job, events.StageEvent(ev.job, ev.state, "failed", str(exc)))]

    @svc.handles(events.TEMPLATE_PARSED, events.StageEvent, give_up=give_up)
    async def on_template_parsed(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
        calls.setdefault(ev.job.result_id, []).append(time.monotonic())
        if ev.job.result_id == poison.get("rid"):
            raise ZeroDivisionError("a handler bug that fires on every delivery")
        state = await verify_template(ev.job, ev.state)
        return [svc.emit(events.TEMPLATE_VERIFIED, ev.job, events.StageEvent(ev.job, state))]

    inproc = InProcessService(svc)
    try:
        inproc.start()
        path, script = generated_benchmark(tmp_path_factory.mktemp("pbench") / "b.yaml", N, prefix="Poison")
        st.post_script(script)
        plan = runner.plan_run(Benchmark.load(path), st.config())
        poison["rid"] = plan.requests[3].jobs[0].result_id
        t0 = time.monotonic()
        sync(runner.submit(st.settings, plan))
        sync(_inject_poison(st, plan))
        yield Scenario(st, plan.run_id, poison["rid"], calls, t0)
    finally:
        try:
            inproc.stop()
        finally:
            stop_stack(st)


async def _inject_poison(st: Stack, plan: runner.RunPlan) -> None:
    nc = await bus.connect(st.settings)
    try:
        js = nc.jetstream()
        run = plan.run_id
        # 1. bytes that are no envelope at all, for the generation and the guards consumers
        await js.publish(events.subject(events.ANSWER_REQUESTED, run, "garbage0001"), b"\x00{not json",
                         stream=events.STREAM)
        await js.publish(events.subject(events.ANSWER_GENERATED, run, "garbage0002"), b'{"event_id": 42}',
                         stream=events.STREAM)
        # 2. a well-formed envelope of a schema version this code does not know
        req = events.AnswerRequested(jobs=[msgspec.structs.replace(plan.requests[0].jobs[0], result_id="future0001")])
        env = events.make_envelope(events.ANSWER_REQUESTED, run, "future0001", req, "test")
        env.schema_version = 99
        await js.publish(env.subject, events.encode(env), stream=events.STREAM)
        # 3. a request the generation handler cannot handle on any delivery (no jobs)
        bug = events.make_envelope(events.ANSWER_REQUESTED, run, "nojobs0001", events.AnswerRequested(jobs=[]),
                                   "test")
        await bus.publish(js, bug)
    finally:
        await nc.close()


def _dead_letters(st: Stack, run_id: str) -> dict[str, events.DeadLetter]:
    async def read() -> list[events.Envelope]:
        nc = await bus.connect(st.settings)
        try:
            return await streams.read_events(nc.jetstream(), events.subject(events.DEAD_LETTER, run_id, "*"))
        finally:
            await nc.close()

    deadline = time.monotonic() + 60
    out: dict[str, events.DeadLetter] = {}
    while time.monotonic() < deadline:
        out = {e.result_id: events.payload_as(e, events.DeadLetter) for e in sync(read())}
        if len(out) >= 3:
            break
        time.sleep(0.25)
    return out


def test_rest_of_run_completes(scenario: Scenario) -> None:
    counts = wait_results(scenario.st, scenario.run_id, N, timeout=90)
    assert len(counts) == N and set(counts.values()) == {1}
    res = results_of(scenario.st, scenario.run_id)
    ok = [r for r in res.values() if r.metadata.result_id != scenario.poison_rid]
    assert len(ok) == N - 1 and all(r.metadata.completed_without_errors for r in ok)


def test_undecodable_and_wrong_schema_are_dead_lettered(scenario: Scenario) -> None:
    dead = _dead_letters(scenario.st, scenario.run_id)
    assert set(dead) == {"garbage0001", "garbage0002", "future0001"}
    assert dead["garbage0001"].consumer == "generation" and dead["garbage0002"].consumer == "guards"
    assert all(d.deliveries == MAX_DELIVER for d in dead.values()), "retried a bounded number of times"
    assert "DecodeError" in dead["garbage0001"].error or "JSON" in dead["garbage0001"].error
    assert "schema_version 99" in dead["future0001"].error
    assert dead["garbage0001"].data.startswith("\x00{not json")


def test_handler_bug_is_retried_with_backoff_then_given_up(scenario: Scenario) -> None:
    wait_results(scenario.st, scenario.run_id, N, timeout=90)
    times = scenario.calls[scenario.poison_rid]
    assert len(times) == MAX_DELIVER, "the bug is retried exactly max_deliver times"
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert gaps[0] >= 0.45 and gaps[1] >= 0.95, f"backoff 0.5 s then 1 s, got {gaps}"
    res = results_of(scenario.st, scenario.run_id)[scenario.poison_rid]
    assert not res.metadata.completed_without_errors
    assert "ZeroDivisionError" in res.metadata.error and "every delivery" in res.metadata.error


def test_give_ups_are_events_and_visible_in_status(scenario: Scenario) -> None:
    st = scenario.st
    wait_results(st, scenario.run_id, N, timeout=90)
    _dead_letters(st, scenario.run_id)
    wait_projected(st, scenario.run_id, N)
    deadline = time.monotonic() + 30
    problems: dict[str, Any] = {}
    while time.monotonic() < deadline:
        problems = status.run_problems(st.settings, scenario.run_id)
        if problems["stage_failed"] >= 2 and problems["dead_letters"] >= 3:
            break
        time.sleep(0.25)
    failures = {(f["stage"], f["type"], f["result_id"]) for f in problems["stage_failures"]}
    assert ("verification", "ZeroDivisionError", scenario.poison_rid) in failures
    assert ("generation", "IndexError", "nojobs0001") in failures
    assert problems["dead_letters"] == 3
    text = status.format_run_problems(problems)
    assert "ZeroDivisionError" in text and "IndexError" in text and "schema_version 99" in text
    env = {**os.environ, "VERIBUS_HOME": str(st.settings.home)}
    out = subprocess.run([sys.executable, "-m", "shared.cli", "status", scenario.run_id], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "dead letters: 3" in out.stdout
    assert "errors=1" in out.stdout.replace(" ", "")
