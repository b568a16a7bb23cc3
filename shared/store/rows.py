"""Rows of the ClickHouse tables, each from one place: `event_row` (an Envelope), `result_to_row`
(a VerificationResult), `run_row` (a RunRequested); `project_envelopes` folds a batch of
envelopes into all three (msgspec only, no pydantic)."""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec

from shared.core.events import (
    ANSWER_GENERATED,
    DEAD_LETTER,
    GUARDS_CHECKED,
    RESULT_FINALIZED,
    RUBRIC_EVALUATED,
    RUN_KEY,
    RUN_REQUESTED,
    STAGE_FAILED,
    TEMPLATE_PARSED,
    TEMPLATE_VERIFIED,
    DeadLetter,
    Envelope,
    ResultFinalized,
    RunRequested,
    StageError,
    StageFailed,
    StageRecord,
    records_from_log,
    round6,
)
from shared.core.models import VerificationResult
from shared.core.scrub import scrub_bytes, scrub_text
from shared.store.content_refs import content_refs, job_refs_decoder

UNDECODABLE = "undecodable"
PROJECTION_FAILED = "projection_failed"
STAGE_EVENT_TYPES = frozenset(
    {ANSWER_GENERATED, GUARDS_CHECKED, TEMPLATE_PARSED, TEMPLATE_VERIFIED, RUBRIC_EVALUATED}
)

EVENT_COLUMNS = [
    "event_id", "event_type", "run_id", "result_id", "subject", "occurred_at", "producer", "attempt",
    "schema_version", "stage", "status", "reason", "error_type", "error_message", "duration_ms",
    "input_tokens", "output_tokens", "stage_names", "stage_statuses", "stage_started", "stage_ended",
    "payload", "cost_usd",
]

RESULT_COLUMNS = [
    "run_id", "result_id", "version", "run_name", "question_id", "question_text", "template_id",
    "keywords", "answering_model", "answering_interface", "answering_model_name", "answering_tools",
    "parsing_model", "parsing_interface", "parsing_model_name", "replicate", "evaluation_mode",
    "timestamp", "run_timestamp", "execution_time", "completed_without_errors", "error",
    "failure_category", "failure_stage", "has_template", "template_verification_performed",
    "verify_result", "verify_granular_result", "template_validation_error", "field_verification_error",
    "raw_llm_response", "embedding_check_performed", "embedding_similarity_score",
    "embedding_override_applied", "embedding_model_used", "regex_validations_performed",
    "regex_overall_success", "recursion_limit_reached", "abstention_check_performed",
    "abstention_detected", "abstention_override_applied", "sufficiency_check_performed",
    "sufficiency_detected", "sufficiency_override_applied", "input_tokens", "output_tokens",
    "total_tokens", "usage_stage", "usage_model", "usage_input_tokens", "usage_output_tokens",
    "has_rubric", "rubric_evaluation_performed", "rubric_evaluation_strategy", "llm_trait_scores",
    "llm_trait_labels", "regex_trait_scores", "callable_trait_scores", "metric_trait_scores",
    "deep_judgment_performed", "deep_judgment_rubric_performed", "template_json", "rubric_json",
    "deep_judgment_json", "deep_judgment_rubric_json", "usage_json", "result_json",
    "cost_usd", "model_calls", "cached_replies", "usage_cost_usd",
]

CONTENT_COLUMNS = ["key", "kind", "run_id", "body"]

RUN_COLUMNS = [
    "run_id", "version", "run_name", "timestamp", "requested_at", "job_count", "answer_count",
    "benchmark_name", "evaluation_mode", "parent_run_id", "unfinished_skipped", "config_json",
]

_json = msgspec.json.Encoder()
_NUMBER = (int, float)  # a tuple: `int | float` would build a union on every call


def _us(ts: float) -> int:
    """Seconds since the epoch -> integer microseconds (what DateTime64(6) columns take)."""
    return int(round(ts * 1_000_000))


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


class _StateProbe(msgspec.Struct):
    stages: list[StageRecord] = []
    usage: dict[str, Any] = {}
    error: StageError | None = None
    started_at: float = 0.0
    log: list[tuple[str, str, str, float, float]] = []  # the compact stage log (events.State)


_NULL = msgspec.Raw(b"null")


