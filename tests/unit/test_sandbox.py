"""The worker sandbox: limits, recovery after every kind of worker failure, IPC cost.

Small limits keep every test bounded (1 s wall per call, 256 MB). The module's pool is shared
by the tests (idle workers carry over from one test's event loop to the next) and is killed
and reaped, by pid, in the fixture's teardown; tests that need other settings make their own
pool and close it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator

import pytest

from shared.templates.sandbox import Sandbox, get_sandbox

TIMEOUT_S = 1.0
MEMORY_MB = 256


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    sb = Sandbox(workers=2, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    yield sb
    pids = sb.pids
    sb.terminate()
    assert all(_gone(p) for p in pids)


async def _serves(sb: Sandbox) -> int:
    """The pool answers a normal call; returns the pid that answered."""
    reply = await sb.call("ping", x=1)
    assert reply["ok"], reply
    assert reply["value"]["echo"] == {"x": 1}
    return reply["value"]["pid"]


async def test_runs_in_a_child_process(sandbox: Sandbox) -> None:
    pid = await _serves(sandbox)
    assert pid != os.getpid() and pid in sandbox.pids
    assert (await sandbox.call("exec", code="result = sum(range(10))")) == {"ok": True, "value": 45}


async def test_limits_are_set_in_the_child(sandbox: Sandbox) -> None:
    reply = await sandbox.call(
        "exec",
        code="import resource as r\n"
        "result = [r.getrlimit(r.RLIMIT_AS)[0], r.getrlimit(r.RLIMIT_NOFILE)[0], r.getrlimit(r.RLIMIT_CORE)[0],"
        " r.getrlimit(r.RLIMIT_CPU)[0], r.getrlimit(r.RLIMIT_FSIZE)[0]]",
    )
    assert reply["ok"], reply
    as_, nofile, core, cpu, fsize = reply["value"]
    assert as_ == MEMORY_MB * 1024 * 1024
    assert nofile == 64 and core == 0 and fsize == 16 * 1024 * 1024
    assert 0 < cpu <= 60  # re-armed per call: a few seconds beyond what the worker has used


async def test_infinite_loop_is_killed_and_pool_recovers(sandbox: Sandbox) -> None:
    before = await _serves(sandbox)
    t = time.monotonic()
    reply = await sandbox.call("exec", code="while True:\n    pass\n")
    elapsed = time.monotonic() - t
    assert reply == {"ok": False, "kind": "timeout", "error": f"code exceeded {TIMEOUT_S} s wall time"}
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1.0
    for _ in range(4):  # both slots serve again, one of them a fresh worker
        await _serves(sandbox)
    assert sandbox.restarts >= 1
    assert len(sandbox.pids) == 2
    assert before in sandbox.pids or _gone(before)


async def test_per_call_timeout_override(sandbox: Sandbox) -> None:
    t = time.monotonic()
    reply = await sandbox.call("exec", code="import time\ntime.sleep(5)", timeout_s=0.3)
    assert reply["kind"] == "timeout" and "exceeded 0.3 s wall time" in reply["error"]
    assert time.monotonic() - t < 1.0
    await _serves(sandbox)


@pytest.mark.parametrize(
    "code",
    ["x = 'a' * 10**10", "x = []\nwhile True:\n    x.append(' ' * 100_000)\n", "x = bytearray(2**40)"],
    ids=["huge-string", "growing-list", "huge-bytearray"],
)
async def test_memory_limit(sandbox: Sandbox, code: str) -> None:
    t = time.monotonic()
    reply = await sandbox.call("exec", code=code)
    assert reply["ok"] is False and reply["kind"] == "memory"
    assert reply["error"] == f"memory limit {MEMORY_MB} MB exceeded"
    assert time.monotonic() - t < TIMEOUT_S  # the cap stops it long before the wall clock
    await _serves(sandbox)


async def test_os_exit_is_reported_with_its_code(sandbox: Sandbox) -> None:
    reply = await sandbox.call("exec", code="import os\nos._exit(3)")
    assert reply == {"ok": False, "kind": "crash", "error": "worker exited with code 3"}
    await _serves(sandbox)


async def test_segfault_is_reported(sandbox: Sandbox) -> None:
    reply = await sandbox.call("exec", code="import ctypes\nctypes.string_at(0)")
    assert reply["ok"] is False and reply["kind"] == "crash"
    assert reply["error"].startswith("worker crashed with SIGSEGV")
    assert "Segmentation fault" in reply["error"]  # faulthandler's line from the worker's stderr
    await _serves(sandbox)


async def test_exception_keeps_the_worker(sandbox: Sandbox) -> None:
    restarts = sandbox.restarts
    reply = await sandbox.call("exec", code="def f():\n    raise ValueError('boom')\nf()")
    assert reply["ok"] is False and reply["kind"] == "exception"
    assert reply["error"] == "ValueError: boom"
    assert "in f" in reply["traceback"]
    reply = await sandbox.call("exec", code="import sys\nsys.exit(3)")
    assert reply == {"ok": False, "kind": "exit", "error": "code called sys.exit(3)"}
    await _serves(sandbox)
    assert sandbox.restarts == restarts  # nothing had to be replaced


async def test_prints_do_not_corrupt_the_protocol(sandbox: Sandbox) -> None:
    reply = await sandbox.call("exec", code="import sys\nprint('x' * 100_000)\nsys.stdout.flush()\nresult = 'fine'")
    assert reply == {"ok": True, "value": "fine"}
    reply = await sandbox.call("exec", code="result = input()")  # stdin is /dev/null, not the protocol
    assert reply["kind"] == "exception" and reply["error"].startswith("EOFError")


async def test_file_size_limit(sandbox: Sandbox, tmp_path: object) -> None:
    # inside its private scratch folder (its cwd) a template may write, up to the file-size limit
    reply = await sandbox.call("exec", code="open('big.bin', 'wb').write(b'a' * (32 * 1024 * 1024))")
    assert reply["ok"] is False and "File too large" in reply["error"]
    # each worker has its own scratch folder, so write and measure in one call
    reply = await sandbox.call("exec", code=(
        "import os\ntry:\n    open('big2.bin', 'wb').write(b'a' * (32 * 1024 * 1024))\nexcept OSError:\n    pass\n"
        "result = os.path.getsize('big2.bin')"))
    assert reply["ok"] is True and reply["value"] <= 16 * 1024 * 1024
    # ... and nowhere else
    target = os.path.join(str(tmp_path), "big.bin")
    reply = await sandbox.call("exec", code=f"open({target!r}, 'wb').write(b'a')")
    assert reply["ok"] is False and "sandbox: writing" in reply["error"]
    assert not os.path.exists(target)


async def test_isolation_refuses_processes_sockets_and_ctypes(sandbox: Sandbox) -> None:
    for code, event in (
        ("import os\nos.fork()", "os.fork"),
        ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", "socket"),
        ("import ctypes\nctypes.CDLL(None)", "ctypes"),
        ("import os\nos.kill(1, 9)", "os.kill"),
    ):
        reply = await sandbox.call("exec", code=code)
        assert reply["ok"] is False and "sandbox:" in reply["error"] and event in reply["error"], (code, reply)
    await _serves(sandbox)


async def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-value")
    sb = Sandbox(workers=1, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    try:
        reply = await sb.call("exec", code="import os\nresult = dict(os.environ)")
        assert reply["ok"], reply
        assert "OPENAI_API_KEY" not in reply["value"]
        assert "sk-secret-value" not in str(reply["value"])
    finally:
        await sb.close()


async def test_karenina_alias_only_inside_workers(sandbox: Sandbox) -> None:
    reply = await sandbox.call(
        "exec",
        code="from karenina.schemas.entities import BaseAnswer as A\n"
        "from karenina.schemas.domain import BaseAnswer as B\n"
        "from karenina.schemas import BaseAnswer as C\n"
        "import shared.templates.answer\n"
        "result = A is B is C is shared.templates.answer.BaseAnswer",
    )
    assert reply == {"ok": True, "value": True}
    assert "karenina" not in sys.modules  # the service process is never touched


async def test_cpu_limit_backstop() -> None:
    """RLIMIT_CPU kills a busy worker even when the wall-time limit is generous."""
    sb = Sandbox(workers=1, timeout_s=10.0, memory_mb=MEMORY_MB, cpu_s=1)
    try:
        t = time.monotonic()
        reply = await sb.call("exec", code="while True:\n    pass\n")
        assert reply["ok"] is False and reply["kind"] == "cpu"
        assert reply["error"] == "code exceeded the CPU time limit (1 s)"
        assert time.monotonic() - t < 5.0
        assert (await sb.call("exec", code="result = 1"))["value"] == 1
    finally:
        await sb.close()


async def test_concurrent_calls_share_the_workers(sandbox: Sandbox) -> None:
    await sandbox.start()
    code = "import os, time\ntime.sleep(0.2)\nresult = os.getpid()"
    t = time.monotonic()
    replies = await asyncio.gather(*(sandbox.call("exec", code=code) for _ in range(6)))
    elapsed = time.monotonic() - t
    assert all(r["ok"] for r in replies)
    assert len({r["value"] for r in replies}) == 2  # two workers, one call each at a time
    assert 0.55 < elapsed < 2.0  # 6 calls × 0.2 s over 2 workers


async def test_cancelled_call_retires_its_worker(sandbox: Sandbox) -> None:
    await sandbox.start()
    task = asyncio.ensure_future(sandbox.call("exec", code="import os, time\ntime.sleep(10)"))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(3):
        await _serves(sandbox)


async def test_unknown_function_and_bad_arguments(sandbox: Sandbox) -> None:
    reply = await sandbox.call("os:system", command="true")
    assert reply["ok"] is False and "unknown sandbox function 'os:system'" in reply["error"]
    reply = await sandbox.call("ping", obj=object())
    assert reply["ok"] is False and "not serialisable" in reply["error"]
    await _serves(sandbox)


def test_idle_workers_survive_a_new_event_loop() -> None:
    sb = Sandbox(workers=1, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    try:
        first = asyncio.run(_serves(sb))
        second = asyncio.run(_serves(sb))
        assert first == second  # the same worker, re-attached to the second loop
    finally:
        sb.terminate()
    assert _gone(first) and sb.pids == []


async def test_close_kills_and_refuses() -> None:
    sb = Sandbox(workers=2, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    await sb.start()
    pids = sb.pids
    assert len(pids) == 2
    await sb.close()
    assert all(_gone(p) for p in pids)
    assert (await sb.call("ping"))["kind"] == "closed"


async def test_default_pool_is_shared() -> None:
    sb = get_sandbox()
    try:
        assert get_sandbox() is sb
        await _serves(sb)
    finally:
        await sb.close()
    assert get_sandbox() is not sb  # a closed default pool is replaced on next use
    get_sandbox().terminate()


async def test_parent_cpu_per_call_is_small(sandbox: Sandbox) -> None:
    """IPC overhead: the service process spends well under 0.5 ms CPU per sandbox call."""
    await sandbox.start()
    for _ in range(50):
        await sandbox.call("ping")
    n = 1000
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        await sandbox.call("ping", payload="x" * 500)
    cpu = (time.process_time() - cpu0) / n
    wall = (time.perf_counter() - wall0) / n
    print(f"sandbox ping: parent CPU {cpu * 1e6:.0f} us/call, round trip {wall * 1e6:.0f} us")
    assert cpu < 0.0005
