"""Size and format limits of everything that crosses the bus, checked in two places:

- at load, before anything is published (`check_question`, `check_config_size`, the planned
  event sizes in `shared.runner`), so an oversized benchmark is refused with a message naming
  the question and the field, instead of failing half-way through publishing;
- at decode, on every event a service or the CLI reads (`check_envelope`, `check_payload`), so a
  forged or corrupt message (a 5,000-character `result_id`, a 10 MB question) is dead-lettered
  once instead of reaching a handler, a subject or ClickHouse.

Events are fat (every event carries its job), and one `answer.requested` carries a job per
judge, so the per-field limits are set to keep the worst realistic event well under NATS's
default 1 MB `max_payload`; the planner also measures each event it is about to publish.
"""

from __future__ import annotations

import re
from typing import Any

MAX_QUESTION_CHARS = 32_000
MAX_TEMPLATE_CHARS = 64_000
MAX_ANSWER_CHARS = 32_000  # the expected answer (raw_answer)
MAX_CONFIG_BYTES = 256_000  # a run config file
MAX_REPLY_CHARS = 100_000  # a model reply is cut here (with a flag) before it is put in an event
MAX_EVENT_BYTES = 1_000_000 - 16_384  # NATS default max_payload minus headers/envelope headroom
MAX_NAME_CHARS = 256  # model names, producer, run name
MAX_URL_CHARS = 2_048

ID_RE = re.compile(r"[A-Za-z0-9_\-]{1,64}")  # run ids, result ids, answer ids: one subject token
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
EVENT_TYPE_RE = re.compile(r"[a-z]{1,32}\.[a-z_]{1,32}")
EVENT_ID_RE = re.compile(r"[A-Za-z0-9_\-:.]{1,512}")


class InvalidEvent(ValueError):
    """An event that breaks the wire limits; it is dead-lettered, never handled."""


class InputTooLarge(ValueError):
    """A benchmark or config part over its limit (refused before publishing)."""


def valid_id(value: str) -> bool:
    return isinstance(value, str) and ID_RE.fullmatch(value) is not None


def safe_token(value: str) -> str:
    """A subject token that is safe to publish on: the value when valid, else 'invalid'."""
    return value if valid_id(value) else "invalid"


def truncate_reply(text: str) -> tuple[str, bool]:
    """(text cut to MAX_REPLY_CHARS, whether it was cut): a long reply is kept, marked, never a
    publish error."""
    if len(text) <= MAX_REPLY_CHARS:
        return text, False
    return text[:MAX_REPLY_CHARS], True


# ---- at load -----------------------------------------------------------------------------


def question_problems(qid: str, text: str, template: str | None, answer: str | None) -> list[str]:
    """Why one question is refused for size, naming the question and field ([] when it fits)."""
    out = []
    for field, value, limit in (("question", text, MAX_QUESTION_CHARS), ("template", template, MAX_TEMPLATE_CHARS),
                                ("answer", answer, MAX_ANSWER_CHARS)):
        if value is not None and len(value) > limit:
            out.append(f"question {qid!r}: {field} is {len(value):,} characters, over the limit of {limit:,}")
    return out


def check_config_size(size: int, where: str) -> None:
    if size > MAX_CONFIG_BYTES:
        raise InputTooLarge(f"{where}: config is {size:,} bytes, over the limit of {MAX_CONFIG_BYTES:,}")


# ---- at decode ---------------------------------------------------------------------------


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise InvalidEvent(what)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(str(value)):,} chars)"


