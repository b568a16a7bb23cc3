"""How a request reaches a model: litellm (any provider; imported lazily because it takes
seconds, with its network and `.env` side effects switched off and its per-call cost/logging work
skipped), or a direct HTTP post to an OpenAI-compatible server; and how a failure is
classified for retries (kind, status, Retry-After), with secrets scrubbed from messages."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import re
import time
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import msgspec

from shared.core.config import Settings
from shared.core.events import ModelSpec
from shared.runtime.llm.reply import DUMMY_KEY

_body_encoder = msgspec.json.Encoder(order="sorted")


_litellm: Any = None


def _get_litellm() -> Any:
    """Import litellm once, offline: no cost-map fetch, no `.env` loading, no debug chatter."""
    global _litellm
    if _litellm is None:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        os.environ.setdefault("LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS", "True")
        os.environ.setdefault("LITELLM_LOCAL_BLOG_POSTS", "True")
        os.environ.setdefault("LITELLM_MODE", "PRODUCTION")  # "DEV" (default) loads ./.env
        import litellm  # local import: litellm takes seconds to import; only its transport needs it

        litellm.suppress_debug_info = True
        litellm.turn_off_message_logging = True
        logging.getLogger("LiteLLM").setLevel(logging.WARNING)
        if Settings.from_env().litellm_lean:
            _install_lean_hooks(litellm)
        _litellm = litellm
    return _litellm


def _install_lean_hooks(litellm: Any) -> None:
    """Skip litellm's per-call cost calculation and success logging while no callback is set.

    Measured: ~7.9 -> ~5.2 ms CPU per call against a local server. We compute usage ourselves
    and price nothing here; with any litellm callback configured the originals run unchanged.
    """
    try:
        # local import: part of litellm, loaded with it (lazily: it takes seconds)
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


_SECRET_PATTERNS = re.compile(
    r"(sk-[A-Za-z0-9_\-]{8,}|(?:api[_-]?key|x-api-key|authorization|bearer)[\"'=:\s]+[A-Za-z0-9_\-\.]{8,})", re.I
)


def _scrub(text: str, secret: str | None) -> str:
    if secret and secret != DUMMY_KEY and len(secret) >= 4:
        text = text.replace(secret, "***")
    return _SECRET_PATTERNS.sub("***", text)


_MISSING_CREDENTIALS = re.compile(r"Missing credentials|api_key client option must be set|"
                                  r"No API key provided|api[_ ]key (?:is )?(?:missing|not set|not found)", re.I)


def _classify(exc: BaseException) -> tuple[str, int | None]:
    """(kind, HTTP status) of a litellm/openai/asyncio exception."""
    status = getattr(exc, "status_code", None)
    if not isinstance(status, int):
        status = None
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timeout", status
    if _MISSING_CREDENTIALS.search(str(exc)):
        # the OpenAI client refuses to start without a key; litellm wraps that in an
        # InternalServerError (HTTP 500), which would be retried as the provider's outage
        return "auth", None
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
                    return max(0.0, parsedate_to_datetime(ra).timestamp() - time.time())
        except (TypeError, ValueError, AttributeError):
            continue
    return None


def _mentions_response_format(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "response_format" in text or "json_schema" in text or "structured output" in text


_choices: dict[str | None, str] = {}


def _transport_choice(raw: str | None) -> str:
    """`Settings.llm_transport` (`VERIBUS_LLM_TRANSPORT`), read by Settings once per distinct raw
    value, not on every call: building the whole Settings per model call was 5% of a model-calling
    service's CPU (profiled, issue 12). The raw value is only the cache key."""
    choice = _choices.get(raw)
    if choice is None:
        choice = Settings.from_env("llm_transport", environ={"VERIBUS_LLM_TRANSPORT": raw or ""}).llm_transport
        _choices[raw] = choice
    return choice


def transport_for(model: ModelSpec) -> str:
    """Which HTTP path a call takes. `auto` (the default, `VERIBUS_LLM_TRANSPORT`): an
    `openai/<name>` model at an explicit `api_base` is an OpenAI-compatible server (vLLM, Ollama,
    the simulator), where litellm has nothing to translate and costs ~6 ms CPU per call, so the
    request goes straight to `<api_base>/chat/completions`; every other model goes through litellm."""
    choice = _transport_choice(os.environ.get("VERIBUS_LLM_TRANSPORT"))  # the cache key; Settings parses it
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
        async with self._session().post(url, data=_body_encoder.encode(body), headers=headers,
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
