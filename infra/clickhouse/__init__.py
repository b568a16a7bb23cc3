"""ClickHouse DDL for veribus: tables and analyst views, applied in file order by `Store.migrate()`.

The .sql files use `{db}` for the database name; every statement is idempotent (IF NOT EXISTS for
tables, OR REPLACE for views) so migrating twice, or on every start, is safe.
"""

from __future__ import annotations

import re
from importlib import resources

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CREATE = re.compile(r"^CREATE\s+(?:OR\s+REPLACE\s+)?(TABLE|VIEW)\s+(?:IF\s+NOT\s+EXISTS\s+)?\{db\}\.(\w+)", re.I)


def check_identifier(name: str) -> str:
    """A database name is spliced into DDL, so it must be a plain identifier."""
    if not _IDENT.match(name):
        raise ValueError(f"invalid ClickHouse database name {name!r}: use letters, digits and _")
    return name


def sql_files() -> list[str]:
    """Names of the DDL files, in the order they are applied."""
    pkg = resources.files(__name__)
    return sorted(p.name for p in pkg.iterdir() if p.name.endswith(".sql"))


def _split(text: str) -> list[str]:
    """Split a file into statements: drop `--` comment lines, cut on `;` at a line end."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("--")]
    parts = re.split(r";\s*$", "\n".join(lines), flags=re.M)
    return [p.strip() for p in parts if p.strip()]


def statements(database: str) -> list[str]:
    """Every DDL statement, with `{db}` replaced by the (checked) database name."""
    db = check_identifier(database)
    pkg = resources.files(__name__)
    out: list[str] = []
    for name in sql_files():
        out.extend(s.replace("{db}", db) for s in _split(pkg.joinpath(name).read_text("utf-8")))
    return out


def _objects(kind: str) -> tuple[str, ...]:
    """Names of the tables or views the DDL files create (so drop/rebuild covers every file)."""
    pkg = resources.files(__name__)
    names: list[str] = []
    for name in sql_files():
        for stmt in _split(pkg.joinpath(name).read_text("utf-8")):
            m = _CREATE.match(stmt)
            if m and m.group(1).upper() == kind:
                names.append(m.group(2))
    return tuple(dict.fromkeys(names))  # a view a later file replaces (009 over 004) once, where it was first made


TABLES = _objects("TABLE")
VIEWS = _objects("VIEW")
