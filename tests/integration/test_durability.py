"""Invariant 1 (exactly-once effect) on the real multi-process stack: redelivered, republished and
replayed events leave `events` and `verification_results` unchanged; `projections rebuild`
refolds identical tables; `resume`, `regrade` and `cancel` through the real services and
through the `veribus` command itself (`python -m shared.cli`). The stack helpers are in
`tests/support/stack.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from bench.workload import expected_verdicts, int_template
from shared.control import lifecycle, processes, rebuild, runner, stack, streams, wait
from shared.control.runref import list_runs
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import Settings
from shared.runtime import bus
from tests.conftest import REPO
from tests.support.stack import (
    Stack,
    generated_benchmark,
    plan_and_submit,
    republish_all,
    results_of,
    rows,
    start_stack,
    stop_stack,
    sync,
    table_snapshot,
    verdicts,
    wait_projected,
    wait_projector_idle,
    wait_results,
    wait_services_idle,
)

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
    admin = dstack.settings.model_copy(update={"nats_role": "admin"})  # replays service events: the admin role
    sent, dup = sync(republish_all(admin, plan.run_id))
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
    processes.stop_proc(projector)
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

    # changing the stream's duplicate window is the admin role's (cli may not reconfigure the stream)
    admin = dstack.settings.model_copy(update={"nats_role": "admin"})

    async def republish(window: float | None, new_ids: bool) -> None:
        nc = await bus.connect(admin)
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

    sync(republish(None, new_ids=True))  # inside the window, another message id: handled again
    wait_services_idle(dstack)
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
        rerun = {j.result_id for r in again for j in r.jobs}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            counts = sync(wait.finalized_counts(dstack.settings, plan.run_id))
            if all(counts.get(rid, 0) >= 2 for rid in rerun):
                break
            time.sleep(0.25)
        # ten results finalized a second time (a third is possible: with a 0.2 s window a service's
        # publish retried after a slow PubAck is a new message too), the others once ...
        assert {rid for rid, n in counts.items() if n >= 2} == rerun, counts
        assert len(counts) == N and all(n == 1 for rid, n in counts.items() if rid not in rerun), counts
        wait_services_idle(dstack)
        wait_projector_idle(dstack)
        after = table_snapshot(dstack, plan.run_id)
        # ... and still one row per event id and per result id, with the same verdicts
        assert [(r[0], r[2], r[3]) for r in after["results"]] == [(r[0], r[2], r[3]) for r in before["results"]]
        assert [r[0] for r in after["events"]] == [r[0] for r in before["events"]]
        # the re-runs were answered from the run-scoped response cache: no new answering calls
        assert dstack.sim_stats()["by_model"].get("sim-answerer", 0) == answers_before
    finally:
        sync(_restore_window(admin))


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
    # what the cancel stops is said: the jobs answered so far go on, the rest finalize as cancelled
    assert 2 <= out.finalized <= out.generated < n, (out.finalized, out.generated)
    with pytest.raises(streams.LifecycleError, match="still queued"):
        sync(lifecycle.resume(dstack.settings, plan.run_id))  # the run is still in flight
    wait_results(dstack, plan.run_id, n, timeout=60)  # cancelled jobs finalize within the limit
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


def test_resume_errors_runs_only_the_errored_jobs_again(dstack: Stack, tmp_path: Path) -> None:
    """`resume --errors`: a run with jobs that ended in errors (the answer model failed every
    retry for three questions, the judge for two) is not finished by a plain resume, which
    names them; with --errors exactly those five run again, the two whose answers were made
    get them from the run's cache (no answer call), and every job ends passing. While they
    run, the run is not over (`run_finished`) and `runs` says running."""
    n = 12
    path, script = generated_benchmark(tmp_path / "errors.yaml", n, prefix="Errorful", wrong_every=0)
    broken = dict(script)
    broken["questions"] = [
        {**q, "answer_errors": ["500"] * 3} if i < 3 else {**q, "judge_errors": ["500"] * 3} if i < 5 else q
        for i, q in enumerate(script["questions"])]
    dstack.post_script(broken)
    config = dstack.config("template_only", answer_kw={"max_retries": 2, "timeout": 3.0}, judge_kw={"max_retries": 2})
    plan = plan_and_submit(dstack, path, config)
    wait_results(dstack, plan.run_id, n, timeout=90)
    wait_services_idle(dstack)
    first = results_of(dstack, plan.run_id)
    errored = sorted(r.metadata.result_id for r in first.values() if not r.metadata.completed_without_errors)
    assert len(errored) == 5, [r.metadata.error for r in first.values()]

    plain = sync(lifecycle.plan_resume(dstack.settings, plan.run_id))
    assert (plain.jobs, plain.errored) == (0, 5)  # errors stay unless asked for
    # the provider is well again, but slow to give the three answers (each first call times out
    # after 3 s, and its retry answers): the re-run is still going when it is looked at
    dstack.post_script({**script, "questions": [{**q, "answer_errors": ["slow"]} if i < 3 else q
                                                for i, q in enumerate(script["questions"])]})
    stats = dstack.sim_stats()
    again = sync(lifecycle.resume(dstack.settings, plan.run_id, include_errors=True))
    assert (again.jobs, again.errored) == (5, 5)
    assert sorted(j.result_id for r in again.requests for j in r.jobs) == errored
    assert not sync(_run_finished(dstack.settings, plan.run_id))  # its errored results are not its end
    wait_projector_idle(dstack)  # the resume's lift is in ClickHouse
    (row,) = [r for r in list_runs(dstack.settings, limit=0) if r["run_id"] == plan.run_id]
    assert row["state"] == "running" and row["resumed"] >= 3, row
    before = {rid: 1 for rid in errored}
    done, timed_out = sync(wait.wait_for_results(dstack.settings, plan.run_id, result_ids=errored,
                                                 baseline=before, timeout=90))
    assert not timed_out, f"{done}/5 re-run"
    assert sync(_run_finished(dstack.settings, plan.run_id))
    res = results_of(dstack, plan.run_id)
    assert [r.metadata.error for r in res.values() if not r.metadata.completed_without_errors] == []
    assert all(r.template.verify_result for r in res.values())
    after = dstack.sim_stats()
    # three answers (each asked twice: the slow call, which the simulator does not count as an answer,
    # and its retry) and five parses; the judge-errored two had their answers in the run's cache
    assert (after["answer"] - stats["answer"], after["judge"] - stats["judge"]) == (3, 5)
    assert after["requests"] - stats["requests"] == 3 * 2 + 5
    wait_projected(dstack, plan.run_id, n)
    wait_projector_idle(dstack)
    (row,) = [r for r in list_runs(dstack.settings, limit=0) if r["run_id"] == plan.run_id]
    assert (row["state"], row["done"], row["errors"], row["passed"]) == ("done", n, 0, n)


async def _run_finished(settings: Settings, run_id: str) -> bool:
    async with bus.session(settings) as nc:
        return await lifecycle.run_finished(nc.jetstream(), run_id)


def test_regrade_uses_stored_answers(dstack: Stack, finished_run, tmp_path: Path) -> None:
    """regrade with changed templates: a new run linked to the parent, verify results follow
    the new templates, and the answering model is not called."""
    plan, path = finished_run
    doc = yaml.safe_load(path.read_text())
    for i, q in enumerate(doc["questions"]):  # the new checkpoint accepts the "wrong" answers too
        if i % 10 == 0:
            q["template"] = int_template(2 * i + 1)
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
def veribus_cli(st: Stack, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real `veribus` command (`shared.cli.main`, its parser and its exit mapping)."""
    env = {**os.environ, "VERIBUS_HOME": str(st.settings.home)}
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], cwd=REPO, env=env, capture_output=True,
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
    # judged again by the simulator: the regrade's report says SIMULATED, as its rows do
    simulated = veribus_cli(dstack, "regrade", plan.run_id, "--simulate", "--timeout", "60")
    assert simulated.returncode == 0, simulated.stderr
    regrade_id = re.search(r"^run (\S+) ", simulated.stdout, re.M).group(1)  # type: ignore[union-attr]
    wait_projected(dstack, regrade_id, N)
    out_dir = tmp_path / "regrade-report"
    report = veribus_cli(dstack, "report", regrade_id, "--output", str(out_dir))
    assert report.returncode == 0, report.stderr + report.stdout
    assert "(SIMULATED LLM)" in report.stdout
    assert json.loads((out_dir / "header.json").read_text())["simulated"] is True
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("class Answer(BaseAnswer):", "class Answer(BaseAnswer:", 1))
    refused = veribus_cli(dstack, "regrade", plan.run_id, "--benchmark", str(bad))
    assert refused.returncode == 2 and "q0000" in refused.stderr and "Traceback" not in refused.stderr
    wait_services_idle(dstack)
    wait_projector_idle(dstack)
    rebuilt = veribus_cli(dstack, "projections", "rebuild", "--timeout", "120")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "CHANGED" not in rebuilt.stdout and rebuilt.stdout.count("identical") == 4, rebuilt.stdout
