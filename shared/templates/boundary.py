"""The OS boundary around template code: a bubblewrap jail, a separate uid, seccomp and rlimits.

Layers, outermost first (each one holds on its own; see README "Threat model"):

1. **bubblewrap jail** (`bwrap`, Debian package `bubblewrap`): new mount, pid, network, IPC, UTS
   and cgroup namespaces. The filesystem is an empty read-only root with only the Python
   installation, the virtualenv, the shared libraries and `shared/` bound read-only, a fresh
   `/proc` of the jail's own pid namespace, a minimal read-only `/dev`, and a small tmpfs `/tmp`
   (the scratch folder, emptied after every call). The environment is cleared. No route exists
   to any network, no other process is visible, so none can be signalled or traced.
   - As root, bwrap runs privileged (no user namespace is needed, so this holds where
     unprivileged user namespaces are disabled); the worker then drops to a separate
     unprivileged uid/gid (`VERIBUS_SANDBOX_UID`, default 65534) before it imports anything.
   - As any other user, bwrap creates an unprivileged user namespace (mapped to that user).
2. **seccomp** (filters built with libseccomp via `pyseccomp` in the service, loaded in the jail
   as raw BPF): the zygote may not exec, open sockets, trace, mount, unshare, load keys/BPF or
   create SysV/POSIX IPC; each call's process additionally may not fork, clone or signal, nor
   own a descriptor (F_SETOWN, F_SETSIG: the kernel would signal its owner for it).
3. **rlimits** in each call's process: address space, CPU seconds, open files, file size, no
   core files and RLIMIT_NPROC = 0 (it binds because the uid is not root).
4. **fresh process per call**: the zygote (which never runs user code) forks a child for each
   call; the child exits after replying, so no interpreter state survives a call.

If the jail cannot be set up the sandbox fails closed: every call returns an `unavailable`
error naming the reason. `VERIBUS_SANDBOX=unsafe` is the explicit, loudly logged opt-out.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from shared.core.config import Settings

_ROOT = str(Path(__file__).resolve().parents[2])  # the repository root
UID_ENV = "VERIBUS_SANDBOX_UID"
DEFAULT_UID = 65534  # nobody
UNSAFE_WARNING = (
    "VERIBUS_SANDBOX=unsafe: template code and callable traits run WITHOUT an OS boundary "
    "(no namespaces, no seccomp, no separate uid); use this only with benchmarks you trust"
)

# System calls refused to the zygote and to every call's process (EPERM unless noted).
_DENY_ALWAYS = (
    "execve", "execveat",
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "move_mount", "open_tree",
    "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "syslog", "personality", "name_to_handle_at",
    "open_by_handle_at", "lookup_dcookie", "vhangup", "uselib",
    "shmget", "shmat", "msgget", "semget", "mq_open", "mq_unlink",
)
# ... and additionally to each call's process: no new processes or threads, no signals.
_DENY_CALL = (
    "fork", "vfork", "clone", "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "pidfd_open", "pidfd_send_signal", "setsid", "setpgid", "prctl", "setpriority", "ioprio_set",
)
# ... nor signals the kernel sends for it: a descriptor's owner (F_SETOWN and kin) gets its
# SIGIO, and F_SETSIG makes that any signal, SIGKILL included, for any process of the same uid
# (another run's process, the zygote). Refused by (system call, argument index, value).
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX = 8, 10, 15
_FIOSETOWN, _SIOCSPGRP = 0x8901, 0x8902
_DENY_CALL_ARGS = (
    ("fcntl", 1, _F_SETOWN), ("fcntl", 1, _F_SETSIG), ("fcntl", 1, _F_SETOWN_EX),
    ("ioctl", 1, _FIOSETOWN), ("ioctl", 1, _SIOCSPGRP),
)
# ... nor change another process's limits or scheduling, which the kernel allows any process of
# the same uid (no ptrace check, non-dumpable or not): prlimit(RLIMIT_CPU, 1) on the zygote got it
# killed with every run's process in it, and RLIMIT_NOFILE 0 left later calls failing. Refused
# when the pid argument is not 0 (the caller itself; `resource.setrlimit` passes 0), and to
# zygote and calls alike; setpriority (a whole process group or user with who=0) and ioprio_set
# are refused outright (_DENY_CALL).
_DENY_OTHER_PID = (("prlimit64", 0), ("sched_setaffinity", 0), ("sched_setscheduler", 0),
                   ("sched_setparam", 0), ("sched_setattr", 0), ("migrate_pages", 0), ("move_pages", 0))


@dataclass
class JailPlan:
    """How workers are started: `bwrap_argv(...)` + [python, ...]; `drop_to` = (uid, gid) for the
    worker to switch to at start (privileged bwrap), None when bwrap already mapped the user."""

    mode: str  # "jail" or "unsafe"
    privileged: bool = False  # bwrap runs as root (no user namespace); the worker drops to `drop_to`
    bwrap: str = ""
    drop_to: tuple[int, int] | None = None
    seccomp_zygote: bytes = b""
    seccomp_call: bytes = b""
    landlock_abi: int = 0  # > 0: each call process also confines itself with Landlock
    layers: list[str] = field(default_factory=list)
    error: str | None = None  # set: the jail cannot be used; calls fail closed with this message


def _build_bpf(deny: tuple[str, ...], deny_args: tuple[tuple[str, int, int], ...] = ()) -> bytes:
    """Compile a default-allow filter refusing `deny`, each (system call, argument index, value)
    of `deny_args`, and each (system call, pid argument) of `_DENY_OTHER_PID` with a pid other than
    0, to BPF (libseccomp, native arch; other architectures such as x32 are killed by libseccomp's
    bad-arch action)."""
    # local import: pyseccomp raises at import when libseccomp is missing, and
    # that must become the sandbox's fail-closed message, not an import error of every service
    import pyseccomp as sc

    filt = sc.SyscallFilter(sc.ALLOW)
    for name in deny:
        action = sc.ERRNO(errno.ENOSYS) if name == "clone3" else sc.ERRNO(errno.EPERM)
        try:
            filt.add_rule(action, name)
        except (OSError, ValueError, RuntimeError):  # unknown to this kernel/libseccomp: nothing to refuse
            continue
    for name, index, value in deny_args:  # these exist on every Linux: a failure fails closed
        filt.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(index, sc.EQ, value))
    for name, index in _DENY_OTHER_PID:  # likewise
        filt.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(index, sc.NE, 0))
    fd = os.memfd_create("veribus-seccomp")
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            filt.export_bpf(f)
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def _ro_paths() -> list[str]:
    """What the jail shows read-only: the interpreter, its stdlib, the venv and site-packages."""
    paths = {sys.base_prefix, sys.prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            paths.add(p)
    real = {os.path.realpath(p) for p in paths if p and os.path.isdir(p)}
    real |= {p for p in paths if p and os.path.isdir(p)}
    # drop paths inside another bound path (bound once, with the parent)
    out = sorted(real)
    return [p for p in out if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in out)]


def _parents(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _jail_settings() -> Settings:
    """The jail's settings (`Settings.sandbox*`), read when asked: a test or the bench switches
    `VERIBUS_SANDBOX` between pools in one process."""
    return Settings.from_env("sandbox", "sandbox_uid", "sandbox_bwrap")


def bwrap_path(explicit: str | None = None) -> str | None:
    """The bwrap binary: `explicit` (`Settings.sandbox_bwrap`, `VERIBUS_SANDBOX_BWRAP`) if set,
    else the one on PATH."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("bwrap") or ("/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None)