class _StageProbe(msgspec.Struct):
    """The few fields of a StageEvent payload the events table needs, and the job's bytes (the
    content keys of answer.generated are read from them: a small decode instead of the payload's)."""

    status: str = "performed"
    reason: str = ""
    state: _StateProbe | None = None
    job: msgspec.Raw = _NULL


_stage_probe = msgspec.json.Decoder(_StageProbe)
_failed_dec = msgspec.json.Decoder(StageFailed)
_dead_dec = msgspec.json.Decoder(DeadLetter)
_run_dec = msgspec.json.Decoder(RunRequested)
_result_dec = msgspec.json.Decoder(ResultFinalized)  # expands a compact result


def _base_event_row(env: Envelope) -> list[Any]:
    """The envelope's columns, the rest at their empty values (written out: every event pays it)."""
    attempt, version = env.attempt, env.schema_version
    return [
        env.event_id, env.event_type, env.run_id, env.result_id,
        f"vb.{env.event_type}.{env.run_id}.{env.result_id}",  # Envelope.subject
        int(round(env.occurred_at * 1_000_000)),  # _us
        env.producer, attempt if 0 <= attempt <= 65535 else min(max(attempt, 0), 65535),
        version if 0 <= version <= 65535 else min(max(version, 0), 65535),
        "", "", "", "", "", None, None, None, [], [], [], [],
        bytes(env.payload), None,
    ]


# indexes into an event row, for the fields filled per event type
_STAGE, _STATUS, _REASON, _ETYPE, _EMSG, _DUR, _IN, _OUT = 9, 10, 11, 12, 13, 14, 15, 16
_SNAMES, _SSTATUS, _SSTART, _SEND = 17, 18, 19, 20
_COST = 22


# the service stage behind each stage event, and the usage_metadata keys (spec/001) it fills
_EVENT_STAGE = {
    ANSWER_GENERATED: "generation",
    GUARDS_CHECKED: "guards",
    TEMPLATE_PARSED: "parsing",
    TEMPLATE_VERIFIED: "verification",
    RUBRIC_EVALUATED: "rubric",
    RESULT_FINALIZED: "finalization",
    RUN_REQUESTED: "run",
}
# every usage entry a stage adds is its event's (the state carries the earlier stages' too):
# the events' token and cost columns, and the calls `shared.store.event_usage` reads from them
EVENT_USAGE_KEYS = {
    ANSWER_GENERATED: ("answer_generation",),
    GUARDS_CHECKED: ("abstention_check", "sufficiency_check"),
    TEMPLATE_PARSED: ("parsing", "deep_judgment"),
    TEMPLATE_VERIFIED: ("embedding_check",),
    RUBRIC_EVALUATED: ("rubric_evaluation", "deep_judgment_rubric", "rubric_presence_check"),
}


def _fill_stage(row: list[Any], event_type: str, payload: bytes) -> _StageProbe:
    """Status, error, tokens and the stage log of a StageEvent payload.

    The stage log in `state.stages` holds the records of the stage that published the event
    (events written before the log went lean carry every earlier record too), so per-stage
    latency is computed in SQL (v_stage_latency), where each record is attributed to the first
    event that carried it; `duration_ms` stays NULL here.
    """
    probe = _stage_probe.decode(payload)
    row[_STATUS] = probe.status
    row[_REASON] = probe.reason
    state = probe.state
    if state is None:
        return probe
    log = state.log
    if log and not state.stages:  # the lean wire: the columns straight from the compact log
        base = state.started_at
        # one loop, not zip(*log) and two comprehensions: ~1.2 us less a stage event
        names: list[str] = []
        statuses: list[str] = []
        starts: list[float] = []
        ends: list[float] = []
        for name, status, _reason, offset, took in log:
            names.append(name)
            statuses.append(status)
            begin = round6(base + offset)
            starts.append(begin)
            ends.append(round6(begin + took))
        row[_SNAMES], row[_SSTATUS], row[_SSTART], row[_SEND] = names, statuses, starts, ends
    else:
        stages = [*state.stages, *records_from_log(state.log, state.started_at)] if state.log else state.stages
        if stages:
            row[_SNAMES] = [s.stage for s in stages]
            row[_SSTATUS] = [s.status for s in stages]
            row[_SSTART] = [s.started_at for s in stages]
            row[_SEND] = [s.ended_at for s in stages]
    usage = state.usage
    entries = [usage[k] for k in EVENT_USAGE_KEYS.get(event_type, ()) if isinstance(usage.get(k), dict)]
    if len(entries) == 1:  # the common case, without the generators (the same sums)
        e = entries[0]
        row[_IN], row[_OUT] = _tokens(e, "input_tokens"), _tokens(e, "output_tokens")
        if "cost_usd" in e:
            row[_COST] = 0 + float(e["cost_usd"] or 0.0)
    elif entries:
        row[_IN] = sum(_tokens(e, "input_tokens") for e in entries)
        row[_OUT] = sum(_tokens(e, "output_tokens") for e in entries)
        if all("cost_usd" in e for e in entries):
            row[_COST] = sum(float(e["cost_usd"] or 0.0) for e in entries)
    if state.error is not None:
        row[_ETYPE] = state.error.type
        row[_EMSG] = state.error.message
    return probe


