"""NATS JetStream plumbing shared by every service and the CLI: one stream, deterministic
message ids, durable pull consumers.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlparse

import nats
from nats import errors as nats_errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from shared.core import events
from shared.core.config import Settings


def _patch_pull_fetch_timeout() -> None:
    """nats-py 2.16 can raise a bare asyncio.TimeoutError from `fetch` (a second fetch after a
    partial batch), which FastStream 0.7.8 does not catch: its pull loop then dies with the batch
    it already holds, and those messages wait a whole ack_wait for redelivery. Re-raise it as
    nats' own TimeoutError, which FastStream handles."""
    sub_cls = JetStreamContext.PullSubscription
    if getattr(sub_cls.fetch, "_veribus_patched", False):
        return
    original = sub_cls.fetch

    async def fetch(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN001
        try:
            return await original(self, *args, **kwargs)
        except nats_errors.TimeoutError:
            raise
        except TimeoutError as exc:
            raise nats_errors.TimeoutError from exc

    fetch._veribus_patched = True  # type: ignore[attr-defined]
    sub_cls.fetch = fetch  # type: ignore[method-assign]


_patch_pull_fetch_timeout()

DUPLICATE_WINDOW_S = 600.0


def stream_config(settings: Settings | None = None) -> StreamConfig:
    """The single source-of-truth stream: every `vb.>` event, on disk, deduplicated by msg id.
    Retention (`VERIBUS_STREAM_MAX_AGE_S`, `VERIBUS_STREAM_MAX_BYTES`) drops the oldest events."""
    limits: dict[str, Any] = {}
    if settings is not None:
        if settings.stream_max_age_s and settings.stream_max_age_s > 0:
            limits["max_age"] = float(settings.stream_max_age_s)
        if settings.stream_max_bytes and settings.stream_max_bytes > 0:
            limits["max_bytes"] = int(settings.stream_max_bytes)
    return StreamConfig(
        name=events.STREAM,
        subjects=events.STREAM_SUBJECTS,
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_direct=True,
        max_msg_size=8 * 1024 * 1024,
        **limits,
    )


def connect_options(settings: Settings) -> dict[str, Any]:
    """nats-py connect kwargs from settings (auth and TLS included)."""
    opts: dict[str, Any] = {
        "servers": [settings.nats_url],
        "name": "veribus",
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 5,
    }
    if settings.nats_user:
        opts["user"] = settings.nats_user
        opts["password"] = settings.nats_password or ""
    if settings.nats_token:
        opts["token"] = settings.nats_token
    if settings.nats_tls_ca:
        ctx = ssl.create_default_context(cafile=settings.nats_tls_ca)
        opts["tls"] = ctx
    return opts


async def connect(settings: Settings, **extra: Any) -> NATS:
    opts = connect_options(settings)
    opts.update(extra)
    return await nats.connect(**opts)


async def ensure_stream(js: JetStreamContext, settings: Settings | None = None) -> None:
    """Create or update the stream (idempotent: every service may call it at start). A retention
    limit is set by whoever configures one; a process without one keeps the stream's (so a CLI
    without the variables does not lift an operator's limits)."""
    cfg = stream_config(settings)
    try:
        info = await js.stream_info(cfg.name)
        if not cfg.max_age:
            cfg.max_age = info.config.max_age
        if not cfg.max_bytes or cfg.max_bytes < 0:
            cfg.max_bytes = info.config.max_bytes
        await js.update_stream(cfg)
    except NotFoundError:
        await js.add_stream(cfg)


def msg_headers(env: events.Envelope) -> dict[str, str]:
    return {"Nats-Msg-Id": env.event_id}


async def publish(js: JetStreamContext, env: events.Envelope) -> bool:
    """Publish one event; returns False when the server deduplicated it."""
    ack = await js.publish(env.subject, events.encode(env), stream=events.STREAM, headers=msg_headers(env))
    return not ack.duplicate


async def publish_many(js: JetStreamContext, envs: Iterable[events.Envelope], window: int = 256) -> int:
    """Publish many events with bounded in-flight acks; returns how many were new."""
    pending: list[asyncio.Future[Any]] = []
    new = 0

    async def drain() -> int:
        acks = await asyncio.gather(*pending)
        pending.clear()
        return sum(0 if a.duplicate else 1 for a in acks)

    for env in envs:
        pending.append(
            asyncio.ensure_future(
                js.publish(env.subject, events.encode(env), stream=events.STREAM, headers=msg_headers(env))
            )
        )
        if len(pending) >= window:
            new += await drain()
    if pending:
        new += await drain()
    return new


async def last_event(js: JetStreamContext, subject: str) -> events.Envelope | None:
    """The newest event on an exact subject (direct get), or None."""
    try:
        msg = await js.get_last_msg(events.STREAM, subject, direct=True)
    except NotFoundError:
        return None
    return events.decode(msg.data) if msg.data else None


def server_reachable(url: str, timeout: float = 0.3) -> bool:
    """True when something accepts TCP connections at the NATS url."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f}s")
