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

from bench.workload import expected_verdicts
from shared.control import stack
from tests.support.stack import (
    Stack,
    check_run_complete,
    start_and_wait_in_flight,
    undisturbed_verdicts,
    workload_stack,
)

N = 200
KILL_AT = 0.15  # fraction of the run's results finalized before the kill


@pytest.fixture(scope="module")
def crash_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    with workload_stack(tmp_path_factory, "crash", N, prefix="Crash", simulator_args=["--latency-ms", "30"],
                        extra_env={"VERIBUS_CONSUMER_ACK_WAIT_S": "5"}) as both:
        yield both


@pytest.fixture(scope="module")
def baseline(crash_stack: tuple[Stack, Path]) -> dict[str, bool | None]:
    """The undisturbed run: its verdicts per question."""
    st, path = crash_stack
    got = undisturbed_verdicts(st, path, N, timeout=120)
    assert got == expected_verdicts(N)
    return got


def _start_and_wait_in_flight(st: Stack, path: Path) -> str:
    return start_and_wait_in_flight(st, path, N, KILL_AT, timeout=60)


def _check_run(st: Stack, run_id: str, baseline: dict[str, bool | None], timeout: float = 90.0) -> None:
    check_run_complete(st, run_id, baseline, N, timeout=timeout, projected_timeout=60)


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
