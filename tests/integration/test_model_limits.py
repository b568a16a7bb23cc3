"""Deployment-wide model limits on a real nats-server: limiters on separate connections (as
separate processes would be) share one cap through the JetStream KV ledger; a holder that dies
without a goodbye loses its slots when its lease expires; 429s from a provider with a tighter
limit shrink the shared window."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
from aiohttp import web

from infra.simulator.script import SimConfig
from infra.simulator.server import SIMULATOR, create_app
from shared.control.processes import free_port
from shared.core.events import ModelSpec
from shared.runtime import call_limits
from shared.runtime.ledger_store import KVLedgerStore
from shared.runtime.limits import Limiter
from shared.runtime.llm.client import LLMClient
from tests.support.limits import hammer as _hammer


async def _limiter(url: str, owner: str, **kw: Any) -> tuple[Limiter, Any]:
    nc = await nats.connect(url)
    return Limiter(KVLedgerStore(nc), owner, **kw), nc


async def test_replicas_on_separate_connections_share_the_cap(nats_server) -> None:  # noqa: ANN001
    pairs = [await _limiter(nats_server.url, f"replica-{i}", linger_s=0.05) for i in range(3)]
    lims = [p[0] for p in pairs]
    model = ModelSpec(model_name="openai/shared", max_concurrency=5)
    try:
        peak, done = await _hammer(lims, model, 600, seed=3)
        ops = sum(lim.store.ops for lim in lims)  # type: ignore[attr-defined]
    finally:
        for lim, nc in pairs:
            await lim.close()
            await nc.close()
    assert done == 600
    assert 2 <= peak <= 5
    assert ops < 600  # fewer ledger round-trips than calls: slots are leased in batches and reused


async def test_a_dead_replicas_lease_expires(nats_server) -> None:  # noqa: ANN001
    model = ModelSpec(model_name="openai/lease", max_concurrency=2)
    dead, dead_nc = await _limiter(nats_server.url, "dies", lease_s=1.5)
    live, live_nc = await _limiter(nats_server.url, "lives", lease_s=1.5, poll_s=0.1)
    try:
        await dead.acquire(model)
        await dead.acquire(model)
        for st in dead._states.values():
            assert st.task is not None
            st.task.cancel()
        await dead_nc.close()  # gone: no release, no renewal, no goodbye
        ledger, _ = await live.store.get(call_limits.limit_key(model))
        assert ledger is not None and ledger.holders["dies"].n == 2
        expires = ledger.holders["dies"].exp
        lease = await asyncio.wait_for(live.acquire(model), 20)
        assert time.time() >= expires  # admitted only after the dead replica's lease ran out
        second = await asyncio.wait_for(live.acquire(model), 20)  # both slots are back
        live.release(lease)
        live.release(second)
    finally:
        await live.close()
        await live_nc.close()


async def test_429s_shrink_the_shared_window(nats_server) -> None:  # noqa: ANN001
    port = free_port()
    app = create_app(config=SimConfig(max_in_flight=2, retry_after_s=0.02))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    lim, nc = await _limiter(nats_server.url, "client", linger_s=0.05, decrease_interval_s=0.05)
    client = LLMClient(backoff_base=0.01, backoff_cap=0.05)
    client.limiter = lim
    model = ModelSpec(model_name="openai/tight", api_base=f"http://127.0.0.1:{port}/v1", max_concurrency=8,
                      max_retries=20)
    sim = app[SIMULATOR]
    sim.config = SimConfig(max_in_flight=2, retry_after_s=0.02, latency_ms=20)
    try:
        replies = await asyncio.gather(*(
            client.complete(model, [{"role": "user", "content": f"question {i}"}], stage="test", use_cache=False)
            for i in range(40)))
        ledger, _ = await lim.store.get(call_limits.limit_key(model))
    finally:
        await lim.close()
        await nc.close()
        await runner.cleanup()
    assert len(replies) == 40 and all(r.text for r in replies)
    assert sim.stats["rejected_over_limit"] > 0  # the provider did push back ...
    assert ledger is not None and ledger.decreases >= 1 and ledger.window < 8  # ... and the window shrank
