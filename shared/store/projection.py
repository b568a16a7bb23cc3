"""The projector's logic: fetched batches of `vb.>` messages -> ClickHouse rows, and read-only SQL
answers for the embedded engine. Kept apart from the FastStream wiring
(`services/projector/app.py`) so run control (`veribus projections rebuild`) and tests can drive
it in-process."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.core.config import Settings
from shared.core.events import decode
from shared.store.engine import Store, open_store
from shared.store.rows import PROJECTION_FAILED, Projection, project_envelope, undecodable_row
from shared.store.sql_guard import ReadOnlyError

log = logging.getLogger("veribus.projector")

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
                env = decode(m.data, m.subject)
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
