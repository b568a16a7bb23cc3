"""The response cache: a run-scoped JetStream KV bucket (or memory, in tests), so a redelivered
or replayed stage does not pay twice for the same call."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any, Protocol

import msgspec
from nats.js.api import KeyValueConfig
from nats.js.errors import KeyNotFoundError

from shared.core.events import ModelSpec
from shared.runtime.bus import ensure_kv

log = logging.getLogger("veribus.llm")


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


BUCKET = "vb_llm_cache"  # the run-scoped replies (`shared.runtime.response_cache` adds a shared one)


class NatsKVCache:
    """Cache shared by all service replicas, on a JetStream key-value bucket (entries expire)."""

    def __init__(self, js: Any, bucket: str = BUCKET, ttl_s: float = 7 * 24 * 3600,
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
                    # direct gets: every model call reads the cache first, and a direct get is a
                    # plain request answered with the raw value, not a JSON API reply in base64
                    config = KeyValueConfig(bucket=self.bucket, ttl=self.ttl_s, history=1, direct=True,
                                            description="veribus LLM response cache")
                    self._kv = await ensure_kv(self.js, config)  # replicated like the stream
        return self._kv

    async def get(self, key: str) -> dict[str, Any] | None:
        kv = await self._bucket()
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        value = msgspec.json.decode(entry.value)
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

CACHE_JOB: ContextVar[tuple[Any, ...] | None] = ContextVar("veribus_llm_cache_job", default=None)
"""Which job a call is for (question, answering model, replicate; set per handled event): as in
the reference, every job asks its judge itself, so two replicates, or two answering models that
happened to give the same text, never share a judge's reply; a redelivery of the same job does."""


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
        "job": CACHE_JOB.get(),
    }
    return hashlib.sha256(_key_encoder.encode(material)).hexdigest()
