"""The worker side of the template sandbox: what runs inside a worker process.

A worker (started by `shared.templates.sandbox` as `python -c …_worker_main`) moves its own fd 1
to stderr, sets its resource limits, isolates itself (`_isolate`: an audit hook refusing
fork/exec, sockets, ctypes, signals and writes outside a scratch folder; a private network
namespace where the kernel allows it), then serves length-prefixed msgpack calls of the
functions named in `BUILTINS` until EOF."""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import json
import os
import resource
import signal
import struct
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import msgspec

from shared.templates.answer import install_karenina_aliases

_HDR = struct.Struct("<I")

_MB = 1024 * 1024

# Functions a worker may run, by short name: (module:function, what to call it in errors).
BUILTINS: dict[str, tuple[str, str]] = {
    "ping": ("shared.templates.jail:_ping", "code"),
    "exec": ("shared.templates.jail:_exec_snippet", "code"),
    "validate_template": ("shared.templates.calls:worker_validate", "template"),
    "verify_template": ("shared.templates.calls:worker_verify", "template"),
    "callable_trait": ("shared.templates.calls:worker_callable", "callable trait"),
}
PRELOAD: tuple[str, ...] = ("shared.templates.calls",)

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

def _arm_cpu(cpu_s: int) -> None:
    """RLIMIT_CPU counts the process's whole life: allow `cpu_s` more seconds from now."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    _set_limit(resource.RLIMIT_CPU, int(ru.ru_utime + ru.ru_stime) + cpu_s)

def _die_with_parent() -> None:
    """Best effort (Linux): SIGKILL this worker when the service process goes away."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - non-Linux: the stdin EOF still ends an idle worker
        pass

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

def _isolate() -> str:
    """Confine user code, after the worker's own setup and before any user code runs:
    - a private network namespace when the kernel allows it (root on Linux): no route anywhere;
    - a PEP 578 audit hook (cannot be removed) that refuses process creation, signals, sockets,
      ctypes, and writes outside a private scratch folder - which becomes cwd and TMPDIR.
    RLIMIT_NPROC does not bind root and there is no mount isolation, so these are the layers that
    stop a template forking, phoning out or writing into the service's files."""
    scratch = os.path.realpath(tempfile.mkdtemp(prefix="veribus-sandbox-"))
    os.chdir(scratch)
    os.environ["TMPDIR"] = scratch
    tempfile.tempdir = scratch
    sys.dont_write_bytecode = True
    if os.environ.get("VERIBUS_SANDBOX_NETNS", "1") != "0":
        try:
            ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET; refused when unprivileged
        except Exception:  # noqa: BLE001 - best effort: the audit hook still refuses sockets
            pass
    prefix = scratch + os.sep

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in _BLOCKED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed in template code")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if isinstance(path, int) or path is None:
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS)
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
    return scratch

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

def _worker_main() -> None:
    """Entry point of a worker process: set up, signal ready, then serve calls until EOF."""
    cfg = json.loads(sys.argv[1])
    in_fd, out_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # input() sees EOF
    os.dup2(2, 1)  # print() goes to stderr, not into the protocol stream
    os.close(devnull)
    _die_with_parent()

    faulthandler.enable()  # a segfault leaves a traceback on stderr for the parent's message

    install_karenina_aliases()
    for mod in cfg["preload"]:
        importlib.import_module(mod)
    _apply_limits(cfg)
    if cfg.get("isolate", True):
        _isolate()
    cpu_s = int(cfg["cpu_s"])
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    mem_reply = enc.encode({"ok": False, "kind": "memory", "recycle": True,
                            "error": f"memory limit {cfg['memory_mb']} MB exceeded"})
    reader = os.fdopen(in_fd, "rb", buffering=1 << 16)
    funcs: dict[str, Callable[..., Any]] = {}
    _send(out_fd, enc.encode({"ready": True, "pid": os.getpid()}))
    while True:
        head = reader.read(4)
        if len(head) < 4:
            os._exit(0)
        body = reader.read(_HDR.unpack(head)[0])
        recycle = False
        try:
            try:
                fn_name, kwargs = dec.decode(body)
                fn = _resolve(fn_name, funcs)
                _arm_cpu(cpu_s)
                reply = enc.encode({"ok": True, "value": fn(**kwargs)})
            except MemoryError:
                raise
            except SystemExit as exc:
                reply = enc.encode({"ok": False, "kind": "exit", "error": f"code called sys.exit({exc.code!r})"})
            except BaseException as exc:  # noqa: BLE001 - user code may raise anything
                tb = "".join(traceback.format_exception(exc))[-4000:]
                reply = enc.encode({"ok": False, "kind": "exception", "error": f"{type(exc).__name__}: {exc}",
                                    "traceback": tb})
        except MemoryError:
            reply, recycle = mem_reply, True  # the heap may be fragmented or poisoned: start afresh
        _send(out_fd, reply)
        if recycle:
            os._exit(0)