def check_envelope(env: Any, subject: str | None = None) -> None:
    """The envelope's ids and sizes; with `subject`, that it arrived where it says it belongs.
    (Plain `if`s: the messages are built only for a refused envelope; a rebuild checks every
    event of the stream.)"""
    if not valid_id(env.run_id):
        raise InvalidEvent(f"run_id {_short(env.run_id)} is not 1-64 of [A-Za-z0-9_-]")
    if not valid_id(env.result_id):
        raise InvalidEvent(f"result_id {_short(env.result_id)} is not 1-64 of [A-Za-z0-9_-]")
    if not (isinstance(env.event_type, str) and EVENT_TYPE_RE.fullmatch(env.event_type) is not None):
        raise InvalidEvent(f"event_type {_short(env.event_type)} is not <word>.<word>")
    if not (isinstance(env.event_id, str) and EVENT_ID_RE.fullmatch(env.event_id) is not None):
        raise InvalidEvent(f"event_id {_short(env.event_id)} is not 1-512 of [A-Za-z0-9_-:.]")
    if len(env.producer) > MAX_NAME_CHARS:
        raise InvalidEvent(f"producer is {len(env.producer):,} characters")
    if not 0 < env.attempt < 1_000_000:
        raise InvalidEvent(f"attempt {env.attempt} out of range")
    if not (env.attempt_key == "" or (valid_id(env.attempt_key) and env.event_id.endswith(":" + env.attempt_key))):
        raise InvalidEvent(f"attempt_key {_short(env.attempt_key)} is not 1-64 of [A-Za-z0-9_-] at the end of the event id")
    if len(env.payload) > MAX_EVENT_BYTES:
        raise InvalidEvent(f"payload is {len(env.payload):,} bytes")
    if subject is not None:
        named = env.subject
        if subject != named:
            raise InvalidEvent(f"arrived on {_short(subject)} but names {_short(named)}")


def check_model(spec: Any, role: str) -> None:
    _need(0 < len(spec.model_name) <= MAX_NAME_CHARS, f"{role}.model_name is {len(spec.model_name):,} characters")
    _need(len(spec.id) <= MAX_NAME_CHARS, f"{role}.id is {len(spec.id):,} characters")
    _need(spec.api_base is None or len(spec.api_base) <= MAX_URL_CHARS, f"{role}.api_base is too long")
    _need(spec.api_key_env is None or ENV_NAME_RE.fullmatch(spec.api_key_env) is not None,
          f"{role}.api_key_env {_short(spec.api_key_env)} is not an environment variable name")


def check_job(job: Any, env: Any | None = None) -> None:
    """One job's ids (and that they match the envelope carrying it) and field sizes."""
    # a lean job carries its question id with the question's content ("q" in refs) until filled in
    lean_question = "q" in (getattr(job, "refs", None) or {}) and not job.question_id
    for name in ("run_id", "result_id", "answer_id", "question_id"):
        val = getattr(job, name)
        if name == "question_id" and lean_question:
            continue
        ok = 0 < len(val) <= 512 if name == "question_id" else valid_id(val)  # question ids are free text
        _need(ok, f"job.{name} {_short(val)} is not a valid id")
    _need(len(job.question_text) <= MAX_QUESTION_CHARS,
          f"job.question_text is {len(job.question_text):,} characters (limit {MAX_QUESTION_CHARS:,})")
    _need(job.template_code is None or len(job.template_code) <= MAX_TEMPLATE_CHARS,
          f"job.template_code is over {MAX_TEMPLATE_CHARS:,} characters")
    _need(job.raw_answer is None or len(job.raw_answer) <= MAX_ANSWER_CHARS,
          f"job.raw_answer is over {MAX_ANSWER_CHARS:,} characters")
    _need(len(job.template_id) <= 64, "job.template_id is too long")
    # a lean job carries its model specs by content hash ("m" in refs: shared.runtime.content) and
    # leaves them empty on the wire; they are checked here again once filled in (content.fill)
    lean_models = "m" in (getattr(job, "refs", None) or {})
    for spec, role in ((job.answering, "job.answering"), (job.parsing, "job.parsing")):
        if not (lean_models and not spec.model_name):
            check_model(spec, role)
    if env is not None:
        _need(job.run_id == env.run_id, f"job.run_id {_short(job.run_id)} is not the event's run {env.run_id!r}")
