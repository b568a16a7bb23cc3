"""Cluster settings and stack bookkeeping without a bus: server lists, replica rules, the nats
config each node gets, and process identity (a reused PID is not one of ours)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from nats import errors as nats_errors
from nats.js import errors as js_errors
from pydantic import ValidationError

from shared.control import nats_nodes, processes, stack
from shared.core.config import Settings
from shared.runtime import bus
from shared.runtime.content import ContentStore


def test_nats_url_takes_a_comma_separated_server_list() -> None:
    s = Settings(nats_url="nats://a:4222, nats://b:4223,c:4224")
    assert s.nats_servers == ["nats://a:4222", "nats://b:4223", "nats://c:4224"]
    assert bus.connect_options(s)["servers"] == s.nats_servers


@pytest.mark.parametrize("bad", ["http://a:4222", "nats://a:99999", "nats://:4222", " , ", "nats://a:4222,ftp://b:1"])
def test_a_bad_server_url_is_named(bad: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(nats_url=bad)
    text = str(err.value)
    assert "VERIBUS_NATS_URL" in text
    named = [u.strip() for u in bad.split(",") if u.strip() and not u.strip().startswith("nats://a:4222")]
    assert all(u in text for u in named), text


def test_stream_replicas_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERIBUS_STREAM_REPLICAS", "2")
    assert Settings.from_env().stream_replicas == 2
    assert bus.replicas_override(None) == 2
    monkeypatch.setenv("VERIBUS_STREAM_REPLICAS", "0")
    with pytest.raises(ValueError, match="VERIBUS_STREAM_REPLICAS='0'"):  # from_env names the variable
        Settings.from_env()
    with pytest.raises(ValueError, match="VERIBUS_STREAM_REPLICAS"):
        bus.replicas_override(None)
    monkeypatch.delenv("VERIBUS_STREAM_REPLICAS")
    assert bus.replicas_override(None) is None


class _Conn:
    """The one thing `cluster_size` reads from a nats-py client: the server's INFO."""

    def __init__(self, info: dict) -> None:
        self._server_info = info


@pytest.mark.parametrize("info,size", [
    ({}, 1),
    ({"connect_urls": ["127.0.0.1:1"]}, 1),  # no cluster name: a standalone server
    ({"cluster": "veribus", "connect_urls": ["127.0.0.1:1", "127.0.0.1:2"]}, 2),
    ({"cluster": "veribus", "connect_urls": [f"127.0.0.1:{i}" for i in range(5)]}, 5),
])
def test_replicas_are_min_three_and_cluster_size(info: dict, size: int) -> None:
    nc = _Conn(info)
    assert bus.cluster_size(nc) == size  # type: ignore[arg-type]
    assert bus.desired_replicas(nc, Settings()) == min(3, size)  # type: ignore[arg-type]
    assert bus.desired_replicas(nc, Settings(stream_replicas=1)) == 1  # type: ignore[arg-type]
    assert bus.stream_config(bus.desired_replicas(nc, Settings())).num_replicas == min(3, size)  # type: ignore[arg-type]


def test_a_cluster_still_forming_gets_the_replicas_of_the_nodes_listed() -> None:
    """A node answers before its routes are all up and advertises fewer members: the nodes the
    URL lists count (docker-compose's stream-init would otherwise make a stream of one replica
    for good); a standalone server stays at one whatever the URL lists."""
    three = Settings(nats_url="nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222")
    forming = _Conn({"cluster": "veribus", "connect_urls": ["127.0.0.1:1"]})
    assert bus.desired_replicas(forming, three) == 3  # type: ignore[arg-type]
    assert bus.desired_replicas(forming, Settings()) == 1  # type: ignore[arg-type]
    assert bus.desired_replicas(_Conn({"connect_urls": ["127.0.0.1:1"]}), three) == 1  # type: ignore[arg-type]


def test_transient_cluster_errors_are_retried_and_others_are_not() -> None:
    assert bus.cluster_not_ready(nats_errors.TimeoutError())
    assert bus.cluster_not_ready(js_errors.ServiceUnavailableError(code=503, description="JetStream not ready"))
    assert bus.cluster_not_ready(js_errors.APIError(code=500, description="insufficient resources"))
    assert not bus.cluster_not_ready(js_errors.BadRequestError(code=400, description="stream name in use"))
    assert not bus.cluster_not_ready(ValueError("bad"))


