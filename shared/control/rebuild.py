"""Rebuilding the ClickHouse projections: drop the tables and refold them from the stream."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.control import processes, rebuild_parallel, stack
from shared.control.rebuild_parallel import stream_range
from shared.control.streams import PROJECTOR_DURABLE, LifecycleError, consumer_lags_leader
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus
from shared.runtime.content import BUCKET as CONTENT_BUCKET
from shared.runtime.content import ContentStore
from shared.store.engine import Store, open_store
from shared.store.projection import UNCOPIED_REFS_SQL, Projector, missing_contents
from shared.store.reads import run_query
from shared.store.rows import Projection

log = logging.getLogger("veribus.lifecycle")


TABLE_FINGERPRINTS = {
    "events": "SELECT count(), groupBitXor(cityHash64(event_id, event_type, run_id, result_id, subject, "
              "occurred_at, payload)) FROM events FINAL",
    "verification_results": "SELECT count(), groupBitXor(cityHash64(result_id, version, result_json)) "
                            "FROM verification_results FINAL",
    "runs": "SELECT count(), groupBitXor(cityHash64(run_id, version, config_json)) FROM runs FINAL",
    "contents": "SELECT count(), groupBitXor(cityHash64(key, kind, body)) FROM contents FINAL",
}


def fingerprint(query: Callable[[str], Any]) -> dict[str, tuple[int, int]]:
    """(rows, content hash) per table, read with FINAL; ingestion times are left out."""
    out = {}
    for table, sql in TABLE_FINGERPRINTS.items():
        try:
            rows = query(sql).rows
            out[table] = (int(rows[0][0]), int(rows[0][1]))
        except Exception as exc:  # noqa: BLE001 - a table that does not exist yet
            log.debug("fingerprint of %s: %s", table, exc)
            out[table] = (0, 0)
    return out


@dataclass
class RebuildReport:
    before: dict[str, tuple[int, int]]
    after: dict[str, tuple[int, int]]
    stream_messages: int
    elapsed_s: float
    mode: str  # "stack" (projector restarted) or "in-process"
    fold_s: float = 0.0  # in-process: the time spent reading, projecting and inserting the stream
    # run_id -> contents its events refer to that the content store no longer had (`contents`
    # lacks them: that run's question/template/rubric cannot be read from ClickHouse)
    contents_missing: dict[str, int] | None = None

    @property
    def identical(self) -> bool:
        return self.before == self.after

    def contents_lines(self) -> list[str]:
        """What the rebuild could not copy from the content store, said plainly ([] when all was there)."""
        if not self.contents_missing:
            return []
        runs = sorted(self.contents_missing)
        total = sum(self.contents_missing.values())
        shown = ", ".join(f"{r} ({self.contents_missing[r]})" for r in runs[:10])
        more = f" and {len(runs) - 10} more" if len(runs) > 10 else ""
        return [f"  {total} job contents referred to by the events are no longer in the content store "
                f"(KV bucket {CONTENT_BUCKET}), so ClickHouse has no question, template or rubric for them; "
                f"runs affected: {shown}{more}. Exports of these runs lack their rubric definition."]


async def _consumer_caught_up(js: JetStreamContext, durable: str) -> bool:
    """Nothing pending or unacknowledged, and the stream's leader holds no message past the
    consumer's ack floor (the consumer's counts are its own member's copy, which may lag)."""
    try:
        ci = await js.consumer_info(events.STREAM, durable)
    except NotFoundError:
        return False
    if int(ci.num_pending or 0) or int(ci.num_ack_pending or 0):
        return False
    return not await consumer_lags_leader(js, ci)


async def _stream_state(settings: Settings) -> Any:
    """The events stream's state (messages, first_seq, last_seq)."""
    async with bus.session(settings) as nc:
        return await bus.leader_stream_state(nc.jetstream())


def _stream_messages(settings: Settings) -> int:
    return int(asyncio.run(_stream_state(settings)).messages)


async def _delete_consumer(settings: Settings, durable: str) -> bool:
    async with bus.session(settings) as nc:
        try:
            await nc.jetstream().delete_consumer(events.STREAM, durable)
            return True
        except NotFoundError:
            return False


async def _wait_caught_up(settings: Settings, durable: str, timeout: float) -> None:
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await _consumer_caught_up(js, durable):
                return
            await asyncio.sleep(0.2)
        raise LifecycleError(f"the projector did not catch up with the stream within {timeout:.0f} s")


def _recreate_tables(settings: Settings) -> None:
    store = open_store(settings, migrate=False)
    try:
        store.drop_all()
        store.migrate()
    finally:
        store.close()


async def _project_in_process(settings: Settings, store: Store, first_seq: int, last_seq: int,
                              batch: int = 10_000) -> None:
    """Fold the stream's messages first_seq..last_seq into the tables of `store` from this
    process (no projector running)."""
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        projector = Projector(settings, fetch_content=ContentStore(lambda: js).get_raw)
        projector.store = store
        # one batch at a time: inserting in a thread beside the next batch's projection was slower
        # (both hold the GIL for most of their work). The cyclic collector is off meanwhile: a batch
        # keeps ~100,000 objects alive and makes no cycles, and its passes over them cost about a
        # third of the projection time (measured on 30,000 events: 0.9 s -> 0.7 s at best, 1.7 s ->
        # 0.9 s typical on the shared machine)
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            async for msgs in stream_range(nc, first_seq, last_seq, batch):
                p = projector.project_batch(msgs)
                await projector.attach_contents(p)
                projector.insert(p)
        finally:
            if gc_was_on:
                gc.enable()