def bwrap_argv(bwrap: str, tmp_mb: int, tag: str, *, privileged: bool) -> list[str]:
    """The bwrap command line (without the program to run)."""
    argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv", "--hostname", "veribus-sandbox"]
    if privileged:
        # root: no user namespace needed; the worker drops to the sandbox uid itself, first thing
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    # the scratch tmpfs /tmp first: the read-only binds below go on top of it, so a repository or
    # venv that itself lives under /tmp (a CI checkout) stays visible inside the jail
    argv += ["--tmpfs", "/", "--perms", "1777", "--size", str(int(tmp_mb) * 1024 * 1024), "--tmpfs", "/tmp"]
    made: set[str] = {"/tmp"}
    binds = [*_ro_paths(), os.path.join(_ROOT, "shared")]
    for p in binds:
        for parent in _parents(p):
            if parent not in made:
                argv += ["--perms", "0755", "--dir", parent]
                made.add(parent)
    for p in binds:
        argv += ["--ro-bind", p, p]
        made.add(p)
    for lib in ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64"):
        if lib in made or any(lib.startswith(b.rstrip("/") + "/") for b in binds):
            continue
        if os.path.islink(lib):
            argv += ["--symlink", os.readlink(lib), lib]
        elif os.path.isdir(lib):
            if lib.startswith("/usr/") and "/usr" not in made:
                argv += ["--perms", "0755", "--dir", "/usr"]
                made.add("/usr")
            argv += ["--ro-bind", lib, lib]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
             "--setenv", "PATH", "/nonexistent", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
             "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
             "--setenv", "PYTHONNOUSERSITE", "1",
             "--setenv", "OMP_NUM_THREADS", "1", "--setenv", "OPENBLAS_NUM_THREADS", "1",
             "--setenv", "MKL_NUM_THREADS", "1", "--setenv", "VERIBUS_SANDBOX_TAG", tag, "--"]
    return argv


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when it has none (an extra layer, not required)."""
    try:
        abi = ctypes.CDLL(None, use_errno=True).syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)


def sandbox_uid(raw: str = str(DEFAULT_UID)) -> tuple[int, int]:
    """The uid/gid a root service's sandbox drops to (`Settings.sandbox_uid`); never root."""
    try:
        uid = int(raw)
    except ValueError:
        raise ValueError(f"{UID_ENV}={raw!r} is not a number") from None
    if uid <= 0:
        raise ValueError(f"{UID_ENV}={uid}: the sandbox uid must not be root")
    return uid, uid


