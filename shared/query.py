"""Read-only SQL over the veribus tables, wherever they are.

- ClickHouse server (`Settings.clickhouse_url`): connect directly.
- Embedded chdb: the folder belongs to the running projector, so ask it over NATS
  (`QUERY_SUBJECT`); when nothing answers (no stack running), open the folder directly.

Every path refuses SQL that is not read-only (`shared.store.is_read_only_sql`).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import threading
from collections.abc import Mapping
from typing import Any

import msgspec

from shared.bus import connect_options, server_reachable
from shared.config import Settings
from shared.events import QUERY_SUBJECT
from shared.sql_guard import reader_settings
from shared.store import QueryResult, ReadOnlyError, open_store, read_only_refusal


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
    import nats
    from nats.errors import NoRespondersError, NoServersError
    from nats.errors import TimeoutError as NatsTimeout

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
    settings: Settings, sql: str, params: Mapping[str, Any] | None = None, timeout: float | None = None
) -> QueryResult:
    """Run one read-only query against the configured store (see module docstring)."""
    reason = read_only_refusal(sql)
    if reason:
        raise QueryError(f"refused: {reason}")
    if settings.clickhouse_url:
        return query_direct(settings, sql, params)
    if timeout is None:  # the engine's own limit, plus time to answer
        timeout = float(reader_settings()["max_execution_time"]) + 5.0
    try:
        return _run_coro(query_via_nats(settings, sql, params, timeout))
    except NoProjector:
        return query_direct(settings, sql, params)


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
