"""`veribus docs asyncapi`: the event catalogue as an AsyncAPI 3.0 document, generated from the
wire types in `shared.core.events` (their JSON Schema comes from
`msgspec.json.schema_components`), so the published contract cannot drift from the code.

One channel per event type (address `vb.<type>.{run_id}.{result_id}`, plus the projector's
`veribus.query` request-reply), one message per event type (the envelope with that type's
payload), and a send/receive operation per producer and consumer. `docs/asyncapi.json` is the
committed copy; `tests/unit/test_asyncapi.py` fails when it is stale.

Without an installed `veribus`: `python -m shared.cli docs asyncapi [--output FILE] [--check]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from shared.core import events

DEFAULT_OUTPUT = Path("docs/asyncapi.json")
REF = "#/components/schemas/{name}"


@dataclass(frozen=True)
class EventDoc:
    event_type: str
    payload: type
    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    summary: str
    run_level: bool = False  # result_id token is `_`


# the catalogue (README "Event catalogue"); `test_asyncapi` checks it names every event type
CATALOGUE: tuple[EventDoc, ...] = (
    EventDoc(events.RUN_REQUESTED, events.RunRequested, ("cli",), ("projector",),
             "A run: config (no secrets), job and answer counts, unfinished questions skipped.", True),
    EventDoc(events.ANSWER_REQUESTED, events.AnswerRequested, ("cli",), ("generation", "projector"),
             "One answer to generate (result_id token = the answer id), with every judge's job."),
    EventDoc(events.ANSWER_GENERATED, events.StageEvent, ("generation", "cli"), ("guards", "projector"),
             "The answer text or trace and its usage (`regrade` republishes stored answers)."),
    EventDoc(events.GUARDS_CHECKED, events.StageEvent, ("guards",), ("parsing", "rubric", "projector"),
             "Recursion, trace validation, abstention and sufficiency verdicts."),
    EventDoc(events.TEMPLATE_PARSED, events.StageEvent, ("parsing",), ("verification", "projector"),
             "The judge's parse (and deep-judgment excerpts)."),
    EventDoc(events.TEMPLATE_VERIFIED, events.StageEvent, ("verification",), ("finalization", "projector"),
             "verify() result, regex checks, embedding check, auto-fails."),
    EventDoc(events.RUBRIC_EVALUATED, events.StageEvent, ("rubric",), ("finalization", "projector"),
             "Rubric trait scores per trait type, and trait errors."),
    EventDoc(events.RESULT_FINALIZED, events.ResultFinalized, ("finalization",), ("projector", "cli"),
             "The complete VerificationResult."),
    EventDoc(events.STAGE_FAILED, events.StageFailed, ("generation", "guards", "parsing", "verification", "rubric",
                                                        "finalization"), ("projector",),
             "A handler gave up after its deliveries: error type, message, traceback, attempt."),
    EventDoc(events.DEAD_LETTER, events.DeadLetter, ("generation", "guards", "parsing", "verification", "rubric",
                                                      "finalization", "projector"), ("finalization", "projector", "cli"),
             "A message that could not be decoded or handled, with the reason."),
    EventDoc(events.RUN_CANCELLED, events.RunControlChange, ("cli",), ("generation", "guards", "parsing",
                                                                        "verification", "rubric", "finalization",
                                                                        "projector"),
             "The run-control event: cancel, resume (lifts a cancel) or a new token budget; the newest is in force.",
             True),
)


def _key(event_type: str) -> str:
    return event_type.replace(".", "_")


def _version() -> str:
    """The wire contract's version (the envelope's schema_version), not the package's: the
    document changes when the events do."""
    return f"{events.SCHEMA_VERSION}.0.0"


def build() -> dict[str, Any]:
    """The AsyncAPI 3.0 document (a plain dict, deterministic: sorted schemas, no timestamps)."""
    kinds = sorted({d.payload for d in CATALOGUE} | {events.Envelope}, key=lambda t: t.__name__)
    _, schemas = msgspec.json.schema_components(kinds, ref_template=REF)
    schemas["Envelope"]["properties"]["payload"] = {"description": "the event type's payload (see the message)"}
    ids = {"run_id": {"description": "the run id (`veribus runs` lists them)"},
           "result_id": {"description": "the result id; `_` for run-level events, the answer id for answer.requested"}}
    headers = {"type": "object", "properties": {
        "Nats-Msg-Id": {"type": "string", "description": "= event_id: JetStream drops a duplicate publish"},
        "traceparent": {"type": "string", "description": "W3C trace context when tracing is on (VERIBUS_OTEL_ENDPOINT)"},
    }}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for d in CATALOGUE:
        key = _key(d.event_type)
        name = d.payload.__name__
        messages[key] = {
            "name": d.event_type, "title": f"{d.event_type} ({name})", "summary": d.summary,
            "contentType": "application/json", "headers": headers,
            "payload": {"allOf": [{"$ref": REF.format(name="Envelope")}, {
                "type": "object", "required": ["event_type", "payload"],
                "properties": {"event_type": {"const": d.event_type}, "payload": {"$ref": REF.format(name=name)},
                               **({"result_id": {"const": events.RUN_KEY}} if d.run_level else {})}}]},
        }
        address = f"vb.{d.event_type}.{{run_id}}.{events.RUN_KEY if d.run_level else '{result_id}'}"
        channels[key] = {
            "address": address, "title": d.event_type, "description": d.summary,
            "parameters": {k: v for k, v in ids.items() if k in address},
            "messages": {key: {"$ref": f"#/components/messages/{key}"}},
        }
        for who in d.producers:
            operations[f"{who}_sends_{key}"] = {
                "action": "send", "channel": {"$ref": f"#/channels/{key}"}, "summary": f"{who} publishes {d.event_type}",
                "messages": [{"$ref": f"#/channels/{key}/messages/{key}"}]}
        for who in d.consumers:
            operations[f"{who}_receives_{key}"] = {
                "action": "receive", "channel": {"$ref": f"#/channels/{key}"},
                "summary": f"{who} consumes {d.event_type} (subscription vb.{d.event_type}.*.*)",
                "messages": [{"$ref": f"#/channels/{key}/messages/{key}"}]}
    schemas["QueryRequest"] = {"type": "object", "required": ["sql"], "properties": {
        "sql": {"type": "string", "description": "one read-only statement (shared.store.sql_guard)"},
        "params": {"anyOf": [{"type": "object"}, {"type": "null"}]}}}
    schemas["QueryReply"] = {"type": "object", "properties": {
        "columns": {"type": "array", "items": {"type": "string"}}, "rows": {"type": "array", "items": {"type": "array"}},
        "types": {"type": "array", "items": {"type": "string"}}, "error": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
    for name in ("QueryRequest", "QueryReply"):
        messages[name] = {"name": name, "contentType": "application/json", "payload": {"$ref": REF.format(name=name)}}
    channels["query"] = {"address": events.QUERY_SUBJECT, "title": "projector query (request-reply, core NATS)",
                         "description": "Read-only SQL against the projector's store; outside the stream.",
                         "messages": {n: {"$ref": f"#/components/messages/{n}"} for n in ("QueryRequest", "QueryReply")}}
    operations["projector_answers_query"] = {
        "action": "receive", "channel": {"$ref": "#/channels/query"}, "summary": "the projector answers read queries",
        "messages": [{"$ref": "#/channels/query/messages/QueryRequest"}],
        "reply": {"channel": {"$ref": "#/channels/query"}, "messages": [{"$ref": "#/channels/query/messages/QueryReply"}]}}
    return {
        "asyncapi": "3.0.0",
        "info": {"title": "veribus events", "version": _version(),
                 "description": (f"Every event is a JSON envelope on the JetStream stream {events.STREAM} "
                                 f"(subjects {', '.join(events.STREAM_SUBJECTS)}), schema_version "
                                 f"{events.SCHEMA_VERSION}. Generated from shared/core/events.py by "
                                 "`veribus docs asyncapi`: do not edit by hand.")},
        "defaultContentType": "application/json",
        "servers": {"local": {"host": "127.0.0.1:4222", "protocol": "nats",
                              "description": "the local stack's nats-server (`veribus up`)"}},
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": dict(sorted(schemas.items()))},
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False, ensure_ascii=False) + "\n"


def cmd_asyncapi(args: argparse.Namespace) -> int:
    """Write the document, or with --check exit 1 when the file differs from the code's."""
    out = Path(args.output)
    text = render()
    if args.check:
        current = out.read_text(encoding="utf-8") if out.exists() else ""
        if current != text:
            print(f"{out} is stale: run `veribus docs asyncapi --output {out}`", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out} ({len(CATALOGUE)} event types)")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", "-o", default=str(DEFAULT_OUTPUT), help="file to write (default: docs/asyncapi.json)")
    p.add_argument("--check", action="store_true", help="only compare: exit 1 when the file is stale")
    p.set_defaults(fn=cmd_asyncapi)


def register(sub: argparse._SubParsersAction) -> None:  # noqa: SLF001 - argparse exposes no public type
    """Add `docs asyncapi` to the `veribus` parser."""
    docs = sub.add_parser("docs", help="generated documentation (the AsyncAPI event catalogue)")
    kinds = docs.add_subparsers(dest="docs_command", required=True)
    add_arguments(kinds.add_parser("asyncapi", help="write the event catalogue as an AsyncAPI 3.0 document"))


def main(argv: Sequence[str] | None = None) -> int:
    """The command on its own parser (the tests; `veribus docs asyncapi` is the way to run it)."""
    parser = argparse.ArgumentParser(prog="veribus docs asyncapi")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.fn(args))

