"""Model-side faults through the real pipeline (simulator error injection): 429 with and without
Retry-After, 5xx, timeouts, a model that never answers, connection refused, truncated / non-JSON
/ invalid judge output. Each is survived: bounded retries with backoff, then a finalized result
with completed_without_errors=false and a precise error; no run hangs. And the run-level token
budget: dispatch stops when it is spent, the remaining jobs finalize as "budget exhausted".
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.workload import int_template
from shared.control import processes, status
from shared.core.models import VerificationResult
from shared.runtime import runcontrol
from tests.support.stack import (
    Listener,
    Stack,
    generated_benchmark,
    plan_and_submit,
    results_of,
    start_stack,
    stop_stack,
    sync,
    wait_projected,
    wait_results,
)

RETRY_AFTER = 0.3
# question index -> (simulator script fields, expected: None = passes, else substrings of the error)
FAULTS: dict[int, tuple[dict[str, Any], list[str] | None]] = {
    1: ({"answer_errors": [429, 429]}, None),  # Retry-After honoured twice, then an answer
    2: ({"answer_errors": [429, 429, 429]}, ["generate_answer", "rate_limit", "HTTP 429", "after 3 attempt(s)"]),
    3: ({"answer_errors": [500, 500, 500]}, ["generate_answer", "server_error", "HTTP 500", "after 3 attempt(s)"]),
    4: ({"answer_errors": [503]}, None),
    5: ({"answer_errors": ["timeout", "timeout", "timeout"]}, ["generate_answer", "timeout", "after 3 attempt(s)"]),
    6: ({"answer_errors": ["slow", "slow", "slow"]}, ["generate_answer", "timeout", "after 3 attempt(s)"]),
    7: ({"judge_errors": ["malformed", "malformed", "malformed"]}, ["parse", "bad_output", "no valid JSON",
                                                                     "unterminated"]),
    8: ({"judge_errors": ["invalid", "invalid", "invalid"]}, ["parse", "bad_output", "value"]),
    9: ({"judge_errors": ["empty", "empty", "empty"]}, ["parse", "bad_output"]),
    10: ({"judge_errors": ["malformed"]}, None),  # one truncated reply, then a valid one
    11: ({"judge_errors": ["fenced"]}, None),  # JSON in a fenced block in prose: extracted
    12: ({"judge_errors": [500, 500, 500]}, ["parse", "server_error", "HTTP 500"]),
}
N = 16


@pytest.fixture(scope="module")
def fstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("faults") / "home"
    # 100 ms per call: real models are slower still; the budget test needs a run that takes a while
    st = start_stack(home, simulator_args=["--latency-ms", "100", "--slow-ms", "20000",
                                           "--retry-after", str(RETRY_AFTER)],
                     extra_env={"VERIBUS_GENERATION_WORKERS": "4", "VERIBUS_SANDBOX_TIMEOUT_S": "3",
                                "VERIBUS_SANDBOX_MEMORY_MB": "384"})
    try:
        yield st
    finally:
        stop_stack(st)


def _models(**kw: Any) -> dict[str, Any]:
    return {"max_retries": 2, "timeout": 1.0, **kw}


def test_injected_faults_each_end_in_a_precise_result(fstack: Stack, tmp_path: Path) -> None:
    path, script = generated_benchmark(tmp_path / "faults.yaml", N, rubric=False, wrong_every=0, prefix="Fault")
    for i, (fields, _) in FAULTS.items():
        script["questions"][i].update(fields)
    fstack.post_script(script)
    plan = plan_and_submit(fstack, path, fstack.config("template_only", answer_kw=_models(), judge_kw=_models()))
    wait_results(fstack, plan.run_id, N, timeout=90)
    res = {r.metadata.question_id: r for r in results_of(fstack, plan.run_id).values()}
    assert len(res) == N
    for i in range(N):
        r = res[f"q{i:04d}"]
        expect = FAULTS.get(i, ({}, None))[1]
        if expect is None:
            assert r.metadata.completed_without_errors, (i, r.metadata.error)
            assert r.template is not None and r.template.verify_result is True, i
        else:
            assert not r.metadata.completed_without_errors, i
            for part in expect:
                assert part in (r.metadata.error or ""), (i, part, r.metadata.error)
    # Retry-After is a floor: two 429s cost at least 2 x 0.3 s before the answer
    assert res["q0001"].metadata.execution_time >= 2 * RETRY_AFTER
    # bounded without a clock: q0006's three 20 s replies each ended as a 1 s timeout (its error
    # says so, checked above), and the run finished inside wait_results' limit
    assert "sim-answerer" in res["q0003"].metadata.error


class _Stub:
    """An OpenAI-compatible endpoint that always answers 429 without a Retry-After header."""

    def __init__(self) -> None:
        self.requests = 0
        self.port = processes.free_port()
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _chat(self, request: web.Request) -> web.Response:
        self.requests += 1
        return web.json_response({"error": {"message": "slow down", "type": "rate_limit_error"}}, status=429)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    def stop(self) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_429_without_retry_after_and_connection_refused(fstack: Stack, tmp_path: Path) -> None:
    """Answering models that never work: backoff without a server hint, and a dead api_base."""
    stub = _Stub()
    stub.start()
    try:
        n = 3
        path, script = generated_benchmark(tmp_path / "dead.yaml", n, rubric=False, prefix="Unreachable")
        fstack.post_script(script)
        for base, expect in ((f"http://127.0.0.1:{stub.port}/v1", ["rate_limit", "HTTP 429", "after 3 attempt(s)"]),
                             (f"http://127.0.0.1:{processes.free_port()}/v1", ["connection", "after 3 attempt(s)"])):
            config = fstack.config("template_only", answer_kw=_models(), judge_kw=_models())
            config.answering_models[0].api_base = base
            plan = plan_and_submit(fstack, path, config)
            wait_results(fstack, plan.run_id, n, timeout=60)  # bounded: every job finalized within the limit
            for r in results_of(fstack, plan.run_id).values():
                assert not r.metadata.completed_without_errors
                assert r.metadata.error.startswith("generate_answer: LLMError: ")
                for part in expect:
                    assert part in r.metadata.error, (part, r.metadata.error)
        assert stub.requests == 3 * n, "max_retries=2: three attempts per answer, then the give-up"
    finally:
        stub.stop()


def _tokens(r: VerificationResult) -> int:
    usage = (r.template.usage_metadata if r.template else None) or {}
    return int((usage.get("total") or {}).get("total_tokens", 0))


def test_token_budget_stops_dispatch(fstack: Stack, tmp_path: Path) -> None:
    n = 60
    path, script = generated_benchmark(tmp_path / "budget.yaml", n, rubric=False, prefix="Budget")
    fstack.post_script(script)
    config = fstack.config("template_only", answer_kw={"max_concurrency": 2}, judge_kw={"max_concurrency": 2})
    # measure what one job costs, then allow about ten
    probe_path, probe_script = generated_benchmark(tmp_path / "probe.yaml", 4, rubric=False, prefix="Budget")
    probe = plan_and_submit(fstack, probe_path, config)
    wait_results(fstack, probe.run_id, 4, timeout=60)
    per_job = max(_tokens(r) for r in results_of(fstack, probe.run_id).values())
    budget = 10 * per_job
    plan = plan_and_submit(fstack, path, config, budget=budget)
    assert plan.run_event.config["budget_tokens"] == budget
    wait_results(fstack, plan.run_id, n, timeout=60)
    res = list(results_of(fstack, plan.run_id).values())
    stopped = [r for r in res if r.metadata.error and "BudgetExhausted" in r.metadata.error]
    done = [r for r in res if r.metadata.completed_without_errors]
    assert len(stopped) + len(done) == n
    assert len(stopped) >= n // 2, f"dispatch stopped: {len(stopped)} of {n} not generated"
    assert len(done) >= 10
    assert all("budget exhausted" in r.metadata.error and str(budget) in r.metadata.error for r in stopped)
    assert all(_tokens(r) == 0 for r in stopped), "a stopped job called no model"
    spent = sum(_tokens(r) for r in done)
    print(f"budget {budget} tokens (~10 jobs of {per_job}): {len(done)} jobs done, {len(stopped)} stopped, "
          f"{spent} tokens spent")
    # overshoot: what was in flight when the budget ran out (4 generation workers) plus what the
    # services spent during the counters' flush and read delays (<= ~0.5 s at 100 ms per call)
    assert budget <= spent <= budget + 20 * per_job, (budget, spent, per_job)
    time.sleep(0.6)  # the services flush their counters every 0.2 s
    assert sync(runcontrol.run_usage(fstack.settings, plan.run_id)) == spent
    # `veribus status RUN` says so
    wait_projected(fstack, plan.run_id, n)
    problems = status.run_problems(fstack.settings, plan.run_id)
    assert (problems["budget_tokens"], problems["tokens_spent"], problems["budget_stopped"]) == \
        (budget, spent, len(stopped))
    assert f"token budget: {budget}" in status.format_run_problems(problems)


# --------------------------------------------------------------------------------------------
# hostile templates and callable traits (the sandbox, end to end)
# --------------------------------------------------------------------------------------------

HOSTILE_VERIFY = {
    "loop": "while True:\n    pass",
    "alloc": "blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 1024 * 1024))",
    "exit": "import os\nos._exit(7)",
    "fork": "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(120)\n    os._exit(0)\n"
            "raise RuntimeError(f'forked child {{pid}}')",
    "write": "open({target!r}, 'w').write('written by a template')\nreturn True",
    "socket": "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hello')\n"
              "s.close()\nreturn True",
}
HANG_TRAIT = {"name": "Hang", "kind": "boolean", "callable_code": "def evaluate(trace):\n    while True:\n        pass\n"}


@pytest.fixture(scope="module")
def hostile_run(fstack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One run: a normal question, one per hostile verify(), a hostile class body, a hanging
    callable trait. Yields what the tests check; kills any process a template forked."""
    import yaml

    tmp = tmp_path_factory.mktemp("hostile")
    listener = Listener()
    target = str(Path(fstack.settings.home) / "logs" / "written-by-template.txt")  # outside any temp dir
    # the fork case runs last, in a run of its own: under root its child survives and keeps the
    # worker's pipes open, which would blur what the other cases report (see test_template_cannot_fork)
    names = ["normal", *(k for k in HOSTILE_VERIFY if k != "fork"), "classbody_exit", "hang_trait"]
    path, script = generated_benchmark(tmp / "hostile.yaml", len(names), rubric=False, wrong_every=0, prefix="Hostile")
    doc = yaml.safe_load(path.read_text())
    for i, name in enumerate(names):
        q = doc["questions"][i]
        q["id"] = name
        if name in HOSTILE_VERIFY:
            body = HOSTILE_VERIFY[name].format(target=target, port=listener.port)
            q["template"] = int_template(2 * i, body)
        elif name == "classbody_exit":
            q["template"] = "import os\nos._exit(1)\n" + q["template"]
        elif name == "hang_trait":
            q["rubric"] = {"callable_traits": [HANG_TRAIT],
                           "regex_traits": [{"name": "SaysSum", "pattern": "sum"}]}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    fstack.post_script(script)
    service_pids = {p.name: p.pid for p in fstack.reload().procs}
    config = fstack.config("template_and_rubric", template_timeout_s=2.0)
    plan = plan_and_submit(fstack, path, config)
    forked: list[int] = []
    try:
        wait_results(fstack, plan.run_id, len(names), timeout=120)
        res = {r.metadata.question_id: r for r in results_of(fstack, plan.run_id).values()}
        fork_path, fork_script = generated_benchmark(tmp / "fork.yaml", 1, rubric=False, wrong_every=0,
                                                     prefix="Forking")
        fdoc = yaml.safe_load(fork_path.read_text())
        fdoc["questions"][0]["id"] = "fork"
        fdoc["questions"][0]["template"] = int_template(0, HOSTILE_VERIFY["fork"].format())
        fork_path.write_text(yaml.safe_dump(fdoc, sort_keys=False))
        fstack.post_script(fork_script)
        fork_plan = plan_and_submit(fstack, fork_path, fstack.config("template_only", template_timeout_s=2.0))
        wait_results(fstack, fork_plan.run_id, 1, timeout=60)
        res.update({r.metadata.question_id: r for r in results_of(fstack, fork_plan.run_id).values()})
        for r in res.values():
            err = (r.metadata.error or "") + " " + ((r.template.field_verification_error if r.template else "") or "")
            if "forked child " in err:
                forked.append(int(err.split("forked child ")[1].split()[0].strip("'\".,)")))
        yield {"results": res, "service_pids": service_pids, "target": target,
               "listener": listener, "forked": forked}
    finally:
        for pid in forked:  # a runaway child a template forked: stop it, by PID
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        listener.close()
        Path(target).unlink(missing_ok=True)


