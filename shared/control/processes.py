"""The local stack's processes, each identified by its PID *and* create time (a PID the kernel
gave to another program since is never mistaken for one of ours): starting one in its own
session with its own bus role, knowing when it is ready, and stopping it with whatever is left in
its process group. Every process carries `VERIBUS_STACK=<home>`, which finds orphans."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from shared.runtime import bus_auth

READY_MARKERS = (" ready", "app started successfully")  # StageService / FastStream start-up lines
STACK_MARKER = "VERIBUS_STACK"  # env var naming the stack home, on every process `up` starts
CREATE_TIME_TOLERANCE_S = 0.05  # psutil create times are in clock ticks (10 ms)


_GIVEN_PORTS: set[int] = set()  # every port free_port has handed out in this process


def free_port() -> int:
    """A port free now and never handed out before by this process. The kernel may give the same
    port to two binds in a row once the first socket is closed, and the processes of one stack
    bind theirs only when they start: two services once got the same metrics port, and one died."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port
    raise RuntimeError("no free port that this process has not handed out already")


def claim_port(port: int) -> bool:
    """Whether `port` on loopback is free for a server to bind now (nothing listens on it, and
    a bind with SO_REUSEADDR, as servers bind, succeeds: a closed connection's TIME_WAIT does
    not count). A free one is never handed out by `free_port` afterwards."""
    if listening(port):
        return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    _GIVEN_PORTS.add(port)
    return True


def is_nats(name: str) -> bool:
    """A NATS node: `nats` (one server) or `nats-1` .. `nats-N` (a cluster)."""
    return name == "nats" or (name.startswith("nats-") and name[5:].isdigit())


def is_service(name: str) -> bool:
    """A veribus service (neither a NATS node nor the simulator)."""
    return not is_nats(name) and name != "simulator"