def event_row(env: Envelope, result: Mapping[str, Any] | None = None) -> list[Any]:
    """One `events` row (EVENT_COLUMNS order). Decodes only the payload fields the row needs.

    `result` is the already-decoded VerificationResult dict of a result.finalized event, if the
    caller has it (the projector does), so the payload is not decoded twice.
    """
    return _event_row(env, result)[0]


def _event_row(env: Envelope, result: Mapping[str, Any] | None = None) -> tuple[list[Any], msgspec.Raw | None]:
    """`event_row`, and a stage payload's job as bytes when the payload decoded (None: not a
    stage event, or a malformed one)."""
    row = _base_event_row(env)
    et = env.event_type
    payload = env.payload
    row[_STAGE] = _EVENT_STAGE.get(et, "")
    job = None
    try:
        if et in STAGE_EVENT_TYPES:
            job = _fill_stage(row, et, payload).job
        elif et == STAGE_FAILED:
            err = _failed_dec.decode(payload).error
            row[_STAGE], row[_STATUS] = err.stage, "failed"
            row[_ETYPE], row[_EMSG] = err.type, err.message
        elif et == DEAD_LETTER:
            dl = _dead_dec.decode(payload)
            row[_STAGE], row[_STATUS], row[_REASON] = dl.consumer, "dead_letter", dl.subject
            row[_ETYPE], row[_EMSG] = "DeadLetter", dl.error
        elif et == RESULT_FINALIZED:
            if result is None:
                result = _result_dec.decode(payload).result
            meta = result.get("metadata") or {}
            ok = bool(meta.get("completed_without_errors", True))
            row[_STATUS] = "performed" if ok else "failed"
            if not ok:
                row[_EMSG] = meta.get("error") or ""
            # the job's end-to-end time, as the result records it
            row[_DUR] = _opt_float(meta.get("execution_time"))
            row[_DUR] = None if row[_DUR] is None else row[_DUR] * 1000.0
        elif et == RUN_REQUESTED:
            row[_STATUS] = "performed"
    except Exception as exc:  # noqa: BLE001 - a malformed payload is recorded, never raised
        _mark_invalid(row, exc)
    return row, job


def _mark_invalid(row: list[Any], exc: BaseException) -> None:
    row[_STATUS], row[_ETYPE], row[_EMSG] = "payload_invalid", type(exc).__name__, str(exc)[:4000]


def _subject_ids(subject: str) -> tuple[str, str, str]:
    parts = subject.split(".")
    if len(parts) == 5 and parts[0] == "vb":
        return f"{parts[1]}.{parts[2]}", parts[3], parts[4]
    return "", "", ""


def undecodable_row(
    subject: str, data: bytes, error: BaseException | str, kind: str = UNDECODABLE, max_bytes: int = 65536
) -> list[Any]:
    """An `events` row for a message that is not a valid Envelope (or, with kind
    'projection_failed', one whose rows the store refused): kept, with its error.

    The id is a hash of subject + data, so a redelivery of the same message is one row.
    """
    digest = hashlib.sha256(subject.encode() + b"\0" + data).hexdigest()[:16]
    claimed_type, run_id, result_id = _subject_ids(subject)
    err_type = type(error).__name__ if isinstance(error, BaseException) else "Error"
    return [
        f"{kind}:{digest}", kind, run_id, result_id, subject, _us(time.time()), "", 0, 0,
        claimed_type, kind, "", err_type, scrub_text(str(error))[:4000], None, None, None, [], [], [], [],
        scrub_bytes(data[:max_bytes]), None,  # whatever was on the bus, stored without this process's secrets
    ]


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _opt_bool(v: Any) -> bool | None:
    return None if v is None else bool(v)