def _probe(argv: list[str], drop_to: tuple[int, int] | None) -> str | None:
    """Start a trivial jailed Python: None if it runs as intended, else why not."""
    code = ("import os,sys\n"
            "d=sys.argv[1]\n"
            "if d:\n u,g=map(int,d.split(':')); os.setgroups([]); os.setresgid(g,g,g); os.setresuid(u,u,u)\n"
            "print(os.getuid(), len(os.listdir('/proc')) < 64, os.getpid())")
    cmd = [*argv, sys.executable, "-S", "-c", code, f"{drop_to[0]}:{drop_to[1]}" if drop_to else ""]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env={"PATH": os.environ.get("PATH", "")})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run: {exc}"
    if r.returncode != 0:
        return f"bwrap failed (exit {r.returncode}): {r.stderr.strip()[-300:]}"
    out = r.stdout.split()
    if len(out) != 3 or out[0] == "0":
        return f"jailed process did not drop root (got {r.stdout.strip()!r})"
    return None


_plan_cache: dict[tuple[str, int, str, str], JailPlan] = {}


def plan(tmp_mb: int = 64) -> JailPlan:
    """Decide (once per process and setting) how sandbox workers are started."""
    try:
        conf = _jail_settings()
    except ValueError as exc:  # a bad VERIBUS_SANDBOX* value: fail closed, naming it
        return JailPlan(mode="jail", error=str(exc))
    mode = conf.sandbox
    key = (mode, tmp_mb, conf.sandbox_bwrap or "", conf.sandbox_uid)
    if key not in _plan_cache:
        _plan_cache[key] = _decide(mode, tmp_mb, conf)
    return _plan_cache[key]


def _decide(mode: str, tmp_mb: int, conf: Settings) -> JailPlan:
    """The plan for one mode and setting: unsafe, or a jail probed here (its error says why not)."""
    if mode == "unsafe":
        return JailPlan(mode="unsafe", layers=["separate process", "scrubbed environment", "rlimits",
                                               "audit hook (not a boundary)"])
    hint = (" (install bubblewrap: apt-get install bubblewrap; run as root or enable unprivileged user "
            "namespaces; or set VERIBUS_SANDBOX=unsafe to run template code without an OS boundary)")
    result = JailPlan(mode="jail")
    if sys.platform != "linux":
        result.error = "the template sandbox needs Linux namespaces and seccomp" + hint
    elif bwrap_path(conf.sandbox_bwrap) is None:
        result.error = f"bubblewrap (bwrap) is not installed or not executable ({conf.sandbox_bwrap or 'PATH'})" + hint
    else:
        try:
            result.seccomp_zygote = _build_bpf(_DENY_ALWAYS + ("clone3",))
            result.seccomp_call = _build_bpf(_DENY_ALWAYS + _DENY_CALL + ("clone3",), _DENY_CALL_ARGS)  # stands on its own too
        except Exception as exc:  # noqa: BLE001 - no libseccomp / pyseccomp: fail closed
            result.error = f"cannot build the seccomp filter ({type(exc).__name__}: {exc})" + hint
    if result.error is None:
        privileged = result.privileged = os.geteuid() == 0
        result.bwrap = bwrap_path(conf.sandbox_bwrap) or ""
        try:
            result.drop_to = sandbox_uid(conf.sandbox_uid) if privileged else None
        except ValueError as exc:
            result.error = str(exc)
        if result.error is None:
            why = _probe(bwrap_argv(result.bwrap, tmp_mb, "probe", privileged=privileged), result.drop_to)
            result.landlock_abi = _landlock_abi()
            if why is not None:
                result.error = f"the sandbox jail cannot be set up: {why}" + hint
            else:
                result.layers = [
                    "bubblewrap jail: mount, pid, net, ipc, uts namespaces" + ("" if privileged else ", user"),
                    f"separate uid {result.drop_to[0]}" if result.drop_to else "user namespace",
                    "seccomp (no exec, sockets, ptrace, mount, IPC; per call no fork/clone/signals)",
                    "rlimits (memory, CPU, files, file size, NPROC=0)",
                    *([f"Landlock ABI {result.landlock_abi} (a call sees only its own scratch folder)"]
                      if result.landlock_abi else []),
                    "fresh process per call (fork from a clean zygote)",
                ]
    return result


__all__ = ["JailPlan", "plan", "bwrap_argv", "UNSAFE_WARNING"]
