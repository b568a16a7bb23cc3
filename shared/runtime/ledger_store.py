"""Where model-limit ledgers live: `KVLedgerStore` (a JetStream KV bucket, the deployment: one
entry per limit key, written by compare-and-set) or `MemoryLedgerStore` (one process, tests)."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from nats.js.api import KeyValueConfig
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from shared.runtime.bus import ensure_kv
from shared.runtime.bus_auth import LIMITS_BUCKET
from shared.runtime.ledger import Ledger, decode_ledger, encode_ledger

BUCKET = LIMITS_BUCKET  # the roles' permissions name it (shared.runtime.bus_auth)


class Conflict(Exception):
    """Someone else wrote the ledger since we read it."""


class LedgerStore(Protocol):
    async def get(self, key: str) -> tuple[Ledger | None, int]: ...

    async def cas(self, key: str, ledger: Ledger, revision: int) -> int: ...

    async def watch(self, key: str, on_change: Any) -> None: ...

    async def close(self) -> None: ...


class MemoryLedgerStore:
    """Ledgers in this process (tests, single-process use)."""

    def __init__(self) -> None:
        self.data: dict[str, tuple[bytes, int]] = {}
        self.ops = 0
        self._watchers: dict[str, list[Any]] = {}

    async def get(self, key: str) -> tuple[Ledger | None, int]:
        self.ops += 1
        raw = self.data.get(key)
        return (decode_ledger(raw[0]), raw[1]) if raw else (None, 0)

    async def cas(self, key: str, ledger: Ledger, revision: int) -> int:
        self.ops += 1
        current = self.data.get(key, (b"", 0))[1]
        if current != revision:
            raise Conflict(key)
        data = encode_ledger(ledger)
        self.data[key] = (data, current + 1)
        for cb in self._watchers.get(key, []):
            cb(data)
        return current + 1

    async def watch(self, key: str, on_change: Any) -> None:
        self._watchers.setdefault(key, []).append(on_change)

    async def close(self) -> None:
        self._watchers.clear()


class KVLedgerStore:
    """Ledgers in a JetStream KV bucket; a core subscription on the key's subject wakes waiters."""

    def __init__(self, nc: Any, bucket: str = BUCKET) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.bucket = bucket
        self.ops = 0
        self._kv: Any = None
        self._lock = asyncio.Lock()
        self._subs: list[Any] = []

    async def _bucket(self) -> Any:
        if self._kv is None:
            async with self._lock:
                if self._kv is None:
                    cfg = KeyValueConfig(bucket=self.bucket, history=1, ttl=24 * 3600,
                                         description="veribus model limits (leases, rate buckets)")
                    self._kv = await ensure_kv(self.js, cfg)  # replicated like the stream
        return self._kv

    async def get(self, key: str) -> tuple[Ledger | None, int]:
        kv = await self._bucket()
        self.ops += 1
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None, 0
        if not entry.value:
            return None, entry.revision or 0
        return decode_ledger(entry.value), entry.revision or 0

    async def cas(self, key: str, ledger: Ledger, revision: int) -> int:
        kv = await self._bucket()
        self.ops += 1
        try:
            if revision == 0:
                return int(await kv.create(key, encode_ledger(ledger)))
            return int(await kv.update(key, encode_ledger(ledger), last=revision))
        except KeyWrongLastSequenceError as exc:
            raise Conflict(key) from exc

    async def watch(self, key: str, on_change: Any) -> None:
        """`on_change(data)` for every write of `key` by a process of the deployment. What a write
        is: a JetStream publish on the key's subject, which asks for its PubAck on the writer's
        reply inbox. A push consumer delivers on whatever subject its creator names, and `cli`
        may make consumers: its deliveries (a reply of `$JS.ACK...` or none, and the stored
        message's own subject) are not writes, and are left out
        (`test_bus_trust.py::test_a_forged_ledger_delivered_by_a_consumer_is_not_read_as_the_ledger`)."""
        subject = f"$KV.{self.bucket}.{key}"

        async def cb(msg: Any) -> None:
            if msg.subject == subject and (msg.reply or "").startswith("_INBOX"):
                on_change(msg.data)

        await self._bucket()
        self._subs.append(await self.nc.subscribe(subject, cb=cb))

    async def close(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection already gone
                pass
        self._subs.clear()
