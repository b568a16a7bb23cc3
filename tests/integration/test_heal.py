"""A stack that heals, through the CLI a user types (`veribus status|up|down` as subprocesses on
a real local stack): kill -9 some services and `up` restarts exactly those; a stack.json PID
that now belongs to another program is dead, and that program is left alone; kill -9
nats-server and `up` brings the whole stack back with no orphans and the chdb folder usable;
`down` stops everything, orphans and process-group leftovers included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bench.workload import expected_verdicts
from shared.control import processes, stack
from tests.conftest import REPO
from tests.support.stack import (
    Stack,
    generated_benchmark,
    plan_and_submit,
    results_of,
    rows,
    start_stack,
    stop_stack,
    verdicts,
    wait_projected,
    wait_results,
)

N = 20


@pytest.fixture(scope="module")
def heal_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    home = tmp_path_factory.mktemp("heal") / "home"
    st = start_stack(home, simulator_args=["--latency-ms", "5"], extra_env={"VERIBUS_CONSUMER_ACK_WAIT_S": "5"})
    path, script = generated_benchmark(tmp_path_factory.mktemp("heal-bench") / "bench.yaml", N, prefix="Heal")
    st.post_script(script)
    extra: list[int] = []
    st.extra_pids = extra  # type: ignore[attr-defined]  # processes a test started, killed at the end
    try:
        yield st, path
    finally:
        stop_stack(st)
        for pid in extra:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def veribus(st: Stack, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VERIBUS_HOME": str(st.state.home), "PYTHONPATH": str(REPO)}
    env.pop("VERIBUS_NATS_URL", None)
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def status_lines(st: Stack) -> dict[str, str]:
    """name -> 'up' | 'DEAD' from `veribus status`."""
    out = veribus(st, "status")
    assert out.returncode == 0, out.stderr
    got = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] == "pid":
            got[parts[0]] = parts[3]
    return got


def identity(p: processes.Proc) -> tuple[int, float | None]:
    return p.pid, p.create_time


def gone(pid: int, create_time: float | None) -> bool:
    """The process that had this PID and create time no longer runs (the PID may be reused)."""
    try:
        q = psutil.Process(pid)
        return q.status() == psutil.STATUS_ZOMBIE or (
            create_time is not None and abs(q.create_time() - create_time) > processes.CREATE_TIME_TOLERANCE_S)
    except psutil.NoSuchProcess:
        return True


def healthy(st: Stack) -> None:
    out = veribus(st, "up")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not st.reload().dead()


def run_ok(st: Stack, path: Path) -> None:
    """A small run completes on the (healed) stack with the expected verdicts, and reaches ClickHouse."""
    plan = plan_and_submit(st, path, st.config())
    wait_results(st, plan.run_id, N, timeout=120)
    assert verdicts(results_of(st, plan.run_id)) == expected_verdicts(N)
    wait_projected(st, plan.run_id, N, timeout=90)


def test_up_restarts_exactly_the_dead_services(heal_stack) -> None:
    st, path = heal_stack
    healthy(st)
    before = {p.name: identity(p) for p in st.reload().procs}
    for name in ("guards", "rubric"):
        st.kill(name)
    shown = status_lines(st)
    assert shown["guards"] == shown["rubric"] == "DEAD"
    assert all(v == "up" for k, v in shown.items() if k not in ("guards", "rubric")), shown

    out = veribus(st, "up")
    assert out.returncode == 0, out.stderr
    assert "restarted: guards, rubric" in out.stdout
    after = {p.name: identity(p) for p in st.reload().procs}
    assert {k for k in after if after[k] != before[k]} == {"guards", "rubric"}
    assert all(p.alive() for p in st.state.procs)
    assert set(status_lines(st).values()) == {"up"}
    run_ok(st, path)


def test_a_reused_pid_is_dead_and_its_new_owner_is_left_alone(heal_stack) -> None:
    """kill -9 verification, then point its stack.json entry at another live program's PID (what
    PID reuse looks like): status says DEAD, `up` starts a new verification service, and
    neither `up` nor `status` touches the other program."""
    st, path = heal_stack
    healthy(st)
    st.kill("verification")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    st.extra_pids.append(other.pid)  # type: ignore[attr-defined]
    data = json.loads((Path(st.state.home) / "stack.json").read_text())
    entry = next(p for p in data["procs"] if p["name"] == "verification")
    entry["pid"] = entry["pgid"] = other.pid  # the recorded create time stays the old service's
    (Path(st.state.home) / "stack.json").write_text(json.dumps(data))

    assert status_lines(st)["verification"] == "DEAD"
    out = veribus(st, "up")
    assert out.returncode == 0, out.stderr
    assert "restarted: verification" in out.stdout
    assert other.poll() is None, "the program that reused the PID still runs"
    new = st.proc("verification")
    assert new.pid != other.pid and new.alive()
    run_ok(st, path)
    other.kill()
    other.wait(10)


def test_up_after_nats_was_killed_brings_the_whole_stack_back(heal_stack) -> None:
    st, path = heal_stack
    healthy(st)
    old = {p.name: identity(p) for p in st.reload().procs}
    nats_port = st.proc("nats").port
    st.kill("nats")
    shown = status_lines(st)
    assert shown["nats"] == "DEAD" and shown["projector"] == "up"
    assert "stack: degraded" in veribus(st, "status").stdout  # as every other command calls it

    out = veribus(st, "up")
    assert out.returncode == 0, out.stdout + out.stderr
    state = st.reload()
    for p in state.procs:
        if p.name == "simulator":
            assert identity(p) == old["simulator"], "the live simulator is kept"
            continue
        assert identity(p) != old[p.name] and p.alive(), f"{p.name} was started again"
        assert gone(*old[p.name]), f"the old {p.name} is stopped"
    assert st.proc("nats").port == nats_port, "same NATS URL as before"
    assert stack.status(st.settings)["orphans"] == []
    # the new projector opened the chdb folder (the old one released it) and answers queries
    assert rows(st, "SELECT count() > 0 FROM verification_results FINAL") == [(1,)]
    run_ok(st, path)


def test_down_stops_everything_orphans_included(heal_stack, tmp_path: Path) -> None:
    """Orphans of two kinds: services that stack.json no longer lists (what the old `up` left
    after it deleted stack.json), and a child left in the process group of a killed stack
    process, without the stack marker in its environment. `down` stops them all."""
    st, _ = heal_stack
    healthy(st)
    home = Path(st.state.home)
    data = json.loads((home / "stack.json").read_text())
    orphaned = [p for p in data["procs"] if p["name"] in ("generation", "finalization")]
    data["procs"] = [p for p in data["procs"] if p not in orphaned]
    (home / "stack.json").write_text(json.dumps(data))

    script = ("import os, subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], env={}); "
              "open(sys.argv[1], 'w').write(str(c.pid)); time.sleep(600)")
    pidfile = tmp_path / "child.pid"
    state = stack.StackState.load(home)
    assert state is not None
    leader = processes.spawn("helper", [sys.executable, "-c", script, str(pidfile)], {**os.environ, **state.env()},
                          home / "logs")
    state.procs.append(leader)
    state.save()
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = psutil.Process(int(pidfile.read_text()))
    st.extra_pids.append(child.pid)  # type: ignore[attr-defined]
    assert os.getpgid(child.pid) == leader.pgid and processes.STACK_MARKER not in child.environ()
    processes.kill_proc(leader)

    st_status = stack.status(st.settings)
    assert sorted(st_status["orphans"]) == sorted(p["pid"] for p in orphaned)
    assert st_status["dead"] == ["helper"]
    everything = [identity(p) for p in state.procs] + [(p["pid"], p["create_time"]) for p in orphaned]
    everything.append((child.pid, child.create_time()))

    out = veribus(st, "down")
    assert out.returncode == 0, out.stderr
    assert "orphan" in out.stdout
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(gone(*x) for x in everything):
        time.sleep(0.1)
    assert all(gone(*x) for x in everything), [x for x in everything if not gone(*x)]
    assert not (home / "stack.json").exists()
    assert "not running" in veribus(st, "status").stdout
    assert list(processes.marked_processes(home)) == []
