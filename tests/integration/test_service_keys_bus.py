"""A service's provider key names on a real nats-server (`shared.runtime.service_keys`): the
entry is there while the replica runs, gone when it stops, and gone after the bucket's TTL when
it dies without a word (kill -9), so a dead replica cannot vouch for a key for long."""

from __future__ import annotations

import asyncio
import os
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


def test_services_on_a_bus_whose_permissions_predate_the_bucket_start_and_run(tmp_path, monkeypatch) -> None:
    """An upgrade that keeps the bus's permissions of the version before (docker-compose's
    `bus-auth` volume, a cluster's confs not written again): the services may not write
    `vb_service_keys`. They start and finish a run all the same, since the entry is said in the
    background; said in their start-up instead, it held every model-calling service for the
    cluster's 60 s of retries and `veribus up` gave up ("services not ready after 60s"), as a
    `veribus bench` run whose process held the old roles found. The CLI then has no entries to
    read and checks its own environment, as before."""
    import subprocess
    import sys

    from shared.runtime import bus_auth
    from tests.conftest import EXAMPLE, REPO
    from tests.support.stack import up_and_down

    older = tuple(b for b in bus_auth.KV_BUCKETS if b != bus_auth.SERVICE_KEYS_BUCKET)
    monkeypatch.setattr(bus_auth, "KV_BUCKETS", older)  # `up` writes the roles in this process
    with up_and_down(tmp_path / "home") as (settings, _state):  # on the old code: TimeoutError, not ready
        conf = (settings.home / "auth" / "nats-auth.conf").read_text()
        assert "vb_service_keys" not in conf and "vb_content" in conf
        env = {k: v for k, v in os.environ.items() if not k.startswith("VERIBUS_NATS")}
        env.update(VERIBUS_HOME=str(settings.home), PYTHONPATH=str(REPO), VERIBUS_PROGRESS_INTERVAL_S="0")
        out = subprocess.run([sys.executable, "-m", "shared.cli", "run", str(EXAMPLE), "--simulate"], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Outcome: ✓ PASSED" in out.stdout, out.stdout

        async def entries() -> list[service_keys.Advert] | None:
            async with bus.session(settings) as nc:
                return await service_keys.read_adverts(nc.jetstream(timeout=2.0))

        assert asyncio.run(entries()) is None  # no service could make the bucket
