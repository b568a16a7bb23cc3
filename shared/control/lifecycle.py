"""Run lifecycle commands: cancel, resume and regrade.

They read the run's events back from the stream (the source of truth, `shared.control.streams`)
and publish new ones: `cancel` and `resume` a control event the services' `RunControl` obeys
(`shared.runtime.runcontrol`), `resume` the answer requests of jobs with no finalized result,
`regrade` the stored answers of a run under new templates, as a new run.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import EllipsisType
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.control.credentials import config_problems
from shared.control.runner import SIMULATOR_SCRIPT_KEY, RunInputError, new_run_id, plan_run
from shared.control.streams import (
    LifecycleError,
    finalized_ids,
    queued_for_services,
    read_events,
    read_messages,
    run_event,
    subject_counts,
)
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.benchmark.question import Question
from shared.core.config import Settings, VerificationConfig
from shared.core.ids import answer_id_for, compute_result_id, event_id_for, template_id_for
from shared.core.models import VerificationResult
from shared.core.rubric import Rubric, RubricError
from shared.core.usage import reused
from shared.core.verdict import errored, verdict_of
from shared.runtime import bus
from shared.runtime.content import ContentMissing, ContentStore, put_manifest, with_manifest
from shared.runtime.costcontrol import check_cost_budget
from shared.runtime.runcontrol import STOP_ERROR_TYPES, check_budget
from shared.runtime.service_keys import Advert
from shared.templates.static_checks import compile_check, template_shape_problem

PRODUCER = "cli/0.1.0"
RESUME_PREFIX = "resume-"
# =========================================================================== cancel


@dataclass
class CancelOutcome:
    run_id: str
    job_count: int
    finalized: int
    already_finished: bool = False  # every job had its result: nothing was published
    generated: int = 0  # jobs whose answer was generated before the cancel: they finish as they are


async def cancel(settings: Settings, run_id: str, reason: str = "") -> CancelOutcome:
    """Publish `run.cancelled`: answers not yet generated finalize as cancelled results. A run
    that has already finished (`run_finished`) is left as it is: nothing is published."""
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        run = await run_event(js, run_id)
        done = len(await finalized_ids(js, run_id))
        if done >= run.job_count and await run_finished(js, run_id):
            return CancelOutcome(run_id, run.job_count, done, already_finished=True)
        await publish_control(js, run_id, events.RunControlChange(cancelled=True, reason=reason, at=time.time()))
        done = len(await finalized_ids(js, run_id))
        generated = len(await subject_counts(js, events.subject(events.ANSWER_GENERATED, run_id, "*")))
        return CancelOutcome(run_id, run.job_count, done, generated=min(generated, run.job_count))


async def run_finished(js: JetStreamContext, run_id: str) -> bool:
    """Whether a run whose every job has a `result.finalized` is really over: no `resume` is
    running jobs again. A resume that re-runs earlier results (stopped ones; errored ones with
    `--errors`) first publishes a lift (a `run.cancelled` with cancelled=False) that says which
    (`reruns`), then publishes them again; until each of them has a result newer than that lift,
    its newest result is still the earlier one, and the run is not over."""
    got = await _newest_control(js, run_id)
    if got is None:
        return True  # never stopped, never resumed
    msg, change = got
    if change.cancelled:
        return True  # the newest control stops the run: nothing of it runs again
    lifted_at = int(msg.seq or 0)
    newest: dict[str, Any] = {}
    for m in await read_messages(js, events.subject(events.RESULT_FINALIZED, run_id, "*")):
        newest[m.subject.rsplit(".", 1)[-1]] = m
    for m in newest.values():
        if int(m.metadata.sequence.stream) < lifted_at:
            try:
                env = events.decode(m.data, m.subject)
            except Exception:  # noqa: BLE001
                continue
            if reruns(change, env):
                return False  # ended before the resume, and not finalized since: it runs again
    return True


def reruns(lift: events.RunControlChange, env: events.Envelope) -> bool:
    """Whether a resume that published `lift` runs the job of an earlier result `env` again."""
    if _stopped(env):
        return not lift.skips_stopped
    return lift.reruns_errors and _failed(env)


async def _newest_control(js: JetStreamContext, run_id: str) -> tuple[Any, events.RunControlChange] | None:
    """The run's newest run-control message and its change (None: none was published, or a
    foreign message is on the subject); a bus error is raised."""
    subject = events.subject(events.RUN_CANCELLED, run_id)
    try:
        msg = await js.get_last_msg(events.STREAM, subject)
    except NotFoundError:
        return None
    try:
        return msg, events.payload_as(events.decode(msg.data, subject), events.RunControlChange)
    except (msgspec.MsgspecError, ValueError):
        return None


async def newest_control(js: JetStreamContext, run_id: str) -> events.RunControlChange | None:
    """The run-control change in force for a run (None: none was published)."""
    got = await _newest_control(js, run_id)
    return None if got is None else got[1]


async def publish_control(js: JetStreamContext, run_id: str, payload: events.RunControlChange,
                          in_force: events.RunControlChange | None | EllipsisType = ...) -> None:
    """Publish a run-control change. A budget it leaves unset keeps the one in force: the newest
    control's budgets replace the config's, and one without them put the config's (perhaps spent)
    back (a `resume --max-cost-usd 8` then `cancel` and `resume --errors` stopped every job again).
    `in_force`: the newest control as the caller has just read it (`...`: read it here)."""
    before = await newest_control(js, run_id) if in_force is ... else in_force
    if before is not None:
        if payload.budget_tokens is None:
            payload.budget_tokens = before.budget_tokens
        if payload.budget_cost_usd is None:
            payload.budget_cost_usd = before.budget_cost_usd
    env = events.make_envelope(events.RUN_CANCELLED, run_id, events.RUN_KEY, payload, PRODUCER)
    env.event_id = event_id_for(run_id, events.RUN_CANCELLED, uuid.uuid4().hex[:12])  # never deduplicated
    await bus.publish(js, env)


# =========================================================================== resume


@dataclass
class ResumePlan:
    run_id: str
    job_count: int
    finalized: int  # jobs with a result that stays
    requests: list[events.AnswerRequested]  # what is published again (only the missing jobs)
    stopped: int = 0  # results that were cancelled / over budget, re-run
    errored: int = 0  # results that ended in an error (not a stop)
    errors_rerun: bool = False  # and they are run again (`resume --errors`)
    never_published: int = 0  # answers of the run missing from the stream (and not re-planned)
    replanned: int = 0  # of the requests, how many came from the benchmark file
    queued: dict[str, int] = field(default_factory=dict)
    attempt_key: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # the run's recorded config (its models)

    @property
    def jobs(self) -> int:
        return sum(len(r.jobs) for r in self.requests)


def _metadata(env: events.Envelope) -> dict[str, Any]:
    try:
        return events.payload_as(env, events.ResultFinalized).result.get("metadata") or {}
    except Exception:  # noqa: BLE001
        return {}


def _stopped(env: events.Envelope) -> bool:
    """A result that only records that the run stopped dispatching (cancel / budget)."""
    err = _metadata(env).get("error") or ""
    return any(f": {t}: " in err for t in STOP_ERROR_TYPES)


def _failed(env: events.Envelope) -> bool:
    """A result that did not complete without errors, not by a stop: a model call that failed after
    its retries, a stage's give-up, a dead letter. (A template whose verify() raised completed: its
    template decides that again, the same way.)"""
    meta = _metadata(env)
    return meta.get("completed_without_errors") is False and not _stopped(env)


async def plan_resume(
    settings: Settings, run_id: str, *, include_stopped: bool = True, include_errors: bool = False,
    benchmark: Benchmark | None = None,
) -> ResumePlan:
    """What `resume` would publish: each answer request reduced to its jobs without a result (and
    those whose result was stopped, or with `include_errors` ended in an error)."""
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        run = await run_event(js, run_id)
        requested = await read_events(js, events.subject(events.ANSWER_REQUESTED, run_id, "*"))
        finals = await read_events(js, events.subject(events.RESULT_FINALIZED, run_id, "*"))
        queued = await queued_for_services(js)
    last_final: dict[str, events.Envelope] = {}
    for env in finals:
        last_final[env.result_id] = env
    stopped = {rid for rid, env in last_final.items() if include_stopped and _stopped(env)}
    failed = {rid for rid, env in last_final.items() if _failed(env)}
    done = set(last_final) - stopped - (failed if include_errors else set())
    by_answer: dict[str, events.AnswerRequested] = {}
    for env in requested:
        try:
            req = events.payload_as(env, events.AnswerRequested)
        except Exception:  # noqa: BLE001 - a foreign message on the subject
            continue
        if req.jobs:
            by_answer[req.jobs[0].answer_id] = req
    replanned = 0
    if benchmark is not None and len(by_answer) < run.answer_count:
        for req in _replan(run, benchmark):
            if req.jobs[0].answer_id not in by_answer:
                by_answer[req.jobs[0].answer_id] = req
                replanned += 1
    todo: list[events.AnswerRequested] = []
    for req in by_answer.values():
        missing = [j for j in req.jobs if j.result_id not in done]
        if missing:
            todo.append(events.AnswerRequested(jobs=missing))
    return ResumePlan(
        run_id=run_id, job_count=run.job_count, finalized=len(done), requests=todo,
        stopped=len(stopped), errored=len(failed), errors_rerun=include_errors,
        never_published=max(0, run.answer_count - len(by_answer)), replanned=replanned, queued=queued,
        config=run.config,
    )


def recorded_config(config: dict[str, Any]) -> VerificationConfig:
    """A run's config as `run` recorded it (keys this version does not know are left out)."""
    return VerificationConfig.model_validate({k: v for k, v in config.items() if k in VerificationConfig.model_fields})


