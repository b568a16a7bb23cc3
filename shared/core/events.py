"""Wire events (msgspec, JSON): the envelope, the payloads, and the subject scheme.

Subject = `vb.<event-type>.<run_id>.<result_id>`; every event type has two tokens so services
subscribe by type (`vb.answer.generated.*.*`) and one result's history is `vb.*.*.<run>.<rid>`.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from shared.core.compact import compact, expand, is_empty_template_default
from shared.core.ids import event_id_for
from shared.core.limits import MAX_EVENT_BYTES, MAX_NAME_CHARS, InvalidEvent, check_envelope, check_job
from shared.core.scrub import scrub_bytes
from shared.core.signals import Signals

T = TypeVar("T")

SCHEMA_VERSION = 1
STREAM = "VERIBUS"
STREAM_SUBJECTS = ["vb.>"]
QUERY_SUBJECT = "veribus.query"  # request-reply, deliberately outside the stream's subjects

RUN_REQUESTED = "run.requested"
ANSWER_REQUESTED = "answer.requested"
ANSWER_GENERATED = "answer.generated"
GUARDS_CHECKED = "guards.checked"
TEMPLATE_PARSED = "template.parsed"
TEMPLATE_VERIFIED = "template.verified"
RUBRIC_EVALUATED = "rubric.evaluated"
RESULT_FINALIZED = "result.finalized"
STAGE_FAILED = "stage.failed"
DEAD_LETTER = "dead.letter"
RUN_CANCELLED = "run.cancelled"

RUN_KEY = "_"  # the result_id token of run-level events


def subject(event_type: str, run_id: str, result_id: str = RUN_KEY) -> str:
    return f"vb.{event_type}.{run_id}.{result_id}"


def subscription(event_type: str) -> str:
    return f"vb.{event_type}.*.*"


class ModelSpec(msgspec.Struct, omit_defaults=True, frozen=True):
    """A model as the services call it. Holds the *name* of the key's env var, never a key.
    Frozen (change one with `msgspec.structs.replace`), so the empty spec can be a default."""

    model_name: str = ""  # empty only in a lean job, whose specs travel by content hash
    id: str = ""
    interface: str = "litellm"
    api_base: str | None = None
    api_key_env: str | None = None
    temperature: float = 0.0
    max_tokens: int | None = None
    system_prompt: str | None = None
    max_concurrency: int = 32
    timeout: float = 120.0
    max_retries: int = 4
    params: dict[str, Any] = {}
    mcp_servers: dict[str, str] = {}
    max_turns: int = 10
    manual_traces: dict[str, Any] = {}
    requests_per_minute: int | None = None  # deployment-wide limits (shared.runtime.limits)
    tokens_per_minute: int | None = None
    limit_scope: str = "model"  # "model" or "endpoint": what max_concurrency/rpm/tpm are shared by
    input_cost_per_million_tokens: float | None = None  # price overrides (shared.core.usage)
    output_cost_per_million_tokens: float | None = None
    # a second copy of a slow call after this long, or "auto" (shared.runtime.llm.hedge)
    hedge_after_s: Annotated[float, msgspec.Meta(gt=0)] | Literal["auto"] | None = None

    @property
    def tools(self) -> list[str]:
        return sorted(self.mcp_servers)

    @property
    def canonical_key(self) -> str:
        return f"{self.interface}:{self.model_name}:{','.join(self.tools)}"


NO_MODEL = ModelSpec()


class Job(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The fixed inputs of one result (question × answering × parsing × replicate).

    A lean job on the wire (`shared.runtime.content`) leaves out what its `refs` point to and
    the ids its envelope already names (`run_id`; `result_id` in a stage event, `answer_id` in an
    answer request): `payload_as` puts the ids back, the content store the rest."""

    run_id: str = ""
    result_id: str = ""
    answer_id: str = ""
    question_id: str = ""  # empty in a lean job: with the question's content
    question_text: str = ""
    answering: ModelSpec = NO_MODEL  # empty in a lean job: carried by content hash
    parsing: ModelSpec = NO_MODEL
    timestamp: str = ""
    evaluation_mode: str = "template_only"
    run_name: str | None = None
    raw_answer: str | None = None
    keywords: list[str] | None = None
    template_code: str | None = None
    template_id: str = "no_template"
    rubric: dict[str, Any] | None = None  # {"traits": [trait dicts]} (shared.core.rubric.Rubric dump)
    replicate: int | None = None
    options: dict[str, Any] = {}  # VerificationConfig stage options (shared.config.StageOptions dump)
    few_shot_examples: list[dict[str, str]] = []
    refs: dict[str, str] = {}  # content keys of fields left out of the wire (shared.runtime.content)


