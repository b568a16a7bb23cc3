"""The sandbox worker's zygote: it never runs user code, and forks the processes that do (a
fresh one per call, or one per scope), enforces each call's wall time, reports how a call process
died, and empties the scratch folder. `shared.templates.jail` starts it."""

from __future__ import annotations

import base64
import hashlib
import os
import resource
import select
import shutil
import signal
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from shared.templates.confine import _apply_limits, _audit_hook, _landlock_confine, _load_seccomp, _set_limit
from shared.templates.protocol import (
    _HDR,
    _MAX_REPLY,
    _MB,
    _label,
    _read_exact,
    _resolve,
    _send,
    _signal_name,
)


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

    def pause(self) -> None:
        """Stop a scope's process between its calls: its reply frame may have been written by
        the template itself, which then runs on (past its wall time and CPU limit, beside other
        runs' calls); stopped, it runs only while its own run's next call is timed."""
        try:
            os.kill(self.pid, signal.SIGSTOP)
        except ProcessLookupError:
            self.dead = True

    def resume(self) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            self.dead = True

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
            if scope:
                child.resume()
            reply, keep = self._exchange(child, fn_name, kwargs, timeout_s, cpu_s)
            if scope and keep:
                child.pause()
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
