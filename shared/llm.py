"""The LLM port: every model call of every service goes through `LLMClient.complete`.

It wraps litellm (any provider) and adds what the pipeline needs around it: structured output
with robust JSON extraction and validation retries, retries with backoff on transient errors,
a per-model concurrency limit, and a response cache so a redelivered or replayed stage does not
pay twice. litellm is imported lazily (it takes seconds) with its network and `.env` side effects
switched off, and with its per-call cost/logging work skipped when no litellm callback is set.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import logging
import os
import random
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from shared.cost import add_extras, call_cost, usage_extras
from shared.events import ModelSpec
from shared.limits import LocalLimiter, estimate_tokens

log = logging.getLogger("veribus.llm")

USAGE_KEYS = ("input_tokens", "output_tokens", "total_tokens")
DUMMY_KEY = "sk-none"
MAX_OUTPUT_RETRIES = 2  # extra calls after a malformed / invalid structured reply
MAX_RETRY_AFTER_S = 120.0

_litellm: Any = None


def _get_litellm() -> Any:
    """Import litellm once, offline: no cost-map fetch, no `.env` loading, no debug chatter."""
    global _litellm
    if _litellm is None:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        os.environ.setdefault("LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS", "True")
        os.environ.setdefault("LITELLM_LOCAL_BLOG_POSTS", "True")
        os.environ.setdefault("LITELLM_MODE", "PRODUCTION")  # "DEV" (default) loads ./.env
        import litellm

        litellm.suppress_debug_info = True
        litellm.turn_off_message_logging = True
        logging.getLogger("LiteLLM").setLevel(logging.WARNING)
        if os.environ.get("VERIBUS_LITELLM_LEAN", "1") != "0":
            _install_lean_hooks(litellm)
        _litellm = litellm
    return _litellm


def _install_lean_hooks(litellm: Any) -> None:
    """Skip litellm's per-call cost calculation and success logging while no callback is set.

    Measured: ~7.9 -> ~5.2 ms CPU per call against a local server. We compute usage ourselves
    and price nothing here; with any litellm callback configured the originals run unchanged.
    """
    try:
        from litellm.litellm_core_utils import litellm_logging as ll
    except ImportError:  # pragma: no cover - other litellm layout
        return
    cls = getattr(ll, "Logging", None)
    names = ("response_cost_calculator", "async_success_handler", "handle_sync_success_callbacks_for_async_calls")
    if cls is None or getattr(cls, "_veribus_lean", False) or not all(hasattr(cls, n) for n in names):
        return
    orig_cost, orig_async, orig_sync = (getattr(cls, n) for n in names)

    def has_callbacks() -> bool:
        return bool(
            getattr(litellm, "callbacks", None)
            or getattr(litellm, "success_callback", None)
            or getattr(litellm, "_async_success_callback", None)
        )

    def response_cost_calculator(self: Any, *args: Any, **kwargs: Any) -> Any:
        return orig_cost(self, *args, **kwargs) if has_callbacks() else None

    async def async_success_handler(self: Any, *args: Any, **kwargs: Any) -> Any:
        if has_callbacks():
            return await orig_async(self, *args, **kwargs)
        return None

    def handle_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        return orig_sync(self, *args, **kwargs) if has_callbacks() else None

    cls.response_cost_calculator = response_cost_calculator
    cls.async_success_handler = async_success_handler
    cls.handle_sync_success_callbacks_for_async_calls = handle_sync
    cls._veribus_lean = True


# ---------------------------------------------------------------- replies, errors, usage


@dataclass
class LLMReply:
    text: str
    usage: dict[str, Any]  # {"input_tokens", "output_tokens", "total_tokens", "model"}
    parsed: Any | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    cached: bool = False
    attempts: int = 1
    raw_message: dict[str, Any] | None = None
    cost_usd: float | None = None  # None: the model's price is unknown (shared.cost)


ERROR_KINDS = ("rate_limit", "server_error", "timeout", "connection", "bad_output", "auth", "bad_request")
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

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE


def usage_entry(reply: LLMReply) -> dict[str, Any]:
    """The reply's usage as a `usage_metadata` stage entry."""
    out: dict[str, Any] = {k: int(reply.usage.get(k, 0) or 0) for k in USAGE_KEYS}
    if reply.usage.get("model"):
        out["model"] = reply.usage["model"]
    out.update(usage_extras(cost_usd=reply.cost_usd, attempts=reply.attempts, cached=reply.cached))
    return out


