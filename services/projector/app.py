"""Projector: every `vb.>` event -> ClickHouse (`events`, `verification_results`, `runs`).

Subscribe (durable pull consumer "projector", whole batches), fold the batch into rows
(`shared.store.rows.project_envelopes`: msgspec only, no pydantic), insert, then ack. Redelivery
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
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.nats import ConsumerConfig, DeliverPolicy, JStream, NatsBroker, PullSub
from nats.js.api import AckPolicy as JsAckPolicy

from shared.core.config import Settings
from shared.core.events import QUERY_SUBJECT, STREAM
from shared.runtime import observability
from shared.runtime.bus import connect_options, prepare_stream
from shared.runtime.content import ContentStore
from shared.runtime.durables import settle_consumer
from shared.runtime.harness import broker_auth_kwargs
from shared.runtime.observability import METRICS
from shared.store import arrow
from shared.store.engine import preload_chdb
from shared.store.projection import DEFAULT_MAX_REPLY, Projector

log = logging.getLogger("veribus.projector")

DURABLE = "projector"
DEFAULT_BATCH_SIZE = 1000  # measured: 500 -> 0.41, 1000 -> 0.34, 2000 -> 0.31 ms CPU/event
DEFAULT_BATCH_TIMEOUT = 0.5  # s: a batch is inserted when full or after this long
RETRY_DELAY = 2.0  # s: nak delay when the store is unavailable

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
        opts.pop("servers"), **{k: v for k, v in opts.items() if k not in ("name", "user", "password", "token", "tls", "inbox_prefix")},
        **broker_auth_kwargs(opts),
        name="veribus-projector", serializer=None, log_level=log_level, graceful_timeout=10.0,
    )

    # the contents lean events refer to, read from the bucket once each into ClickHouse
    projector.fetch_content = ContentStore(lambda: broker._connection.jetstream()).get_raw

    consumer = ConsumerConfig(
        durable_name=DURABLE,
        filter_subject="vb.>",  # every event; what `settle_consumer` puts back if changed
        ack_policy=JsAckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=settings.consumer_ack_wait_s,
        max_ack_pending=max(settings.consumer_max_ack_pending, 2 * batch_size),
        max_deliver=-1,  # a failed insert is the store's fault, not the message's: keep it
    )

    @broker.subscriber(
        "vb.>",
        stream=JStream(name=STREAM, declare=False),  # declared by shared.runtime.bus.ensure_stream
        durable=DURABLE,
        inbox_prefix=f"{opts.get('inbox_prefix', '_INBOX')}.".encode(),  # its pulls' inboxes: the role's own
        pull_sub=PullSub(batch_size=batch_size, timeout=batch_timeout, batch=True),
        config=consumer,
        ack_policy=AckPolicy.MANUAL,
        decoder=lambda msg: msg.raw_message,  # raw nats Msgs: no JSON decode by FastStream
    )
    async def on_events(msgs: list[Any]) -> None:
        with METRICS.handling("projector", "vb.>", 1) as m:
            ack, nak = await projector.handle_batch(msgs)
            m["outcome"] = "failed" if nak else "handled"
        for m in ack:
            await m.ack()
        for m in nak:
            await m.nak(delay=RETRY_DELAY)

    # concurrent queries, each on its own read-only handle: a heavy one holds one worker, not the endpoint
    @broker.subscriber(QUERY_SUBJECT, queue=DURABLE, decoder=lambda msg: msg.body,
                       max_workers=settings.query_concurrency)
    async def on_query(body: bytes) -> bytes:
        return await asyncio.to_thread(projector.answer_query, body)

    app = FastStream(broker, logger=log)

    @app.on_startup
    async def _open() -> None:
        projector.open()  # blocking on purpose: before any message is consumed, in the main thread
        await prepare_stream(settings, name="veribus-projector-admin")

    observer: list[Any] = []

    @app.after_startup
    async def _limits() -> None:
        conn = getattr(broker, "_connection", None)
        projector.max_reply_bytes = int(getattr(conn, "max_payload", 0) or DEFAULT_MAX_REPLY) - 1024
        await settle_consumer(broker._connection.jetstream(), STREAM, DURABLE, consumer)  # a changed ack wait or filter
        observer.append(await observability.start("projector", observability.broker_not_ready(broker, lambda: True),
                                                  lambda: broker._connection.jetstream(), [DURABLE]))

    @app.on_shutdown
    async def _stop_observer() -> None:
        for runner in observer:
            if runner is not None:
                await runner.cleanup()

    @app.after_shutdown
    async def _close() -> None:
        projector.close()
        log.info("projector stopped: %s", projector.stats)

    return app, projector


def main() -> None:
    """Entry point of `python -m services.projector` (settings from VERIBUS_* env vars)."""
    observability.configure_logging("projector")  # its handler scrubs secrets (shared.core.scrub)
    settings = Settings.from_env()
    if not settings.clickhouse_url:
        preload_chdb()
    arrow.preload()  # not inside the first batch's insert
    batch, timeout = settings.projector_batch, settings.projector_batch_timeout
    # FastStream logs every batch / query ("Received", "Processed") at `log_level`: keep them at DEBUG
    app, _ = create_app(settings, batch_size=batch, batch_timeout=timeout, log_level=logging.DEBUG)
    asyncio.run(app.run())
