"""`veribus bench --limits`: the per-call overhead of the deployment-wide model limiter
(`shared.runtime.limits`) against a local semaphore: ledger round trips per call and CPU per
call, with three limiters (three "replicas") on their own NATS connections sharing one cap.
A nats-server is started for it and stopped at the end. Figures, not assertions."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from shared.control.nats_nodes import standalone_nats
from shared.core.events import ModelSpec
from shared.runtime.call_limits import LocalLimiter
from shared.runtime.ledger_store import KVLedgerStore
from shared.runtime.limits import Limiter


async def _drive(lims: list[Any], n: int, model: ModelSpec, callers: int, hold_s: float) -> float:
    """n calls by `callers` concurrent callers spread over the limiters; returns CPU seconds."""
    sem = asyncio.Semaphore(callers)

    async def one(i: int) -> None:
        async with sem:
            lim = lims[i % len(lims)]
            lease = await lim.acquire(model)
            await asyncio.sleep(hold_s)
            lim.release(lease)

    t = time.process_time()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.process_time() - t


async def measure(url: str, calls: int, cap: int, callers: int, hold_s: float) -> dict[str, float]:
    model = ModelSpec(model_name="openai/bench-limits", max_concurrency=cap)
    ncs = [await nats.connect(url) for _ in range(3)]
    lims = [Limiter(KVLedgerStore(nc), f"bench-{i}") for i, nc in enumerate(ncs)]
    try:
        await _drive(lims, 100, model, callers, hold_s)  # warm-up: bucket, leases, watches
        ops0 = sum(lim.store.ops for lim in lims)  # type: ignore[attr-defined]
        cpu = await _drive(lims, calls, model, callers, hold_s)
        ops = sum(lim.store.ops for lim in lims) - ops0  # type: ignore[attr-defined]
        local_cpu = await _drive([LocalLimiter()], calls, model, callers, hold_s)
    finally:
        for lim in lims:
            await lim.close()
        for nc in ncs:
            await nc.close()
    return {"calls": calls, "cap": cap, "callers": callers, "ledger_ops_per_call": round(ops / calls, 4),
            "cpu_ms_per_call": round(1000 * cpu / calls, 4), "local_semaphore_cpu_ms_per_call":
            round(1000 * local_cpu / calls, 4)}


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="veribus-bench-limits-") as store:
        proc, url = standalone_nats(Path(store))
        try:
            row = asyncio.run(measure(url, args.limit_calls, 16, 24, 0.002))
        finally:
            proc.kill()
            proc.wait(timeout=10)
    print(f"model limiter, 3 replicas sharing max_concurrency {row['cap']}, {row['callers']} callers, "
          f"{row['calls']} calls:")
    print(f"  ledger round trips per call   {row['ledger_ops_per_call']:>8}   (slots are leased in batches)")
    print(f"  CPU ms per call               {row['cpu_ms_per_call']:>8}   "
          f"(a local semaphore: {row['local_semaphore_cpu_ms_per_call']})")
    return 0
