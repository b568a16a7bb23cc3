"""Issue 9, replayed as a new user would, through the real CLI (`python -m shared.cli`) against
real nats-server processes, the real services and the embedded ClickHouse:

- a configured bus (VERIBUS_NATS_URL / --nats-url, with auth) receives the run; no temporary
  stack starts beside it; the CLI says which deployment it talks to;
- an unreachable bus: every command fails fast with one line, exit 3, no traceback;
- no silent simulator: a missing provider key is refused (exit 2) before anything is published;
  a config's explicit api_base is called as given;
- honest outcomes: all jobs in error -> exit 4 with errors grouped by stage and type; --max-errors;
  0 jobs -> exit 2 with the hint; verify() raising is counted apart; `report --quiet` says why;
- gates are checked before the run; `pass_rate>=80` is read as 0.8 and said so;
- runs by name, `veribus runs`, `regrade` naming and judge resolution;
- progress lines when piped, the temporary stack as its own step, and Ctrl-C's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.workload import VERIFY, int_template
from shared.cli.simulator_script import post_script
from shared.control import stack
from shared.control.nats_nodes import nats_server_binary
from shared.control.processes import free_port
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus, bus_auth
from shared.runtime.bus import wait_for_port
from tests.conftest import CHECKPOINTS, EXAMPLE, REPO
from tests.support.stack import up_and_down

KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "MISTRAL_API_KEY")


def write_bench(path: Path, n: int = 3, *, raising: set[int] = frozenset(), failing: set[int] = frozenset(),
                finished: bool = True, prefix: str = "Honest") -> Path:
    """N int questions; those in `raising` have a verify() that raises ZeroDivisionError, those in
    `failing` one that returns False."""
    qs = []
    for i in range(n):
        body = "return 1 / 0 == self.value" if i in raising else "return False" if i in failing else VERIFY
        qs.append({"id": f"h{i}", "question": f"{prefix} question {i}: what is {i} plus {i}?", "answer": str(2 * i),
                   "template": int_template(2 * i, body), "finished": finished})
    path.write_text(yaml.safe_dump({"name": f"{prefix.lower()}-{n}", "questions": qs}, sort_keys=False))
    return path


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in KEYS and not k.startswith("VERIBUS_NATS") and k not in ("VERIBUS_CLICKHOUSE_URL",
                                                                               "VERIBUS_SIMULATOR_URL")}
    env.update(VERIBUS_HOME=str(home), PYTHONPATH=str(REPO), VERIBUS_PROGRESS_INTERVAL_S="0", **extra)
    return env


def veribus(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


async def _stream_subjects(url: str, flt: str = "vb.>", **auth: str) -> dict[str, int]:
    from nats.js.errors import NotFoundError

    nc = await bus.connect(Settings(nats_url=url, **auth), allow_reconnect=False, max_reconnect_attempts=0)
    try:
        try:
            info = await nc.jetstream().stream_info(events.STREAM, subjects_filter=flt)
        except NotFoundError:
            return {}
        return dict(info.state.subjects or {})
    finally:
        await nc.close()


def stream_subjects(url: str, flt: str = "vb.>", **auth: str) -> dict[str, int]:
    return asyncio.run(_stream_subjects(url, flt, **auth))


def run_requested(url: str, **auth: str) -> list[str]:
    return [s for s in stream_subjects(url, **auth) if s.startswith("vb.run.requested.")]


# --------------------------------------------------------------------------------------------
# a configured bus, without services
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def listening(command: Callable[[int], list[str]], timeout: float, **popen: Any) -> Iterator[int]:
    """A process of this test's, `command(port)` on a free loopback port, once it listens; killed after."""
    port = free_port()
    proc = subprocess.Popen(command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
    try:
        wait_for_port("127.0.0.1", port, timeout)
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def auth_nats(tmp_path: Path) -> Iterator[str]:
    """A nats-server that requires a user and password (as a shared deployment would)."""
    conf = tmp_path / "auth.conf"
    conf.write_text('authorization { user: "vb", password: "s3cret-pw" }\n')
    with listening(lambda port: [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd",
                                 str(tmp_path / "store"), "-c", str(conf)], timeout=10) as port:
        yield f"nats://127.0.0.1:{port}"


def test_a_configured_bus_receives_the_run_and_no_temporary_stack_starts(nats_server, tmp_path: Path) -> None:
    home = tmp_path / "home"
    bench = write_bench(tmp_path / "b.yaml", 2)
    env = cli_env(home, VERIBUS_NATS_URL=nats_server.url)
    junit = tmp_path / "j.xml"
    out = veribus(env, "run", str(bench), "--model", "openai/m", "--judge", "openai/j", "--api-base",
                  "http://127.0.0.1:9/v1", "--timeout", "3", "--junit", str(junit))
    assert "temporary" not in out.stderr and not (home / "stack.json").exists()
    assert f"deployment: NATS {nats_server.url} (from VERIBUS_NATS_URL)" in out.stderr, out.stderr
    assert out.returncode == 3, out.stderr  # no services on this bus: results missing at --timeout
    assert "2 of 2 job(s) have no result at --timeout" in out.stdout + out.stderr
    # the JUnit file says so too: it was all green (no gate, no sample) beside exit 3
    import xml.etree.ElementTree as ET

    outcome = ET.parse(junit).getroot().find("testsuite[@name='veribus.outcome']")
    assert outcome is not None and outcome.get("failures") == "1", ET.tostring(ET.parse(junit).getroot())
    assert "2 of 2 job(s) have no result at --timeout" in outcome.find("testcase/failure").get("message")  # type: ignore[union-attr]
    assert len(run_requested(nats_server.url)) == 1
    assert sum(n for s, n in stream_subjects(nats_server.url).items() if s.startswith("vb.answer.requested.")) == 2

    flag = veribus(cli_env(home), "run", str(bench), "--nats-url", nats_server.url, "--model", "openai/m",
                   "--judge", "openai/j", "--api-base", "http://127.0.0.1:9/v1", "--timeout", "2")
    assert f"deployment: NATS {nats_server.url} (from --nats-url)" in flag.stderr, flag.stderr
    assert flag.returncode == 3 and len(run_requested(nats_server.url)) == 2


def test_nats_auth_settings_are_used_and_a_refusal_is_one_line(auth_nats: str, tmp_path: Path) -> None:
    bench = write_bench(tmp_path / "b.yaml", 1)
    args = ("run", str(bench), "--model", "openai/m", "--judge", "openai/j", "--api-base", "http://127.0.0.1:9/v1",
            "--timeout", "2")
    refused = veribus(cli_env(tmp_path / "h1", VERIBUS_NATS_URL=auth_nats), *args, timeout=60)
    assert refused.returncode == 3 and "Traceback" not in refused.stderr
    assert "refused the credentials" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    wrong = veribus(cli_env(tmp_path / "h2", VERIBUS_NATS_URL=auth_nats, VERIBUS_NATS_USER="vb",
                            VERIBUS_NATS_PASSWORD="guessed"), *args, timeout=60)
    assert wrong.returncode == 3 and "refused the credentials" in wrong.stderr
    assert "guessed" not in wrong.stderr + wrong.stdout
    ok = veribus(cli_env(tmp_path / "h3", VERIBUS_NATS_URL=auth_nats, VERIBUS_NATS_USER="vb",
                         VERIBUS_NATS_PASSWORD="s3cret-pw"), *args, timeout=60)
    assert "user vb" in ok.stderr and "s3cret-pw" not in ok.stderr + ok.stdout
    assert ok.returncode == 3  # published, no services to answer
    assert len(run_requested(auth_nats, nats_user="vb", nats_password="s3cret-pw")) == 1


COMMANDS = [
    ("run", "{bench}", "--simulate"), ("run", "{bench}", "--model", "openai/m", "--judge", "openai/m",
                                        "--api-base", "http://127.0.0.1:9/v1"),
    ("status",), ("status", "RUN"), ("query", "SELECT 1"), ("results", "RUN"), ("export", "RUN", "-o", "{tmp}/x.json"),
    ("report", "RUN"), ("compare", "RUN", "--model-a", "a", "--model-b", "b"), ("resume", "RUN"),
    ("regrade", "RUN"), ("cancel", "RUN"), ("projections", "rebuild"), ("runs",),
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_an_unreachable_bus_fails_every_command_with_one_line(argv: tuple[str, ...], tmp_path: Path) -> None:
    port = free_port()  # bound and released: nothing listens
    bench = write_bench(tmp_path / "b.yaml", 1)
    args = [a.format(bench=bench, tmp=tmp_path) for a in argv]
    env = cli_env(tmp_path / "home", VERIBUS_NATS_URL=f"nats://127.0.0.1:{port}",
                  VERIBUS_SIMULATOR_URL="http://127.0.0.1:9/v1")
    out = veribus(env, *args, timeout=60)  # a retry loop would hit this timeout
    assert out.returncode == 3, (out.returncode, out.stderr)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines == [f"veribus: error: cannot reach the NATS server at nats://127.0.0.1:{port} "
                     "(from VERIBUS_NATS_URL): connection refused"], out.stderr
    assert not (tmp_path / "home" / "stack.json").exists()


def test_a_bus_without_jetstream_is_refused_in_one_line(tmp_path: Path) -> None:
    """A reachable nats-server started without -js: the command stops at once (a standalone
    server is not waited on as a cluster electing a leader is) and says it is JetStream that is
    missing, not the server."""
    bench = write_bench(tmp_path / "b.yaml", 1)
    with listening(lambda port: [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port)], timeout=10) as port:
        out = veribus(cli_env(tmp_path / "home", VERIBUS_NATS_URL=f"nats://127.0.0.1:{port}"), "run", str(bench),
                      "--model", "openai/m", "--judge", "openai/j", "--api-base", "http://127.0.0.1:9/v1", timeout=60)
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith("deployment:")]
    assert len(lines) == 1 and f"the NATS server at nats://127.0.0.1:{port} answers but its JetStream did not " \
        in lines[0] and "start it with -js" in lines[0], out.stderr
    assert " within " not in lines[0], "a standalone server was waited on as a cluster electing a leader"


