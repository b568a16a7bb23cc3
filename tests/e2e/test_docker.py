"""The deployment shape of docker-compose.yml, end to end, with the real server images: a
three-node NATS cluster (`nats:2.11-alpine`) and a ClickHouse server
(`clickhouse/clickhouse-server:25.8`) in containers (testcontainers), the simulator and every
service as local processes pointed at them by VERIBUS_NATS_URL (all three nodes) and
VERIBUS_CLICKHOUSE_URL. One run goes through; its results are read from the ClickHouse server.

Needs a Docker engine. Where there is none (as on the machine this was written on), every test
here is skipped with the reason; nothing about the ClickHouse server path is claimed tested then.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.workload import expected_verdicts
from shared.control import lifecycle, processes, runner, stack, wait
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, Settings, VerificationConfig
from shared.runtime import bus
from tests.support.stack import generated_benchmark, verdicts

pytestmark = pytest.mark.docker

NATS_IMAGE = "nats:2.11-alpine"
CLICKHOUSE_IMAGE = "clickhouse/clickhouse-server:25.8"
N = 20


def docker_unavailable() -> str | None:
    """Why the Docker tests cannot run here, or None when they can."""
    try:
        import docker
        import testcontainers  # noqa: F401
    except ImportError as exc:
        return f"testcontainers / docker SDK not installed ({exc}); pip install '.[test]'"
    try:
        docker.from_env().ping()
    except Exception as exc:  # noqa: BLE001 - any failure means: no engine to talk to
        return f"no Docker engine reachable (docker.from_env().ping() failed: {exc})"
    return None


@pytest.fixture(scope="module")
def engine() -> None:
    reason = docker_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def deployment(engine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """NATS cluster + ClickHouse server containers on one Docker network."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.network import Network
    from testcontainers.core.waiting_utils import wait_for_logs

    names = ["nats-1", "nats-2", "nats-3"]
    started: list[Any] = []
    with Network() as net:
        try:
            for name in names:
                routes = ",".join(f"nats://{o}:6222" for o in names if o != name)
                c = (DockerContainer(NATS_IMAGE)
                     .with_command(f"-n {name} -js -sd /data -m 8222 --cluster_name veribus "
                                   f"--cluster nats://0.0.0.0:6222 --routes {routes}")
                     .with_network(net).with_network_aliases(name).with_exposed_ports(4222, 8222))
                c.start()
                started.append(c)
            for c in started:
                wait_for_logs(c, "Server is ready", timeout=60)
            ch = (DockerContainer(CLICKHOUSE_IMAGE)
                  .with_env("CLICKHOUSE_DB", "veribus").with_env("CLICKHOUSE_USER", "veribus")
                  .with_env("CLICKHOUSE_PASSWORD", "veribus").with_network(net).with_exposed_ports(8123))
            ch.start()
            started.append(ch)
            _wait_http(f"http://{ch.get_container_host_ip()}:{ch.get_exposed_port(8123)}/ping", 120)
            for c in started[:3]:
                _wait_http(f"http://{c.get_container_host_ip()}:{c.get_exposed_port(8222)}/healthz", 120)
            nats_url = ",".join(f"nats://{c.get_container_host_ip()}:{c.get_exposed_port(4222)}" for c in started[:3])
            ch_url = f"http://veribus:veribus@{ch.get_container_host_ip()}:{ch.get_exposed_port(8123)}/veribus"
            home = tmp_path_factory.mktemp("docker") / "home"
            yield Settings(nats_url=nats_url, clickhouse_url=ch_url, home=home)
        finally:
            for c in reversed(started):
                c.stop()


def _wait_http(url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s")


@pytest.fixture(scope="module")
def services(deployment: Settings) -> Iterator[tuple[Settings, str]]:
    """The simulator and every service as local processes, pointed at the containers."""
    home = deployment.home.resolve()
    (home / "logs").mkdir(parents=True, exist_ok=True)
    sport = processes.free_port()
    env = {**os.environ, "VERIBUS_NATS_URL": deployment.nats_url, "VERIBUS_CLICKHOUSE_URL": deployment.clickhouse_url
           or "", "VERIBUS_HOME": str(home), "VERIBUS_CONSUMER_ACK_WAIT_S": "10", processes.STACK_MARKER: str(home)}
    procs = [processes.spawn("simulator", [sys.executable, "-m", "infra.simulator", "--host", "127.0.0.1", "--port",
                                        str(sport)], env, home / "logs", port=sport)]
    try:
        bus.wait_for_port("127.0.0.1", sport, 30)
        for name in stack.SERVICES:
            procs.append(processes.spawn(name, [sys.executable, "-m", f"services.{name}"], env, home / "logs"))
        stack.wait_ready(stack.StackState(home=str(home), nats_url=deployment.nats_url, simulator_url=None,
                                          procs=procs), timeout=120)
        yield deployment, f"http://127.0.0.1:{sport}/v1"
    finally:
        processes.stop_procs(procs)


def test_one_run_end_to_end_on_containers(services: tuple[Settings, str], tmp_path: Path) -> None:
    import clickhouse_connect
    import httpx

    settings, sim = services
    path, script = generated_benchmark(tmp_path / "bench.yaml", N, prefix="Docker")
    httpx.post(sim.removesuffix("/v1") + "/simulator/script", json=script, timeout=10).raise_for_status()
    config = VerificationConfig(
        answering_models=[ModelConfig(model_name="openai/sim-answerer", api_base=sim)],
        parsing_models=[ModelConfig(model_name="openai/sim-judge", api_base=sim)],
        evaluation_mode="template_and_rubric")
    plan = runner.plan_run(Benchmark.load(path), config)
    asyncio.run(runner.submit(settings, plan))
    done, timed_out = asyncio.run(wait.wait_for_results(settings, plan.run_id, count=N, timeout=180))
    assert not timed_out and done == N
    got = asyncio.run(lifecycle.run_results(settings, plan.run_id))
    assert verdicts(got) == expected_verdicts(N)

    async def replicas() -> int:
        nc = await bus.connect(settings)
        try:
            return (await nc.jetstream().stream_info(events.STREAM)).config.num_replicas
        finally:
            await nc.close()

    assert asyncio.run(replicas()) == 3
    client = clickhouse_connect.get_client(dsn=settings.clickhouse_url)
    deadline = time.monotonic() + 120
    count = 0
    while time.monotonic() < deadline:
        count = client.query("SELECT count() FROM verification_results FINAL WHERE run_id = {r:String}",
                             parameters={"r": plan.run_id}).result_rows[0][0]
        if count >= N:
            break
        time.sleep(0.5)
    assert count == N, f"the ClickHouse server has {count}/{N} rows of the run"
    passed = client.query("SELECT countIf(verify_result) FROM verification_results FINAL WHERE run_id = {r:String}",
                          parameters={"r": plan.run_id}).result_rows[0][0]
    assert passed == sum(expected_verdicts(N).values())

