"""NATS JetStream plumbing shared by every service and the CLI: one stream, deterministic
message ids, durable pull consumers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlparse

import nats
from nats import errors as nats_errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import errors as js_errors
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NotFoundError

from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus_auth, nats_patches, tracing  # noqa: F401 - nats_patches: applied on import

log = logging.getLogger("veribus.bus")

DUPLICATE_WINDOW_S = 600.0


def retention_limits(settings: Settings | None) -> dict[str, Any]:
    """The stream's retention from `VERIBUS_STREAM_MAX_AGE_S` / `VERIBUS_STREAM_MAX_BYTES` (oldest
    events go first); {} when none is configured."""
    limits: dict[str, Any] = {}
    if settings is not None:
        if settings.stream_max_age_s and settings.stream_max_age_s > 0:
            limits["max_age"] = float(settings.stream_max_age_s)
        if settings.stream_max_bytes and settings.stream_max_bytes > 0:
            limits["max_bytes"] = int(settings.stream_max_bytes)
    return limits


def stream_config(replicas: int = 1, limits: dict[str, Any] | None = None) -> StreamConfig:
    """The single source-of-truth stream: every `vb.>` event, on disk, deduplicated by msg id,
    kept on `replicas` servers of a cluster, within the retention `limits`."""
    return StreamConfig(
        name=events.STREAM,
        subjects=events.STREAM_SUBJECTS,
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_direct=True,
        max_msg_size=8 * 1024 * 1024,
        num_replicas=replicas,
        **(limits or {}),
    )


_REFUSED: list[str] = []  # the latest permissions violations of this process, newest last


def refused_inbox() -> str | None:
    """The newest refusal of a subscription to this process's reply inboxes, if there was one:
    then nothing it asks is answered, and a timeout is the server's permissions, not a slow
    server (a server still on a configuration from before per-role inboxes refuses them all)."""
    for text in reversed(_REFUSED):
        if "subscription" in text and '"_inbox' in text:
            return text
    return None


async def _quiet_error_cb(exc: Exception) -> None:
    """nats-py's default error callback logs a traceback per failed (re)connect attempt; one
    line at debug is enough (callers report what failed). A permissions violation is different:
    nats-py reports a refused subscription only here, the subscribing call succeeds, and what
    depended on it silently gets nothing, so it is a warning (and kept for `refused_inbox`)."""
    if "permissions violation" in str(exc).lower():
        _REFUSED.append(str(exc).lower())
        del _REFUSED[:-8]
        log.warning("nats: %s (this process's bus role does not allow it)", exc)
        return
    log.debug("nats: %s: %s", type(exc).__name__, exc)


def connect_options(settings: Settings) -> dict[str, Any]:
    """nats-py connect kwargs from settings (auth and TLS included)."""
    opts: dict[str, Any] = {
        "servers": settings.nats_servers,
        "error_cb": _quiet_error_cb,
        "name": "veribus",
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 5,
    }
    user, password, token = bus_auth.resolve(settings)  # explicit settings, else this role's credentials
    if user:
        opts["user"] = user
        opts["password"] = password or ""
    if token:
        opts["token"] = token
    role = bus_auth.connected_role(settings)
    if role is not None:  # the only replies this role may read (and no other role may send)
        opts["inbox_prefix"] = bus_auth.inbox_prefix(role)
    if settings.nats_tls_ca:
        ctx = ssl.create_default_context(cafile=settings.nats_tls_ca)
        opts["tls"] = ctx
    return opts


async def connect(settings: Settings, **extra: Any) -> NATS:
    opts = connect_options(settings)
    opts.update(extra)
    return await nats.connect(**opts)


MAX_REPLICAS = 3
CLUSTER_READY_TIMEOUT_S = 60.0
PLACEMENT_RETRY_S = 5.0  # how long a creation waits for a missing node before using fewer replicas


def _server_info(nc: NATS) -> dict[str, Any]:
    return getattr(nc, "_server_info", None) or {}


def clustered(nc: NATS) -> bool:
    """The server we are connected to is a cluster member (its INFO names a `cluster`)."""
    return bool(_server_info(nc).get("cluster"))


def cluster_size(nc: NATS) -> int:
    """How many servers the cluster we are connected to has, from the server's INFO: a
    clustered server lists every member's client URL in `connect_urls`; a standalone one has
    no `cluster`."""
    if not clustered(nc):
        return 1
    return max(1, len(set(_server_info(nc).get("connect_urls") or [])))


def replicas_override(settings: Settings | None) -> int | None:
    """`Settings.stream_replicas` (`VERIBUS_STREAM_REPLICAS`; the given settings, else the
    environment's), or None. A bad value is a ValueError naming the variable."""
    return (settings or Settings.from_env("stream_replicas")).stream_replicas


def desired_replicas(nc: NATS, settings: Settings | None = None) -> int:
    """Replicas for the stream and the KV buckets: VERIBUS_STREAM_REPLICAS when set, else
    min(3, cluster size). On a clustered server the size is the members it advertised or the
    nodes the URL lists, whichever is more: a node counts as healthy before its routes are all
    up, so a process connecting then (docker-compose's stream-init) is told of fewer members, and
    a stream created with that many replicas would keep them (`_create_placed` still steps down
    when the cluster really cannot place them)."""
    override = replicas_override(settings)
    if override is not None:
        return override
    size = cluster_size(nc)
    if clustered(nc):
        size = max(size, len((settings or Settings.from_env("nats_url")).nats_servers))
    return min(MAX_REPLICAS, size)


def cluster_not_ready(exc: BaseException) -> bool:
    """Errors a forming or failing-over cluster gives for a while (no meta leader yet, too few
    peers, a request lost on a node that went away): worth retrying, not reporting."""
    if isinstance(exc, js_errors.ServiceUnavailableError | js_errors.NoStreamResponseError
                  | nats_errors.TimeoutError | TimeoutError | nats_errors.NoRespondersError
                  | nats_errors.ConnectionReconnectingError):
        return True
    if isinstance(exc, js_errors.APIError):
        text = f"{exc.description or ''}".lower()
        return (exc.code or 0) >= 500 or "insufficient resources" in text or "no suitable peers" in text \
            or "not available" in text or "temporarily unavailable" in text
    return False


async def retry_cluster(op: Any, what: str, timeout: float = CLUSTER_READY_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    delay = 0.2
    while True:
        try:
            return await op()
        except Exception as exc:  # noqa: BLE001 - filtered below
            if not cluster_not_ready(exc) or time.monotonic() + delay > deadline:
                raise
            log.info("%s: the cluster is not ready (%r); retrying", what, exc)
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)


def _placement_failed(exc: BaseException) -> bool:
    text = f"{getattr(exc, 'description', '') or ''}".lower()
    return isinstance(exc, js_errors.APIError) and ("no suitable peers" in text or "insufficient resources" in text)


async def _create_placed(create: Any, replicas: int, what: str, *, result: Any) -> Any:
    """Create with `replicas`; when the cluster cannot place that many (a node is down right
    now), retry briefly, then step down one replica at a time rather than fail: a run must not
    stop because one node of three is being restarted. Logged at WARNING."""
    n = replicas
    while True:
        try:
            return result(n, await retry_cluster(lambda n=n: create(n), what, PLACEMENT_RETRY_S))
        except Exception as exc:
            if n <= 1 or not _placement_failed(exc):
                raise
            log.warning("%s: cannot place %d replicas now (%s); creating it with %d", what, n,
                        getattr(exc, "description", exc), n - 1)
            n -= 1


async def ensure_stream(js: JetStreamContext, settings: Settings | None = None) -> int:
    """Create or update the stream (idempotent: every service may call it at start); returns
    its replica count. Without an explicit VERIBUS_STREAM_REPLICAS the count never goes down:
    a process that connected before the cluster's routes were up must not shrink the stream
    the others created. Retries while the cluster forms or fails over."""
    nc: NATS = js._nc  # type: ignore[attr-defined]
    wanted = desired_replicas(nc, settings)
    explicit = replicas_override(settings) is not None

    limits = retention_limits(settings)

    async def op() -> int:
        try:
            info = await js.stream_info(events.STREAM)
        except NotFoundError:
            return int(await _create_placed(lambda n: js.add_stream(stream_config(n, limits)), wanted,
                                            "stream " + events.STREAM, result=lambda n, _: n))
        have = info.config
        replicas = wanted if explicit else max(wanted, have.num_replicas or 1)
        cfg = stream_config(replicas, limits)
        # a process without retention settings keeps the stream's (a CLI must not lift them)
        if not cfg.max_age:
            cfg.max_age = have.max_age
        if not cfg.max_bytes or cfg.max_bytes < 0:
            cfg.max_bytes = have.max_bytes
        if _stream_differs(have, cfg):
            # only when it differs: service roles and `cli` may read, not change, the stream (a
            # change is not answered: that role's request is refused), so the stream stays as it is
            try:
                await js.update_stream(cfg)
            except (nats_errors.TimeoutError, TimeoutError):
                log.warning("stream %s: its configuration differs from this process's and could not be changed "
                            "(no answer: only the operator's role may change it); using it as it is", events.STREAM)
                return have.num_replicas or 1
        return replicas

    return int(await retry_cluster(op, "stream " + events.STREAM))


async def ensure_kv(js: JetStreamContext, config: Any, settings: Settings | None = None) -> Any:
    """The KV bucket `config.bucket`, created on first use with the stream's replica rule and
    not fewer replicas than the stream has (a node that is down while a bucket is created is
    missing from the cluster's INFO, not from the cluster), unless the cluster cannot place them
    right now (see `_create_placed`). Another process may create it at the same moment: then it
    is opened."""
    async def op() -> Any:
        try:
            return await js.key_value(config.bucket)
        except (BucketNotFoundError, NotFoundError):
            pass
        replicas = desired_replicas(js._nc, settings)  # type: ignore[attr-defined]
        if replicas_override(settings) is None:
            try:
                replicas = max(replicas, (await js.stream_info(events.STREAM)).config.num_replicas or 1)
            except NotFoundError:
                pass

        async def create(n: int) -> Any:
            config.replicas = n
            return await js.create_key_value(config)

        try:
            return await _create_placed(create, replicas, "bucket " + config.bucket, result=lambda _, kv: kv)
        except Exception as exc:  # noqa: BLE001 - lost the creation race, or the cluster is not ready
            if cluster_not_ready(exc):
                raise
            return await js.key_value(config.bucket)

    return await retry_cluster(op, "bucket " + config.bucket)


def _stream_differs(have: StreamConfig, want: StreamConfig) -> bool:
    return (sorted(have.subjects or []) != sorted(want.subjects or []) or have.max_msg_size != want.max_msg_size
            or have.duplicate_window != want.duplicate_window or have.allow_direct != want.allow_direct
            or (have.num_replicas or 1) != (want.num_replicas or 1)
            or (have.max_age or 0) != (want.max_age or 0) or (have.max_bytes or -1) != (want.max_bytes or -1))


def ensure_stream_blocking(settings: Settings, timeout: float = 30.0) -> None:
    """Create or update the stream from synchronous code (`veribus up`, as the operator's role,
    before any service, whose role may not create it)."""

    async def go() -> None:
        nc = await connect(settings, name="veribus-up")
        try:
            await ensure_stream(nc.jetstream(), settings)
        finally:
            await nc.close()

    async def bounded() -> None:
        await asyncio.wait_for(go(), timeout)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(bounded())
        return

    box: list[BaseException] = []
    t = threading.Thread(target=lambda: _capture(box, bounded))
    t.start()
    t.join()
    if box:
        raise box[0]


def _capture(box: list[BaseException], coro_fn: Any) -> None:
    try:
        asyncio.run(coro_fn())
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
        box.append(exc)


# connect options of a one-shot probe or request: one try per server, no reconnecting, so an
# unreachable server fails the call at once (merge into `session(**extra)`)
ONE_TRY: dict[str, Any] = {"allow_reconnect": False, "max_reconnect_attempts": 0, "reconnect_time_wait": 0}


@asynccontextmanager
async def session(settings: Settings, *, ensure: bool = False, within: float | None = None,
                  **extra: Any) -> AsyncIterator[NATS]:
    """One connection for one piece of work, closed however the block ends (the connect /
    `finally: close` every command needs, written once). `ensure`: create or update the stream
    first, for a command that may be the first to touch a fresh server. `extra`: connect options
    (`ONE_TRY` for a probe that must fail fast); `within`: seconds the whole connect may take
    (TimeoutError after), for callers that must not wait on a server that accepts TCP and says
    nothing."""
    connecting = connect(settings, **extra)
    nc = await (asyncio.wait_for(connecting, timeout=within) if within is not None else connecting)
    try:
        if ensure:
            await ensure_stream(nc.jetstream(), settings)
        yield nc
    finally:
        await nc.close()


async def prepare_stream(settings: Settings, **extra: Any) -> None:
    """Create or update the stream over a short admin connection (a service at start-up)."""
    async with session(settings, ensure=True, **extra):
        pass


def msg_headers(env: events.Envelope) -> dict[str, str]:
    """The message id (JetStream deduplication) and, when tracing is on, the W3C trace context
    of the span being handled (`shared.runtime.tracing`)."""
    headers = {"Nats-Msg-Id": env.event_id}
    tracing.inject(headers)
    return headers


PUBLISH_RETRY_S = 30.0


async def _publish_one(js: JetStreamContext, env: events.Envelope) -> Any:
    # no `stream=`: nats-py would add a Nats-Expected-Stream header, stored with every event (vb.>
    # belongs to one stream; a subject no stream takes fails the publish all the same)
    return await js.publish(env.subject, events.wire(env), headers=msg_headers(env))


async def publish(js: JetStreamContext, env: events.Envelope) -> bool:
    """Publish one event; returns False when the server deduplicated it. While a cluster fails
    over (a node died, a new stream leader is being elected) the publish is retried: the message
    id makes a retry after a lost ack harmless."""
    try:  # the first try outside the retry loop: every handled message publishes (issue 12)
        ack = await _publish_one(js, env)
    except Exception as exc:  # noqa: BLE001 - filtered: only what a failing-over cluster says is retried
        if not cluster_not_ready(exc):
            raise
        ack = await retry_cluster(lambda: _publish_one(js, env), "publish", PUBLISH_RETRY_S)
    return not ack.duplicate


async def publish_many(js: JetStreamContext, envs: Iterable[events.Envelope], window: int = 256) -> int:
    """Publish many events with bounded in-flight acks; returns how many were new. Publishes
    that fail while the cluster fails over are retried one by one."""
    pending: list[tuple[events.Envelope, asyncio.Future[Any]]] = []
    new = 0

    async def drain() -> int:
        acks = await asyncio.gather(*(f for _, f in pending), return_exceptions=True)
        count = 0
        for (env, _), ack in zip(pending, acks, strict=True):
            if isinstance(ack, BaseException):
                if not cluster_not_ready(ack):
                    raise ack
                count += int(await publish(js, env))
            else:
                count += 0 if ack.duplicate else 1
        pending.clear()
        return count

    for env in envs:
        pending.append((env, asyncio.ensure_future(_publish_one(js, env))))
        if len(pending) >= window:
            new += await drain()
    if pending:
        new += await drain()
    return new


async def leader_stream_state(js: JetStreamContext, timeout: float = CLUSTER_READY_TIMEOUT_S) -> Any:
    """The events stream's state (messages, first_seq, last_seq) as its leader holds it. While a
    replicated stream has no leader, every member answers a stream info from its own copy, which
    may be behind (the info then names no leader): asked again until one is elected."""
    deadline = time.monotonic() + timeout
    while True:
        info = await retry_cluster(lambda: js.stream_info(events.STREAM), "stream info", timeout)
        if info.cluster is None or info.cluster.leader:
            return info.state
        if time.monotonic() > deadline:
            raise RuntimeError(f"the stream {events.STREAM} has had no leader for {timeout:.0f} s: "
                               "its state cannot be read (are most of the NATS nodes down?)")
        await asyncio.sleep(0.2)


async def last_event(js: JetStreamContext, subject: str) -> events.Envelope | None:
    """The newest event on an exact subject, or None: a direct get, and on a miss the stream's
    leader is asked (`leader_last_event`)."""
    try:
        msg = await js.get_last_msg(events.STREAM, subject, direct=True)
    except NotFoundError:
        return await leader_last_event(js, subject)
    return _event_of(msg, subject)


async def leader_last_event(js: JetStreamContext, subject: str) -> events.Envelope | None:
    """The newest event on an exact subject as the stream's leader holds it, or None.

    Any member of a replicated stream answers a direct get from its own copy, which may lag the
    leader (a node just restarted, or the one the quorum did not wait for): a miss there is not
    an answer. The finalization join depends on it: two branch events published together, each
    handler's direct get served by a member that has not applied the other one, and neither
    would finalize the job. A non-direct get is answered by the leader only."""
    try:
        msg = await retry_cluster(lambda: js.get_last_msg(events.STREAM, subject), "message get")
    except NotFoundError:
        return None
    return _event_of(msg, subject)


def _event_of(msg: Any, subject: str) -> events.Envelope | None:
    return events.decode(msg.data, subject) if msg.data else None


def server_reachable(url: str, timeout: float = 0.3) -> bool:
    """True when something accepts TCP connections at the NATS url, or at any URL of a
    comma-separated list (a cluster with one node down is still reachable)."""
    for one in url.split(","):
        if not one.strip():
            continue
        parsed = urlparse(one.strip() if "://" in one else f"nats://{one.strip()}")
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        except OSError:
            continue
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


def main() -> int:
    """`python -m shared.runtime.bus`: create or update the events stream (the VERIBUS_* settings;
    as the operator's role, `cli`): docker-compose's one-shot `stream-init`, before the services,
    whose roles may not create it."""
    settings = Settings.from_env()
    ensure_stream_blocking(settings, timeout=120.0)
    print(f"stream {events.STREAM} ready on {settings.nats_url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
