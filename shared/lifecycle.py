"""Run lifecycle: cancel, token budgets, resume, regrade, and rebuilding the projections.

Two halves:

- `RunControl` is used by the service harness (`shared.service`): before an `answer.requested`
  is handled it asks whether the run was cancelled or has spent its token budget, and after
  every handled event of a run with a budget it adds the tokens that stage spent to the run's
  counter. Cancellation is an event on the stream (`vb.run.cancelled.<run>._`, its last message
  wins); the budget is `budget_tokens` in the run's `run.requested` config (or a newer value on
  the control subject); the spent counter is one key per run in the JetStream KV bucket
  `vb_run_usage`, updated by compare-and-set from every service process.
- the commands (`cancel`, `resume`, `regrade`, `rebuild_projections`, `run_problems`) read the
  run's events back from the stream (the source of truth) and publish new ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared import bus, events
from shared.config import Settings
from shared.ids import event_id_for

if TYPE_CHECKING:
    from shared.benchmark import Benchmark
    from shared.models import VerificationResult

log = logging.getLogger("veribus.lifecycle")

USAGE_BUCKET = "vb_run_usage"
PRODUCER = "cli/0.1.0"
RESUME_PREFIX = "resume-"
# durable consumers whose queued messages still lead to results (the projector's do not)
STAGE_DURABLES = ("generation", "guards", "parsing", "verification", "rubric", "finalization-template",
                  "finalization-rubric")
PROJECTOR_DURABLE = "projector"


class LifecycleError(RuntimeError):
    """A lifecycle command that cannot proceed; the message says why and what to do."""


# =========================================================================== run control


class RunControlPayload(msgspec.Struct, omit_defaults=True):
    """Payload of `vb.run.cancelled.<run>._`: the newest message on that subject is in force.

    `cancelled=False` (published by `resume`) lifts an earlier cancel; `budget_tokens` replaces
    the budget of the run's config."""

    cancelled: bool = True
    reason: str = ""
    budget_tokens: int | None = None
    at: float = 0.0


class RunStopped(Exception):
    """The run's remaining answers are not dispatched; the job finalizes with this error."""


class RunCancelled(RunStopped):
    pass


class BudgetExhausted(RunStopped):
    pass


STOP_ERROR_TYPES = frozenset({"RunCancelled", "BudgetExhausted"})


class _UsageEntry(msgspec.Struct):
    total_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class _UsageState(msgspec.Struct):
    usage: dict[str, _UsageEntry | None] = {}


class _UsageProbe(msgspec.Struct):
    """The token counts of a StageEvent payload; everything else is skipped by the decoder."""

    state: _UsageState | None = None


_usage_probe = msgspec.json.Decoder(_UsageProbe)
_control_dec = msgspec.json.Decoder(RunControlPayload)
_TOKEN_EVENTS = frozenset({events.ANSWER_GENERATED, events.GUARDS_CHECKED, events.TEMPLATE_PARSED,
                           events.TEMPLATE_VERIFIED, events.RUBRIC_EVALUATED})


def _entry_tokens(e: Any) -> int:
    if e is None:
        return 0
    if isinstance(e, dict):
        total = int(e.get("total_tokens") or 0)
        return total or int(e.get("input_tokens") or 0) + int(e.get("output_tokens") or 0)
    return int(e.total_tokens or 0) or int(e.input_tokens or 0) + int(e.output_tokens or 0)


def usage_tokens(usage: dict[str, Any] | None) -> int:
    """Total tokens of a state's `usage` map (per stage entries; a `total` entry is ignored)."""
    if not usage:
        return 0
    return sum(_entry_tokens(v) for k, v in usage.items() if k != "total")


def tokens_before(payload: Any) -> int:
    """Tokens already on an incoming event's state (read before the handler: stages update the
    state in place)."""
    return usage_tokens(payload.state.usage) if isinstance(payload, events.StageEvent) else 0


def tokens_spent(before: int, outs: Iterable[events.Envelope]) -> int:
    """Tokens one handled event spent: the growth of the state's usage from the input event
    (`before`, see `tokens_before`) to its outputs. Fan-out copies (one answer for several
    judges) count once: the max is taken."""
    spent = 0
    for out in outs:
        if out.event_type not in _TOKEN_EVENTS:
            continue
        try:
            probe = _usage_probe.decode(out.payload)
        except msgspec.DecodeError:
            continue
        if probe.state is not None:
            spent = max(spent, usage_tokens(probe.state.usage) - before)  # type: ignore[arg-type]
    return spent


def _kv_key(run_id: str) -> str:
    """A KV-safe key for a run id (run ids we make are safe already)."""
    if re.fullmatch(r"[-_=A-Za-z0-9]{1,200}", run_id):
        return run_id
    return "h" + hashlib.sha256(run_id.encode()).hexdigest()[:32]