def resume_key_problems(plan: ResumePlan, services_environ: Mapping[str, str] | None = None, *,
                        adverts: Sequence[Advert] | None = None) -> list[str]:
    """The run's models that could not be called by the jobs `plan` publishes again: a provider key
    missing where the calls are made (`adverts`: a configured deployment's services' key names;
    `services_environ`: a running local stack's services; else here), as `run` refuses them.
    Nothing to publish, nothing to check."""
    if not plan.requests:
        return []
    return config_problems(recorded_config(plan.config), services_environ, adverts=adverts)


def _replan(run: events.RunRequested, benchmark: Benchmark) -> list[events.AnswerRequested]:
    """The run's answer requests, planned again from its benchmark and recorded config (same
    timestamp, so the same result ids)."""
    plan = plan_run(benchmark, recorded_config(run.config), run_id=run.run_id, timestamp=run.timestamp)
    return plan.requests


async def resume(
    settings: Settings, run_id: str, *, include_stopped: bool = True, include_errors: bool = False,
    force: bool = False, budget_tokens: int | None = None, budget_cost_usd: float | None = None,
    benchmark: Benchmark | None = None, services_environ: Mapping[str, str] | None = None,
    adverts: Sequence[Advert] | None = None,
) -> ResumePlan:
    """Publish again the answer requests of the run's jobs that have no result (and, by default,
    those that were cancelled or stopped by a budget; with `include_errors`, those that ended in
    an error). Finished jobs cost nothing. A new token or money budget replaces the run's (a run
    stopped by its spent budget needs a larger one). A model whose key is missing where the calls
    are made is refused before anything is published (`resume_key_problems`).

    A resume that runs earlier results again, or sets a budget, or publishes jobs of a cancelled
    run, first publishes a lift (`run.cancelled` with cancelled=False) that says which results it
    runs again: until each has a newer result the run is not over (`run_finished`,
    `shared.store.resumed`)."""
    if budget_tokens is not None:
        budget_tokens = check_budget(budget_tokens)
    if budget_cost_usd is not None:
        budget_cost_usd = check_cost_budget(budget_cost_usd)
    plan = await plan_resume(settings, run_id, include_stopped=include_stopped, include_errors=include_errors,
                             benchmark=benchmark)
    if plan.queued and not force:
        total = sum(plan.queued.values())
        detail = ", ".join(f"{k} {v}" for k, v in sorted(plan.queued.items()))
        raise LifecycleError(
            f"{total} message(s) are still queued for the services ({detail}); they will finish those jobs "
            "(start the stack if it is down). Resume once they are done, or pass --force.")
    problems = resume_key_problems(plan, services_environ, adverts=adverts)
    if problems:
        raise LifecycleError("refused before publishing:\n  " + "\n  ".join(problems))
    plan.attempt_key = RESUME_PREFIX + uuid.uuid4().hex[:8]
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        in_force = await newest_control(js, run_id)
        reruns_errors = plan.errors_rerun and plan.errored > 0
        if (plan.stopped or reruns_errors or budget_tokens is not None or budget_cost_usd is not None
                or (plan.requests and in_force is not None and in_force.cancelled)):
            await publish_control(js, run_id, events.RunControlChange(
                cancelled=False, reason="resumed", budget_tokens=budget_tokens, budget_cost_usd=budget_cost_usd,
                at=time.time(), skips_stopped=not include_stopped, reruns_errors=reruns_errors), in_force)
        envs = []
        for req in plan.requests:
            envs.append(events.make_envelope(events.ANSWER_REQUESTED, run_id, req.jobs[0].answer_id, req, PRODUCER,
                                             attempt_key=plan.attempt_key))
        await bus.publish_many(js, envs)
    return plan


