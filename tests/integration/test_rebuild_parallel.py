"""`projections rebuild` with worker processes (real nats-server, real chdb): chunks of the stream
projected in other processes and inserted in stream order give the very tables the one-process
fold gives, gaps in the stream and a re-published event (a later copy of an event id) included."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats
import pytest

from bench.rebuild import result_events
from shared.control import rebuild, rebuild_parallel
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus
from shared.store.engine import open_store


def _stream(run_id: str, n: int) -> list[events.Envelope]:
    ts = "2025-01-01T00:00:00+00:00"
    out = [events.make_envelope(events.RUN_REQUESTED, run_id, events.RUN_KEY, events.RunRequested(
        run_id=run_id, timestamp=ts, job_count=n, answer_count=n, benchmark_name="bench"), "cli/test")]
    for i in range(n):
        out.extend(result_events(run_id, 700 + i, ts, 1_700_000_000.0 + i))
    return out


async def _fill(settings: Settings, envs: list[events.Envelope]) -> tuple[int, int, events.Envelope]:
    """Publish `envs` with, two results before their end, a later copy of the first result's
    finalized event under another message id (as a republish outside the duplicate window
    lands), and delete two messages (gaps)."""
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js, settings)
        await bus.publish_many(js, envs[:-12])
        final = msgspec.structs.replace(next(e for e in envs if e.event_type == events.RESULT_FINALIZED))
        final.occurred_at += 60.0
        await js.publish(final.subject, events.wire(final), headers={"Nats-Msg-Id": "republished-" + final.event_id})
        await bus.publish_many(js, envs[-12:])
        for seq in (5, 23):
            await js.delete_msg(events.STREAM, seq)
        info = await js.stream_info(events.STREAM)
        return int(info.state.first_seq), int(info.state.last_seq), final
    finally:
        await nc.close()


def test_plan_chunks_covers_the_range_in_order() -> None:
    assert rebuild_parallel.plan_chunks(3, 10, 4) == [(3, 6), (7, 10)]
    assert rebuild_parallel.plan_chunks(1, 9, 4) == [(1, 4), (5, 8), (9, 9)]
    assert rebuild_parallel.plan_chunks(1, 0, 4) == []  # an empty stream


# forked workers, all chunks but the last joined into one insert (the event and its later copy in
# one insert); spawned workers, two chunks per insert (the two in different inserts)
@pytest.mark.parametrize(("fork", "join"), [(True, 100), (False, 2)], ids=["forked", "spawned"])
def test_workers_rebuild_the_tables_the_single_process_fold_builds(
        nats_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fork: bool, join: int) -> None:  # noqa: ANN001
    settings = Settings(home=tmp_path / "home", nats_url=nats_server.url)
    first, last, copy = asyncio.run(_fill(settings, _stream("20250103T000000-parallel", 9)))
    assert last - first > 40

    monkeypatch.setenv("VERIBUS_REBUILD_WORKERS", "0")
    one = rebuild.rebuild_projections(settings)
    monkeypatch.setenv("VERIBUS_REBUILD_WORKERS", "2")
    monkeypatch.setattr(rebuild_parallel, "CHUNK", 7)  # many chunks: both workers, chunks across the gaps
    monkeypatch.setattr(rebuild_parallel, "_can_fork", lambda: fork)  # workers forked from this process, or spawned
    monkeypatch.setattr(rebuild_parallel, "JOIN_CHUNKS", join)
    made: list[bool] = []

    class Recorded(rebuild_parallel.Workers):
        def __init__(self, n: int) -> None:
            super().__init__(n)
            made.append(self.forked)

    monkeypatch.setattr(rebuild_parallel, "Workers", Recorded)
    two = rebuild.rebuild_projections(settings)
    assert made == [fork]

    assert one.mode == two.mode == "in-process"
    assert one.after == two.after
    assert two.after["verification_results"][0] == 9 and two.after["runs"][0] == 1
    assert two.after["events"][0] == last - first + 1 - 2 - 1  # gaps left out; the copy replaces its event
    store = open_store(settings)
    try:
        kept = store.query("SELECT toUnixTimestamp64Micro(occurred_at) FROM events FINAL WHERE event_id = {e:String}",
                           {"e": copy.event_id}).rows
    finally:
        store.close()
    assert kept == [(round(copy.occurred_at * 1_000_000),)]  # the later copy, as the live projector keeps it


def _failing_work(how: str):  # noqa: ANN202
    """A worker's `_work` that sends one chunk and then fails `how`: raises, or dies (exit 3)."""
    async def work(conf: dict, out) -> None:  # noqa: ANN001
        import os
        import pickle
        pickle.dump({"messages": 1, "blocks": []}, out)
        out.flush()
        if how == "dies":
            os._exit(3)
        raise ValueError("chunk 2 is not readable")
    return work


