"""The multi-process stack as the integration tests drive it: start and stop a real stack (nats-server,
simulator, services, projector), generate benchmarks the simulator answers, submit runs and wait for
their results and projections. Every process started here is stopped by `stop_stack`, by PID."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import workload
from shared.control import lifecycle, processes, rebuild, runner, stack, streams, wait
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, Settings, VerificationConfig
from shared.core.models import VerificationResult
from shared.runtime import bus, runcontrol
from shared.store.reads import run_query


def sync(coro: Any) -> Any:
    """Run a coroutine from sync code, also when the caller's loop is running."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def generated_benchmark(path: Path, n: int, *, rubric: bool = True, wrong_every: int = 10,
                        prefix: str = "Durable") -> tuple[Path, dict[str, Any]]:
    """The benchmarks' generated workload (`bench.workload`), with a global rubric by default."""
    return workload.generated_benchmark(path, n, rubric=rubric, wrong_every=wrong_every, prefix=prefix)


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

    def proc(self, name: str) -> processes.Proc:
        return stack.proc_named(self.reload(), name)

    def kill(self, name: str) -> int:
        p = self.proc(name)
        processes.kill_proc(p)
        assert not p.alive()
        return p.pid

    def restart(self, name: str) -> processes.Proc:
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


@contextmanager
def up_and_down(home: Path, **up_kw: Any) -> Iterator[tuple[Settings, stack.StackState]]:
    """`up` a stack as the CLI does (`shared.control.stack.up`), yield its settings (pointing at its
    NATS and simulator) and state; `down` after, and every process it had must be gone."""
    settings = Settings(home=home)
    state = stack.up(settings, **up_kw)
    settings.nats_url = state.nats_url
    settings.simulator_url = state.simulator_url
    try:
        yield settings, state
    finally:
        stack.down(settings)
        for p in state.procs:
            assert not p.alive(), f"{p.name} (pid {p.pid}) still running after down"


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


async def _queued(settings: Settings) -> dict[str, int]:
    nc = await bus.connect(settings)
    try:
        return await streams.queued_for_services(nc.jetstream())
    finally:
        await nc.close()


def wait_services_idle(st: Stack, timeout: float = 30.0) -> None:
    """Until no service has a message queued (a `resume` refuses to publish before that)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sync(_queued(st.settings)):
            return
        time.sleep(0.1)
    raise AssertionError(f"services still have queued messages: {sync(_queued(st.settings))}")


def log_lines(st: Stack, service: str, needle: str, last: int = 20) -> list[str]:
    """The last lines a service has logged that contain `needle` (for a failing assertion's message)."""
    text = "".join(p.log_text() for p in st.state.procs if p.name == service)
    return [line for line in text.splitlines() if needle in line][-last:]


def results_of(st: Stack, run_id: str) -> dict[str, VerificationResult]:
    return sync(lifecycle.run_results(st.settings, run_id))


def verdicts(results: dict[str, VerificationResult]) -> dict[str, bool | None]:
    return {r.metadata.question_id: (r.template.verify_result if r.template else None) for r in results.values()}


def verdict_diff(got: dict[str, bool | None], want: dict[str, bool | None], n_results: int) -> str:
    """What differs between two verdict maps, so a failure names the questions."""
    missing = sorted(want.keys() - got.keys())
    extra = sorted(got.keys() - want.keys())
    changed = sorted((q, want[q], got[q]) for q in want.keys() & got.keys() if want[q] != got[q])
    return (f"{n_results} results read; missing {missing[:10]} ({len(missing)}), extra {extra[:10]}, "
            f"changed (question, expected, got) {changed[:10]} ({len(changed)})")


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
        async with bus.session(st.settings) as nc:
            return await rebuild._consumer_caught_up(nc.jetstream(), streams.PROJECTOR_DURABLE)

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


async def republish_all(settings: Settings, run_id: str) -> tuple[int, int]:
    """Publish every stored message of the run again, byte for byte, with its Nats-Msg-Id."""
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        envs = await streams.read_events(js, f"vb.*.*.{run_id}.*")
        dup = 0
        for env in envs:
            ack = await js.publish(env.subject, events.encode(env), stream=events.STREAM,
                                   headers={"Nats-Msg-Id": env.event_id})
            dup += int(ack.duplicate)
        return len(envs), dup


# --- a stack with the generated workload, and the crash tests' run (test_crash, test_cluster_stack) ---


@contextmanager
def workload_stack(tmp_path_factory: Any, name: str, n: int, *, prefix: str,
                   **start_kw: Any) -> Iterator[tuple[Stack, Path]]:
    """A module's stack (`start_stack(**start_kw)`) with an `n`-question generated benchmark whose
    simulator script is posted; stopped on exit."""
    st = start_stack(tmp_path_factory.mktemp(name) / "home", **start_kw)
    try:
        path, script = generated_benchmark(tmp_path_factory.mktemp(f"{name}-bench") / "bench.yaml", n,
                                           prefix=prefix)
        st.post_script(script)
        yield st, path
    finally:
        stop_stack(st)


def concurrent_config(st: Stack) -> VerificationConfig:
    """4 calls in flight per model: a run of a few hundred jobs takes a few seconds, long enough to
    crash into."""
    return st.config(answer_kw={"max_concurrency": 4}, judge_kw={"max_concurrency": 4})


def undisturbed_verdicts(st: Stack, path: Path, n: int, timeout: float) -> dict[str, bool | None]:
    """A run nothing disturbs: its verdicts per question (the baseline the crash tests compare to)."""
    plan = plan_and_submit(st, path, concurrent_config(st))
    wait_results(st, plan.run_id, n, timeout=timeout)
    return verdicts(results_of(st, plan.run_id))


def start_and_wait_in_flight(st: Stack, path: Path, n: int, kill_at: float, timeout: float) -> str:
    """Submit a run and return its id once `kill_at` of its `n` results are finalized, not all."""
    plan = plan_and_submit(st, path, concurrent_config(st))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = len(sync(wait.finalized_counts(st.settings, plan.run_id)))
        if done >= kill_at * n:
            assert done < n, "the run finished before the crash: make it slower"
            return plan.run_id
        time.sleep(0.05)
    raise AssertionError("the run did not get going")


def check_run_complete(st: Stack, run_id: str, baseline: dict[str, bool | None], n: int, *,
                       timeout: float, projected_timeout: float, idle_timeout: float = 60.0) -> None:
    """Nothing was lost: exactly one finalized result per job, all without errors, the baseline's
    verdicts, and the projector holds each result and each result.finalized event once."""
    counts = wait_results(st, run_id, n, timeout=timeout)
    assert len(counts) == n and set(counts.values()) == {1}, "exactly one result.finalized per job"
    res = results_of(st, run_id)
    assert all(r.metadata.completed_without_errors for r in res.values()), \
        [r.metadata.error for r in res.values() if not r.metadata.completed_without_errors][:3]
    got = verdicts(res)
    assert got == baseline, verdict_diff(got, baseline, len(res))
    wait_projected(st, run_id, n, timeout=projected_timeout)
    wait_projector_idle(st, timeout=idle_timeout)  # a batch's results rows are inserted before its events rows
    assert rows(st, "SELECT count() FROM verification_results FINAL WHERE run_id = {r:String}", r=run_id) == [(n,)]
    assert rows(st, "SELECT count() FROM events FINAL WHERE run_id = {r:String} AND event_type = 'result.finalized'",
                r=run_id) == [(n,)]


class Listener:
    """A loopback TCP listener that counts connections (a template must make none)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
