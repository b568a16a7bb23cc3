"""The worker side of the template sandbox: what runs inside a jailed worker process.

A worker is started by `shared.templates.sandbox` inside the jail that
`shared.templates.boundary` describes (bubblewrap namespaces, a separate uid, a cleared
environment) as `python -I -c …_worker_main`. It drops to the sandbox uid, makes itself not
dumpable, imports what calls need, loads the zygote's seccomp filter and becomes a *zygote*: it
never runs user code, and forks the processes that do. A call without a scope gets a fresh
process that sets its rlimits (memory, CPU, files, file size, NPROC=0, no core), loads the
per-call seccomp filter (no fork/clone/exec/signals/sockets), runs in an empty scratch folder
and exits; a call with a scope (a run id) goes to that scope's own process. The zygote enforces
the wall time (SIGKILL of the call process), reports how a call process died, and empties the
scratch folder after every one-shot call.

Protocol: length-prefixed msgpack frames over the worker's stdin/stdout (fd 1 is moved to
stderr; a call's prints go to a pipe the zygote drains).
"""

from __future__ import annotations

import base64
import ctypes
import faulthandler
import gc
import hashlib
import importlib
import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from shared.templates.answer import install_karenina_aliases

_HDR = struct.Struct("<I")
_MB = 1024 * 1024
_MAX_REPLY = 64 * _MB

# Functions a worker may run, by short name: (module:function, what to call it in errors).
BUILTINS: dict[str, tuple[str, str]] = {
    "ping": ("shared.templates.jail:_ping", "code"),
    "exec": ("shared.templates.jail:_exec_snippet", "code"),
    "validate_template": ("shared.templates.calls:worker_validate", "template"),
    "verify_template": ("shared.templates.calls:worker_verify", "template"),
    "callable_trait": ("shared.templates.calls:worker_callable", "callable trait"),
}
PRELOAD: tuple[str, ...] = ("shared.templates.calls",)


def _label(fn_name: str) -> str:
    return BUILTINS[fn_name][1] if fn_name in BUILTINS else "code"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"



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
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - non-Linux: the stdin EOF still ends an idle worker
        pass


def _not_dumpable() -> None:
    """The zygote's /proc/<pid>/{mem,environ,...} become root-owned: a call process (same uid)
    cannot write into the zygote's memory to leave state for later calls."""
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


# Landlock filesystem rights (linux/landlock.h), by the ABI version that introduced them
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_LL_ABI1 = (1 << 13) - 1
_LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_LL_FILE_RIGHTS = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV


class _LLRulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _LLPathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: not available)."""
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    return max(int(abi), 0)


def _landlock_confine(scratch: str) -> None:
    """Landlock, per call process: everything in the jail but /tmp is read-only, /dev is
    read/write (device nodes), and the only other place it may touch is its own scratch folder,
    so call processes of other runs (same uid) cannot see or plant files in each other's."""
    abi = landlock_abi()
    if abi < 1:
        raise RuntimeError("Landlock is not available")
    handled = _LL_ABI1 | (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0) | (
        _LL_IOCTL_DEV if abi >= 5 else 0)
    libc = ctypes.CDLL(None, use_errno=True)
    attr = _LLRulesetAttr(handled)
    ruleset = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    read = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
    rules = [("/" + name, read) for name in os.listdir("/") if name not in ("tmp", "dev")]
    rules += [("/dev", read | _LL_WRITE_FILE | (_LL_IOCTL_DEV & handled)), (scratch, handled)]
    # the read-only Python the jail binds may itself live under /tmp (a CI checkout and its venv)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # shared/
    rules += [(p, read) for p in sorted({*sys.path, sys.prefix, sys.exec_prefix, pkg})
              if p.startswith("/tmp/") and os.path.isdir(p)]
    try:
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                if not os.path.isdir(path):
                    access &= _LL_FILE_RIGHTS
                rule = _LLPathBeneath(access & handled, fd)
                if libc.syscall(445, ruleset, 1, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
            finally:
                os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS (already set in the jail)
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
        if libc.syscall(446, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)


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
        if cfg.get("landlock"):
            _landlock_confine(scratch)
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
    faulthandler.enable()  # a segfault leaves a traceback on stderr for the error message
    sys.dont_write_bytecode = True
    install_karenina_aliases()
    for mod in cfg["preload"]:
        importlib.import_module(mod)
    if not cfg.get("scratch"):
        cfg["scratch"] = os.path.realpath(tempfile.mkdtemp(prefix="veribus-sandbox-"))
    if cfg.get("seccomp_zygote"):
        _load_seccomp(base64.b64decode(cfg["seccomp_zygote"]))
    zygote = _Zygote(cfg, out_fd, in_fd)
    reader = os.fdopen(in_fd, "rb", buffering=1 << 16)
    gc.collect()
    gc.freeze()  # the calls' collector never walks (and so never copies) the zygote's pages
    _send(out_fd, zygote.enc.encode({"ready": True, "pid": os.getpid(), "uid": os.getuid()}))
    zygote.serve(reader)



__all__ = ["BUILTINS", "PRELOAD"]
