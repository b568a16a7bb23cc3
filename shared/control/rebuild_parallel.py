"""`projections rebuild` across processes: worker processes read, decode and project slices of the
stream and build the Arrow record batches; this process only inserts them, in stream order.

Why: a rebuild is CPU-bound Python (decoding events, building rows, filling Arrow columns: ~30 us
an event) and one process holds the GIL for all of it, so a thread beside it did not help. Each
worker takes every n-th chunk of consecutive stream sequences (its own ephemeral consumer per
chunk, read by `shared.control.stream_read`) and sends one pickled message per chunk on a pipe:
per table the Arrow IPC messages of its rows (`arrow.ipc_parts`, pickled from `arrow.ipc_buffers`).
This process takes the chunks in sequence order (worker 0's first, worker 1's first, worker 0's second, ...) and joins
`JOIN_CHUNKS` consecutive chunks' batches into one insert per table, as bytes ClickHouse reads
(`ArrowStream`) without this process decoding them, so the rows go in in the order the live
projector inserts them and a later copy of an event replaces an earlier one exactly as it does
there. The rows are `Projector.project_batch`'s and the Arrow columns `shared.store.arrow`'s: the
same code as the live projector's, split over processes.

Workers are forked from this process after its imports when that is safe (`_can_fork`: Linux, no
other Python thread, no event loop running): they start in milliseconds. Otherwise they are
`python -m shared.control.rebuild_parallel` (not multiprocessing: nothing of the calling program
is re-imported; ~0.9 s of start-up each). Either way their configuration (settings, column types,
chunks) arrives on a pipe, not the command line, as the settings may hold NATS credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared.control.stream_read import StreamReader
from shared.control.streams import copy_was_behind
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus
from shared.store import arrow
from shared.store.engine import INSERT_ORDER, projection_columns
from shared.store.projection import Projector

log = logging.getLogger("veribus.lifecycle")

# stream sequences per chunk (one worker message), and chunks per insert (per table): 40,000
# events an insert; chunks of 5,000 rather than 10,000 shorten the fill (the inserts start
# sooner) and the drain (the last insert, made after the workers end, is smaller): ~3 % faster
CHUNK = 5_000
JOIN_CHUNKS = 8
TABLE_RANK = {table: i for i, (table, _, _) in enumerate(INSERT_ORDER)}


def plan_chunks(first_seq: int, last_seq: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """Inclusive sequence ranges covering first..last, in order."""
    if last_seq < first_seq or first_seq <= 0:
        return []
    return [(s, min(s + chunk - 1, last_seq)) for s in range(first_seq, last_seq + 1, chunk)]


def default_workers() -> int:
    """`VERIBUS_REBUILD_WORKERS` (0: fold in this process), else one worker per core. (Measured
    with spawned workers, before the lean reader: on two shared cores (load 4-6), 120,010
    events, three alternating rounds: 0 workers 8.7k, 18.7k, 17.4k events/s for the fold;
    1 worker 8.8k, 21.2k, 16.9k; 2 workers 11.3k, 26.8k, 23.1k.)"""
    n = Settings.from_env("rebuild_workers").rebuild_workers
    return n if n is not None else max(1, os.cpu_count() or 1)


class _Joined:
    """Consecutive chunks' Arrow record batches joined into one insert per table: each insert
    makes a part that ClickHouse merges later (re-reading and re-compressing it), and one part
    of 40,000 events instead of four of 10,000 costs about 3 us an event less, merges
    included. Rows keep their stream order inside an insert as across inserts: the insert
    sorts stably, so a later copy of an event still replaces the earlier one (checked on 100,000
    rows, 50,000 keys twice, in one `ArrowStream` insert of 15 batches: FINAL and a merge kept
    every later row)."""

    def __init__(self, insert: Any) -> None:
        self.insert = insert
        self.pending: dict[str, tuple[Sequence[str], bytes, list[bytes]]] = {}

    def add(self, table: str, column_names: Sequence[str], columns: Any, parts: tuple[bytes, list[bytes]] | None) -> None:
        held = self.pending.get(table)
        if parts is None or (held is not None and (held[0] != column_names or held[1] != parts[0])):
            self._flush(table)  # what came before goes in first
        if parts is None:
            self.insert(table, column_names, columns, None)
        elif table in self.pending:
            self.pending[table][2].extend(parts[1])
        else:
            self.pending[table] = (column_names, parts[0], list(parts[1]))

    def _flush(self, table: str) -> None:
        held = self.pending.pop(table, None)
        if held is not None:
            column_names, schema, batches = held
            self.insert(table, column_names, None, arrow.IpcStream(schema, batches))

    def flush(self) -> None:
        """Every table held, in `INSERT_ORDER` (runs before results: a joined insert may hold a
        later chunk's runs after an earlier chunk's results)."""
        for table in sorted(self.pending, key=lambda t: TABLE_RANK.get(t, len(TABLE_RANK))):
            self._flush(table)


def _can_fork() -> bool:
    """Whether worker processes may be forked from this one: on Linux, with no thread of
    Python's but this one (a forked child has only the forking thread: a lock another thread
    held would stay held in it) and no event loop running. The native threads pyarrow starts
    (jemalloc's, Arrow's pools) re-initialise themselves in a child (at-fork handlers)."""
    if sys.platform != "linux" or threading.active_count() != 1:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


class _Forked:
    """A worker forked from this process, after its imports: it starts in milliseconds, where a
    fresh interpreter importing everything (`python -m shared.control.rebuild_parallel`) takes
    ~0.9 s of CPU, a sixth of a 120,000-event fold on two cores. Same pipes, same protocol as
    the spawned worker's stdin and stdout; the subprocess.Popen calls the pool makes."""

    def __init__(self, inherited: list[Any]) -> None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                for f in inherited:  # the other workers' pipe ends: their EOF must not wait on this one
                    f.close()
                os.close(in_w)
                os.close(out_r)
                code = _serve(os.fdopen(in_r, "rb"), os.fdopen(out_w, "wb"))
            finally:
                os._exit(code)
        os.close(in_r)
        os.close(out_w)
        self.pid = pid
        self.stdin: Any = os.fdopen(in_w, "wb")
        self.stdout: Any = os.fdopen(out_r, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """Blocks until the child ends (it is killed first by `Workers.close` when still running)."""
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


class _Inbox:
    """A thread that reads one worker's pickled chunks off its pipe as they come, up to `AHEAD`
    unread: the worker writes a chunk and goes on to the next while this process inserts (the
    insert releases the GIL). Read only when the inserting process asks, a worker sat blocked on
    its full pipe for the length of every insert, and a fifth of the two cores stayed idle."""

    AHEAD = 2

    PIPE_BYTES = 1 << 20  # Linux's default most for an unprivileged pipe (/proc/sys/fs/pipe-max-size)

    def __init__(self, proc: Any, chunks: int) -> None:
        self.proc = proc
        with contextlib.suppress(OSError, AttributeError):  # a larger pipe: 16x fewer reads and wake-ups
            fcntl.fcntl(proc.stdout.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), self.PIPE_BYTES)
        self.box: queue.Queue[dict[str, Any] | BaseException] = queue.Queue(self.AHEAD)
        self.thread = threading.Thread(target=self._read, args=(chunks,), name=f"rebuild-inbox-{proc.pid}", daemon=True)
        self.thread.start()

    def _read(self, chunks: int) -> None:
        assert self.proc.stdout is not None
        for _ in range(chunks):
            try:
                msg = pickle.load(self.proc.stdout)
            except BaseException as exc:  # noqa: BLE001 - handed to the inserting thread, which raises it
                self.box.put(exc)
                return
            self.box.put(msg)
            if "error" in msg:
                return

    def take(self) -> dict[str, Any]:
        """The worker's next chunk; its failure raised."""
        msg = self.box.get()
        if isinstance(msg, EOFError):
            raise RuntimeError(f"rebuild worker {self.proc.pid} ended early (exit code {self.proc.wait(30)}); "
                               "its error is on stderr") from msg
        if isinstance(msg, BaseException):
            raise msg
        if "error" in msg:
            raise RuntimeError(f"rebuild worker {self.proc.pid}: {msg['error']}")
        return msg

    def end(self) -> None:
        """After the worker has ended (its pipe at EOF): let the thread finish, dropping what it read."""
        while self.thread.is_alive():
            try:
                self.box.get(timeout=0.1)
            except queue.Empty:
                pass
        self.thread.join()


