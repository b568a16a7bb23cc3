"""`run_main`: `asyncio.run` for the CLI's commands, where Ctrl-C at any moment is a plain
KeyboardInterrupt (the command then says what keeps running) and never a traceback; and
`interruptible`, which makes Ctrl-C end a long await even when the code under it swallows the
cancellation.

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
from collections.abc import Awaitable, Coroutine, Iterator
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


RECANCEL_S = 1.0  # how long an interrupted await may unwind before it is cancelled again


async def interruptible(coro: Awaitable[T]) -> T:
    """Await `coro`; Ctrl-C cancels it and raises KeyboardInterrupt once it has ended. One
    cancellation is not always enough: Python 3.11's `asyncio.wait_for` returns its result, dropping
    the cancel, when the cancel lands in the loop iteration where the awaited call completes.
    `runner.collect`'s tick made such a call every 2 s, and a Ctrl-C that met one was lost:
    `veribus run` went on following (seen once in a full test run). So the task is cancelled
    again while it has not ended."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    sigint: asyncio.Future[None] = loop.create_future()

    def on_sigint() -> None:
        if not sigint.done():
            sigint.set_result(None)
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        pass
    try:
        await asyncio.wait({task, sigint}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # our own caller was cancelled: so is the work it awaited
        task.cancel()
        await _until_ended(task)
        raise
    finally:
        try:
            loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    if sigint.done():
        await _until_ended(task)
        raise KeyboardInterrupt
    return task.result()


async def _until_ended(task: asyncio.Future[Any]) -> None:
    """Wait for a cancelled `task` to end, cancelling it again after each RECANCEL_S it has not (a
    cancel may be dropped, see `interruptible`; one that is unwinding, its NATS connection closing,
    is not cut short). What it ended with is dropped: the caller is leaving."""
    while not task.done():
        await asyncio.wait({task}, timeout=RECANCEL_S)
        if not task.done():
            task.cancel()
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved
