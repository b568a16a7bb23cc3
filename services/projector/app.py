"""Projector: every `vb.>` event -> ClickHouse (`events`, `verification_results`, `runs`).

Subscribe (durable pull consumer "projector", whole batches), fold the batch into rows
(`shared.store.project_envelopes`: msgspec only, no pydantic), insert, then ack. Redelivery
is harmless: the tables are ReplacingMergeTree and every read uses FINAL. An undecodable message
becomes an `events` row (event_type 'undecodable') and is acked, so it never blocks a batch.

With embedded chdb the projector owns the folder (one process per folder), so it also answers
read-only SQL on core NATS request-reply `QUERY_SUBJECT`:
`{"sql": ..., "params": {...}}` -> `{"columns": [...], "types": [...], "rows": [[...]]}` or
`{"error": "..."}`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from faststream import AckPolicy, FastStream
from faststream.nats import ConsumerConfig, DeliverPolicy, JStream, NatsBroker, PullSub
from nats.js.api import AckPolicy as JsAckPolicy

from shared.bus import connect as bus_connect
from shared.bus import connect_options, ensure_stream
from shared.config import Settings
from shared.events import QUERY_SUBJECT, STREAM, decode
from shared.scrub import install_log_scrubber
from shared.service import broker_auth_kwargs
from shared.store import (
    PROJECTION_FAILED,
    Projection,
    ReadOnlyError,
    Store,
    open_store,
    preload_chdb,
    project_envelope,
    undecodable_row,
)

log = logging.getLogger("veribus.projector")

DURABLE = "projector"
PRODUCER = "projector/0.1"
DEFAULT_BATCH_SIZE = 1000  # measured: 500 -> 0.41, 1000 -> 0.34, 2000 -> 0.31 ms CPU/event
DEFAULT_BATCH_TIMEOUT = 0.5  # s: a batch is inserted when full or after this long
RETRY_DELAY = 2.0  # s: nak delay when the store is unavailable
DEFAULT_MAX_REPLY = 1024 * 1024

_json = msgspec.json.Encoder(enc_hook=str)


class _QueryRequest(msgspec.Struct):
    sql: str
    params: dict[str, Any] | None = None


_query_dec = msgspec.json.Decoder(_QueryRequest)


@dataclass
class Stats:
    batches: int = 0
    events: int = 0
    results: int = 0
    runs: int = 0
    undecodable: int = 0
    insert_failures: int = 0
    queries: int = 0
    project_cpu_s: float = 0.0  # CPU of decode + row building (the per-event Python work)


class Projector:
    """The projector's logic, separate from the FastStream wiring so it can be driven directly."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store: Store | None = None
        self.stats = Stats()
        self.max_reply_bytes = DEFAULT_MAX_REPLY

    def open(self) -> None:
        """Open (and migrate) the store; call in the main thread (chdb import, folder lock)."""
        if self.store is None:
            self.store = open_store(self.settings)
            self.store.reader()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    # ---- events ----
    def project_batch(self, msgs: list[Any]) -> Projection:
        """Decode a fetched batch into rows. Never raises for a bad message."""
        t0 = time.process_time()
        out = Projection()
        bad = 0
        for m in msgs:
            try:
                env = decode(m.data)
            except Exception as exc:  # noqa: BLE001 - any undecodable message is recorded
                out.events.append(undecodable_row(m.subject, m.data, exc))
                bad += 1
                continue
            project_envelope(env, out)
        self.stats.undecodable += bad
        self.stats.project_cpu_s += time.process_time() - t0
        return out

    def insert(self, p: Projection) -> None:
        assert self.store is not None, "Projector.open() first"
        self.store.insert_projection(p)
        self.stats.batches += 1
        self.stats.events += len(p.events)
        self.stats.results += len(p.results)
        self.stats.runs += len(p.runs)

    def store_ok(self) -> bool:
        try:
            assert self.store is not None
            self.store.query("SELECT 1")
            return True
        except Exception:  # noqa: BLE001 - any failure means "not available"
            return False

    async def handle_batch(self, msgs: list[Any]) -> tuple[list[Any], list[Any]]:
        """Project and insert; returns (messages to ack, messages to nak).

        A failed batch insert is retried message by message when the store itself answers, so
        one row ClickHouse refuses is recorded as a 'projection_failed' event and acked instead
        of blocking the consumer; when the store is down, everything is nak'ed for later.
        """
        p = self.project_batch(msgs)
        try:
            await asyncio.to_thread(self.insert, p)
            return msgs, []
        except Exception as exc:  # noqa: BLE001
            self.stats.insert_failures += 1
            log.warning("batch insert of %d events failed: %s", len(msgs), exc)
        if not await asyncio.to_thread(self.store_ok):
            return [], msgs
        ack: list[Any] = []
        nak: list[Any] = []
        for m in msgs:
            one = self.project_batch([m])
            try:
                await asyncio.to_thread(self.insert, one)
                ack.append(m)
                continue
            except Exception as exc:  # noqa: BLE001
                row = undecodable_row(m.subject, m.data, exc, kind=PROJECTION_FAILED)
                log.error("message on %s cannot be stored, recorded as projection_failed: %s", m.subject, exc)
                try:
                    await asyncio.to_thread(self.insert, Projection(events=[row]))
                    ack.append(m)
                except Exception:  # noqa: BLE001 - the store went away: retry later
                    nak.append(m)
        return ack, nak

    # ---- queries ----
    def answer_query(self, data: bytes) -> bytes:
        """A request body -> the JSON reply (never raises)."""
        self.stats.queries += 1
        try:
            req = _query_dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _json.encode({"error": f"bad request: {exc}"})
        try:
            assert self.store is not None
            res = self.store.query_read_only(req.sql, req.params)
        except ReadOnlyError as exc:
            return _json.encode({"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - database errors go back to the caller
            return _json.encode({"error": f"{type(exc).__name__}: {exc}"[:4000]})
        body = _json.encode({"columns": res.columns, "types": res.types, "rows": res.rows})
        if len(body) > self.max_reply_bytes:
            return _json.encode({
                "error": f"result too large for a NATS reply ({len(body)} bytes, {len(res.rows)} rows, "
                f"limit {self.max_reply_bytes}): add a LIMIT or aggregate"
            })
        return body


def create_app(
    settings: Settings,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    batch_timeout: float = DEFAULT_BATCH_TIMEOUT,
    log_level: int = logging.INFO,
) -> tuple[FastStream, Projector]:
    """The FastStream app and its Projector (not yet started)."""
    projector = Projector(settings)
    opts = connect_options(settings)
    broker = NatsBroker(
        opts.pop("servers"), **{k: v for k, v in opts.items() if k not in ("name", "user", "password", "token", "tls")},
        **broker_auth_kwargs(settings),
        name="veribus-projector", serializer=None, log_level=log_level, graceful_timeout=10.0,
    )

    @broker.subscriber(
        "vb.>",
        stream=JStream(name=STREAM, declare=False),  # declared by shared.bus.ensure_stream
        durable=DURABLE,
        pull_sub=PullSub(batch_size=batch_size, timeout=batch_timeout, batch=True),
        config=ConsumerConfig(
            durable_name=DURABLE,
            ack_policy=JsAckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=settings.consumer_ack_wait_s,
            max_ack_pending=max(settings.consumer_max_ack_pending, 2 * batch_size),
            max_deliver=-1,  # a failed insert is the store's fault, not the message's: keep it
        ),
        ack_policy=AckPolicy.MANUAL,
        decoder=lambda msg: msg.raw_message,  # raw nats Msgs: no JSON decode by FastStream
    )
    async def on_events(msgs: list[Any]) -> None:
        ack, nak = await projector.handle_batch(msgs)
        for m in ack:
            await m.ack()
        for m in nak:
            await m.nak(delay=RETRY_DELAY)

    # concurrent queries, each on its own read-only handle: a heavy one holds one worker, not the endpoint
    @broker.subscriber(QUERY_SUBJECT, queue=DURABLE, decoder=lambda msg: msg.body,
                       max_workers=int(os.environ.get("VERIBUS_QUERY_CONCURRENCY", "4")))
    async def on_query(body: bytes) -> bytes:
        return await asyncio.to_thread(projector.answer_query, body)

    app = FastStream(broker, logger=log)

    @app.on_startup
    async def _open() -> None:
        projector.open()  # blocking on purpose: before any message is consumed, in the main thread
        nc = await bus_connect(settings, name="veribus-projector-admin")
        try:
            await ensure_stream(nc.jetstream())
        finally:
            await nc.close()

    @app.after_startup
    async def _limits() -> None:
        conn = getattr(broker, "_connection", None)
        projector.max_reply_bytes = int(getattr(conn, "max_payload", 0) or DEFAULT_MAX_REPLY) - 1024

    @app.after_shutdown
    async def _close() -> None:
        projector.close()
        log.info("projector stopped: %s", projector.stats)

    return app, projector


def main() -> None:
    """Entry point of `python -m services.projector` (settings from VERIBUS_* env vars)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    install_log_scrubber()
    settings = Settings.from_env()
    if not settings.clickhouse_url:
        preload_chdb()
    batch = int(os.environ.get("VERIBUS_PROJECTOR_BATCH", DEFAULT_BATCH_SIZE))
    timeout = float(os.environ.get("VERIBUS_PROJECTOR_BATCH_TIMEOUT", DEFAULT_BATCH_TIMEOUT))
    # FastStream logs every batch / query ("Received", "Processed") at `log_level`: keep them at DEBUG
    app, _ = create_app(settings, batch_size=batch, batch_timeout=timeout, log_level=logging.DEBUG)
    asyncio.run(app.run())
