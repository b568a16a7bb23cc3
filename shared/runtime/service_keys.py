"""Which provider keys each model-calling service holds, said on the bus by *name*, never value.

Against a configured deployment the CLI runs elsewhere than the services that make the model
calls, so its own environment says nothing about their keys: a laptop without `OPENAI_API_KEY`
was refused a run the cluster could make, and a laptop with it let through a run whose every
call then failed. Each service with a model client puts one entry in the KV bucket
`vb_service_keys`, `<service>.<replica>`: the names of its set, credential-like environment
variables (`shared.core.scrub.is_secret_name`), refreshed every `REFRESH_S`. The bucket's entries
expire after `TTL_S` (a killed replica's); a stopped service deletes its own. Only service roles
may write the bucket; `cli` reads it (stream info for the subjects, direct gets for the values).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import NotFoundError

from shared.core.config import Settings
from shared.core.scrub import is_secret_name
from shared.runtime.bus import ensure_kv
from shared.runtime.bus_auth import SERVICE_KEYS_BUCKET

log = logging.getLogger("veribus.service_keys")

BUCKET = SERVICE_KEYS_BUCKET
TTL_S = 90.0  # an entry nobody refreshes is gone after this (the replica died)
REFRESH_S = 30.0
MAX_NAMES = 256  # what one entry may list (a decoded entry is cut there too)


class Advert(msgspec.Struct, frozen=True):
    """One replica's entry: which service, which replica (its `producer`), its key names."""

    service: str
    producer: str
    keys: tuple[str, ...] = ()


_decode = msgspec.json.Decoder(Advert)


def key_names(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The names of the set, credential-like variables of `environ` (never their values)."""
    return tuple(sorted(n for n, v in environ.items() if v and is_secret_name(n)))[:MAX_NAMES]


def entry_key(service: str, producer: str) -> str:
    """The replica's KV key: `<service>.<producer with what a key may not hold made _>`."""
    return f"{service}.{re.sub(r'[^A-Za-z0-9_-]', '_', producer)}"[:200]


def kv_config() -> KeyValueConfig:
    return KeyValueConfig(bucket=BUCKET, history=1, ttl=TTL_S, direct=True,
                          description="veribus: the provider key names each model-calling service holds")


class KeyAdvertiser:
    """A service's entry: put at start, refreshed until `close`, which deletes it."""

    def __init__(self, js: Callable[[], JetStreamContext], service: str, producer: str,
                 settings: Settings | None = None, environ: Mapping[str, str] | None = None) -> None:
        self._js = js
        self._settings = settings
        self.key = entry_key(service, producer)
        self.value = msgspec.json.encode(Advert(service, producer, key_names(os.environ if environ is None
                                                                              else environ)))
        self._kv: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Say the entry in the background and keep it fresh: the service's start never waits on
        the bucket (a cluster still electing its leaders), and a bus that refuses it (older
        permissions) costs one warning, not the service; the CLI then checks its own environment."""
        self._task = asyncio.create_task(self._keep(), name="veribus-service-keys")

    async def _keep(self) -> None:
        warned = False
        while True:
            try:
                if self._kv is None:
                    self._kv = await ensure_kv(self._js(), kv_config(), self._settings)
                await self._kv.put(self.key, self.value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - tried again at the next refresh
                if not warned:
                    log.warning("could not say this service's provider key names on the bus (%s: %s): `veribus run` "
                                "against this deployment cannot check them; trying again every %.0f s",
                                type(exc).__name__, exc, REFRESH_S)
                    warned = True
            await asyncio.sleep(REFRESH_S)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._kv is not None:
            with contextlib.suppress(Exception):
                await self._kv.delete(self.key)
            self._kv = None


async def read_adverts(js: JetStreamContext) -> list[Advert] | None:
    """Every live replica's entry; None when the bucket does not exist (no service of this
    version has started). An entry that does not decode, or whose key does not match its
    service and replica, is left out."""
    stream = f"KV_{BUCKET}"
    try:
        info = await js.stream_info(stream, subjects_filter=f"$KV.{BUCKET}.>")
    except NotFoundError:
        return None
    out = []
    for subject in sorted(info.state.subjects or {}):
        try:
            msg = await js.get_last_msg(stream, subject, direct=True)
        except NotFoundError:  # expired or deleted since the info
            continue
        if not msg.data or (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
            continue
        try:
            advert = _decode.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("a service key entry %s does not decode; left out", subject)
            continue
        if f"$KV.{BUCKET}.{entry_key(advert.service, advert.producer)}" != subject:
            continue
        out.append(msgspec.structs.replace(advert, keys=advert.keys[:MAX_NAMES]))
    return out
