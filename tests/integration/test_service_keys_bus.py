"""A service's provider key names on a real nats-server (`shared.runtime.service_keys`): the
entry is there while the replica runs, gone when it stops, and gone after the bucket's TTL when
it dies without a word (kill -9), so a dead replica cannot vouch for a key for long."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.core.config import Settings
from shared.runtime import bus, service_keys

pytestmark = pytest.mark.integration


async def _said(js, producers: set[str], timeout: float = 10.0) -> list[service_keys.Advert]:  # noqa: ANN001
    """The entries once every one of `producers` has said its own (a replica says it in the
    background, so its service's start never waits on the bucket)."""
    t0 = time.monotonic()
    while True:
        got = await service_keys.read_adverts(js) or []
        if {a.producer for a in got} >= producers:
            return got
        assert time.monotonic() - t0 < timeout, f"not said within {timeout} s: {producers}"
        await asyncio.sleep(0.05)


def test_an_entry_lives_with_its_replica(nats_server) -> None:
    settings = Settings(nats_url=nats_server.url)

    async def scenario() -> None:
        async with bus.session(settings) as nc:
            js = nc.jetstream()
            assert await service_keys.read_adverts(js) is None  # no service of this version yet
            one = service_keys.KeyAdvertiser(lambda: js, "generation", "generation/0.1.0@h:1", settings,
                                             environ={"OPENAI_API_KEY": "sk-x", "PATH": "/bin"})
            two = service_keys.KeyAdvertiser(lambda: js, "generation", "generation/0.1.0@h:2", settings, environ={})
            await one.start()
            await two.start()
            got = await _said(js, {"generation/0.1.0@h:1", "generation/0.1.0@h:2"})
            assert sorted((a.producer, a.keys) for a in got) == [("generation/0.1.0@h:1", ("OPENAI_API_KEY",)),
                                                                   ("generation/0.1.0@h:2", ())]
            await two.close()
            assert [a.producer for a in await service_keys.read_adverts(js)] == ["generation/0.1.0@h:1"]
            await one.close()
            assert await service_keys.read_adverts(js) == []

    asyncio.run(scenario())


def test_a_replica_killed_without_a_word_is_forgotten_after_the_ttl(nats_server, monkeypatch) -> None:
    monkeypatch.setattr(service_keys, "TTL_S", 1.0)  # the bucket is made with it (a fresh server per test)
    settings = Settings(nats_url=nats_server.url)

    async def scenario() -> None:
        async with bus.session(settings) as nc:
            js = nc.jetstream()
            dead = service_keys.KeyAdvertiser(lambda: js, "parsing", "parsing/0.1.0@h:9", settings,
                                              environ={"OPENAI_API_KEY": "sk-x"})
            await dead.start()
            assert [a.producer for a in await _said(js, {"parsing/0.1.0@h:9"})] == ["parsing/0.1.0@h:9"]
            dead._task.cancel()  # killed: no refresh, no delete
            t0 = time.monotonic()
            while await service_keys.read_adverts(js):
                assert time.monotonic() - t0 < 15, "the dead replica's entry outlived its TTL"
                await asyncio.sleep(0.2)
            await dead.close()

    asyncio.run(scenario())
