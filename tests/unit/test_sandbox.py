"""The worker sandbox: limits, recovery after every kind of call failure, pool lifecycle.

Small limits keep every test bounded (1 s wall per call, 256 MB). The module's pool is shared
by the tests (idle workers carry over from one test's event loop to the next) and is killed
and reaped, by pid, in the fixture's teardown; tests that need other settings make their own
pool and close it. Attacks on the boundary itself are in test_sandbox_attacks.py.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.templates.sandbox import Sandbox, get_sandbox
from tests.support.pools import gone, reaped_pool

TIMEOUT_S = 4.0  # generous: a loaded shared machine must not turn a memory or crash case into a timeout
MEMORY_MB = 256


def _tagged(tag: str) -> list[int]:
    """Every process (outer bwrap, jail init, zygote, call) started for the pool with `tag`."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if tag.encode() in p.joinpath("cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with reaped_pool(workers=2, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB) as sb:
        yield sb
    _wait_none_tagged(sb.tag)


def _wait_none_tagged(tag: str) -> None:
    """The jail's inner processes die with their outer bwrap (die-with-parent): wait for it."""
    deadline = time.monotonic() + 30
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _tagged(tag) == []


async def _serves(sb: Sandbox) -> int:
    """The pool answers a normal call; returns the pid (in the jail's pid namespace) that answered."""
    reply = await sb.call("ping", x=1)
    assert reply["ok"], reply
    assert reply["value"]["echo"] == {"x": 1}
    return reply["value"]["pid"]


async def test_runs_in_a_jailed_child_process(sandbox: Sandbox) -> None:
    await _serves(sandbox)
    assert sandbox.jail.mode == "jail" and sandbox.jail.error is None
    assert sandbox.pids and os.getpid() not in sandbox.pids
    assert (await sandbox.call("exec", code="result = sum(range(10))")) == {"ok": True, "value": 45}