class StageError(msgspec.Struct, omit_defaults=True):
    stage: str
    type: str
    message: str
    traceback: str = ""
    attempt: int = 1


class StageRecord(msgspec.Struct, omit_defaults=True):
    stage: str
    status: Literal["performed", "skipped", "failed"]
    reason: str = ""
    started_at: float = 0.0
    ended_at: float = 0.0


class State(msgspec.Struct, omit_defaults=True):
    """What the stages have found so far, by result section; folded into a VerificationResult.

    On the wire (`lean_state`) the stage log travels as `log`, one array per record
    `[stage, status, reason, start - started_at, end - start]` in seconds to the microsecond;
    decoding turns it back into `stages` (events written before carry `stages` itself)."""

    template: dict[str, Any] = {}
    rubric: dict[str, Any] | None = None
    deep_judgment: dict[str, Any] | None = None
    deep_judgment_rubric: dict[str, Any] | None = None
    root: dict[str, Any] = {}
    usage: dict[str, dict[str, Any]] = {}
    signals: Signals = msgspec.field(default_factory=Signals)  # flags between stages (shared.core.signals)
    error: StageError | None = None
    stages: list[StageRecord] = []
    started_at: float = 0.0
    log: list[tuple[str, Literal["performed", "skipped", "failed"], str, float, float]] = []

    def __post_init__(self) -> None:
        if self.log:
            self.stages = [*self.stages, *records_from_log(self.log, self.started_at)]
            self.log = []


_ROUND6_EXACT = 4503599627370496.0  # 2**52: below it, x * 1e6 is within half an ulp <= 0.25 of x * 10**6


def round6(x: float) -> float:
    """`round(x, 6)`, the very same float, in about a third of its time: `round(x, 6)` goes
    through a decimal string (~0.5 us), and a rebuild rounds every record of every stage log
    twice. x * 1e6 rounded to an integer k is the correctly rounded number of microseconds,
    unless the product sits exactly on a half, where its rounding error (exact, Dekker's
    product: 1e6 has 14 significant bits) says which way the true x * 10**6 lies; k / 1e6 is
    then the float nearest k / 10**6, as `round` makes it. Zero (whose sign `round` keeps), huge,
    infinite and NaN values take `round` itself."""
    p = x * 1e6
    if not -_ROUND6_EXACT < p < _ROUND6_EXACT:
        return round(x, 6)
    k = round(p)
    d = p - k
    if d == 0.5 or d == -0.5:
        c = 134217729.0 * x  # Dekker's split of x into 26-bit halves
        hi = c - (c - x)
        err = (hi * 1e6 - p) + (x - hi) * 1e6  # x * 10**6 - p, exactly
        if err:
            k = int(p + 0.5) if err > 0.0 else int(p - 0.5)
    return k / 1e6 if k else round(x, 6)


def records_from_log(log: list[Any], started_at: float) -> list[StageRecord]:
    """Stage records from the wire's compact log (`State.log`)."""
    out = []
    for stage, status, reason, start, took in log:
        begin = round6(started_at + start)
        out.append(StageRecord(stage=stage, status=status, reason=reason, started_at=begin,
                               ended_at=round6(begin + took)))
    return out