@pytest.mark.parametrize(("how", "said"), [("raises", "ValueError: chunk 2 is not readable"),
                                           ("dies", "ended early (exit code 3)")])
def test_a_failing_worker_fails_the_rebuild_and_leaves_no_thread_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, said: str) -> None:
    """A worker that fails after its first chunk fails the fold with its error named (the chunks
    before it inserted, nothing after), and closing the pool ends its pipe readers."""
    import threading

    monkeypatch.setattr(rebuild_parallel, "_work", _failing_work(how))
    threads = threading.active_count()
    pool = rebuild_parallel.Workers(2, fork=True)
    inserted: list[str] = []
    try:
        with pytest.raises(RuntimeError, match=said.replace("(", r"\(").replace(")", r"\)")):
            pool.run(Settings(home=tmp_path), {}, [(1, 10), (11, 20), (21, 30), (31, 40)],
                     lambda table, *_: inserted.append(table), 10)
    finally:
        pool.close()
    assert inserted == []  # no blocks came; what failed is said, not inserted
    assert threading.active_count() == threads
    assert all(p.poll() is not None for p in pool.procs)


def test_an_ipc_stream_of_joined_chunks_reads_back_as_their_rows(tmp_path: Path) -> None:
    """The rebuild's inserts: chunks' IPC messages (`ipc_buffers`, pickled as a worker sends
    them) joined under one schema message as an `IpcStream`, its pieces never concatenated for
    chdb, read back by Arrow and by the engine as every chunk's rows in order."""
    import pickle

    import pyarrow as pa

    from shared.store import arrow

    chunks = [pa.table({"event_id": [f"e{i}-{j}" for j in range(3)], "attempt": pa.array([i, i, i], pa.uint16())})
              for i in range(3)]
    parts = [pickle.loads(pickle.dumps(arrow.ipc_buffers(t), protocol=5)) for t in chunks]
    stream = arrow.IpcStream(parts[0][0], [b for _, batches in parts for b in batches])
    assert isinstance(stream, arrow.IpcStream) and len(stream) == 2 + 3
    assert pa.ipc.open_stream(bytes(stream)).read_all().equals(pa.concat_tables(chunks))

    store = open_store(Settings(home=tmp_path / "home"))
    try:
        store.client.command(f"CREATE TABLE {store.database}.t (event_id String, attempt UInt16) "
                             "ENGINE = MergeTree ORDER BY tuple()")
        store.insert_block("t", ["event_id", "attempt"], None, stream)
        rows = store.query(f"SELECT event_id, attempt FROM {store.database}.t ORDER BY attempt, event_id").rows
    finally:
        store.close()
    assert rows == [(f"e{i}-{j}", i) for i in range(3) for j in range(3)]


def test_a_joined_insert_puts_a_later_chunks_runs_before_an_earlier_chunks_results() -> None:
    """Chunks held for one insert per table: the first chunk had results only, the next a new
    run's row. Flushed in dict order the results went in first, and a read in between found
    results of a run ClickHouse did not have; the flush follows the store's insert order."""
    done: list[str] = []
    joined = rebuild_parallel._Joined(lambda table, *_: done.append(table))
    for table in ("verification_results", "events", "runs", "contents"):
        joined.add(table, ("c",), None, (b"schema-" + table.encode(), [b"batch"]))
    joined.flush()
    assert done == ["contents", "runs", "verification_results", "events"]
