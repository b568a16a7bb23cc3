"""Scrub secret-looking values out of text before it is published, logged or stored.

Two layers, because neither alone is enough:
- *exact values*: the value of every environment variable of this process whose name looks like
  a credential (`*KEY*`, `*TOKEN*`, `*SECRET*`, `*PASSWORD*`, ...). Whatever path a key takes
  (a template returning it in a parsed field, an exception quoting a request header), its exact
  text is replaced, in events (payload bytes, JSON-escaped forms included), logs and errors;
- *patterns*: common key shapes (`sk-...`, `Bearer ...`, `api_key=...`, AWS/GitHub/Slack
  tokens) in free text (error messages, tracebacks, log lines), for keys this process never
  had in its environment.

Patterns are applied only to free text, never to whole event payloads, where they could cut
JSON apart; exact values are safe everywhere.
"""

from __future__ import annotations

import json
import logging
import os
import re
import traceback
from typing import Any

REDACTED = "[REDACTED]"

_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|AUTH|PRIVATE)", re.I)
_MIN_LEN = 8  # shorter values ("1", "true") would redact ordinary text
_NOT_SECRET = frozenset({"true", "false", "none", "null", "1", "0", "yes", "no"})

_PATTERNS = re.compile(
    r"sk-(?:ant-|proj-)?[A-Za-z0-9_\-]{12,}"  # OpenAI / Anthropic style keys
    r"|AKIA[0-9A-Z]{16}"  # AWS access key id
    r"|gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub tokens
    r"|xox[abprs]-[A-Za-z0-9\-]{10,}"  # Slack tokens
    r"|AIza[0-9A-Za-z_\-]{30,}"  # Google API keys
    r"|(?<=[Bb]earer )[A-Za-z0-9_\-\.=+/]{8,}"  # Authorization: Bearer <token>
    r"|(?<=[Bb]asic )[A-Za-z0-9+/=]{12,}"
    r"|(?i:(?<=api_key=)|(?<=api-key=)|(?<=apikey=)|(?<=token=)|(?<=password=)|(?<=secret=))[^\s&\"',;]{6,}"
    r"|(?i:(?<=\"api_key\": \")|(?<='api_key': ')|(?<=\"authorization\": \")|(?<='authorization': '))"
    r"[^\"']{6,}",
)


def is_secret_name(name: str) -> bool:
    """True for an environment variable name that looks like it holds a credential."""
    return bool(_SECRET_NAME.search(name))


_names_cache: dict[int, tuple[str, ...]] = {}
_variants_cache: dict[tuple[tuple[str, str], ...], tuple[list[str], list[bytes]]] = {}


def _text(value: str | bytes) -> str:
    return os.fsdecode(value) if isinstance(value, bytes) else value


def _secret_names(env: Any) -> tuple[Any, ...]:
    """Credential-like variable names of `env`, cached by its set of names (this runs for every
    event published, so the regex pass over ~100 names happens once per distinct environment)."""
    keys = tuple(env)
    h = hash(keys)
    names = _names_cache.get(h)
    if names is None:
        names = tuple(k for k in keys if is_secret_name(_text(k)))
        if len(_names_cache) > 64:
            _names_cache.clear()
        _names_cache[h] = names
    return names


def _raw_environ() -> dict[Any, Any]:
    """This process's environment without decoding every entry: `os.environ` decodes each key
    and value on access (~300 us for ~100 variables), its backing dict does not."""
    data = getattr(os.environ, "_data", None)
    return data if isinstance(data, dict) else dict(os.environ)


def _current(environ: os._Environ[str] | dict[str, str] | None) -> tuple[list[str], list[bytes]]:
    """(text variants, byte variants) of the secret values, longest first, cached by value."""
    env: Any = _raw_environ() if environ is None else environ
    pairs = tuple((k, env[k]) for k in _secret_names(env))
    hit = _variants_cache.get(pairs)
    if hit is None:
        decoded = {_text(v) for _, v in pairs}
        vals = sorted({v for v in decoded if len(v) >= _MIN_LEN and v.lower() not in _NOT_SECRET},
                      key=len, reverse=True)
        texts = [x for v in vals for x in _variants(v)]
        hit = (texts, [t.encode() for t in texts])
        if len(_variants_cache) > 64:
            _variants_cache.clear()
        _variants_cache[pairs] = hit
    return hit


def _variants(value: str) -> list[str]:
    """The value and its JSON-escaped form (different when it holds quotes, backslashes...)."""
    escaped = json.dumps(value)[1:-1]
    return [value] if escaped == value else [value, escaped]


def scrub_text(text: str, extra: list[str] | None = None) -> str:
    """`text` with known secret values and secret-looking tokens replaced by REDACTED."""
    if not text:
        return text
    for v in [*(x for e in (extra or []) for x in _variants(e)), *_current(None)[0]]:
        if v in text:
            text = text.replace(v, REDACTED)
    return _PATTERNS.sub(REDACTED, text)


def scrub_bytes(data: bytes) -> bytes:
    """Exact secret values (and their JSON-escaped forms) out of encoded bytes, e.g. an event
    payload: the JSON stays valid because REDACTED needs no escaping."""
    for b in _current(None)[1]:
        if b in data:
            data = data.replace(b, REDACTED.encode())
    return data


class ScrubFilter(logging.Filter):
    """A logging filter that scrubs each record's final message (args included) and its
    exception text, so no handler ever writes a secret."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is logged as is
            msg = str(record.msg)
        record.msg = scrub_text(msg)
        record.args = None
        if record.exc_info:
            record.exc_text = scrub_text("".join(traceback.format_exception(*record.exc_info)))
            record.exc_info = None
        if record.stack_info:
            record.stack_info = scrub_text(record.stack_info)
        return True
