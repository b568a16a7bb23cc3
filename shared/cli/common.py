"""What every `veribus` command module shares: the deployment's settings, and one line on
stderr for an error or a note."""

from __future__ import annotations

import sys
from typing import Any

from shared.control.deployment import select


def deployment_settings() -> Any:
    """The settings of the deployment this command talks to (flags, environment, local stack)."""
    return select().settings


def err(msg: str) -> None:
    print(f"veribus: error: {msg}", file=sys.stderr)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
