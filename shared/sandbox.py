"""Worker sandbox: user template code and callable traits never run in a service process.

A `Sandbox` is a pool of worker processes. Each worker is a jail (`shared.sandbox_jail`:
bubblewrap namespaces, a separate uid, seccomp, a cleared environment) holding a *zygote*: a
Python process that imports what calls need, never runs user code, and forks one fresh child
per call. The child sets its rlimits (memory, CPU, files, file size, NPROC=0, no core), loads
the per-call seccomp filter (no fork/clone/exec/signals/sockets), runs the call in an empty
scratch folder and exits, so nothing a call does to the interpreter, the filesystem or the
process table survives it. The zygote enforces the per-call wall time (SIGKILL of the child)
and reports how a child died; the parent keeps a backstop timer that kills a whole worker
(by process group; the jail dies with it) if its zygote stops answering.

Protocol: length-prefixed msgpack frames over the worker's stdin/stdout (the worker moves its
own fd 1 to stderr; a call's prints go to a pipe the zygote drains). One call at a time per
worker. The parent watches the pipes with `loop.add_reader`: no threads, no per-call tasks,
and idle workers carry over to a new event loop.

If the jail cannot be set up the pool fails closed (every call: kind "unavailable").
`VERIBUS_SANDBOX=unsafe` runs the same zygote without the jail, seccomp or uid drop.

Every `call` returns a dict: {"ok": True, "value": …} or {"ok": False, "kind": …, "error": …}
with kind one of: exception, exit, timeout, memory, cpu, crash, unavailable, closed.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import hashlib
import importlib
import itertools
import json
import logging
import math
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from shared import sandbox_jail
from shared.sandbox_jail import bwrap_argv

_HDR = struct.Struct("<I")
_MAX_REPLY = 64 * 1024 * 1024
_BACKSTOP_S = 5.0  # extra wall time before the parent kills a whole worker whose zygote did not answer
log = logging.getLogger("veribus.sandbox")
_ROOT = str(Path(__file__).resolve().parent.parent)
_MB = 1024 * 1024

# Functions a worker may run, by short name: (module:function, what to call it in errors).
BUILTINS: dict[str, tuple[str, str]] = {
    "ping": ("shared.sandbox:_ping", "code"),
    "exec": ("shared.sandbox:_exec_snippet", "code"),
    "validate_template": ("shared.templates:worker_validate", "template"),
    "verify_template": ("shared.templates:worker_verify", "template"),
    "callable_trait": ("shared.templates:worker_callable", "callable trait"),
}
PRELOAD: tuple[str, ...] = ("shared.templates",)
_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR")


def _label(fn_name: str) -> str:
    return BUILTINS[fn_name][1] if fn_name in BUILTINS else "code"


# =========================================================================== worker side


def _ping(**kwargs: Any) -> dict[str, Any]:
    """Round-trip probe (tests, benchmarks): echoes its arguments with the worker's pid."""
    return {"pid": os.getpid(), "echo": kwargs}


def _exec_snippet(code: str) -> Any:
    """Run a code snippet and return its `result` variable (tests and ad-hoc user code)."""
    ns: dict[str, Any] = {"__name__": "veribus_snippet"}
    exec(compile(code, "<snippet>", "exec"), ns)
    return ns.get("result")


def _send(fd: int, payload: bytes) -> None:
    data = memoryview(_HDR.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data):]


def _set_limit(which: int, soft: int, hard: int | None = None) -> None:
    """Lower a limit (never raise the hard one: that would fail without privileges)."""
    _, cur_hard = resource.getrlimit(which)
    new_hard = cur_hard if hard is None else hard
    if cur_hard != resource.RLIM_INFINITY and (new_hard == resource.RLIM_INFINITY or new_hard > cur_hard):
        new_hard = cur_hard
    soft = soft if new_hard == resource.RLIM_INFINITY else min(soft, new_hard)
    resource.setrlimit(which, (soft, new_hard))


def _apply_limits(cfg: dict[str, Any]) -> None:
    mem = int(cfg["memory_mb"]) * _MB
    _set_limit(resource.RLIMIT_AS, mem, mem)
    _set_limit(resource.RLIMIT_CORE, 0, 0)
    _set_limit(resource.RLIMIT_NOFILE, int(cfg["max_open_files"]), int(cfg["max_open_files"]))
    fsize = int(cfg["max_file_mb"]) * _MB
    _set_limit(resource.RLIMIT_FSIZE, fsize, fsize)
    _set_limit(resource.RLIMIT_NPROC, int(cfg["max_procs"]), int(cfg["max_procs"]))