def test_hostile_templates_are_stopped_and_recorded(fstack: Stack, hostile_run: dict[str, Any]) -> None:
    res = hostile_run["results"]
    assert res["normal"].metadata.completed_without_errors and res["normal"].template.verify_result is True
    expect = {
        "loop": "exceeded",  # wall time (2 s) or CPU limit
        "alloc": "memory limit",
        "exit": "exited with code 7",
        "classbody_exit": "template",
    }
    for name, part in expect.items():
        r = res[name]
        assert not r.metadata.completed_without_errors, name
        assert part in (r.metadata.error or ""), (name, r.metadata.error)
    # the hanging callable trait is stopped and recorded on its own trait; the other trait scores
    rub = res["hang_trait"].rubric
    assert rub is not None and rub.trait_errors and "Hang" in rub.trait_errors
    assert "exceeded" in rub.trait_errors["Hang"]
    assert rub.regex_trait_scores == {"SaysSum": True}
    assert res["hang_trait"].template.verify_result is True
    # no service died or was replaced
    now = {p.name: p.pid for p in fstack.reload().procs}
    assert now == hostile_run["service_pids"]
    assert all(p.alive() for p in fstack.state.procs)




def test_template_cannot_fork(hostile_run: dict[str, Any]) -> None:
    r = hostile_run["results"]["fork"]
    assert not [pid for pid in hostile_run["forked"] if psutil_alive(pid)], "a forked child outlived the call"
    # verify() errors are non-fatal (spec/003 stage 8): the refused fork is a field verification error
    assert r.template is not None and r.template.verify_result is False
    assert "Error" in (r.template.field_verification_error or ""), r.template.field_verification_error


def psutil_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_template_cannot_write_outside_a_temp_dir(hostile_run: dict[str, Any]) -> None:
    assert not Path(hostile_run["target"]).exists()
    t = hostile_run["results"]["write"].template
    assert t is not None and t.verify_result is False and "Error" in (t.field_verification_error or "")


def test_template_cannot_open_a_socket(hostile_run: dict[str, Any]) -> None:
    assert hostile_run["listener"].connections == 0
    t = hostile_run["results"]["socket"].template
    assert t is not None and t.verify_result is False and "Error" in (t.field_verification_error or "")
