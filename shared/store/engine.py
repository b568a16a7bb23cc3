"""Store port: the ClickHouse tables behind one small interface, for two backends.

- server: `clickhouse-connect` to a ClickHouse server (`Settings.clickhouse_url`);
- embedded: chdb in-process, persisted to `Settings.chdb_path`, through the same
  clickhouse-connect client API (`get_client(dsn="chdb:///abs/path")`, checked with chdb 4.4).

A chdb folder opens in one process only (the projector owns it). All calls are blocking: async
callers wrap them in `asyncio.to_thread`. The rows written come from `shared.store.rows`; what a
read-only query may run is decided in `shared.store.sql_guard`.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import queue
import secrets
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from infra.clickhouse import TABLES, VIEWS, check_identifier, statements
from shared.core.config import Settings
from shared.core.events import (
    Envelope,
    RunRequested,
)
from shared.store import arrow
from shared.store.rows import (
    CONTENT_COLUMNS,
    EVENT_COLUMNS,
    RESULT_COLUMNS,
    RUN_COLUMNS,
    Projection,
    event_row,
    run_row,
)
from shared.store.sql_guard import (
    RESULT_TOO_LARGE,
    ReadOnlyError,
    ResultTooLarge,
    engine_check,
    read_only_refusal,
    reader_settings,
    statement_word,
    table_functions,
)

if TYPE_CHECKING:
    import pandas as pd


log = logging.getLogger("veribus.store")


# --------------------------------------------------------------------------------------------
# Store
# --------------------------------------------------------------------------------------------


@dataclass
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]
    types: list[str] = field(default_factory=list)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=False)) for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)


_chdb_lock = threading.Lock()
RESULT_JSON = msgspec.json.Encoder(enc_hook=str)  # a result as JSON: what a query's byte budget counts, and the projector's reply


_result_values = operator.itemgetter(*RESULT_COLUMNS)  # a result row dict -> its values in column order (in C)


# (table, its columns, the Projection attribute holding its rows), in insert order: contents and
# runs before results (a reader that sees a result always finds its run, even when the writer dies
# between two inserts), events last
INSERT_ORDER: tuple[tuple[str, Sequence[str], str], ...] = (
    ("contents", CONTENT_COLUMNS, "contents"), ("runs", RUN_COLUMNS, "runs"),
    ("verification_results", RESULT_COLUMNS, "results"), ("events", EVENT_COLUMNS, "events"))


def projection_columns(p: Projection) -> list[tuple[str, Sequence[str], list[Sequence[Any]]]]:
    """(table, column names, columns) of a projection's rows, in `INSERT_ORDER` (the store's
    inserts and the rebuild's workers share this)."""
    return [(table, names, list(zip(*rows, strict=True)))
            for table, names, attr in INSERT_ORDER if (rows := getattr(p, attr))]


NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}  # how JSON carries what it has no number for