def test_cluster_node_configs(tmp_path: Path) -> None:
    nodes = nats_nodes.plan_nats_nodes(tmp_path, 3)
    assert [n.name for n in nodes] == ["nats-1", "nats-2", "nats-3"]
    ports = [p for n in nodes for p in (n.port, n.http_port, n.cluster_port)]
    assert len(set(ports)) == 9, "every node gets its own client, monitoring and route port"
    confs = nats_nodes.write_nats_configs(Settings(nats_token="tok-secret"), tmp_path, nodes)
    for n in nodes:
        text = confs[n.name].read_text()
        assert oct(confs[n.name].stat().st_mode & 0o777) == "0o600"
        assert f'server_name: "{n.name}"' in text and f'listen: "127.0.0.1:{n.port}"' in text
        assert f"127.0.0.1:{n.cluster_port}\"\n" in text  # its own route listener
        routes = text.split("routes: [", 1)[1].split("]", 1)[0]
        assert f":{n.cluster_port}" not in routes, "a node does not route to itself"
        assert all(f":{o.cluster_port}" in routes for o in nodes if o is not n)
        assert 'token: "tok-secret"' in text
        assert str(n.store) in text


def test_single_node_config_has_no_cluster(tmp_path: Path) -> None:
    [node] = nats_nodes.plan_nats_nodes(tmp_path, 1)
    assert node.name == "nats" and node.cluster_port is None and node.store == tmp_path / "nats"
    text = nats_nodes.nats_config(Settings(), node, [node])
    assert "cluster" not in text and "authorization" not in text
    with pytest.raises(ValueError, match="at least 1"):
        nats_nodes.plan_nats_nodes(tmp_path, 0)


