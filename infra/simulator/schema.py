"""Judge replies the simulator makes up: a JSON value that fills a request's JSON schema
(from the response_format or a schema written in the prompt), deep-judgment excerpts quoted
verbatim from the response, and the word matching requests are scripted by."""

from __future__ import annotations

import json
import math
import re
import string
from functools import lru_cache
from typing import Any

DEFAULT_TRUE_FIELDS = ["sufficient", "is_sufficient", "equivalent", "semantically_equivalent"]
REASONING_NAMES = ("reasoning", "explanation", "rationale", "justification", "reason", "thoughts")


# Words = runs of characters that are neither whitespace nor ASCII punctuation ("_" is a word char).
_SEPARATORS = "".join(c for c in string.punctuation if c != "_")
_SEP_TABLE = str.maketrans(_SEPARATORS, " " * len(_SEPARATORS))
_WORD = re.compile(r"[^\s" + re.escape(_SEPARATORS) + r"]+")


@lru_cache(maxsize=1024)
def words_of(text: str) -> frozenset[str]:
    """Word set of one message (cached: system prompts repeat across requests)."""
    return frozenset(text.translate(_SEP_TABLE).split())


def _interior_words(match: str) -> list[str]:
    """Words of `match` that do not touch its start or end (see `Script`)."""
    return [m.group() for m in _WORD.finditer(match) if m.start() > 0 and m.end() < len(match)]


# ---------------------------------------------------------------- schema filling


_RESPONSE_BLOCK = re.compile(r"<response>\n?(.*?)\n?</response>", re.S)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _is_excerpt_list(node: Any) -> bool:
    if not isinstance(node, dict) or node.get("type") != "array":
        return False
    props = (node.get("items") or {}).get("properties") or {}
    return "text" in props and "confidence" in props


def excerpt_reply(schema: dict[str, Any], values: dict[str, Any], texts: list[str]) -> dict[str, Any] | None:
    """Deep-judgment excerpt requests (every property a list of {text, confidence}): quote, verbatim,
    the sentence of the prompt's <response> block that mentions the scripted value of that
    property, else its first sentence; None when the schema is not an excerpt request."""
    props = schema.get("properties") or {}
    if not props or not all(_is_excerpt_list(p) for p in props.values()):
        return None
    m = _RESPONSE_BLOCK.search("\n".join(texts))
    sentences = [x.strip() for x in _SENTENCE_END.split(m.group(1))] if m else []
    sentences = [x for x in sentences if x]
    out: dict[str, Any] = {}
    for name in props:
        value = values.get(name)
        needle = str(value).lower() if isinstance(value, str | int | float) and str(value) else None
        pick = next((x for x in sentences if needle and needle in x.lower()), sentences[0] if sentences else "")
        out[name] = ([{"text": pick, "confidence": "high"}] if pick
                     else [{"text": "", "confidence": "none", "explanation": "simulated: no evidence"}])
    return out


def fill_schema(
    schema: dict[str, Any],
    values: dict[str, Any] | None = None,
    true_fields: frozenset[str] | set[str] = frozenset(DEFAULT_TRUE_FIELDS),
) -> Any:
    """An instance of `schema`: a scripted value for any property (at any depth) whose name is in
    `values`, else a type default (booleans false unless in `true_fields`, numbers the midpoint of
    their bounds, strings "simulated", enums their first value, arrays empty)."""
    return _fill(schema, schema, values or {}, frozenset(true_fields), "", 0)


def _resolve(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    seen = 0
    while isinstance(node, dict) and "$ref" in node and seen < 32:
        ref = node["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return {}
        target: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part, {}) if isinstance(target, dict) else {}
        extra = {k: v for k, v in node.items() if k != "$ref"}
        node = {**target, **extra} if extra else target
        seen += 1
    return node if isinstance(node, dict) else {}


def _fill(node: Any, root: dict[str, Any], values: dict[str, Any], true_fields: frozenset[str],
          name: str, depth: int) -> Any:
    if depth > 24 or not isinstance(node, dict):
        return None
    node = _resolve(node, root)
    if "const" in node:
        return node["const"]
    if "enum" in node and node["enum"]:
        return node["enum"][0]
    for key in ("anyOf", "oneOf"):
        options = node.get(key)
        if options:
            resolved = [_resolve(o, root) for o in options]
            non_null = [o for o in resolved if o.get("type") != "null"]
            return _fill(non_null[0] if non_null else resolved[0], root, values, true_fields, name, depth + 1)
    if node.get("allOf"):
        merged: dict[str, Any] = {}
        for part in node["allOf"]:
            merged.update(_resolve(part, root))
        merged.update({k: v for k, v in node.items() if k != "allOf"})
        return _fill(merged, root, values, true_fields, name, depth + 1)
    typ = node.get("type")
    if isinstance(typ, list):
        non_null_types = [t for t in typ if t != "null"]
        typ = non_null_types[0] if non_null_types else "null"
    if typ is None:
        typ = "object" if "properties" in node else "string"
    if typ == "object":
        out: dict[str, Any] = {}
        for prop, sub in (node.get("properties") or {}).items():
            if prop in values:
                out[prop] = values[prop]
            else:
                out[prop] = _fill(sub, root, values, true_fields, prop, depth + 1)
        return out
    if typ == "boolean":
        return name in true_fields
    if typ in ("integer", "number"):
        return _number(node, typ == "integer")
    if typ == "array":
        return []
    if typ == "null":
        return None
    lname = name.lower()
    if any(r in lname for r in REASONING_NAMES):
        return "simulated reasoning"
    return "simulated"


def _number(node: dict[str, Any], integer: bool) -> int | float:
    lo = node.get("minimum", node.get("exclusiveMinimum"))
    hi = node.get("maximum", node.get("exclusiveMaximum"))
    if lo is not None and hi is not None:
        mid = (lo + hi) / 2
        return int(math.floor(mid)) if integer else mid
    if lo is not None:
        val = max(lo, 0)
    elif hi is not None:
        val = min(hi, 0)
    else:
        val = 0
    return int(math.ceil(val)) if integer else val


@lru_cache(maxsize=512)
def _schema_from_block(block: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("properties"), dict):
        return obj
    return None


@lru_cache(maxsize=256)
def find_schema_in_text(text: str) -> dict[str, Any] | None:
    """A JSON schema written into a prompt (fenced block, else a bare object with "properties")."""
    if '"properties"' not in text:
        return None
    for block in text.split("```")[1::2]:
        if '"properties"' in block:
            body = block.split("\n", 1)[1] if block[:1].isalpha() and "\n" in block else block
            schema = _schema_from_block(body.strip())
            if schema is not None:
                return schema
    decoder = json.JSONDecoder()
    pos = text.find('"properties"')
    start = text.rfind("{", 0, pos)
    tries = 0
    while start >= 0 and tries < 16:
        try:
            obj, _ = decoder.raw_decode(text, start)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("properties"), dict):
            return obj
        start = text.rfind("{", 0, start)
        tries += 1
    return None


def _schema_in_messages(texts: list[str]) -> dict[str, Any] | None:
    for text in texts:
        schema = find_schema_in_text(text)
        if schema is not None:
            return schema
    return None


# ---------------------------------------------------------------- request handling


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return ""