def _non_finite_as_text(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    return v


def json_safe_rows(rows: Sequence[Sequence[Any]]) -> Sequence[Sequence[Any]]:
    """Rows with inf, -inf and nan as the strings "inf", "-inf", "nan": JSON has no number for
    them, and the encoder wrote null, so `SELECT 1/0` read as NULL. The rows as they are when
    they hold none (the common case costs one scan)."""
    if not any(isinstance(v, float) and not math.isfinite(v) for row in rows for v in row):
        return rows
    return [[_non_finite_as_text(v) for v in row] for row in rows]


def query_error_text(exc: BaseException) -> str:
    """What a failed query says to whoever asked: ClickHouse's own message ("Code: 47. DB::Exception:
    Unknown expression identifier ...") as it is, since the client's exception class
    (`StreamFailureError`, `DatabaseError`) names nothing the user wrote; any other failure with its
    type, which is then the useful part."""
    text = str(exc)
    if text.startswith("Code: ") or "DB::Exception" in text:
        return text
    return f"{type(exc).__name__}: {text}"


def preload_chdb() -> None:
    """Import chdb once, early, in the calling (main) thread: the import is slow (~0.3 s, ~226 MB)
    and may change the working directory, so it must not happen lazily inside a worker thread."""
    with _chdb_lock:
        cwd = os.getcwd()
        import chdb  # noqa: F401 - local import: heavy (~0.3 s, ~226 MB), only the embedded engine

        if os.getcwd() != cwd:
            os.chdir(cwd)


class Store:
    """The veribus tables over one clickhouse-connect client (server or chdb)."""

    def __init__(self, client: Any, database: str, backend: str, reader: Any | None = None) -> None:
        self.client = client
        self.database = check_identifier(database)
        self.backend = backend
        self._reader = reader
        self._reader_factory: Any = None
        conf = Settings.from_env("query_concurrency", "query_result_mb")
        self.reader_pool_size = conf.query_concurrency
        self.max_result_bytes = conf.query_result_mb * 2**20
        self._pool_lock = threading.Lock()
        self._idle: queue.Queue[Any] = queue.Queue()
        self._made = 0
        self._arrow_types: dict[str, dict[str, Any]] = {}
        self._table_functions: frozenset[str] | None = None

    # ---- schema ----
    def migrate(self) -> None:
        """Create the database, tables and views if missing (idempotent; views are replaced)."""
        self._arrow_types.clear()
        self.client.command(f"CREATE DATABASE IF NOT EXISTS {self.database}")
        for stmt in statements(self.database):
            self.client.command(stmt)

    def drop_all(self) -> None:
        """Drop every veribus table and view (projections rebuild refolds them from the stream)."""
        self._arrow_types.clear()
        for name in reversed(VIEWS):
            self.client.command(f"DROP VIEW IF EXISTS {self.database}.{name}")
        for name in TABLES:
            self.client.command(f"DROP TABLE IF EXISTS {self.database}.{name}")

    # ---- writes ----
    def column_types(self, table: str) -> dict[str, str]:
        """The ClickHouse type of each column of `table` (what its Arrow types are made from)."""
        rows = self.client.query(f"DESCRIBE TABLE {self.database}.{check_identifier(table)}").result_rows
        return {r[0]: r[1] for r in rows}

    def _types_of(self, table: str) -> dict[str, Any]:
        types = self._arrow_types.get(table)
        if types is None:
            types = self._arrow_types[table] = arrow.arrow_types(self.column_types(table))
        return types

    def _insert(self, table: str, column_names: Sequence[str], columns: Sequence[Sequence[Any]]) -> None:
        """Insert columns of values (`shared.store.arrow`); what Arrow cannot type or the engine
        does not take from it goes in by clickhouse-connect's Native insert instead, so a row is
        never lost to the format (inserts are idempotent: the tables replace by key)."""
        block = arrow.block_or_none(self._types_of, table, column_names, columns)
        self.insert_block(table, column_names, columns, block)

    def insert_block(self, table: str, column_names: Sequence[str], columns: Sequence[Sequence[Any]] | None,
                     block: Any | None, settings: Mapping[str, Any] | None = None) -> None:
        """Insert `columns`, given as the Arrow `block` made from them when there is one (a
        table, or an IPC stream as bytes or `arrow.IpcStream`, as the rebuild's worker processes
        make them); Native insert when there is none or the engine refuses it (with no
        `columns` to fall back on, the refusal is raised)."""
        if block is not None:
            try:
                if isinstance(block, bytes | arrow.IpcStream):  # Arrow data as the engine reads it, made elsewhere
                    if isinstance(block, arrow.IpcStream) and self.backend != "chdb":
                        block = bytes(block)  # a server's HTTP body: one buffer (chdb writes the pieces to its file)
                    self.client.raw_insert(f"{self.database}.{table}", column_names, block,
                                           settings=dict(settings or {}), fmt="ArrowStream")
                else:
                    self.client.insert_arrow(f"{self.database}.{table}", block, settings=dict(settings or {}))
                return
            except Exception as exc:  # noqa: BLE001 - any Arrow problem: the slower, general insert
                if columns is None:
                    raise
                log.debug("Arrow insert into %s refused (%s); inserting natively", table, exc)
        assert columns is not None, "a block or its columns"
        self.client.insert(f"{self.database}.{table}", list(zip(*columns, strict=True)), column_names=column_names,
                           settings=dict(settings or {}))

    def insert_event_rows(self, rows: Sequence[Sequence[Any]]) -> None:
        if rows:
            self._insert("events", EVENT_COLUMNS, list(zip(*rows, strict=True)))

    def insert_events(self, envs: Iterable[Envelope]) -> int:
        rows = [event_row(e) for e in envs]
        self.insert_event_rows(rows)
        return len(rows)

    def insert_results(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert `result_to_row` dicts (many per call)."""
        if rows:
            self._insert("verification_results", RESULT_COLUMNS, list(zip(*map(_result_values, rows), strict=True)))

    def insert_runs(self, runs: Sequence[RunRequested | Mapping[str, Any] | Sequence[Any]]) -> None:
        """Insert runs: RunRequested payloads (or dicts of one), or ready `run_row` lists."""
        rows = [r if isinstance(r, list | tuple) else run_row(r) for r in runs]
        if rows:
            self._insert("runs", RUN_COLUMNS, list(zip(*rows, strict=True)))

    def insert_contents(self, rows: Sequence[Sequence[Any]]) -> None:
        """Insert job contents (CONTENT_COLUMNS order: key, kind, run_id, body)."""
        if rows:
            self._insert("contents", CONTENT_COLUMNS, list(zip(*rows, strict=True)))

    def existing_contents(self, keys: Sequence[str]) -> set[str]:
        """Which of these content keys the `contents` table already has."""
        if not keys:
            return set()
        res = self.query(f"SELECT DISTINCT key FROM {self.database}.contents WHERE key IN {{k:Array(String)}}",
                         {"k": list(keys)})
        return {str(r[0]) for r in res.rows}

    def insert_projection(self, p: Projection) -> None:
        """Contents, runs and results first, events last; all idempotent, so a retry after a
        partial failure converges."""
        for table, column_names, columns in projection_columns(p):
            self._insert(table, column_names, columns)

    # ---- reads ----
    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
        """Run any query on the writer client (trusted callers: the services and tests)."""
        return self._query(self.client, sql, params)

    def query_read_only(self, sql: str, params: Mapping[str, Any] | None = None,
                        max_bytes: int | None = None) -> QueryResult:
        """Run an untrusted query: the engine parses it and `shared.sql_guard` refuses file,
        network and program access; on chdb it runs on one of a pool of read-only handles
        (`readonly = 1`, time/memory/thread limits), so a heavy query holds only its own handle.
        The result is read a block at a time and stops with `ResultTooLarge` once its JSON passes
        `max_bytes` (default `Settings.query_result_mb`): chdb does not enforce
        `max_result_bytes`, and a whole result turned into Python rows weighs several times its bytes."""
        reason = read_only_refusal(sql)
        if reason:
            raise ReadOnlyError(f"refused: {reason}")
        reader = self._acquire_reader()
        in_step = True
        try:
            def run(q: str, p: Mapping[str, Any] | None) -> list[tuple[Any, ...]]:
                return self._query(reader, q, p).rows

            if self._table_functions is None:
                self._table_functions = table_functions(lambda q: run(q, None))
            reason, canonical = engine_check(run, sql, params, self._table_functions)
            if reason:
                raise ReadOnlyError(f"refused: {reason}")
            return self._query_bounded(reader, canonical, params, max_bytes or self.max_result_bytes)
        except BaseException as exc:
            # a refusal ran nothing on the handle; a failure, or a stream closed early (too large),
            # may have left rows there
            if not isinstance(exc, ReadOnlyError) or isinstance(exc, ResultTooLarge):
                in_step = self._in_step(reader)
            raise
        finally:
            if in_step:
                self._release_reader(reader)
            else:
                self._discard_reader(reader)

    def _in_step(self, reader: Any) -> bool:
        """Whether a handle whose query failed answers its next query with that query's rows.
        On chdb a result stopped by a limit (`max_result_rows`) leaves its unread blocks on the
        handle, and the next query read them as its own result: another client's query, or the
        guard's own re-write of the next SQL (`formatQuerySingleLine`), got rows the failed query
        chose. A token only this check knows must come back, or the handle is not used again."""
        token = "veribus-in-step-" + secrets.token_hex(8)
        for _ in range(3):
            try:
                if self._query(reader, f"SELECT '{token}'", None).rows == [(token,)]:
                    return True
            except Exception:  # noqa: BLE001 - leftovers of the failed query: read on
                continue
        return False

    def _discard_reader(self, reader: Any) -> None:
        """Close a handle that is out of step; the pool makes a new one when it needs it."""
        if self._reader_factory is None:
            return  # the store's own client (a server, or tests): nothing else to use
        with self._pool_lock:
            self._made -= 1
        try:
            reader.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            log.warning("closing an out-of-step read-only handle failed", exc_info=True)

    def _acquire_reader(self) -> Any:
        """A read-only handle for one query: an idle one, a new one while under the pool size,
        else wait for one to come back."""
        if self._reader_factory is None:
            return self.reader()
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._pool_lock:
            make = self._made < self.reader_pool_size
            if make:
                self._made += 1
        if not make:
            return self._idle.get()
        try:
            return self._reader_factory()
        except BaseException:
            with self._pool_lock:
                self._made -= 1
            raise

    def _release_reader(self, reader: Any) -> None:
        if self._reader_factory is not None:
            self._idle.put(reader)

    def query_df(self, sql: str, params: Mapping[str, Any] | None = None) -> pd.DataFrame:
        return self.client.query_df(sql, parameters=dict(params) if params else None)

    def _query(self, client: Any, sql: str, params: Mapping[str, Any] | None) -> QueryResult:
        res = client.query(sql, parameters=dict(params) if params else None)
        return QueryResult(
            columns=list(res.column_names),
            rows=[tuple(r) for r in res.result_rows],
            types=[t.name for t in res.column_types],
        )

    def _query_bounded(self, client: Any, sql: str, params: Mapping[str, Any] | None,
                       max_bytes: int) -> QueryResult:
        """`_query`, streamed: each block's JSON is counted before its rows are kept. chdb
        streams SELECTs only; SHOW, DESCRIBE, EXPLAIN and EXISTS (metadata, a few rows) are read
        whole and measured after."""
        def too_large(within: str) -> ResultTooLarge:
            return ResultTooLarge(f"{RESULT_TOO_LARGE}: it passed {max_bytes:,} bytes of JSON{within} and was "
                                  "stopped: add a LIMIT or aggregate")

        if statement_word(sql) not in ("SELECT", "WITH"):
            res = self._query(client, sql, params)
            if len(RESULT_JSON.encode(res.rows)) > max_bytes:
                raise too_large("")
            return res
        rows: list[tuple[Any, ...]] = []
        size = 0
        with client.query_row_block_stream(sql, parameters=dict(params) if params else None) as stream:
            columns = list(stream.source.column_names)
            types = [t.name for t in stream.source.column_types]
            for block in stream:
                size += len(RESULT_JSON.encode(block))
                if size > max_bytes:
                    raise too_large(f" within its first {len(rows) + len(block):,} rows")
                rows.extend(tuple(r) for r in block)
        return QueryResult(columns=columns, rows=rows, types=types)

    def reader(self) -> Any:
        if self._reader is None:
            self._reader = self._reader_factory() if self._reader_factory else self.client
        return self._reader

    def count(self, table: str, where: str = "", params: Mapping[str, Any] | None = None) -> int:
        """Rows of a table under FINAL (what analysts see), for tests and status checks."""
        check_identifier(table)
        sql = f"SELECT count() FROM {self.database}.{table} FINAL" + (f" WHERE {where}" if where else "")
        return int(self.query(sql, params).rows[0][0])

    def close(self) -> None:
        """Close the clients; on chdb this frees the folder lock for another process."""
        clients = [self.client] if self._reader in (None, self.client) else [self._reader, self.client]
        while not self._idle.empty():
            clients.insert(0, self._idle.get_nowait())
        for c in clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self._reader = None


def folder_held_elsewhere(path: Path) -> bool:
    """Whether a chdb folder's lock (ClickHouse's `flock` on `<folder>/status`) is held, by
    another process or another open file of this one."""
    import fcntl  # local import: POSIX only, and only asked after an open failed

    try:
        fd = os.open(path / "status", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def flock_holders(path: Path) -> set[int]:
    """The PIDs `/proc/locks` names as holding a lock on `path` (Linux; empty when it cannot
    tell: no such file, no /proc, or a filesystem whose device numbers it shows differently)."""
    try:
        st = os.stat(path)
        text = Path("/proc/locks").read_text()
    except OSError:
        return set()
    # "1: FLOCK  ADVISORY  WRITE 7564 fe:00:2146433 0 EOF"; a waiting lock's line has "->" after its number
    node = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] != "->" and parts[5] == node and parts[4].isdigit():
            holders.add(int(parts[4]))
    return holders


class FolderHeld(RuntimeError):
    """The chdb folder is open in another process (one process per folder); `holders`: the
    PIDs the lock names, when it can tell."""

    def __init__(self, message: str, path: Path, holders: set[int] | frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.path = path
        self.holders = frozenset(holders)


def _held_message(path: Path) -> str:
    return (f"the chdb folder {path} is open in another process (one process per folder: the stack's projector, "
            "a `veribus view` reading it (it lets go after a few idle seconds), or another command); query "
            "through the running stack, or try again when it is free")


def _chdb_client(path: Path, database: str | None = None) -> Any:
    import clickhouse_connect  # local import: ~0.2 s, only a store connection needs it

    return clickhouse_connect.get_client(dsn=f"chdb://{path}", database=database)


def open_store(settings: Settings, migrate: bool = True) -> Store:
    """Open the store `settings` points at: a ClickHouse server when `clickhouse_url` is set, else
    the embedded chdb folder `settings.chdb_path` (one process per folder)."""
    import clickhouse_connect  # local import: ~0.2 s, only a store connection needs it

    db = check_identifier(settings.clickhouse_database)
    if settings.clickhouse_url:
        # no session id: concurrent queries on one HTTP session are refused by the server
        client = clickhouse_connect.get_client(dsn=settings.clickhouse_url, autogenerate_session_id=False)
        if migrate:  # a read-only analyst account cannot create; it only reads
            client.command(f"CREATE DATABASE IF NOT EXISTS {db}")
        client.database = db
        store = Store(client, db, "server")
        url = settings.clickhouse_url

        def make_server_reader() -> Any:
            # untrusted SQL (the projector's query subject, the viewer) on its own client: every
            # request carries readonly = 2 (reads, and settings changes, which the guard refuses
            # in the SQL itself; no writes, no DDL) and the query limits. An account the server
            # already holds read-only keeps its own profile: clickhouse-connect drops a setting
            # the account may not change (with a warning) instead of failing the query.
            return clickhouse_connect.get_client(dsn=url, autogenerate_session_id=False, database=db,
                                                 settings={"readonly": 2, **reader_settings()})

        store._reader_factory = make_server_reader
    else:
        preload_chdb()
        path = Path(settings.chdb_path).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        holders = flock_holders(path / "status")
        if holders and os.getpid() not in holders:  # asked first: chdb would print its own line on stderr
            raise FolderHeld(_held_message(path), path, holders)
        try:
            client = _chdb_client(path)
        except Exception as exc:
            # chdb prints "Cannot lock file .../status" on stderr and raises "Error initializing
            # EmbeddedServer: . (BAD_ARGUMENTS)": the lock itself says whether another process has it
            if "lock" in str(exc).lower() or folder_held_elsewhere(path):
                raise FolderHeld(_held_message(path), path, flock_holders(path / "status")) from exc
            raise
        client.command(f"CREATE DATABASE IF NOT EXISTS {db}")
        client.database = db
        store = Store(client, db, "chdb")

        def make_reader() -> Any:
            reader = _chdb_client(path, db)
            for name, value in reader_settings().items():
                reader.command(f"SET {name} = {value!r}")
            reader.command("SET readonly = 1")
            return reader

        store._reader_factory = make_reader
    if migrate:
        store.migrate()
    return store
