"""Invariant 7 (secrets): an API key given through `api_key_env` never appears in events (the
whole JetStream store directory), logs, ClickHouse rows or exports; NATS user/password and token
auth are configurable end to end; the projector's query endpoint refuses every write.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import psutil
import pytest
import yaml

from shared.analysis.export import export_run
from shared.control import nats_nodes, processes, stack
from shared.core import events
from shared.core.config import ModelConfig, Settings, VerificationConfig
from shared.runtime import bus
from shared.store.reads import run_query
from tests.conftest import REPO
from tests.support.stack import (
    Stack,
    generated_benchmark,
    plan_and_submit,
    results_of,
    start_stack,
    stop_stack,
    sync,
    wait_projected,
    wait_projector_idle,
    wait_results,
)

SECRET = "sk-veribus-FAKE-" + os.urandom(12).hex()  # never a real key
PARAM_SECRET = "sk-veribus-PARAM-" + os.urandom(12).hex()
KEY_VAR = "VB_TEST_FAKE_API_KEY"
DEAD_PORT = processes.free_port()  # nothing listens there; the operator allows the key to be sent to it
DEAD_BASE = f"http://127.0.0.1:{DEAD_PORT}/v1"

ENV_DUMP_VERIFY = '''from karenina.schemas.entities import BaseAnswer
from pydantic import Field

class Answer(BaseAnswer):
    value: int = Field(description="The number asked for")

    def model_post_init(self, __context):
        self.correct = {"value": 0}

    def verify(self) -> bool:
        import os
        raise RuntimeError("sandbox environment: " + repr(sorted(os.environ.items())))
'''


@pytest.fixture(scope="module")
def sstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("secrets") / "home"
    st = start_stack(home, extra_env={KEY_VAR: SECRET, "VERIBUS_ENDPOINTS": f"{DEAD_BASE}={KEY_VAR}"})
    try:
        yield st
    finally:
        stop_stack(st)


@pytest.fixture(scope="module")
def secret_runs(sstack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A `veribus run` (CLI, simulated models that authenticate with the key from the
    environment), a run whose model is unreachable (errors that could quote the key), and
    exports of both."""
    tmp = tmp_path_factory.mktemp("secret-run")
    path, script = generated_benchmark(tmp / "bench.yaml", 6, prefix="Secret")
    doc = yaml.safe_load(path.read_text())
    doc["questions"].append({"id": "env-dump", "question": "Secret question env: what is 0 plus 0?", "answer": "0",
                             "template": ENV_DUMP_VERIFY})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp / "bench.simulator.yaml").write_text(yaml.safe_dump(
        {"questions": [*script["questions"], {"match": "Secret question env", "answer": "0", "parsed": {"value": 0},
                                              "judge": {"Clarity": True}}]}))
    cfg = tmp / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "answering_models": [{"model_name": "sim-answerer", "api_key_env": KEY_VAR}],
        "parsing_models": [{"model_name": "sim-judge", "api_key_env": KEY_VAR}],
        "evaluation_mode": "template_and_rubric",
    }))
    env = {**os.environ, "VERIBUS_HOME": str(sstack.settings.home), KEY_VAR: SECRET}
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        env.pop(var, None)
    out_dir = tmp / "out"
    proc = subprocess.run([sys.executable, "-m", "shared.cli", "run", str(path), "--simulate", "--config", str(cfg),
                           "--run-name", "secrets", "--output", str(out_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert "Traceback" not in proc.stderr, proc.stderr
    run_id = next((line.split()[1].rstrip(":") for line in proc.stdout.splitlines()
                   if line.startswith("run ") and " jobs " in line), None)
    if run_id is None:  # the output format changed: find the run by its name
        run_id = run_query(sstack.settings, "SELECT run_id FROM runs FINAL WHERE run_name = 'secrets'").rows[0][0]
    wait_results(sstack, run_id, 7)
    # a model at a dead address, authenticating with the same key: its errors are recorded
    dead = ModelConfig(model_name="openai/dead", api_base=DEAD_BASE,
                       api_key_env=KEY_VAR, max_retries=1, timeout=2)
    config = VerificationConfig(answering_models=[dead], parsing_models=[dead])
    small, _ = generated_benchmark(tmp / "small.yaml", 2, rubric=False, prefix="Deadsecret")
    plan = plan_and_submit(sstack, small, config)
    wait_results(sstack, plan.run_id, 2)
    wait_projected(sstack, run_id, 7)
    wait_projected(sstack, plan.run_id, 2)
    wait_projector_idle(sstack)
    exports = []
    for rid in (run_id, plan.run_id):
        for fmt in ("json", "jsonl", "csv"):
            exports.append(Path(export_run(sstack.settings, rid, fmt, tmp / "export" / f"{rid}.{fmt}").path))
    return {"run_id": run_id, "dead_run_id": plan.run_id, "cli": proc, "out_dir": out_dir, "exports": exports}


def _files_containing(root: Path, needle: bytes) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file():
            try:
                if needle in p.read_bytes():
                    hits.append(str(p))
            except OSError:
                pass
    return hits


def _tables_containing(st: Stack, needle: str) -> dict[str, int]:
    """Rows of each table with the needle in any column (every column as text)."""
    hits = {}
    for table in ("events", "verification_results", "runs"):
        cols = [r[0] for r in run_query(st.settings, f"DESCRIBE TABLE {table}").rows]
        cond = " OR ".join(f"position(toString({c}), {{s:String}}) > 0" for c in cols)
        hits[table] = int(run_query(st.settings, f"SELECT count() FROM {table} WHERE {cond}", {"s": needle}).rows[0][0])
    return hits


def _all_rows_text(st: Stack, table: str, page: int = 25) -> Iterator[str]:
    """`SELECT *` of a table, page by page, every row as text."""
    n = int(run_query(st.settings, f"SELECT count() FROM {table}").rows[0][0])
    for offset in range(0, n, page):
        for row in run_query(st.settings, f"SELECT * FROM {table} ORDER BY tuple() LIMIT {page} OFFSET {offset}").rows:
            yield repr(row)


def test_the_key_was_used(sstack: Stack, secret_runs: dict[str, Any]) -> None:
    """The services had the key and the run authenticated with it (else this test proves nothing)."""
    env = psutil.Process(sstack.proc("generation").pid).environ()
    assert env.get(KEY_VAR) == SECRET
    # exit 4: the hostile env-dump template's verify() raised, which is counted as a job in error
    assert secret_runs["cli"].returncode == 4, secret_runs["cli"].stderr
    assert "verify() raised: 1" in secret_runs["cli"].stdout
    res = results_of(sstack, secret_runs["run_id"])
    ok = [r for r in res.values() if r.metadata.question_id != "env-dump"]
    assert len(ok) == 6 and all(r.metadata.completed_without_errors for r in ok)
    dump = next(r for r in res.values() if r.metadata.question_id == "env-dump")
    assert "sandbox environment" in (dump.template.field_verification_error or "")
    dead = results_of(sstack, secret_runs["dead_run_id"])
    assert all("connection" in (r.metadata.error or "") for r in dead.values())


def test_key_is_in_no_event_log_row_or_export(sstack: Stack, secret_runs: dict[str, Any]) -> None:
    home = Path(sstack.settings.home)
    needle = SECRET.encode()
    assert _files_containing(home / "nats", needle) == [], "the key is in the JetStream store"
    assert _files_containing(home / "logs", needle) == [], "the key is in a log"
    assert _tables_containing(sstack, SECRET) == {"events": 0, "verification_results": 0, "runs": 0}
    for table in ("events", "verification_results", "runs"):
        assert not any(SECRET in row for row in _all_rows_text(sstack, table)), table
    for f in [*secret_runs["exports"], *Path(secret_runs["out_dir"]).rglob("*")]:
        if Path(f).is_file():
            assert needle not in Path(f).read_bytes(), f
    cli = secret_runs["cli"]
    assert SECRET not in cli.stdout and SECRET not in cli.stderr
    # the store and tables are not empty: the search had something to search
    assert _tables_containing(sstack, secret_runs["run_id"])["events"] > 20


def test_key_in_model_params_is_refused(sstack: Stack) -> None:
    """params travel in every event, so a key-like param is refused before anything is planned."""
    with pytest.raises(ValueError, match="api_key_env") as err:
        ModelConfig(model_name="openai/sim-answerer", api_base=sstack.state.simulator_url,
                    params={"api_key": PARAM_SECRET})
    assert PARAM_SECRET not in str(err.value)


# ------------------------------------------------------------------------ the query endpoint

WRITES = [
    "INSERT INTO events (event_id) VALUES ('x')",
    "DROP TABLE events",
    "TRUNCATE TABLE verification_results",
    "ALTER TABLE runs DELETE WHERE 1",
    "CREATE TABLE pwned (x UInt8) ENGINE = Memory",
    "OPTIMIZE TABLE events FINAL",
    "SYSTEM DROP MARK CACHE",
    "SET readonly = 0",
    "SELECT 1; DROP TABLE events",
    "SELECT count() FROM events SETTINGS readonly = 0",
    "SELECT * FROM file('/etc/passwd')",
    "SELECT * FROM url('http://127.0.0.1:9/x', CSV, 'a String')",
    "INSERT INTO FUNCTION file('/tmp/veribus-pwned.csv') SELECT 1",
    "SELECT * FROM events INTO OUTFILE '/tmp/veribus-pwned.tsv'",
    "WITH 1 AS x DELETE FROM events WHERE 1",
    "/* hi */ DETACH TABLE events",
]


def test_query_endpoint_refuses_writes(sstack: Stack, secret_runs: dict[str, Any]) -> None:
    """Raw requests on the query subject (not through the client-side check) are refused."""
    before = {t: int(run_query(sstack.settings, f"SELECT count() FROM {t}").rows[0][0])
              for t in ("events", "verification_results", "runs")}

    async def ask_all() -> list[dict[str, Any]]:
        nc = await bus.connect(sstack.settings)
        try:
            out = []
            for sql in WRITES:
                msg = await nc.request(events.QUERY_SUBJECT, msgspec.json.encode({"sql": sql}), timeout=10)
                out.append(msgspec.json.decode(msg.data))
            return out
        finally:
            await nc.close()

    replies = sync(ask_all())
    for sql, reply in zip(WRITES, replies, strict=True):
        assert "error" in reply and reply.get("rows") is None, (sql, reply)
    after = {t: int(run_query(sstack.settings, f"SELECT count() FROM {t}").rows[0][0]) for t in before}
    assert after == before
    assert not Path("/tmp/veribus-pwned.csv").exists() and not Path("/tmp/veribus-pwned.tsv").exists()
    tables = {r[0] for r in run_query(sstack.settings, "SHOW TABLES").rows}
    assert {"events", "verification_results", "runs"} <= tables and "pwned" not in tables


# ------------------------------------------------------------------------ NATS authentication


def _spawn_nats(port: int, store: Path, log_dir: Path, *auth: str) -> processes.Proc:
    cmd = [str(nats_nodes.nats_server_binary()), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store), *auth]
    return processes.spawn("nats", cmd, dict(os.environ), log_dir)


@pytest.fixture
def auth_stack(tmp_path: Path) -> Iterator[tuple[Settings, stack.StackState]]:
    """nats-server with --user/--pass, the simulator and every service started with the
    credentials in VERIBUS_NATS_USER / VERIBUS_NATS_PASSWORD (stopped by PID in teardown)."""
    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True)
    port = processes.free_port()
    user, password = "veribus", "pw-" + os.urandom(8).hex()
    procs = [_spawn_nats(port, home / "nats", home / "logs", "--user", user, "--pass", password)]
    state = stack.StackState(home=str(home), nats_url=f"nats://127.0.0.1:{port}", simulator_url=None, procs=procs,
                             started_at=time.time())
    state.save()
    settings = Settings(home=home, nats_url=state.nats_url, nats_user=user, nats_password=password)
    try:
        bus.wait_for_port("127.0.0.1", port)
        sport = processes.free_port()
        procs.append(processes.spawn("simulator", [sys.executable, "-m", "infra.simulator", "--host", "127.0.0.1",
                                                "--port", str(sport)], dict(os.environ), home / "logs"))
        state.simulator_url = f"http://127.0.0.1:{sport}/v1"
        bus.wait_for_port("127.0.0.1", sport, 20)
        env = {**os.environ, **state.env(), "VERIBUS_NATS_USER": user, "VERIBUS_NATS_PASSWORD": password}
        for name in stack.SERVICES:
            procs.append(processes.spawn(name, [sys.executable, "-m", f"services.{name}"], env, home / "logs"))
        state.save()
        stack.wait_ready(state)
        yield settings, state
    finally:
        stack.down(Settings(home=home))
        for p in procs:
            if p.alive():
                os.kill(p.pid, 9)
            try:
                psutil.Process(p.pid).wait(10)  # reap (these are children of this process)
            except psutil.Error:
                pass




def test_stack_against_nats_with_user_and_password(auth_stack, tmp_path: Path) -> None:
    settings, state = auth_stack
    # without (or with wrong) credentials the server refuses the connection
    for creds in ({}, {"user": settings.nats_user, "password": "wrong"}):
        with pytest.raises(Exception):  # noqa: B017 - nats-py raises its own error types here
            sync(nats.connect(state.nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                              **creds))
    st = Stack(settings, state, {})
    path, script = generated_benchmark(tmp_path / "auth.yaml", 5, prefix="Authenticated")
    st.post_script(script)
    plan = plan_and_submit(st, path, st.config())
    wait_results(st, plan.run_id, 5, timeout=60)
    assert all(r.metadata.completed_without_errors for r in results_of(st, plan.run_id).values())
    wait_projected(st, plan.run_id, 5)  # the projector (and its query endpoint) authenticated too
    logs = Path(settings.home) / "logs"
    assert _files_containing(logs, settings.nats_password.encode()) == []
    assert _files_containing(Path(settings.home) / "nats", settings.nats_password.encode()) == []


def test_token_auth(tmp_path: Path) -> None:
    port = processes.free_port()
    token = "tok-" + os.urandom(8).hex()
    (tmp_path / "logs").mkdir()
    proc = _spawn_nats(port, tmp_path / "nats", tmp_path / "logs", "--auth", token)
    try:
        bus.wait_for_port("127.0.0.1", port)
        url = f"nats://127.0.0.1:{port}"

        async def roundtrip(settings: Settings) -> bool:
            nc = await bus.connect(settings, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
            try:
                js = nc.jetstream()
                await bus.ensure_stream(js)
                env = events.make_envelope(events.RUN_REQUESTED, "tok-run", events.RUN_KEY,
                                           events.RunRequested(run_id="tok-run", timestamp="t", job_count=0,
                                                               answer_count=0), "test")
                await bus.publish(js, env)
                return (await bus.last_event(js, env.subject)) is not None
            finally:
                await nc.close()

        assert sync(roundtrip(Settings(nats_url=url, nats_token=token)))
        with pytest.raises(Exception):  # noqa: B017
            sync(roundtrip(Settings(nats_url=url)))
        with pytest.raises(Exception):  # noqa: B017
            sync(roundtrip(Settings(nats_url=url, nats_token="not-the-token")))
    finally:
        os.kill(proc.pid, 9)
        psutil.Process(proc.pid).wait(10)  # reaps our child



@pytest.mark.parametrize("kind", ["user", "token"])
def test_the_node_config_makes_the_local_server_require_the_credentials(tmp_path: Path, kind: str) -> None:
    """`nats_nodes.write_nats_configs` (what `up` writes, with `nats_auth_block`): a configured
    user/password or token is actually enforced by the local server (without it the server
    accepts anyone), and the secret is in a 0600 file, never on the command line."""
    secret = "s-" + os.urandom(8).hex()
    settings = (Settings(nats_user="veribus", nats_password=secret) if kind == "user"
                else Settings(nats_token=secret))
    port = processes.free_port()
    node = nats_nodes.NatsNode("nats", port, processes.free_port(), tmp_path / "nats")
    conf = nats_nodes.write_nats_configs(settings, tmp_path, [node])["nats"]
    cmd = [str(nats_nodes.nats_server_binary()), "-c", str(conf)]  # the config names the port and store
    assert oct(conf.stat().st_mode & 0o777) == "0o600"
    assert secret not in " ".join(cmd)
    (tmp_path / "logs").mkdir()
    proc = processes.spawn("nats", cmd, dict(os.environ), tmp_path / "logs")
    try:
        bus.wait_for_port("127.0.0.1", port)
        url = f"nats://127.0.0.1:{port}"
        ok = settings.model_copy(update={"nats_url": url})

        async def connect(s: Settings) -> None:
            nc = await bus.connect(s, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
            await nc.close()

        sync(connect(ok))
        with pytest.raises(Exception):  # noqa: B017
            sync(connect(Settings(nats_url=url)))
    finally:
        os.kill(proc.pid, 9)
        psutil.Process(proc.pid).wait(10)
    assert nats_nodes.nats_auth_block(Settings()) == ""
