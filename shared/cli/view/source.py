"""Where the viewer reads from, decided per query the way `veribus query` decides:

- a ClickHouse server (`Settings.clickhouse_url`): one client, queried in a worker thread;
- the embedded engine: the projector owns the chdb folder, so ask it over NATS
  (`veribus.query`, one connection kept open); when no projector answers, open the folder in
  this process, and close it again after a few idle seconds so a stack started later can take it.

It also reads the bus: the JetStream stream and its consumers (pending and in-flight
messages), for the live status strip of the runs page.

Every query is read-only: the projector and `Store.query_read_only` refuse anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shared.core.config import Settings
from shared.core.events import QUERY_SUBJECT, STREAM
from shared.runtime.bus import connect_options, server_reachable
from shared.store.engine import QueryResult, Store, open_store
from shared.store.reads import QueryError
from shared.store.sql_guard import ReadOnlyError, read_only_refusal

IDLE_CLOSE_S = 5.0

_enc = msgspec.json.Encoder(enc_hook=str)


class _Reply(msgspec.Struct):
    columns: list[str] = []
    rows: list[list[Any]] = []
    types: list[str] = []
    error: str | None = None


_dec = msgspec.json.Decoder(_Reply)


class ViewSource:
    """Async read-only queries for the viewer (see the module docstring)."""

    def __init__(self, settings: Settings, timeout: float = 30.0) -> None:
        self.settings = settings
        self.timeout = timeout
        self._nc: Any = None
        self._store: Store | None = None
        self._store_used = 0.0
        self._lock = asyncio.Lock()
        self._closer: asyncio.Task[None] | None = None
        self.backend = "clickhouse server" if settings.clickhouse_url else "embedded (chdb)"

    # ---- queries ----
    async def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        reason = read_only_refusal(sql)
        if reason:
            raise QueryError(f"refused: {reason}")
        if not self.settings.clickhouse_url:
            nc = await self._nats()
            if nc is not None:
                res = await self._via_nats(nc, sql, params)
                if res is not None:
                    return res
        return await self._direct(sql, params)

    async def _nats(self) -> Any:
        if self._nc is not None and self._nc.is_connected:
            return self._nc
        if not server_reachable(self.settings.nats_url):
            return None
        opts = connect_options(self.settings)
        opts.update(name="veribus-view", connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=1)
        try:
            self._nc = await asyncio.wait_for(nats.connect(**opts), timeout=5)
        except Exception:  # noqa: BLE001 - no server: read the folder directly
            self._nc = None
        return self._nc

    async def _via_nats(self, nc: Any, sql: str, params: dict[str, Any] | None) -> QueryResult | None:
        body = _enc.encode({"sql": sql, "params": params or None})
        try:
            msg = await nc.request(QUERY_SUBJECT, body, timeout=self.timeout)
        except NoRespondersError:
            return None  # a bus without a projector: the folder is free
        except (TimeoutError, NatsTimeout) as exc:
            raise QueryError(f"the projector did not answer within {self.timeout:g} s") from exc
        except Exception as exc:  # the connection dropped: reconnect on the next query
            self._nc = None
            raise QueryError(f"NATS request to the projector failed: {type(exc).__name__}: {exc}") from exc
        reply = _dec.decode(msg.data)
        if reply.error is not None:
            raise QueryError(reply.error)
        if self._store is not None:
            await self._close_store()  # a projector appeared: let go of the folder
        return QueryResult(columns=reply.columns, rows=[tuple(r) for r in reply.rows], types=reply.types)

    async def _direct(self, sql: str, params: dict[str, Any] | None) -> QueryResult:
        async with self._lock:
            if self._store is None:
                self._store = await asyncio.to_thread(open_store, self.settings, not self.settings.clickhouse_url)
            store = self._store
            self._store_used = time.monotonic()
            try:
                return await asyncio.to_thread(store.query_read_only, sql, params)
            except ReadOnlyError as exc:
                raise QueryError(str(exc)) from exc
            except Exception as exc:
                raise QueryError(f"{type(exc).__name__}: {exc}") from exc
            finally:
                self._store_used = time.monotonic()
                if not self.settings.clickhouse_url and self._closer is None:
                    self._closer = asyncio.get_running_loop().create_task(self._close_when_idle())

    async def _close_when_idle(self) -> None:
        try:
            while self._store is not None:
                await asyncio.sleep(1.0)
                if time.monotonic() - self._store_used >= IDLE_CLOSE_S and not self._lock.locked():
                    await self._close_store()
        finally:
            self._closer = None

    async def _close_store(self) -> None:
        async with self._lock:
            if self._store is not None:
                store, self._store = self._store, None
                await asyncio.to_thread(store.close)

    # ---- the bus ----
    async def bus_status(self) -> dict[str, Any] | None:
        """The stream's message count and each consumer's backlog, or None without a bus."""
        nc = await self._nats()
        if nc is None:
            return None
        try:
            js = nc.jetstream()
            info = await js.stream_info(STREAM)
            consumers = await js.consumers_info(STREAM)
        except Exception:  # noqa: BLE001 - a bus without the stream yet
            return None
        return {
            "messages": int(info.state.messages),
            "consumers": sorted(
                ({"name": c.name, "pending": int(c.num_pending or 0), "in_flight": int(c.num_ack_pending or 0),
                  "redelivered": int(c.num_redelivered or 0)} for c in consumers),
                key=lambda c: c["name"]),
        }

    async def close(self) -> None:
        if self._closer is not None:
            self._closer.cancel()
            with contextlib.suppress(BaseException):
                await self._closer
        await self._close_store()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = None