@dataclass
class _RunInfo:
    loaded: bool = False
    config_budget: int | None = None
    control: RunControlPayload | None = None
    checked_at: float = -1e9  # monotonic
    checked_wall: float = 0.0  # time.time() of the same read
    usage_seen: int = 0
    usage_read_at: float = -1e9

    @property
    def budget(self) -> int | None:
        if self.control is not None and self.control.budget_tokens is not None:
            return self.control.budget_tokens
        return self.config_budget

    @property
    def cancelled(self) -> bool:
        return bool(self.control is not None and self.control.cancelled)


class RunControl:
    """Per-process view of run cancellation and token budgets (see module docstring).

    Reads are cached (`ttl_s`, `usage_ttl_s`), so the per-message cost is a dict lookup; each
    process adds its spent tokens to the run's KV counter every `flush_s`. A read that fails (the
    server is away) never stops a run: the gate fails open and retries on the next message.
    """

    def __init__(self, js: Callable[[], JetStreamContext], *, ttl_s: float = 1.0, usage_ttl_s: float = 0.25,
                 flush_s: float = 0.2, max_runs: int = 4096) -> None:
        self._js = js
        self.ttl_s = ttl_s
        self.usage_ttl_s = usage_ttl_s
        self.flush_s = flush_s
        self.max_runs = max_runs
        self._runs: OrderedDict[str, _RunInfo] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}
        self._pending: dict[str, int] = {}
        self._kv: Any = None
        self._flusher: asyncio.Task[None] | None = None

    # ---- reading the run's state ----
    async def _info(self, run_id: str, newer_than: float = 0.0) -> _RunInfo:
        """The run's state, read at most `ttl_s` ago and (wall clock) after `newer_than`."""
        info = self._runs.get(run_id)
        now = time.monotonic()
        if info is not None and now - info.checked_at < self.ttl_s and info.checked_wall >= newer_than:
            return info
        lock = self._locks.setdefault(run_id, asyncio.Lock())
        async with lock:
            info = self._runs.get(run_id)
            if (info is not None and time.monotonic() - info.checked_at < self.ttl_s
                    and info.checked_wall >= newer_than):
                return info
            info = info or _RunInfo()
            js = self._js()
            try:
                if not info.loaded:
                    run_env = await bus.last_event(js, events.subject(events.RUN_REQUESTED, run_id))
                    if run_env is not None:
                        cfg = events.payload_as(run_env, events.RunRequested).config
                        b = cfg.get("budget_tokens")
                        info.config_budget = int(b) if isinstance(b, int | float) and b > 0 else None
                    info.loaded = True
                ctl = await bus.last_event(js, events.subject(events.RUN_CANCELLED, run_id))
                info.control = _control_dec.decode(ctl.payload) if ctl is not None else None
            except Exception as exc:  # noqa: BLE001 - fail open, retry on the next message
                log.warning("run control: cannot read the state of run %s: %s", run_id, exc)
            info.checked_at = time.monotonic()
            info.checked_wall = time.time()
            self._runs[run_id] = info
            self._runs.move_to_end(run_id)
            while len(self._runs) > self.max_runs:
                old, _ = self._runs.popitem(last=False)
                self._locks.pop(old, None)
            return info

    async def budget(self, run_id: str) -> int | None:
        """The run's token budget, or None (no budget)."""
        return (await self._info(run_id)).budget

    async def usage(self, run_id: str) -> int:
        """Tokens the run has spent as far as this process knows (counter + unflushed)."""
        info = await self._info(run_id)
        now = time.monotonic()
        if now - info.usage_read_at >= self.usage_ttl_s:
            try:
                info.usage_seen = await self._read_counter(run_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("run control: cannot read the usage of run %s: %s", run_id, exc)
            info.usage_read_at = now
        return info.usage_seen + self._pending.get(run_id, 0)

    async def stop_reason(self, run_id: str, published_at: float = 0.0) -> RunStopped | None:
        """Why the run's next answer must not be generated, or None.

        `published_at`: when the request was published. A stop seen before that is read again
        (a `resume` lifts the stop, then publishes its requests: they must see the lift)."""
        info = await self._info(run_id)
        if info.cancelled and info.checked_wall < published_at:
            info = await self._info(run_id, newer_than=published_at)
        if info.cancelled:
            why = f" ({info.control.reason})" if info.control and info.control.reason else ""
            return RunCancelled(f"cancelled: run {run_id} was cancelled before this answer was generated{why}")
        budget = info.budget
        if budget is not None:
            used = await self.usage(run_id)
            if used >= budget and info.checked_wall < published_at:
                info = await self._info(run_id, newer_than=published_at)  # a raised budget?
                budget = info.budget
            if budget is not None and used >= budget:
                return BudgetExhausted(f"budget exhausted: run {run_id} has used {used} of its {budget}-token "
                                       "budget; this answer was not generated")
        return None

    # ---- spending ----
    def record_usage(self, run_id: str, tokens: int) -> None:
        """Add tokens this process spent for the run (flushed to the shared counter soon)."""
        if tokens <= 0:
            return
        self._pending[run_id] = self._pending.get(run_id, 0) + tokens
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        while self._pending:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        for run_id in list(self._pending):
            delta = self._pending.pop(run_id, 0)
            if delta <= 0:
                continue
            try:
                total = await self._add_counter(run_id, delta)
            except Exception as exc:  # noqa: BLE001 - keep it for the next flush
                log.warning("run control: cannot add %d tokens to run %s: %s", delta, run_id, exc)
                self._pending[run_id] = self._pending.get(run_id, 0) + delta
                continue
            info = self._runs.get(run_id)
            if info is not None:
                info.usage_seen = max(info.usage_seen, total)

    async def close(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
        if self._pending:
            try:
                await asyncio.wait_for(self.flush(), 5.0)
            except Exception:  # noqa: BLE001 - shutting down: best effort
                pass

    # ---- the KV counter ----
    async def _bucket(self) -> Any:
        if self._kv is None:
            self._kv = await usage_bucket(self._js())
        return self._kv

    async def _read_counter(self, run_id: str) -> int:
        from nats.js.errors import KeyNotFoundError

        kv = await self._bucket()
        try:
            entry = await kv.get(_kv_key(run_id))
        except KeyNotFoundError:
            return 0
        return int(entry.value or b"0")

    async def _add_counter(self, run_id: str, delta: int) -> int:
        """Compare-and-set add; returns the new total."""
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        kv = await self._bucket()
        key = _kv_key(run_id)
        for _ in range(50):
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                try:
                    await kv.create(key, str(delta).encode())
                    return delta
                except KeyWrongLastSequenceError:
                    continue
            total = int(entry.value or b"0") + delta
            try:
                await kv.update(key, str(total).encode(), last=entry.revision)
                return total
            except KeyWrongLastSequenceError:
                await asyncio.sleep(0.005)
        raise RuntimeError(f"usage counter of run {run_id}: too much contention")


async def usage_bucket(js: JetStreamContext, bucket: str = USAGE_BUCKET) -> Any:
    """A run-usage KV bucket (created on first use): tokens, or micro-dollars (shared.cost_budget)."""
    from nats.js.api import KeyValueConfig
    from nats.js.errors import BucketNotFoundError, NotFoundError

    try:
        return await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        try:
            return await js.create_key_value(KeyValueConfig(
                bucket=bucket, history=1, ttl=30 * 24 * 3600, description="veribus spending per run"))
        except Exception:  # noqa: BLE001 - another process created it meanwhile
            return await js.key_value(bucket)


async def run_usage(settings: Settings, run_id: str) -> int:
    """Tokens the run's services have reported spending so far (the budget counter)."""
    nc = await bus.connect(settings)
    try:
        return await RunControl(lambda: nc.jetstream())._read_counter(run_id)
    finally:
        await nc.close()


def set_budget(run_event: events.RunRequested, budget_tokens: int | None) -> None:
    """Record a token budget in the run's config (what `veribus run --max-tokens-budget N` does
    before submitting); the generation service stops dispatching once the run has spent it."""
    if budget_tokens is None:
        return
    if budget_tokens <= 0:
        raise ValueError(f"budget_tokens must be a positive number of tokens, got {budget_tokens}")
    run_event.config = {**run_event.config, "budget_tokens": int(budget_tokens)}


def pop_budget(config_data: dict[str, Any]) -> int | None:
    """Take `budget_tokens` out of a run-config mapping (it is not a VerificationConfig field)."""
    raw = config_data.pop("budget_tokens", None)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
        raise ValueError(f"budget_tokens: expected a positive integer number of tokens, got {raw!r}")
    return raw


# =========================================================================== event ids of re-runs


def chain_suffix(env: events.Envelope) -> str:
    """The attempt key of an event (`<id>:<type>:<key>`), '' for a first run.

    `resume` publishes answer requests with a key; every event a service publishes in reply
    carries the same key, so a resumed job's chain is not deduplicated against the events of an
    earlier, broken one."""
    key = env.result_id if env.result_id != events.RUN_KEY else env.run_id
    base = f"{key}:{env.event_type}"
    if env.event_id.startswith(base + ":"):
        return env.event_id[len(base) + 1:]
    return ""


def apply_suffix(suffix: str, outs: list[events.Envelope]) -> list[events.Envelope]:
    """Give outgoing events the attempt key of the event they answer (see `chain_suffix`)."""
    if suffix:
        for out in outs:
            if not out.event_id.endswith(":" + suffix):
                out.event_id = f"{out.event_id}:{suffix}"
    return outs


# =========================================================================== reading the stream


async def read_events(js: JetStreamContext, subject_filter: str, *, batch: int = 1000,
                      timeout: float = 60.0) -> list[events.Envelope]:
    """Every decodable event on `subject_filter`, in stream order (an ephemeral consumer)."""
    psub = await js.pull_subscribe(
        subject_filter, durable=None, stream=events.STREAM,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                              inactive_threshold=30.0, max_ack_pending=-1),
    )
    out: list[events.Envelope] = []
    deadline = time.monotonic() + timeout
    try:
        remaining = (await psub.consumer_info()).num_pending
        while remaining > 0:
            if time.monotonic() > deadline:
                raise LifecycleError(f"reading {subject_filter} from the stream took longer than {timeout:.0f} s")
            try:
                msgs = await psub.fetch(min(batch, remaining), timeout=2.0)
            except Exception as exc:  # noqa: BLE001 - nats TimeoutError: ask again
                log.debug("fetch %s: %s", subject_filter, exc)
                continue
            for m in msgs:
                try:
                    out.append(events.decode(m.data))
                except Exception:  # noqa: BLE001 - undecodable: not part of the run's history
                    pass
            remaining = msgs[-1].metadata.num_pending if msgs and msgs[-1].metadata else remaining - len(msgs)
    finally:
        try:
            await psub.unsubscribe()
        except Exception:  # noqa: BLE001
            pass
    return out


async def subject_counts(js: JetStreamContext, subject_filter: str) -> dict[str, int]:
    """Messages per subject under a filter (e.g. result.finalized per result of one run)."""
    info = await js.stream_info(events.STREAM, subjects_filter=subject_filter)
    return dict(info.state.subjects or {})


async def finalized_ids(js: JetStreamContext, run_id: str) -> set[str]:
    """Result ids of the run that have a `result.finalized` event."""
    counts = await subject_counts(js, events.subject(events.RESULT_FINALIZED, run_id, "*"))
    return {s.rsplit(".", 1)[-1] for s in counts}


async def _run_event(js: JetStreamContext, run_id: str) -> events.RunRequested:
    env = await bus.last_event(js, events.subject(events.RUN_REQUESTED, run_id))
    if env is None:
        raise LifecycleError(f"no run {run_id!r} in the stream (no run.requested event)")
    return events.payload_as(env, events.RunRequested)


async def queued_for_services(js: JetStreamContext) -> dict[str, int]:
    """Messages the stage services still have to handle (pending + unacked), per durable."""
    from nats.js.errors import NotFoundError

    out: dict[str, int] = {}
    for name in STAGE_DURABLES:
        try:
            ci = await js.consumer_info(events.STREAM, name)
        except NotFoundError:
            continue
        n = int(ci.num_pending or 0) + int(ci.num_ack_pending or 0)
        if n:
            out[name] = n
    return out


# =========================================================================== cancel


@dataclass
class CancelOutcome:
    run_id: str
    job_count: int
    finalized: int


async def cancel(settings: Settings, run_id: str, reason: str = "") -> CancelOutcome:
    """Publish `run.cancelled`: answers not yet generated finalize as cancelled results."""
    nc = await bus.connect(settings)
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        run = await _run_event(js, run_id)
        await publish_control(js, run_id, RunControlPayload(cancelled=True, reason=reason, at=time.time()))
        done = len(await finalized_ids(js, run_id))
        return CancelOutcome(run_id, run.job_count, done)
    finally:
        await nc.close()


async def publish_control(js: JetStreamContext, run_id: str, payload: RunControlPayload) -> None:
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
    never_published: int = 0  # answers of the run missing from the stream (and not re-planned)
    replanned: int = 0  # of the requests, how many came from the benchmark file
    queued: dict[str, int] = field(default_factory=dict)
    attempt_key: str = ""

    @property
    def jobs(self) -> int:
        return sum(len(r.jobs) for r in self.requests)


def _stopped(env: events.Envelope) -> bool:
    """A result that only records that the run stopped dispatching (cancel / budget)."""
    try:
        result = events.payload_as(env, events.ResultFinalized).result
    except Exception:  # noqa: BLE001
        return False
    err = ((result.get("metadata") or {}).get("error")) or ""
    return any(f": {t}: " in err for t in STOP_ERROR_TYPES)


async def plan_resume(
    settings: Settings, run_id: str, *, include_stopped: bool = True, benchmark: Benchmark | None = None,
) -> ResumePlan:
    """What `resume` would publish: each answer request reduced to its jobs without a result."""
    nc = await bus.connect(settings)
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        run = await _run_event(js, run_id)
        requested = await read_events(js, events.subject(events.ANSWER_REQUESTED, run_id, "*"))
        finals = await read_events(js, events.subject(events.RESULT_FINALIZED, run_id, "*"))
        queued = await queued_for_services(js)
    finally:
        await nc.close()
    last_final: dict[str, events.Envelope] = {}
    for env in finals:
        last_final[env.result_id] = env
    stopped = {rid for rid, env in last_final.items() if include_stopped and _stopped(env)}
    done = set(last_final) - stopped
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
        stopped=len(stopped), never_published=max(0, run.answer_count - len(by_answer)),
        replanned=replanned, queued=queued,
    )


