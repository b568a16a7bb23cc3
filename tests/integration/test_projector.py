"""The projector against a real nats-server and a real chdb folder, run as `python -m
services.projector` in a subprocess (it owns its chdb folder; this test process never opens it).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus
from shared.store.reads import NoProjector, QueryError, QueryResult, query_via_nats
from tests.conftest import REPO, NatsServer
from tests.unit.test_flatten import USAGE, _stage_env, make_result


def _sync(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, also when the caller's loop is running."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@dataclass
class ProjectorProc:
    settings: Settings
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.projector"], cwd=REPO, env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"projector exited early:\n{self.log.read_text()[-3000:]}"
            try:
                _sync(query_via_nats(self.settings, "SELECT 1", timeout=2))
                return
            except (NoProjector, QueryError):
                time.sleep(0.1)
        raise TimeoutError(f"projector not answering after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int | None:
        """SIGTERM (graceful: closes the chdb folder), then kill if it does not exit. By PID."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        code, self.proc = self.proc.returncode, None
        return code

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


@pytest.fixture
def projector(nats_server: NatsServer, tmp_path: Path) -> Iterator[ProjectorProc]:
    home = tmp_path / "home"
    settings = Settings(nats_url=nats_server.url, home=home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERIBUS_")}
    env.update(VERIBUS_NATS_URL=nats_server.url, VERIBUS_HOME=str(home), PYTHONPATH=str(REPO))
    p = ProjectorProc(settings=settings, env=env, log=tmp_path / "projector.log")
    p.start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[Any]:
    nc = await bus.connect(Settings(nats_url=nats_server.url))
    js = nc.jetstream()
    await bus.ensure_stream(js)
    try:
        yield js
    finally:
        await nc.close()


def result_events(run_id: str, i: int, verify: bool | None) -> list[events.Envelope]:
    """The stage events and the finalized result of one job."""
    r = make_result(question=f"q{i}", replicate=1, verify=verify, usage=USAGE,
                    error=None if verify is not None else "parse_template: ValueError: bad json")
    rid = r.metadata.result_id
    t0 = 1_700_000_000.0 + i
    gen = ("generate_answer", "performed", t0, t0 + 1.5)
    parse = ("parse_template", "performed", t0 + 1.6, t0 + 1.9)
    envs = [
        _stage_env(events.ANSWER_GENERATED, rid, [gen], usage={"answer_generation": {"input_tokens": 9, "output_tokens": 4}}),
        _stage_env(events.TEMPLATE_PARSED, rid, [gen, parse]),
        events.make_envelope(events.RESULT_FINALIZED, run_id, rid,
                             events.ResultFinalized(result=r.model_dump(mode="json")), "finalization/test"),
    ]
    for e in envs:  # _stage_env builds run1 envelopes; re-key them to this run
        e.run_id = run_id
    return envs


def run_event(run_id: str, jobs: int) -> events.Envelope:
    return events.make_envelope(events.RUN_REQUESTED, run_id, events.RUN_KEY, events.RunRequested(
        run_id=run_id, timestamp="2026-04-21T12:00:00+00:00", job_count=jobs, answer_count=jobs,
        benchmark_name="bench"), "cli/test")


async def q(settings: Settings, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
    return await query_via_nats(settings, sql, params, timeout=10)


async def wait_count(settings: Settings, sql: str, expected: int, timeout: float = 30.0,
                     params: dict[str, Any] | None = None) -> int:
    deadline = time.monotonic() + timeout
    n = -1
    while time.monotonic() < deadline:
        n = int((await q(settings, sql, params)).rows[0][0])
        if n >= expected:
            return n
        await asyncio.sleep(0.1)
    raise AssertionError(f"{sql}: {n} rows after {timeout}s, expected {expected}")


async def test_projects_events_dedups_records_undecodable_and_answers_queries(
    projector: ProjectorProc, js: Any
) -> None:
    s = projector.settings
    verdicts = [True, False, True, None, True]
    envs = [run_event("runP", len(verdicts))]
    for i, v in enumerate(verdicts):
        envs += result_events("runP", i, v)
    assert await bus.publish_many(js, envs) == len(envs)
    assert await bus.publish_many(js, envs[:4]) == 0  # same msg ids: deduplicated by the server
    for env in envs[:6]:  # a republish the server cannot dedup (new msg id): the tables must
        await js.publish(env.subject, events.encode(env), headers={"Nats-Msg-Id": env.event_id + ":again"})
    await js.publish("vb.answer.generated.runP.junk", b"\x00 not an envelope", headers={"Nats-Msg-Id": "junk-1"})
    wrong = events.encode(envs[1]).replace(b'"payload"', b'"schema_version":99,"payload"')
    await js.publish(envs[1].subject, wrong, headers={"Nats-Msg-Id": "wrong-version"})

    expected_events = len(envs) + 2
    await wait_count(s, "SELECT count() FROM events FINAL", expected_events)
    await asyncio.sleep(1.0)  # one more batch window: nothing beyond the expected rows may appear
    assert int((await q(s, "SELECT count() FROM events FINAL")).rows[0][0]) == expected_events

    res = await q(s, "SELECT event_type, count() FROM events FINAL WHERE run_id = {r:String} GROUP BY event_type "
                     "ORDER BY event_type", {"r": "runP"})
    assert dict(res.rows) == {"answer.generated": 5, "result.finalized": 5, "run.requested": 1,
                              "template.parsed": 5, "undecodable": 2}  # both bad messages were on runP subjects
    bad = await q(s, "SELECT subject, error_type, status FROM events FINAL WHERE event_type = 'undecodable' "
                     "ORDER BY error_type")
    assert [(r[1], r[2]) for r in bad.rows] == [("DecodeError", "undecodable"), ("SchemaVersionError", "undecodable")]

    summary = await q(s, "SELECT job_count, total, passed, failed, errors FROM v_run_summary WHERE run_id = 'runP'")
    assert summary.rows == [(5, 5, verdicts.count(True), verdicts.count(False), 1)]
    rows = await q(s, "SELECT question_id, verify_result, result_json FROM verification_results FINAL "
                      "WHERE run_id = {r:String} ORDER BY question_id", {"r": "runP"})
    assert [r[1] for r in rows.rows] == verdicts
    assert json.loads(rows.rows[0][2])["metadata"]["question_id"] == "q0"

    tokens = await q(s, "SELECT sum(input_tokens) FROM events FINAL WHERE event_type = 'answer.generated' "
                        "AND run_id = 'runP'")
    assert tokens.rows == [(9 * 5,)]

    with pytest.raises(QueryError, match="refused"):
        await q(s, "INSERT INTO runs (run_id) VALUES ('x')")
    with pytest.raises(QueryError, match="refused"):
        await q(s, "SELECT * FROM file('/etc/passwd', 'LineAsString')")
    with pytest.raises(QueryError, match="(?i)unknown|exist"):
        await q(s, "SELECT * FROM no_such_table")
    assert int((await q(s, "SELECT count() FROM runs FINAL")).rows[0][0]) == 1


async def test_resumes_from_its_durable_consumer_and_frees_the_folder(projector: ProjectorProc, js: Any) -> None:
    s = projector.settings
    first = [run_event("runR", 6)] + [e for i in range(3) for e in result_events("runR", i, True)]
    await bus.publish_many(js, first)
    await wait_count(s, "SELECT count() FROM verification_results FINAL", 3)

    assert projector.stop() == 0  # graceful SIGTERM exit

    second = [e for i in range(3, 6) for e in result_events("runR", i, False)]
    await bus.publish_many(js, second)  # published while the projector is down

    # no projector answers: a reader opens the (now unlocked) folder directly, in its own process
    code = ("import json; from shared.core.config import Settings; from shared.store.reads import run_query; "
            "r = run_query(Settings.from_env(), 'SELECT count() FROM verification_results FINAL'); "
            "print(json.dumps(r.rows))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=projector.env, capture_output=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.decode().strip().splitlines()[-1]) == [[3]]

    projector.start()
    await wait_count(s, "SELECT count() FROM verification_results FINAL", 6)
    await asyncio.sleep(1.0)
    res = await q(s, "SELECT total, passed, failed FROM v_run_summary WHERE run_id = 'runR'")
    assert res.rows == [(6, 3, 3)]
    assert int((await q(s, "SELECT count() FROM events FINAL")).rows[0][0]) == len(first) + len(second)


async def test_cpu_per_event_and_throughput(projector: ProjectorProc, js: Any) -> None:
    """Measures the projector process: CPU seconds per event and end-to-end events/s."""
    s = projector.settings
    n_results = 1000
    envs = [e for i in range(n_results) for e in result_events("runT", i, i % 4 != 0)]
    proc = psutil.Process(projector.pid)
    cpu0 = sum(proc.cpu_times()[:2])
    t0 = time.perf_counter()
    await bus.publish_many(js, envs)
    await wait_count(s, "SELECT count() FROM events FINAL WHERE run_id = 'runT'", len(envs), timeout=120)
    wall = time.perf_counter() - t0
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    per_event_ms = cpu / len(envs) * 1000
    print(f"\nprojector: {len(envs)} events ({n_results} results) in {wall:.2f}s = {len(envs) / wall:.0f} events/s; "
          f"CPU {cpu:.2f}s = {per_event_ms:.3f} ms/event, {cpu / n_results * 1000:.2f} ms/result")
    assert int((await q(s, "SELECT count() FROM verification_results FINAL WHERE run_id = 'runT'")).rows[0][0]) \
        == n_results
    # generous bound (2 shared cores, includes queries and background merges): a regression guard
    assert per_event_ms < 2.0