def test_a_reused_pid_is_not_ours(tmp_path: Path) -> None:
    """A stack.json entry whose PID now belongs to another program (same PID, other create
    time) is dead: not reported alive, not signalled by `stop_proc`/`kill_proc`."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = psutil.Process(other.pid)
        ours = processes.Proc(name="x", pid=other.pid, cmd=me.cmdline(), log=str(tmp_path / "x.log"),
                          create_time=me.create_time(), pgid=other.pid)
        assert ours.alive()
        impostor = processes.Proc(name="parsing", pid=other.pid, cmd=[sys.executable, "-m", "services.parsing"],
                              log=str(tmp_path / "p.log"), create_time=me.create_time() - 5.0, pgid=other.pid)
        assert not impostor.alive()
        processes.stop_proc(impostor, timeout=1)
        processes.kill_proc(impostor, timeout=1)
        assert other.poll() is None, "a process that merely reuses the PID is left alone"
        legacy = processes.Proc(name="parsing", pid=other.pid, cmd=[sys.executable, "-m", "services.parsing"],
                            log=str(tmp_path / "p.log"))
        assert not legacy.alive(), "without a create time, the command line must match"
    finally:
        other.kill()
        other.wait(10)
    assert not ours.alive()


def test_old_stack_json_still_loads(tmp_path: Path) -> None:
    """stack.json written before identities and clusters were recorded."""
    old = {"home": str(tmp_path), "nats_url": "nats://127.0.0.1:4222", "simulator_url": None, "started_at": 1.0,
           "procs": [{"name": "nats", "pid": 999999, "cmd": ["nats-server"], "log": "x", "log_offset": 0}]}
    (tmp_path / "stack.json").write_text(json.dumps(old))
    state = stack.StackState.load(tmp_path)
    assert state is not None and state.nats_cluster == 1
    assert [p.name for p in state.nats_procs()] == ["nats"] and state.procs[0].create_time is None
    assert [p.name for p in state.dead()] == ["nats"]


def test_is_nats() -> None:
    assert processes.is_nats("nats") and processes.is_nats("nats-2")
    assert not processes.is_nats("nats-x") and not processes.is_nats("generation") and not processes.is_nats("natsy")


def test_env_marks_stack_processes(tmp_path: Path) -> None:
    state = stack.StackState(home=str(tmp_path), nats_url="nats://127.0.0.1:1,nats://127.0.0.1:2",
                             simulator_url=None)
    env = state.env()
    assert env[processes.STACK_MARKER] == str(tmp_path)
    assert Settings(nats_url=env["VERIBUS_NATS_URL"]).nats_servers == ["nats://127.0.0.1:1", "nats://127.0.0.1:2"]


def test_orphans_are_found_by_the_stack_marker_and_only_ours(tmp_path: Path) -> None:
    """A process carrying VERIBUS_STACK=<this home> that stack.json does not list is an orphan
    and is stopped; one marked with another home, or unmarked, is left alone."""
    home = tmp_path / "home"
    home.mkdir()
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    ours = subprocess.Popen(sleeper, env={**os.environ, processes.STACK_MARKER: str(home)})
    other_home = subprocess.Popen(sleeper, env={**os.environ, processes.STACK_MARKER: str(tmp_path / "elsewhere")})
    unmarked = subprocess.Popen(sleeper, env={k: v for k, v in os.environ.items() if k != processes.STACK_MARKER})
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ours.pid not in {q.pid for q in processes.marked_processes(home)}:
            time.sleep(0.05)  # until the child has exec'd with its environment
        assert [q.pid for q in processes.marked_processes(home)] == [ours.pid]
        assert stack.status(Settings(home=home))["orphans"] == [ours.pid]
        stopped = processes.stop_orphans(home, timeout=5)
        assert len(stopped) == 1 and str(ours.pid) in stopped[0]
        assert ours.wait(10) is not None
        assert other_home.poll() is None and unmarked.poll() is None
        assert list(processes.marked_processes(home)) == []
    finally:
        for p in (ours, other_home, unmarked):
            p.kill()
            p.wait(10)


async def test_creation_steps_down_replicas_only_when_placement_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster that cannot place 3 replicas now (a node is down) gets the bucket/stream with
    fewer rather than a failed run; any other error is raised as it is."""
    from nats.js import errors as js_errors

    monkeypatch.setattr(bus, "PLACEMENT_RETRY_S", 0.3)
    tried: list[int] = []

    async def create(n: int) -> str:
        tried.append(n)
        if n > 2:
            raise js_errors.BadRequestError(code=400, err_code=10005,
                                            description="no suitable peers for placement, peer offline")
        return f"made with {n}"

    assert await bus._create_placed(create, 3, "bucket t", result=lambda n, made: (n, made)) == (2, "made with 2")
    assert set(tried) == {3, 2} and tried[-1] == 2

    async def refused(n: int) -> str:
        raise js_errors.BadRequestError(code=400, err_code=10058, description="stream name already in use")

    with pytest.raises(js_errors.BadRequestError, match="already in use"):
        await bus._create_placed(refused, 3, "stream t", result=lambda n, made: made)


class _FlakyBucket:
    """A content bucket just created on a three-node cluster: its first puts find no stream leader."""

    def __init__(self, failures: list[BaseException]) -> None:
        self.failures, self.puts, self.data = failures, 0, {}

    async def put(self, key: str, value: bytes) -> int:
        self.puts += 1
        if self.failures:
            raise self.failures.pop(0)
        self.data[key] = value
        return self.puts


async def test_a_content_put_waits_for_a_forming_cluster_and_refuses_the_rest() -> None:
    """The fresh-clone CI's first cluster run failed to submit: `nats: no response from stream` on
    the content bucket it had just created. A put is retried while the cluster is not ready; any
    other error is raised at once."""
    store = ContentStore(lambda: None)
    store._kv = _FlakyBucket([js_errors.NoStreamResponseError(), nats_errors.NoRespondersError()])
    assert await store.put_many([("c_key", b'{"question_text": "2+2?"}')]) == 1
    assert (store._kv.puts, list(store._kv.data)) == (3, ["c_key"])
    store = ContentStore(lambda: None)
    store._kv = _FlakyBucket([js_errors.BadRequestError(code=400, description="invalid key")])
    with pytest.raises(js_errors.BadRequestError):
        await store.put_many([("c_key", b"{}")])
    assert store._kv.puts == 1
