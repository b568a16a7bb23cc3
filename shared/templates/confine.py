"""What a sandbox worker does to itself, inside the jail (`shared.templates.boundary` builds
the jail around it): rlimits, parent-death signal, not dumpable, dropping to the sandbox uid,
loading a seccomp-BPF program, Landlock per call process, and the audit hook (defence in depth)."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from typing import Any

from shared.templates.protocol import _MB


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


# Landlock scopes (ABI 6): no signal to a process outside the call's own domain (a sibling call
# process, the zygote), kernel-sent SIGIO of an owned descriptor included; no connection to an
# abstract unix socket made outside it
_LL_SCOPE_ABSTRACT_UNIX_SOCKET, _LL_SCOPE_SIGNAL = 1 << 0, 1 << 1


class _LLRulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _LLRulesetAttrScoped(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


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
    so call processes of other runs (same uid) cannot see or plant files in each other's; from
    ABI 6 on, it signals no process outside its own domain either."""
    abi = landlock_abi()
    if abi < 1:
        raise RuntimeError("Landlock is not available")
    handled = _LL_ABI1 | (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0) | (
        _LL_IOCTL_DEV if abi >= 5 else 0)
    libc = ctypes.CDLL(None, use_errno=True)
    attr: Any = (_LLRulesetAttrScoped(handled, 0, _LL_SCOPE_SIGNAL | _LL_SCOPE_ABSTRACT_UNIX_SOCKET)
                 if abi >= 6 else _LLRulesetAttr(handled))
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