def rebuild_projections(settings: Settings, *, timeout: float = 600.0,
                        progress: Callable[[str], None] | None = None) -> RebuildReport:
    """Drop the ClickHouse tables and refold them from the stream (the event log is the truth).

    With the local stack running: stop the projector, drop and recreate the tables, delete the
    projector's durable consumer, start the projector again (it re-reads the stream from the
    start) and wait until it has caught up. Without a local stack: fold the stream in this
    process (NATS must be reachable; nothing else may hold the chdb folder). Returns row counts
    and content hashes before and after."""
    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    state = stack.running_stack(settings)
    if state is not None:
        settings = settings.model_copy(update={"nats_url": state.nats_url})
    if not bus.server_reachable(settings.nats_url):
        raise LifecycleError(f"no NATS server at {settings.nats_url}: the stream is needed to rebuild "
                             "(start the stack with `veribus up`)")
    projectors = state.replicas_of("projector") if state else []
    if not projectors:
        return _rebuild_in_process(settings, say, t0)
    before = fingerprint(lambda sql: run_query(settings, sql))
    say(f"stopping the projector ({', '.join(str(p.pid) for p in projectors)})")
    for p in projectors:
        processes.stop_proc(p, timeout=30.0)
    say("dropping and recreating the tables")
    _recreate_tables(settings)
    if state is not None:
        asyncio.run(_delete_consumer(settings, PROJECTOR_DURABLE))
        say("starting the projector: it re-reads the stream from the start")
        for p in projectors:
            stack.restart_proc(state, p.name)
        asyncio.run(_wait_caught_up(settings, PROJECTOR_DURABLE, timeout))
    after = fingerprint(lambda sql: run_query(settings, sql))
    missing = missing_contents(lambda sql: run_query(settings, sql))
    msgs = _stream_messages(settings)
    return RebuildReport(before, after, msgs, time.monotonic() - t0, "stack", contents_missing=missing)


# the rebuild's inserts do not collapse rows of one key inside a block as they go in (a sort per
# block saved: ~3 us an event); reads use FINAL and merges collapse them, keeping the later row as
# the insert would have
REBUILD_INSERT = {"optimize_on_insert": 0}


def _fold_in_workers(settings: Settings, store: Store, workers: Any, chunks: list[tuple[int, int]],
                     batch: int = 10_000) -> None:
    """Fold the stream's `chunks` with `workers` (rebuild_parallel) reading and projecting, this
    process inserting."""
    types = {t: store.column_types(t) for t in ("events", "verification_results", "runs")}
    workers.run(settings, types, chunks, lambda *block: store.insert_block(*block, settings=REBUILD_INSERT), batch)


async def _copy_contents(settings: Settings, store: Store, window: int = 1000) -> None:
    """After a fold in workers (which project events, not contents): the live projector's
    `attach_contents` copies what the events refer to from the content store, a window of refs
    (found in SQL) at a time; a content the store no longer has stays missing, and
    `missing_contents` names its run."""
    refs = {str(k): (str(kind), str(run)) for k, kind, run in store.query(UNCOPIED_REFS_SQL).rows}
    if not refs:
        return
    async with bus.session(settings) as nc:
        projector = Projector(settings, fetch_content=ContentStore(lambda: nc.jetstream()).get_raw)
        projector.store = store
        keys = list(refs)
        for i in range(0, len(keys), window):
            p = Projection(refs={k: refs[k] for k in keys[i:i + window]})
            await projector.attach_contents(p)
            projector.insert(p)


def _rebuild_in_process(settings: Settings, say: Callable[[str], None], t0: float,
                        workers: int | None = None) -> RebuildReport:
    """No projector running: one store connection (the chdb folder is this process's) for the
    fingerprints, the drop and the inserts; worker processes read and project the stream
    (`rebuild_parallel`; none: all in this process)."""
    n = rebuild_parallel.default_workers() if workers is None else workers
    # no more workers than chunks, and none for one chunk (a small stream: a worker's start-up,
    # ~0.9 s of CPU, would cost more than it saves)
    state = asyncio.run(_stream_state(settings))
    chunks = rebuild_parallel.plan_chunks(int(state.first_seq), int(state.last_seq), rebuild_parallel.CHUNK)
    n = min(n, len(chunks)) if len(chunks) > 1 else 0
    pool = rebuild_parallel.Workers(n) if n > 0 else None  # started first: their imports overlap chdb's
    try:
        store = open_store(settings, migrate=False)
        try:
            before = fingerprint(store.query)
            say("dropping and recreating the tables")
            store.drop_all()
            store.migrate()
            t_fold = time.monotonic()
            if pool is not None:
                say(f"folding the stream: {n} worker processes read and project, this one inserts")
                _fold_in_workers(settings, store, pool, chunks)
                asyncio.run(_copy_contents(settings, store))
            else:
                say("folding the stream in this process")
                asyncio.run(_project_in_process(settings, store, int(state.first_seq), int(state.last_seq)))
            fold_s = time.monotonic() - t_fold
            say("fingerprinting the rebuilt tables")
            after = fingerprint(store.query)
            missing = missing_contents(store.query)
        finally:
            store.close()
    finally:
        if pool is not None:
            pool.close()
    msgs = _stream_messages(settings)
    return RebuildReport(before, after, msgs, time.monotonic() - t0, "in-process", fold_s, missing)
