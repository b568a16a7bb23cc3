"""The read-only SQL guard: what a query over NATS or `veribus query` may run (reads only, no
file, network or program table functions)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:

    pass


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


def read_only_refusal(sql: str) -> str | None:
    """Why `sql` is refused as a read-only query, or None when it is accepted."""
    code = strip_sql_literals(sql).strip()
    code = re.sub(r";\s*$", "", code).strip()
    if not code:
        return "empty query"
    if ";" in code:
        return "only one statement is allowed"
    first = re.match(r"\(*\s*([A-Za-z]+)", code)
    word = first.group(1).upper() if first else ""
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