def _replan(run: events.RunRequested, benchmark: Benchmark) -> list[events.AnswerRequested]:
    """The run's answer requests, planned again from its benchmark and recorded config (same
    timestamp, so the same result ids)."""
    from shared.config import VerificationConfig
    from shared.runner import plan_run

    cfg = {k: v for k, v in run.config.items() if k in VerificationConfig.model_fields}
    plan = plan_run(benchmark, VerificationConfig.model_validate(cfg), run_id=run.run_id, timestamp=run.timestamp)
    return plan.requests


async def resume(
    settings: Settings, run_id: str, *, include_stopped: bool = True, force: bool = False,
    budget_tokens: int | None = None, benchmark: Benchmark | None = None,
) -> ResumePlan:
    """Publish again the answer requests of the run's jobs that have no result (and, by default,
    those that were cancelled or stopped by the budget). Finished jobs cost nothing."""
    plan = await plan_resume(settings, run_id, include_stopped=include_stopped, benchmark=benchmark)
    if plan.queued and not force:
        total = sum(plan.queued.values())
        detail = ", ".join(f"{k} {v}" for k, v in sorted(plan.queued.items()))
        raise LifecycleError(
            f"{total} message(s) are still queued for the services ({detail}); they will finish those jobs "
            "(start the stack if it is down). Resume once they are done, or pass --force.")
    plan.attempt_key = RESUME_PREFIX + uuid.uuid4().hex[:8]
    nc = await bus.connect(settings)
    try:
        js = nc.jetstream()
        if plan.stopped or budget_tokens is not None:
            await publish_control(js, run_id, RunControlPayload(
                cancelled=False, reason="resumed", budget_tokens=budget_tokens, at=time.time()))
        envs = []
        for req in plan.requests:
            env = events.make_envelope(events.ANSWER_REQUESTED, run_id, req.jobs[0].answer_id, req, PRODUCER)
            env.event_id = event_id_for(req.jobs[0].answer_id, events.ANSWER_REQUESTED, plan.attempt_key)
            envs.append(env)
        await bus.publish_many(js, envs)
    finally:
        await nc.close()
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
    from shared.ids import answer_id_for, compute_result_id, template_id_for
    from shared.runner import RunInputError, new_run_id
    from shared.templates import compile_check

    mode = mode or parent.evaluation_mode
    run_id = run_id or new_run_id()
    timestamp = timestamp or datetime.now(UTC).isoformat()
    questions = {q.id: q for q in benchmark.finished_questions()} if benchmark is not None else {}
    problems: list[str] = []
    if benchmark is not None and mode != "rubric_only":
        for q in questions.values():
            if not q.template_code:
                problems.append(f"question {q.id!r}: no answer template (mode {mode} needs one)")
            elif err := compile_check(q.template_code):
                problems.append(f"question {q.id!r}: template does not compile: {err}")
    if problems:
        raise RunInputError("regrade refused before publishing:\n  " + "\n  ".join(problems))
    out: list[events.StageEvent] = []
    skipped: list[str] = []
    now = time.time()
    for ev in answers:
        job = ev.job
        q = questions.get(job.question_id)
        if benchmark is not None and q is None:
            skipped.append(job.question_id)
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
        state = msgspec.structs.replace(ev.state, started_at=now)
        out.append(events.StageEvent(job=new_job, state=state, status=ev.status, reason=ev.reason))
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
    nc = await bus.connect(settings)
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        parent = await _run_event(js, parent_run_id)
        envs = await read_events(js, events.subject(events.ANSWER_GENERATED, parent_run_id, "*"))
        latest: dict[str, events.StageEvent] = {}
        for env in envs:  # a resumed job may have several: the newest is the one its result used
            try:
                latest[env.result_id] = events.payload_as(env, events.StageEvent)
            except Exception:  # noqa: BLE001
                continue
        from shared.content import ContentStore

        content = ContentStore(lambda: js)
        for ev in latest.values():  # lean events: the stored question, template and rubric back in
            ev.job = msgspec.structs.replace(await content.hydrate(ev.job), refs={})
    finally:
        await nc.close()
    plan = regrade_jobs(parent, latest.values(), benchmark=benchmark, mode=mode, run_name=run_name)
    plan.jobs_without_answer = max(0, parent.job_count - len(latest))
    return plan


