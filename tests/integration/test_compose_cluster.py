"""docker-compose.yml's NATS cluster, checked without Docker: the three nodes' command lines
(the same flags, run by the local nats-server binary with container host names and ports mapped
to loopback) form one JetStream cluster that gives the stream three replicas, and every service
is given all three nodes. (The containers themselves run in tests/e2e/test_docker.py, where a
Docker engine exists.)"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from shared.control import nats_nodes, processes
from shared.core.config import Settings
from shared.runtime import bus
from tests.conftest import REPO

COMPOSE = REPO / "docker-compose.yml"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _nats_services(doc: dict) -> dict[str, dict]:
    return {name: svc for name, svc in doc["services"].items() if "nats" in str(svc.get("image", ""))}


def test_every_service_gets_all_three_nodes() -> None:
    doc = _compose()
    nodes = _nats_services(doc)
    assert sorted(nodes) == ["nats-1", "nats-2", "nats-3"]
    for name in ("projector", "generation", "guards", "parsing", "verification", "rubric", "finalization"):
        svc = doc["services"][name]
        urls = Settings(nats_url=svc["environment"]["VERIBUS_NATS_URL"]).nats_servers
        assert sorted(urls) == [f"nats://{n}:4222" for n in sorted(nodes)], name
        assert {f"nats-{i}" for i in (1, 2, 3)} <= set(svc["depends_on"])
    assert "clickhouse" in doc["services"]


@pytest.fixture
def compose_nodes(tmp_path: Path) -> Iterator[tuple[list[subprocess.Popen[bytes]], list[int], list[int]]]:
    """Run the compose file's three nats command lines locally, each container's host name and
    ports mapped to free loopback ports."""
    nodes = _nats_services(_compose())
    names = sorted(nodes)
    client = {n: processes.free_port() for n in names}
    route = {n: processes.free_port() for n in names}
    http = {n: processes.free_port() for n in names}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in names:
            args = []
            for a in nodes[name]["command"]:
                for other in names:
                    a = a.replace(f"nats://{other}:6222", f"nats://127.0.0.1:{route[other]}")
                a = a.replace("nats://0.0.0.0:6222", f"nats://127.0.0.1:{route[name]}")
                a = {"/data": str(tmp_path / name), "8222": str(http[name])}.get(a, a)
                args.append(a)
            assert f"nats://127.0.0.1:{route[name]}" in args and "-js" in args
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child
            procs.append(subprocess.Popen([str(nats_nodes.nats_server_binary()), *args, "-a", "127.0.0.1",
                                           "-p", str(client[name])], stdout=log, stderr=subprocess.STDOUT))
            log.close()
        yield procs, [client[n] for n in names], [http[n] for n in names]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


async def test_the_compose_nats_commands_form_a_three_replica_cluster(compose_nodes) -> None:
    procs, clients, https = compose_nodes
    probes = [processes.Proc(name=f"nats-{i + 1}", pid=p.pid, cmd=psutil.Process(p.pid).cmdline(), log="", port=c,
                         http_port=h) for i, (p, c, h) in enumerate(zip(procs, clients, https, strict=True))]
    await asyncio.to_thread(nats_nodes.wait_nats_healthy, probes, 60.0, 3)
    settings = Settings(nats_url=",".join(f"nats://127.0.0.1:{c}" for c in clients))
    nc = await bus.connect(settings)
    try:
        assert bus.cluster_size(nc) == 3
        assert await bus.ensure_stream(nc.jetstream(), settings) == 3
    finally:
        await nc.close()