@pytest.mark.parametrize("cmd", ["resume", "cancel", "regrade"])
def test_lifecycle_commands_without_any_deployment_say_so(cmd: str, tmp_path: Path) -> None:
    out = veribus(cli_env(tmp_path / "home"), cmd, "some-run", timeout=60)
    assert out.returncode == 3 and "Traceback" not in out.stderr
    assert f"`veribus {cmd}` needs a running deployment" in out.stderr and "veribus up" in out.stderr


def test_a_missing_provider_key_is_refused_before_publishing(nats_server, tmp_path: Path) -> None:
    env = cli_env(tmp_path / "home", VERIBUS_NATS_URL=nats_server.url)
    bench = CHECKPOINTS / "multi_question.jsonld"
    out = veribus(env, "run", str(bench), "--model", "gpt-4.1-mini", "--judge", "gpt-4.1-mini", timeout=120)
    assert out.returncode == 2, out.stderr
    assert "'gpt-4.1-mini'" in out.stderr and "set OPENAI_API_KEY" in out.stderr
    assert "SIMULATED" not in out.stdout and run_requested(nats_server.url) == []
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"answering_models": [{"model_name": "m", "api_key_env": "MY_TEAM_KEY"}],
                                   "parsing_models": [{"model_name": "anthropic/claude-haiku-4-5"}]}))
    out = veribus(env, "run", str(write_bench(tmp_path / "c.yaml", 1)), "--config", str(cfg), timeout=120)
    assert out.returncode == 2 and "set MY_TEAM_KEY" in out.stderr and "set ANTHROPIC_API_KEY" in out.stderr
    assert run_requested(nats_server.url) == []
    out = veribus(env, "run", str(bench), "--model", "totally-unknown-model-xyz", "--judge",
                  "totally-unknown-model-xyz", timeout=120)  # a typo: no provider, whatever keys are set
    assert out.returncode == 2 and "'totally-unknown-model-xyz': no provider known" in out.stderr, out.stderr
    assert run_requested(nats_server.url) == []


def test_zero_jobs_and_bad_gates_are_refused_before_publishing(nats_server, tmp_path: Path) -> None:
    env = cli_env(tmp_path / "home", VERIBUS_NATS_URL=nats_server.url)
    drafts = write_bench(tmp_path / "drafts.yaml", 2, finished=False)
    out = veribus(env, "run", str(drafts), "--simulate", timeout=120)
    assert out.returncode == 2 and "0 jobs" in out.stderr and "--include-unfinished" in out.stderr
    bench = write_bench(tmp_path / "b.yaml", 1)
    for gate, why in (("acuracy>=0.8", "unknown metric 'acuracy'"), ("accuracy=>0.8", "bad operator"),
                      ("accuracy>=150", "out of range"), ("accuracy:gpt-9>=0.5", "no model 'gpt-9'")):
        out = veribus(env, "run", str(bench), "--simulate", "--gate", gate, timeout=120)
        assert out.returncode == 2 and why in out.stderr, (gate, out.stderr)
        assert "Traceback" not in out.stderr
    assert run_requested(nats_server.url) == []


# --------------------------------------------------------------------------------------------
# the whole stack
# --------------------------------------------------------------------------------------------


SERVICE_ONLY_KEY = "VB_SERVICES_TEAM_KEY"  # a provider key `up` gives the live stack's services, and no CLI has


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, stack.StackState]]:
    with up_and_down(tmp_path_factory.mktemp("honest") / "home", extra_env={SERVICE_ONLY_KEY: "sk-services"}) as both:
        yield both


