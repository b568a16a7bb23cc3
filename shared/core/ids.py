"""Deterministic identifiers (`spec/002` §2): the same inputs always give the same id."""

from __future__ import annotations

import hashlib
import json


def question_id_for(text: str) -> str:
    """MD5 of the question text: the id of a question that brings none of its own."""
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def template_id_for(template_code: str | None) -> str:
    """MD5 of the stripped template code (as the reference computes it), or `no_template`.

    Stripping first means a template re-saved with a trailing newline keeps its id, and ids agree
    with results the reference wrote for the same checkpoint.
    """
    if not template_code or not template_code.strip():
        return "no_template"
    return hashlib.md5(template_code.strip().encode("utf-8")).hexdigest()


def compute_result_id(
    question_id: str,
    answering_key: str,
    parsing_key: str,
    timestamp: str,
    replicate: int | None,
) -> str:
    """16-char SHA256 over (question, answering identity, parsing identity, timestamp, replicate)."""
    raw = json.dumps([question_id, answering_key, parsing_key, timestamp, replicate], separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:16]


def answer_id_for(run_id: str, question_id: str, answering_key: str, replicate: int | None) -> str:
    """Id of one generated answer, shared by every judge that parses it."""
    raw = json.dumps([run_id, question_id, answering_key, replicate], separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:16]


def event_id_for(result_id: str, event_type: str, attempt_key: str = "") -> str:
    """Deterministic event id: published as Nats-Msg-Id so a republish is deduplicated."""
    return f"{result_id}:{event_type}{':' + attempt_key if attempt_key else ''}"
