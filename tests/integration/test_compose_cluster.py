"""docker-compose.yml's NATS cluster, checked without Docker: the three nodes' command lines
(the same flags, run by the local nats-server binary with container host names, ports and
volumes mapped to loopback and a temporary folder) form one JetStream cluster that gives the
stream three replicas, every service is given all three nodes, and the bus roles are in force:
the one-shot `bus-auth` command's credentials, the nodes' authorization block, the one-shot
`stream-init` as `cli`, each service as its own role. (The containers themselves run in
tests/e2e/test_docker.py, where a Docker engine exists.)"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import psutil
import pytest
import yaml
from nats.errors import NoServersError
from nats.js.errors import NotFoundError

from shared.control import nats_nodes, processes
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus, bus_auth
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


SERVICES = ("projector", "generation", "guards", "parsing", "verification", "rubric", "finalization")


def _mount(svc: dict, target: str) -> str:
    """The volume mounted at `target` in a compose service, with its mode ('volume:target[:ro]')."""
    found = [v for v in svc.get("volumes", []) if v.split(":")[1] == target]
    assert len(found) == 1, (target, svc.get("volumes"))
    return found[0]


def test_every_service_connects_as_its_own_role_with_read_only_credentials() -> None:
    doc = _compose()
    auth = doc["services"]["bus-auth"]
    assert auth["command"][-3:] == ["shared.runtime.bus_auth", "--keep", "/auth"]  # kept across `up`s
    assert _mount(auth, "/auth") == "bus-auth:/auth"
    for name in SERVICES:
        svc = doc["services"][name]
        env = svc["environment"]
        assert env["VERIBUS_NATS_ROLE"] == name and name in bus_auth.roles(), name
        assert env["VERIBUS_NATS_CREDENTIALS"] == "/auth/auth/credentials.json"
        assert _mount(svc, "/auth") == "bus-auth:/auth:ro", name
        assert svc["depends_on"]["stream-init"] == {"condition": "service_completed_successfully"}, name
        assert not any(k.startswith(("VERIBUS_NATS_USER", "VERIBUS_NATS_PASSWORD", "VERIBUS_NATS_TOKEN")) for k in env)
        # provider keys (.env) only where model calls are made, as the local stack gives them
        assert bool(svc.get("env_file")) is (name not in bus_auth.NO_MODEL_CALLS), name
    init = doc["services"]["stream-init"]
    assert init["environment"]["VERIBUS_NATS_ROLE"] == "cli" and init["command"][-1] == "shared.runtime.bus"
    for node in _nats_services(doc).values():
        assert node["command"][:2] == ["-c", "/auth/auth/nats-auth.conf"]
        assert _mount(node, "/auth") == "bus-auth:/auth:ro"
        assert node["depends_on"]["bus-auth"] == {"condition": "service_completed_successfully"}


def _run_one_shot(doc: dict, name: str, auth_home: Path, env: dict[str, str] | None = None) -> str:
    """Run a one-shot compose service's command here, its `/auth` volume at `auth_home`."""
    cmd = [sys.executable if a == "python" else a.replace("/auth", str(auth_home), 1) if a.startswith("/auth") else a
           for a in doc["services"][name]["command"]]
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_services_that_run_template_code_may_make_the_sandbox_jail() -> None:
    """A service whose code imports the template sandbox (`shared.templates`) gets the rights
    bubblewrap needs in a container; without them its sandbox fails closed and every template
    call errors. The others keep Docker's defaults."""
    doc = _compose()
    sandboxed = {d.name for d in (REPO / "services").iterdir() if d.is_dir()
                 and any("from shared.templates" in f.read_text() for f in d.glob("*.py"))}
    assert sandboxed >= {"parsing", "verification", "rubric"}, sandboxed
    for name in SERVICES:
        svc = doc["services"][name]
        if name in sandboxed:
            assert svc.get("cap_add") == ["SYS_ADMIN"], name
            assert {"seccomp=unconfined", "apparmor=unconfined"} <= set(svc.get("security_opt", [])), name
        else:
            assert "cap_add" not in svc and "security_opt" not in svc, name