def add_usage(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum token counts; keep `model` only when both sides agree (or one has none)."""
    out: dict[str, Any] = {k: int(a.get(k, 0) or 0) + int(b.get(k, 0) or 0) for k in USAGE_KEYS}
    models = {m for m in (a.get("model"), b.get("model")) if m}
    if len(models) == 1:
        out["model"] = models.pop()
    return add_extras(out, a, b)


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


# ---------------------------------------------------------------- cache


class ResponseCache(Protocol):
    async def get(self, key: str) -> dict[str, Any] | None: ...

    async def put(self, key: str, value: dict[str, Any]) -> None: ...


class MemoryCache:
    """In-process LRU cache (tests, single-process runs)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._data: OrderedDict[str, dict[str, Any]] = OrderedDict()

    async def get(self, key: str) -> dict[str, Any] | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    async def put(self, key: str, value: dict[str, Any]) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


class NatsKVCache:
    """Cache shared by all service replicas, on a JetStream key-value bucket (entries expire)."""

    def __init__(self, js: Any, bucket: str = "vb_llm_cache", ttl_s: float = 7 * 24 * 3600,
                 max_value_bytes: int = 900_000) -> None:
        self.js = js
        self.bucket = bucket
        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self._kv: Any = None
        self._lock = asyncio.Lock()

    async def _bucket(self) -> Any:
        if self._kv is None:
            async with self._lock:
                if self._kv is None:
                    from nats.js.api import KeyValueConfig
                    from nats.js.errors import BucketNotFoundError, NotFoundError

                    try:
                        self._kv = await self.js.key_value(self.bucket)
                    except (BucketNotFoundError, NotFoundError):
                        config = KeyValueConfig(bucket=self.bucket, ttl=self.ttl_s, history=1,
                                                description="veribus LLM response cache")
                        try:
                            self._kv = await self.js.create_key_value(config)
                        except Exception:  # another replica created it meanwhile
                            self._kv = await self.js.key_value(self.bucket)
        return self._kv

    async def get(self, key: str) -> dict[str, Any] | None:
        from nats.js.errors import KeyNotFoundError

        kv = await self._bucket()
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        value = _json_decode(entry.value)
        return value if isinstance(value, dict) else None

    async def put(self, key: str, value: dict[str, Any]) -> None:
        data = msgspec.json.encode(value)
        if len(data) > self.max_value_bytes:
            log.debug("llm cache: reply of %d bytes not cached (limit %d)", len(data), self.max_value_bytes)
            return
        kv = await self._bucket()
        await kv.put(key, data)


_key_encoder = msgspec.json.Encoder(order="sorted")


CACHE_SCOPE: ContextVar[str | None] = ContextVar("veribus_llm_cache_scope", default=None)
"""The scope of cached replies (the run id, set per handled event): a redelivery or replay of the
same run reuses a reply; a new run of the same benchmark asks the model afresh."""


def cache_key(model: ModelSpec, messages: list[dict[str, Any]], *, response_schema: dict[str, Any] | None = None,
              schema_name: str = "response", tools: list[dict[str, Any]] | None = None,
              replicate: int | None = None) -> str:
    """sha256 over everything that changes the model's reply (never the API key)."""
    material = {
        "model": model.canonical_key,
        "api_base": model.api_base,
        "messages": messages,
        "temperature": model.temperature,
        "max_tokens": model.max_tokens,
        "params": model.params,
        "schema": response_schema,
        "schema_name": schema_name if response_schema is not None else None,
        "tools": tools,
        "replicate": replicate,
        "scope": CACHE_SCOPE.get(),
    }
    return hashlib.sha256(_key_encoder.encode(material)).hexdigest()


# ---------------------------------------------------------------- client

_SECRET_PATTERNS = re.compile(
    r"(sk-[A-Za-z0-9_\-]{8,}|(?:api[_-]?key|x-api-key|authorization|bearer)[\"'=:\s]+[A-Za-z0-9_\-\.]{8,})", re.I
)


def _scrub(text: str, secret: str | None) -> str:
    if secret and secret != DUMMY_KEY and len(secret) >= 4:
        text = text.replace(secret, "***")
    return _SECRET_PATTERNS.sub("***", text)


def _classify(exc: BaseException) -> tuple[str, int | None]:
    """(kind, HTTP status) of a litellm/openai/asyncio exception."""
    status = getattr(exc, "status_code", None)
    if not isinstance(status, int):
        status = None
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timeout", status
    litellm = _litellm
    if litellm is not None:
        checks: list[tuple[str, str]] = [
            ("Timeout", "timeout"),
            ("RateLimitError", "rate_limit"),
            ("AuthenticationError", "auth"),
            ("PermissionDeniedError", "auth"),
            ("ContextWindowExceededError", "bad_request"),
            ("BadRequestError", "bad_request"),
            ("NotFoundError", "bad_request"),
            ("UnprocessableEntityError", "bad_request"),
            ("InternalServerError", "server_error"),
            ("ServiceUnavailableError", "server_error"),
            ("BadGatewayError", "server_error"),
            ("APIConnectionError", "connection"),
        ]
        for name, kind in checks:
            cls = getattr(litellm, name, None)
            if isinstance(cls, type) and isinstance(exc, cls):
                return kind, status
    if status is not None:
        if status == 429:
            return "rate_limit", status
        if status in (401, 403):
            return "auth", status
        if status == 408:
            return "timeout", status
        if status >= 500:
            return "server_error", status
        if 400 <= status < 500:
            return "bad_request", status
    if isinstance(exc, ConnectionError | OSError) or type(exc).__module__.startswith(("aiohttp", "httpx")):
        return "connection", status
    return "bad_request", status  # anything else (a bug, a bad argument) would fail again: no retry


def _retry_after(exc: BaseException) -> float | None:
    """Seconds the server asked us to wait (`retry-after-ms` or `Retry-After`), if any."""
    for headers in (getattr(exc, "litellm_response_headers", None),
                    getattr(getattr(exc, "response", None), "headers", None)):
        if not headers:
            continue
        try:
            ms = headers.get("retry-after-ms")
            if ms is not None:
                return max(0.0, float(ms) / 1000)
            ra = headers.get("retry-after")
            if ra is not None:
                try:
                    return max(0.0, float(ra))
                except ValueError:
                    from email.utils import parsedate_to_datetime

                    return max(0.0, parsedate_to_datetime(ra).timestamp() - time.time())
        except (TypeError, ValueError, AttributeError):
            continue
    return None


def _mentions_response_format(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "response_format" in text or "json_schema" in text or "structured output" in text


TRANSPORTS = ("auto", "litellm", "direct")


def transport_for(model: ModelSpec) -> str:
    """Which HTTP path a call takes. `auto` (the default, `VERIBUS_LLM_TRANSPORT`): an
    `openai/<name>` model at an explicit `api_base` is an OpenAI-compatible server (vLLM, Ollama,
    the simulator), where litellm has nothing to translate and costs ~6 ms CPU per call, so the
    request goes straight to `<api_base>/chat/completions`; every other model goes through litellm."""
    choice = os.environ.get("VERIBUS_LLM_TRANSPORT", "auto").lower()
    if choice not in TRANSPORTS:
        raise ValueError(f"VERIBUS_LLM_TRANSPORT must be one of {TRANSPORTS}, got {choice!r}")
    if choice == "litellm":
        return "litellm"
    direct_ok = bool(model.api_base) and model.model_name.startswith("openai/")
    if choice == "direct" and not direct_ok:
        return "litellm"
    return "direct" if direct_ok else "litellm"


class HTTPStatusError(Exception):
    """A non-2xx reply of an OpenAI-compatible server (direct transport)."""

    def __init__(self, status_code: int, body: str, headers: dict[str, str]) -> None:
        self.status_code = status_code
        self.response = type("Resp", (), {"headers": headers})()
        super().__init__(f"HTTP {status_code}: {body[:500]}")


class _Obj:
    """Attribute access over a decoded JSON dict, so direct replies read like SDK objects."""

    __slots__ = ("_d",)

    def __init__(self, d: dict[str, Any]) -> None:
        self._d = d

    def __getattr__(self, name: str) -> Any:
        v = self._d.get(name)
        if isinstance(v, dict):
            return _Obj(v)
        if isinstance(v, list):
            return [_Obj(x) if isinstance(x, dict) else x for x in v]
        return v


class DirectTransport:
    """POST /chat/completions on an OpenAI-compatible server over one pooled aiohttp session per
    event loop (a session cannot outlive its loop: stale ones are closed when a new loop asks,
    and at exit)."""

    def __init__(self) -> None:
        self._sessions: dict[int, tuple[asyncio.AbstractEventLoop, Any]] = {}
        atexit.register(self._drop_stale)

    def _drop_stale(self) -> None:
        for key, (loop, sess) in list(self._sessions.items()):
            if loop.is_closed():
                conn = sess.connector
                if conn is not None and not conn.closed:
                    conn._close()  # sync: its loop is gone, so nothing can be awaited any more
                del self._sessions[key]

    def _session(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        entry = self._sessions.get(id(loop))
        if entry is None or entry[0] is not loop or entry[1].closed:
            self._drop_stale()
            sess = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
            self._sessions[id(loop)] = (loop, sess)
            return sess
        return entry[1]

    async def complete(self, model: ModelSpec, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                       api_key: str | None) -> Any:
        import aiohttp

        body: dict[str, Any] = {"model": model.model_name.split("/", 1)[1], "messages": messages}
        for k, v in kwargs.items():
            if k in ("model", "api_base", "api_key", "timeout", "max_retries", "num_retries", "_skip_mcp_handler"):
                continue
            body[k] = v
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        url = str(model.api_base).rstrip("/") + "/chat/completions"
        timeout = aiohttp.ClientTimeout(total=model.timeout)
        async with self._session().post(url, data=_key_encoder.encode(body), headers=headers,
                                        timeout=timeout) as resp:
            raw = await resp.read()
            if resp.status >= 300:
                raise HTTPStatusError(resp.status, raw.decode("utf-8", "replace"),
                                      {k.lower(): v for k, v in resp.headers.items()})
        return _Obj(msgspec.json.decode(raw))

    async def close(self) -> None:
        """Close this event loop's pooled session (call before the loop ends)."""
        loop = asyncio.get_running_loop()
        entry = self._sessions.pop(id(loop), None)
        if entry is not None and not entry[1].closed:
            await entry[1].close()


_direct = DirectTransport()


async def close_transports() -> None:
    await _direct.close()


class LLMClient:
    """The one way services call models (see module docstring)."""

    def __init__(self, cache: ResponseCache | None = None, *, backoff_base: float = 0.5,
                 backoff_cap: float = 30.0, rng: random.Random | None = None) -> None:
        self.cache = cache
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self._rng = rng or random.Random()
        # per-process concurrency by default; services attach the deployment-wide `Limiter`
        self.limiter: Any = LocalLimiter()

    def backoff_delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Full-jitter exponential backoff; a server's Retry-After is a floor (capped)."""
        ceiling = min(self.backoff_cap, self.backoff_base * (2 ** max(0, attempt - 1)))
        delay = self._rng.uniform(0, ceiling)
        if retry_after is not None:
            ra = min(retry_after, MAX_RETRY_AFTER_S)
            delay = ra + self._rng.uniform(0, 0.1 * ra)
        return delay

    async def complete(
        self,
        model: ModelSpec,
        messages: list[dict[str, Any]],
        *,
        stage: str,
        response_schema: dict[str, Any] | None = None,
        schema_name: str = "response",
        validate: Callable[[Any], Any] | None = None,
        replicate: int | None = None,
        tools: list[dict[str, Any]] | None = None,
        use_cache: bool = True,
    ) -> LLMReply:
        """One model reply; structured (`parsed`) when `response_schema` or `validate` is given."""
        key = None
        if use_cache and self.cache is not None:
            key = cache_key(model, messages, response_schema=response_schema, schema_name=schema_name,
                            tools=tools, replicate=replicate)
            reply = await self._from_cache(key, response_schema, validate)
            if reply is not None:
                return reply

        api_key = self._api_key(model, stage)
        kwargs = self._kwargs(model, api_key, tools)
        structured = response_schema is not None
        if structured:
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": _schema_name(schema_name), "schema": response_schema, "strict": False},
            }
        convo = list(messages)
        usage: dict[str, Any] = {"model": model.model_name}
        attempts = 0
        last_error = ""
        for round_ in range(MAX_OUTPUT_RETRIES + 1):
            resp, n = await self._call(model, convo, kwargs, stage, api_key, attempts)
            attempts += n
            usage = add_usage(usage, _usage_of(resp, model.model_name))
            text, tool_calls = _message_of(resp)
            if tool_calls or (not structured and validate is None):
                parsed = None
                break
            try:
                obj = extract_json(text) if structured else text
                parsed = validate(obj) if validate is not None else obj
                break
            except Exception as exc:  # validators raise anything (pydantic, ValueError, ...)
                last_error = _scrub(f"{type(exc).__name__}: {exc}", api_key)[:2000]
                log.debug("llm %s stage=%s: unusable output (round %d): %s", model.model_name, stage,
                          round_ + 1, last_error)
                convo = convo + [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": _feedback(last_error, structured)},
                ]
        else:
            raise LLMError(
                "bad_output",
                f"bad_output: model {model.model_name} at stage {stage} gave no valid "
                f"{'JSON' if structured else 'reply'} after {MAX_OUTPUT_RETRIES + 1} replies "
                f"({attempts} attempts); last error: {last_error}",
                model=model.model_name, stage=stage, attempts=attempts, usage=usage,
            )
        raw_message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            raw_message["tool_calls"] = tool_calls
        reply = LLMReply(text=text, usage=usage, parsed=parsed, tool_calls=tool_calls, attempts=attempts,
                         raw_message=raw_message,
                         cost_usd=call_cost(model, usage.get("input_tokens", 0), usage.get("output_tokens", 0)))
        if key is not None and self.cache is not None:
            try:
                await self.cache.put(key, {"text": text, "usage": usage, "tool_calls": tool_calls,
                                           "attempts": attempts})
            except Exception as exc:  # a cache outage must not fail the call
                log.warning("llm cache put failed: %s", exc)
        return reply

    async def _from_cache(self, key: str, response_schema: dict[str, Any] | None,
                          validate: Callable[[Any], Any] | None) -> LLMReply | None:
        assert self.cache is not None
        try:
            hit = await self.cache.get(key)
        except Exception as exc:
            log.warning("llm cache get failed: %s", exc)
            return None
        if not hit:
            return None
        text = hit.get("text") or ""
        tool_calls = hit.get("tool_calls") or []
        parsed = None
        if not tool_calls and (response_schema is not None or validate is not None):
            try:
                obj = extract_json(text) if response_schema is not None else text
                parsed = validate(obj) if validate is not None else obj
            except Exception:
                return None  # the validator changed since: ask the model again
        raw_message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            raw_message["tool_calls"] = tool_calls
        return LLMReply(text=text, usage=dict(hit.get("usage") or {}), parsed=parsed, tool_calls=tool_calls,
                        cached=True, attempts=int(hit.get("attempts", 1)), raw_message=raw_message)

    @staticmethod
    def _api_key(model: ModelSpec, stage: str) -> str | None:
        if model.api_key_env:
            key = os.environ.get(model.api_key_env)
            if not key:
                raise LLMError("auth", f"auth: environment variable {model.api_key_env} (api_key_env of model "
                               f"{model.model_name}) is not set; stage {stage}", model=model.model_name,
                               stage=stage, attempts=0)
            return key
        if model.api_base:
            return DUMMY_KEY
        return None

    @staticmethod
    def _kwargs(model: ModelSpec, api_key: str | None, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": model.model_name,
            "temperature": model.temperature,
            "timeout": model.timeout,
            "max_retries": 0,  # we retry (with backoff and Retry-After), not the SDK underneath
            "num_retries": 0,
        }
        if model.api_base:
            kwargs["api_base"] = model.api_base
        if api_key:
            kwargs["api_key"] = api_key
        if model.max_tokens is not None:
            kwargs["max_tokens"] = model.max_tokens
        if tools:
            kwargs["tools"] = tools
            # Our tools are plain functions (the agent runs MCP itself); without this litellm imports
            # its proxy's MCP gateway, which needs the `mcp` package, on every call with tools.
            kwargs["_skip_mcp_handler"] = True
        kwargs.update(model.params)
        return kwargs

    async def _call(self, model: ModelSpec, messages: list[dict[str, Any]], kwargs: dict[str, Any], stage: str,
                    api_key: str | None, prior_attempts: int) -> tuple[Any, int]:
        """One reply, retrying transient failures; returns (response, attempts used)."""
        direct = transport_for(model) == "direct"
        litellm = None if direct else _get_litellm()
        limiter = self.limiter
        estimate = estimate_tokens(model, messages) if getattr(model, "tokens_per_minute", None) else 0
        attempt = 0
        dropped_format = False
        hard_timeout = model.timeout * 1.5 + 5.0
        while True:
            attempt += 1
            lease = await limiter.acquire(model, estimate)
            try:
                async with asyncio.timeout(hard_timeout):
                    if direct:
                        resp = await _direct.complete(model, messages, kwargs, api_key)
                    else:
                        resp = await litellm.acompletion(messages=messages, **kwargs)
                limiter.release(lease, tokens=_usage_of(resp, model.model_name)["total_tokens"])
                return resp, attempt
            except asyncio.CancelledError:
                limiter.release(lease)
                raise
            except Exception as exc:
                kind, status = _classify(exc)
                limiter.release(lease, rate_limited=kind == "rate_limit")
                if (kind == "bad_request" and "response_format" in kwargs and not dropped_format
                        and _mentions_response_format(exc)):
                    log.info("llm %s rejected response_format; retrying without it", model.model_name)
                    del kwargs["response_format"]  # in place: later validation rounds go without it too
                    dropped_format = True
                    continue
                ra = _retry_after(exc) if kind == "rate_limit" else None
                total = prior_attempts + attempt
                if kind in RETRYABLE and attempt <= model.max_retries:
                    delay = self.backoff_delay(attempt, ra)
                    log.debug("llm %s stage=%s: %s (HTTP %s), retry %d/%d in %.2fs", model.model_name, stage,
                              kind, status, attempt, model.max_retries, delay)
                    await asyncio.sleep(delay)
                    continue
                detail = _scrub(f"{type(exc).__name__}: {exc}", api_key)
                if len(detail) > 1000:
                    detail = detail[:1000] + "..."
                http = f"HTTP {status}" if status is not None else "no HTTP status"
                raise LLMError(
                    kind,
                    f"{kind}: model {model.model_name} at stage {stage} failed after {total} attempt(s) "
                    f"({http}): {detail}",
                    model=model.model_name, stage=stage, status_code=status, attempts=total, retry_after=ra,
                ) from None


def _schema_name(name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", name or "response")[:64]
    return clean or "response"


def _feedback(error: str, structured: bool) -> str:
    if structured:
        return (f"Your previous reply could not be used: {error}\n"
                "Reply again with ONLY a JSON object that conforms to the schema - no prose, no markdown fences.")
    return f"Your previous reply could not be used: {error}\nPlease reply again."


def _usage_of(resp: Any, model_name: str) -> dict[str, Any]:
    u = getattr(resp, "usage", None)
    if u is None and isinstance(resp, dict):
        u = resp.get("usage")
    if u is None:
        return {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "model": model_name}
    get = u.get if isinstance(u, dict) else (lambda k, d=None: getattr(u, k, d))
    inp = int(get("prompt_tokens", 0) or 0)
    out = int(get("completion_tokens", 0) or 0)
    total = int(get("total_tokens", 0) or 0) or inp + out
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": total, "model": model_name}


def _message_of(resp: Any) -> tuple[str, list[dict[str, Any]]]:
    """(text, tool calls as OpenAI dicts) of the first choice."""
    choice = resp.choices[0]
    msg = choice.message
    text = getattr(msg, "content", None) or ""
    if not isinstance(text, str):
        text = str(text)
    calls: list[dict[str, Any]] = []
    for tc in getattr(msg, "tool_calls", None) or []:
        fn = getattr(tc, "function", None)
        calls.append({
            "id": getattr(tc, "id", None) or "",
            "type": "function",
            "function": {"name": getattr(fn, "name", "") or "", "arguments": getattr(fn, "arguments", "") or "{}"},
        })
    return text, calls