async def submit_regrade(settings: Settings, plan: RegradePlan) -> int:
    """Publish the new run and its answer.generated events (the guards stage takes it from there)."""
    nc = await bus.connect(settings)
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        await bus.publish(js, events.make_envelope(events.RUN_REQUESTED, plan.run_id, events.RUN_KEY,
                                                   plan.run_event, PRODUCER))
        envs = [events.make_envelope(events.ANSWER_GENERATED, plan.run_id, ev.job.result_id, ev, PRODUCER)
                for ev in plan.generated]
        return await bus.publish_many(js, envs)
    finally:
        await nc.close()


async def run_results(settings: Settings, run_id: str) -> dict[str, VerificationResult]:
    """The run's finalized results from the stream (the newest per result id)."""
    from shared.models import VerificationResult

    nc = await bus.connect(settings)
    try:
        envs = await read_events(nc.jetstream(), events.subject(events.RESULT_FINALIZED, run_id, "*"))
    finally:
        await nc.close()
    out: dict[str, VerificationResult] = {}
    for env in envs:
        out[env.result_id] = VerificationResult.model_validate(events.payload_as(env, events.ResultFinalized).result)
    return out


def compare_runs(old: Iterable[VerificationResult], new: Iterable[VerificationResult]) -> dict[str, Any]:
    """verify_result per (question, answering model, judge, replicate) in two runs."""

    def key(r: VerificationResult) -> tuple[Any, ...]:
        m = r.metadata
        return (m.question_id, m.answering.model_name, m.parsing.model_name, m.replicate)

    def verdict(r: VerificationResult) -> bool | None:
        return r.template.verify_result if r.template is not None else None

    before = {key(r): verdict(r) for r in old}
    after = {key(r): verdict(r) for r in new}
    changed = sorted((k[0], before[k], after[k]) for k in before.keys() & after.keys() if before[k] != after[k])
    return {"compared": len(before.keys() & after.keys()), "changed": changed}


