"""The response cache on a real nats-server, called through LLMClient against the simulator: a
repeated call in the same run never reaches the model (with or without the cross-run opt-in), a
new run does unless it opted in, and `clear` empties the shared bucket."""

from __future__ import annotations

import nats
from aiohttp import web

from infra.simulator.server import SIMULATOR, create_app
from shared.control.processes import free_port
from shared.core.events import ModelSpec
from shared.runtime import response_cache
from shared.runtime.llm.cache import CACHE_SCOPE
from shared.runtime.llm.client import LLMClient
from shared.runtime.response_cache import SHARED_SCOPE, service_cache


async def test_run_scope_and_shared_scope(nats_server) -> None:  # noqa: ANN001
    port = free_port()
    app = create_app()
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    nc = await nats.connect(nats_server.url)
    sim = app[SIMULATOR]
    client = LLMClient(cache=service_cache(nc.jetstream(), run_scoped=True, max_age_s=3600))
    model = ModelSpec(model_name="openai/cached", api_base=f"http://127.0.0.1:{port}/v1")
    msgs = [{"role": "user", "content": "What is the answer?"}]

    async def ask() -> bool:
        return (await client.complete(model, msgs, stage="test", replicate=1)).cached

    try:
        CACHE_SCOPE.set("run-a")
        assert [await ask(), await ask()] == [False, True]  # a redelivery in run-a: no second call
        CACHE_SCOPE.set("run-b")
        assert await ask() is False  # a new run without the opt-in asks again
        assert sim.stats["requests"] == 2
        CACHE_SCOPE.set(SHARED_SCOPE)
        assert [await ask(), await ask()] == [False, True]  # opted in: the first fills, the rest reuse
        assert sim.stats["requests"] == 3
        removed = await response_cache.clear(nc.jetstream())
        assert removed == {response_cache.SHARED_BUCKET: 1}
        assert await ask() is False and sim.stats["requests"] == 4
        no_run_cache = LLMClient(cache=service_cache(nc.jetstream(), run_scoped=False, max_age_s=3600))
        CACHE_SCOPE.set("run-c")
        r1 = await no_run_cache.complete(model, msgs, stage="test", replicate=1)
        r2 = await no_run_cache.complete(model, msgs, stage="test", replicate=1)
        assert not r1.cached and not r2.cached and sim.stats["requests"] == 6  # VERIBUS_LLM_CACHE=false
    finally:
        await nc.close()
        await runner.cleanup()