# =========================================================================== regrade


@dataclass
class RegradePlan:
    parent_run_id: str
    run_id: str
    run_event: events.RunRequested
    generated: list[events.StageEvent]  # the new run's answer.generated payloads
    skipped_not_in_benchmark: list[str] = field(default_factory=list)
    jobs_without_answer: int = 0
    # the parent run's `.simulator.yaml` (runner.SIMULATOR_SCRIPT_KEY), read back from the content
    # bucket; `simulator_script_lost` says why it could not be, when the run named one
    simulator_script: dict[str, Any] | None = None
    simulator_script_lost: str | None = None
    contents: list[tuple[str, bytes]] = field(default_factory=list)  # stored before the run is published

    @property
    def result_ids(self) -> list[str]:
        return [ev.job.result_id for ev in self.generated]


def regrade_jobs(
    parent: events.RunRequested,
    answers: Iterable[events.StageEvent],
    *,
    benchmark: Benchmark | None = None,
    mode: str | None = None,
    run_id: str | None = None,
    run_name: str | None = None,
    timestamp: str | None = None,
) -> RegradePlan:
    """The new run's jobs: each stored answer of the parent run with the (new) template and
    rubric, new run/result ids, and the answer's state kept (no answering-model call)."""
    mode = mode or parent.evaluation_mode
    run_id = run_id or new_run_id()
    timestamp = timestamp or datetime.now(UTC).isoformat()
    # every question of the benchmark, finished or not: the parent run chose which questions it
    # answered (`--include-unfinished` too), and each stored answer is regraded with its question's
    # new template; only the templates of questions with an answer have to compile
    questions = {q.id: q for q in benchmark.questions} if benchmark is not None else {}
    checked: dict[str, str | None] = {}
    out: list[events.StageEvent] = []
    skipped: list[str] = []
    now = time.time()
    for ev in answers:
        job = ev.job
        q = questions.get(job.question_id)
        if benchmark is not None and q is None:
            skipped.append(job.question_id)
            continue
        if q is not None and mode != "rubric_only":
            if q.id not in checked:
                checked[q.id] = _template_problem(q, mode)
            if checked[q.id]:
                continue
        if q is not None:
            code = q.template_code if mode != "rubric_only" else None
            rubric = benchmark.rubric_for(q) if benchmark is not None and mode != "template_only" else None
            rubric_wire = rubric.to_wire() if rubric is not None and not rubric.is_empty() else None
            raw_answer, keywords = q.raw_answer, q.keywords or None
        else:
            code = job.template_code if mode != "rubric_only" else None
            rubric_wire = job.rubric if mode != "template_only" else None
            raw_answer, keywords = job.raw_answer, job.keywords
        if mode != "rubric_only" and not code:
            raise RunInputError(f"question {job.question_id!r}: no answer template (mode {mode} needs one)")
        rid = compute_result_id(job.question_id, job.answering.canonical_key, job.parsing.canonical_key,
                                timestamp, job.replicate)
        new_job = msgspec.structs.replace(
            job, run_id=run_id, result_id=rid, timestamp=timestamp, evaluation_mode=mode,
            answer_id=answer_id_for(run_id, job.question_id, job.answering.canonical_key, job.replicate),
            run_name=run_name if run_name is not None else job.run_name,
            template_code=code, template_id=template_id_for(code) if code else "no_template",
            rubric=rubric_wire, raw_answer=raw_answer, keywords=keywords,
        )
        # the stored answer's call and cost are the parent run's: here it is a reply served without a call
        state = msgspec.structs.replace(ev.state, started_at=now,
                                        usage={stage: reused(e) for stage, e in ev.state.usage.items()})
        out.append(events.StageEvent(job=new_job, state=state, status=ev.status, reason=ev.reason))
    problems = [why for why in checked.values() if why]
    if problems:
        raise RunInputError("regrade refused before publishing:\n  " + "\n  ".join(problems))
    if mode != "template_only" and out and not any(ev.job.rubric for ev in out):
        raise RunInputError(f"evaluation_mode {mode!r} needs rubric traits, and the regraded jobs have none")
    config = {**parent.config, "evaluation_mode": mode, "regraded_from": parent.run_id}
    if run_name is not None:
        config["run_name"] = run_name
    run_event = events.RunRequested(
        run_id=run_id, timestamp=timestamp, job_count=len(out),
        answer_count=len({ev.job.answer_id for ev in out}),
        run_name=run_name if run_name is not None else parent.run_name,
        benchmark_name=benchmark.name if benchmark is not None else parent.benchmark_name,
        evaluation_mode=mode, config=config, unfinished_skipped=list(parent.unfinished_skipped),
        parent_run_id=parent.run_id,
    )
    return RegradePlan(parent.run_id, run_id, run_event, out, skipped)


