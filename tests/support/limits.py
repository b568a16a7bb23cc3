"""Helpers for limiter tests."""

from __future__ import annotations

import asyncio
import random

from shared.core.events import ModelSpec
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