# =========================================================================== projections


TABLE_FINGERPRINTS = {
    "events": "SELECT count(), groupBitXor(cityHash64(event_id, event_type, run_id, result_id, subject, "
              "occurred_at, payload)) FROM events FINAL",
    "verification_results": "SELECT count(), groupBitXor(cityHash64(result_id, version, result_json)) "
                            "FROM verification_results FINAL",
    "runs": "SELECT count(), groupBitXor(cityHash64(run_id, version, config_json)) FROM runs FINAL",
}


def fingerprint(query: Callable[[str], Any]) -> dict[str, tuple[int, int]]:
    """(rows, content hash) per table, read with FINAL; ingestion times are left out."""
    out = {}
    for table, sql in TABLE_FINGERPRINTS.items():
        try:
            rows = query(sql).rows
            out[table] = (int(rows[0][0]), int(rows[0][1]))
        except Exception as exc:  # noqa: BLE001 - a table that does not exist yet
            log.debug("fingerprint of %s: %s", table, exc)
            out[table] = (0, 0)
    return out


@dataclass
class RebuildReport:
    before: dict[str, tuple[int, int]]
    after: dict[str, tuple[int, int]]
    stream_messages: int
    elapsed_s: float
    mode: str  # "stack" (projector restarted) or "in-process"

    @property
    def identical(self) -> bool:
        return self.before == self.after


