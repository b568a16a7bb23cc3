"""Layer 6, the `veribus` command: `commands` (the parser and `main`, the entry point
`shared.cli:main`), `stack` (up, down, status, runs, query, view), `run`, `analysis` (results,
compare, export, report), `lifecycle` (cancel, resume, regrade, projections) and `scale` (cache)."""

from shared.cli.commands import main

__all__ = ["main"]
