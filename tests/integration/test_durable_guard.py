"""A service's durable consumer against the `cli` role, on a real nats-server with the stack's
bus roles (`bus_auth.generate`, the configuration `veribus up` writes): every JetStream API route
an attacker holding `cli` could take to re-point, replace, reset, pause or delete the
`verification` durable is refused and leaves it as it was (before the roles named every create,
an unnamed create re-pointed its filter at `vb.nothing.*.*` and every later run timed out); the
operator's own paths that follow and read the stream still work under those roles; and a durable
changed anyway (as admin) is put back when its service starts (`durables.settle_consumer`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats import errors as nats_errors

from shared.control import rebuild_parallel, runner, streams
from shared.control.nats_nodes import nats_server_binary, plan_nats_nodes, write_nats_configs
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus, bus_auth
from shared.runtime.harness import StageService
from tests.support.procs import stop_process
from tests.support.results import make

pytestmark = pytest.mark.integration

DURABLE = "verification"
FILTER = events.subscription(events.TEMPLATE_PARSED)
RUN = "guardrun"


@dataclass
class RoleServer:
    home: Path
    url: str

    def settings(self, role: str) -> Settings:
        return Settings(home=self.home, nats_url=self.url, nats_role=role)


@pytest.fixture(scope="module")
def role_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoleServer]:
    """One nats-server with the stack's role permissions, as `veribus up` configures it."""
    home = tmp_path_factory.mktemp("guard") / "home"
    home.mkdir(mode=0o700)
    nodes = plan_nats_nodes(home, 1)
    conf = write_nats_configs(Settings(), home, nodes, bus_auth.generate(home).read_text())[nodes[0].name]
    proc = subprocess.Popen([str(nats_server_binary()), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        bus.wait_for_port("127.0.0.1", nodes[0].port, 10)
        server = RoleServer(home, f"nats://127.0.0.1:{nodes[0].port}")
        asyncio.run(_prepare_stream(server))
        yield server
    finally:
        stop_process(proc)


async def _prepare_stream(server: RoleServer) -> None:
    async with bus.session(server.settings("admin"), ensure=True):
        pass


async def _connect(server: RoleServer, role: str, errors: list[str]) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    opts = bus.connect_options(server.settings(role))
    opts.update(allow_reconnect=False, max_reconnect_attempts=0, error_cb=on_error)
    return await nats.connect(**opts)


def _stage_event(i: int) -> events.Envelope:
    job = events.Job(run_id=RUN, result_id=f"g{i:04d}", answer_id=f"g{i:04d}", question_id=f"q{i}",
                     question_text="2+2?", answering=events.ModelSpec(model_name="openai/a"),
                     parsing=events.ModelSpec(model_name="openai/j"), timestamp="2026-01-01T00:00:00+00:00")
    return events.make_envelope(events.TEMPLATE_PARSED, RUN, job.result_id, events.StageEvent(job, events.State()),
                                "parsing")


def _service(server: RoleServer, handled: list[str] | None = None) -> StageService:
    """The verification service's durable as the harness makes it, as its own role."""
    svc = StageService("verification", server.settings("verification"))

    @svc.handles(events.TEMPLATE_PARSED, events.StageEvent)
    async def on_parsed(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
        if handled is not None:
            handled.append(env.result_id)
        return []

    return svc


@pytest.fixture
async def durable(role_nats: RoleServer) -> AsyncIterator[None]:
    """A fresh `verification` durable, made by its own role, with queued work: two of its messages
    pulled, one acked (so a reset or a pull by anyone else changes what the server holds)."""
    admin = await bus.connect(role_nats.settings("admin"))
    try:
        try:
            await admin.jetstream().delete_consumer(events.STREAM, DURABLE)
        except nats.js.errors.NotFoundError:
            pass
        await bus.publish_many(admin.jetstream(), [_stage_event(i) for i in range(6)])
    finally:
        await admin.close()
    nc = await bus.connect(role_nats.settings("verification"))
    try:
        js = nc.jetstream()
        sub = _service(role_nats).subscriptions[events.TEMPLATE_PARSED]
        psub = await js.pull_subscribe(FILTER, durable=DURABLE, stream=events.STREAM, config=sub.config)
        msgs = await psub.fetch(2, timeout=5)
        await msgs[0].ack_sync()
        yield
    finally:
        await nc.close()


async def _held(server: RoleServer) -> dict[str, Any] | None:
    """What the server holds of the durable (its config, positions, pause), read as admin; None
    when it is gone."""
    nc = await bus.connect(server.settings("admin"))
    try:
        info = json.loads((await nc.request(f"$JS.API.CONSUMER.INFO.{events.STREAM}.{DURABLE}", b"", timeout=5)).data)
    finally:
        await nc.close()
    if "error" in info:
        return None
    seqs = {k: {f: v for f, v in (info.get(k) or {}).items() if f != "last_active"} for k in ("delivered", "ack_floor")}
    return {"config": info["config"], **seqs, "num_ack_pending": info.get("num_ack_pending"),
            "num_pending": info.get("num_pending"), "paused": bool(info.get("paused"))}


def _create(subject: str, **config: Any) -> tuple[str, dict[str, Any]]:
    """A consumer create request re-pointing the durable at nothing, `config` over its own."""
    return subject, {"stream_name": events.STREAM, "config": {
        "ack_policy": "explicit", "deliver_policy": "all", "filter_subject": "vb.nothing.*.*", **config}}


API = f"$JS.API.CONSUMER.%s.{events.STREAM}"
ATTACKS: dict[str, tuple[str, dict[str, Any] | None]] = {
    # the red-team route: no name in the subject, the durable's in the body
    "unnamed create, name in the body": _create(API % "CREATE", name=DURABLE),
    "unnamed create, durable_name in the body": _create(API % "CREATE", durable_name=DURABLE),
    "unnamed create that pauses it": _create(API % "CREATE", name=DURABLE, filter_subject=FILTER,
                                             pause_until="2099-01-01T00:00:00Z"),
    # a name of cli's own in the subject, the durable's in the body (the server refuses these)
    "named create, durable_name in the body": _create(API % "CREATE" + ".cli-own", durable_name=DURABLE),
    "named create with a filter, durable_name in the body": _create(API % "CREATE" + ".cli-own.vb.nothing.*.*",
                                                                    durable_name=DURABLE),
    "named create, name in the body": _create(API % "CREATE" + ".cli-own", name=DURABLE),
    "named create, a wildcard for the name": _create(API % "CREATE" + ".*", name=DURABLE),
    "create under its name": _create(API % "CREATE" + f".{DURABLE}", name=DURABLE, durable_name=DURABLE),
    "create under its name with a filter": _create(API % "CREATE" + f".{DURABLE}.vb.nothing.*.*", name=DURABLE,
                                                   durable_name=DURABLE),
    "legacy durable create": _create(API % "DURABLE.CREATE" + f".{DURABLE}", durable_name=DURABLE),
    "legacy durable create under another name": _create(API % "DURABLE.CREATE" + ".cli-own", durable_name=DURABLE),
    # its position and state
    "reset past its queued jobs": (API % "RESET" + f".{DURABLE}", {"seq": 1000}),
    "reset to its ack floor": (API % "RESET" + f".{DURABLE}", None),
    "pause": (API % "PAUSE" + f".{DURABLE}", {"pause_until": "2099-01-01T00:00:00Z"}),
    "unpin": (API % "UNPIN" + f".{DURABLE}", {"group": "g"}),
    "pull its work": (API % "MSG.NEXT" + f".{DURABLE}", {"batch": 5, "expires": 500_000_000}),
    "delete": (API % "DELETE" + f".{DURABLE}", None),
    # cluster operations (refused by a single server too, but they are not cli's to ask)
    "leader stepdown": (API % "LEADER.STEPDOWN" + f".{DURABLE}", None),
    "peer removal": (API % "PEER.REMOVE" + f".{DURABLE}", {"peer": "nats"}),
    "peer evacuation": (API % "PEER.EVACUATE" + f".{DURABLE}", None),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_cli_cannot_change_a_service_durable_by_any_route(role_nats: RoleServer, durable: None,
                                                                attack: str) -> None:
    subject, body = ATTACKS[attack]
    before = await _held(role_nats)
    assert before is not None and before["num_ack_pending"] == 1 and before["config"]["filter_subject"] == FILTER
    errors: list[str] = []
    nc = await _connect(role_nats, "cli", errors)
    try:
        try:
            reply = (await nc.request(subject, json.dumps(body).encode() if body is not None else b"", timeout=2)).data
        except nats_errors.TimeoutError:
            reply = None
        await nc.flush()
    finally:
        await nc.close()
    if reply is None:  # no answer: the server must have refused the publish
        assert any("permissions violation" in e and subject.lower() in e for e in errors), (attack, errors)
    else:  # an answer: a JetStream API error, or a consumer of cli's own; never a message of the durable
        try:
            answer = json.loads(reply)
        except ValueError:
            answer = {}
        assert "error" in answer or answer.get("name") not in (None, DURABLE), (attack, reply[:300])
    assert await _held(role_nats) == before, attack


async def test_the_operators_paths_follow_and_read_the_stream_as_cli(role_nats: RoleServer,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Every create of `cli` names its consumer (`nats_patches`), so what the CLI does with
    consumers still works with the named creates alone: follow a run's results (ordered push
    consumers), read a subject (an ephemeral pull consumer), read a range of the stream as the
    parallel rebuild does (`add_consumer` without a name, then deleted), list the consumers."""
    run_id = "followed"
    results = [make(f"q{i}", "openai/a", True) for i in range(4)]
    admin = await bus.connect(role_nats.settings("admin"))
    try:
        await bus.publish_many(admin.jetstream(), [
            events.make_envelope(events.RESULT_FINALIZED, run_id, r.metadata.result_id,
                                 events.ResultFinalized(result=r.model_dump(mode="json")), "finalization")
            for r in results])
        last = (await admin.jetstream().stream_info(events.STREAM)).state.last_seq
    finally:
        await admin.close()
    expected = {r.metadata.result_id for r in results}
    with caplog.at_level(logging.WARNING, logger="veribus.bus"):
        outcome = await runner.collect(role_nats.settings("cli"), run_id, expected, timeout=20, tick_s=0.5)
    assert not outcome.timed_out and set(outcome.results) == expected
    assert "permissions violation" not in caplog.text
    errors: list[str] = []
    nc = await _connect(role_nats, "cli", errors)
    try:
        js = nc.jetstream(timeout=5)
        read = await streams.read_events(js, events.subject(events.RESULT_FINALIZED, run_id, "*"), timeout=10)
        assert {e.result_id for e in read} == expected
        before = {c.name for c in await js.consumers_info(events.STREAM)}
        ranged = [m async for batch in rebuild_parallel.stream_range(nc, 1, last, 3, timeout=20) for m in batch]
        assert len(ranged) == last
        # the rebuild's consumer is deleted after it (a delete of a consumer of cli's own)
        assert {c.name for c in await js.consumers_info(events.STREAM)} <= before
        await nc.flush()
    finally:
        await nc.close()
    assert not errors, errors


async def test_a_service_puts_its_durable_back_when_it_starts(role_nats: RoleServer,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The durable re-pointed at `vb.nothing.*.*` while its service runs (as the red-team pass
    did through `cli`; here as admin, who still may) passes over the jobs that arrive meanwhile;
    then set to stall its pulls (max_batch 1, a pinned priority group, headers only, deleted when
    idle, paused). When the service starts again it restores every one of those, with a warning
    naming them, and the jobs passed over are handled."""
    handled: list[str] = []
    svc = _service(role_nats, handled)
    nc = await bus.connect(role_nats.settings("verification"))
    svc.bind(nc.jetstream())
    admin = await bus.connect(role_nats.settings("admin"))
    ajs = admin.jetstream()

    async def update(**changes: Any) -> None:
        info = json.loads((await admin.request(f"$JS.API.CONSUMER.INFO.{events.STREAM}.{DURABLE}", b"", timeout=5)).data)
        req = {"stream_name": events.STREAM, "config": {**info["config"], **changes}}
        reply = json.loads((await admin.request(f"$JS.API.CONSUMER.CREATE.{events.STREAM}.{DURABLE}",
                                                json.dumps(req).encode(), timeout=5)).data)
        assert "error" not in reply, reply

    first = [_stage_event(i) for i in range(6)]
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await ajs.delete_consumer(events.STREAM, DURABLE)
        await bus.publish_many(ajs, first)
        await svc._start_pumps()  # makes the durable
        for _ in range(100):
            if {e.result_id for e in first} <= set(handled):
                break
            await asyncio.sleep(0.1)
        assert {e.result_id for e in first} <= set(handled)
        await update(filter_subject="vb.nothing.*.*")
        late = [_stage_event(i) for i in range(100, 104)]
        await bus.publish_many(ajs, late)
        # the service's next pull request: the server scans on from the durable's position for a
        # message its filter takes, and moves past them
        pull = await nc.jetstream().pull_subscribe_bind(DURABLE, stream=events.STREAM)
        with pytest.raises(nats_errors.TimeoutError):
            await pull.fetch(1, timeout=1)
        await svc._stop_pumps()
        assert not {e.result_id for e in late} & set(handled)
        passed_over = await _held(role_nats)
        assert passed_over is not None and passed_over["num_pending"] == 0
        await update(max_batch=1, priority_groups=["g"], priority_policy="pinned_client", headers_only=True,
                     inactive_threshold=3600 * 10**9, backoff=[10**9, 2 * 10**9])
        await ajs.pause_consumer(events.STREAM, DURABLE, "2099-01-01T00:00:00Z")
        tampered = await _held(role_nats)
        assert tampered is not None and tampered["paused"] and tampered["config"]["max_batch"] == 1
        with caplog.at_level(logging.WARNING, logger="veribus.bus"):
            await svc._start_pumps()
            for _ in range(100):
                if {e.result_id for e in late} <= set(handled):
                    break
                await asyncio.sleep(0.1)
    finally:
        await svc._stop_pumps()
        await svc.control.close()
        await svc.cost_control.close()
        await nc.close()
        await admin.close()
    assert {e.result_id for e in late} <= set(handled), "the jobs the wrong filter passed over were not handled"
    held = await _held(role_nats)
    assert held is not None and not held["paused"]
    cfg = held["config"]
    assert cfg["filter_subject"] == FILTER and not cfg.get("filter_subjects")
    for field in ("max_batch", "priority_groups", "priority_policy", "headers_only", "inactive_threshold", "backoff"):
        assert cfg.get(field) in (None, 0, False, [], "none"), (field, cfg.get(field))
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    for named in ("vb.nothing.*.*", "max_batch", "priority_policy", "headers_only", "inactive_threshold", "backoff",
                  "paused", "reset to its ack floor"):
        assert named in warned, (named, warned)
