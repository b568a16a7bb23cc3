"""The LLM port: every model call of every service goes through `LLMClient.complete`.

It adds what the pipeline needs around a model call (`shared.runtime.llm.transport`):
structured output with robust JSON extraction and validation retries (`reply`), retries with
backoff on transient errors, a per-model concurrency limit, and a response cache (`cache`) so a
redelivered or replayed stage does not pay twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from shared.core.events import ModelSpec
from shared.runtime.call_limits import LocalLimiter, estimate_tokens
from shared.runtime.endpoints import EndpointRefused
from shared.runtime.endpoints import check_model as check_endpoint
from shared.runtime.llm import transport
from shared.runtime.llm.cache import ResponseCache, cache_key
from shared.runtime.llm.hedge import first_reply
from shared.runtime.llm.pricing import call_cost
from shared.runtime.llm.reply import (
    DUMMY_KEY,
    MAX_OUTPUT_RETRIES,
    MAX_RETRY_AFTER_S,
    RETRYABLE,
    LLMError,
    LLMReply,
    add_usage,
    extract_json,
)
from shared.runtime.llm.transport import (
    _classify,
    _mentions_response_format,
    _retry_after,
    _scrub,
    transport_for,
)
from shared.runtime.observability import METRICS

log = logging.getLogger("veribus.llm")

CALL_GATE: ContextVar[Callable[[], Awaitable[BaseException | None]] | None] = ContextVar("veribus_llm_call_gate",
                                                                                         default=None)
"""Asked once a call holds its model slot, just before the request goes out: an exception to raise
instead of calling. The harness sets it for dispatch (answer generation): a job can wait a long
time for a slot, and a budget that ran out or a cancel meanwhile must stop it there, not only when
its message arrived (every worker takes its message at once, before any slot is free)."""
_WARNED: set[tuple[str, str, str]] = set()
_CAUSES = {"connection": "connection refused or unreachable", "auth": "missing or rejected credentials",
           "rate_limit": "rate limited (HTTP 429)", "timeout": "timed out", "server_error": "server error"}


def warn_once(model: str, api_base: str | None, kind: str, status: int | None, detail: str) -> bool:
    """Log why a model cannot be called at WARNING, once per (model, endpoint, cause) in this
    process: for failures before any call (a missing api_key_env variable). Failed calls are
    logged once per cause by `METRICS.model_call`. Returns True when it logged."""
    key = (model, api_base or "", f"{kind}:{status}")
    if key in _WARNED:
        return False
    _WARNED.add(key)
    where = f" at {api_base}" if api_base else ""
    http = f" (HTTP {status})" if status is not None else ""
    log.warning("model %s%s: %s%s: %s; retried with backoff, further failures of this kind are not logged "
                "again", model, where, _CAUSES.get(kind, kind), http, detail[:300])
    return True


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
        try:  # before anything else: a job may not point a key at an endpoint the operator did not allow
            check_endpoint(model)
        except EndpointRefused as exc:
            raise LLMError("endpoint_refused", f"endpoint_refused: model {model.model_name} at stage {stage}: {exc}",
                           model=model.model_name, stage=stage, attempts=0) from None
        key = None
        if use_cache and self.cache is not None:
            key = cache_key(model, messages, response_schema=response_schema, schema_name=schema_name,
                            tools=tools, replicate=replicate)
            reply = await self._from_cache(key, response_schema, validate)
            if reply is not None:
                METRICS.model_call(model.model_name, "cache_hit")
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
        retries: dict[str, int] = {}
        last_error = ""
        for round_ in range(MAX_OUTPUT_RETRIES + 1):
            resp, n, abandoned = await self._call(model, convo, kwargs, stage, api_key, attempts, retries)
            attempts += n
            used = _usage_of(resp, model.model_name)
            for _ in range(1 + abandoned):  # an abandoned hedge copy counts as costing what the reply did
                usage = add_usage(usage, used)
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
            METRICS.model_call(model.model_name, "failed_bad_output", last_error)
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
                         cost_usd=call_cost(model, usage.get("input_tokens", 0), usage.get("output_tokens", 0)),
                         raw_message=raw_message, retries=retries)
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
                warn_once(model.model_name, model.api_base, "auth", None,
                          f"environment variable {model.api_key_env} (its api_key_env) is not set")
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
                    api_key: str | None, prior_attempts: int,
                    retries: dict[str, int] | None = None) -> tuple[Any, int, int]:
        """One reply, retrying transient failures; returns (response, requests sent, hedged copies
        abandoned in flight). Each retry is counted by its error kind in `retries`
        (metadata.retry_counts), a hedge (`shared.runtime.llm.hedge`) as "hedge"."""
        direct = transport_for(model) == "direct"
        litellm = None if direct else transport._get_litellm()
        limiter = self.limiter
        estimate = estimate_tokens(model, messages) if model.tokens_per_minute else 0
        attempt = 0
        dropped_format = False
        hard_timeout = model.timeout * 1.5 + 5.0
        hedges = 0

        def send() -> Awaitable[Any]:
            if direct:
                return transport._direct.complete(model, messages, kwargs, api_key)
            return litellm.acompletion(messages=messages, **kwargs)

        def hedged() -> None:  # a second copy went out: a request sent, counted as a retry of kind "hedge"
            nonlocal hedges
            hedges += 1
            if retries is not None:
                retries["hedge"] = retries.get("hedge", 0) + 1
            METRICS.model_call(model.model_name, "hedge")

        async def may_hedge() -> bool:  # not once the run's budget is spent or it was cancelled
            gate = CALL_GATE.get()
            return gate is None or await gate() is None

        def tokens_of(resp: Any) -> int:
            return int(_usage_of(resp, model.model_name)["total_tokens"])

        def is_rate_limit(exc: BaseException) -> bool:
            return _classify(exc)[0] == "rate_limit"

        while True:
            attempt += 1
            lease = await limiter.acquire(model, estimate)
            gate = CALL_GATE.get()
            stop = await gate() if gate is not None else None
            if stop is not None:
                limiter.release(lease)
                raise stop
            try:
                async with asyncio.timeout(hard_timeout):
                    got = await first_reply(send, model, limiter, lease, estimate, on_hedge=hedged,
                                            may_hedge=may_hedge, tokens_of=tokens_of, is_rate_limit=is_rate_limit)
                resp = got.response
                if not got.owns_lease:
                    limiter.release(lease, tokens=tokens_of(resp))
                METRICS.model_call(model.model_name, "ok")
                return resp, attempt + hedges, got.abandoned
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
                total = prior_attempts + attempt + hedges
                if kind in RETRYABLE and attempt <= model.max_retries:
                    if retries is not None:
                        retries[kind] = retries.get(kind, 0) + 1
                    METRICS.model_call(model.model_name, f"retry_{kind}")
                    delay = self.backoff_delay(attempt, ra)
                    log.debug("llm %s stage=%s: %s (HTTP %s), retry %d/%d in %.2fs", model.model_name, stage,
                              kind, status, attempt, model.max_retries, delay)
                    await asyncio.sleep(delay)
                    continue
                detail = _scrub(f"{type(exc).__name__}: {exc}", api_key)
                if len(detail) > 1000:
                    detail = detail[:1000] + "..."
                http = f"HTTP {status}" if status is not None else "no HTTP status"
                METRICS.model_call(model.model_name, f"failed_{kind}", f"{http}: {detail}")
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