async def _consumer_caught_up(js: JetStreamContext, durable: str) -> bool:
    from nats.js.errors import NotFoundError

    try:
        ci = await js.consumer_info(events.STREAM, durable)
    except NotFoundError:
        return False
    return int(ci.num_pending or 0) == 0 and int(ci.num_ack_pending or 0) == 0


async def _stream_messages(settings: Settings) -> int:
    nc = await bus.connect(settings)
    try:
        info = await nc.jetstream().stream_info(events.STREAM)
        return int(info.state.messages)
    finally:
        await nc.close()


async def _delete_consumer(settings: Settings, durable: str) -> bool:
    from nats.js.errors import NotFoundError

    nc = await bus.connect(settings)
    try:
        await nc.jetstream().delete_consumer(events.STREAM, durable)
        return True
    except NotFoundError:
        return False
    finally:
        await nc.close()


async def _wait_caught_up(settings: Settings, durable: str, timeout: float) -> None:
    nc = await bus.connect(settings)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await _consumer_caught_up(js, durable):
                return
            await asyncio.sleep(0.2)
        raise LifecycleError(f"the projector did not catch up with the stream within {timeout:.0f} s")
    finally:
        await nc.close()


def _recreate_tables(settings: Settings) -> None:
    from shared.store import open_store

    store = open_store(settings, migrate=False)
    try:
        store.drop_all()
        store.migrate()
    finally:
        store.close()


