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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import nats
from nats.errors import NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeout

from shared.core.config import Settings
from shared.core.events import QUERY_SUBJECT
from shared.runtime.bus import connect_options, server_reachable
from shared.store.engine import QueryResult, Store, open_store
from shared.store.sql_guard import ReadOnlyError, read_only_refusal


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


async def query_via_nats(
    settings: Settings, sql: str, params: Mapping[str, Any] | None = None, timeout: float = 10.0
) -> QueryResult:
    """Ask the projector. Raises NoProjector when no server or no subscriber is there."""
    if not server_reachable(settings.nats_url):
        raise NoProjector(f"no NATS server at {settings.nats_url}")
    opts = connect_options(settings)
    opts.update(name="veribus-query", connect_timeout=2, allow_reconnect=False,
                max_reconnect_attempts=1, reconnect_time_wait=0.1)
    try:
        nc = await asyncio.wait_for(nats.connect(**opts), timeout=5)
    except (TimeoutError, NoServersError, OSError, NatsTimeout) as exc:
        raise NoProjector(f"no NATS server at {settings.nats_url}: {exc}") from exc
    try:
        body = _enc.encode({"sql": sql, "params": dict(params) if params else None})
        try:
            msg = await nc.request(QUERY_SUBJECT, body, timeout=timeout)
        except NoRespondersError as exc:
            raise NoProjector("no projector is subscribed to the query subject") from exc
        except (TimeoutError, NatsTimeout) as exc:
            raise QueryError(f"the projector did not answer within {timeout} s") from exc
    finally:
        await nc.close()
    reply = _reply_dec.decode(msg.data)
    if reply.error is not None:
        raise QueryError(reply.error)
    return QueryResult(columns=reply.columns, rows=[tuple(r) for r in reply.rows], types=reply.types)


def query_direct(settings: Settings, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
    """Open the store in this process (server, or a chdb folder no other process holds)."""
    store = open_store(settings, migrate=not settings.clickhouse_url)
    try:
        return store.query_read_only(sql, params)
    except ReadOnlyError as exc:
        raise QueryError(str(exc)) from exc
    except Exception as exc:
        raise QueryError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        store.close()


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
    settings: Settings, sql: str, params: Mapping[str, Any] | None = None, timeout: float = 10
) -> QueryResult:
    """Run one read-only query against the configured store (see `open_source`)."""
    reason = read_only_refusal(sql)
    if reason:
        raise QueryError(f"refused: {reason}")
    with open_source(settings, timeout=timeout) as source:
        return source.query(sql, params)


# ---- formatting ----


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"
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
    """The rows as a JSON array of objects (column -> value)."""
    return msgspec.json.format(_enc.encode(result.as_dicts()), indent=2).decode()


class RowSource(Protocol):
    """Something that runs one read-only query: a store, or the projector over NATS."""

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult: ...


class StoreSource:
    """Reads through an open Store (its read-only handle)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
        try:
            return self.store.query_read_only(sql, params)
        except ReadOnlyError as exc:
            raise QueryError(str(exc)) from exc
        except Exception as exc:
            raise QueryError(f"{type(exc).__name__}: {exc}") from exc


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
    if not settings.clickhouse_url:
        try:
            _run_coro(query_via_nats(settings, "SELECT 1", None, 10.0))
        except NoProjector:
            pass
        else:
            yield NatsSource(settings, timeout)
            return
    store = open_store(settings, migrate=not settings.clickhouse_url)
    try:
        yield StoreSource(store)
    finally:
        store.close()


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
            if "too large" in str(exc) and n > 1:
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
