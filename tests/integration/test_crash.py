"""Invariant 2 (nothing is lost): kill -9 any service, several at once, or the NATS server in the
middle of a run of a few hundred jobs; restart it the way `up` starts it; every job still ends
in exactly one finalized result, with the verdicts of an undisturbed run of the same benchmark
and simulator script.

One stack serves the module (simulator latency 30 ms, ack_wait 5 s so that messages a killed
process held are redelivered quickly); each test submits its own run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.control import stack, wait
from tests.integration.test_durability import (
    Stack,
    expected_verdicts,
    generated_benchmark,
    plan_and_submit,
    results_of,
    rows,
    start_stack,
    stop_stack,
    sync,
    verdicts,
    wait_projected,
    wait_projector_idle,
    wait_results,
)

N = 200
KILL_AT = 0.15  # fraction of the run's results finalized before the kill


@pytest.fixture(scope="module")
def crash_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    home = tmp_path_factory.mktemp("crash") / "home"
    st = start_stack(home, simulator_args=["--latency-ms", "30"],
                     extra_env={"VERIBUS_CONSUMER_ACK_WAIT_S": "5"})
    path, script = generated_benchmark(tmp_path_factory.mktemp("crash-bench") / "bench.yaml", N, prefix="Crash")
    st.post_script(script)
    try:
        yield st, path
    finally:
        stop_stack(st)


@pytest.fixture(scope="module")
def baseline(crash_stack: tuple[Stack, Path]) -> dict[str, bool | None]:
    """The undisturbed run: its verdicts per question."""
    st, path = crash_stack
    plan = plan_and_submit(st, path, _config(st))
    wait_results(st, plan.run_id, N, timeout=120)
    got = verdicts(results_of(st, plan.run_id))
    assert got == expected_verdicts(N)
    return got


def _config(st: Stack):  # noqa: ANN202
    # 4 calls in flight per model: the run takes a few seconds, long enough to crash into
    return st.config(answer_kw={"max_concurrency": 4}, judge_kw={"max_concurrency": 4})


def _start_and_wait_in_flight(st: Stack, path: Path) -> str:
    plan = plan_and_submit(st, path, _config(st))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = len(sync(wait.finalized_counts(st.settings, plan.run_id)))
        if done >= KILL_AT * N:
            assert done < N, "the run finished before the crash: make it slower"
            return plan.run_id
        time.sleep(0.05)
    raise AssertionError("the run did not get going")


def _check_run(st: Stack, run_id: str, baseline: dict[str, bool | None], timeout: float = 90.0) -> None:
    counts = wait_results(st, run_id, N, timeout=timeout)
    assert len(counts) == N and set(counts.values()) == {1}, "exactly one result.finalized per job"
    res = results_of(st, run_id)
    assert all(r.metadata.completed_without_errors for r in res.values()), \
        [r.metadata.error for r in res.values() if not r.metadata.completed_without_errors][:3]
    assert verdicts(res) == baseline
    wait_projected(st, run_id, N, timeout=60)
    wait_projector_idle(st)  # a batch's results rows are inserted before its events rows
    assert rows(st, "SELECT count() FROM verification_results FINAL WHERE run_id = {r:String}", r=run_id) == [(N,)]
    assert rows(st, "SELECT count() FROM events FINAL WHERE run_id = {r:String} AND event_type = 'result.finalized'",
                r=run_id) == [(N,)]


@pytest.mark.parametrize("service", stack.SERVICES)
def test_kill_one_service(crash_stack, baseline, service: str) -> None:
    st, path = crash_stack
    st.ensure_all_alive()
    run_id = _start_and_wait_in_flight(st, path)
    old = st.kill(service)
    new = st.restart(service)
    assert new.pid != old and new.alive()
    _check_run(st, run_id, baseline)


def test_kill_several_services(crash_stack, baseline) -> None:
    st, path = crash_stack
    st.ensure_all_alive()
    run_id = _start_and_wait_in_flight(st, path)
    victims = ["generation", "parsing", "rubric", "finalization", "projector"]
    for name in victims:
        st.kill(name)
    time.sleep(0.5)  # the run is stalled with nobody holding its messages
    for name in victims:
        st.restart(name)
    _check_run(st, run_id, baseline)


def test_kill_nats_server(crash_stack, baseline) -> None:
    """kill -9 nats-server and start it again on the same port and store: the stream, the
    durable consumers and the services' connections come back, and the run completes."""
    st, path = crash_stack
    st.ensure_all_alive()
    run_id = _start_and_wait_in_flight(st, path)
    st.kill("nats")
    time.sleep(1.0)
    st.restart("nats")
    _check_run(st, run_id, baseline, timeout=120)
    assert all(p.alive() for p in st.reload().procs), "every service survived the server's restart"