@pytest.fixture
def compose_nodes(tmp_path: Path) -> Iterator[tuple[list[subprocess.Popen[bytes]], list[int], list[int], Path]]:
    """Run the compose file's one-shot `bus-auth` and three nats command lines locally, each
    container's host name and ports mapped to free loopback ports, the `bus-auth` volume to a
    folder; yields the nodes, their client and monitoring ports and that folder."""
    doc = _compose()
    auth_home = tmp_path / "bus-auth"
    _run_one_shot(doc, "bus-auth", auth_home)
    nodes = _nats_services(doc)
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
                a = a.replace("/auth/", f"{auth_home}/", 1) if a.startswith("/auth/") else a
                a = {"/data": str(tmp_path / name), "8222": str(http[name])}.get(a, a)
                args.append(a)
            assert f"nats://127.0.0.1:{route[name]}" in args and "-js" in args
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child
            procs.append(subprocess.Popen([str(nats_nodes.nats_server_binary()), *args, "-a", "127.0.0.1",
                                           "-p", str(client[name])], stdout=log, stderr=subprocess.STDOUT))
            log.close()
        yield procs, [client[n] for n in names], [http[n] for n in names], auth_home
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


async def test_the_compose_nats_commands_form_a_three_replica_cluster_with_the_roles_in_force(compose_nodes) -> None:
    procs, clients, https, auth_home = compose_nodes
    logs = [str(auth_home.parent / f"nats-{i + 1}.log") for i in range(len(procs))]
    # Identified by create time and logging to its own file: right after Popen returns, the child's
    # /proc cmdline can still read empty (exec has not set up its arguments yet), and a probe that
    # compared command lines once took a live node for a dead one.
    probes = [processes.Proc(name=f"nats-{i + 1}", pid=p.pid, cmd=list(p.args), log=log, port=c, http_port=h,
                             create_time=psutil.Process(p.pid).create_time())
              for i, (p, c, h, log) in enumerate(zip(procs, clients, https, logs, strict=True))]
    await asyncio.to_thread(nats_nodes.wait_nats_healthy, probes, 60.0, 3)
    url = ",".join(f"nats://127.0.0.1:{c}" for c in clients)
    creds = auth_home / "auth" / "credentials.json"

    # nobody gets on without credentials
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await nats.connect(url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)

    # a service's role may not create the stream; the one-shot stream-init, as `cli`, does
    gen = await bus.connect(Settings(nats_url=url, nats_role="generation", nats_credentials=str(creds)))
    try:
        with pytest.raises((nats.errors.Error, TimeoutError)):  # its request to the JetStream API is dropped
            await asyncio.wait_for(bus.ensure_stream(gen.jetstream(), Settings(nats_url=url)), 5)
    finally:
        await gen.close()
    cli = await bus.connect(Settings(nats_url=url, nats_role="cli", nats_credentials=str(creds)))
    try:
        with pytest.raises(NotFoundError):
            await cli.jetstream().stream_info(events.STREAM)
    finally:
        await cli.close()
    env = {"VERIBUS_NATS_URL": url, "VERIBUS_NATS_ROLE": "cli", "VERIBUS_NATS_CREDENTIALS": str(creds)}
    assert "ready" in _run_one_shot(_compose(), "stream-init", auth_home, env)
    cli = await bus.connect(Settings(nats_url=url, nats_role="cli", nats_credentials=str(creds)))
    try:
        assert bus.cluster_size(cli) == 3
        assert (await cli.jetstream().stream_info(events.STREAM)).config.num_replicas == 3
        before = (await cli.jetstream().stream_info(events.STREAM)).state.messages
    finally:
        await cli.close()

    # the generation role's own output is stored; a result forged on its connection is not
    gen = await bus.connect(Settings(nats_url=url, nats_role="generation", nats_credentials=str(creds)))
    try:
        await gen.jetstream().publish(events.subject(events.ANSWER_GENERATED, "run1", "r1"), b"{}")
        await gen.publish(events.subject(events.RESULT_FINALIZED, "run1", "r1"), b"{}")
        await gen.flush()
        await asyncio.sleep(0.3)
    finally:
        await gen.close()

    # bus-auth again (the next `docker compose up`) keeps the credentials the nodes enforce
    kept = json.loads(creds.read_text())
    _run_one_shot(_compose(), "bus-auth", auth_home)
    assert json.loads(creds.read_text()) == kept
    cli = await bus.connect(Settings(nats_url=url, nats_role="cli", nats_credentials=str(creds)))
    try:
        assert (await cli.jetstream().stream_info(events.STREAM)).state.messages == before + 1
    finally:
        await cli.close()