def local_env(settings: Settings, **extra: str) -> dict[str, str]:
    return cli_env(settings.home, **extra)


def summary_of(out_dir: Path) -> dict:
    return json.loads((out_dir / "summary.json").read_text())


def test_all_jobs_in_error_is_exit_4_with_errors_grouped(live, tmp_path: Path) -> None:
    settings, _ = live
    env = local_env(settings)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"answering_models": [{"model_name": "openai/m", "api_base": dead, "max_retries": 1}],
                                   "parsing_models": [{"model_name": "openai/j", "api_base": dead}]}))
    out_dir = tmp_path / "out"
    out = veribus(env, "run", str(write_bench(tmp_path / "b.yaml", 3)), "--config", str(cfg), "--run-name",
                  "deadbase", "--output", str(out_dir), "--gate", "pass_rate>=80")
    assert out.returncode == 4, out.stdout + out.stderr
    assert "gate pass_rate >= 0.8 (from 'pass_rate>=80'; 80 read as 0.8 (80%))" in out.stderr
    assert f"deployment: local stack in {settings.home.resolve()}" in out.stderr
    assert "✓ PASSED" not in out.stdout and "SIMULATED" not in out.stdout
    assert "Errors by stage and type" in out.stdout
    assert "3 x generate_answer / LLMError(connection)" in out.stdout, out.stdout
    assert "Outcome: ✗ FAILED: 3 of 3 job(s) ended in error; none tolerated" in out.stdout
    body = summary_of(out_dir)
    assert body["outcome"]["exit_code"] == 4 and body["error_groups"][0]["count"] == 3
    assert body["error_groups"][0]["stage"] == "generate_answer"

    quiet = veribus(env, "report", "deadbase", "--quiet")
    assert quiet.returncode == 4 and quiet.stdout.strip().startswith("✗ FAILED: 3 of 3 job(s) ended in error")
    tolerant = veribus(env, "report", "deadbase", "--quiet", "--max-errors", "100%")
    assert tolerant.returncode == 0 and tolerant.stdout.strip() == "✓ PASSED"
    html = tmp_path / "r.html"
    veribus(env, "report", "deadbase", "--html", str(html))
    assert "Errors by stage and type" in html.read_text() and "LLMError(connection)" in html.read_text()

    # regrade of a run whose judge cannot be reached is refused before publishing
    before = run_requested(settings.nats_url, home=str(settings.home))  # the stack's cli role
    regrade = veribus(env, "regrade", "deadbase")
    assert regrade.returncode == 2 and "cannot be reached" in regrade.stderr and "openai/j" in regrade.stderr
    assert run_requested(settings.nats_url, home=str(settings.home)) == before


def test_a_config_api_base_is_called_as_given(live, tmp_path: Path) -> None:
    """The user's own OpenAI-compatible server (here: a second simulator process, the only model
    server there is offline) is what a config's explicit api_base reaches; not the stack's."""
    settings, state = live
    with own_model_server(tmp_path / "simhome") as base:
        from infra.simulator.from_benchmark import simulator_script_for
        from shared.core.benchmark.model import Benchmark

        bench = write_bench(tmp_path / "b.yaml", 2, prefix="Own")
        httpx.post(base.removesuffix("/v1") + "/simulator/script",
                   json=simulator_script_for(Benchmark.load(bench)), timeout=10).raise_for_status()
        stack_before = httpx.get(state.simulator_url.removesuffix("/v1") + "/simulator/stats", timeout=10).json()
        cfg = tmp_path / "run.yaml"
        cfg.write_text(yaml.safe_dump({"answering_models": [{"model_name": "openai/own-model", "api_base": base}],
                                       "parsing_models": [{"model_name": "openai/own-judge", "api_base": base}]}))
        out = veribus(local_env(settings), "run", str(bench), "--config", str(cfg), "--output", str(tmp_path / "o"))
        assert out.returncode == 0, out.stdout + out.stderr
        assert "SIMULATED" not in out.stdout and summary_of(tmp_path / "o")["simulated"] is False
        stats = httpx.get(base.removesuffix("/v1") + "/simulator/stats", timeout=10).json()
        assert stats["by_model"].get("own-model", stats["by_model"].get("openai/own-model")) and stats["judge"] >= 2
        stack_after = httpx.get(state.simulator_url.removesuffix("/v1") + "/simulator/stats", timeout=10).json()
        assert stack_after["requests"] == stack_before["requests"]  # the stack's simulator was not asked