async def _project_in_process(settings: Settings, batch: int = 2000) -> None:
    """Fold the whole stream into the tables from this process (no projector running)."""
    from services.projector.app import Projector

    projector = Projector(settings)
    projector.open()
    nc = await bus.connect(settings)
    try:
        js = nc.jetstream()
        psub = await js.pull_subscribe(
            "vb.>", durable=None, stream=events.STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                                  inactive_threshold=30.0, max_ack_pending=-1))
        remaining = (await psub.consumer_info()).num_pending
        while remaining > 0:
            try:
                msgs = await psub.fetch(min(batch, remaining), timeout=2.0)
            except Exception:  # noqa: BLE001 - nats TimeoutError: ask again
                continue
            projector.insert(projector.project_batch(msgs))
            remaining = msgs[-1].metadata.num_pending if msgs[-1].metadata else remaining - len(msgs)
        await psub.unsubscribe()
    finally:
        await nc.close()
        projector.close()


def rebuild_projections(settings: Settings, *, timeout: float = 600.0,
                        progress: Callable[[str], None] | None = None) -> RebuildReport:
    """Drop the ClickHouse tables and refold them from the stream (the event log is the truth).

    With the local stack running: stop the projector, drop and recreate the tables, delete the
    projector's durable consumer, start the projector again (it re-reads the stream from the
    start) and wait until it has caught up. Without a local stack: fold the stream in this
    process (NATS must be reachable; nothing else may hold the chdb folder). Returns row counts
    and content hashes before and after."""
    from shared import stack
    from shared.query import query_direct, run_query

    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    state = stack.running_stack(settings)
    if state is not None:
        settings = settings.model_copy(update={"nats_url": state.nats_url})
    if not bus.server_reachable(settings.nats_url):
        raise LifecycleError(f"no NATS server at {settings.nats_url}: the stream is needed to rebuild "
                             "(start the stack with `veribus up`)")
    projectors = [p for p in state.procs if p.name.split("-")[0] == "projector"] if state else []
    if projectors:
        before = fingerprint(lambda sql: run_query(settings, sql))
        say(f"stopping the projector ({', '.join(str(p.pid) for p in projectors)})")
        for p in projectors:
            stack.stop_proc(p, timeout=30.0)
    else:
        before = fingerprint(lambda sql: query_direct(settings, sql))
    say("dropping and recreating the tables")
    _recreate_tables(settings)
    if projectors and state is not None:
        asyncio.run(_delete_consumer(settings, PROJECTOR_DURABLE))
        say("starting the projector: it re-reads the stream from the start")
        for p in projectors:
            stack.restart_proc(state, p.name)
        asyncio.run(_wait_caught_up(settings, PROJECTOR_DURABLE, timeout))
        after = fingerprint(lambda sql: run_query(settings, sql))
        mode = "stack"
    else:
        say("folding the stream in this process")
        asyncio.run(_project_in_process(settings))
        after = fingerprint(lambda sql: query_direct(settings, sql))
        mode = "in-process"
    msgs = asyncio.run(_stream_messages(settings))
    return RebuildReport(before, after, msgs, time.monotonic() - t0, mode)


# =========================================================================== problems of a run


