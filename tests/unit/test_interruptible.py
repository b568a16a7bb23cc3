"""Ctrl-C ends `veribus run`'s following even when the code under it drops a cancellation.

Python 3.11's `asyncio.wait_for` returns its result and drops the cancel when the cancel lands in
the loop iteration where the awaited call completes; `runner.collect` awaits such calls every
tick. A full test run once saw `veribus run` go on following for a minute after its SIGINT
(`test_honest_cli.py::test_ctrl_c_says_what_keeps_running`). These tests send real SIGINTs to a
child Python running `run_main(interruptible(...))`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from shared.cli.aio import interruptible, run_main

REPO = Path(__file__).parents[2]

_FOLLOWER = """
import asyncio, os, signal, sys
from shared.cli.aio import interruptible, run_main
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (see test_outcome.py)
how = sys.argv[1]
cancels = []

async def follower():
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, os.kill, os.getpid(), signal.SIGINT)  # Ctrl-C while it follows
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancels.append(1)
            if how == "swallows" and len(cancels) == 1:
                continue  # dropped, as 3.11's wait_for drops one, and it goes on following
            await asyncio.sleep(0.05)  # unwinding (a connection closing) is not cut short
            print("unwound", flush=True)
            raise

try:
    run_main(interruptible(follower()))
    print("finished")
except KeyboardInterrupt:
    print("interrupted", len(cancels) > 0)
"""


@pytest.mark.parametrize(("how", "said"), [("honours", ["unwound", "interrupted", "True"]),
                                           ("swallows", ["unwound", "interrupted", "True"])])
def test_ctrl_c_ends_the_follow_even_when_a_cancel_is_dropped(how: str, said: list[str]) -> None:
    """A follower that drops the first cancel (and would then follow for an hour) is cancelled
    again and interrupted; one that honours the first unwinds in peace (its 0.05 s of clean-up is
    not cut short by a second cancel)."""
    out = subprocess.run([sys.executable, "-c", _FOLLOWER, how], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.stdout.split() == said, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_python_3_11_wait_for_drops_a_cancel_that_meets_its_result() -> None:
    """The premise, in this Python: a cancel delivered as the awaited call completes is dropped by
    `asyncio.wait_for` (the task goes on, with `cancelling()` still 1); `asyncio.timeout`, which
    `runner.collect` now uses, raises it."""
    async def meeting(use_timeout: bool) -> str:
        me = asyncio.current_task()
        assert me is not None

        async def call() -> int:
            asyncio.get_running_loop().call_soon(me.cancel)  # lands in the iteration the call completes in
            return 1

        try:
            if use_timeout:
                async with asyncio.timeout(5):
                    await call()
                    await asyncio.sleep(0)
            else:
                await asyncio.wait_for(call(), 5)
                await asyncio.sleep(0)
            return "went on"
        except asyncio.CancelledError:
            return "cancelled"

    if sys.version_info < (3, 12):
        assert asyncio.run(meeting(use_timeout=False)) == "went on"
    assert asyncio.run(meeting(use_timeout=True)) == "cancelled"


async def test_without_ctrl_c_the_result_or_error_comes_through() -> None:
    async def value() -> int:
        await asyncio.sleep(0)
        return 7

    async def broken() -> None:
        raise ValueError("the stream is gone")

    assert await interruptible(value()) == 7
    with pytest.raises(ValueError, match="the stream is gone"):
        await interruptible(broken())


def test_run_main_returns_what_an_uninterrupted_follow_returns() -> None:
    async def value() -> str:
        return "done"

    assert run_main(interruptible(value())) == "done"