class Workers:
    """Worker processes started early (forked after the imports, or spawned: their start-up
    overlaps opening chdb), given work later."""

    def __init__(self, n: int, fork: bool | None = None) -> None:
        self.inboxes: list[_Inbox] = []  # run's readers of the workers' pipes
        self.forked = _can_fork() if fork is None else fork
        if self.forked:
            arrow.preload()  # once here, not once per worker
            self.procs: list[Any] = []
            for _ in range(n):
                self.procs.append(_Forked([f for p in self.procs for f in (p.stdin, p.stdout)]))
            return
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.procs = [subprocess.Popen([sys.executable, "-m", "shared.control.rebuild_parallel"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
                      for _ in range(n)]

    def run(self, settings: Any, column_types: dict[str, dict[str, str]], chunks: Sequence[tuple[int, int]],
            insert: Any, batch: int) -> int:
        """Hand out the chunks and call `insert(table, column_names, columns, block)` in chunk
        order (`block`: the bytes of an Arrow IPC stream of one or more chunks' rows, or None
        with the columns to insert natively); returns the messages read."""
        n = len(self.procs)
        for k, proc in enumerate(self.procs):
            assert proc.stdin is not None
            conf = {"settings": settings.model_dump(mode="json"), "types": column_types,
                    "chunks": list(chunks[k::n]), "batch": batch}
            proc.stdin.write(pickle.dumps(conf, protocol=pickle.HIGHEST_PROTOCOL))
            proc.stdin.close()
        read = 0
        joined = _Joined(insert)
        self.inboxes = [_Inbox(proc, len(chunks[k::n])) for k, proc in enumerate(self.procs)]
        for i in range(len(chunks)):
            msg = self.inboxes[i % n].take()
            read += msg["messages"]
            if i == len(chunks) - 1:
                joined.flush()  # the last chunk alone: the insert after the workers end is a short one
            for table, column_names, columns, parts in msg["blocks"]:
                joined.add(table, column_names, columns, parts)
            if i % JOIN_CHUNKS == JOIN_CHUNKS - 1:
                joined.flush()
        joined.flush()
        return read

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        for inbox in self.inboxes:
            inbox.end()
        for proc in self.procs:
            for f in (proc.stdin, proc.stdout):
                if f is not None and not f.closed:
                    f.close()


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

async def stream_range(nc: Any, start: int, end: int, batch: int, timeout: float = 300.0) -> AsyncIterator[list[Any]]:
    """The messages with stream sequence start..end (fewer where the stream has gaps), in
    batches, complete as the stream's leader holds them.

    The ephemeral consumer reads the copy of the member the server placed it on, which may lag
    the leader; its pending count then ends the read short. So after it the leader is asked for
    the first message past the last one read: one at or before `end` means the copy was behind,
    and a new consumer reads on from there (`streams.read_consumer` closes a read the same way)."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout
    nxt = max(start, 1)
    while nxt <= end:
        async with ephemeral_consumer(js, DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=nxt) as info:
            pending = int(info.num_pending or 0)
            if pending:
                async for msgs in StreamReader(nc, info.name).batches(min(pending, end - nxt + 1), batch, end_seq=end):
                    if msgs:
                        nxt = max(nxt, int(msgs[-1].metadata.sequence.stream) + 1)
                        yield msgs
        if not await copy_was_behind(js, events.STREAM_SUBJECTS[0], nxt - 1, end, deadline, timeout):
            return
        await asyncio.sleep(0.05)


async def _read_chunk(nc: Any, start: int, end: int, batch: int) -> list[Any]:
    """The messages with stream sequence start..end (fewer where the stream has gaps)."""
    out: list[Any] = []
    async for msgs in stream_range(nc, start, end, batch):
        out.extend(msgs)
    return out


def worker_blocks(p: Any, types: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    """What a worker sends per table of a projection: (table, column names, the columns only when
    there is no Arrow block, the block's IPC messages). The block goes as the bytes the insert
    reads (no unpickling and re-encoding in the inserting process); without one, the inserting
    process falls back to a Native insert of the columns."""
    blocks = []
    for table, column_names, columns in projection_columns(p):
        block = arrow.block_or_none(types.__getitem__, table, column_names, columns)
        parts = arrow.ipc_buffers(block) if block is not None else None  # bytes once unpickled
        blocks.append((table, column_names, None if parts is not None else columns, parts))
    return blocks


async def _work(conf: dict[str, Any], out: Any) -> None:
    settings = Settings.model_validate(conf["settings"])
    types = {table: arrow.arrow_types(t) for table, t in conf["types"].items()}
    projector = Projector(settings)
    gc.disable()  # as in the in-process fold: a chunk's objects make no cycles
    async with bus.session(settings) as nc:
        for start, end in conf["chunks"]:
            msgs = await _read_chunk(nc, start, end, conf["batch"])
            p = projector.project_batch(msgs)
            blocks = worker_blocks(p, types)
            pickle.dump({"messages": len(msgs), "blocks": blocks}, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
            del msgs, p, blocks


def _serve(conf_in: Any, out: Any) -> int:
    """A worker's life: one pickled configuration in, a pickled message per chunk out (or one
    with the error, which fails the rebuild)."""
    try:
        conf = pickle.load(conf_in)
    except EOFError:
        return 0  # not needed after all
    try:
        asyncio.run(_work(conf, out))
    except Exception as exc:  # noqa: BLE001 - reported to the inserting process, which fails the rebuild
        pickle.dump({"error": f"{type(exc).__name__}: {exc}"}, out)
        out.flush()
        return 1
    finally:
        conf_in.close()
    out.close()
    return 0


def worker_main() -> int:
    """A spawned worker (`python -m shared.control.rebuild_parallel`)."""
    # nothing but the pickled chunks goes to the pipe: it moves to a descriptor of its own, and
    # whatever else writes to stdout (Python or C) goes to stderr
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    arrow.preload()  # before the configuration comes (meanwhile the inserting process opens chdb)
    return _serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    sys.exit(worker_main())
