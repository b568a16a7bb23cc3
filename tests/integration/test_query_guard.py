"""Issue 10, item 4 (real chdb engine): the query endpoint cannot read files, reach the network
or run programs whatever the SQL, and a heavy query holds only its own handle.

The attacks are sent the way an analyst's SQL arrives (`Store.query_read_only`, what the
projector runs for `veribus query`), and each engine-level refusal is also checked on its own,
without the regex pre-filter, since that filter is exactly what `$$...$$` fooled.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.core.config import Settings
from shared.store.engine import Store, open_store
from shared.store.sql_guard import ReadOnlyError, ResultTooLarge, engine_check, read_only_refusal


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    os.environ["VERIBUS_QUERY_TIMEOUT_S"] = "20"
    st = open_store(Settings(home=tmp_path_factory.mktemp("qguard")))
    try:
        yield st
    finally:
        st.close()
        os.environ.pop("VERIBUS_QUERY_TIMEOUT_S", None)


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("secret") / "root-only.txt"
    p.write_text("TOP-SECRET-" + os.urandom(8).hex())
    p.chmod(0o600)
    return p


def _engine_only(store: Store, sql: str) -> str | None:
    reader = store._acquire_reader()
    try:
        reason, _ = engine_check(lambda q, p: store._query(reader, q, p).rows, sql, None,
                                 store._table_functions or frozenset())
        return reason
    finally:
        store._release_reader(reader)


def test_dollar_string_bypass_is_refused_by_the_engine_parser(store: Store, secret_file: Path) -> None:
    sql = f"SELECT $$'$$ AS a, file('{secret_file}') AS b, 'x' AS c"
    assert read_only_refusal(sql) is None  # the regex layer is fooled, as in the issue ...
    reason = _engine_only(store, sql)  # ... the engine's parser is not
    assert reason is not None and "file()" in reason
    with pytest.raises(ReadOnlyError) as ei:
        store.query_read_only(sql)
    assert secret_file.read_text() not in str(ei.value)


@pytest.mark.parametrize("sql", [
    "SELECT $$'$$ AS a, FILE('{f}') AS b, 'x' AS c",
    "SELECT $$'$$ AS a, `file`('{f}') AS b, 'x' AS c",
    "SELECT $$'$$ AS a, arrayMap(x -> file(x), ['{f}']) AS b, 'x' AS c",
    "SELECT $$'$$ AS a, (SELECT file('{f}')) AS b, 'x' AS c",
    "SELECT $$'$$ AS a, * FROM file('{f}', 'LineAsString')",
    "SELECT $$'$$ AS a, * FROM url('http://127.0.0.1:9/x', 'LineAsString')",
    "SELECT $$'$$ AS a, * FROM executable('id', 'LineAsString', 'x String')",
    "SELECT $$'$$ AS a, * FROM remote('127.0.0.1:9000', system.one)",
    "SELECT $$'$$ AS a, * FROM system.processes",
    "SELECT $$'$$ AS a INTO OUTFILE '{out}'",
    "SELECT $$'$$ AS a UNION ALL SELECT 'b' INTO OUTFILE '{out}'",
    "DESCRIBE TABLE runs INTO OUTFILE '{out}'",
    "SHOW TABLES INTO OUTFILE '{out}'",
    "SELECT $$'$$ AS a; SELECT file('{f}'); SELECT 'x'",
    "SELECT $$'$$ AS a; DROP TABLE runs; SELECT 'x'",
    "SELECT $$'$$ AS a SETTINGS readonly = 0",
    "SELECT * FROM merge('system', '^processes$')",
    "SELECT name, value FROM merge('system', '^server_settings$') WHERE name = 'path'",
    "SELECT * FROM merge(REGEXP('^sys'), '^disks$')",
])
def test_attacks_refused_at_the_engine(store: Store, secret_file: Path, tmp_path: Path, sql: str) -> None:
    out = tmp_path / "written.txt"
    sql = sql.format(f=secret_file, out=out)
    assert _engine_only(store, sql) is not None
    with pytest.raises(ReadOnlyError):
        store.query_read_only(sql)
    assert not out.exists()
    assert store.count("runs") == 0 or store.query("EXISTS TABLE runs").rows[0][0] == 1


def _chars(text: str) -> str:
    """`text` as SQL without a quote: char(47, 116, ...)."""
    return "char(" + ", ".join(str(ord(c)) for c in text) + ")"


@pytest.mark.parametrize("sql", ["SELECT '%(x)s' AS a", "SELECT 1 AS n, '%(x)s' AS a"])
def test_parameters_cannot_add_statements_to_the_checked_query(store: Store, secret_file: Path, sql: str) -> None:
    """A query over the endpoint comes with its parameters (`{"sql": ..., "params": {...}}`). Without a
    `{name:Type}` placeholder clickhouse-connect formats them into the text (`%(x)s`) after the guard read
    it, and chdb runs every statement: the value closes the literal and adds a `SELECT file(...)` (no
    quote needed), which read any file the projector can (the credentials file holds the admin password)."""
    params = {"x": f" AS a; SELECT file({_chars(str(secret_file))}) AS b; SELECT "}
    with pytest.raises(ReadOnlyError) as ei:  # before: rows ('',), (the file,), ('',)
        store.query_read_only(sql, params)
    assert "placeholder" in str(ei.value) and secret_file.read_text() not in str(ei.value)
    # a write smuggled the same way is refused too, and the tables are untouched
    with pytest.raises(ReadOnlyError):
        store.query_read_only(sql, {"x": " AS a; DROP TABLE runs; SELECT "})
    assert store.query("EXISTS TABLE runs").rows[0][0] == 1


def test_ordinary_queries_still_work(store: Store) -> None:
    assert store.query_read_only("SELECT count() FROM verification_results FINAL").rows == [(0,)]
    assert store.query_read_only("SELECT $$it's$$ AS s").rows == [("it's",)]
    assert store.query_read_only("SELECT {r:String} AS r", {"r": "x'y"}).rows == [("x'y",)]
    assert store.query_read_only("SELECT sum(number) FROM numbers(10)").rows == [(45,)]
    assert ("runs",) in store.query_read_only("SHOW TABLES").rows
    assert store.query_read_only("SHOW TABLES LIKE '%run%'").rows
    assert store.query_read_only("SELECT number FROM numbers(10) ORDER BY number DESC LIMIT 2 OFFSET 1").rows == [
        (8,), (7,)]
    assert store.query_read_only("SELECT run_id FROM runs FINAL WHERE run_id = {r:String} LIMIT 20",
                                 {"r": "x"}).rows == []


def test_heavy_query_is_bounded_and_does_not_block_others(store: Store) -> None:
    """numbers(1e11) runs on its own read-only handle: while it still runs, another query
    answers; it then ends with the engine's time limit, not after it finishes counting."""
    outcome: dict[str, BaseException | None] = {}
    started = threading.Event()

    def heavy() -> None:
        started.set()
        try:
            store.query_read_only("SELECT count() FROM numbers(100000000000) WHERE sipHash64(number) = 1")
            outcome["err"] = None
        except BaseException as exc:  # noqa: BLE001
            outcome["err"] = exc

    t = threading.Thread(target=heavy)
    t.start()
    started.wait(10)
    # the light query asks only once the engine is running the heavy one
    running = "SELECT count() FROM system.processes WHERE query LIKE '%sipHash64(number) = 1%' AND query NOT LIKE '%system.processes%'"
    while t.is_alive() and store.query(running).rows[0][0] == 0:
        started.wait(0.05)
    assert t.is_alive()
    light = store.query_read_only("SELECT count() FROM runs FINAL").rows
    still_running = t.is_alive()
    t.join(120)
    assert light == [(0,)]
    assert still_running, "the light query waited for the heavy one"
    assert not t.is_alive() and outcome["err"] is not None and "TIMEOUT" in str(outcome["err"]).upper()


