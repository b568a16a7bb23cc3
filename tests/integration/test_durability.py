"""Invariant 1 (exactly-once effect) on the real multi-process stack: redelivered, republished and
replayed events leave `events` and `verification_results` unchanged; `projections rebuild`
refolds identical tables; `resume`, `regrade` and `cancel` through the real services.

This module also holds the stack helpers the other durability test modules import
(`start_stack`, `generated_benchmark`, `sim_config`, ...).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from shared.control import lifecycle, rebuild, runner, stack, streams, wait
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, Settings, VerificationConfig
from shared.core.models import VerificationResult
from shared.runtime import bus, runcontrol
from shared.store.reads import run_query
from tests.conftest import REPO

# --------------------------------------------------------------------------------------------
# helpers shared by the durability test modules
# --------------------------------------------------------------------------------------------

TEMPLATE = '''from karenina.schemas.entities import BaseAnswer
from pydantic import Field

class Answer(BaseAnswer):
    value: int = Field(description="The number asked for")

    def model_post_init(self, __context):
        self.correct = {{"value": {n}}}

    def verify(self) -> bool:
        return self.value == self.correct["value"]
'''

RUBRIC = {
    "llm_traits": [{"name": "Clarity", "kind": "boolean", "description": "The answer is clear."}],
    "regex_traits": [{"name": "NoApology", "pattern": "(?i)sorry", "invert_result": True}],
}


def sync(coro: Any) -> Any:
    """Run a coroutine from sync code, also when the caller's loop is running."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def generated_benchmark(path: Path, n: int, *, rubric: bool = True, wrong_every: int = 10,
                        prefix: str = "Durable") -> tuple[Path, dict[str, Any]]:
    """N questions with int templates (+ a global rubric); the simulator script answers one in
    `wrong_every` wrongly (none when 0), so verify results are a known mix."""
    questions, script = [], []
    for i in range(n):
        text = f"{prefix} question {i}: what is {i} plus {i}?"
        questions.append({"id": f"q{i:04d}", "question": text, "answer": str(2 * i),
                          "template": TEMPLATE.format(n=2 * i)})
        value = 2 * i + 1 if wrong_every and i % wrong_every == 0 else 2 * i
        script.append({"match": text, "answer": f"The sum is {value}.", "parsed": {"value": value},
                       "judge": {"Clarity": True}})
    doc: dict[str, Any] = {"name": f"{prefix.lower()}-{n}", "questions": questions}
    if rubric:
        doc["rubric"] = RUBRIC
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, {"questions": script}


def expected_verdicts(n: int, wrong_every: int = 10) -> dict[str, bool]:
    return {f"q{i:04d}": not (wrong_every and i % wrong_every == 0) for i in range(n)}


@dataclass
class Stack:
    settings: Settings
    state: stack.StackState
    extra_env: dict[str, str]

    @property
    def sim_base(self) -> str:
        assert self.state.simulator_url
        return self.state.simulator_url.removesuffix("/v1")

    def post_script(self, script: dict[str, Any]) -> None:
        httpx.post(f"{self.sim_base}/simulator/script", json=script, timeout=10).raise_for_status()

    def sim_stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.sim_base}/simulator/stats", timeout=10).json()

    def reload(self) -> stack.StackState:
        """The stack's state as saved (a lifecycle command may have restarted a process)."""
        self.state = stack.StackState.load(Path(self.state.home)) or self.state
        return self.state

    def proc(self, name: str) -> stack.Proc:
        return stack.proc_named(self.reload(), name)

    def kill(self, name: str) -> int:
        p = self.proc(name)
        stack.kill_proc(p)
        assert not p.alive()
        return p.pid

    def restart(self, name: str) -> stack.Proc:
        return stack.restart_proc(self.reload(), name, extra_env=self.extra_env)

    def ensure_all_alive(self) -> None:
        for p in list(self.reload().procs):
            if not p.alive():
                self.restart(p.name)

    def model(self, name: str, **kw: Any) -> ModelConfig:
        return ModelConfig(model_name=f"openai/{name}", api_base=self.state.simulator_url, **kw)

    def config(self, mode: str = "template_and_rubric", answer_kw: dict[str, Any] | None = None,
               judge_kw: dict[str, Any] | None = None, **kw: Any) -> VerificationConfig:
        return VerificationConfig(answering_models=[self.model("sim-answerer", **(answer_kw or {}))],
                                  parsing_models=[self.model("sim-judge", **(judge_kw or {}))],
                                  evaluation_mode=mode, **kw)