def test_a_hedged_model_above_temperature_zero_is_noted_before_the_run(live, tmp_path: Path) -> None:
    """Hedging keeps the first of two replies; at temperature 0.7 that leans toward short ones, and
    `run` says so on stderr before it publishes (the run itself goes ahead: the user's trade)."""
    settings, _ = live
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"answering_models": [{"model_name": "sim-answerer", "hedge_after_s": 5,
                                                         "temperature": 0.7}],
                                   "parsing_models": [{"model_name": "sim-judge"}]}))
    out = veribus(local_env(settings), "run", str(write_bench(tmp_path / "b.yaml", 2, prefix="Hedged")), "--simulate",
                  "--config", str(cfg), "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "note: answering model 'sim-answerer' is hedged (hedge_after_s: 5.0) at temperature 0.7: " in out.stderr
    assert out.stderr.index("is hedged") < out.stderr.index("deployment: local stack"), out.stderr
    assert "judge model" not in out.stderr


def test_verify_raising_is_counted_apart_and_fails_the_run(live, tmp_path: Path) -> None:
    """h0 passes, h1's verify() returns False, h2's raises: every output counts h2 as an error
    (never a fail, never a pass) and h1 as the one fail, as the run's verdict does: `run`,
    `results`, `runs`, `status RUN` and the analyst views (shared.core.verdict)."""
    settings, _ = live
    env = local_env(settings)
    out_dir = tmp_path / "out"
    bench = write_bench(tmp_path / "b.yaml", 3, raising={2}, failing={1}, prefix="Raise")
    out = veribus(env, "run", str(bench), "--simulate", "--output", str(out_dir), "--run-name", "raise-counts")
    assert out.returncode == 4, out.stdout + out.stderr
    assert "verify() raised: 1" in out.stdout and "Failed: 1" in out.stdout and "Passed: 1" in out.stdout
    assert "verify_template / verify() raised: ZeroDivisionError" in out.stdout
    assert "1 of 3 job(s) ended in error (1 where the template's verify() raised)" in out.stdout
    assert summary_of(out_dir)["metrics"]["verify_raised"] == 1

    res = veribus(env, "results", "raise-counts")
    assert res.returncode == 0, res.stderr
    assert "3 results, 1 errors (1 where verify() raised), 1 passed, 1 failed" in res.stdout, res.stdout
    body = json.loads(veribus(env, "results", "raise-counts", "--format", "json").stdout)
    s = body["summary"]
    assert (s["num_passed"], s["num_failed"], s["num_errors"], s["num_verify_raised"]) == (1, 1, 1, 1)
    run_id = body["run_id"]

    runs = {r["run_id"]: r for r in json.loads(veribus(env, "runs", "--format", "json").stdout)}
    row = runs[run_id]
    assert (row["passed"], row["failed"], row["errors"], row["state"]) == (1, 1, 1, "done, errors"), row

    status = veribus(env, "status", "raise-counts", timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"run {run_id}: results=3, passed=1, failed=1, errors=1" in status.stdout, status.stdout
    assert "Field verification failed: ZeroDivisionError" in status.stdout  # listed among the result errors

    view = veribus(env, "query", "SELECT passed, failed, errors, verified FROM v_model_pass_rate "
                                 f"WHERE run_id = '{run_id}'", "--format", "json")
    assert view.returncode == 0, view.stderr
    assert [(r["passed"], r["failed"], r["errors"], r["verified"]) for r in json.loads(view.stdout)] == [(1, 1, 1, 3)]


def test_runs_by_name_list_and_regrade(live, tmp_path: Path) -> None:
    settings, _ = live
    env = local_env(settings)
    bench = write_bench(tmp_path / "b.yaml", 2, prefix="Named")
    first = veribus(env, "run", str(bench), "--simulate", "--run-name", "nightly")
    second = veribus(env, "run", str(bench), "--simulate", "--run-name", "nightly")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "progress: 2/2 done (100%), 2 passed, 0 failed, 0 errors" in second.stderr  # piped: plain lines
    first_id = first.stdout.split()[1].rstrip(":")
    second_id = second.stdout.split()[1].rstrip(":")

    runs = veribus(env, "runs")
    assert runs.returncode == 0, runs.stderr
    header = runs.stdout.splitlines()[0].split()
    assert header == ["run_id", "run_name", "started", "jobs", "done", "passed", "errors", "state"]
    rows = {ln.split()[0]: ln.split() for ln in runs.stdout.splitlines()[1:]}
    assert rows[second_id][1] == "nightly" and rows[second_id][-5:] == ["2", "2", "2", "0", "done"]

    res = veribus(env, "results", "nightly")
    assert res.returncode == 0 and f"run {second_id}:" in res.stdout
    assert "name 'nightly' matches 2 runs; using the most recent" in res.stderr and first_id in res.stderr
    dry = veribus(env, "resume", "nightly", "--dry-run")
    assert dry.returncode == 0 and f"run {second_id}: 2 jobs, 2 with a result" in dry.stdout

    regrade = veribus(env, "regrade", "nightly", "--timeout", "120")
    assert regrade.returncode == 0, regrade.stdout + regrade.stderr
    assert "(nightly-regrade-1): regrade of " + second_id in regrade.stdout
    again = veribus(env, "regrade", "nightly", "--timeout", "120")
    assert again.returncode == 0 and "(nightly-regrade-2)" in again.stdout
    latest = veribus(env, "results", "nightly")
    assert f"run {second_id}:" in latest.stdout  # the regrades did not take the name


def test_regrade_simulate_scripts_a_simulator_that_was_restarted(live, tmp_path: Path) -> None:
    """`regrade --simulate` against a simulator that holds no script for the run (restarted since:
    here a fresh simulator process, the one VERIBUS_SIMULATOR_URL names) posts the script of what
    it grades, as `run --simulate` does: the regrade grades as the run did. It parsed every stored
    answer with made-up values, and said "verify_result changed" for them, exit 0."""
    settings, _ = live
    env = local_env(settings)
    bench = write_bench(tmp_path / "b.yaml", 3, prefix="Rescripted")
    run = veribus(env, "run", str(bench), "--simulate", "--run-name", "rescripted")
    assert run.returncode == 0, run.stdout + run.stderr
    with own_model_server(tmp_path / "simhome") as fresh:
        before = httpx.get(fresh.removesuffix("/v1") + "/simulator/stats", timeout=10).json()
        regrade = veribus(local_env(settings, VERIBUS_SIMULATOR_URL=fresh), "regrade", "rescripted", "--simulate",
                          "--timeout", "120")
        assert regrade.returncode == 0, regrade.stdout + regrade.stderr
        assert "3/3 finalized: 3 passed, 0 error(s)" in regrade.stdout, regrade.stdout
        assert "verify_result changed for 0 of 3 job(s)" in regrade.stdout, regrade.stdout
        stats = httpx.get(fresh.removesuffix("/v1") + "/simulator/stats", timeout=10).json()
        assert stats["judge"] - before["judge"] >= 3 and stats["unmatched"] == before["unmatched"], stats


def test_regrade_simulate_keeps_the_runs_simulator_yaml(live, tmp_path: Path) -> None:
    """A run scripted by the `.simulator.yaml` beside its benchmark (the example's scripts three
    wrong answers) regraded without `--benchmark` against a simulator restarted since: the script
    made from the stored questions alone graded those answers as right, and the regrade said
    "verify_result changed for 3 of 18", exit 0, for templates that had not changed. The run keeps
    its `.simulator.yaml` in the content bucket; the regrade, and a regrade of the regrade, load it."""
    settings, _ = live
    env = local_env(settings)
    for name in ("example.yaml", "example.simulator.yaml"):
        shutil.copy(EXAMPLE.with_name(name), tmp_path / name)
    run = veribus(env, "run", str(tmp_path / "example.yaml"), "--simulate", "--run-name", "kept-script")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Passed: 15 (83.3%)" in run.stdout, run.stdout
    with own_model_server(tmp_path / "simhome") as fresh:
        sim_env = local_env(settings, VERIBUS_SIMULATOR_URL=fresh)
        for parent in ("kept-script", "kept-script-regrade-1"):
            regrade = veribus(sim_env, "regrade", parent, "--simulate", "--timeout", "120")
            assert regrade.returncode == 0, regrade.stdout + regrade.stderr
            assert "18/18 finalized: 15 passed, 0 error(s)" in regrade.stdout, regrade.stdout
            assert "verify_result changed for 0 of 18 job(s)" in regrade.stdout, regrade.stdout


def test_simulate_on_a_configured_deployment(live, tmp_path: Path) -> None:
    settings, state = live
    # another machine's CLI: the deployment's URL and the cli role's credentials file (bus roles)
    creds = str(settings.home / "auth" / "credentials.json")
    env = cli_env(tmp_path / "elsewhere", VERIBUS_NATS_URL=state.nats_url, VERIBUS_NATS_CREDENTIALS=creds,
                  VERIBUS_SIMULATOR_URL=state.simulator_url)
    out = veribus(env, "run", str(write_bench(tmp_path / "b.yaml", 2, prefix="Conf")), "--simulate")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"deployment: NATS {state.nats_url} (from VERIBUS_NATS_URL)" in out.stderr
    assert "SIMULATED" in out.stdout and "temporary" not in out.stderr
    refused = veribus(cli_env(tmp_path / "elsewhere", VERIBUS_NATS_URL=state.nats_url, VERIBUS_NATS_CREDENTIALS=creds),
                      "run", str(write_bench(tmp_path / "c.yaml", 1)), "--simulate")
    assert refused.returncode == 2 and "VERIBUS_SIMULATOR_URL" in refused.stderr


def test_a_configured_deployment_checks_keys_where_its_services_make_the_calls(live, tmp_path: Path) -> None:
    """Another machine's CLI: the provider keys that count are the deployment's services' (each
    live replica says its key *names* on the bus), not the CLI's environment. Before, the CLI
    looked in its own: a key only the services held refused the run, and a key only the CLI held
    let through a run whose every call failed. A `cli` holder cannot forge a replica's entry."""
    from infra.simulator.from_benchmark import simulator_script_for
    from shared.core.benchmark.model import Benchmark

    settings, state = live
    creds = str(settings.home / "auth" / "credentials.json")
    env = cli_env(tmp_path / "elsewhere", VERIBUS_NATS_URL=state.nats_url, VERIBUS_NATS_CREDENTIALS=creds,
                  VB_CLI_ONLY_KEY="sk-cli")
    bench = write_bench(tmp_path / "b.yaml", 2, prefix="Keys")
    post_script(state.simulator_url, simulator_script_for(Benchmark.load(bench)))

    def config(judge_key: str) -> Path:
        path = tmp_path / f"{judge_key}.yaml"
        path.write_text(yaml.safe_dump({
            "answering_models": [{"model_name": "openai/sim-answerer", "api_base": state.simulator_url,
                                  "api_key_env": SERVICE_ONLY_KEY}],
            "parsing_models": [{"model_name": "openai/sim-judge", "api_base": state.simulator_url,
                                "api_key_env": judge_key}]}))
        return path

    def runs() -> list[str]:
        return run_requested(state.nats_url, home=settings.home)

    before = runs()
    out = veribus(env, "run", str(bench), "--config", str(config("VB_CLI_ONLY_KEY")))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "refused before publishing" in out.stderr, out.stderr
    assert ("judge model 'openai/sim-judge': no API key in the deployment's parsing service, which makes its calls "
            "(1 of 1 running replica(s) lack VB_CLI_ONLY_KEY") in out.stderr, out.stderr
    # template_only: the rubric service makes no call; the answering key is the services'
    assert "rubric" not in out.stderr and SERVICE_ONLY_KEY not in out.stderr, out.stderr
    assert runs() == before

    # a `cli` holder forges a parsing replica that holds the key: the bus refuses the entry
    errors: list[str] = []

    async def forge() -> list[Any] | None:
        from shared.runtime import service_keys

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        opts = bus.connect_options(Settings(nats_url=state.nats_url, home=settings.home))
        opts.update(allow_reconnect=False, max_reconnect_attempts=0, error_cb=on_error)
        import nats

        nc = await nats.connect(**opts)
        try:
            forged = service_keys.Advert("parsing", "parsing/0.1.0@forged:1", ("VB_CLI_ONLY_KEY",))
            key = service_keys.entry_key(forged.service, forged.producer)
            await nc.publish(f"$KV.{service_keys.BUCKET}.{key}", json.dumps(
                {"service": forged.service, "producer": forged.producer, "keys": list(forged.keys)}).encode())
            await nc.publish(f"$JS.API.STREAM.PURGE.KV_{service_keys.BUCKET}", b"")
            await nc.flush()
            await asyncio.sleep(0.3)
            return await service_keys.read_adverts(nc.jetstream(timeout=2.0))
        finally:
            await nc.close()

    adverts = asyncio.run(forge())
    assert sum("permissions violation" in e for e in errors) == 2, errors
    assert adverts and {a.service for a in adverts} == {"generation", "guards", "parsing", "verification", "rubric"}
    assert all(a.keys == (SERVICE_ONLY_KEY,) and "forged" not in a.producer for a in adverts), adverts
    out = veribus(env, "run", str(bench), "--config", str(config("VB_CLI_ONLY_KEY")))
    assert out.returncode == 2 and "lack VB_CLI_ONLY_KEY" in out.stderr and runs() == before, out.stderr

    status = veribus(env, "status")
    assert status.returncode == 0, status.stderr
    assert "model-calling services (each replica says so every 30 s): generation x1, " in status.stdout, status.stdout
    assert f"keys: {SERVICE_ONLY_KEY}" in status.stdout and "sk-services" not in status.stdout, status.stdout

    # both models on the key only the services hold: the run goes through, though this CLI lacks it
    out = veribus(env, "run", str(bench), "--config", str(config(SERVICE_ONLY_KEY)))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Passed: 2 (100.0%)" in out.stdout and "SIMULATED" not in out.stdout, out.stdout
    assert len(runs()) == len(before) + 1


def test_simulator_options_a_running_deployment_does_not_take_are_said(live, tmp_path: Path) -> None:
    """--sim-error-rate / --sim-latency-ms only set up a temporary stack's simulator: against the
    running stack the run said nothing and came back clean, as if 0.9 of the calls had not
    been asked to fail."""
    settings, _ = live
    out = veribus(local_env(settings), "run", str(write_bench(tmp_path / "b.yaml", 1, prefix="Simopt")), "--simulate",
                  "--sim-error-rate", "0.9", "--sim-latency-ms", "5", "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("note: --sim-latency-ms 5.0 and --sim-error-rate 0.9 not applied: the --sim-* options set up a temporary "
            "stack's simulator, and this run goes to a running deployment") in out.stderr, out.stderr


def test_bad_outputs_empty_models_and_gates_without_data_are_refused_before_anything_runs(live, tmp_path: Path) -> None:
    """A user's report: `run --output FILE` made every model call, then `FileExistsError`, exit 3;
    `report --html DIR/` and `export --output DIR` said `IsADirectoryError`, exit 3; `--simulate
    --model ""` ran a model named `simulator:openai/`; `--gate "Clarity>=4"` in template_only mode
    ran the whole benchmark to fail the gate with no data. Each is exit 2 now, naming what is
    wrong, with no run published and nothing written."""
    settings, _ = live
    env = local_env(settings)
    afile, adir = tmp_path / "afile", tmp_path / "adir"
    afile.write_text("mine")
    adir.mkdir()
    done = veribus(env, "run", str(write_bench(tmp_path / "b.yaml", 1, prefix="Outpath")), "--simulate",
                   "--run-name", "outpaths", "--quiet")
    assert done.returncode == 0, done.stdout + done.stderr
    before = run_requested(settings.nats_url, home=str(settings.home))
    refusals = [
        (("run", str(EXAMPLE), "--simulate", "--output", str(afile)),
         f"--output {afile}: exists and is a file, where a folder is needed"),
        (("run", str(EXAMPLE), "--simulate", "--junit", str(adir)), f"--junit {adir}: is a folder, where a file is"),
        (("run", str(EXAMPLE), "--simulate", "--model", "", "--judge", " "),
         "--model: model_name must not be empty; --judge: model_name must not be empty"),
        (("run", str(EXAMPLE), "--simulate", "--gate", "Clarity>=4"),
         "gate 'Clarity>=4': 'Clarity' is a rubric trait, and rubric traits are not evaluated in template_only mode"),
        (("report", "outpaths", "--html", f"{adir}/"), f"--html {adir}/: is a folder, where a file is needed"),
        (("report", "outpaths", "--output", str(afile)), f"--output {afile}: exists and is a file"),
        (("export", "outpaths", "--format", "json", "--output", str(adir)), f"--output {adir}: is a folder"),
    ]
    for argv, says in refusals:
        out = veribus(env, *argv)
        assert out.returncode == 2, (argv, out.returncode, out.stdout, out.stderr)
        assert says in out.stderr and "Error:" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert run_requested(settings.nats_url, home=str(settings.home)) == before
    assert afile.read_text() == "mine" and list(adir.iterdir()) == []
    rubric = veribus(env, "run", str(EXAMPLE), "--simulate", "--mode", "template_and_rubric", "--gate", "Clarity>=1",
                     "--quiet")
    assert rubric.returncode in (0, 1) and "gate Clarity >= " in rubric.stderr, rubric.stderr  # it has data there


def test_num_runs_junit_holds_every_run(live, tmp_path: Path) -> None:
    """`--num-runs 2 --junit FILE` wrote each run's JUnit over the one before: the file held the
    last run only. It holds every run now, a gates and a samples testsuite per run, named as
    --output names the runs' folders (run_1, run_2) and carrying the run's id."""
    import xml.etree.ElementTree as ET

    settings, _ = live
    out_dir, junit = tmp_path / "out" / "nr", tmp_path / "out" / "j.xml"
    out = veribus(local_env(settings), "run", str(write_bench(tmp_path / "b.yaml", 2, prefix="Junit")), "--simulate",
                  "--num-runs", "2", "--output", str(out_dir), "--junit", str(junit), "--gate", "accuracy>=0.9")
    assert out.returncode == 0, out.stdout + out.stderr
    run_ids = json.loads((out_dir / "aggregate_stats.json").read_text())["run_ids"]
    assert len(set(run_ids)) == 2
    root = ET.parse(junit).getroot()
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["veribus.run_1.gates", "veribus.run_1.samples", "veribus.run_1.outcome",
                                               "veribus.run_2.gates", "veribus.run_2.samples", "veribus.run_2.outcome"]
    assert [s.find("properties/property[@name='run_id']").get("value") for s in suites] == [  # type: ignore[union-attr]
        run_ids[0], run_ids[0], run_ids[0], run_ids[1], run_ids[1], run_ids[1]]
    assert [s.get("failures") for s in suites if s.get("name").endswith(".outcome")] == ["0", "0"]  # type: ignore[union-attr]
    for gates, samples in (suites[0:2], suites[3:5]):
        assert (gates.get("tests"), gates.get("failures")) == ("1", "0")
        assert samples.get("tests") == "2" and len(samples.findall("testcase")) == 2
        assert {tc.get("name").split(" ")[0] for tc in samples.findall("testcase")} == {"h0", "h1"}  # type: ignore[union-attr]
    assert f"JUnit report of the 2 runs written to {junit}" in out.stdout


def test_ctrl_c_says_what_keeps_running(live, tmp_path: Path) -> None:
    settings, _ = live
    # a server that takes connections and never answers: every call waits (its 120 s timeout), so
    # the run is still going when it is interrupted and cancelled (a refused port made each call
    # fail at once, and on some runs all four jobs had ended in errors before the cancel)
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(64)
    silent = f"http://127.0.0.1:{hang.getsockname()[1]}/v1"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"answering_models": [{"model_name": "openai/m", "api_base": silent}],
                                   "parsing_models": [{"model_name": "openai/j", "api_base": silent}]}))
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "run", str(write_bench(tmp_path / "b.yaml", 4)),
                             "--config", str(cfg), "--run-name", "interrupted"], cwd=REPO,
                            env=local_env(settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and not line.startswith("submitted run "):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith("submitted run "), proc.stderr.read() if proc.poll() is not None else "no run line"
        run_id = line.split()[2].rstrip(";")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert f"interrupted: run {run_id} keeps running" in err and f"veribus cancel {run_id}" in err
        assert f"veribus status {run_id}" in err and "Traceback" not in err
        cancel = veribus(local_env(settings), "cancel", "interrupted")
        assert cancel.returncode == 0 and f"run {run_id}: cancelled" in cancel.stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        hang.close()  # the calls still waiting on it end now


def test_a_temporary_stack_is_its_own_step(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = veribus(cli_env(home), "run", str(EXAMPLE), "--simulate", "--timeout", "300")
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "deployment: none configured" in out.stderr
        assert "step 1/2: starting a temporary local stack" in out.stderr
        assert "temporary stack ready in" in out.stderr and "step 2/2: running" in out.stderr
        assert "SIMULATED" in out.stdout
    finally:
        stack.down(Settings(home=home))  # only if the CLI left something behind
    assert not (home / "stack.json").exists()


@contextlib.contextmanager
def own_model_server(home: Path, *args: str) -> Iterator[str]:
    """An OpenAI-compatible server of the user's own (a simulator process started apart from the
    stack, with `args`), its base URL; killed after."""
    with listening(lambda port: [sys.executable, "-m", "infra.simulator", "--host", "127.0.0.1", "--port", str(port),
                                 *args], timeout=30, cwd=REPO, env=cli_env(home)) as port:
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture
def slow_model(tmp_path: Path) -> Iterator[str]:
    """Every call takes 40 ms, so a budget can run out while a run's jobs wait for the model."""
    with own_model_server(tmp_path / "simhome", "--latency-ms", "40") as base:
        yield base


@pytest.mark.parametrize(("flag", "value", "says", "not_says"), [
    ("--max-tokens-budget", "1", "the token budget stopped the run", "--max-cost-usd"),
    ("--max-cost-usd", "0.000001", "the cost budget (--max-cost-usd) stopped the run", "--max-tokens-budget"),
])
def test_a_run_its_budget_stopped_is_not_reported_as_passed(live, slow_model: str, tmp_path: Path, flag: str,
                                                            value: str, says: str, not_says: str) -> None:
    """Issue 9 through the real CLI: every job that completes passes, but the budget stopped the
    rest before their answers: exit 4, the reason named (token or money budget), never PASSED."""
    settings, _ = live
    price = {"api_base": slow_model, "max_concurrency": 1, "input_cost_per_million_tokens": 1000.0,
             "output_cost_per_million_tokens": 1000.0}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"answering_models": [{"model_name": "openai/own-model", **price}],
                                   "parsing_models": [{"model_name": "openai/own-judge", **price}]}))
    from infra.simulator.from_benchmark import simulator_script_for
    from shared.core.benchmark.model import Benchmark

    bench = write_bench(tmp_path / "b.yaml", 30, prefix="Budgeted" + flag.strip("-").replace("-", ""))
    httpx.post(slow_model.removesuffix("/v1") + "/simulator/script", json=simulator_script_for(Benchmark.load(bench)),
               timeout=10).raise_for_status()
    out_dir = tmp_path / "out"
    out = veribus(local_env(settings), "run", str(bench), "--config", str(cfg), flag, value, "--output", str(out_dir))
    assert out.returncode == 4, out.stdout + out.stderr
    assert "✓ PASSED" not in out.stdout and "Outcome: ✗" in out.stdout, out.stdout
    assert says in out.stdout and not_says not in out.stdout.split("Outcome:", 1)[1], out.stdout
    body = summary_of(out_dir)
    assert body["outcome"]["exit_code"] == 4 and body["outcome"]["status"] == "budget_stopped", body["outcome"]
    stopped = int(out.stdout.split(says + " (", 1)[1].split(" job(s)", 1)[0])
    assert 1 <= stopped < 30, out.stdout  # the first job was dispatched; the budget stopped later ones