async def plan_regrade(
    settings: Settings, parent_run_id: str, *, benchmark: Benchmark | None = None, mode: str | None = None,
    run_name: str | None = None,
) -> RegradePlan:
    """Read the parent run's stored answers from the stream and plan the regrade."""
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        parent = await run_event(js, parent_run_id)
        envs = await read_events(js, events.subject(events.ANSWER_GENERATED, parent_run_id, "*"))
        latest: dict[str, events.StageEvent] = {}
        for env in envs:  # a resumed job may have several: the newest is the one its result used
            try:
                latest[env.result_id] = events.payload_as(env, events.StageEvent)
            except Exception:  # noqa: BLE001
                continue
        content = ContentStore(lambda: js)
        for ev in latest.values():  # lean events: the stored question, template and rubric back in
            ev.job = msgspec.structs.replace(await content.hydrate(ev.job), refs={})
        script, lost = None, None
        key = (parent.config or {}).get(SIMULATOR_SCRIPT_KEY)
        if isinstance(key, str) and key:
            try:
                script = await content.get(key)
            except ContentMissing as exc:
                lost = str(exc)
    plan = regrade_jobs(parent, latest.values(), benchmark=benchmark, mode=mode, run_name=run_name)
    plan.jobs_without_answer = max(0, parent.job_count - len(latest))
    plan.simulator_script, plan.simulator_script_lost = (script if isinstance(script, dict) else None), lost
    return plan


