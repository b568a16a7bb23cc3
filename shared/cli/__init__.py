"""Layer 6, the `veribus` command: `commands` (the parser and `main`, the entry point
`shared.cli:main`), `analysis` (results, compare, export, report) and `lifecycle` (cancel,
resume, regrade, projections)."""

from shared.cli.commands import main

__all__ = ["main"]