# --------------------------------------------------------------------------------------------
# a new user's defects: bad input is exit 2, a finished run is not "cancelled"
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", ["-1", "0"])
def test_a_timeout_that_is_not_positive_is_refused_before_publishing(nats_server, tmp_path: Path,
                                                                     timeout: str) -> None:
    """`--timeout -1` was published, timed out at once (exit 3) and left the run going."""
    env = cli_env(tmp_path / "home", VERIBUS_NATS_URL=nats_server.url)
    out = veribus(env, "run", str(write_bench(tmp_path / "b.yaml", 1)), "--simulate", "--timeout", timeout,
                  timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"argument --timeout: must be > 0 seconds, got {timeout}" in out.stderr
    assert "Traceback" not in out.stderr and run_requested(nats_server.url) == []


def test_status_of_a_run_nobody_knows_is_exit_2(live) -> None:
    """`status RUN` resolves RUN as `results`, `report` and `cancel` do: the store, then the stream."""
    settings, _ = live
    for ref in ("nosuchrun", "20990101T000000-deadbeef"):
        out = veribus(local_env(settings), "status", ref, timeout=60)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"no run {ref!r}" in out.stderr and f"run {ref}: results=" not in out.stdout
        assert "Traceback" not in out.stderr


BAD_QUERIES = ["DROP TABLE x", "INSERT INTO verification_results VALUES (1)", "CREATE TABLE x (a Int8) ENGINE = Memory",
               "SELECT 1; SELECT 2", "SELECT * FROM file('/etc/passwd')", "SELEC 1", "",
               "SELECT nosuchcol FROM verification_results", "SELECT * FROM nosuchtable"]


def test_refused_and_bad_queries_are_bad_input_not_an_unreachable_deployment(live) -> None:
    settings, _ = live
    env = local_env(settings)
    for sql in BAD_QUERIES:
        out = veribus(env, "query", sql, timeout=60)
        assert out.returncode == 2, (sql, out.returncode, out.stderr)
        assert "veribus: error: " in out.stderr and "Traceback" not in out.stderr, (sql, out.stderr)
    ok = veribus(env, "query", "SELECT 1 AS one")
    assert ok.returncode == 0 and "(1 row)" in ok.stdout, ok.stderr


def test_runs_limit_and_results_grouping_are_checked(live, tmp_path: Path) -> None:
    settings, _ = live
    env = local_env(settings)
    bench = write_bench(tmp_path / "b.yaml", 1, prefix="Limited")
    for _ in range(2):
        assert veribus(env, "run", str(bench), "--simulate", "--run-name", "limited", "--quiet").returncode == 0
    negative = veribus(env, "runs", "--limit", "-1")
    assert negative.returncode == 2 and "argument --limit: must be >= 0" in negative.stderr, negative.stderr
    assert "UInt32" not in negative.stderr
    every = veribus(env, "runs", "--limit", "0", "--format", "json")
    one = veribus(env, "runs", "--limit", "1", "--format", "json")
    assert every.returncode == 0 and one.returncode == 0, every.stderr + one.stderr
    assert len(json.loads(one.stdout)) == 1 and len(json.loads(every.stdout)) >= 2  # 0: every run, not none
    assert "no runs yet" not in every.stdout

    by = veribus(env, "results", "limited", "--by", "nosuchcol")
    assert by.returncode == 2, by.stderr
    assert "cannot group by 'nosuchcol': use one of answering_model, parsing_model" in by.stderr
    assert "KeyError" not in by.stderr
    assert veribus(env, "results", "limited", "--by", "question_id").returncode == 0


def test_cancelling_a_finished_run_says_so_and_publishes_nothing(live, tmp_path: Path) -> None:
    settings, _ = live
    env = local_env(settings)
    done = veribus(env, "run", str(write_bench(tmp_path / "b.yaml", 2, prefix="Finished")), "--simulate",
                   "--run-name", "finished-then-cancelled")
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = done.stdout.split()[1].rstrip(":")
    out = veribus(env, "cancel", "finished-then-cancelled")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"run {run_id} already finished (2/2 results): nothing to cancel", out.stdout
    assert stream_subjects(settings.nats_url, f"vb.run.cancelled.{run_id}.>", home=str(settings.home)) == {}
    runs = {r["run_id"]: r for r in json.loads(veribus(env, "runs", "--format", "json").stdout)}
    assert runs[run_id]["state"] == "done"


def test_cancel_tells_a_finished_run_from_one_a_resume_runs_again(nats_server) -> None:
    """`cancel` publishes nothing once every job has its result, unless a resume lifted a stop and
    is running stopped jobs again (their newest result is the stopped one, older than the lift)."""
    from shared.control import lifecycle

    settings = Settings(nats_url=nats_server.url)
    stopped_error = "generate_answer: RunCancelled: the run was cancelled"

    async def publish(run_id: str, *items: tuple[str, str, Any], key: str = "") -> None:
        async with bus.session(settings) as nc:
            js = nc.jetstream()
            await bus.ensure_stream(js)
            for event_type, rid, payload in items:
                await bus.publish(js, events.make_envelope(event_type, run_id, rid, payload, "test", attempt_key=key))

    def requested(run_id: str) -> tuple[str, str, Any]:
        return (events.RUN_REQUESTED, events.RUN_KEY,
                events.RunRequested(run_id=run_id, timestamp="2026-01-01T00:00:00", job_count=2, answer_count=2))

    def final(rid: str, error: str | None = None) -> tuple[str, str, Any]:
        return (events.RESULT_FINALIZED, rid,
                events.ResultFinalized(result={"metadata": {"result_id": rid, "error": error}}))

    def control(cancelled: bool) -> tuple[str, str, Any]:
        return (events.RUN_CANCELLED, events.RUN_KEY,
                events.RunControlChange(cancelled=cancelled, reason="test", at=time.time()))

    def cancel(run_id: str) -> lifecycle.CancelOutcome:
        return asyncio.run(lifecycle.cancel(settings, run_id))

    def controls(run_id: str) -> int:
        return sum(stream_subjects(nats_server.url, f"vb.run.cancelled.{run_id}.>").values())

    asyncio.run(publish("done", requested("done"), final("d1"), final("d2")))
    out = cancel("done")
    assert out.already_finished and out.finalized == 2 and controls("done") == 0

    asyncio.run(publish("half", requested("half"), final("h1")))
    out = cancel("half")
    assert not out.already_finished and controls("half") == 1

    # cancelled, its last job finalized as cancelled: over; a resume lifts the stop: running again
    asyncio.run(publish("res", requested("res"), final("r1"), control(True), final("r2", stopped_error)))
    assert cancel("res").already_finished and controls("res") == 1
    asyncio.run(publish("res", control(False), key="lift"))
    out = cancel("res")
    assert not out.already_finished and controls("res") == 3  # the lift, and this cancel

    # ... and once the resumed job has a result newer than the lift, it is over again
    asyncio.run(publish("res2", requested("res2"), final("s1"), control(True), final("s2", stopped_error)))
    asyncio.run(publish("res2", control(False), key="lift"))
    asyncio.run(publish("res2", final("s2"), key="resume-1"))
    assert cancel("res2").already_finished and controls("res2") == 2


def test_a_server_on_permissions_from_before_per_role_inboxes_is_named_as_such(tmp_path: Path) -> None:
    """After an upgrade, a nats-server still running the roles' old permissions (every role's
    replies on `_INBOX.>`) refuses this version's reply inboxes, so it answers nothing: the
    command says that, and how to fix it, instead of blaming JetStream."""
    home = tmp_path / "home"
    conf = bus_auth.generate(home)
    conf.write_text(re.sub(r'"_INBOX_[a-z]+\.>"', '"_INBOX.>"', conf.read_text()))  # the old permissions
    with listening(lambda port: [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd",
                                 str(tmp_path / "store"), "-c", str(conf)], timeout=10) as port:
        out = veribus(cli_env(home, VERIBUS_NATS_URL=f"nats://127.0.0.1:{port}"), "status", timeout=60)
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr
    error = [ln for ln in out.stderr.splitlines() if ln.startswith("veribus: error:")]
    assert len(error) == 1, out.stderr
    assert f"the NATS server at nats://127.0.0.1:{port} refused the reply inboxes of bus role 'cli' (_INBOX_cli.>)" \
        in error[0] and "nats-auth.conf" in error[0] and "JetStream" not in error[0], out.stderr


def test_resume_refuses_a_model_whose_key_the_services_lack_and_publishes_nothing(nats_server) -> None:
    """`resume` runs model calls again, in the services: a key they were started without is
    refused before anything is published, as `run` refuses it (every job errored after five
    retries as a provider outage before), and `--dry-run` says the same."""
    from shared.control import lifecycle
    from shared.control.streams import LifecycleError

    settings = Settings(nats_url=nats_server.url)
    run_id = "keyless"
    config = {"answering_models": [{"model_name": "gpt-4.1-mini"}],
              "parsing_models": [{"model_name": "openai/judge", "api_key_env": "MY_JUDGE_KEY"}]}
    job = events.Job(run_id=run_id, result_id="r1", answer_id="a1", question_id="q1", question_text="2+2?",
                     answering=events.ModelSpec(model_name="gpt-4.1-mini"),
                     parsing=events.ModelSpec(model_name="openai/judge", api_key_env="MY_JUDGE_KEY"),
                     timestamp="2026-01-01T00:00:00")

    async def publish() -> None:
        async with bus.session(settings) as nc:
            js = nc.jetstream()
            await bus.ensure_stream(js)
            run = events.RunRequested(run_id=run_id, timestamp=job.timestamp, job_count=1, answer_count=1, config=config)
            await bus.publish(js, events.make_envelope(events.RUN_REQUESTED, run_id, events.RUN_KEY, run, "test"))
            await bus.publish(js, events.make_envelope(events.ANSWER_REQUESTED, run_id, "a1",
                                                       events.AnswerRequested(jobs=[job]), "test"))

    def published() -> int:
        return sum(n for subject, n in stream_subjects(nats_server.url).items() if f".{run_id}." in subject)

    asyncio.run(publish())
    before = published()
    assert before == 2
    services = {"PATH": "/usr/bin", "OPENAI_API_KEY": "sk-up"}  # what `up` gave the services: no MY_JUDGE_KEY
    with pytest.raises(LifecycleError) as refused:
        asyncio.run(lifecycle.resume(settings, run_id, force=True, services_environ=services))
    said = str(refused.value)
    assert said.startswith("refused before publishing:") and "judge model 'openai/judge'" in said, said
    assert "set MY_JUDGE_KEY where `veribus up` runs" in said and "gpt-4.1-mini" not in said, said
    assert published() == before  # no answer request, no lift
    plan = asyncio.run(lifecycle.plan_resume(settings, run_id))
    assert lifecycle.resume_key_problems(plan, services) == [said.split("\n  ", 1)[1]]
    # a configured deployment: its replicas' key names decide, this process's environment does not
    from shared.runtime.service_keys import Advert

    adverts = [Advert("generation", "generation/0.1.0@g:1", ("OPENAI_API_KEY",)),
               Advert("parsing", "parsing/0.1.0@p:1", ("OPENAI_API_KEY",))]
    with pytest.raises(LifecycleError) as refused:
        asyncio.run(lifecycle.resume(settings, run_id, force=True, adverts=adverts,
                                     services_environ={"MY_JUDGE_KEY": "here, not there"}))
    assert "judge model 'openai/judge': no API key in the deployment's parsing service" in str(refused.value)
    assert "lack MY_JUDGE_KEY: parsing/0.1.0@p:1" in str(refused.value) and published() == before
    done = asyncio.run(lifecycle.resume(settings, run_id, force=True, services_environ={**services, "MY_JUDGE_KEY": "k"}))
    assert done.jobs == 1 and published() == before + 1
