"""Sandbox pools for the unit tests: a module's pool is killed and reaped, by pid, when the module
is done, and the teardown checks that not one of its workers is left."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shared.templates.sandbox import Sandbox


def gone(pid: int) -> bool:
    """No process has this pid any more (reaped, not just dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextmanager
def reaped_pool(**kw: Any) -> Iterator[Sandbox]:
    """`Sandbox(**kw)`, terminated on exit; every worker it had must be gone."""
    pool = Sandbox(**kw)
    yield pool
    pids = pool.pids
    pool.terminate()
    assert all(gone(p) for p in pids)