@dataclass
class Proc:
    name: str
    pid: int
    cmd: list[str]
    log: str
    log_offset: int = 0  # where this process's output starts in its (appended) log
    create_time: float | None = None  # with the PID, the process's identity
    pgid: int | None = None  # its own process group (started in a new session)
    port: int | None = None  # NATS nodes: client port
    http_port: int | None = None  # NATS nodes: monitoring port (/healthz)
    metrics_port: int | None = None  # services: /healthz /readyz /metrics (shared.runtime.observability)

    def log_text(self) -> str:
        """What this process has logged so far (not earlier runs that used the same log file)."""
        path = Path(self.log)
        if not path.is_file():  # not yet written, or a probe built without one (`Path("")` is ".")
            return ""
        with path.open("rb") as fh:
            fh.seek(self.log_offset)
            return fh.read().decode(errors="replace")

    def ready(self) -> bool:
        """True once the service's /readyz says so (or, without a metrics port, once it logged
        that it is ready); raises if it died during start-up."""
        if self.metrics_port is not None:
            if readyz(self.metrics_port):
                return True
        elif any(marker in self.log_text() for marker in READY_MARKERS):
            return True
        if not self.alive():
            text = self.log_text()
            tail = "\n".join(text.splitlines()[-15:])
            raise RuntimeError(f"service {self.name} exited during start-up; log {self.log}:\n{tail}")
        return False

    def process(self) -> psutil.Process | None:
        """The running process that is this one: same PID *and* same create time (a PID the
        kernel gave to another program since is not ours); None when it is gone or a zombie.
        Entries saved before create times were recorded are matched by command line."""
        try:
            p = psutil.Process(self.pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return None
            if self.create_time is not None:
                if abs(p.create_time() - self.create_time) > CREATE_TIME_TOLERANCE_S:
                    return None
            elif p.cmdline() != self.cmd:
                return None
            return p
        except psutil.Error:
            return None

    def alive(self) -> bool:
        return self.process() is not None


def readyz(port: int, timeout: float = 1.0) -> bool:
    """GET /readyz on a service's metrics port: True on 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=timeout) as resp:  # noqa: S310
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def spawn(name: str, cmd: list[str], env: dict[str, str], logdir: Path, **extra: Any) -> Proc:
    log = logdir / f"{name}.log"
    offset = log.stat().st_size if log.exists() else 0
    fh = os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")  # handed to the child
    os.chmod(log, 0o600)
    env = bus_auth.service_env(name, env)  # its own bus role; provider keys only where models are called
    proc = subprocess.Popen(  # umask 077: logs, the NATS store and the chdb folder are private to the stack's user
        cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        umask=0o077,
    )
    fh.close()
    try:
        created: float | None = psutil.Process(proc.pid).create_time()  # a zombie still has one
    except psutil.Error:
        created = None
    return Proc(name=name, pid=proc.pid, cmd=cmd, log=str(log), log_offset=offset, create_time=created,
                pgid=proc.pid, **extra)


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _group_is_ours(p: Proc) -> bool:
    """Whether the process group `p.pgid` is still the one `p` led. Linux does not hand out a
    PID that is still some group's id, so: if the leader's PID now belongs to a different
    process, our group had emptied before that; otherwise any members are our leftovers."""
    if p.pgid is None:
        return False
    try:
        leader = psutil.Process(p.pgid)
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
    if p.create_time is None:
        return False
    try:
        return abs(leader.create_time() - p.create_time) <= CREATE_TIME_TOLERANCE_S
    except psutil.Error:
        return True


def _group_members(pgid: int) -> list[psutil.Process]:
    out = []
    for q in psutil.process_iter():
        try:
            if q.pid != os.getpid() and os.getpgid(q.pid) == pgid and q.status() != psutil.STATUS_ZOMBIE:
                out.append(q)
        except (psutil.Error, OSError):
            continue
    return out


def _terminate(procs: list[psutil.Process], timeout: float) -> None:
    """SIGTERM, wait, then SIGKILL what is left (each process as identified by psutil, which
    checks its create time again before signalling)."""
    for q in procs:
        try:
            q.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for q in alive:
        try:
            q.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def stop_proc(p: Proc, timeout: float = 10.0) -> None:
    """Stop one stack process (if it is still ours) and whatever is left in its process group."""
    stop_procs([p], timeout)


def stop_procs(procs: list[Proc], timeout: float = 10.0) -> None:
    """Stop several stack processes at once (SIGTERM, then SIGKILL after `timeout`), each only
    if it is still ours, then whatever is left in their process groups."""
    live = [q for q in (p.process() for p in procs) if q is not None]
    if live:
        _terminate(live, timeout)
    left = [m for p in procs if _group_is_ours(p) for m in _group_members(p.pgid or -1)]
    if left:
        _terminate(left, timeout)


def marked_processes(home: Path) -> Iterator[psutil.Process]:
    """Live processes whose environment says they belong to the stack at `home` (every process
    `up` starts carries `VERIBUS_STACK=<home>`, and their children inherit it)."""
    mark = str(Path(home).resolve())
    me = os.getpid()
    for q in psutil.process_iter():
        try:
            if q.pid == me or q.status() == psutil.STATUS_ZOMBIE:
                continue
            if q.environ().get(STACK_MARKER) == mark:
                yield q
        except (psutil.Error, OSError):
            continue


def stop_orphans(home: Path, keep: set[int] | None = None, timeout: float = 10.0) -> list[str]:
    """Stop processes of this stack that `stack.json` does not account for (`keep`: PIDs that
    it does). Returns a description of each."""
    found = [q for q in marked_processes(home) if q.pid not in (keep or set())]
    names = []
    for q in found:
        try:
            names.append(f"orphan {q.pid} ({' '.join(q.cmdline()[-2:])})")
        except psutil.Error:
            names.append(f"orphan {q.pid}")
    if found:
        _terminate(found, timeout)
    return names


def kill_proc(p: Proc, timeout: float = 10.0) -> None:
    """kill -9 one process (if it is still ours) and wait until it is gone (crash tests)."""
    live = p.process()
    if live is None:
        return
    try:
        live.kill()
    except psutil.Error:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.alive():
        time.sleep(0.02)


def wait_proc_ready(p: Proc, timeout: float = 60.0) -> None:
    """Wait until one (re)started service logs that it is ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.ready():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{p.name} not ready after {timeout:.0f}s")