def run_problems(settings: Settings, run_id: str, limit: int = 20) -> dict[str, Any]:
    """Stage give-ups, dead letters and result errors of a run (for `veribus status RUN`)."""
    from shared.query import run_query

    p = {"run": run_id}
    failed = run_query(settings, "SELECT stage, error_type, error_message, result_id FROM events FINAL "
                                 "WHERE run_id = {run:String} AND event_type = 'stage.failed' "
                                 f"ORDER BY occurred_at LIMIT {int(limit)}", p).rows
    n_failed = run_query(settings, "SELECT count() FROM events FINAL WHERE run_id = {run:String} "
                                   "AND event_type = 'stage.failed'", p).rows[0][0]
    dead = run_query(settings, "SELECT stage, error_message, reason FROM events FINAL WHERE run_id = {run:String} "
                               f"AND event_type = 'dead.letter' ORDER BY occurred_at LIMIT {int(limit)}", p).rows
    n_dead = run_query(settings, "SELECT count() FROM events FINAL WHERE run_id = {run:String} "
                                 "AND event_type = 'dead.letter'", p).rows[0][0]
    errors = run_query(settings, "SELECT substring(error, 1, 120) AS e, count() FROM verification_results FINAL "
                                 "WHERE (run_id = {run:String} OR run_name = {run:String}) "
                                 "AND NOT completed_without_errors GROUP BY e ORDER BY count() DESC "
                                 f"LIMIT {int(limit)}", p).rows
    budget_rows = run_query(settings, "SELECT JSONExtractInt(config_json, 'budget_tokens') FROM runs FINAL "
                                      "WHERE run_id = {run:String}", p).rows
    budget = int(budget_rows[0][0]) if budget_rows and budget_rows[0][0] else None
    spent = stopped = 0
    if budget is not None:
        spent, stopped = run_query(settings, "SELECT sum(total_tokens), countIf(positionCaseInsensitive(ifNull("
                                             "error, ''), ': BudgetExhausted: ') > 0) FROM verification_results FINAL "
                                             "WHERE run_id = {run:String}", p).rows[0]
    return {
        "budget_tokens": budget,
        "tokens_spent": int(spent or 0),
        "budget_stopped": int(stopped or 0),
        "stage_failed": int(n_failed),
        "stage_failures": [{"stage": r[0], "type": r[1], "message": r[2], "result_id": r[3]} for r in failed],
        "dead_letters": int(n_dead),
        "dead_letter_list": [{"consumer": r[0], "error": r[1], "subject": r[2]} for r in dead],
        "errors": [{"error": r[0], "count": int(r[1])} for r in errors],
    }


def format_run_problems(problems: dict[str, Any]) -> str:
    lines = []
    if problems.get("budget_tokens") is not None:
        lines.append(f"  token budget: {problems['budget_tokens']}; spent by finalized results: "
                     f"{problems['tokens_spent']}; {problems['budget_stopped']} job(s) not generated "
                     "(budget exhausted)")
    lines.append(f"  stage give-ups: {problems['stage_failed']}")
    for f in problems["stage_failures"]:
        lines.append(f"    {f['stage']}: {f['type']}: {f['message'][:160]} (result {f['result_id']})")
    lines.append(f"  dead letters: {problems['dead_letters']}")
    for d in problems["dead_letter_list"]:
        lines.append(f"    {d['consumer']}: {d['error'][:160]} ({d['subject']})")
    if problems["errors"]:
        lines.append("  result errors:")
        for e in problems["errors"]:
            lines.append(f"    {e['count']:>6}  {e['error']}")
    return "\n".join(lines)


def load_benchmark(path: str | Path) -> Benchmark:
    from shared.benchmark import Benchmark

    return Benchmark.load(path)


# =========================================================================== waiting


async def wait_for_results(
    settings: Settings, run_id: str, *, result_ids: Iterable[str] | None = None, count: int | None = None,
    baseline: dict[str, int] | None = None, timeout: float = 600.0, poll_s: float = 0.5,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[int, bool]:
    """Wait until each of `result_ids` has a newer `result.finalized` than in `baseline`
    (subject counts), or until the run has `count` finalized results. Returns (done, timed_out)."""
    ids = set(result_ids or ())
    base = baseline or {}
    want = len(ids) if ids else int(count or 0)
    nc = await bus.connect(settings)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        done = 0
        while True:
            try:
                counts = await subject_counts(js, events.subject(events.RESULT_FINALIZED, run_id, "*"))
            except Exception as exc:  # noqa: BLE001 - a reconnecting server: ask again
                log.debug("wait_for_results: %s", exc)
                counts = None
            if counts is not None:
                by_id = {s.rsplit(".", 1)[-1]: n for s, n in counts.items()}
                if ids:
                    done = sum(1 for r in ids if by_id.get(r, 0) > base.get(r, 0))
                else:
                    done = len(by_id)
                if progress:
                    progress(done, want)
                if done >= want:
                    return done, False
            if time.monotonic() > deadline:
                return done, True
            await asyncio.sleep(poll_s)
    finally:
        await nc.close()


async def finalized_counts(settings: Settings, run_id: str) -> dict[str, int]:
    """result_id -> number of result.finalized messages in the stream (1 when exactly once)."""
    nc = await bus.connect(settings)
    try:
        counts = await subject_counts(nc.jetstream(), events.subject(events.RESULT_FINALIZED, run_id, "*"))
    finally:
        await nc.close()
    return {s.rsplit(".", 1)[-1]: n for s, n in counts.items()}