def start_stack(home: Path, *, simulator_args: list[str] | None = None, extra_env: dict[str, str] | None = None,
                replicas: dict[str, int] | None = None, nats_cluster: int = 1) -> Stack:
    settings = Settings(home=home)
    env = dict(extra_env or {})  # VERIBUS_LOG_LEVEL must stay INFO: readiness is read from the logs
    # what the stack's processes read comes from their environment, not from `settings`
    state = stack.up(settings, simulator_args=simulator_args, extra_env=env, replicas=replicas,
                     nats_cluster=nats_cluster)
    settings.nats_url = state.nats_url
    settings.simulator_url = state.simulator_url
    for key, field in (("VERIBUS_CONSUMER_ACK_WAIT_S", "consumer_ack_wait_s"),
                       ("VERIBUS_CONSUMER_MAX_DELIVER", "consumer_max_deliver")):
        if key in env:
            setattr(settings, field, float(env[key]) if field.endswith("_s") else int(env[key]))
    return Stack(settings, state, env)


def stop_stack(st: Stack) -> None:
    """`down`, then make sure every process the stack ever had is gone (by PID)."""
    pids = [p.pid for p in st.reload().procs]
    try:
        stack.down(st.settings)
    finally:
        for pid in pids:
            try:
                if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    os.kill(pid, signal.SIGKILL)
            except (psutil.Error, ProcessLookupError):
                pass


def plan_and_submit(st: Stack, bench_path: Path, config: VerificationConfig, *,
                    budget: int | None = None) -> runner.RunPlan:
    plan = runner.plan_run(Benchmark.load(bench_path), config)
    runcontrol.set_budget(plan.run_event, budget)
    sync(runner.submit(st.settings, plan))
    return plan


def wait_results(st: Stack, run_id: str, n: int, timeout: float = 120.0) -> dict[str, int]:
    done, timed_out = sync(wait.wait_for_results(st.settings, run_id, count=n, timeout=timeout, poll_s=0.25))
    counts = sync(wait.finalized_counts(st.settings, run_id))
    assert not timed_out, f"only {done}/{n} results of run {run_id} after {timeout}s"
    return counts


def results_of(st: Stack, run_id: str) -> dict[str, VerificationResult]:
    return sync(lifecycle.run_results(st.settings, run_id))


def verdicts(results: dict[str, VerificationResult]) -> dict[str, bool | None]:
    return {r.metadata.question_id: (r.template.verify_result if r.template else None) for r in results.values()}


def rows(st: Stack, sql: str, **params: Any) -> list[tuple]:
    return run_query(st.settings, sql, params).rows