def test_a_huge_result_stops_at_its_byte_budget_and_every_handle_stays_in_step(store: Store) -> None:
    """~300 MB of rows (chdb ignores `max_result_bytes`): the read stops within its first block
    of 8,192 rows instead of turning the whole result into Python rows, and the handle it was
    streamed on answers the next queries with their own rows, not the stopped one's leftovers."""
    with pytest.raises(ResultTooLarge, match=r"^result too large: it passed 1,048,576 bytes of JSON within its first 8,192 rows"):
        store.query_read_only("SELECT repeat('x', 1000) AS s FROM numbers(300000)", max_bytes=2**20)
    for i in range(store.reader_pool_size + 1):
        assert store.query_read_only("SELECT {i:UInt32} AS i", {"i": i}).rows == [(i,)]
    # under the budget the whole result comes back, with its columns and types
    res = store.query_read_only("SELECT number AS n, toString(number) AS s FROM numbers(20000)", max_bytes=2**20)
    assert len(res.rows) == 20000 and res.rows[-1] == (19999, "19999") and res.types == ["UInt64", "String"]
    # the default budget is the store's (`VERIBUS_QUERY_RESULT_MB`, 64 MB)
    assert store.max_result_bytes == 64 * 2**20
    with pytest.raises(ResultTooLarge, match="67,108,864 bytes"):
        store.query_read_only("SELECT repeat('x', 1000) AS s FROM numbers(300000)")
