"""`veribus bench --rebuild`: projector rebuild throughput (issue 12: >= 50,000 events/s).

A real nats-server gets a stream of generated events for many results, in the mix and wire form
a run publishes (`run.requested`, then per result `answer.requested`, the four template-branch
stage events and `result.finalized`; lean jobs, compact stage logs and results), published
directly: no services, no model calls. Then `projections rebuild` folds the stream into a fresh
embedded ClickHouse (chdb) in a process of its own, as `veribus projections rebuild` runs
(`python -m bench.rebuild`: the rebuild only, its report as JSON; not this process, whose heap
holds what it generated and published, and whose size every forked worker's page tables would
copy), and the figure is stream events per second of that rebuild. Figures, not assertions: the
machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

from bench.targets import figure
from shared.control import rebuild
from shared.control.nats_nodes import standalone_nats
from shared.core import events
from shared.core.config import Settings
from shared.core.fold import fold_result
from shared.runtime import bus

TARGET_EVENTS_PER_S = 50_000
PER_RESULT = 6  # answer.requested, answer.generated, guards.checked, template.parsed, template.verified, finalized


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--rebuild", action="store_true",
                   help="instead: fill a stream with generated events and time `projections rebuild` into chdb")
    b.add_argument("--rebuild-events", type=int, default=120_000, help="about this many events for --rebuild")
    b.add_argument("--rebuild-runs", type=int, default=10, help="runs the --rebuild events are spread over")


def _spec(name: str) -> events.ModelSpec:
    return events.ModelSpec(model_name=name, id=name, api_base="http://127.0.0.1:9/v1")


def _full_job(run_id: str, i: int, timestamp: str) -> events.Job:
    return events.Job(
        run_id=run_id, result_id=f"{i:016x}", answer_id=f"a{i:015x}", question_id=f"bench-{i}",
        question_text=f"Bench question {i}: what is {i} plus {i}?", answering=_spec("openai/bench-answerer"),
        parsing=_spec("openai/bench-judge"), timestamp=timestamp, template_id=f"{i:032x}",
        raw_answer=str(2 * i), options={"abstention_enabled": False})


def _lean(job: events.Job, *, keep_result_id: bool) -> events.Job:
    """The job as a lean event carries it (contents by hash, ids from the envelope)."""
    refs = {"q": f"c_q{job.result_id[:14]}", "o": "c_optionsoftherun", "m": "c_modelsoftherun"}
    return events.Job(answer_id=job.answer_id if keep_result_id else "", result_id=job.result_id if keep_result_id else "",
                      refs=refs)


def _usage(model: str, tin: int, tout: int) -> dict[str, Any]:
    return {"input_tokens": tin, "output_tokens": tout, "total_tokens": tin + tout, "model": model,
            "model_calls": 1, "cached_replies": 0}


def _record(stage: str, status: str, start: float, took: float, reason: str = "") -> events.StageRecord:
    return events.StageRecord(stage=stage, status=status, reason=reason, started_at=start,  # type: ignore[arg-type]
                              ended_at=start + took)


def result_events(run_id: str, i: int, timestamp: str, t0: float) -> list[events.Envelope]:
    """One result's events, as the services publish them (template-only, one in ten wrong)."""
    job = _full_job(run_id, i, timestamp)
    value = 2 * i + 1 if i % 10 == 0 else 2 * i
    answer = f"The sum is {value}."
    state = events.State(started_at=t0, template={"raw_llm_response": answer, "trace_messages": []},
                         usage={"answer_generation": _usage("openai/bench-answerer", 29, 4)},
                         stages=[_record("generate_answer", "performed", t0, 0.04)])
    out: list[tuple[str, Any]] = [(events.ANSWER_REQUESTED, events.AnswerRequested(jobs=[_lean(job, keep_result_id=True)]))]
    lean = _lean(job, keep_result_id=False)

    def stage_event(et: str, st: events.State) -> None:
        out.append((et, events.StageEvent(job=lean, state=events.lean_state(st))))
        st.stages = []  # each event carries its own stage's records

    stage_event(events.ANSWER_GENERATED, state)
    state.root = {"used_full_trace": False, "evaluation_input": answer}
    state.stages = [_record(s, "skipped", t0 + 0.1, 1e-6, r) for s, r in (
        ("recursion_limit_autofail", "recursion limit not reached"), ("trace_validation_autofail", "not an MCP agent trace"),
        ("abstention_check", "abstention_enabled is false"), ("sufficiency_check", "sufficiency_enabled is false"))]
    stage_event(events.GUARDS_CHECKED, state)
    state.usage["parsing"] = _usage("openai/bench-judge", 146, 3)
    state.signals.parsed = {"value": value}
    state.stages = [_record("parse_template", "performed", t0 + 0.2, 0.06)]
    stage_event(events.TEMPLATE_PARSED, state)
    state.template.update({"template_verification_performed": True, "verify_result": value == 2 * i,
                           "parsed_llm_response": {"value": value}, "parsed_gt_response": {"value": 2 * i},
                           "regex_validations_performed": False, "regex_validation_results": {},
                           "regex_validation_details": {}, "regex_overall_success": True,
                           "regex_extraction_results": {}})
    state.signals.field_verification_result = value == 2 * i
    state.stages = [_record("verify_template", "performed", t0 + 0.3, 0.02),
                    _record("embedding_check", "skipped", t0 + 0.32, 1e-6, "embedding check disabled"),
                    _record("deep_judgment_autofail", "skipped", t0 + 0.32, 1e-6, "deep judgment disabled")]
    stage_event(events.TEMPLATE_VERIFIED, state)
    dump = fold_result(job, state, None, t0 + 0.4).model_dump(mode="json")
    out.append((events.RESULT_FINALIZED, events.ResultFinalized.wire(dump)))
    envs = []
    for k, (et, payload) in enumerate(out):
        rid = job.answer_id if et == events.ANSWER_REQUESTED else job.result_id
        env = events.make_envelope(et, run_id, rid, payload, f"{et.split('.')[0]}/0.1.0")
        env.occurred_at = t0 + 0.05 * k
        envs.append(env)
    return envs


