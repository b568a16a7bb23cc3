"""What every `veribus` command module shares: the deployment's settings, a run argument resolved
to its run id, and one line on stderr for an error or a note."""

from __future__ import annotations

import sys
from typing import Any

from shared.control.deployment import select
from shared.control.runref import resolve


def deployment_settings() -> Any:
    """The settings of the deployment this command talks to (flags, environment, local stack)."""
    return select().settings


def err(msg: str) -> None:
    print(f"veribus: error: {msg}", file=sys.stderr)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve_run_arg(settings: Any, ref: str, *, stream: bool) -> str:
    """A run id or name -> the run id, from the stream (`stream=True`) or the store (the most
    recent run of a name; said when it is ambiguous). Raises RunNotFound, which `main` turns
    into one line and exit 2."""
    picked = resolve(settings, ref, stream=stream)
    if picked.note:
        say(f"note: {picked.note}")
    return picked.run_id
