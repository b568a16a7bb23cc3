"""Helpers for limiter tests."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from shared.core.events import ModelSpec
from shared.runtime.ledger import Ledger
from shared.runtime.ledger_store import MemoryLedgerStore
from shared.runtime.limits import Limiter


async def hammer(limiters: list[Limiter], model: ModelSpec, calls: int, seed: int = 0) -> tuple[int, int]:
    """`calls` concurrent calls spread over the limiters; returns (peak in flight, calls done)."""
    rng = random.Random(seed)
    in_flight = peak = done = 0

    async def one(lim: Limiter) -> None:
        nonlocal in_flight, peak, done
        lease = await lim.acquire(model)
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(rng.uniform(0, 0.004))
        in_flight -= 1
        done += 1
        lim.release(lease)

    await asyncio.gather(*(one(limiters[i % len(limiters)]) for i in range(calls)))
    return peak, done


class RoundTripStore(MemoryLedgerStore):
    """A `MemoryLedgerStore` whose reads and writes take a round trip (they yield to the event
    loop for a random few ms, as a KV bucket on the bus does), so calls are admitted and released
    while a ledger write is on its way."""

    def __init__(self, seed: int = 0, max_delay_s: float = 0.003) -> None:
        super().__init__()
        self._rng = random.Random(seed)
        self.max_delay_s = max_delay_s

    async def get(self, key: str) -> tuple[Ledger | None, int]:
        await asyncio.sleep(self._rng.uniform(0, self.max_delay_s))
        return await super().get(key)

    async def cas(self, key: str, ledger: Ledger, revision: int) -> int:
        await asyncio.sleep(self._rng.uniform(0, self.max_delay_s))
        return await super().cas(key, ledger, revision)

    async def watch(self, key: str, on_change: Any) -> None:
        """Changes reach a watcher a few ms late, as a message on the bus does: its view lags."""
        loop = asyncio.get_running_loop()

        def later(data: bytes) -> None:
            loop.call_later(self._rng.uniform(0, self.max_delay_s), on_change, data)

        await super().watch(key, later)


class GatedStore(MemoryLedgerStore):
    """A `MemoryLedgerStore` that can stop the next write at a gate (`hold`), so a test decides
    what happens while that write is on its way, then lets it land (`open`)."""

    def __init__(self) -> None:
        super().__init__()
        self._gate = asyncio.Event()
        self._gate.set()
        self._armed = False
        self.write_waiting = asyncio.Event()

    def hold(self) -> None:
        self._gate.clear()
        self._armed = True
        self.write_waiting.clear()

    def open(self) -> None:
        self._gate.set()

    async def cas(self, key: str, ledger: Ledger, revision: int) -> int:
        if self._armed:
            self._armed = False
            self.write_waiting.set()
            await self._gate.wait()
        return await super().cas(key, ledger, revision)