def _opt_float(v: Any) -> float | None:
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, _NUMBER):
        return float(v)
    return None


def _score_map(d: Any) -> dict[str, float]:
    if not isinstance(d, dict):
        return {}
    out: dict[str, float] = {}
    for k, v in d.items():
        f = _opt_float(v)
        if f is not None:
            out[str(k)] = f
    return out


def _metric_map(d: Any) -> dict[str, dict[str, float]]:
    if not isinstance(d, dict):
        return {}
    return {str(k): _score_map(v) for k, v in d.items() if isinstance(v, dict)}


def _display(identity: Mapping[str, Any]) -> str:
    """ModelIdentity.display_string, on the JSON dump (no pydantic in the projector)."""
    base = f"{identity.get('interface', 'litellm')}:{identity.get('model_name', '')}"
    tools = identity.get("tools") or []
    return f"{base}+[{','.join(sorted(tools))}]" if tools else base


def _tokens(entry: Any, key: str) -> int:
    if not isinstance(entry, dict):
        return 0
    v = entry.get(key)
    return int(v) if isinstance(v, _NUMBER) and not isinstance(v, bool) and v > 0 else 0


def _iso_to_us(ts: Any) -> int | None:
    if not isinstance(ts, str) or not ts:
        return None
    return _iso_str_to_us(ts)


@functools.lru_cache(maxsize=256)
def _iso_str_to_us(ts: str) -> int | None:
    """Cached: a run's results share its timestamp (~1 us a parse)."""
    try:
        dt = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return _us(dt.timestamp())


def _json_or_empty(obj: Any) -> bytes:
    return b"" if obj is None else _json.encode(obj)


def result_to_row(
    result: VerificationResult | Mapping[str, Any], run_id: str, version: int | None = None
) -> dict[str, Any]:
    """Flatten a VerificationResult (model, or its `model_dump(mode="json")`) into a row dict.

    The one place the result -> `verification_results` mapping lives. `version` orders
    re-projections (ReplacingMergeTree keeps the highest); default: now, in microseconds.
    """
    return dict(zip(RESULT_COLUMNS, result_values(result, run_id, version), strict=True))


