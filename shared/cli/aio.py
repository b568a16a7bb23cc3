"""`run_main`: `asyncio.run` for the CLI's commands, where Ctrl-C at any moment is a plain
KeyboardInterrupt (the command then says what keeps running) and never a traceback.

Why: `asyncio.run` builds its event loop before it installs its own SIGINT handler. A Ctrl-C that
lands while the loop is being built raises KeyboardInterrupt inside the loop's constructor, and
the half-built loop later fails in its `__del__` ("Exception ignored ... AttributeError:
'_UnixSelectorEventLoop' object has no attribute '_signal_handlers'"), with a "coroutine ... was
never awaited" warning beside it: seen under load after `veribus run` had printed "submitted
run" (2 in 30 interrupts). One that lands after the runner made the main task and before it
installed its handler leaves a task that never ran; one that lands as the main task starts is
delivered by asyncio as a cancellation of it, which the runner can let out as CancelledError.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ctrl-C held while the block runs and raised as KeyboardInterrupt after it, where the default
    handler would raise it wherever the block is (a handler of our own, not a signal mask: the
    signal may be delivered to any thread, the handler always runs in the main one)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield  # someone else handles SIGINT here: nothing to defer
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def run_main(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)` (see the module docstring): the loop is built, and closed, with Ctrl-C
    held; a coroutine interrupted before any task took it is closed, not left "never awaited" (one
    a task holds is cancelled with the task); a cancelled main task (nothing but Ctrl-C cancels
    it) is KeyboardInterrupt."""
    runner = asyncio.Runner()
    loop = None
    try:
        with _sigint_deferred():
            loop = runner.get_loop()
        return runner.run(coro)
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
    finally:
        with _sigint_deferred():
            held = loop is not None and any(t.get_coro() is coro for t in asyncio.all_tasks(loop))
            if not held and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                coro.close()
            runner.close()
