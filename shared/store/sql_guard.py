"""The read-only SQL guard: what a query over NATS or `veribus query` may run (reads only, no
file, network or program access). Two layers: a quick textual pre-filter (`read_only_refusal`),
then the engine's own parser (`engine_check`, below), which is the one that decides."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from shared.core.config import Settings

# --------------------------------------------------------------------------------------------
# Read-only SQL guard
# --------------------------------------------------------------------------------------------

_LITERALS_AND_COMMENTS = re.compile(
    r"'(?:[^'\\]|\\.|'')*'"  # string literal
    r'|"((?:[^"\\]|\\.|"")*)"'  # quoted identifier
    r"|`((?:[^`\\]|\\.|``)*)`"  # backquoted identifier
    r"|--[^\n]*|#[^\n]*"  # line comments
    r"|/\*.*?\*/",  # block comment
    re.S,
)
_READ_STARTS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS"})
_WRITE_WORDS = re.compile(
    r"\b(INSERT|ALTER|DROP|CREATE|SYSTEM|KILL|SET|SETTINGS|TRUNCATE|RENAME|OPTIMIZE|ATTACH|DETACH|"
    r"GRANT|REVOKE|DELETE|UPDATE|BACKUP|RESTORE|EXCHANGE|UNDROP|OUTFILE)\b",
    re.I,
)
# Functions / table functions that read or write files, reach the network or other databases, or
# run programs. `file()` is also a scalar function that reads a file, so match any call.
_FORBIDDEN_CALLS = re.compile(
    r"\b(file|fileCluster|url|urlCluster|s3|s3Cluster|gcs|cosn|oss|azureBlobStorage|azureBlobStorageCluster|"
    r"hdfs|hdfsCluster|remote|remoteSecure|cluster|clusterAllReplicas|mysql|postgresql|sqlite|mongodb|"
    r"redis|jdbc|odbc|executable|executablePool|input|python|arrowflight|iceberg\w*|deltaLake\w*|hudi\w*|"
    r"paimon\w*|ytsaurus|dictionary|dictGet\w*|loop|timeSeries\w*|prometheusQuery\w*|filesystem\w*|"
    r"readFile)\s*\(",
    re.I,
)


def strip_sql_literals(sql: str) -> str:
    """SQL with string literals emptied and comments removed, so keyword checks see code only.

    A quoted identifier becomes a neutral name, unless it names a forbidden function, which is
    kept so that `` `file`(...) `` still reads as a call (a column named `update` stays allowed).
    """

    def repl(m: re.Match[str]) -> str:
        tok = m.group(0)
        if tok[0] == "'":
            return "''"
        if tok[0] in "\"`":
            name = m.group(1) if tok[0] == '"' else m.group(2)
            return f" {name} " if _FORBIDDEN_CALLS.fullmatch(name + "(") else " quoted_ident "
        return " "

    return _LITERALS_AND_COMMENTS.sub(repl, sql)


_FIRST_WORD = re.compile(r"\(*\s*([A-Za-z]+)")


def statement_word(code: str) -> str:
    """The statement's first keyword, upper-cased, past opening parentheses ("" when none);
    `code` without comments (`strip_sql_literals`, or the engine's canonical form)."""
    first = _FIRST_WORD.match(code.lstrip())
    return first.group(1).upper() if first else ""


def read_only_refusal(sql: str) -> str | None:
    """Why `sql` is refused as a read-only query, or None when it is accepted."""
    code = strip_sql_literals(sql).strip()
    code = re.sub(r";\s*$", "", code).strip()
    if not code:
        return "empty query"
    if ";" in code:
        return "only one statement is allowed"
    word = statement_word(code)
    if word not in _READ_STARTS:
        return f"only SELECT/WITH/SHOW/DESCRIBE/EXPLAIN queries are allowed, not {word or code[:20]!r}"
    bad = _WRITE_WORDS.search(code)
    if bad and not (word == "SHOW" and bad.group(1).upper() == "CREATE"):
        return f"keyword {bad.group(1).upper()} is not allowed in a read-only query"
    call = _FORBIDDEN_CALLS.search(code)
    if call:
        return f"function {call.group(1)}() is not allowed in a read-only query"
    return None


def is_read_only_sql(sql: str) -> bool:
    """True for one SELECT/WITH/SHOW/DESCRIBE/EXPLAIN statement that cannot write or reach out."""
    return read_only_refusal(sql) is None


class ReadOnlyError(ValueError):
    pass


# --------------------------------------------------------------------------------------------
# The engine's own parser decides (issue 10)
# --------------------------------------------------------------------------------------------
# The query endpoint's guard, decided by the engine's own parser (`EXPLAIN AST`), not by
# regular expressions over the SQL text.
#
# Regular expressions cannot know what the engine treats as a string: `$$'$$` is a complete
# string to ClickHouse and the start of an unterminated one to a regex, so `SELECT $$'$$,
# file('/etc/passwd')` hid a file read from the old guard. Here the engine parses the statement
# and the guard walks its syntax tree:
#
# - the statement is a SELECT/WITH, SHOW, DESCRIBE, EXISTS or EXPLAIN;
# - no function that reads files, reaches the network or runs programs is called anywhere
#   (`file`, every table function but a few pure generators, `dictGet*`, `filesystem*`, ...),
#   whatever its spelling (`FILE`, backquotes, inside a lambda or subquery);
# - no `system.*` table but a few harmless ones (`system.processes` would show other queries).
#
# The query then runs on a reader with `readonly = 1` (no writes, no settings changes, and table
# functions that touch storage refused by the engine itself), one thread, and limits on time
# (`max_execution_time`), memory (`max_memory_usage`) and result size: `reader_settings`.


ALLOWED_ROOTS = frozenset({"SelectWithUnionQuery", "SelectQuery", "ShowTables", "ShowTablesQuery", "DescribeQuery",
                           "ShowCreateTableQuery", "ShowCreateViewQuery", "ExistsTableQuery", "ExistsViewQuery",
                           "Explain", "ShowColumns", "ShowDatabases", "ShowFunctions", "ShowSettings"})
# statement nodes whose direct Literal child is an INTO OUTFILE path (a LIMIT's literal hangs
# under SelectQuery, a SHOW ... LIKE pattern is not a child node)
OUTFILE_PARENTS = ALLOWED_ROOTS - {"SelectQuery"}
# pure generators: no storage, no network (readonly allows them; bounded by the query limits)
# (not `merge`: `merge('system', '^processes$')` reads any table, system ones included, named by a string)
SAFE_TABLE_FUNCTIONS = frozenset({"numbers", "numbers_mt", "zeros", "zeros_mt", "values", "generate_series",
                                  "generateseries", "null", "view", "primes", "sqlstandardvalues"})
DENIED_FUNCTIONS = frozenset({
    "file", "filecluster", "url", "urlcluster", "executable", "executablepool", "input", "python", "remote",
    "remotesecure", "cluster", "clusterallreplicas", "dictionary", "dictget", "joinget", "joingetornull",
    "filesystemavailable", "filesystemcapacity", "filesystemunreserved", "getserversetting", "getmacro",
    "currentrequesturl", "eval", "merge", "s3", "hdfs", "mysql", "postgresql", "sqlite", "mongodb", "redis", "jdbc", "odbc",
})
DENIED_PREFIXES = ("dictget", "joinget", "filesystem", "iceberg", "deltalake", "hudi", "paimon", "azure", "s3",
                   "timeseries", "prometheus", "mergetree", "fuzz")
ALLOWED_SYSTEM_TABLES = frozenset({"one", "numbers", "numbers_mt", "zeros", "zeros_mt", "tables", "columns",
                                   "functions", "table_functions", "data_type_families", "time_zones"})

# a bound parameter's name, and a placeholder the engine binds it to (clickhouse-connect's own
# pattern for one is a superset of this: where this finds one, it binds on the engine's side)
_PARAM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLACEHOLDER = re.compile(r"\{(\w+):[^}]+\}")

_NODE = re.compile(r"^\s*(\w+)(?: (.*?))?(?: \(alias [^)]*\))?(?: \(children \d+\))?$")


RESULT_TOO_LARGE = "result too large"  # how every such error starts, also across NATS (paging, exit codes)


class ResultTooLarge(ReadOnlyError):
    """A read-only query's result outgrew its byte budget; it was stopped, not truncated."""


def reader_settings() -> dict[str, Any]:
    """Session settings of a read-only query handle (set before `readonly = 1`), from
    `Settings.query_*` (`VERIBUS_QUERY_TIMEOUT_S`, `_MEMORY_MB`, `_THREADS`)."""
    conf = Settings.from_env("query_timeout_s", "query_memory_mb", "query_threads")
    return {
        "max_execution_time": conf.query_timeout_s,
        "timeout_overflow_mode": "throw",
        "max_memory_usage": conf.query_memory_mb * 2**20,
        "max_threads": conf.query_threads,
        "max_result_rows": 1_000_000,
        "max_result_bytes": 256 * 2**20,
        "max_block_size": 8192,  # the unit a result is read and measured in (`Store.query_read_only`)
        "max_bytes_before_external_group_by": 0,
    }


def table_functions(run: Callable[[str], list[tuple[Any, ...]]]) -> frozenset[str]:
    """Every table function the engine knows, lower-cased (so new ones are denied too)."""
    return frozenset(str(r[0]).lower() for r in run("SELECT name FROM system.table_functions"))


def refusal_from_ast(ast_lines: list[str], engine_table_functions: frozenset[str] = frozenset()) -> str | None:
    """Why the parsed statement is refused, from `EXPLAIN AST` output lines; None when allowed."""
    if not ast_lines:
        return "the engine returned no syntax tree"
    root = _NODE.match(ast_lines[0])
    kind = root.group(1) if root else ast_lines[0].split()[0]
    if kind not in ALLOWED_ROOTS:
        return f"only SELECT/WITH/SHOW/DESCRIBE/EXISTS/EXPLAIN queries are allowed, not {kind}"
    denied_tf = engine_table_functions - SAFE_TABLE_FUNCTIONS
    parents: list[tuple[int, str]] = []  # (indent, node kind) of the open ancestors
    for line in ast_lines:
        m = _NODE.match(line)
        if not m:
            continue
        indent = len(line) - len(line.lstrip(" "))
        while parents and parents[-1][0] >= indent:
            parents.pop()
        parent = parents[-1][1] if parents else ""
        node, arg = m.group(1), (m.group(2) or "").strip()
        parents.append((indent, node))
        if node == "Literal" and parent in OUTFILE_PARENTS:
            return "INTO OUTFILE is not allowed in a query (it writes a file)"
        if node == "Function":
            name = arg.split(" ", 1)[0].strip("`\"").lower()
            if name in DENIED_FUNCTIONS or name in denied_tf or name.startswith(DENIED_PREFIXES):
                return f"function {arg.split(' ', 1)[0]}() is not allowed in a query (it reads files, reaches " \
                       "the network or runs programs)"
        elif node in ("TableIdentifier", "Identifier"):
            name = arg.split(" ", 1)[0].strip("`\"")
            db, _, table = name.partition(".")
            if db.lower() == "system" and table and table.lower() not in ALLOWED_SYSTEM_TABLES:
                return f"table {name} is not readable through the query endpoint"
    return None


def params_refusal(canonical: str, params: Mapping[str, Any] | None) -> str | None:
    """Why `params` may not go with the statement `canonical`; None when they may.

    Parameters are bound by the engine, to `{name:Type}` placeholders, or not at all. A query
    without a placeholder has its parameters formatted into its text by clickhouse-connect
    (`%(name)s`, client side), after the guard has read that text: a value could then close a
    string literal of the checked statement and add statements of its own (chdb runs several,
    so `SELECT '%(x)s'` with `x = " AS a; SELECT file(...) AS b; SELECT "` read any file)."""
    if not params:
        return None
    if not isinstance(params, Mapping):
        return "query parameters must be an object of name -> value"
    for name, value in params.items():
        if not isinstance(name, str) or not _PARAM_NAME.fullmatch(name):
            return f"query parameter name {str(name)[:40]!r} is not a plain name ([A-Za-z_][A-Za-z0-9_]*)"
        if isinstance(value, bytes | bytearray | memoryview):
            return f"query parameter {name!r} is raw bytes"
    if not _PLACEHOLDER.search(canonical):
        return "query parameters are bound only to {name:Type} placeholders, and this query has none"
    return None


def _engine_message(exc: BaseException) -> str:
    text = str(exc).strip()
    m = re.search(r"DB::Exception: (.*?)(?: \(version [\d.]+\))?(?:\. \(\w+\))?$", text, re.S)
    return (m.group(1) if m else text)[:500]


def engine_check(run: Callable[[str, Mapping[str, Any] | None], list[tuple[Any, ...]]], sql: str,
                 params: Mapping[str, Any] | None, engine_table_functions: frozenset[str]) -> tuple[str | None, str]:
    """(why `sql` is refused or None, the statement to run).

    `run` executes a statement on a read-only handle and returns its rows. The engine first
    re-writes the SQL, passed as a bound parameter so it is never executed, as exactly one
    statement (`formatQuerySingleLine`: several statements are a syntax error); the guard
    then reads that statement's syntax tree, and only that canonical text is ever run."""
    if not sql.strip():
        return "empty query", ""
    try:
        canonical = str(run("SELECT formatQuerySingleLine({veribus_sql:String})", {"veribus_sql": sql})[0][0])
    except Exception as exc:  # noqa: BLE001 - the engine's parse error is the answer
        return f"the engine does not accept this query: {_engine_message(exc)}", ""
    reason = params_refusal(canonical, params)  # before anything runs with them (the EXPLAIN below too)
    if reason:
        return reason, ""
    try:
        rows = run(f"EXPLAIN AST {canonical}", params)
    except Exception as exc:  # noqa: BLE001
        return f"the engine does not accept this query: {_engine_message(exc)}", ""
    return refusal_from_ast([str(r[0]) for r in rows], engine_table_functions), canonical