def _die_with_parent() -> None:
    """Best effort (Linux): SIGKILL this worker when the service process goes away."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - non-Linux: the stdin EOF still ends an idle worker
        pass


def _not_dumpable() -> None:
    """The zygote's /proc/<pid>/{mem,environ,...} become root-owned: a call process (same uid)
    cannot write into the zygote's memory to leave state for later calls."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "PR_SET_DUMPABLE failed")


def _drop_privileges(uid: int, gid: int) -> None:
    """Privileged jail: become the sandbox uid/gid (no groups, no capabilities left) or die."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() == 0 or os.geteuid() == 0 or os.getresgid() != (gid, gid, gid):
        raise RuntimeError("sandbox worker could not drop root")
    with open("/proc/self/status") as f:
        eff = next((ln.split()[1] for ln in f if ln.startswith("CapEff:")), "")
    if eff.strip("0"):
        raise RuntimeError(f"sandbox worker still holds capabilities ({eff})")


def _load_seccomp(bpf: bytes) -> None:
    """Install a compiled seccomp-BPF program (built by libseccomp in the service) on this thread."""
    import ctypes

    class _Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    if not bpf or len(bpf) % ctypes.sizeof(_Filter):
        raise RuntimeError("seccomp program is empty or malformed")
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _Prog(len(bpf) // ctypes.sizeof(_Filter), ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "loading the seccomp filter failed")


_BLOCKED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "os.startfile",
    "subprocess.Popen", "pty.spawn",
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
    "os.kill", "os.killpg", "signal.pthread_kill",
    "os.chdir", "os.chmod", "os.chown", "os.link", "os.symlink", "os.truncate",
})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _audit_hook(scratch: str) -> None:
    """Defence in depth only (PEP 578 hooks are not a security boundary: user code can rebind
    the globals they read). Refuses process creation, signals, sockets, ctypes and writes outside
    the call's scratch folder with a readable message; the kernel layers stop what it misses."""
    prefix = scratch + os.sep
    blocked, write_flags = _BLOCKED_EVENTS, _WRITE_FLAGS  # bound now: rebinding the module globals later changes nothing

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed in template code")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if isinstance(path, int) or path is None:
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writing:
                real = os.path.realpath(os.fsdecode(path))
                if not (real + os.sep).startswith(prefix):
                    raise PermissionError(f"sandbox: writing {real} is not allowed (only under {scratch})")
        elif event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "shutil.move"):
            for path in args[:2]:
                if isinstance(path, str | bytes | os.PathLike):
                    real = os.path.realpath(os.fsdecode(path))
                    if not (real + os.sep).startswith(prefix):
                        raise PermissionError(f"sandbox: {event} on {real} is not allowed")

    sys.addaudithook(hook)