def lean_state(state: State) -> State:
    """The state as published: its stage log compact (see State), and without the template
    fields at their empty defaults (`shared.core.compact.is_empty_template_default`)."""
    if any(is_empty_template_default(k, v) for k, v in state.template.items()):
        state = msgspec.structs.replace(
            state, template={k: v for k, v in state.template.items() if not is_empty_template_default(k, v)})
    if not state.stages:
        return state
    base = state.started_at
    log = [(r.stage, r.status, r.reason, round(r.started_at - base, 6), round(r.ended_at - r.started_at, 6))
           for r in state.stages]
    lean = msgspec.structs.replace(state, stages=[])
    lean.log = log  # set after: construction (__post_init__) would turn it back into records
    return lean


class StageEvent(msgspec.Struct, omit_defaults=True):
    """Payload of every per-result stage event: the job and its state after this stage."""

    job: Job
    state: State
    status: Literal["performed", "skipped", "failed"] = "performed"
    reason: str = ""


class AnswerRequested(msgspec.Struct, omit_defaults=True):
    """One answer to generate, parsed by every job in `jobs` (one per judge)."""

    jobs: list[Job]


class RunRequested(msgspec.Struct, omit_defaults=True):
    run_id: str
    timestamp: str
    job_count: int
    answer_count: int
    run_name: str | None = None
    benchmark_name: str = ""
    evaluation_mode: str = "template_only"
    config: dict[str, Any] = {}
    unfinished_skipped: list[str] = []
    parent_run_id: str | None = None


class RunControlChange(msgspec.Struct, omit_defaults=True):
    """Payload of `run.cancelled` (`vb.run.cancelled.<run>._`), the run-control event: the newest
    message on that subject is in force. `cancelled=True` cancels the run; `cancelled=False`
    (published by `resume`) lifts an earlier cancel; `budget_tokens` and `budget_cost_usd` replace
    the token and money budgets of the run's config. A lift also says which earlier results the
    resume runs again: the stopped ones (cancelled, over budget) unless `skips_stopped`, and the
    errored ones with `reruns_errors` (`resume --errors`). The subject keeps its first name so
    stored events read back unchanged."""

    cancelled: bool = True
    reason: str = ""
    budget_tokens: int | None = None
    at: float = 0.0
    budget_cost_usd: float | None = None
    skips_stopped: bool = False
    reruns_errors: bool = False

    @property
    def action(self) -> Literal["cancel", "resume", "budget"]:
        """What the change does, for people and reports."""
        if self.cancelled:
            return "cancel"
        raised = self.budget_tokens is not None or self.budget_cost_usd is not None
        return "budget" if raised and self.reason != "resumed" else "resume"


class StageFailed(msgspec.Struct, omit_defaults=True):
    error: StageError
    event_type: str = ""  # the event whose handling failed


class DeadLetter(msgspec.Struct, omit_defaults=True):
    subject: str
    consumer: str
    error: str
    deliveries: int
    data: str = ""  # the undeliverable message, as text (truncated)


class ResultFinalized(msgspec.Struct, omit_defaults=True):
    """Payload of `result.finalized`: the whole VerificationResult, so a rebuild needs no other event.

    Decoded, `result` is always the full `model_dump(mode="json")`. On the wire the finalizer
    sends `compact` instead (the dump without its default values, `shared.core.compact`), which
    decoding expands back; events written before that carry `result` itself and read unchanged."""

    result: dict[str, Any] = {}  # VerificationResult.model_dump(mode="json")
    compact: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if self.compact and not self.result:
            self.result = expand(self.compact)
            self.compact = {}

    @classmethod
    def wire(cls, dump: dict[str, Any]) -> ResultFinalizedWire:
        """What the finalizer publishes for a result dump: its compact form only."""
        return ResultFinalizedWire(compact=compact(dump))


