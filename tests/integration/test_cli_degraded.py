"""A local stack that lost part of itself, through the real CLI (`python -m shared.cli`) against real
nats-server processes, the real services and the embedded ClickHouse:

- its nats-server dead, the rest running: every command names the degraded stack and what to do
  (exit 3); none treats it as "no stack" (no raw chdb lock error), and `run` never starts a
  temporary stack over it (the surviving services keep running);
- its projector dead during a run: `run` does not print PASSED (nor an error line beside one), it
  says its streamed results passed and their rows are not stored (exit 3); `results`, `status`,
  `runs` say what ClickHouse lacks (exit 3); reads are not labelled "via the projector".

Every process is started by `up_and_down` and stopped by it (by PID)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from shared.control import processes, stack
from shared.store.reads import run_query
from tests.conftest import EXAMPLE, REPO
from tests.integration.test_honest_cli import cli_env, veribus, write_bench
from tests.support.stack import up_and_down


def test_a_degraded_stack_is_named_and_never_replaced(tmp_path: Path) -> None:
    with up_and_down(tmp_path / "home") as (settings, state):
        env = cli_env(settings.home)
        first = veribus(env, "run", str(write_bench(tmp_path / "b.yaml", 1, prefix="Degraded")), "--simulate",
                        "--run-name", "before")
        assert first.returncode == 0, first.stdout + first.stderr
        nats = stack.proc_named(state, "nats")
        processes.kill_proc(nats)
        survivors = [p for p in state.procs if p.name != "nats"]
        assert all(p.alive() for p in survivors)
        stack_json = (settings.home / "stack.json").read_text()

        for argv in (("runs",), ("query", "SELECT 1"), ("results", "before"), ("status", "before"),
                     ("report", "before"), ("cancel", "before"), ("run", str(EXAMPLE), "--simulate")):
            out = veribus(env, *argv, timeout=120)
            assert out.returncode == 3, (argv, out.returncode, out.stdout + out.stderr)
            text = out.stdout + out.stderr
            assert f"the local stack in {settings.home.resolve()} is degraded (nats DEAD; still running: " in text, \
                (argv, text)
            assert "veribus up" in text and "veribus down" in text, (argv, text)
            assert "no local stack running" not in text and "Cannot lock file" not in text, (argv, text)
            assert "temporary" not in text and "Traceback" not in text, (argv, text)
        # nothing replaced the stack: the same processes run, stack.json is the user's
        assert all(p.alive() for p in survivors), [p.name for p in survivors if not p.alive()]
        assert (settings.home / "stack.json").read_text() == stack_json
        status = veribus(env, "status")
        assert status.returncode == 0 and "nats             pid" in status.stdout and "DEAD" in status.stdout

        healed = veribus(env, "up")  # what the message says to do
        assert healed.returncode == 0, healed.stderr
        again = veribus(env, "results", "before")
        assert again.returncode == 0, again.stdout + again.stderr


def _projector_pid(home: Path) -> int:
    return stack.proc_named(stack.StackState.load(home), "projector").pid


def test_a_dead_projector_is_never_reported_as_success(tmp_path: Path) -> None:
    with up_and_down(tmp_path / "home") as (settings, state):
        env = cli_env(settings.home)
        before = veribus(env, "run", str(write_bench(tmp_path / "a.yaml", 2, prefix="Stored")), "--simulate",
                         "--run-name", "stored")
        assert before.returncode == 0, before.stdout + before.stderr

        # a run whose projector dies once its run row and first results are in ClickHouse
        bench = write_bench(tmp_path / "b.yaml", 30, prefix="Orphaned")
        out_dir = tmp_path / "out"
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "run", str(bench), "--simulate", "--replicates",
                                 "20", "--run-name", "orphaned", "--output", str(out_dir)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                rows = run_query(settings, "SELECT count() FROM verification_results FINAL WHERE run_name = 'orphaned'")
                if int(rows.rows[0][0]) > 0:
                    break
                time.sleep(0.1)
            psutil.Process(_projector_pid(settings.home)).kill()
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        assert proc.returncode == 3, stdout + stderr
        assert "✓ PASSED" not in stdout and "veribus: error" not in stderr, stdout + stderr
        outcome = stdout.split("Outcome: ", 1)[1].splitlines()[0]
        assert outcome.startswith("✗ FAILED: results not stored: on its 600 results from the event stream the run "
                                  "passed (every job completed, every gate passed), but "), outcome
        assert "the local stack's projector is DEAD" in outcome and outcome.endswith("(exit 3)"), outcome
        summary = json.loads((out_dir / "summary.json").read_text())
        assert summary["outcome"]["exit_code"] == 3 and summary["outcome"]["status"] == "not_stored"

        results = veribus(env, "results", "orphaned")
        assert results.returncode == 3, results.stdout + results.stderr
        assert "results, 0 errors" in results.stdout  # what ClickHouse has is shown ...
        assert "of the 600 finalized results of run" in results.stderr  # ... and what it lacks is said
        assert "the local stack's projector is DEAD" in results.stderr
        assert "(via the projector)" not in results.stderr and "the stack's projector is DEAD" in results.stderr
        status = veribus(env, "status", "orphaned")
        assert status.returncode == 3 and "of the 600 finalized results" in status.stderr, status.stderr
        runs = veribus(env, "runs")
        assert runs.returncode == 3 and "projector is DEAD" in runs.stderr, runs.stderr
        query = veribus(env, "query", "SELECT count() FROM verification_results")
        assert query.returncode == 3 and "(via the projector)" not in query.stderr, query.stderr
        # a run ClickHouse holds whole is read as before: nothing to warn about
        complete = veribus(env, "results", "stored")
        assert complete.returncode == 0, complete.stdout + complete.stderr

        # a run the projector never saw: in the stream only
        missing = veribus(env, "run", str(write_bench(tmp_path / "c.yaml", 2, prefix="Unseen")), "--simulate",
                          "--run-name", "unseen", "--quiet")
        assert missing.returncode == 3 and missing.stdout.startswith("✗ FAILED: results not stored"), missing.stdout
        for cmd in ("results", "report", "status"):
            out = veribus(env, cmd, "unseen")
            assert out.returncode == 3, (cmd, out.stdout + out.stderr)
            assert "is in the event stream but not in ClickHouse yet" in out.stderr, (cmd, out.stderr)
            assert "no run 'unseen'" not in out.stderr


def test_losing_the_bus_while_following_a_run_ends_it_at_once_naming_the_server(tmp_path: Path) -> None:
    """nats-server dies while `run` follows a slow run: within seconds (not at --timeout, not
    after retrying every read for its own timeout) `run` says it lost the server, names it and
    the command to read the run later, exit 3, without a traceback."""
    with up_and_down(tmp_path / "home", simulator_args=["--latency-ms", "1500"]) as (settings, state):
        env = cli_env(settings.home)
        bench = write_bench(tmp_path / "slow.yaml", 20, prefix="Lost")
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "run", str(bench), "--simulate",
                                 "--replicates", "5", "--timeout", "120"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not stack.StackState.load(settings.home).procs:
                time.sleep(0.2)
            time.sleep(4.0)  # submitted and following (the first answers take 1.5 s)
            assert proc.poll() is None, proc.communicate()
            processes.kill_proc(stack.proc_named(state, "nats"))
            out, errs = proc.communicate(timeout=90)  # well before --timeout 120 would end it
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert proc.returncode == 3, out + errs
        assert f"lost the NATS server at {settings.nats_url}" in errs and "Traceback" not in errs, errs
        assert "veribus status" in errs


def test_a_service_that_dies_while_a_run_is_followed_is_named_and_up_brings_it_back(tmp_path: Path) -> None:
    """parsing is killed once `run` follows its run: stderr names it (DEAD, its PID, what waits,
    `veribus up`) once, and on the progress line; `veribus up`, as it says, restarts it, a note
    says it runs again, and the run completes (exit 0)."""
    import threading

    with up_and_down(tmp_path / "home", simulator_args=["--latency-ms", "1500"],
                     extra_env={"VERIBUS_CONSUMER_ACK_WAIT_S": "5"}) as (settings, state):
        env = cli_env(settings.home)
        bench = write_bench(tmp_path / "watched.yaml", 10, prefix="Watched")
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "run", str(bench), "--simulate",
                                 "--replicates", "2", "--timeout", "240"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out: list[str] = []
        err: list[str] = []
        readers = [threading.Thread(target=lambda f=f, into=into: into.extend(f), daemon=True)
                   for f, into in ((proc.stdout, out), (proc.stderr, err))]
        for t in readers:
            t.start()

        def wait_for(lines: list[str], text: str) -> None:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and proc.poll() is None and not any(text in ln for ln in lines):
                time.sleep(0.05)
            assert any(text in ln for ln in lines), (text, "".join(out), "".join(err))

        parsing = stack.proc_named(state, "parsing")
        try:
            wait_for(out, "submitted run")  # following; the first answers take 1.5 s to reach parsing
            processes.kill_proc(parsing)
            wait_for(err, "warning: the local stack's parsing is DEAD")
            healed = veribus(env, "up")  # what the warning says to do
            assert healed.returncode == 0, healed.stdout + healed.stderr
            proc.wait(timeout=200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for t in readers:
                t.join(10)
        stderr = "".join(err)
        assert proc.returncode == 0, "".join(out) + stderr
        warned = [ln for ln in err if "is DEAD" in ln and ln.startswith("warning:")]
        assert warned == [f"warning: the local stack's parsing is DEAD (pid {parsing.pid} exited): the run's jobs "
                          "wait for it at that stage; `veribus up` restarts it\n"], stderr
        assert any(ln.startswith("progress: ") and ln.rstrip().endswith(", DEAD: parsing") for ln in err), stderr
        assert "note: the local stack's parsing is running again\n" in err, stderr
        assert "Traceback" not in stderr and "✓ PASSED" in "".join(out)