def result_values(
    result: VerificationResult | Mapping[str, Any], run_id: str, version: int | None = None
) -> list[Any]:
    """`result_to_row`'s values, in RESULT_COLUMNS order: what a projection keeps, as the
    columns are made from lists without a dict per result to build and read back by name
    (~5 us a result of a rebuild's worker)."""
    data: Mapping[str, Any] = (
        result.model_dump(mode="json") if isinstance(result, VerificationResult) else result
    )
    meta = data.get("metadata") or {}
    tpl = data.get("template")
    rub = data.get("rubric")
    dj = data.get("deep_judgment")
    djr = data.get("deep_judgment_rubric")
    t = tpl or {}
    r = rub or {}
    # the sections' `get`s hoisted (~55 lookups a result), each where its section is first read,
    # so a malformed one fails on the same access as ever
    mget = meta.get
    ans = mget("answering") or {}
    par = mget("parsing") or {}
    failure = mget("failure")
    if not isinstance(failure, dict):
        failure = {}
    tget = t.get
    usage = tget("usage_metadata")
    if not isinstance(usage, dict):
        usage = {}

    u_stage: list[str] = []
    u_model: list[str] = []
    u_in: list[int] = []
    u_out: list[int] = []
    u_cost: list[float | None] = []
    entries: list[dict[str, Any]] = []  # the stages' entries (dicts), for the cost columns
    for stage, entry in usage.items():
        if stage == "total" or not isinstance(entry, dict):
            continue
        entries.append(entry)
        u_stage.append(stage)
        fallback = ans.get("model_name", "") if stage == "answer_generation" else par.get("model_name", "")
        u_model.append(str(entry.get("model") or entry.get("model_name") or fallback))
        u_in.append(_tokens(entry, "input_tokens"))
        u_out.append(_tokens(entry, "output_tokens"))
        c = entry.get("cost_usd")
        u_cost.append(float(c) if isinstance(c, _NUMBER) else None)
    total = usage.get("total")
    if isinstance(total, dict):
        t_in, t_out = _tokens(total, "input_tokens"), _tokens(total, "output_tokens")
        t_all = _tokens(total, "total_tokens") or t_in + t_out
    else:
        total = {}
        t_in, t_out = sum(u_in), sum(u_out)
        t_all = t_in + t_out
    replicate = mget("replicate")

    return [
        run_id,  # run_id
        mget("result_id", ""),  # result_id
        version if version is not None else _us(time.time()),  # version
        _opt_str(mget("run_name")),  # run_name
        mget("question_id", ""),  # question_id
        mget("question_text") or "",  # question_text
        mget("template_id") or "no_template",  # template_id
        [str(k) for k in mget("keywords") or []],  # keywords
        _display(ans),  # answering_model
        ans.get("interface", ""),  # answering_interface
        ans.get("model_name", ""),  # answering_model_name
        [str(x) for x in ans.get("tools") or []],  # answering_tools
        _display(par),  # parsing_model
        par.get("interface", ""),  # parsing_interface
        par.get("model_name", ""),  # parsing_model_name
        replicate if isinstance(replicate, int) and replicate >= 0 else None,  # replicate
        _opt_str(mget("evaluation_mode")),  # evaluation_mode
        mget("timestamp") or "",  # timestamp
        _iso_to_us(mget("timestamp")),  # run_timestamp
        float(mget("execution_time") or 0.0),  # execution_time
        bool(mget("completed_without_errors", True)),  # completed_without_errors
        _opt_str(mget("error")),  # error
        _opt_str(failure.get("category")),  # failure_category
        _opt_str(failure.get("stage")),  # failure_stage
        tpl is not None,  # has_template
        bool(tget("template_verification_performed", False)),  # template_verification_performed
        _opt_bool(tget("verify_result")),  # verify_result
        _opt_float(tget("verify_granular_result")),  # verify_granular_result
        _opt_str(tget("template_validation_error")),  # template_validation_error
        _opt_str(tget("field_verification_error")),  # field_verification_error
        tget("raw_llm_response") or "",  # raw_llm_response
        bool(tget("embedding_check_performed", False)),  # embedding_check_performed
        _opt_float(tget("embedding_similarity_score")),  # embedding_similarity_score
        bool(tget("embedding_override_applied", False)),  # embedding_override_applied
        _opt_str(tget("embedding_model_used")),  # embedding_model_used
        bool(tget("regex_validations_performed", False)),  # regex_validations_performed
        _opt_bool(tget("regex_overall_success")),  # regex_overall_success
        bool(tget("recursion_limit_reached", False)),  # recursion_limit_reached
        bool(tget("abstention_check_performed", False)),  # abstention_check_performed
        _opt_bool(tget("abstention_detected")),  # abstention_detected
        bool(tget("abstention_override_applied", False)),  # abstention_override_applied
        bool(tget("sufficiency_check_performed", False)),  # sufficiency_check_performed
        _opt_bool(tget("sufficiency_detected")),  # sufficiency_detected
        bool(tget("sufficiency_override_applied", False)),  # sufficiency_override_applied
        t_in,  # input_tokens
        t_out,  # output_tokens
        t_all,  # total_tokens
        u_stage,  # usage_stage
        u_model,  # usage_model
        u_in,  # usage_input_tokens
        u_out,  # usage_output_tokens
        rub is not None,  # has_rubric
        bool(r.get("rubric_evaluation_performed", False)),  # rubric_evaluation_performed
        _opt_str(r.get("rubric_evaluation_strategy")),  # rubric_evaluation_strategy
        _score_map(r.get("llm_trait_scores")),  # llm_trait_scores
        {str(k): str(v) for k, v in (r.get("llm_trait_labels") or {}).items()},  # llm_trait_labels
        _score_map(r.get("regex_trait_scores")),  # regex_trait_scores
        _score_map(r.get("callable_trait_scores")),  # callable_trait_scores
        _metric_map(r.get("metric_trait_scores")),  # metric_trait_scores
        bool((dj or {}).get("deep_judgment_performed", False)),  # deep_judgment_performed
        bool((djr or {}).get("deep_judgment_rubric_performed", False)),  # deep_judgment_rubric_performed
        _json_or_empty(tpl),  # template_json
        _json_or_empty(rub),  # rubric_json
        _json_or_empty(dj),  # deep_judgment_json
        _json_or_empty(djr),  # deep_judgment_rubric_json
        _json_or_empty(usage or None),  # usage_json
        _json.encode(data),  # result_json
        *_cost_columns(total, entries, u_cost),  # cost_usd, model_calls, cached_replies, usage_cost_usd
    ]


