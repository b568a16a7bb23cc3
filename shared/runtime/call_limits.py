"""What one model call is limited by: its limit key (the model, or its endpoint), its token
estimate before it is made, the `Lease` it holds while it runs, and `LocalLimiter`, the
per-process limiter of a client without a deployment."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any

from shared.core.events import ModelSpec

DEFAULT_ANSWER_TOKENS = 512  # a call's output estimate for tokens/minute when max_tokens is unset
# a hedge's slot (`try_acquire`) must have been idle this long: every slot busy, or a call waiting,
# within it means work is coming (a stage's next message arrives ms after its last call ends)
IDLE_FOR_HEDGE_S = 0.1


def limit_identity(model: ModelSpec) -> str:
    """What a limit is shared by: the model (+ endpoint) or, for scope 'endpoint', the endpoint."""
    if getattr(model, "limit_scope", "model") == "endpoint":
        return f"endpoint|{model.api_base or model.model_name.split('/', 1)[0]}"
    return f"model|{model.canonical_key}|{model.api_base or ''}"


def limit_key(model: ModelSpec) -> str:
    return "m_" + hashlib.sha256(limit_identity(model).encode()).hexdigest()[:32]


def estimate_tokens(model: ModelSpec, messages: list[dict[str, Any]]) -> int:
    """A call's tokens before it is made (for tokens/minute): ~4 characters a token in, plus
    `max_tokens` (or a default) out. The difference to the real count is settled afterwards."""
    chars = 0
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            chars += len(c)
        elif isinstance(c, list):
            chars += sum(len(str(p.get("text", ""))) for p in c if isinstance(p, dict))
    return chars // 4 + 1 + (model.max_tokens or DEFAULT_ANSWER_TOKENS)


@dataclass
class Lease:
    """One admitted call; hand it back to `Limiter.release`."""

    key: str
    estimate: int = 0
    released: bool = False


class LocalLimiter:
    """Per-process concurrency only (no bus): what a client without a deployment uses."""

    def __init__(self) -> None:
        self._sems: dict[str, asyncio.Semaphore] = {}
        self._full_at: dict[str, float] = {}  # when every slot was last taken (or a call waited)

    async def acquire(self, model: ModelSpec, estimate: int = 0) -> Lease:
        key = limit_key(model)
        sem = self._sems.get(key)
        if sem is None:
            sem = self._sems[key] = asyncio.Semaphore(max(1, model.max_concurrency))
        if sem.locked():
            self._full_at[key] = time.monotonic()
        await sem.acquire()
        if sem.locked():
            self._full_at[key] = time.monotonic()
        return Lease(key, estimate)

    async def try_acquire(self, model: ModelSpec, estimate: int = 0) -> Lease | None:
        """A lease only if a slot is free now and has been for `IDLE_FOR_HEDGE_S` (a hedge's slot)."""
        key = limit_key(model)
        sem = self._sems.get(key)
        if sem is None or sem.locked() or time.monotonic() - self._full_at.get(key, 0.0) < IDLE_FOR_HEDGE_S:
            return None
        await sem.acquire()  # not locked: returns without yielding
        return Lease(key, estimate)

    def release(self, lease: Lease, *, tokens: int | None = None, rate_limited: bool = False) -> None:
        if not lease.released:
            lease.released = True
            self._sems[lease.key].release()

    async def close(self) -> None:
        return None
