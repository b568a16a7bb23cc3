"""The response cache across runs (opt-in) beside the run-scoped one.

Two scopes, one key function (`shared.runtime.llm.cache.cache_key`: model, endpoint, parameters, messages,
schema, tools, replicate, scope):

- **run** (default, `VERIBUS_LLM_CACHE`, on): replies are keyed with the run id, so a redelivered
  or replayed stage of the same run never pays twice, and a new run asks the model afresh;
- **shared** (`response_cache: true` in the run config, `veribus run --cache`): replies are keyed
  without the run id, in their own bucket, so a second identical run makes no model calls. An
  entry older than the run's `response_cache_ttl_s` is a miss (asked again, then replaced); the
  bucket's own max age (`VERIBUS_RESPONSE_CACHE_MAX_AGE_S`) bounds what is stored at all.
  `veribus cache clear` empties it.

The scope of a call comes from the job being handled (`scope_for`), set by the service harness.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any

from nats.js.errors import BucketNotFoundError, NotFoundError

from shared.runtime.llm.cache import BUCKET, CACHE_SCOPE, NatsKVCache, ResponseCache

SHARED_SCOPE = "shared"
SHARED_BUCKET = "vb_llm_cache_shared"
RUN_BUCKET = BUCKET
DEFAULT_TTL_S = 7 * 24 * 3600.0

CACHE_TTL: ContextVar[float] = ContextVar("veribus_response_cache_ttl", default=DEFAULT_TTL_S)
"""How old a shared entry may be for the job being handled (its run's `response_cache_ttl_s`)."""


def _job_of(payload: Any) -> Any:
    """The job a handled event is for (an answer's requests name one per judge: the first)."""
    job = getattr(payload, "job", None)
    if job is None:
        jobs = getattr(payload, "jobs", None)
        job = jobs[0] if jobs else None
    return job


def _options_of(payload: Any) -> dict[str, Any]:
    options = getattr(_job_of(payload), "options", None)
    return options if isinstance(options, dict) else {}


def scope_for(run_id: str, payload: Any) -> str:
    """The cache scope of a handled event: the shared scope when its run opted in, else the run."""
    options = _options_of(payload)
    if options.get("response_cache"):
        ttl = options.get("response_cache_ttl_s")
        CACHE_TTL.set(float(ttl) if isinstance(ttl, int | float) and ttl > 0 else DEFAULT_TTL_S)
        return SHARED_SCOPE
    return run_id


def job_for(payload: Any) -> tuple[Any, ...] | None:
    """The identity of the job a handled event is for (`CACHE_JOB`): question, answering model,
    replicate (an answer's judges share it: they parse one answer, asked for once)."""
    job = _job_of(payload)
    if job is None:
        return None
    answering = getattr(job, "answering", None)
    return (getattr(job, "question_id", ""), answering.canonical_key if answering is not None else "",
            getattr(job, "replicate", None))


class ScopedCache:
    """Routes each get/put to the run-scoped cache or the shared one, by `CACHE_SCOPE`."""

    def __init__(self, run: ResponseCache | None, shared: ResponseCache | None) -> None:
        self.run = run
        self.shared = shared
        self.shared_hits = 0
        self.stale = 0

    async def get(self, key: str) -> dict[str, Any] | None:
        if CACHE_SCOPE.get() == SHARED_SCOPE:
            if self.shared is None:
                return None
            hit = await self.shared.get(key)
            if hit is None:
                return None
            stored = hit.get("stored_at")
            if not isinstance(stored, int | float) or time.time() - stored > CACHE_TTL.get():
                self.stale += 1
                return None  # too old for this run: ask the model, the put replaces it
            self.shared_hits += 1
            return hit
        return await self.run.get(key) if self.run is not None else None

    async def put(self, key: str, value: dict[str, Any]) -> None:
        if CACHE_SCOPE.get() == SHARED_SCOPE:
            if self.shared is not None:
                await self.shared.put(key, {**value, "stored_at": time.time()})
        elif self.run is not None:
            await self.run.put(key, value)


def service_cache(js: Any, *, run_scoped: bool, max_age_s: float) -> ScopedCache:
    """The cache a service's model client uses: run-scoped (when enabled) plus the shared one."""
    return ScopedCache(NatsKVCache(js) if run_scoped else None,
                       NatsKVCache(js, bucket=SHARED_BUCKET, ttl_s=max_age_s))


async def clear(js: Any, *, include_run_scoped: bool = False) -> dict[str, int]:
    """Empty the shared cache (and, with `include_run_scoped`, the run-scoped one); returns the
    number of entries removed per bucket. A bucket that does not exist counts as empty."""
    removed: dict[str, int] = {}
    for bucket in (SHARED_BUCKET, RUN_BUCKET) if include_run_scoped else (SHARED_BUCKET,):
        try:
            kv = await js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            removed[bucket] = 0
            continue
        status = await kv.status()
        removed[bucket] = int(status.values or 0)
        await js.purge_stream(f"KV_{bucket}")
    return removed


async def info(js: Any) -> dict[str, dict[str, Any]]:
    """Entries and bytes per cache bucket."""
    out: dict[str, dict[str, Any]] = {}
    for bucket in (SHARED_BUCKET, RUN_BUCKET):
        try:
            kv = await js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            out[bucket] = {"entries": 0, "bytes": 0, "max_age_s": None, "exists": False}
            continue
        status = await kv.status()
        si = await js.stream_info(f"KV_{bucket}")
        out[bucket] = {"entries": int(status.values or 0), "bytes": int(si.state.bytes or 0),
                       "max_age_s": status.ttl, "exists": True}
    return out