def graded_benchmark(plan: RegradePlan) -> Benchmark:
    """The benchmark a regrade grades with, as its jobs carry it: each question of the stored
    answers once (its text, ground-truth answer, the template and rubric of the new jobs), for the
    LLM simulator's script (`infra.simulator.from_benchmark.simulator_script_for`) when the regrade
    is not given a benchmark file. A question without text (nothing to match) is left out; a rubric
    that does not decode leaves the question without one (the script then scripts no judge traits)."""
    questions: dict[str, Question] = {}
    for ev in plan.generated:
        job = ev.job
        if job.question_id in questions or not job.question_text:
            continue
        try:
            rubric = Rubric.from_wire(job.rubric) if job.rubric else None
        except (RubricError, ValueError):
            rubric = None
        questions[job.question_id] = Question(
            id=job.question_id, text=job.question_text, raw_answer=job.raw_answer, template_code=job.template_code,
            keywords=list(job.keywords or []), rubric=rubric)
    return Benchmark(name=plan.run_event.benchmark_name or plan.parent_run_id, questions=list(questions.values()))


async def submit_regrade(settings: Settings, plan: RegradePlan) -> int:
    """Publish the new run and its answer.generated events (the guards stage takes it from there)."""
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        store = ContentStore(lambda: js)
        if plan.contents:  # what the run's config refers to, stored before the run is
            await store.put_many(plan.contents)
        await bus.publish(js, events.make_envelope(events.RUN_REQUESTED, plan.run_id, events.RUN_KEY,
                                                   plan.run_event, PRODUCER))
        # the regrade's code, announced by hash as `submit` does (its templates may be new)
        manifest = await put_manifest(store, (ev.job for ev in plan.generated))
        envs = [events.make_envelope(events.ANSWER_GENERATED, plan.run_id, ev.job.result_id,
                                     msgspec.structs.replace(ev, job=with_manifest(ev.job, manifest)), PRODUCER)
                for ev in plan.generated]
        return await bus.publish_many(js, envs)