def _resolve(fn_name: str, cache: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    fn = cache.get(fn_name)
    if fn is None:
        target = BUILTINS[fn_name][0] if fn_name in BUILTINS else fn_name
        mod_name, sep, attr = target.partition(":")
        if not sep or not mod_name.startswith("shared."):
            raise ValueError(f"unknown sandbox function {fn_name!r}")
        fn = getattr(importlib.import_module(mod_name), attr)
        cache[fn_name] = fn
    return fn


def _clear_dir(root: str) -> None:
    """Empty `root` (the call left files, maybe unreadable ones: the owner can always chmod)."""
    def onerror(func: Any, path: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass

    with os.scandir(root) as it:
        entries = list(it)
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                os.chmod(e.path, 0o700)
                shutil.rmtree(e.path, onerror=onerror)
            else:
                os.unlink(e.path)
        except OSError:
            pass


def _read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


class _Child:
    """A call process as its zygote sees it: pipes for requests, replies and its stderr."""

    def __init__(self, pid: int, req_w: int, reply_r: int, err_r: int, scratch: str) -> None:
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.req_w, self.reply_r, self.err_r = req_w, reply_r, err_r
        self.scratch = scratch
        self.pending = bytearray()  # reply bytes read beyond one frame (a scope child's own junk)
        self.last_used = 0.0
        self.dead = False
        self.status: int | None = None

    def close(self) -> None:
        """Kill, reap, close, and remove the scratch folder."""
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, self.status = os.waitpid(self.pid, 0)
        for fd in (self.pidfd, self.req_w, self.reply_r, self.err_r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.scratch, ignore_errors=True)
        if os.path.exists(self.scratch):
            _clear_dir(self.scratch)
            shutil.rmtree(self.scratch, ignore_errors=True)


class _Zygote:
    """The worker's main process: it imports what calls need, never runs user code, and forks
    the processes that do. A call without a scope gets a fresh process that exits after it (so
    nothing it does to the interpreter survives it). A call with a scope (a run id) goes to that
    scope's own process, forked on first use and kept for the scope's later calls (templates
    compiled once per run); it never serves another scope, at most `MAX_SCOPES` are kept, and any
    failure retires it."""

    MAX_SCOPES = 4
    SCOPE_IDLE_S = 60.0  # a scope process unused this long is retired (its run is probably over)

    def __init__(self, cfg: dict[str, Any], out_fd: int, in_fd: int) -> None:
        self.cfg = cfg
        self.out_fd, self.in_fd = out_fd, in_fd
        self.enc, self.dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        self.scratch_root = cfg["scratch"]
        self.call_bpf = base64.b64decode(cfg.get("seccomp_call") or "")
        self.mem_reply = self.enc.encode({"ok": False, "kind": "memory",
                                          "error": f"memory limit {cfg['memory_mb']} MB exceeded"})
        self.funcs: dict[str, Callable[..., Any]] = {}
        self.scopes: OrderedDict[str, _Child] = OrderedDict()

    # -- in the child -------------------------------------------------------------------

    def _child_main(self, req_r: int, reply_w: int, scratch: str, persistent: bool) -> None:
        os.chdir(scratch)
        os.environ["TMPDIR"] = scratch
        tempfile.tempdir = scratch
        cfg = self.cfg
        _apply_limits(cfg)
        if self.call_bpf:
            _load_seccomp(self.call_bpf)
        if cfg.get("audit", True):
            _audit_hook(scratch)
        while True:
            try:
                head = _read_exact(req_r, 4)
                fn_name, kwargs, cpu_s = self.dec.decode(_read_exact(req_r, _HDR.unpack(head)[0]))
            except EOFError:
                return
            _set_limit(resource.RLIMIT_CPU, _cpu_used() + cpu_s, None if persistent else _cpu_used() + cpu_s + 1)
            try:
                try:
                    fn = _resolve(fn_name, self.funcs)
                    reply = self.enc.encode({"ok": True, "value": fn(**kwargs)})
                except MemoryError:
                    raise
                except SystemExit as exc:
                    reply = self.enc.encode({"ok": False, "kind": "exit",
                                             "error": f"code called sys.exit({exc.code!r})"})
                except BaseException as exc:  # noqa: BLE001 - user code may raise anything
                    tb = "".join(traceback.format_exception(exc))[-4000:]
                    reply = self.enc.encode({"ok": False, "kind": "exception",
                                             "error": f"{type(exc).__name__}: {exc}", "traceback": tb})
            except MemoryError:
                _send(reply_w, self.mem_reply)
                return  # the heap may be fragmented or poisoned: never serve again
            _send(reply_w, reply)
            if not persistent:
                return

    def _fork(self, scratch: str, persistent: bool) -> _Child:
        os.mkdir(scratch, 0o700)
        req_r, req_w = os.pipe()
        reply_r, reply_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the call's own process
            try:
                os.dup2(err_w, 1)
                os.dup2(err_w, 2)
                keep = {0, 1, 2, req_r, reply_w}
                for name in os.listdir("/proc/self/fd"):  # nothing of the zygote or of other scopes
                    if int(name) not in keep:
                        try:
                            os.close(int(name))
                        except OSError:
                            pass
                self._child_main(req_r, reply_w, scratch, persistent)
            except BaseException as exc:  # noqa: BLE001 - report setup failures too
                try:
                    _send(reply_w, self.enc.encode({"ok": False, "kind": "crash",
                                                    "error": f"sandbox call setup failed: {type(exc).__name__}: {exc}"}))
                except BaseException:  # noqa: BLE001
                    pass
            finally:
                os._exit(0)
        for fd in (req_r, reply_w, err_w):
            os.close(fd)
        return _Child(pid, req_w, reply_r, err_r, scratch)

    # -- in the zygote ------------------------------------------------------------------

    def serve(self, reader: Any) -> None:
        while True:
            head = reader.read(4)
            if len(head) < 4:
                for child in self.scopes.values():
                    child.close()
                os._exit(0)
            body = reader.read(_HDR.unpack(head)[0])
            try:
                fn_name, kwargs, timeout_s, cpu_s, scope = self.dec.decode(body)
            except Exception as exc:  # noqa: BLE001 - the parent sent something odd
                _send(self.out_fd, self.enc.encode({"ok": False, "kind": "exception", "error": f"bad request: {exc}"}))
                continue
            _send(self.out_fd, self.call(fn_name, kwargs, float(timeout_s), int(cpu_s), scope))

    def _sweep(self) -> None:
        """Empty the scratch root but for the live scopes' folders."""
        live = {os.path.basename(c.scratch) for c in self.scopes.values()}
        with os.scandir(self.scratch_root) as it:
            stray = [e.name for e in it if e.name not in live]
        for name in stray:
            path = os.path.join(self.scratch_root, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    os.chmod(path, 0o700)
                    _clear_dir(path)
                    os.rmdir(path)
                else:
                    os.unlink(path)
            except OSError:
                pass

    def call(self, fn_name: str, kwargs: dict[str, Any], timeout_s: float, cpu_s: int, scope: str | None) -> bytes:
        import time

        now = time.monotonic()
        for name in [n for n, c in self.scopes.items() if n != scope and now - c.last_used > self.SCOPE_IDLE_S]:
            self.scopes.pop(name).close()
        self._sweep()
        if scope:
            child = self.scopes.pop(scope, None)
            if child is None:
                tag = hashlib.sha256(scope.encode("utf-8", "replace")).hexdigest()[:16]
                child = self._fork(os.path.join(self.scratch_root, "scope-" + tag), persistent=True)
            child.last_used = now
            self.scopes[scope] = child
            while len(self.scopes) > self.MAX_SCOPES:
                _, old = self.scopes.popitem(last=False)
                old.close()
        else:
            child = self._fork(os.path.join(self.scratch_root, "call"), persistent=False)
        keep = False
        try:
            reply, keep = self._exchange(child, fn_name, kwargs, timeout_s, cpu_s)
            return reply
        finally:
            if not (scope and keep):
                if scope:
                    self.scopes.pop(scope, None)
                child.close()
                self._sweep()

    def _exchange(self, child: _Child, fn_name: str, kwargs: dict[str, Any], timeout_s: float,
                  cpu_s: int) -> tuple[bytes, bool]:
        """Send one request, wait for one reply frame; returns (reply, whether the child may serve again)."""
        import select
        import time

        label = _label(fn_name)
        body = self.enc.encode((fn_name, kwargs, cpu_s))
        deadline = time.monotonic() + timeout_s
        try:
            data = memoryview(_HDR.pack(len(body)) + body)
            while data:  # the child is waiting in its request loop
                data = data[os.write(child.req_w, data):]
        except OSError:
            pass  # it is gone; the wait below reports how it died
        reply, err_tail = child.pending, bytearray()
        child.pending = bytearray()
        fds = [child.reply_r, child.err_r, child.pidfd]
        frame: bytes | None = None
        timed_out = too_big = False
        while frame is None:
            if len(reply) >= 4 and len(reply) >= 4 + _HDR.unpack_from(reply)[0]:
                n = _HDR.unpack_from(reply)[0]
                frame, child.pending = bytes(reply[4:4 + n]), bytearray(reply[4 + n:])
                break
            if child.dead and child.reply_r not in fds:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            ready, _, _ = select.select(fds, [], [], remaining)
            for fd in ready:
                if fd == child.pidfd:
                    child.dead = True
                    fds.remove(fd)
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    fds.remove(fd)
                elif fd == child.reply_r:
                    reply += chunk
                    if len(reply) > _MAX_REPLY + 4:
                        too_big = True
                else:
                    err_tail += chunk
                    if len(err_tail) > 8192:
                        del err_tail[:-4096]
            if too_big:
                break
            if child.dead and child.reply_r not in fds and child.err_r not in fds:
                continue  # everything it wrote has been read: check for a frame once more, then stop
        if frame is not None:
            keep = not child.dead and frame != self.mem_reply
            return frame, keep
        if timed_out:
            return self.enc.encode({"ok": False, "kind": "timeout",
                                    "error": f"{label} exceeded {timeout_s} s wall time"}), False
        if too_big:
            return self.enc.encode({"ok": False, "kind": "exception",
                                    "error": f"{label} returned more than {_MAX_REPLY // _MB} MB"}), False
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, child.status = os.waitpid(child.pid, 0)
        return self.enc.encode(_death(child.status, label, cpu_s, self.cfg, bytes(err_tail))), False


def _cpu_used() -> int:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return int(ru.ru_utime + ru.ru_stime)


def _death(status: int, label: str, cpu_s: int, cfg: dict[str, Any], stderr: bytes) -> dict[str, Any]:
    """The reply for a call whose process died without answering."""
    kind = "crash"
    if os.WIFEXITED(status):
        what = f"worker exited with code {os.WEXITSTATUS(status)}"
    else:
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            kind, what = "cpu", f"{label} exceeded the CPU time limit ({cpu_s} s)"
        elif sig == signal.SIGXFSZ:
            what = f"{label} exceeded the file size limit ({cfg['max_file_mb']} MB)"
        elif sig == signal.SIGKILL:
            what = "worker killed by SIGKILL (out of memory?)"
        else:
            what = f"worker crashed with {_signal_name(sig)}"
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    hint = next((ln.strip() for ln in lines if "Fatal Python error" in ln), "")
    if hint:
        what += f" (stderr: {hint[:200]})"
    return {"ok": False, "kind": kind, "error": what}


def _worker_main() -> None:
    """Entry point of a worker (zygote) process: confine itself, load what calls need, signal
    ready, then fork one child per call until its stdin closes."""
    cfg = json.loads(sys.argv[1])
    in_fd, out_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # input() sees EOF
    os.dup2(2, 1)  # print() goes to stderr, not into the protocol stream
    os.close(devnull)
    if cfg.get("drop_to"):
        _drop_privileges(*cfg["drop_to"])
    _die_with_parent()
    _not_dumpable()
    import faulthandler

    faulthandler.enable()  # a segfault leaves a traceback on stderr for the error message
    sys.dont_write_bytecode = True
    from shared.answer import install_karenina_aliases

    install_karenina_aliases()
    for mod in cfg["preload"]:
        importlib.import_module(mod)
    import select  # noqa: F401 - imported before seccomp and forks, used by every call

    if not cfg.get("scratch"):
        cfg["scratch"] = os.path.realpath(tempfile.mkdtemp(prefix="veribus-sandbox-"))
    if cfg.get("seccomp_zygote"):
        _load_seccomp(base64.b64decode(cfg["seccomp_zygote"]))
    zygote = _Zygote(cfg, out_fd, in_fd)
    reader = os.fdopen(in_fd, "rb", buffering=1 << 16)
    import gc

    gc.collect()
    gc.freeze()  # the calls' collector never walks (and so never copies) the zygote's pages
    _send(out_fd, zygote.enc.encode({"ready": True, "pid": os.getpid(), "uid": os.getuid()}))
    zygote.serve(reader)


# =========================================================================== parent side


_KINDS = frozenset({"exception", "exit", "timeout", "memory", "cpu", "crash", "unavailable", "closed"})


def _checked_reply(dec: msgspec.msgpack.Decoder, payload: Any, label: str) -> dict[str, Any]:
    """A reply frame as the pool's callers may rely on it. User code can write its own frame
    into the reply pipe, so the shape is checked here, in the service, not trusted."""
    try:
        msg = dec.decode(payload)
    except msgspec.DecodeError:
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


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


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

    async def start(self) -> None:
        pool = self.pool
        jail = pool.jail
        cfg_d: dict[str, Any] = {
            "memory_mb": pool.memory_mb, "max_open_files": pool.max_open_files, "max_file_mb": pool.max_file_mb,
            "max_procs": pool.max_procs, "preload": list(pool.preload), "audit": pool.audit_hook,
            "tag": pool.tag}  # the tag in every process's cmdline: tests find them all
        boot = f"import sys; sys.path.insert(0, {_ROOT!r}); from shared.sandbox import _worker_main; _worker_main()"
        if jail.mode == "jail":
            cfg_d.update(scratch="/tmp", drop_to=list(jail.drop_to) if jail.drop_to else None,
                         seccomp_zygote=base64.b64encode(jail.seccomp_zygote).decode(),
                         seccomp_call=base64.b64encode(jail.seccomp_call).decode())
            argv = [*bwrap_argv(jail.bwrap, pool.tmp_mb, pool.tag, privileged=jail.privileged),
                    sys.executable, "-I", "-c", boot, json.dumps(cfg_d)]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            cwd = "/"
        else:
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
        self.jail = sandbox_jail.plan(self.tmp_mb)  # fixed for the pool's life; probed once per process
        self.tag = f"veribus-sandbox-{os.getpid()}-{next(_pool_ids)}"  # in each worker's argv/env: find them all
        if self.jail.mode == "unsafe":
            log.warning(sandbox_jail.UNSAFE_WARNING)
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
        _default = Sandbox(
            workers=int(os.environ.get("VERIBUS_SANDBOX_WORKERS", "2")),
            timeout_s=float(os.environ.get("VERIBUS_SANDBOX_TIMEOUT_S", "10.0")),
            memory_mb=int(os.environ.get("VERIBUS_SANDBOX_MEMORY_MB", "512")),
        )
    return _default


@atexit.register
def _reap_at_exit() -> None:
    for pool in list(_live_pools):
        pool.terminate()


__all__ = ["Sandbox", "get_sandbox", "BUILTINS"]
