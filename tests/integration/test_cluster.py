"""The stream and KV buckets on a real three-node NATS cluster (nats-server processes on free
loopback ports, started and stopped by the `nats_cluster` fixture): replica counts, the
override, and deduplication and reads across the death of the stream's leader."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig

from shared.control import streams
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus, runcontrol
from tests.conftest import NatsCluster, NatsServer
from tests.support.jetstream import meta_leader


def _env(i: int, run: str = "clu-run") -> events.Envelope:
    payload = events.RunRequested(run_id=run, timestamp="t", job_count=0, answer_count=0)
    env = events.make_envelope(events.RUN_REQUESTED, run, f"r{i:04d}", payload, "test")
    env.event_id = f"{run}:r{i:04d}"
    return env


async def _stream_info(js: Any) -> Any:
    return await bus.retry_cluster(lambda: js.stream_info(events.STREAM), "stream info")


async def test_stream_and_buckets_get_three_replicas(nats_cluster: NatsCluster) -> None:
    settings = Settings(nats_url=nats_cluster.url)
    nc = await bus.connect(settings)
    try:
        assert bus.cluster_size(nc) == 3
        js = nc.jetstream()
        assert await bus.ensure_stream(js, settings) == 3
        info = await js.stream_info(events.STREAM)
        peers = {info.cluster.leader, *(p.name for p in info.cluster.replicas or [])}
        assert info.config.num_replicas == 3 and peers == {"nats-1", "nats-2", "nats-3"}
        kv = await runcontrol.usage_bucket(js)
        assert (await kv.status()).stream_info.config.num_replicas == 3
        cache = await bus.ensure_kv(js, KeyValueConfig(bucket="vb_cluster_test", history=1), settings)
        assert (await cache.status()).stream_info.config.num_replicas == 3
    finally:
        await nc.close()


async def test_replicas_override_and_no_silent_shrink(nats_cluster: NatsCluster) -> None:
    """VERIBUS_STREAM_REPLICAS is obeyed exactly; without it a later caller never lowers the
    replica count another one set (and raises it to min(3, cluster size))."""
    nc = await bus.connect(Settings(nats_url=nats_cluster.url))
    try:
        js = nc.jetstream()
        assert await bus.ensure_stream(js, Settings(nats_url=nats_cluster.url, stream_replicas=1)) == 1
        assert (await js.stream_info(events.STREAM)).config.num_replicas == 1
        assert await bus.ensure_stream(js, Settings(nats_url=nats_cluster.url)) == 3
        assert (await _stream_info(js)).config.num_replicas == 3
        assert await bus.ensure_stream(js, Settings(nats_url=nats_cluster.url, stream_replicas=2)) == 2
        assert (await _stream_info(js)).config.num_replicas == 2
        kv = await bus.ensure_kv(js, KeyValueConfig(bucket="vb_override_test"),
                                 Settings(nats_url=nats_cluster.url, stream_replicas=2))
        assert (await kv.status()).stream_info.config.num_replicas == 2
    finally:
        await nc.close()


async def test_single_server_gets_one_replica(nats_server: NatsServer) -> None:
    settings = Settings(nats_url=nats_server.url)
    nc = await bus.connect(settings)
    try:
        assert bus.cluster_size(nc) == 1
        assert await bus.ensure_stream(nc.jetstream(), settings) == 1
    finally:
        await nc.close()


async def test_the_stream_survives_its_leader_and_keeps_deduplicating(nats_cluster: NatsCluster) -> None:
    """kill -9 the node that leads the stream: a client holding the server list fails over,
    `bus.publish` rides out the election, a republished message id is still a duplicate (the
    dedup state is replicated), and the restarted node catches up."""
    settings = Settings(nats_url=nats_cluster.url)
    nc = await bus.connect(settings, reconnect_time_wait=0.2)
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js, settings)
        first = [_env(i) for i in range(100)]
        assert await bus.publish_many(js, first) == 100
        leader = (await js.stream_info(events.STREAM)).cluster.leader
        assert leader in {n.name for n in nats_cluster.nodes}
        nats_cluster.kill(leader)

        new = [await bus.publish(js, _env(i)) for i in range(100, 200)]
        assert all(new), "events published after the failover are new"
        again = [await bus.publish(js, e) for e in first]
        assert not any(again), "every republished message id is a duplicate after the failover"
        info = await _stream_info(js)
        assert info.state.messages == 200
        assert info.cluster.leader not in (None, leader)

        nats_cluster.start(leader)
        await asyncio.to_thread(nats_cluster.wait_healthy, [leader], 60.0)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = await _stream_info(js)
            back = {p.name: p for p in info.cluster.replicas or []}
            if leader in back and back[leader].current and not back[leader].lag:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"restarted node {leader} did not catch up: {info.cluster}")
        got = await streams.read_events(js, "vb.run.requested.clu-run.*")
        assert sorted(e.event_id for e in got) == sorted(e.event_id for e in first + [_env(i) for i in range(100, 200)])
    finally:
        await nc.close()


async def test_a_bucket_can_be_made_while_a_node_is_down(nats_cluster: NatsCluster) -> None:
    """With one node dead the servers' INFO lists two nodes; the stream keeps 3 replicas, and a
    KV bucket created now asks for 3 (it follows the stream). Whether the cluster can place 3
    right now depends on whether it has noticed the node is gone; if not, the bucket is made
    with 2 rather than failing. Either way it works at once."""
    settings = Settings(nats_url=nats_cluster.url)
    nc = await bus.connect(settings)
    try:
        assert await bus.ensure_stream(nc.jetstream(), settings) == 3
    finally:
        await nc.close()
    nats_cluster.kill("nats-3")
    deadline = time.monotonic() + 15
    while True:  # a live node drops the dead one's URL from its INFO once it notices the route gone
        nc = await bus.connect(settings)
        if bus.cluster_size(nc) == 2 or time.monotonic() > deadline:
            break
        await nc.close()
        await asyncio.sleep(0.2)
    try:
        js = nc.jetstream()
        assert bus.cluster_size(nc) == 2
        assert await bus.ensure_stream(js, settings) == 3
        kv = await bus.ensure_kv(js, KeyValueConfig(bucket="vb_made_degraded"), settings)
        assert (await kv.status()).stream_info.config.num_replicas in (2, 3)
        await kv.put("k", b"v")
        assert (await kv.get("k")).value == b"v"
    finally:
        await nc.close()


# rounds of "stop a follower, commit, read the moment it runs again": the lag shows in most
# rounds, not all (the node may apply the catch-up before it answers the read)
ROUNDS = 12
UNACKED = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                         inactive_threshold=60.0, max_ack_pending=-1)


class _LagRounds:
    """Rounds of a lag test, each `_on_the_leader`, until the lag has shown (and at least two):
    a round sets `lagged` when it saw it."""

    def __init__(self, cluster: NatsCluster) -> None:
        self.cluster, self.lagged = cluster, 0

    async def __aiter__(self) -> AsyncIterator[tuple[int, Any, set[str]]]:
        settings = Settings(nats_url=self.cluster.url)
        async with bus.session(settings) as nc:
            await bus.ensure_stream(nc.jetstream(), settings)
        for rnd in range(ROUNDS):
            if self.lagged and rnd >= 2:
                return
            async with _on_the_leader(self.cluster) as (nc, hosts):
                yield rnd, nc, hosts


@contextlib.asynccontextmanager
async def _on_the_leader(cluster: NatsCluster) -> AsyncIterator[tuple[Any, set[str]]]:
    """A round of a lag test: once every node is healthy, a client connected to the stream
    leader's node only, and the nodes that may be stopped under it (neither the stream leader
    nor the JetStream meta leader, whose absence stalls every API call until an election)."""
    await asyncio.to_thread(cluster.wait_healthy)
    async with bus.session(Settings(nats_url=cluster.url)) as nc0:
        leader = (await _stream_info(nc0.jetstream())).cluster.leader
    nc = await bus.connect(Settings(nats_url=f"nats://127.0.0.1:{cluster.node(leader).port}"))
    try:
        yield nc, {n.name for n in cluster.nodes} - {leader, meta_leader(n.http_port for n in cluster.nodes)}
    finally:
        await nc.close()


async def _placed_on(hosts: set[str], make: Any, drop: Any) -> tuple[Any, Any]:
    """A consumer the server placed on one of `hosts` (placement is the server's choice: make
    them until one lands there); `make()` returns the consumer and its info, `drop(it)` ends it."""
    for _ in range(40):
        made, info = await make()
        if info.cluster and info.cluster.leader in hosts:
            return made, info
        await drop(made)
    raise AssertionError(f"the server placed none of 40 consumers on {sorted(hosts)}")


async def _consumer_on_a_follower(js: Any, subject_filter: str, hosts: set[str]) -> Any:
    """A pull subscription on an unacknowledged R1 consumer placed on one of `hosts`."""
    async def make() -> tuple[Any, Any]:
        psub = await js.pull_subscribe(subject_filter, durable=None, stream=events.STREAM, config=UNACKED)
        return psub, await psub.consumer_info()

    return (await _placed_on(hosts, make, lambda psub: psub.unsubscribe()))[0]


class _AskedEarly:
    """A pull subscription whose first `consumer_info` is one the server already gave (the moment
    its node ran again), so the read under test starts from that count, whatever the timing of
    its own first request; every other call goes to the subscription."""

    def __init__(self, psub: Any, first_info: Any) -> None:
        self._psub, self._first = psub, first_info

    async def consumer_info(self) -> Any:
        if self._first is not None:
            info, self._first = self._first, None
            return info
        return await self._psub.consumer_info()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._psub, name)


async def test_a_read_served_by_a_lagging_replica_is_completed_by_the_leader(nats_cluster: NatsCluster) -> None:
    """An R1 consumer delivers from the copy of the member it sits on. Put one on a follower,
    stop that node while the other two commit 300 events, and read from the count it gives the
    moment it runs again: that count is still short (a read that trusted it returned a run
    without its newest results), yet `read_consumer` returns all 300, as the leader holds them."""
    rounds = _LagRounds(nats_cluster)
    async for rnd, nc, hosts in rounds:
        js = nc.jetstream()
        subject_filter = events.subject(events.RUN_REQUESTED, f"lag{rnd}", "*")
        psub = await _consumer_on_a_follower(js, subject_filter, hosts)
        sent = [_env(i, f"lag{rnd}") for i in range(300)]
        with nats_cluster.paused((await psub.consumer_info()).cluster.leader):
            assert await bus.publish_many(js, sent) == 300
        stale = await psub.consumer_info()  # asked the moment the node runs again
        try:
            got = await streams.read_consumer(js, _AskedEarly(psub, stale), subject_filter, timeout=30)
        finally:
            await psub.unsubscribe()
        assert sorted(events.decode(m.data, m.subject).event_id for m in got) == sorted(e.event_id for e in sent)
        rounds.lagged += stale.num_pending < 300
    assert rounds.lagged, "the follower's copy was never behind when read: the lag this test is about did not occur"


async def test_a_stream_range_served_by_a_lagging_replica_reads_on(nats_cluster: NatsCluster, monkeypatch) -> None:
    """`projections rebuild` reads the stream by sequence range (`rebuild_parallel.stream_range`).
    Its first consumer is one the server put on a follower that was stopped while 300 events were
    committed, with its pending count as read the moment the node runs again: that copy ends
    short, and the range still comes back whole, each sequence once and in order (a new
    consumer reads on from where the short one stopped)."""
    from shared.control import rebuild_parallel

    real = rebuild_parallel.ephemeral_consumer
    rounds = _LagRounds(nats_cluster)
    async for rnd, nc, hosts in rounds:
        js = nc.jetstream()
        async def make(js: Any = js) -> tuple[Any, Any]:
            info = await js.add_consumer(events.STREAM, UNACKED)
            return info, info

        placed, _ = await _placed_on(hosts, make, lambda info, js=js: js.delete_consumer(events.STREAM, info.name))
        with nats_cluster.paused(placed.cluster.leader):
            assert await bus.publish_many(js, [_env(i, f"range{rnd}") for i in range(300)]) == 300
        stale = await js.consumer_info(events.STREAM, placed.name)
        state = (await _stream_info(js)).state
        calls: list[dict] = []

        @contextlib.asynccontextmanager
        async def first_on_the_follower(js_: Any, policy: Any, calls: list = calls, stale: Any = stale,
                                        **kw: Any) -> Any:
            calls.append(kw)
            if len(calls) == 1:
                yield stale
                return
            async with real(js_, policy, **kw) as info:
                yield info

        monkeypatch.setattr(rebuild_parallel, "ephemeral_consumer", first_on_the_follower)
        seqs = [m.metadata.sequence.stream
                async for batch in rebuild_parallel.stream_range(nc, int(state.first_seq), int(state.last_seq), 50)
                for m in batch]
        await js.delete_consumer(events.STREAM, placed.name)
        assert seqs == list(range(int(state.first_seq), int(state.last_seq) + 1))
        rounds.lagged += len(calls) > 1
    assert rounds.lagged, "the follower's copy was never behind when read: the lag this test is about did not occur"