async def run_results(settings: Settings, run_id: str) -> dict[str, VerificationResult]:
    """The run's finalized results from the stream (the newest per result id)."""
    async with bus.session(settings) as nc:
        envs = await read_events(nc.jetstream(), events.subject(events.RESULT_FINALIZED, run_id, "*"))
    out: dict[str, VerificationResult] = {}
    for env in envs:
        out[env.result_id] = VerificationResult.model_validate(events.payload_as(env, events.ResultFinalized).result)
    return out


def _template_problem(q: Any, mode: str) -> str | None:
    """Why a question's template cannot grade its stored answer in `mode` (a template mode), or None."""
    if not q.template_code:
        return f"question {q.id!r}: no answer template (mode {mode} needs one)"
    err = compile_check(q.template_code)
    if err:
        return f"question {q.id!r}: template does not compile: {err}"
    missing = template_shape_problem(q.template_code)
    return f"question {q.id!r}: template: {missing}" if missing else None


def outcome_label(r: VerificationResult) -> str:
    """How a result ended, in words: `error` (it did not complete, or its verify() raised, as
    `shared.core.verdict.errored` counts it), else `passed`, `failed` or `no verdict` (no template
    verdict: rubric_only, a template that never ran)."""
    if errored(r):
        return "error"
    verdict = verdict_of(r)
    return "no verdict" if verdict is None else "passed" if verdict else "failed"


def compare_runs(old: Iterable[VerificationResult], new: Iterable[VerificationResult]) -> dict[str, Any]:
    """The verdict (`shared.core.verdict.verdict_of`: None for an error or no template verdict)
    per (question, answering model, judge, replicate) in two runs.

    `changed`: `(question id, outcome before, outcome after)` (`outcome_label`: passed, failed,
    error, no verdict) of each job present in both runs whose verdict differs (an error both times is
    no change), sorted; `errors_before`
    and `errors_after`: how many of the jobs in both runs are errors in each (an error never has a
    verdict to compare, and a verdict, False, that turned into a verify() error is not a change of it)."""

    def key(r: VerificationResult) -> tuple[Any, ...]:
        m = r.metadata
        return (m.question_id, m.answering.model_name, m.parsing.model_name, m.replicate)

    before = {key(r): r for r in old}
    after = {key(r): r for r in new}
    both = before.keys() & after.keys()
    # labels, never the verdicts, are sorted: a verdict is a bool or None, and None < bool raises;
    # an error that stays one (a verify() that raised, then a stage error) is no change either
    changed = sorted((k[0], outcome_label(before[k]), outcome_label(after[k])) for k in both
                     if verdict_of(before[k]) != verdict_of(after[k])
                     and outcome_label(before[k]) != outcome_label(after[k]))
    return {"compared": len(both), "changed": changed,
            "errors_before": sum(1 for k in both if errored(before[k])),
            "errors_after": sum(1 for k in both if errored(after[k]))}


def load_benchmark(path: str | Path, rubric: str | Path | None = None) -> Benchmark:
    return Benchmark.load(path, rubric=rubric)
