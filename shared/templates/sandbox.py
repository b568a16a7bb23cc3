"""Worker sandbox, the service's side: user template code and callable traits never run in a
service process.

A `Sandbox` is a pool of worker processes. Each worker is a jail (`shared.templates.boundary`:
bubblewrap namespaces, a separate unprivileged uid, seccomp, a cleared environment) holding a
zygote (`shared.templates.jail`) that forks a fresh process per call, or one process per scope
(a run id) kept for that scope's later calls. The zygote enforces the per-call wall time; the
parent keeps a backstop timer that kills a whole worker (by process group; the jail dies with
it) if its zygote stops answering, and checks the shape of every reply (user code can write
its own frames).

One call at a time per worker. The parent watches the pipes with `loop.add_reader`: no
threads, no per-call tasks, and idle workers carry over to a new event loop.

If the jail cannot be set up the pool fails closed (every call: kind "unavailable").
`VERIBUS_SANDBOX=unsafe` runs the same zygote without the jail, seccomp or uid drop.

Every `call` returns a dict: {"ok": True, "value": …} or {"ok": False, "kind": …, "error": …}
with kind one of: exception, exit, timeout, memory, cpu, crash, unavailable, closed.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import itertools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

import msgspec

from shared.core.config import Settings
from shared.templates import boundary
from shared.templates.boundary import bwrap_argv
from shared.templates.protocol import _HDR, BUILTINS, PRELOAD, _label, _signal_name

_ROOT = str(Path(__file__).resolve().parents[2])  # the repository root, for the worker's sys.path
_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR")
_BACKSTOP_S = 5.0  # extra wall time before the parent kills a whole worker whose zygote did not answer
log = logging.getLogger("veribus.sandbox")


_KINDS = frozenset({"exception", "exit", "timeout", "memory", "cpu", "crash", "unavailable", "closed"})


def _checked_reply(dec: msgspec.msgpack.Decoder, payload: Any, label: str) -> dict[str, Any]:
    """A reply frame as the pool's callers may rely on it. User code can write its own frame
    into the reply pipe, so the shape is checked here, in the service, not trusted."""
    try:
        msg = dec.decode(payload)
    except (msgspec.DecodeError, RecursionError):  # nested thousands deep: malformed all the same
        msg = None
    if isinstance(msg, dict) and msg.get("ready") is True:
        return msg  # the worker's start-up hello
    if isinstance(msg, dict) and msg.get("ok") is True and "value" in msg:
        return {"ok": True, "value": msg["value"]}
    if (isinstance(msg, dict) and msg.get("ok") is False and msg.get("kind") in _KINDS
            and isinstance(msg.get("error"), str)):
        out = {"ok": False, "kind": msg["kind"], "error": msg["error"][:20_000]}
        if isinstance(msg.get("traceback"), str):
            out["traceback"] = msg["traceback"][:8_000]
        return out
    return {"ok": False, "kind": "crash", "error": f"{label} sent a malformed sandbox reply"}


class _Worker:
    """One worker process as the parent sees it; at most one request in flight.

    Driven by `loop.add_reader` on its stdout/stderr pipes (no child-watcher threads), so an
    idle worker can be re-attached to a new event loop."""

    def __init__(self, pool: Sandbox) -> None:
        self.pool = pool
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self.in_fd = self.out_fd = self.err_fd = -1
        self.loop: asyncio.AbstractEventLoop | None = None
        self.buf = bytearray()
        self.stderr_tail = bytearray()
        self.waiter: asyncio.Future[dict[str, Any]] | None = None
        self.label = "code"
        self.alive = False
        self.usable = False
        self.returncode: int | None = None
        self.exited: asyncio.Future[None] | None = None
        self.in_pool = False  # idle in, or borrowed from, the pool (not starting, not retired)
        self.scratch: str | None = None  # the host scratch folder of an unjailed worker

    async def start(self) -> None:
        pool = self.pool
        jail = pool.jail
        cfg_d: dict[str, Any] = {
            "memory_mb": pool.memory_mb, "max_open_files": pool.max_open_files, "max_file_mb": pool.max_file_mb,
            "max_procs": pool.max_procs, "preload": list(pool.preload), "audit": pool.audit_hook,
            "tag": pool.tag}  # the tag in every process's cmdline: tests find them all
        boot = f"import sys; sys.path.insert(0, {_ROOT!r}); from shared.templates.jail import _worker_main; _worker_main()"
        if jail.mode == "jail":
            cfg_d.update(scratch="/tmp", drop_to=list(jail.drop_to) if jail.drop_to else None,
                         landlock=jail.landlock_abi > 0,
                         seccomp_zygote=base64.b64encode(jail.seccomp_zygote).decode(),
                         seccomp_call=base64.b64encode(jail.seccomp_call).decode())
            argv = [*bwrap_argv(jail.bwrap, pool.tmp_mb, pool.tag, privileged=jail.privileged),
                    sys.executable, "-I", "-c", boot, json.dumps(cfg_d)]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            cwd = "/"
        else:  # no jail, so no tmpfs of its own: a scratch folder on the host, removed in `_release`
            self.scratch = os.path.realpath(tempfile.mkdtemp(prefix="veribus-sandbox-"))
            cfg_d["scratch"] = self.scratch
            argv = [sys.executable, "-I", "-c", boot, json.dumps(cfg_d), pool.tag]
            env = {k: os.environ[k] for k in _ENV_KEEP if k in os.environ}
            env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1",
                       OPENBLAS_NUM_THREADS="1", VERIBUS_SANDBOX_TAG=pool.tag)
            cwd = tempfile.gettempdir()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, bufsize=0, env=env, cwd=cwd, start_new_session=True,
        )
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.pid = self.proc.pid
        self.in_fd, self.out_fd, self.err_fd = (
            self.proc.stdin.fileno(), self.proc.stdout.fileno(), self.proc.stderr.fileno())
        os.set_blocking(self.out_fd, False)
        os.set_blocking(self.err_fd, False)
        self.alive = True
        pool._pids.add(self.pid)
        loop = asyncio.get_running_loop()
        self.attach(loop)
        self.waiter = loop.create_future()
        try:
            hello = await asyncio.wait_for(self.waiter, pool.startup_timeout_s)
        except TimeoutError:
            self.kill()
            raise RuntimeError(f"sandbox worker did not start within {pool.startup_timeout_s} s") from None
        finally:
            self.waiter = None
        if not hello.get("ready"):
            self.kill()
            raise RuntimeError(f"sandbox worker failed to start: {hello.get('error', hello)}")
        if jail.mode == "jail" and hello.get("uid") == 0:
            self.kill()
            raise RuntimeError("sandbox worker runs as root: refusing to use it")
        self.usable = True

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the worker's pipes from `loop` (a previous loop, if any, is closed)."""
        self.loop = loop
        self.exited = loop.create_future()
        loop.add_reader(self.out_fd, self._readable)
        loop.add_reader(self.err_fd, self._err_readable)

    # -- pipe callbacks ------------------------------------------------------------------

    def _readable(self) -> None:
        try:
            data = os.read(self.out_fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.feed(data)
        else:
            self._on_eof()

    def _err_readable(self) -> None:
        try:
            data = os.read(self.err_fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            assert self.loop is not None
            self.loop.remove_reader(self.err_fd)
            return
        tail = self.stderr_tail
        tail += data
        if len(tail) > 4096:
            del tail[:-4096]

    def feed(self, data: bytes) -> None:
        buf = self.buf
        if not buf and len(data) >= 4:  # fast path: exactly one whole frame
            n = _HDR.unpack_from(data)[0]
            if len(data) == 4 + n:
                self._frame(memoryview(data)[4:])
                return
        buf += data
        while len(buf) >= 4:
            n = _HDR.unpack_from(buf)[0]
            if len(buf) < 4 + n:
                break
            frame = bytes(buf[4 : 4 + n])
            del buf[: 4 + n]
            self._frame(frame)

    def _frame(self, payload: Any) -> None:
        msg = _checked_reply(self.pool._dec, payload, self.label)
        fut = self.waiter
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _on_eof(self) -> None:
        """The worker's protocol pipe closed: it is gone (or going). Reap it, tell the caller."""
        assert self.loop is not None and self.proc is not None
        self.loop.remove_reader(self.out_fd)
        try:
            self._err_readable()  # pick up a last fatal-error line
        except OSError:
            pass
        self.kill()  # in case it merely closed the pipe; a zombie keeps its exit status
        try:
            self.returncode = self.proc.wait(timeout=2.0)  # immediate unless stuck in the kernel
        except subprocess.TimeoutExpired:
            self._reap_later(self.proc)
        self._release()
        fut = self.waiter
        if fut is not None and not fut.done():
            fut.set_result(self._death_reply())
        elif self.in_pool and not self.pool._closed:  # died while idle: replace it
            self.in_pool = False
            self.pool.restarts += 1
            self.pool._spawn()
        if self.exited is not None and not self.exited.done():
            self.exited.set_result(None)

    def _reap_later(self, proc: subprocess.Popen[bytes]) -> None:
        def again() -> None:
            if proc.poll() is None:
                loop.call_later(1.0, again)

        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_later(1.0, again)

    def _release(self) -> None:
        self.alive = False
        self.usable = False
        self.pool._pids.discard(self.pid)
        self.pool._all.discard(self)
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.out_fd)
            loop.remove_reader(self.err_fd)
        if self.proc is not None:
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if f is not None:
                    f.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def _death_reply(self) -> dict[str, Any]:
        rc = self.returncode
        pool = self.pool
        kind = "crash"
        if rc is None:
            what = "worker closed its pipes"
        elif rc >= 0:
            what = f"worker exited with code {rc}"
        elif -rc == signal.SIGXCPU:
            kind, what = "cpu", f"{self.label} exceeded the CPU time limit ({pool.cpu_s} s)"
        elif -rc == signal.SIGXFSZ:
            what = f"{self.label} exceeded the file size limit ({pool.max_file_mb} MB)"
        elif -rc == signal.SIGKILL:
            what = "worker killed by SIGKILL (out of memory?)"
        else:
            what = f"worker crashed with {_signal_name(-rc)}"
        lines = bytes(self.stderr_tail).decode("utf-8", "replace").strip().splitlines()
        hint = next((ln.strip() for ln in lines if "Fatal Python error" in ln), lines[-1].strip() if lines else "")
        if hint:
            what += f" (stderr: {hint[:200]})"
        return {"ok": False, "kind": kind, "error": what}

    # -- calls ---------------------------------------------------------------------------

    async def request(self, body: bytes, timeout_s: float, label: str) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.waiter = fut
        self.label = label
        data = memoryview(_HDR.pack(len(body)) + body)
        try:
            while data:  # the worker is idle and reading: a blocking write does not stall
                data = data[os.write(self.in_fd, data):]
        except OSError:  # it died meanwhile; its EOF resolves `fut` with the reason
            pass
        # the zygote stops an overrunning call itself; this backstop is for a wedged zygote
        timer = loop.call_later(timeout_s + _BACKSTOP_S, self._expire, fut, timeout_s)
        try:
            reply = await fut
        except asyncio.CancelledError:
            self.kill()  # it is still busy with the abandoned call: never reuse it
            raise
        finally:
            timer.cancel()
            self.waiter = None
        if reply.get("recycle"):
            self.usable = False
        return reply

    def _expire(self, fut: asyncio.Future[dict[str, Any]], timeout_s: float) -> None:
        if not fut.done():
            fut.set_result({"ok": False, "kind": "timeout", "error": f"{self.label} exceeded {timeout_s} s wall time"})
        self.kill()

    def kill(self) -> None:
        self.usable = False
        if self.alive:
            try:
                os.killpg(self.pid, signal.SIGKILL)  # the worker and anything it forked
            except (ProcessLookupError, PermissionError):
                pass

    def reap_now(self) -> None:
        """Kill and reap synchronously (loop closed, interpreter exit)."""
        if self.alive and self.proc is not None:
            self.kill()
            try:
                self.returncode = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._release()


class _Broken:
    """Queue marker: a worker slot that could not be (re)started."""

    def __init__(self, error: str) -> None:
        self.error = error


class Sandbox:
    """A pool of sandbox workers, used from one event loop at a time.

    `call(fn_name, **kwargs)` runs a worker function (a name from `BUILTINS` or a
    `shared.<module>:<function>` path) with msgpack-able kwargs and returns a result dict (see the
    module docstring). `timeout_s=` overrides the pool's wall-time limit for one call. Workers
    start lazily on the first call (or with `await start()`); `await close()` kills them.
    """

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        *,
        cpu_s: int | None = None,
        max_open_files: int = 64,
        max_file_mb: int = 16,
        max_procs: int = 0,
        preload: tuple[str, ...] = PRELOAD,
        startup_timeout_s: float = 60.0,
        tmp_mb: int = 64,
        audit_hook: bool = True,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.tmp_mb = int(tmp_mb)
        self.audit_hook = audit_hook  # defence in depth only; tests switch it off to attack the kernel layers
        self.jail = boundary.plan(self.tmp_mb)  # fixed for the pool's life; probed once per process
        self.tag = f"veribus-sandbox-{os.getpid()}-{next(_pool_ids)}"  # in each worker's argv/env: find them all
        if self.jail.mode == "unsafe":
            log.warning(boundary.UNSAFE_WARNING)
        self.workers = workers
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self._cpu_explicit = cpu_s is not None
        self.cpu_s = int(cpu_s) if cpu_s is not None else int(math.ceil(self.timeout_s)) + 1
        self.max_open_files = max_open_files
        self.max_file_mb = max_file_mb
        self.max_procs = max_procs
        self.preload = preload
        self.startup_timeout_s = startup_timeout_s
        self.calls = 0
        self.restarts = 0
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Queue[_Worker | _Broken] | None = None
        self._all: set[_Worker] = set()
        self._spawns: set[asyncio.Task[None]] = set()
        self._pids: set[int] = set()
        self._closed = False
        _live_pools.add(self)

    # -- lifecycle -----------------------------------------------------------------------

    def _ensure(self) -> asyncio.Queue[_Worker | _Broken]:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._idle is not None:
            return self._idle
        keep: list[_Worker] = []
        if self._idle is not None:  # a previous loop: carry idle workers over, drop the rest
            while not self._idle.empty():
                item = self._idle.get_nowait()
                if isinstance(item, _Worker) and item.usable:
                    keep.append(item)
        for w in list(self._all):
            if w not in keep:
                w.in_pool = False
                w.reap_now()
        self._loop = loop
        self._idle = asyncio.Queue()
        self._all = set(keep)
        self._spawns = set()
        for w in keep:
            w.attach(loop)
            self._idle.put_nowait(w)
        for _ in range(self.workers - len(keep)):
            self._spawn()
        return self._idle

    def _spawn(self) -> None:
        task = asyncio.get_running_loop().create_task(self._start_one())
        self._spawns.add(task)
        task.add_done_callback(self._spawns.discard)

    async def _start_one(self) -> None:
        error = ""
        for attempt in range(3):
            if self._closed:
                return
            w = _Worker(self)
            self._all.add(w)
            try:
                await w.start()
            except Exception as exc:  # noqa: BLE001 - reported to callers below
                w.reap_now()
                self._all.discard(w)
                error = f"sandbox worker failed to start: {exc}"
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            if self._closed:
                w.reap_now()
                return
            assert self._idle is not None
            w.in_pool = True
            self._idle.put_nowait(w)
            return
        assert self._idle is not None
        self._idle.put_nowait(_Broken(error))

    async def start(self) -> None:
        """Start the workers now and wait until they are ready (optional: `call` starts lazily)."""
        self._ensure()
        if self._spawns:
            await asyncio.gather(*list(self._spawns))

    async def close(self) -> None:
        """Kill every worker (by process group) and reap it."""
        self._closed = True
        for t in list(self._spawns):
            t.cancel()
        workers = list(self._all)
        for w in workers:
            w.in_pool = False
            w.kill()
        pending = [w.exited for w in workers if w.alive and w.exited is not None and w.loop is self._loop]
        if pending and self._loop is asyncio.get_running_loop():
            await asyncio.wait(pending, timeout=5.0)
        for w in workers:
            w.reap_now()
        self._all.clear()
        self._idle = None
        self._loop = None
        _live_pools.discard(self)

    def terminate(self) -> None:
        """Kill and reap every worker synchronously (sync teardown, interpreter exit); the pool
        stays usable and starts new workers on the next call."""
        for t in list(self._spawns):
            t.cancel()
        for w in list(self._all):
            w.in_pool = False
            w.reap_now()
        self._all.clear()
        self._idle = None
        self._loop = None

    @property
    def pids(self) -> list[int]:
        """Pids of the live workers (for tests and diagnostics)."""
        return sorted(self._pids)

    # -- calls ---------------------------------------------------------------------------

    async def call(self, fn_name: str, /, *, timeout_s: float | None = None, scope: str | None = None,
                   **kwargs: Any) -> dict[str, Any]:
        """Run `fn_name(**kwargs)` in a fresh call process, or, with `scope` (a run id), in that
        scope's own process, which later calls of the same scope reuse (and no other scope sees)."""
        if self._closed:
            return {"ok": False, "kind": "closed", "error": "sandbox is closed"}
        if self.jail.error:  # fail closed: no jail, no user code
            return {"ok": False, "kind": "unavailable", "error": f"sandbox unavailable: {self.jail.error}"}
        idle = self._ensure()
        while True:
            try:
                w = idle.get_nowait()
            except asyncio.QueueEmpty:
                w = await idle.get()
            if isinstance(w, _Broken):
                idle.put_nowait(w)  # wake the next waiter too
                return {"ok": False, "kind": "unavailable", "error": w.error}
            if w.usable:
                break
            # it died while idle; its EOF handler has already started a replacement
        self.calls += 1
        wall = self.timeout_s if timeout_s is None else float(timeout_s)
        cpu = self.cpu_s if self._cpu_explicit else int(math.ceil(wall)) + 1
        try:
            body = self._enc.encode((fn_name, kwargs, wall, cpu, scope or None))
        except Exception as exc:  # noqa: BLE001
            idle.put_nowait(w)
            return {"ok": False, "kind": "exception", "error": f"arguments not serialisable: {exc}"}
        try:
            return await w.request(body, wall, _label(fn_name))
        finally:
            if w.usable and not self._closed:
                idle.put_nowait(w)
            else:
                w.in_pool = False
                w.kill()  # reaped (and dropped from the pool) when its pipe reports EOF
                if not self._closed:
                    self.restarts += 1
                    self._spawn()


_live_pools: weakref.WeakSet[Sandbox] = weakref.WeakSet()
_pool_ids = itertools.count(1)
_default: Sandbox | None = None


def get_sandbox() -> Sandbox:
    """The process-wide pool, created on first use. Sized by VERIBUS_SANDBOX_WORKERS,
    VERIBUS_SANDBOX_TIMEOUT_S and VERIBUS_SANDBOX_MEMORY_MB (defaults 2, 10.0, 512)."""
    global _default
    if _default is None or _default._closed:
        settings = Settings.from_env()
        _default = Sandbox(
            workers=settings.sandbox_workers,
            timeout_s=settings.sandbox_timeout_s,
            memory_mb=settings.sandbox_memory_mb,
        )
    return _default


@atexit.register
def _reap_at_exit() -> None:
    for pool in list(_live_pools):
        pool.terminate()


__all__ = ["Sandbox", "get_sandbox", "BUILTINS"]
