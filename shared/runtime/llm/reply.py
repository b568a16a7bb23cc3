"""What a model call gives back: the reply, the classified error, token usage, and the JSON
inside a reply (fenced, in prose, after a think block), extracted robustly."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.core.usage import add_extras, usage_extras

USAGE_KEYS = ("input_tokens", "output_tokens", "total_tokens")
DUMMY_KEY = "sk-none"
MAX_OUTPUT_RETRIES = 2  # extra calls after a malformed / invalid structured reply
MAX_RETRY_AFTER_S = 120.0


@dataclass
class LLMReply:
    text: str
    usage: dict[str, Any]  # {"input_tokens", "output_tokens", "total_tokens", "model"}
    parsed: Any | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    cached: bool = False
    attempts: int = 1
    raw_message: dict[str, Any] | None = None
    cost_usd: float | None = None  # None: the model's price is unknown (shared.runtime.llm.pricing)
    retries: dict[str, int] = field(default_factory=dict)  # transient error kind -> retries it cost


ERROR_KINDS = ("rate_limit", "server_error", "timeout", "connection", "bad_output", "auth", "bad_request",
               "endpoint_refused")
RETRYABLE = frozenset({"rate_limit", "server_error", "timeout", "connection"})


class LLMError(Exception):
    """A model call that failed for good. `kind` is one of `ERROR_KINDS`; the message names the
    model, stage, HTTP status and attempt count, and never contains an API key."""

    def __init__(self, kind: str, message: str, *, model: str = "", stage: str = "",
                 status_code: int | None = None, attempts: int = 1, retry_after: float | None = None,
                 usage: dict[str, Any] | None = None) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown LLMError kind {kind!r}")
        self.kind = kind
        self.model = model
        self.stage = stage
        self.status_code = status_code
        self.attempts = attempts
        self.retry_after = retry_after
        self.usage = usage or {}  # tokens spent before failing (bad_output replies)
        super().__init__(message)


def usage_entry(reply: LLMReply) -> dict[str, Any]:
    """The reply's usage as a `usage_metadata` stage entry."""
    out: dict[str, Any] = {k: int(reply.usage.get(k, 0) or 0) for k in USAGE_KEYS}
    if reply.usage.get("model"):
        out["model"] = reply.usage["model"]
    if reply.retries:
        out["retries"] = dict(reply.retries)  # folded into metadata.retry_counts, not usage_metadata
    out.update(usage_extras(cost_usd=reply.cost_usd, attempts=reply.attempts, cached=reply.cached))
    return out


def add_usage(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum token counts; keep `model` only when both sides agree (or one has none)."""
    out: dict[str, Any] = {k: int(a.get(k, 0) or 0) + int(b.get(k, 0) or 0) for k in USAGE_KEYS}
    models = {m for m in (a.get("model"), b.get("model")) if m}
    if len(models) == 1:
        out["model"] = models.pop()
    retries: dict[str, int] = {}
    for side in (a, b):
        for kind, n in (side.get("retries") or {}).items():
            retries[kind] = retries.get(kind, 0) + int(n)
    if retries:
        out["retries"] = retries
    return add_extras(out, a, b)  # model calls, cached replies, cost


# ---------------------------------------------------------------- JSON extraction

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_-]*)[ \t]*\r?\n?(.*?)```", re.S)
_THINK = re.compile(r"<think(?:ing)?>.*?</think(?:ing)?>", re.S | re.I)
_json_decode = msgspec.json.decode
_raw_decoder = json.JSONDecoder()


def extract_json(text: str) -> Any:
    """The JSON value in a model reply: plain JSON, a ```json fenced block, or JSON in prose.

    Raises ValueError (with a preview of the text) when there is none.
    """
    if not isinstance(text, str):
        raise ValueError(f"reply is {type(text).__name__}, not text")
    s = text.strip()
    if "<think" in s.lower():
        s = _THINK.sub("", s).strip()
    if s[:1] in ("{", "["):
        try:
            return _json_decode(s)
        except msgspec.DecodeError:
            pass
    if "```" in s:
        blocks = _FENCE.findall(s)
        blocks.sort(key=lambda b: b[0].lower() != "json")  # ```json blocks first, stable otherwise
        for _lang, body in blocks:
            body = body.strip()
            if body[:1] in ("{", "["):
                try:
                    return _json_decode(body)
                except msgspec.DecodeError:
                    found = _scan(body)
                    if found is not _MISSING:
                        return found
    found = _scan(s)
    if found is not _MISSING:
        return found
    preview = s if len(s) <= 200 else s[:200] + "..."
    raise ValueError(f"no JSON object found in the reply: {preview!r}")


_MISSING = object()


def _scan(s: str, max_tries: int = 64) -> Any:
    """First decodable object (else array) starting at a '{' (else '[') in `s`."""
    for opener in ("{", "["):
        pos = s.find(opener)
        tries = 0
        while pos >= 0 and tries < max_tries:
            try:
                obj, _end = _raw_decoder.raw_decode(s, pos)
                return obj
            except ValueError:
                pos = s.find(opener, pos + 1)
                tries += 1
    return _MISSING
