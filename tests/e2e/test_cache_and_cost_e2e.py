"""Issue 12, must-haves 3 and 4 on the whole stack: the opt-in response cache across runs (a
second identical `veribus run --cache` makes zero model calls and says so; `veribus cache clear`
empties it), and the money budget (`budget_cost_usd`) stopping dispatch like the token budget."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.control import lifecycle, runner, wait
from shared.core.benchmark.model import Benchmark
from shared.runtime import bus
from shared.runtime.costcontrol import run_cost_spent, set_cost_budget
from tests.support.stack import (
    Stack,
    generated_benchmark,
    log_lines,
    plan_and_submit,
    results_of,
    start_stack,
    stop_stack,
    sync,
    wait_results,
    wait_services_idle,
)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
N = 12


@pytest.fixture(scope="module")
def cstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("cache") / "home"
    st = start_stack(home, simulator_args=["--latency-ms", "100"], extra_env={"VERIBUS_GENERATION_WORKERS": "4"})
    try:
        yield st
    finally:
        stop_stack(st)


def _veribus(st: Stack, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VERIBUS_HOME": st.state.home, "PYTHONPATH": str(REPO)}
    env.pop("VERIBUS_NATS_URL", None)
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _calls(out: str) -> tuple[int, int]:
    m = re.search(r"Model calls: (\d+)(?: \((\d+) repl(?:y|ies) without a call: response cache or regraded answers\))?", out)
    assert m, out
    return int(m.group(1)), int(m.group(2) or 0)


def test_second_identical_run_makes_no_model_calls(cstack: Stack, tmp_path: Path) -> None:
    path, _ = generated_benchmark(tmp_path / "cached.yaml", N, rubric=False, prefix="Cached")
    args = ["run", str(path), "--simulate", "--mode", "template_only", "--cache", "--timeout", "180"]
    assert _veribus(cstack, "cache", "clear").returncode == 0

    first = _veribus(cstack, *args)
    assert first.returncode == 0, first.stderr + first.stdout
    calls, cached = _calls(first.stdout)
    assert calls >= 2 * N and cached == 0  # an answer and a parse per question

    before = cstack.sim_stats()["requests"]
    second = _veribus(cstack, *args)
    assert second.returncode == 0, second.stderr + second.stdout
    assert _calls(second.stdout) == (0, 2 * N)  # says so ...
    assert cstack.sim_stats()["requests"] == before  # ... and the model server saw nothing

    plain = _veribus(cstack, *args[:-3], "--timeout", "180")  # without --cache: opt-in, so calls again
    assert plain.returncode == 0 and _calls(plain.stdout)[0] >= 2 * N

    info = json.loads(_veribus(cstack, "cache", "info", "--format", "json").stdout)
    assert info["vb_llm_cache_shared"]["entries"] >= 2 * N
    cleared = _veribus(cstack, "cache", "clear")
    assert cleared.returncode == 0 and re.search(r"vb_llm_cache_shared: (\d+) entries removed", cleared.stdout)
    assert int(re.search(r"vb_llm_cache_shared: (\d+)", cleared.stdout).group(1)) >= 2 * N  # type: ignore[union-attr]
    third = _veribus(cstack, *args)
    assert third.returncode == 0 and _calls(third.stdout)[0] >= 2 * N  # cleared: asked again


def test_replicates_and_models_ask_the_judge_themselves(cstack: Stack, tmp_path: Path) -> None:
    """Without --cache, two answering models x six replicates of the example benchmark, whose
    scripted simulator answers are the same text every time, so the judge's requests repeat:
    every job still asks the judge itself (as the reference does: replicates stay independent);
    none is served from the run-scoped cache, which is there for a redelivery of the same job."""
    out = _veribus(cstack, "run", str(REPO / "examples" / "example.yaml"), "--simulate", "--mode", "template_only",
                   "--model", "openai/sim-a", "--model", "openai/sim-b", "--replicates", "6", "--timeout", "180")
    assert out.returncode in (0, 4), out.stderr + out.stdout  # the example has questions the simulator fails
    calls, cached = _calls(out.stdout)
    assert cached == 0, out.stdout
    jobs = int(re.search(r"(\d+) jobs", out.stdout + out.stderr).group(1))  # type: ignore[union-attr]
    assert calls >= 2 * jobs, out.stdout  # an answer and a parse per job


def test_cost_budget_stops_dispatch(cstack: Stack, tmp_path: Path) -> None:
    n = 40
    path, script = generated_benchmark(tmp_path / "costly.yaml", n, rubric=False, prefix="Costly")
    cstack.post_script(script)
    price = {"input_cost_per_million_tokens": 1000.0, "output_cost_per_million_tokens": 2000.0,
             "max_concurrency": 2}
    config = cstack.config("template_only", answer_kw=price, judge_kw=price)
    probe_path, _ = generated_benchmark(tmp_path / "probe.yaml", 3, rubric=False, prefix="Costly")
    probe = plan_and_submit(cstack, probe_path, config)
    wait_results(cstack, probe.run_id, 3, timeout=60)
    per_job = max(r.template.usage_metadata["total"]["cost_usd"] for r in results_of(cstack, probe.run_id).values())
    assert per_job > 0
    budget = 8 * per_job
    plan = runner.plan_run(Benchmark.load(path), config)
    set_cost_budget(plan.run_event, budget)
    sync(runner.submit(cstack.settings, plan))
    wait_results(cstack, plan.run_id, n, timeout=120)
    res = list(results_of(cstack, plan.run_id).values())
    stopped = [r for r in res if r.metadata.error and "cost budget exhausted" in r.metadata.error]
    done = [r for r in res if r.metadata.completed_without_errors]
    assert len(stopped) + len(done) == n
    assert len(stopped) >= n // 2, f"dispatch stopped: only {len(stopped)} of {n} not generated"
    assert len(done) >= 8
    assert all(r.template is None or not r.template.usage_metadata
               or not r.template.usage_metadata.get("total", {}).get("model_calls") for r in stopped)  # no calls
    spent = sum(r.template.usage_metadata["total"]["cost_usd"] for r in done)
    assert budget <= spent <= budget + 20 * per_job, (budget, spent, per_job)
    time.sleep(0.6)  # services flush their counters every 0.2 s

    async def counter() -> float:
        nc = await bus.connect(cstack.settings)
        try:
            return await run_cost_spent(nc.jetstream(), plan.run_id)
        finally:
            await nc.close()

    assert sync(counter()) == pytest.approx(spent, abs=1e-5)

    # resume with a larger money budget (`veribus resume --max-cost-usd`): only the stopped jobs
    # run again, and the run ends with every job's real result
    wait_services_idle(cstack)
    with pytest.raises(ValueError, match="positive amount"):
        sync(lifecycle.resume(cstack.settings, plan.run_id, budget_cost_usd=float("nan")))  # refused before publishing
    again = sync(lifecycle.resume(cstack.settings, plan.run_id, budget_cost_usd=budget + 2 * n * per_job))
    assert again.stopped == len(stopped) and again.jobs == len(stopped)
    before = {r.metadata.result_id: 1 for r in stopped}
    done_now, timed_out = sync(wait.wait_for_results(cstack.settings, plan.run_id, result_ids=list(before),
                                                     baseline=before, timeout=120))
    assert not timed_out, f"{done_now}/{len(before)} resumed"
    res = list(results_of(cstack, plan.run_id).values())
    assert len(res) == n and all(r.metadata.completed_without_errors for r in res), \
        ([r.metadata.error for r in res if not r.metadata.completed_without_errors][:3],
         log_lines(cstack, "generation", "run control"))


def test_an_answer_shared_by_two_judges_is_one_call(cstack: Stack, tmp_path: Path) -> None:
    """The user's report: with two judges every output counted each answer call twice (`Model
    calls: 432` for 360 requests the simulator saw, and twice the cost, beside a --max-cost-usd
    that the real spend kept). The answer's first job counts its call and cost; the other judge's
    job carries its tokens only. The summary's calls are the requests the model server got."""
    path, _ = generated_benchmark(tmp_path / "judges.yaml", N, rubric=False, prefix="TwoJudges")
    before = cstack.sim_stats()["requests"]
    out = _veribus(cstack, "run", str(path), "--simulate", "--mode", "template_only", "--judge", "judge-a",
                   "--judge", "judge-b", "--timeout", "180")
    assert out.returncode == 0, out.stderr + out.stdout
    calls, cached = _calls(out.stdout)
    sent = cstack.sim_stats()["requests"] - before
    assert (calls, cached) == (sent, 0) and sent == 3 * N, (calls, sent, out.stdout)  # N answers, 2N parses
