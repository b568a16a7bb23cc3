"""ClickHouse DDL for veribus: tables and analyst views, applied in file order by `Store.migrate()`.

The .sql files use `{db}` for the database name; every statement is idempotent (IF NOT EXISTS for
tables, OR REPLACE for views) so migrating twice, or on every start, is safe.
"""

from __future__ import annotations

import re
from importlib import resources

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TABLES = ("events", "verification_results", "runs")
VIEWS = (
    "v_pass_rate_by_model",
    "v_pass_rate_by_question",
    "v_pass_rate_by_replicate",
    "v_run_summary",
    "v_stage_latency",
    "v_event_counts",
    "v_usage_by_model",
    "v_trait_scores",
)


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
