"""Shared fixtures: a real nats-server on a free port, and the reference material paths.
Every process a fixture starts is stopped by its teardown, by PID.

Tiers follow the folders: every test under `tests/unit` is marked `unit`, under
`tests/integration` `integration`, under `tests/e2e` `e2e`. `make test-fast` runs
`-m "unit or smoke"` (the unit tests and the one small stack test marked `smoke`); `make test`
runs everything. Builders and helpers the test modules share live in `tests/support/`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the read-only reference material sits beside the repository (worktrees sit one level deeper)
SHARED = next((p / "shared" for p in REPO.parents if (p / "shared" / "reference").is_dir()), REPO.parent / "shared")
REFERENCE = SHARED / "reference" / "karenina"
CHECKPOINTS = REFERENCE / "checkpoints"
LLM_RESPONSES = REFERENCE / "llm_responses" / "claude-haiku-4-5"
EXAMPLE = REPO / "examples" / "example.yaml"

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the tier of its folder, so `-m unit` selects exactly tests/unit."""
    for item in items:
        parts = Path(str(item.path)).relative_to(REPO / "tests").parts
        if parts and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


@dataclass
class NatsServer:
    url: str
    port: int
    store: Path
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def start(self) -> None:
        """(Re)start on the same port and store: JetStream state survives a restart."""
        from shared.runtime.bus import wait_for_port

        self.proc = _spawn_nats(self.port, self.store)
        wait_for_port("127.0.0.1", self.port, 10)


def _spawn_nats(port: int, store: Path) -> subprocess.Popen[bytes]:
    from shared.control.nats_nodes import nats_server_binary

    return subprocess.Popen(
        [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    from shared.control.processes import free_port
    from shared.runtime.bus import wait_for_port

    port = free_port()
    store = tmp_path / "nats"
    proc = _spawn_nats(port, store)
    server = NatsServer(url=f"nats://127.0.0.1:{port}", port=port, store=store, proc=proc)
    try:
        wait_for_port("127.0.0.1", port, 10)
        yield server
    finally:
        server.stop()


def python() -> str:
    return sys.executable


# ---- a NATS cluster: N real nats-server nodes on free loopback ports ----


@dataclass
class NatsCluster:
    """Real nats-server nodes routed into one cluster, configured by `shared.control.nats_nodes.nats_config`
    (the same function `veribus up --nats-cluster N` uses). Nodes can be killed (-9) and
    started again on the same ports and stores."""

    home: Path
    nodes: list  # list[shared.control.nats_nodes.NatsNode]
    procs: dict[str, subprocess.Popen[bytes]]
    confs: dict[str, Path]

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{n.port}" for n in self.nodes]

    @property
    def url(self) -> str:
        """All nodes, comma-separated: what VERIBUS_NATS_URL takes."""
        return ",".join(self.urls)

    def node(self, name: str):  # noqa: ANN201
        return next(n for n in self.nodes if n.name == name)

    def start(self, name: str) -> None:
        from shared.control.nats_nodes import nats_server_binary

        log = open(self.home / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        self.procs[name] = subprocess.Popen([str(nats_server_binary()), "-c", str(self.confs[name])],
                                            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """SIGSTOP one node (the other two commit without it, and its copy falls behind), and
        SIGCONT it on leaving, whatever happened meanwhile."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            proc.send_signal(signal.SIGCONT)

    def healthy(self, name: str) -> bool:
        """/healthz ok and every member's client URL known (see `nats_nodes.nats_healthy`)."""
        from shared.control.nats_nodes import nats_healthy
        from shared.control.processes import Proc

        n = self.node(name)
        probe = Proc(name=name, pid=self.procs[name].pid, cmd=[], log="", port=n.port, http_port=n.http_port)
        return nats_healthy(probe, len(self.nodes))

    def wait_healthy(self, names: list[str] | None = None, timeout: float = 60.0) -> None:
        import time

        deadline = time.monotonic() + timeout
        pending = list(names or [n.name for n in self.nodes])
        while pending and time.monotonic() < deadline:
            pending = [n for n in pending if not (self.alive(n) and self.healthy(n))]
            if pending:
                time.sleep(0.1)
        if pending:
            raise TimeoutError(f"NATS nodes not healthy after {timeout:.0f}s: {pending}")

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)


def start_nats_cluster(home: Path, size: int = 3) -> NatsCluster:
    from shared.control.nats_nodes import plan_nats_nodes, write_nats_configs
    from shared.core.config import Settings

    home.mkdir(parents=True, exist_ok=True)
    nodes = plan_nats_nodes(home, size)
    for n in nodes:
        n.store.mkdir(parents=True, exist_ok=True)
    cluster = NatsCluster(home=home, nodes=nodes, procs={}, confs=write_nats_configs(Settings(), home, nodes))
    try:
        for n in nodes:
            cluster.start(n.name)
        cluster.wait_healthy()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A three-node cluster for one test; every node is stopped by the teardown."""
    cluster = start_nats_cluster(tmp_path / "cluster", 3)
    try:
        yield cluster
    finally:
        cluster.stop()
