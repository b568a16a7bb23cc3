"""`projections rebuild` across processes: worker processes read, decode and project slices of the
stream and build the Arrow blocks; this process only inserts them, in stream order.

Why: a rebuild is CPU-bound Python (decoding events, building rows, filling Arrow columns: ~40 us
an event) and one process holds the GIL for all of it, so a thread beside it did not help. Each
worker takes every n-th chunk of consecutive stream sequences (its own ephemeral consumer per
chunk) and sends one pickled message per chunk on its stdout; this process takes the chunks in
sequence order (worker 0's first, worker 1's first, worker 0's second, ...), so the inserts happen
in the order the live projector makes them and a later copy of an event replaces an earlier one
exactly as it does there. The rows are `Projector.project_batch`'s, the blocks
`shared.store.arrow.to_arrow`'s and the inserts `Store.insert_block`'s: the same code as the live
projector's, split over processes.

Workers are `python -m shared.control.rebuild_parallel` (not multiprocessing: nothing of the
calling program is re-imported); their configuration (settings, column types, chunks) arrives on
stdin, not the command line, as the settings may hold NATS credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import pickle
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus
from shared.store import arrow
from shared.store.engine import projection_columns
from shared.store.projection import Projector

log = logging.getLogger("veribus.lifecycle")

CHUNK = 10_000  # stream sequences per chunk: one worker message, one insert per table


def plan_chunks(first_seq: int, last_seq: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """Inclusive sequence ranges covering first..last, in order."""
    if last_seq < first_seq or first_seq <= 0:
        return []
    return [(s, min(s + chunk - 1, last_seq)) for s in range(first_seq, last_seq + 1, chunk)]


def default_workers() -> int:
    """`VERIBUS_REBUILD_WORKERS` (0: fold in this process), else one worker per core. On two
    shared cores (load 4-6), 120,010 events, three alternating rounds: 0 workers 8.7k, 18.7k,
    17.4k events/s for the fold; 1 worker 8.8k, 21.2k, 16.9k; 2 workers 11.3k, 26.8k, 23.1k."""
    n = Settings.from_env("rebuild_workers").rebuild_workers
    return n if n is not None else max(1, os.cpu_count() or 1)


class Workers:
    """Worker processes started early (their imports overlap opening chdb), given work later."""

    def __init__(self, n: int) -> None:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.procs = [subprocess.Popen([sys.executable, "-m", "shared.control.rebuild_parallel"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
                      for _ in range(n)]

    def run(self, settings: Any, column_types: dict[str, dict[str, str]], chunks: Sequence[tuple[int, int]],
            insert: Any, batch: int) -> int:
        """Hand out the chunks and call `insert(table, column_names, columns, block)` for every
        block, in chunk order; returns the messages read."""
        n = len(self.procs)
        for k, proc in enumerate(self.procs):
            assert proc.stdin is not None
            conf = {"settings": settings.model_dump(mode="json"), "types": column_types,
                    "chunks": list(chunks[k::n]), "batch": batch}
            proc.stdin.write(pickle.dumps(conf, protocol=pickle.HIGHEST_PROTOCOL))
            proc.stdin.close()
        read = 0
        for i in range(len(chunks)):
            proc = self.procs[i % n]
            assert proc.stdout is not None
            try:
                msg = pickle.load(proc.stdout)
            except EOFError as exc:
                raise RuntimeError(f"rebuild worker {proc.pid} ended early (exit code {proc.wait(30)}); "
                                   "its error is on stderr") from exc
            if "error" in msg:
                raise RuntimeError(f"rebuild worker {proc.pid}: {msg['error']}")
            read += msg["messages"]
            for table, column_names, columns, block in msg["blocks"]:
                insert(table, column_names, columns, block)
        return read

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            for f in (proc.stdin, proc.stdout):
                if f is not None and not f.closed:
                    f.close()


class StreamReader:
    """Reads a whole stream through an ephemeral pull consumer, a batch per pull request, the
    messages collected by a subscription callback. (`PullSubscription.fetch` awaits each message
    with its own timeout: about five times slower, and a rebuild reads every event there is.)"""

    def __init__(self, nc: Any, consumer: str, max_bytes: int = 32 * 2**20) -> None:
        self.nc, self.consumer, self.max_bytes = nc, consumer, max_bytes
        self.inbox = nc.new_inbox()
        self.msgs: list[Any] = []
        self.want = 0
        self.ended = asyncio.Event()

    async def _on_msg(self, msg: Any) -> None:
        if not msg.data and msg.headers and msg.headers.get("Status"):
            self.ended.set()  # the request ended: expired (408), over max_bytes (409), nothing left (404)
            return
        self.msgs.append(msg)
        if len(self.msgs) >= self.want:
            self.ended.set()

    async def batches(self, remaining: int, batch: int, end_seq: int | None = None) -> Any:
        """Yield lists of messages until `remaining` (the consumer's pending count) are read, or,
        with `end_seq`, until stream sequence `end_seq` (the messages after it are left out)."""
        sub = await self.nc.subscribe(self.inbox, cb=self._on_msg, pending_msgs_limit=4 * batch,
                                      pending_bytes_limit=4 * self.max_bytes)
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{events.STREAM}.{self.consumer}"
        try:
            while remaining > 0:
                self.msgs, self.want = [], min(batch, remaining)
                self.ended.clear()
                req = {"batch": self.want, "max_bytes": self.max_bytes, "expires": 5_000_000_000}
                await self.nc.publish(subject, events.to_json(req), reply=self.inbox)
                await self.ended.wait()
                msgs = self.msgs
                if not msgs:
                    continue
                meta = msgs[-1].metadata
                remaining = meta.num_pending if meta is not None else remaining - len(msgs)
                if end_seq is not None and meta is not None:
                    last = meta.sequence.stream
                    if last > end_seq:
                        msgs = [m for m in msgs if m.metadata.sequence.stream <= end_seq]
                    remaining = min(remaining, max(0, end_seq - last))
                yield msgs
        finally:
            await sub.unsubscribe()


@contextlib.asynccontextmanager
async def ephemeral_consumer(js: Any, deliver_policy: DeliverPolicy, **config: Any) -> AsyncIterator[Any]:
    """An unacknowledged ephemeral consumer on the events stream (its ConsumerInfo), for reading
    it through `StreamReader`; deleted afterwards."""
    info = await js.add_consumer(events.STREAM, ConsumerConfig(
        ack_policy=AckPolicy.NONE, deliver_policy=deliver_policy, inactive_threshold=30.0, max_ack_pending=-1,
        **config))
    try:
        yield info
    finally:
        try:
            await js.delete_consumer(events.STREAM, info.name)
        except Exception as exc:  # noqa: BLE001 - it goes when inactive anyway
            log.debug("deleting the rebuild consumer: %s", exc)


# ---- the worker side ----

async def _read_chunk(nc: Any, start: int, end: int, batch: int) -> list[Any]:
    """The messages with stream sequence start..end (fewer where the stream has gaps)."""
    out: list[Any] = []
    async with ephemeral_consumer(nc.jetstream(), DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start) as info:
        pending = int(info.num_pending or 0)
        async for msgs in StreamReader(nc, info.name).batches(min(pending, end - start + 1), batch, end_seq=end):
            out.extend(msgs)
    return out


async def _work(conf: dict[str, Any], out: Any) -> None:
    settings = Settings.model_validate(conf["settings"])
    types = {table: arrow.arrow_types(t) for table, t in conf["types"].items()}
    projector = Projector(settings)
    gc.disable()  # as in the in-process fold: a chunk's objects make no cycles
    async with bus.session(settings) as nc:
        for start, end in conf["chunks"]:
            msgs = await _read_chunk(nc, start, end, conf["batch"])
            p = projector.project_batch(msgs)
            blocks = []
            for table, column_names, columns in projection_columns(p):
                # no block: the inserting process falls back to a Native insert
                block = arrow.block_or_none(types.__getitem__, table, column_names, columns)
                blocks.append((table, column_names, None if block is not None else columns, block))
            pickle.dump({"messages": len(msgs), "blocks": blocks}, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
            del msgs, p, blocks


def _warm_up() -> None:
    """Before the configuration comes (meanwhile the inserting process opens chdb), make pyarrow
    load pandas: its first `pa.array` imports it (~0.3 s)."""
    import pyarrow as pa  # local import: heavy, and only a worker fills Arrow columns

    pa.array([b""], type=pa.binary())


def worker_main() -> int:
    # nothing but the pickled chunks goes to the pipe: it moves to a descriptor of its own, and
    # whatever else writes to stdout (Python or C) goes to stderr
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _warm_up()
    try:
        conf = pickle.load(sys.stdin.buffer)
    except EOFError:
        return 0  # not needed after all
    try:
        asyncio.run(_work(conf, out))
    except Exception as exc:  # noqa: BLE001 - reported to the inserting process, which fails the rebuild
        pickle.dump({"error": f"{type(exc).__name__}: {exc}"}, out)
        out.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