class ResultFinalizedWire(msgspec.Struct):
    """The encoding side of ResultFinalized (decode with ResultFinalized)."""

    compact: dict[str, Any]


class Envelope(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The wire envelope. Published (`wire`), it leaves out what its subject
    (`vb.<event_type>.<run_id>.<result_id>`) says and an event id that follows from those
    (`event_id_for`); `decode(data, subject)` puts them back. Envelopes that carry them (events
    written before, or read back without a subject) decode as always."""

    event_id: str = ""
    event_type: str = ""
    run_id: str = ""
    result_id: str = ""
    occurred_at: float
    producer: str
    payload: msgspec.Raw
    schema_version: int = SCHEMA_VERSION
    attempt: int = 1  # the delivery that published it (a give-up records its last delivery)
    # the `resume` attempt the event belongs to ('' for a first run); its event id ends in
    # `:<attempt_key>` too, so a resumed chain is not deduplicated against an earlier one
    attempt_key: str = ""

    @property
    def subject(self) -> str:
        return subject(self.event_type, self.run_id, self.result_id)


_encoder = msgspec.json.Encoder()
_env_decoder = msgspec.json.Decoder(Envelope)
_payload_decoders: dict[type, msgspec.json.Decoder] = {}


class SchemaVersionError(ValueError):
    pass


def make_envelope(
    event_type: str, run_id: str, result_id: str, payload: Any, producer: str, attempt: int = 1,
    attempt_key: str = "",
) -> Envelope:
    return Envelope(
        event_id=event_id_for(result_id if result_id != RUN_KEY else run_id, event_type, attempt_key),
        event_type=event_type,
        run_id=run_id,
        result_id=result_id,
        occurred_at=time.time(),
        producer=producer,
        payload=msgspec.Raw(scrub_bytes(_encoder.encode(payload))),  # no secret value is ever published
        attempt=attempt,
        attempt_key=attempt_key,
    )


def encode(env: Envelope) -> bytes:
    """The whole envelope (it decodes without its subject)."""
    return _encoder.encode(env)


def _derived_id(env: Envelope) -> str:
    return event_id_for(env.result_id if env.result_id != RUN_KEY else env.run_id, env.event_type, env.attempt_key)


def wire(env: Envelope) -> bytes:
    """The envelope as published on its subject: without the ids the subject names, and without
    its event id when that follows from them (see Envelope)."""
    event_id = "" if env.event_id == _derived_id(env) else env.event_id
    return _encoder.encode(msgspec.structs.replace(env, event_id=event_id, event_type="", run_id="", result_id=""))


def _from_subject(env: Envelope, subject: str | None) -> None:
    """Fill in what a published envelope left out, from the subject it arrived on."""
    if subject is None:
        raise InvalidEvent(f"event {env.event_id[:100] or '?'} names no type, run or result: it is read from its subject")
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != "vb":
        raise InvalidEvent(f"subject {subject[:200]!r} is not vb.<event-type>.<run>.<result>")
    env.event_type = env.event_type or f"{parts[1]}.{parts[2]}"
    env.run_id = env.run_id or parts[3]
    env.result_id = env.result_id or parts[4]
    if not env.event_id:
        env.event_id = _derived_id(env)


# a subject whose tokens pass `check_envelope`'s id and event type checks (`_from_wire_subject`)
_WIRE_SUBJECT = re.compile(r"vb\.([a-z]{1,32}\.[a-z_]{1,32})\.([A-Za-z0-9_\-]{1,64})\.([A-Za-z0-9_\-]{1,64})")


# one string object for each event type, run id and producer of the events decoded lately: a
# rebuild's rows hold the same few values tens of thousands of times, and Arrow reads one string
# for them where it read a string scattered over the heap for each (~0.15 us an event a column)
_SHARED: dict[str, str] = {}
_SHARED_MAX = 4096


def _from_wire_subject(env: Envelope, subject: str) -> bool:
    """The common case of `decode` in one regex: a `wire` envelope (no ids of its own) within
    the limits on a well-formed subject passes every check, as its ids are the subject's tokens
    (a rebuild decodes every event of the stream: ~2 us an event saved). False, with `env`
    untouched, for anything else: the full checks then raise their precise errors."""
    if (env.event_type or env.run_id or env.result_id or env.event_id or env.attempt_key
            or env.schema_version != SCHEMA_VERSION or not 0 < env.attempt < 1_000_000
            or len(env.producer) > MAX_NAME_CHARS or len(env.payload) > MAX_EVENT_BYTES):
        return False
    m = _WIRE_SUBJECT.fullmatch(subject)
    if m is None:
        return False
    et, run_id, result_id = m.groups()
    if len(_SHARED) > _SHARED_MAX:
        _SHARED.clear()
    env.event_type = et = _SHARED.setdefault(et, et)
    env.run_id = run_id = _SHARED.setdefault(run_id, run_id)
    env.result_id = result_id
    env.producer = _SHARED.setdefault(env.producer, env.producer)
    env.event_id = f"{result_id if result_id != RUN_KEY else run_id}:{et}"  # _derived_id, without an attempt key
    return True


def decode(data: bytes, subject: str | None = None) -> Envelope:
    """Decode and validate an envelope (ids, sizes; with `subject`, that it arrived where it
    says it belongs): raises for a bad one, which is then dead-lettered, never handled."""
    if len(data) > MAX_EVENT_BYTES + 65_536:
        raise InvalidEvent(f"message is {len(data):,} bytes")
    env = _env_decoder.decode(data)
    if subject is not None and _from_wire_subject(env, subject):
        return env
    if not env.event_type:  # published by `wire`: its subject names it
        _from_subject(env, subject)
    if env.schema_version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"event {env.event_id[:100]} has schema_version {env.schema_version}, expected {SCHEMA_VERSION}"
        )
    check_envelope(env, subject)
    return env


def payload_as(env: Envelope, kind: type[T]) -> T:
    """Decode the payload as `kind`; jobs it carries are checked against the limits."""
    dec = _payload_decoders.get(kind)
    if dec is None:
        dec = _payload_decoders[kind] = msgspec.json.Decoder(kind)
    payload = dec.decode(env.payload)
    _ids_from_envelope(env, payload)
    check_payload(env, payload)
    return payload


def _ids_from_envelope(env: Envelope, payload: Any) -> None:
    """A lean job leaves out the ids its envelope names: put them back before the checks."""
    if isinstance(payload, StageEvent):
        job = payload.job
        if not job.run_id:
            job.run_id = env.run_id
        if not job.result_id:
            job.result_id = env.result_id
    elif isinstance(payload, AnswerRequested):
        for job in payload.jobs:
            if not job.run_id:
                job.run_id = env.run_id
            if not job.answer_id:
                job.answer_id = env.result_id


def check_payload(env: Envelope, payload: Any) -> None:
    """Payload checks for the kinds that carry jobs (the ones handlers act on): each job within
    the limits, of the event's run, and under the event's id."""
    if isinstance(payload, AnswerRequested):
        if not 0 < len(payload.jobs) <= 1_000:
            raise InvalidEvent(f"answer.requested carries {len(payload.jobs)} jobs")
        for job in payload.jobs:
            check_job(job, env)
            if job.answer_id != env.result_id:
                raise InvalidEvent(f"job.answer_id {job.answer_id[:40]!r} is not the event's id")
    elif isinstance(payload, StageEvent):
        check_job(payload.job, env)
        if payload.job.result_id != env.result_id:
            raise InvalidEvent(f"job.result_id {payload.job.result_id[:40]!r} is not the event's result "
                               f"{env.result_id!r}")


def to_json(obj: Any) -> bytes:
    return _encoder.encode(obj)

