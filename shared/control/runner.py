"""Submitting a run and following it: plan jobs from a benchmark and a config (refusing bad
input before anything is published), publish them, then collect finalized results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from shared.control.deployment import Unreachable, mask_url
from shared.control.streams import STAGE_DURABLES
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import Settings, VerificationConfig
from shared.core.ids import answer_id_for, compute_result_id, template_id_for
from shared.core.limits import MAX_EVENT_BYTES, question_problems
from shared.core.models import VerificationResult
from shared.runtime import bus
from shared.runtime.content import ContentStore, content_key, lean_requests, put_manifest, with_manifest
from shared.templates.static_checks import compile_check, template_shape_problem


class RunInputError(ValueError):
    """Input refused before publishing; the message names the question/field."""


@dataclass(repr=False)
class RunPlan:
    run_id: str
    timestamp: str
    run_name: str | None
    requests: list[events.AnswerRequested]
    run_event: events.RunRequested
    unfinished: list[str] = field(default_factory=list)
    # (key, bytes) stored in the content bucket before the run is published: what its config refers
    # to by hash (the simulator script beside the benchmark, which a regrade loads again)
    contents: list[tuple[str, bytes]] = field(default_factory=list)

    def __repr__(self) -> str:
        """A summary: `asyncio.run` formats the repr of the plan a coroutine returns (see
        `RunOutcome.__repr__`); every job of 1,000 questions took 0.2 s to format."""
        return (f"RunPlan({self.run_id!r}, {len(self.requests)} requests, {self.job_count} jobs, "
                f"{len(self.unfinished)} unfinished)")

    @property
    def result_ids(self) -> list[str]:
        return [j.result_id for r in self.requests for j in r.jobs]

    @property
    def job_count(self) -> int:
        return sum(len(r.jobs) for r in self.requests)


# The run config's key naming, by content key, the `<name>.simulator.yaml` a simulated run was
# scripted with: the one part of its simulator script its stored jobs cannot make again, which
# `regrade --simulate` loads again (`shared.cli.lifecycle.load_simulator_script`).
SIMULATOR_SCRIPT_KEY = "simulator_script"


def keep_simulator_script(plan: Any, extra: dict[str, Any]) -> None:
    """Store `extra` (a benchmark's `.simulator.yaml`) with the run `plan` publishes (a `RunPlan`, or
    a regrade's), named in its config."""
    data = json.dumps(extra, sort_keys=True, default=str).encode()
    key = content_key(data)
    plan.contents.append((key, data))
    plan.run_event.config[SIMULATOR_SCRIPT_KEY] = key


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def plan_run(
    benchmark: Benchmark,
    config: VerificationConfig,
    *,
    run_id: str | None = None,
    timestamp: str | None = None,
    only_result_ids: set[str] | None = None,
    include_unfinished: bool = False,
) -> RunPlan:
    """One job per finished question x answering model x parsing model x replicate
    (every question with `include_unfinished`)."""
    selected = list(benchmark.questions) if include_unfinished else benchmark.finished_questions()
    problems = []
    mode = config.evaluation_mode
    for q in selected:
        problems += question_problems(q.id, q.text, q.template_code, q.raw_answer)
        if mode != "rubric_only":
            if not q.template_code:
                problems.append(f"question {q.id!r} ({q.text[:50]!r}): no answer template (mode {mode} needs one)")
                continue
            err = compile_check(q.template_code)
            if err:
                problems.append(f"question {q.id!r} ({q.text[:50]!r}): template does not compile: {err}")
            elif missing := template_shape_problem(q.template_code):
                problems.append(f"question {q.id!r} ({q.text[:50]!r}): template: {missing}")
    if problems:
        hint = []
        if mode != "rubric_only" and selected and not any(q.template_code for q in selected):
            hint = ["(no question has a template, as in a Question,Answer CSV: run it with `--mode rubric_only`, "
                    "adding traits with `--rubric FILE` when it has none)"]
        raise RunInputError("refused before publishing:\n  " + "\n  ".join(problems + hint))
    if mode != "template_only":
        has_rubric = (benchmark.global_rubric and not benchmark.global_rubric.is_empty()) or any(
            q.rubric and not q.rubric.is_empty() for q in selected)
        if not has_rubric:
            raise RunInputError(f"evaluation_mode {mode!r} needs rubric traits, and the benchmark has none "
                                "(`veribus run --rubric FILE` adds a global rubric)")

    run_id = run_id or new_run_id()
    timestamp = timestamp or datetime.now(UTC).isoformat()
    options = config.stage_options().model_dump(mode="json")
    few_shot = (config.few_shot_config or {}).get("examples") or []
    requests: list[events.AnswerRequested] = []
    for q in selected:
        rubric = benchmark.rubric_for(q) if mode != "template_only" else None
        rubric_wire = rubric.to_wire() if rubric is not None and not rubric.is_empty() else None
        if rubric_wire is not None and benchmark.global_rubric is not None:
            # which traits are the benchmark's (the rest are the question's): rubric.trait_provenance
            rubric_wire["provenance"] = {n: "global" for n in benchmark.global_rubric.trait_names()}
        for am in config.answering_models:
            a_spec = am.to_spec()
            for rep in range(1, config.replicate_count + 1):
                replicate = rep if config.replicate_count > 1 else None
                jobs = []
                for pm in config.parsing_models:
                    p_spec = pm.to_spec()
                    rid = compute_result_id(q.id, a_spec.canonical_key, p_spec.canonical_key, timestamp, replicate)
                    if only_result_ids is not None and rid not in only_result_ids:
                        continue
                    jobs.append(events.Job(
                        run_id=run_id, result_id=rid,
                        answer_id=answer_id_for(run_id, q.id, a_spec.canonical_key, replicate),
                        question_id=q.id, question_text=q.text, answering=a_spec, parsing=p_spec,
                        timestamp=timestamp, evaluation_mode=mode, run_name=config.run_name,
                        raw_answer=q.raw_answer, keywords=q.keywords or None,
                        template_code=q.template_code if mode != "rubric_only" else None,
                        template_id=template_id_for(q.template_code) if mode != "rubric_only" else "no_template", rubric=rubric_wire, replicate=replicate,
                        options=options, few_shot_examples=list(q.few_shot_examples or few_shot),
                    ))
                if jobs:
                    requests.append(events.AnswerRequested(jobs=jobs))
    oversized = _oversized(requests)
    if oversized:
        raise RunInputError("refused before publishing:\n  " + "\n  ".join(oversized))
    unfinished = [] if include_unfinished else [q.id for q in benchmark.unfinished_questions()]
    run_event = events.RunRequested(
        run_id=run_id, timestamp=timestamp, job_count=sum(len(r.jobs) for r in requests),
        answer_count=len(requests), run_name=config.run_name, benchmark_name=benchmark.name,
        evaluation_mode=mode, config=public_config(config), unfinished_skipped=unfinished,
    )
    return RunPlan(run_id, timestamp, config.run_name, requests, run_event, unfinished)


def _oversized(requests: list[events.AnswerRequested]) -> list[str]:
    """Requests whose event would exceed the bus's message size (one job per judge rides in
    each), measured as encoded, once per question."""
    out: list[str] = []
    seen: set[str] = set()
    for r in requests:
        qid = r.jobs[0].question_id
        if qid in seen:
            continue
        size = len(events.to_json(r))
        if size > MAX_EVENT_BYTES:
            seen.add(qid)
            out.append(f"question {qid!r}: its answer request is {size:,} bytes with {len(r.jobs)} judge(s), over the "
                       f"limit of {MAX_EVENT_BYTES:,}; shorten the question/template/rubric or use fewer judges")
    return out


def public_config(config: VerificationConfig) -> dict:
    """The config as recorded in events: model settings without anything secret."""
    data = config.model_dump(mode="json")
    for key in ("answering_models", "parsing_models"):
        for m in data.get(key, []):
            m.pop("manual_traces", None)
            m["params"] = {k: v for k, v in (m.get("params") or {}).items() if "key" not in k.lower()}
    return data


SUBMIT_FIRST_CHUNK = 32
"""Answer requests in the first published chunk; each next chunk is twice the last."""
SUBMIT_MAX_CHUNK = 1024


def submit_chunks(n: int, first: int = SUBMIT_FIRST_CHUNK, largest: int = SUBMIT_MAX_CHUNK) -> list[slice]:
    """Slices of `n` requests in publishing order: small first, doubling up to `largest`.
    Why: the first jobs reach generation while the rest of the run's contents are still being
    stored, instead of after all of them (about 0.15 s of idle models for 1,000 questions)."""
    out, i, size = [], 0, max(1, first)
    while i < n:
        out.append(slice(i, min(n, i + size)))
        i += size
        size = min(max(1, largest), size * 2)
    return out


async def submit(settings: Settings, plan: RunPlan) -> int:
    """Publish the run and its answer requests; returns how many requests were new. Requests go
    out in chunks (`submit_chunks`), each chunk's contents stored before its jobs are published
    (a job never refers to content the store does not have yet)."""
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        await bus.ensure_stream(js, settings)
        producer = "cli/0.1.0"
        store = ContentStore(lambda: js)  # one store: contents shared by chunks are written once
        if plan.contents:  # what the run's config refers to, stored before the run is
            await store.put_many(plan.contents)
        await bus.publish(js, events.make_envelope(events.RUN_REQUESTED, plan.run_id, events.RUN_KEY,
                                                   plan.run_event, producer))
        # the run's code, announced by hash before any job: only jobs whose code it lists share
        # the run's sandbox processes (`ContentStore.sandbox_scope`)
        manifest = await put_manifest(store, (job for r in plan.requests for job in r.jobs))
        new = 0
        for part in submit_chunks(len(plan.requests)):
            requests = plan.requests[part]
            answer_ids = [r.jobs[0].answer_id for r in requests]  # a lean job leaves its answer id to the subject
            if settings.lean_events:  # contents once, by hash; events carry the hashes
                requests = await lean_requests(store, requests, manifest)
            else:
                requests = [events.AnswerRequested(jobs=[with_manifest(j, manifest) for j in r.jobs]) for r in requests]
            envs = [events.make_envelope(events.ANSWER_REQUESTED, plan.run_id, aid, r, producer)
                    for aid, r in zip(answer_ids, requests, strict=True)]
            new += await bus.publish_many(js, envs)
        return new


async def retrying_now(js: JetStreamContext) -> int:
    """Messages the stage services are retrying right now (redelivered and not yet acknowledged),
    summed over their durable consumers; 0 when that cannot be read."""
    n = 0
    for name in STAGE_DURABLES:
        try:
            ci = await js.consumer_info(events.STREAM, name)
        except Exception:  # noqa: BLE001 - a consumer not created yet, or a reconnecting server
            continue
        n += int(ci.num_redelivered or 0)
    return n


@dataclass(repr=False)
class RunOutcome:
    results: dict[str, VerificationResult]
    dead_letters: list[events.DeadLetter]
    elapsed_s: float
    timed_out: bool = False

    def __repr__(self) -> str:
        """A summary, not every result: `asyncio.run` (Python 3.11, main thread) formats the repr of
        its finished task, result included, when it restores the SIGINT handler, so a dataclass
        repr of 1,000 results cost 0.1-0.3 s after the last one arrived (`collect`'s caller waits)."""
        return (f"RunOutcome({len(self.results)} results, {len(self.dead_letters)} dead letters, "
                f"elapsed_s={self.elapsed_s:.3f}, timed_out={self.timed_out})")


LOST_BUS_S = 5.0  # how long `collect` waits for a lost NATS server to come back before it says so


async def collect(
    settings: Settings,
    run_id: str,
    expected: set[str],
    *,
    progress: Callable[[int, int], None] | None = None,
    timeout: float | None = None,
    on_result: Callable[[VerificationResult], None] | None = None,
    on_tick: Callable[[int], None] | None = None,
    tick_s: float = 2.0,
) -> RunOutcome:
    """Read `result.finalized` events of a run from the stream until every expected result is in.
    `on_result` sees each new result; `on_tick` is called every `tick_s` with the number of
    messages the stage services are retrying right now (redelivered, not yet acknowledged)."""
    start = time.monotonic()
    results: dict[str, VerificationResult] = {}
    dead: list[events.DeadLetter] = []
    dead_ids: set[str] = set()
    done = asyncio.Event()
    async with bus.session(settings, ensure=True) as nc:
        js = nc.jetstream()

        async def on_msg(msg) -> None:  # noqa: ANN001
            try:
                env = events.decode(msg.data, msg.subject)
            except Exception:  # noqa: BLE001 - not a valid event: never a result
                return
            if env.event_type == events.RESULT_FINALIZED:
                if env.result_id in expected and env.result_id not in results:
                    try:
                        payload = events.payload_as(env, events.ResultFinalized)
                        results[env.result_id] = VerificationResult.model_validate(payload.result)
                    except Exception:  # noqa: BLE001 - an unreadable result does not end the job
                        return
                    if on_result:
                        on_result(results[env.result_id])
            elif env.event_type == events.DEAD_LETTER and env.result_id not in dead_ids:
                # reported with the run; only result.finalized ends a job (a service turns a dead
                # letter for a job that cannot finish into that job's finalized error result)
                dead_ids.add(env.result_id)
                try:
                    dead.append(events.payload_as(env, events.DeadLetter))
                except Exception:  # noqa: BLE001
                    pass
            if progress:
                progress(len(results), len(expected))
            if expected <= set(results):
                done.set()

        subs = []
        for et in (events.RESULT_FINALIZED, events.DEAD_LETTER):
            subs.append(await js.subscribe(
                events.subject(et, run_id, "*"), cb=on_msg, ordered_consumer=True,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
            ))
        if not expected:
            done.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        timed_out = False
        lost_since: float | None = None
        while not done.is_set():
            wait = tick_s if deadline is None else min(tick_s, max(0.0, deadline - time.monotonic()))
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can drop a cancel (`cli.aio.interruptible`)
                async with asyncio.timeout(wait):
                    await done.wait()
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    break
                if not nc.is_connected:  # the client reconnects meanwhile; a server that stays gone ends it
                    lost_since = lost_since or time.monotonic()
                    if time.monotonic() - lost_since >= LOST_BUS_S:
                        raise Unreachable(f"lost the NATS server at {mask_url(settings.nats_url)} while following "
                                          f"run {run_id} ({len(results)} of {len(expected)} results in); the run's "
                                          f"events are kept: `veribus status {run_id}` once it is back") from None
                    continue
                lost_since = None
                if on_tick:
                    # bounded: each read waits for its own timeout while the server is away
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(tick_s):
                            retrying = await retrying_now(js)
                        on_tick(retrying)
        for s in subs:
            with contextlib.suppress(Exception):  # a lost server: nothing to unsubscribe from
                await asyncio.wait_for(s.unsubscribe(), tick_s)
    return RunOutcome(results, dead, time.monotonic() - start, timed_out)
