"""`veribus down` then `veribus up` on a home whose run is still in flight (through the CLI's own
`main`, in this process, on real nats-server and simulator processes): the stack comes back on
the ports it had, so jobs that name the simulator by its URL (`api_base`) still reach it, with
the script it was given; `down` says which runs are in flight and what becomes of them, and the
run then finishes after `up` with every result and no errors. A port another program took in
between is replaced by a new one, and `up` says so."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.workload import expected_verdicts
from shared.cli.commands import main
from shared.control import processes, stack, wait
from shared.core.config import Settings
from tests.support.stack import (
    generated_benchmark,
    plan_and_submit,
    results_of,
    start_stack,
    stop_stack,
    sync,
    verdicts,
    wait_results,
)


def _cli(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    monkeypatch.setenv("VERIBUS_HOME", str(home))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    monkeypatch.delenv("VERIBUS_SIMULATOR_URL", raising=False)


class Started:
    """Every process the stack of `home` had, to stop by identity (PID and create time) at the end."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.procs: list[processes.Proc] = []

    def note(self) -> stack.StackState:
        state = stack.StackState.load(self.home)
        assert state is not None
        self.procs += state.procs
        return state

    def stop(self) -> None:
        stack.down(Settings(home=self.home))
        for p in self.procs:
            if p.alive():
                processes.kill_proc(p)
        assert not [p.name for p in self.procs if p.alive()]


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Started]:
    s = Started(tmp_path / "home")
    try:
        yield s
    finally:
        s.stop()


def _port(url: str | None) -> int:
    assert url
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def test_up_after_down_takes_its_ports_again_and_a_new_one_for_a_port_taken(
        started: Started, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The simulator (and nats-server) come back on the ports they had: the old `up` gave them
    new ones, and every job of a run in flight still named the old simulator URL. A port taken
    by another program meanwhile gets a new one, and `up` says what that means. (NATS and the
    simulator only: the services play no part in which ports these get, and with nothing in
    flight `down` says nothing about runs.)"""
    _cli(monkeypatch, started.home)
    monkeypatch.setattr(stack, "SERVICES", [])
    assert main(["up"]) == 0
    first = started.note()
    capsys.readouterr()
    assert main(["down"]) == 0
    assert "in flight" not in capsys.readouterr().err  # nothing is: not a word about runs

    assert main(["up"]) == 0
    second = started.note()
    out = capsys.readouterr().out
    assert second.simulator_url == first.simulator_url, out
    assert second.nats_url == first.nats_url, out
    assert "note:" not in out
    assert main(["down"]) == 0

    sim_port = _port(first.simulator_url)
    with socket.create_server(("127.0.0.1", sim_port)):  # another program takes the simulator's port
        assert main(["up"]) == 0
        third = started.note()
        out = capsys.readouterr().out
        assert third.nats_url == first.nats_url
        assert _port(third.simulator_url) != sim_port
        assert (f"note: the simulator's port {sim_port} is taken by another program: it listens on "
                f"{_port(third.simulator_url)} now; jobs of runs sent before to http://127.0.0.1:{sim_port}/v1 "
                "(--simulate) end with connection errors") in out
        assert main(["down"]) == 0


N = 16


def test_a_run_in_flight_across_down_and_up_finishes_without_errors(
        started: Started, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The user's report: a simulated run in flight across `down` / `up` ended with a third of its
    results `connection: ... failed after 5 attempt(s)` (the simulator came back on a new port),
    and `down` had said nothing. Now `down` names the run and says it resumes; after `up` the run
    finishes with every result, no errors, and the scripted verdicts (the simulator kept its
    script).

    And at once: the ack wait is 10 minutes here, and the run must finish within 2 after `up`.
    The jobs `down` cut off (generation's, waiting for their model's one slot) were left unacked
    and came back only after the ack wait (120 s by default); a stopping service now hands them
    back (a nak) once its grace (1 s here) is over."""
    _cli(monkeypatch, started.home)
    env = {"VERIBUS_CONSUMER_ACK_WAIT_S": "600", "VERIBUS_SHUTDOWN_GRACE_S": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # for the services `veribus up` starts
    sim_args = ["--latency-ms", "400"]
    st = start_stack(started.home, simulator_args=sim_args, extra_env=env)
    try:
        before = started.note()
        path, script = generated_benchmark(tmp_path / "bench.yaml", N, prefix="Downup")
        st.post_script(script)
        # one answer at a time: the run takes N x 0.4 s at least, long enough to stop the stack in
        config = st.config("template_only", answer_kw={"max_concurrency": 1}, judge_kw={"max_concurrency": 2})
        plan = plan_and_submit(st, path, config)
        deadline = time.monotonic() + 120
        while len(sync(wait.finalized_counts(st.settings, plan.run_id))) < 1:
            assert time.monotonic() < deadline, "the run did not get going"
            time.sleep(0.05)

        assert main(["down"]) == 0
        err = capsys.readouterr().err
        line = next((x for x in err.splitlines() if x.startswith("warning: 1 run(s) still in flight: ")), "")
        assert f"; run {plan.run_id})" in line and f" of {N} jobs have a result" in line, err
        assert "`veribus up` from this home takes them up where they stopped" in err
        assert "No `veribus resume` is needed" in err
        done_at_down = int(line.split(f"{plan.run_id} (", 1)[1].split(" of ", 1)[0])
        assert done_at_down < N, "the run finished before `down`: make it slower"

        assert main(["up", "--sim-latency-ms", "400"]) == 0
        after = started.note()
        st.state = after
        st.settings.nats_url, st.settings.simulator_url = after.nats_url, after.simulator_url
        assert after.simulator_url == before.simulator_url
        handed_back = [line for log in (started.home / "logs").glob("generation*.log") for line in log.read_text().splitlines()
                       if "handed back unfinished" in line]
        assert handed_back, "generation stopped with nothing in flight: the test did not cut anything off"
        wait_results(st, plan.run_id, N, timeout=120)  # << the ack wait: nothing was left to it
        res = results_of(st, plan.run_id)
        assert [r.metadata.error for r in res.values() if not r.metadata.completed_without_errors] == []
        assert verdicts(res) == expected_verdicts(N)
    finally:
        stop_stack(st)