def wait_projected(st: Stack, run_id: str, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    got = -1
    while time.monotonic() < deadline:
        try:
            got = rows(st, "SELECT count() FROM verification_results FINAL WHERE run_id = {r:String}", r=run_id)[0][0]
            if got >= n:
                return
        except Exception:  # noqa: BLE001 - the projector may be restarting
            pass
        time.sleep(0.25)
    raise AssertionError(f"projector has {got}/{n} rows of run {run_id} after {timeout}s")


def wait_projector_idle(st: Stack, timeout: float = 60.0) -> None:
    """Until the projector's durable consumer has nothing pending or unacknowledged."""

    async def idle() -> bool:
        nc = await bus.connect(st.settings)
        try:
            return await rebuild._consumer_caught_up(nc.jetstream(), streams.PROJECTOR_DURABLE)
        finally:
            await nc.close()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sync(idle()):
            return
        time.sleep(0.2)
    raise AssertionError("projector did not catch up")


def table_snapshot(st: Stack, run_id: str) -> dict[str, list[tuple]]:
    """The run's rows as analysts see them (FINAL), ingestion time left out."""
    return {
        "events": rows(st, "SELECT event_id, event_type, result_id, occurred_at, status, error_message, "
                           "cityHash64(payload) FROM events FINAL WHERE run_id = {r:String} ORDER BY event_id",
                       r=run_id),
        "results": rows(st, "SELECT result_id, version, verify_result, completed_without_errors, "
                            "cityHash64(result_json) FROM verification_results FINAL WHERE run_id = {r:String} "
                            "ORDER BY result_id", r=run_id),
    }


async def _republish_all(settings: Settings, run_id: str) -> tuple[int, int]:
    """Publish every stored message of the run again, byte for byte, with its Nats-Msg-Id."""
    nc = await bus.connect(settings)
    try:
        js = nc.jetstream()
        envs = await streams.read_events(js, f"vb.*.*.{run_id}.*")
        dup = 0
        for env in envs:
            ack = await js.publish(env.subject, events.encode(env), stream=events.STREAM,
                                   headers={"Nats-Msg-Id": env.event_id})
            dup += int(ack.duplicate)
        return len(envs), dup
    finally:
        await nc.close()


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------

N = 40


@pytest.fixture(scope="module")
def dstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("durable") / "home"
    # few generation workers, so a run has answer requests that no handler has started yet
    st = start_stack(home, extra_env={"VERIBUS_CONSUMER_ACK_WAIT_S": "5", "VERIBUS_GENERATION_WORKERS": "8"})
    try:
        yield st
    finally:
        stop_stack(st)


@pytest.fixture(scope="module")
def finished_run(dstack: Stack, tmp_path_factory: pytest.TempPathFactory) -> tuple[runner.RunPlan, Path]:
    path, script = generated_benchmark(tmp_path_factory.mktemp("bench") / "bench.yaml", N)
    dstack.post_script(script)
    plan = plan_and_submit(dstack, path, dstack.config())
    wait_results(dstack, plan.run_id, N)
    wait_projected(dstack, plan.run_id, N)
    wait_projector_idle(dstack)
    return plan, path


def test_republished_envelopes_are_deduplicated(dstack: Stack, finished_run) -> None:
    plan, _ = finished_run
    before = table_snapshot(dstack, plan.run_id)
    assert len(before["results"]) == N
    sent, dup = sync(_republish_all(dstack.settings, plan.run_id))
    assert sent >= N * 6 and dup == sent, "every republished envelope is a duplicate inside the window"
    wait_projector_idle(dstack)
    assert table_snapshot(dstack, plan.run_id) == before
    counts = sync(wait.finalized_counts(dstack.settings, plan.run_id))
    assert len(counts) == N and set(counts.values()) == {1}


def test_replay_by_resetting_the_projector_consumer(dstack: Stack, finished_run) -> None:
    """A replay (the projector re-reads the whole stream) changes nothing in the tables."""
    plan, _ = finished_run
    before = table_snapshot(dstack, plan.run_id)
    projector = dstack.proc("projector")
    stack.stop_proc(projector)
    assert sync(rebuild._delete_consumer(dstack.settings, streams.PROJECTOR_DURABLE))
    dstack.restart("projector")
    wait_projector_idle(dstack)
    assert table_snapshot(dstack, plan.run_id) == before


def test_republished_answer_request_does_not_make_a_second_result(dstack: Stack, finished_run) -> None:
    """An answer.requested handled again (republished under another message id inside the
    duplicate window, or byte for byte after it) never makes a second result: inside the window
    the re-run's events are deduplicated by the server; after it (the window shortened to 0.2 s
    here) they are new messages with the same event ids, which the tables fold into one row per
    event id and one row per result."""
    plan, _ = finished_run
    before = table_snapshot(dstack, plan.run_id)
    answers_before = dstack.sim_stats()["by_model"].get("sim-answerer", 0)
    again = plan.requests[:10]

    async def republish(window: float | None, new_ids: bool) -> None:
        nc = await bus.connect(dstack.settings)
        try:
            js = nc.jetstream()
            if window is not None:
                cfg = bus.stream_config()
                cfg.duplicate_window = window
                await js.update_stream(cfg)
                await asyncio.sleep(2 * window)
            envs = [events.make_envelope(events.ANSWER_REQUESTED, plan.run_id, r.jobs[0].answer_id, r, "test")
                    for r in again]
            if new_ids:
                for e in envs:
                    e.event_id = f"republished-{e.event_id}"
            await bus.publish_many(js, envs)
        finally:
            await nc.close()

    def generation_idle() -> None:
        deadline = time.monotonic() + 30
        while sync(_queued(dstack.settings)) and time.monotonic() < deadline:
            time.sleep(0.1)

    sync(republish(None, new_ids=True))  # inside the window, another message id: handled again
    generation_idle()
    wait_projector_idle(dstack)
    after = table_snapshot(dstack, plan.run_id)
    # the only new rows are the ten republished requests themselves
    assert after["results"] == before["results"]
    assert [e for e in after["events"] if not e[0].startswith("republished-")] == before["events"]
    assert sum(e[0].startswith("republished-") for e in after["events"]) == len(again)
    before = after
    assert set(sync(wait.finalized_counts(dstack.settings, plan.run_id)).values()) == {1}

    try:
        sync(republish(0.2, new_ids=False))  # the same envelopes after the window
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            counts = sync(wait.finalized_counts(dstack.settings, plan.run_id))
            if sum(counts.values()) >= N + len(again):
                break
            time.sleep(0.25)
        assert sum(counts.values()) == N + len(again), counts  # ten results finalized a second time ...
        generation_idle()
        wait_projector_idle(dstack)
        after = table_snapshot(dstack, plan.run_id)
        # ... and still one row per event id and per result id, with the same verdicts
        assert [(r[0], r[2], r[3]) for r in after["results"]] == [(r[0], r[2], r[3]) for r in before["results"]]
        assert [r[0] for r in after["events"]] == [r[0] for r in before["events"]]
        # the re-runs were answered from the run-scoped response cache: no new answering calls
        assert dstack.sim_stats()["by_model"].get("sim-answerer", 0) == answers_before
    finally:
        sync(_restore_window(dstack.settings))


async def _queued(settings: Settings) -> dict[str, int]:
    nc = await bus.connect(settings)
    try:
        return await streams.queued_for_services(nc.jetstream())
    finally:
        await nc.close()


def wait_services_idle(st: Stack, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sync(_queued(st.settings)):
            return
        time.sleep(0.1)
    raise AssertionError(f"services still have queued messages: {sync(_queued(st.settings))}")


async def _restore_window(settings: Settings) -> None:
    nc = await bus.connect(settings)
    try:
        await nc.jetstream().update_stream(bus.stream_config())
    finally:
        await nc.close()


def test_projections_rebuild_yields_identical_tables(dstack: Stack, finished_run) -> None:
    plan, _ = finished_run
    wait_projector_idle(dstack)
    before = table_snapshot(dstack, plan.run_id)
    rep = rebuild.rebuild_projections(dstack.settings, timeout=120)
    assert rep.mode == "stack"
    assert rep.identical, (rep.before, rep.after)
    assert rep.after["verification_results"][0] >= N
    assert table_snapshot(dstack, plan.run_id) == before
    assert dstack.proc("projector").alive()


def test_resume_republishes_only_unfinished_jobs(dstack: Stack, tmp_path: Path) -> None:
    """A submit that died half-way: resume plans the missing answers from the benchmark and
    publishes only those; finished jobs cost no model call."""
    n = 30
    path, script = generated_benchmark(tmp_path / "resume.yaml", n, prefix="Resumable")
    dstack.post_script(script)
    config = dstack.config()
    plan = runner.plan_run(Benchmark.load(path), config)
    full = list(plan.requests)
    plan.requests = full[:12]  # the CLI "crashed" after publishing 12 of 30 answer requests
    sync(runner.submit(dstack.settings, plan))
    wait_results(dstack, plan.run_id, 12)
    wait_services_idle(dstack)
    calls_before = dstack.sim_stats()["by_model"].get("sim-answerer", 0)

    dry = sync(lifecycle.plan_resume(dstack.settings, plan.run_id))
    assert dry.finalized == 12 and dry.jobs == 0 and dry.never_published == n - 12
    with_bench = sync(lifecycle.resume(dstack.settings, plan.run_id, benchmark=Benchmark.load(path)))
    assert with_bench.replanned == n - 12 and with_bench.jobs == n - 12 and with_bench.finalized == 12
    wait_results(dstack, plan.run_id, n)
    assert dstack.sim_stats()["by_model"].get("sim-answerer", 0) - calls_before == n - 12
    counts = sync(wait.finalized_counts(dstack.settings, plan.run_id))
    assert len(counts) == n and set(counts.values()) == {1}
    assert verdicts(results_of(dstack, plan.run_id)) == expected_verdicts(n)
    again = sync(lifecycle.plan_resume(dstack.settings, plan.run_id))
    assert again.jobs == 0 and again.finalized == n



def test_cancel_then_resume(dstack: Stack, tmp_path: Path) -> None:
    """cancel: answers not yet generated finalize as cancelled (nothing hangs); resume re-runs
    exactly those."""
    n = 60
    path, script = generated_benchmark(tmp_path / "cancel.yaml", n, prefix="Cancellable")
    script["questions"] = [{**q, "answer_errors": ["slow"]} for q in script["questions"]]
    dstack.post_script(script)
    # one answer at a time, each ~0.3 s (a forced 'slow' answer is retried after the timeout)
    config = dstack.config(answer_kw={"max_concurrency": 1, "timeout": 0.3, "max_retries": 2})
    plan = plan_and_submit(dstack, path, config)
    deadline = time.monotonic() + 30
    while len(sync(wait.finalized_counts(dstack.settings, plan.run_id))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    out = sync(lifecycle.cancel(dstack.settings, plan.run_id, "test"))
    assert out.job_count == n
    with pytest.raises(streams.LifecycleError, match="still queued"):
        sync(lifecycle.resume(dstack.settings, plan.run_id))  # the run is still in flight
    t0 = time.monotonic()
    wait_results(dstack, plan.run_id, n, timeout=60)
    assert time.monotonic() - t0 < 30, "cancelled jobs finalize promptly"
    res = results_of(dstack, plan.run_id)
    cancelled = [r for r in res.values() if r.metadata.error and "RunCancelled" in r.metadata.error]
    assert 0 < len(cancelled) < n
    for r in cancelled:
        assert not r.metadata.completed_without_errors
        assert "cancelled" in r.metadata.error
    # resume: only the cancelled jobs run again, and every job ends with a real result
    dstack.post_script({"questions": [{k: v for k, v in q.items() if k != "answer_errors"}
                                      for q in script["questions"]]})
    wait_services_idle(dstack)
    plan2 = sync(lifecycle.resume(dstack.settings, plan.run_id))
    assert plan2.stopped == len(cancelled) and plan2.jobs == len(cancelled)
    before = {rid: 1 for rid in (r.metadata.result_id for r in cancelled)}
    done, timed_out = sync(wait.wait_for_results(dstack.settings, plan.run_id, result_ids=list(before),
                                                      baseline=before, timeout=90))
    assert not timed_out, f"{done}/{len(before)} resumed"
    res = results_of(dstack, plan.run_id)
    assert len(res) == n
    bad = [r.metadata.result_id for r in res.values() if r.metadata.error and "RunCancelled" in r.metadata.error]
    assert not bad


def test_regrade_uses_stored_answers(dstack: Stack, finished_run, tmp_path: Path) -> None:
    """regrade with changed templates: a new run linked to the parent, verify results follow
    the new templates, and the answering model is not called."""
    plan, path = finished_run
    doc = yaml.safe_load(path.read_text())
    for i, q in enumerate(doc["questions"]):  # the new checkpoint accepts the "wrong" answers too
        if i % 10 == 0:
            q["template"] = TEMPLATE.format(n=2 * i + 1)
    new_path = tmp_path / "bench-v2.yaml"
    new_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    calls_before = dstack.sim_stats()["by_model"]
    rg = sync(lifecycle.plan_regrade(dstack.settings, plan.run_id, benchmark=Benchmark.load(new_path)))
    assert len(rg.generated) == N and rg.run_event.parent_run_id == plan.run_id
    sync(lifecycle.submit_regrade(dstack.settings, rg))
    wait_results(dstack, rg.run_id, N)
    new = results_of(dstack, rg.run_id)
    assert all(v is True for v in verdicts(new).values())
    calls_after = dstack.sim_stats()["by_model"]
    assert calls_after.get("sim-answerer", 0) == calls_before.get("sim-answerer", 0)
    assert calls_after.get("sim-judge", 0) > calls_before.get("sim-judge", 0)
    old = results_of(dstack, plan.run_id)
    assert {r.metadata.question_id: r.template.raw_llm_response for r in new.values()} == \
           {r.metadata.question_id: r.template.raw_llm_response for r in old.values()}
    cmp = lifecycle.compare_runs(old.values(), new.values())
    assert cmp["compared"] == N and len(cmp["changed"]) == N // 10
    wait_projected(dstack, rg.run_id, N)
    assert rows(dstack, "SELECT parent_run_id FROM runs FINAL WHERE run_id = {r:String}", r=rg.run_id) == \
        [(plan.run_id,)]


def test_backpressure_keeps_memory_bounded(tmp_path: Path) -> None:
    """Invariant 5, CI size: 3,000 jobs queued against a 200 ms model. While the queue is deep
    every service's RSS stays flat (in-flight work is bounded by workers and max_ack_pending);
    after a cancel every job is finalized. `python -m bench.backpressure` runs 10,000."""
    from bench.backpressure import print_figures, run_backpressure

    row = run_backpressure(jobs=3000, latency_ms=200.0, concurrency=16, hold_s=6.0, drain_timeout_s=180.0,
                           home=tmp_path)
    print_figures(row)
    assert not row["timed_out"] and row["finalized"] == 3000
    assert row["consumers_at_end_of_hold"]["generation"]["pending"] > 1000, "the queue was deep while measured"
    for name, c in row["consumers_at_end_of_hold"].items():
        assert row["max_ack_pending_seen"][name] <= c["max_ack_pending"], name
    for name in stack.SERVICES:
        limit = 1200.0 if name == "projector" else 600.0  # the projector holds the embedded ClickHouse
        assert row["rss_mb_peak"][name] < limit, (name, row["rss_mb_peak"][name])
        assert row["rss_mb_growth"][name] < 300.0, (name, row["rss_mb_growth"][name])


# the lifecycle commands through the CLI (wired by `shared.cli.lifecycle.register`; the shim below
# registers them when shared.cli does not yet)
CLI_SHIM = (
    "import argparse, sys\n"
    "from shared.cli import commands as cli\n"
    "from shared.cli import lifecycle as cli_lifecycle\n"
    "p = cli.build_parser()\n"
    "sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))\n"
    "if 'resume' not in sub.choices:\n"
    "    cli_lifecycle.register(sub)\n"
    "args = p.parse_args(sys.argv[1:])\n"
    "sys.exit(args.fn(args))\n"
)


def veribus_cli(st: Stack, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VERIBUS_HOME": str(st.settings.home)}
    return subprocess.run([sys.executable, "-c", CLI_SHIM, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_lifecycle_commands_on_the_cli(dstack: Stack, finished_run, tmp_path: Path) -> None:
    plan, path = finished_run
    out = veribus_cli(dstack, "resume", plan.run_id, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert f"run {plan.run_id}: {N} jobs, {N} with a result" in out.stdout and "0 job(s)" in out.stdout
    missing = veribus_cli(dstack, "cancel", "no-such-run")
    assert missing.returncode == 2 and "no run 'no-such-run'" in missing.stderr
    regrade = veribus_cli(dstack, "regrade", plan.run_id, "--timeout", "60")
    assert regrade.returncode == 0, regrade.stderr
    assert f"regrade of {plan.run_id}: {N} jobs from stored answers" in regrade.stdout
    assert f"{N}/{N} finalized" in regrade.stdout and f"verify_result changed for 0 of {N}" in regrade.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("class Answer(BaseAnswer):", "class Answer(BaseAnswer:", 1))
    refused = veribus_cli(dstack, "regrade", plan.run_id, "--benchmark", str(bad))
    assert refused.returncode == 2 and "q0000" in refused.stderr and "Traceback" not in refused.stderr
    wait_services_idle(dstack)
    wait_projector_idle(dstack)
    rebuilt = veribus_cli(dstack, "projections", "rebuild", "--timeout", "120")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "CHANGED" not in rebuilt.stdout and rebuilt.stdout.count("identical") == 3, rebuilt.stdout