def generate(n_events: int, runs: int) -> list[events.Envelope]:
    """About `n_events` events over `runs` runs (each run: run.requested + its results' events)."""
    per_run = max(1, n_events // max(1, runs) // PER_RESULT)
    out: list[events.Envelope] = []
    t0 = time.time() - 3600
    for r in range(runs):
        run_id = f"20250101T0000{r:02d}-bench{r:03d}"
        timestamp = f"2025-01-01T00:00:{r:02d}+00:00"
        out.append(events.make_envelope(events.RUN_REQUESTED, run_id, events.RUN_KEY, events.RunRequested(
            run_id=run_id, timestamp=timestamp, job_count=per_run, answer_count=per_run, benchmark_name="bench",
            config={"answering_models": ["openai/bench-answerer"], "parsing_models": ["openai/bench-judge"]}),
            "cli/0.1.0"))
        for i in range(per_run):
            out.extend(result_events(run_id, r * per_run + i + 1000, timestamp, t0 + r))
    return out


async def _fill(settings: Settings, envs: list[events.Envelope]) -> tuple[int, int]:
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        await bus.ensure_stream(js, settings)
        await bus.publish_many(js, envs, window=1024)
        info = await js.stream_info(events.STREAM)
        return int(info.state.messages), int(info.state.bytes)


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the rebuild's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(n_events: int, runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="veribus-bench-rebuild-") as tmp:
        home = Path(tmp)
        proc, url = standalone_nats(home / "nats")
        try:
            settings = Settings(home=home / "home", nats_url=url)
            t = time.perf_counter()
            envs = generate(n_events, runs)
            gen_s = time.perf_counter() - t
            t = time.perf_counter()
            messages, nbytes = asyncio.run(_fill(settings, envs))
            fill_s = time.perf_counter() - t
            del envs
            server = psutil.Process(proc.pid)
            _settle(server)
            server_cpu, cpu = sum(server.cpu_times()[:2]), _cpu_s()
            rep = _rebuild_in_a_process(settings)
            # CPU per event is the figure to compare on a shared machine (rates follow the load);
            # the rebuild's process and its workers, start-up included
            cpu_us = 1e6 * (_cpu_s() - cpu) / messages
            server_us = 1e6 * (sum(server.cpu_times()[:2]) - server_cpu) / messages
            return {"events": messages, "stream_bytes": nbytes, "generate_s": round(gen_s, 2),
                    "publish_s": round(fill_s, 2), "rebuild_s": round(rep["elapsed_s"], 3),
                    "events_per_s": round(messages / rep["elapsed_s"]) if rep["elapsed_s"] else None,
                    "fold_s": round(rep["fold_s"], 3),
                    "fold_events_per_s": round(messages / rep["fold_s"]) if rep["fold_s"] else None,
                    "cpu_us_per_event": round(cpu_us, 1), "nats_server_cpu_us_per_event": round(server_us, 1),
                    "rows": rep["rows"], "mode": rep["mode"]}
        finally:
            proc.terminate()
            proc.wait(10)


def _settle(server: psutil.Process, idle: float = 0.05, limit_s: float = 15.0) -> None:
    """Wait until nats-server is done with the publish (its file store writes and flushes: it
    uses under `idle` of a core over half a second), as a stream is at rest when it is rebuilt."""
    deadline = time.monotonic() + limit_s
    before = sum(server.cpu_times()[:2])
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(server.cpu_times()[:2])
        if now - before < idle * 0.5:
            return
        before = now


def _rebuild_in_a_process(settings: Settings) -> dict[str, Any]:
    """`rebuild_projections` in a fresh `python -m bench.rebuild` (its report as JSON on stdout)."""
    env = {**os.environ, "VERIBUS_HOME": str(settings.home), "VERIBUS_NATS_URL": settings.nats_url}
    out = subprocess.run([sys.executable, "-m", "bench.rebuild"], env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"the rebuild process failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child() -> int:
    """The rebuild process: the stream at VERIBUS_NATS_URL into a fresh chdb under VERIBUS_HOME."""
    rep = rebuild.rebuild_projections(Settings.from_env("home", "nats_url"), timeout=1800)
    print(json.dumps({"elapsed_s": rep.elapsed_s, "fold_s": rep.fold_s, "mode": rep.mode,
                      "rows": {k: v[0] for k, v in rep.after.items()}}))
    return 0


def main(args: argparse.Namespace) -> int:
    row = measure(args.rebuild_events, args.rebuild_runs)
    print(f"\n== projections rebuild: {row['events']} events ({row['stream_bytes']} bytes) in {row['rebuild_s']} s, "
          f"{row['mode']} (no projector running) into a fresh chdb, in a process of its own")
    print(f"  of which folding the stream (read, project, insert): {row['fold_s']} s; the rest opens chdb, "
          "drops and creates the tables and fingerprints them before and after")
    print(f"  CPU per event, the whole command (its process, start-up included, and its workers): "
          f"{row['cpu_us_per_event']} us; "
          f"nats-server: {row['nats_server_cpu_us_per_event']} us")
    print(f"  rows after: {row['rows']}")
    print(f"  (generated in {row['generate_s']} s, published in {row['publish_s']} s; not part of the figure)")
    print("\nIssue 12 figures vs targets (on a shared machine figures vary from run to run):")
    print(figure("rebuild events/s, fold", row["fold_events_per_s"], f">= {TARGET_EVENTS_PER_S:,}"))
    print(figure("rebuild events/s, whole command", row["events_per_s"]))
    print("\n" + msgspec.json.format(msgspec.json.encode(row)).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(_child())
