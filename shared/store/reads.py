"""Read-only SQL over the veribus tables, wherever they are: where reads go is decided once,
in `open_source`.

- ClickHouse server (`Settings.clickhouse_url`): connect directly.
- Embedded chdb: the folder belongs to the running projector, so ask it over NATS
  (`QUERY_SUBJECT`); when nothing answers (no stack running), open the folder directly.

`run_query` (one query, `veribus query`) and the result loaders and exports (`ResultFilter`,
`iter_pages`: keyset-paged reads of `verification_results FINAL`) both read through a
`RowSource` from `open_source`. Every path refuses SQL that is not read-only
(`shared.store.sql_guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import msgspec
from nats.errors import NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeout

from shared.core.config import Settings
from shared.core.events import QUERY_SUBJECT
from shared.runtime import bus
from shared.runtime.bus import server_reachable
from shared.store.engine import NON_FINITE, QueryResult, Store, json_safe_rows, open_store, query_error_text
from shared.store.sql_guard import RESULT_TOO_LARGE, ReadOnlyError, read_only_refusal, reader_settings


class QueryError(RuntimeError):
    """The query ran and failed (database error), or was refused."""


class NoProjector(Exception):
    """Nothing answered on QUERY_SUBJECT (no NATS server, or no projector subscribed)."""


_enc = msgspec.json.Encoder(enc_hook=str)


class _Reply(msgspec.Struct):
    columns: list[str] = []
    rows: list[list[Any]] = []
    types: list[str] = []
    error: str | None = None


_reply_dec = msgspec.json.Decoder(_Reply)


# how a reader connects: one short try; the caller falls back to the folder when nothing answers
_READER_CONNECT: dict[str, Any] = {"connect_timeout": 2, "allow_reconnect": False, "max_reconnect_attempts": 1,
                                   "reconnect_time_wait": 0.1}
_CONNECT_WITHIN_S = 5.0
_CONNECT_FAILED = (TimeoutError, NoServersError, OSError, NatsTimeout)


def projector_first(settings: Settings) -> bool:
    """Where reads go: a configured ClickHouse server is read directly; otherwise the embedded
    folder belongs to the running projector, so ask it first (the folder only when none answers)."""
    return not settings.clickhouse_url


async def ask_projector(nc: Any, sql: str, params: Mapping[str, Any] | None, timeout: float) -> QueryResult:
    """One query to the projector over a connection (`QUERY_SUBJECT` request-reply). Raises
    NoProjector when nobody is subscribed, QueryError when it fails or does not answer in time."""
    body = _enc.encode({"sql": sql, "params": dict(params) if params else None})
    try:
        msg = await nc.request(QUERY_SUBJECT, body, timeout=timeout)
    except NoRespondersError as exc:
        raise NoProjector("no projector is subscribed to the query subject") from exc
    except (TimeoutError, NatsTimeout) as exc:
        raise QueryError(f"the projector did not answer within {timeout:g} s") from exc
    reply = _reply_dec.decode(msg.data)
    if reply.error is not None:
        raise QueryError(reply.error)
    rows = [tuple(r) for r in reply.rows]
    floats = [i for i, t in enumerate(reply.types or ()) if "Float" in t]
    if floats and any(isinstance(r[i], str) for r in rows for i in floats):  # inf/nan, sent as text
        rows = [tuple(NON_FINITE.get(v, v) if i in floats and isinstance(v, str) else v for i, v in enumerate(r))
                for r in rows]
    return QueryResult(columns=reply.columns, rows=rows, types=reply.types)


async def query_via_nats(
    settings: Settings, sql: str, params: Mapping[str, Any] | None = None, timeout: float = 10.0
) -> QueryResult:
    """Ask the projector. Raises NoProjector when no server or no subscriber is there."""
    if not server_reachable(settings.nats_url):
        raise NoProjector(f"no NATS server at {settings.nats_url}")
    try:
        async with bus.session(settings, within=_CONNECT_WITHIN_S, name="veribus-query", **_READER_CONNECT) as nc:
            return await ask_projector(nc, sql, params, timeout)
    except _CONNECT_FAILED as exc:
        raise NoProjector(f"no NATS server at {settings.nats_url}: {exc}") from exc


def store_query(store: Store, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
    """A read-only query on an open store; every failure is a QueryError."""
    try:
        return store.query_read_only(sql, params)
    except ReadOnlyError as exc:
        raise QueryError(str(exc)) from exc
    except Exception as exc:
        raise QueryError(query_error_text(exc)) from exc


def _run_coro(coro: Any) -> Any:
    """asyncio.run, also from code that already runs an event loop (in a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["v"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["e"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


def run_query(
    settings: Settings, sql: str, params: Mapping[str, Any] | None = None, timeout: float | None = None
) -> QueryResult:
    """Run one read-only query against the configured store (see `open_source`); by default it
    waits for the engine's own time limit plus time to answer."""
    reason = read_only_refusal(sql)
    if reason:
        raise QueryError(f"refused: {reason}")
    if timeout is None:
        timeout = float(reader_settings()["max_execution_time"]) + 5.0
    with open_source(settings, timeout=timeout) as source:
        return source.query(sql, params)


# ---- formatting ----


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"  # inf, -inf, nan as such
    if isinstance(v, _dt.datetime):
        return v.isoformat(sep=" ")
    if isinstance(v, dict | list | tuple):
        return _enc.encode(v).decode()
    return str(v)


def format_table(result: QueryResult, max_width: int = 60) -> str:
    """An aligned text table (numbers right-aligned, long cells cut to `max_width`)."""
    cells = [[_cell(v) for v in row] for row in result.rows]
    cells = [[c if len(c) <= max_width else c[: max_width - 1] + "…" for c in row] for row in cells]
    cols = list(result.columns)
    widths = [len(c) for c in cols]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    numeric = [
        all(isinstance(r[i], int | float) and not isinstance(r[i], bool) for r in result.rows if r[i] is not None)
        and any(r[i] is not None for r in result.rows)
        for i in range(len(cols))
    ]

    def line(vals: list[str]) -> str:
        return "  ".join(
            v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i]) for i, v in enumerate(vals)
        ).rstrip()

    out = [line(cols), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    out.append(f"({len(result.rows)} row{'s' if len(result.rows) != 1 else ''})")
    return "\n".join(out)


def format_json(result: QueryResult) -> str:
    """The rows as a JSON array of objects (column -> value); inf, -inf and nan as the strings
    "inf", "-inf", "nan" (JSON has no number for them; never null, which is NULL's)."""
    safe = QueryResult(columns=result.columns, rows=list(json_safe_rows(result.rows)), types=result.types)
    return msgspec.json.format(_enc.encode(safe.as_dicts()), indent=2).decode()


class RowSource(Protocol):
    """Something that runs one read-only query: a store, or the projector over NATS."""

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult: ...


class StoreSource:
    """Reads through an open Store (its read-only handle)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
        return store_query(self.store, sql, params)


class NatsSource:
    """Reads through the projector (`veribus.query` request-reply); one connection per query."""

    def __init__(self, settings: Settings, timeout: float = 30.0) -> None:
        self.settings = settings
        self.timeout = timeout

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
        return _run_coro(query_via_nats(self.settings, sql, params, self.timeout))


@contextlib.contextmanager
def open_source(settings: Settings, timeout: float = 30.0) -> Iterator[RowSource]:
    """Where reads go, decided once: a ClickHouse server directly; else the projector over NATS
    when a stack runs; else the chdb folder opened in this process (held open for the whole
    read, not reopened per page)."""
    if projector_first(settings):
        try:
            _run_coro(query_via_nats(settings, "SELECT 1", None, 10.0))
        except NoProjector:
            pass
        else:
            yield NatsSource(settings, timeout)
            return
    store = open_store(settings, migrate=projector_first(settings))
    try:
        yield StoreSource(store)
    finally:
        store.close()


# a folder the long-lived reader opened is let go after this many idle seconds, so that a stack
# started later can take it
IDLE_CLOSE_S = 5.0


class LiveSource:
    """Async read-only queries for a long-lived reader (the viewer): where reads go is
    `projector_first`, as for `open_source`, decided per query. It keeps one NATS connection
    open (a bus may appear or go away between queries, so not a `bus.session` per query) and,
    when no projector answers, opens the folder in this process and closes it again after
    `IDLE_CLOSE_S` idle seconds or as soon as a projector answers."""

    def __init__(self, settings: Settings, timeout: float = 30.0, *, name: str = "veribus-reader") -> None:
        self.settings = settings
        self.timeout = timeout
        self.name = name
        self._nc: Any = None
        self._store: Store | None = None
        self._store_used = 0.0
        self._lock = asyncio.Lock()
        self._closer: asyncio.Task[None] | None = None
        self.backend = "embedded (chdb)" if projector_first(settings) else "clickhouse server"

    async def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        reason = read_only_refusal(sql)
        if reason:
            raise QueryError(f"refused: {reason}")
        if projector_first(self.settings):
            nc = await self.connection()
            if nc is not None:
                res = await self._via_nats(nc, sql, params)
                if res is not None:
                    return res
        return await self._direct(sql, params)

    async def connection(self) -> Any:
        """The open NATS connection, (re)connected when needed; None when no server answers."""
        if self._nc is not None and self._nc.is_connected:
            return self._nc
        if not server_reachable(self.settings.nats_url):
            return None
        try:
            self._nc = await asyncio.wait_for(bus.connect(self.settings, name=self.name, **_READER_CONNECT),
                                              timeout=_CONNECT_WITHIN_S)
        except Exception:  # noqa: BLE001 - no server: read the folder directly
            self._nc = None
        return self._nc

    async def _via_nats(self, nc: Any, sql: str, params: dict[str, Any] | None) -> QueryResult | None:
        try:
            res = await ask_projector(nc, sql, params, self.timeout)
        except NoProjector:
            return None  # a bus without a projector: the folder is free
        except QueryError:
            raise
        except Exception as exc:  # the connection dropped: reconnect on the next query
            self._nc = None
            raise QueryError(f"NATS request to the projector failed: {type(exc).__name__}: {exc}") from exc
        if self._store is not None:
            await self._close_store()  # a projector appeared: let go of the folder
        return res

    async def _direct(self, sql: str, params: dict[str, Any] | None) -> QueryResult:
        async with self._lock:
            if self._store is None:
                self._store = await asyncio.to_thread(open_store, self.settings, projector_first(self.settings))
            store = self._store
            self._store_used = time.monotonic()
            try:
                return await asyncio.to_thread(store_query, store, sql, params)
            finally:
                self._store_used = time.monotonic()
                if projector_first(self.settings) and self._closer is None:
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


class ResultFilter:
    """WHERE clause over `verification_results` for the loaders and exports (parameterised)."""

    def __init__(
        self, run_id: str | None = None, run_name: str | None = None, question_ids: Sequence[str] | None = None,
        answering_models: Sequence[str] | None = None, parsing_models: Sequence[str] | None = None,
        replicates: Sequence[int] | None = None, completed_only: bool = False,
    ) -> None:
        self.run_id, self.run_name = run_id, run_name
        self.question_ids = list(question_ids or [])
        self.answering_models = list(answering_models or [])
        self.parsing_models = list(parsing_models or [])
        self.replicates = list(replicates or [])
        self.completed_only = completed_only

    def sql(self) -> tuple[str, dict[str, Any]]:
        clauses: list[str] = []
        params: dict[str, Any] = {}
        if self.run_id:
            clauses.append("run_id = {f_run:String}")
            params["f_run"] = self.run_id
        if self.run_name:
            clauses.append("run_name = {f_run_name:String}")
            params["f_run_name"] = self.run_name
        if self.question_ids:
            clauses.append("question_id IN {f_q:Array(String)}")
            params["f_q"] = self.question_ids
        for col, key, models in (("answering", "f_am", self.answering_models), ("parsing", "f_pm", self.parsing_models)):
            if models:
                clauses.append(f"({col}_model IN {{{key}:Array(String)}} OR {col}_model_name IN {{{key}:Array(String)}})")
                params[key] = models
        if self.replicates:
            clauses.append("replicate IN {f_rep:Array(UInt32)}")
            params["f_rep"] = self.replicates
        if self.completed_only:
            clauses.append("completed_without_errors")
        return (" AND ".join(clauses) or "1"), params


def iter_pages(
    source: RowSource, columns: str, where: ResultFilter | None = None, *, page_size: int = 1000,
    limit: int | None = None, table: str = "verification_results",
) -> Iterator[QueryResult]:
    """Keyset-paged reads of `table FINAL` in (run_id, result_id) order: each page is one bounded
    query, so memory stays flat however many rows match. The page shrinks when the projector
    says a reply would exceed the NATS payload limit."""
    where = where or ResultFilter()
    cond, params = where.sql()
    # one run: the key's second column alone orders the rows (a predicate the primary key serves)
    key_pred = " AND result_id > {k_id:String}" if where.run_id else \
        " AND (run_id, result_id) > ({k_run:String}, {k_id:String})"
    after_run, after_id = "", ""
    first = True
    fetched = 0
    size = max(1, page_size)
    while limit is None or fetched < limit:
        n = size if limit is None else min(size, limit - fetched)
        keyset = "" if first else key_pred
        sql = (f"SELECT run_id, result_id, {columns} FROM {table} FINAL WHERE {cond}{keyset} "
               f"ORDER BY run_id, result_id LIMIT {int(n)}")
        p = dict(params)
        if not first:
            p["k_id"] = after_id
            if not where.run_id:
                p["k_run"] = after_run
        try:
            page = source.query(sql, p)
        except QueryError as exc:
            if RESULT_TOO_LARGE in str(exc) and n > 1:
                size = max(1, n // 4)
                continue
            raise
        if not page.rows:
            return
        yield page
        fetched += len(page.rows)
        after_run, after_id = str(page.rows[-1][0]), str(page.rows[-1][1])
        first = False
        if len(page.rows) < n:
            return


def iter_result_json(source: RowSource, where: ResultFilter | None = None, *, page_size: int = 500,
                     limit: int | None = None) -> Iterator[tuple[str, str]]:
    """(run_id, result_json) of every matching row, streamed page by page."""
    for page in iter_pages(source, "result_json", where, page_size=page_size, limit=limit):
        for row in page.rows:
            blob = row[2]
            yield str(row[0]), blob.decode() if isinstance(blob, bytes | bytearray) else str(blob)


def resolve_run(source: RowSource, run: str) -> str:
    """A run id, or the latest run with that run name -> the run id (ValueError when none)."""
    res = source.query(
        "SELECT run_id FROM (SELECT run_id, requested_at AS at FROM runs FINAL WHERE run_id = {r:String} "
        "OR run_name = {r:String} UNION ALL SELECT run_id, max(ingested_at) AS at FROM verification_results "
        "FINAL WHERE run_id = {r:String} OR run_name = {r:String} GROUP BY run_id) ORDER BY (run_id = {r:String}) DESC, "
        "at DESC LIMIT 1", {"r": run})
    if not res.rows:
        raise ValueError(f"no run with id or name {run!r} in the store")
    return str(res.rows[0][0])