def _cost_columns(total: dict[str, Any], entries: list[dict[str, Any]], u_cost: list[float | None]) -> tuple[Any, ...]:
    """cost_usd (None when any stage that made calls has no price), model calls, cached replies,
    from the usage's total ({} when it has none) and its stages' entries as `result_values` read
    them. The stages' sums only when the total lacks them: a malformed stage entry then raises
    (the result is recorded as an invalid payload) exactly when the row needs it."""
    calls = int(total.get("model_calls") or sum(int(e.get("model_calls") or 0) for e in entries))
    cached = int(total.get("cached_replies") or sum(int(e.get("cached_replies") or 0) for e in entries))
    c = total.get("cost_usd")
    if not isinstance(c, _NUMBER):
        c = sum(x for x in u_cost if x is not None) if u_cost and all(x is not None for x in u_cost) else None
    return float(c) if c is not None else None, calls, cached, u_cost


def row_to_result(result_json: str | bytes | Mapping[str, Any]) -> VerificationResult:
    """The `result_json` column (or a whole row dict) back into the model, exactly."""
    if isinstance(result_json, Mapping):
        result_json = result_json["result_json"]
    return VerificationResult.model_validate_json(result_json)


def run_row(run: RunRequested | Mapping[str, Any], requested_at: float | None = None) -> list[Any]:
    """One `runs` row (RUN_COLUMNS order) from a run.requested payload."""
    r = run if isinstance(run, RunRequested) else msgspec.convert(run, RunRequested)
    at = requested_at if requested_at is not None else time.time()
    return [
        r.run_id, _us(at), r.run_name, r.timestamp, _us(at), min(max(r.job_count, 0), 2**32 - 1),
        min(max(r.answer_count, 0), 2**32 - 1),
        r.benchmark_name, r.evaluation_mode, r.parent_run_id, list(r.unfinished_skipped),
        _json.encode(r.config),
    ]


@dataclass
class Projection:
    """Rows for the tables, from one batch of messages. `refs` (content key -> (kind, run_id)
    of its first mention) are the contents the batch's events refer to; the projector fetches the
    ones ClickHouse does not have yet into `contents` (rows in CONTENT_COLUMNS order). `results`
    holds `result_values` lists (RESULT_COLUMNS order)."""

    events: list[list[Any]] = field(default_factory=list)
    results: list[list[Any]] = field(default_factory=list)
    runs: list[list[Any]] = field(default_factory=list)
    refs: dict[str, tuple[str, str]] = field(default_factory=dict)
    contents: list[list[Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.events)


def project_envelope(env: Envelope, out: Projection) -> None:
    """Fold one decoded envelope into rows. A payload that does not fit its type is still an
    events row (status payload_invalid), never an exception."""
    try:
        if env.event_type == RESULT_FINALIZED:
            result = _result_dec.decode(env.payload).result
            out.results.append(result_values(result, env.run_id, version=_us(env.occurred_at)))
            out.events.append(event_row(env, result))
            return
        if env.event_type == RUN_REQUESTED and env.result_id == RUN_KEY:
            out.runs.append(run_row(_run_dec.decode(env.payload), env.occurred_at))
    except Exception as exc:  # noqa: BLE001 - a malformed payload is recorded, never raised
        row = _base_event_row(env)
        _mark_invalid(row, exc)
        out.events.append(row)
        return
    row, job = _event_row(env)
    out.events.append(row)
    try:
        # answer.generated's keys came with its row's decode; answer.requested's are read here
        if job is not None and env.event_type == ANSWER_GENERATED:
            refs = job_refs_decoder.decode(job)
            items = refs.refs.items() if refs is not None else ()
        else:
            items = content_refs(env)
        for kind, key in items:
            if key and key not in out.refs:
                out.refs[key] = (kind, env.run_id)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass  # the events row already records what is wrong with the payload


def project_envelopes(envs: Iterable[Envelope]) -> Projection:
    out = Projection()
    for env in envs:
        project_envelope(env, out)
    return out