async def test_every_call_is_a_new_process() -> None:
    sb = Sandbox(workers=1, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    try:
        code = "import os\nresult = [os.getpid(), os.getppid(), os.getuid()]"
        replies = [(await sb.call("exec", code=code))["value"] for _ in range(4)]
        assert len({pid for pid, _, _ in replies}) == 4  # a fresh process each time (one jail, one pid namespace)
        assert len({ppid for _, ppid, _ in replies}) == 1  # ... forked by the same zygote
        assert all(uid != 0 for _, _, uid in replies)
    finally:
        await sb.close()


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
    await _serves(sandbox)
    restarts = sandbox.restarts
    # the loop is cut at this call's wall limit (a short one: any limit stops it)
    reply = await sandbox.call("exec", code="while True:\n    pass\n", timeout_s=1.0)
    assert reply == {"ok": False, "kind": "timeout", "error": "code exceeded 1.0 s wall time"}
    for _ in range(4):  # both slots serve again: the zygote killed the call, not itself
        await _serves(sandbox)
    assert sandbox.restarts == restarts
    assert len(sandbox.pids) == 2


async def test_per_call_timeout_override(sandbox: Sandbox) -> None:
    reply = await sandbox.call("exec", code="import time\ntime.sleep(5)", timeout_s=0.3)
    assert reply["kind"] == "timeout" and "exceeded 0.3 s wall time" in reply["error"]
    await _serves(sandbox)


@pytest.mark.parametrize(
    "code",
    ["x = 'a' * 10**10", "x = []\nwhile True:\n    x.append(' ' * 100_000)\n", "x = bytearray(2**40)"],
    ids=["huge-string", "growing-list", "huge-bytearray"],
)
async def test_memory_limit(sandbox: Sandbox, code: str) -> None:
    reply = await sandbox.call("exec", code=code)
    assert reply["ok"] is False and reply["kind"] == "memory"  # the cap, not the wall clock, stopped it
    assert reply["error"] == f"memory limit {MEMORY_MB} MB exceeded"
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
    # each call has its own scratch folder, so write and measure in one call
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
    """(a key set after start-up; the planted-key attack on the initial environment is in test_sandbox_attacks)"""
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
        reply = await sb.call("exec", code="while True:\n    pass\n")
        assert reply["ok"] is False and reply["kind"] == "cpu"
        assert reply["error"] == "code exceeded the CPU time limit (1 s)"
        assert (await sb.call("exec", code="result = 1"))["value"] == 1
    finally:
        await sb.close()


async def test_concurrent_calls_share_the_workers(sandbox: Sandbox) -> None:
    await sandbox.start()
    code = "import os, time\ntime.sleep(0.2)\nresult = os.getppid()"
    calls_before = sandbox.calls
    replies = await asyncio.gather(*(sandbox.call("exec", code=code) for _ in range(6)))
    assert all(r["ok"] for r in replies)
    assert sandbox.calls - calls_before == 6
    assert len(sandbox.pids) == 2  # two workers served the six calls, one at a time each


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
        asyncio.run(_serves(sb))
        first = sb.pids
        asyncio.run(_serves(sb))
        assert sb.pids == first  # the same worker, re-attached to the second loop
    finally:
        sb.terminate()
    assert all(gone(p) for p in first) and sb.pids == []
    _wait_none_tagged(sb.tag)


async def test_close_kills_and_refuses() -> None:
    sb = Sandbox(workers=2, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    await sb.start()
    pids = sb.pids
    assert len(pids) == 2
    await sb.close()
    assert all(gone(p) for p in pids)
    _wait_none_tagged(sb.tag)
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


def test_fails_closed_without_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERIBUS_SANDBOX_BWRAP", "/nonexistent/bwrap")
    sb = Sandbox(workers=1, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    reply = asyncio.run(sb.call("exec", code="result = 1"))
    assert reply["ok"] is False and reply["kind"] == "unavailable"
    assert "bubblewrap (bwrap) is not installed" in reply["error"] and "VERIBUS_SANDBOX=unsafe" in reply["error"]
    assert sb.pids == []  # nothing was started


def test_fails_closed_on_a_bad_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERIBUS_SANDBOX", "off")
    reply = asyncio.run(Sandbox(workers=1).call("ping"))
    assert reply["kind"] == "unavailable" and "VERIBUS_SANDBOX='off'" in reply["error"]
    assert "'auto', 'jail' or 'unsafe'" in reply["error"]


@pytest.mark.needs_root
def test_root_sandbox_uid_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.fail("this suite runs as root here; the uid drop is the root path")
    monkeypatch.setenv("VERIBUS_SANDBOX_UID", "0")
    monkeypatch.setenv("VERIBUS_SANDBOX_BWRAP", "/usr/bin/bwrap")  # a fresh plan (the cache key changes)
    reply = asyncio.run(Sandbox(workers=1).call("ping"))
    assert reply["kind"] == "unavailable" and "must not be root" in reply["error"]


def test_unsafe_mode_is_explicit_and_loud(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VERIBUS_SANDBOX", "unsafe")
    with caplog.at_level("WARNING", logger="veribus.sandbox"):
        sb = Sandbox(workers=1, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    try:
        assert sb.jail.mode == "unsafe"
        assert any("WITHOUT an OS boundary" in r.getMessage() for r in caplog.records)
        reply = asyncio.run(sb.call("exec", code="import os\nresult = os.getuid()"))
        assert reply == {"ok": True, "value": os.getuid()}  # no uid drop: it really is unconfined
        cwd = asyncio.run(sb.call("exec", code="import os\nresult = os.getcwd()"))["value"]
        root = os.path.dirname(cwd)  # a call runs in a folder of the worker's scratch root, on the host
        assert os.path.basename(root).startswith("veribus-sandbox-") and os.path.isdir(root)
    finally:
        sb.terminate()
    assert not os.path.exists(root), "the unjailed worker's scratch folder outlives it"


async def test_a_scope_keeps_its_process_and_no_other_scope_sees_it() -> None:
    """Calls with the same scope (a run id) share one process (templates compile once per run);
    another scope, or no scope, gets a process of its own with none of that state."""
    sb = Sandbox(workers=1, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    mark = "import builtins, os\nbuiltins.__dict__.setdefault('_vb_mark', []).append(1)\nresult = [os.getpid(), len(builtins._vb_mark)]"
    try:
        a = [(await sb.call("exec", code=mark, scope="run-a"))["value"] for _ in range(3)]
        assert len({pid for pid, _ in a}) == 1 and [n for _, n in a] == [1, 2, 3]
        b = (await sb.call("exec", code=mark, scope="run-b"))["value"]
        assert b[1] == 1 and b[0] != a[0][0]
        fresh = (await sb.call("exec", code=mark))["value"]
        assert fresh[1] == 1
        again = (await sb.call("exec", code=mark, scope="run-a"))["value"]
        assert again == [a[0][0], 4]  # run-a's process served on, untouched by the others
        # a timeout retires the scope's process: the next call of that scope starts afresh
        reply = await sb.call("exec", code="while True:\n    pass\n", scope="run-a", timeout_s=0.5)
        assert reply["kind"] == "timeout"
        after = (await sb.call("exec", code=mark, scope="run-a"))["value"]
        assert after[1] == 1 and after[0] != a[0][0]
    finally:
        await sb.close()


async def test_scope_processes_are_bounded_and_hold_only_their_own_pipes() -> None:
    sb = Sandbox(workers=1, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    code = "import os\nresult = [os.getpid(), sorted(int(f) for f in os.listdir('/proc/self/fd'))]"
    try:
        first = {}
        for i in range(6):  # more scopes than a worker keeps
            first[i] = (await sb.call("exec", code=code, scope=f"run-{i}"))["value"]
            assert len(first[i][1]) <= 6, first[i]  # stdin/out/err, its request and reply pipes (+ the listing)
        reply = await sb.call("exec", code="import os\nresult = len([p for p in os.listdir('/proc') if p.isdigit()])")
        assert reply["ok"] and reply["value"] <= 2 + 4 + 1  # init, zygote, at most 4 kept scopes, this call
        again = (await sb.call("exec", code=code, scope="run-0"))["value"]
        assert again[0] != first[0][0]  # the oldest scope was retired
        kept = (await sb.call("exec", code=code, scope="run-5"))["value"]
        assert kept[0] == first[5][0]
    finally:
        await sb.close()
