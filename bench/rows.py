"""`veribus bench --projection-rows`: the projection's per-event Python, without NATS or an insert.

The rebuild's event mix (`bench.rebuild.generate`, as published: `events.wire` on its subject)
goes through `Projector.project_batch` (decode, rows) and then what a rebuild worker does with
the rows (`projection_columns`, the Arrow columns, their IPC messages, pickled to a pipe-like
sink), several times over; the figures are CPU microseconds per event of each step, best of the
repetitions (the machine is shared: compare versions interleaved, A B A B, never across sittings).
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.rebuild import generate
from shared.control.rebuild_parallel import worker_blocks
from shared.core import events
from shared.core.config import Settings
from shared.store import arrow
from shared.store.engine import open_store
from shared.store.projection import Projector

TABLES = ("events", "verification_results", "runs", "contents")


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--projection-rows", action="store_true",
                   help="instead: CPU per event of decoding and building rows, and of their Arrow blocks")
    b.add_argument("--projection-events", type=int, default=30_000, help="about this many events for --projection-rows")
    b.add_argument("--projection-repeat", type=int, default=5, help="repetitions for --projection-rows (the best is reported)")


class _Msg:
    """What `project_batch` reads of a stream message."""

    __slots__ = ("subject", "data")

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data = subject, data


def _arrow_types(home: Path) -> dict[str, dict[str, Any]]:
    """The tables' Arrow types, from a fresh embedded store's columns (as a rebuild worker gets them)."""
    store = open_store(Settings(home=home))
    try:
        return {t: arrow.arrow_types(store.column_types(t)) for t in TABLES}
    finally:
        store.close()


def measure(n_events: int, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="veribus-bench-rows-") as tmp:
        types = _arrow_types(Path(tmp) / "home")
        msgs = [_Msg(e.subject, events.wire(e)) for e in generate(n_events, 10)]
        projector = Projector(Settings(home=Path(tmp) / "home"))
        rows_us, arrow_us = [], []
        gc_was_on = gc.isenabled()
        gc.disable()  # as in the rebuild's fold
        try:
            with open(os.devnull, "wb") as sink:
                for _ in range(repeat):
                    t0 = time.process_time()
                    p = projector.project_batch(msgs)
                    t1 = time.process_time()
                    blocks = worker_blocks(p, types)
                    pickle.dump({"messages": len(msgs), "blocks": blocks}, sink, protocol=pickle.HIGHEST_PROTOCOL)
                    t2 = time.process_time()
                    rows_us.append(1e6 * (t1 - t0) / len(msgs))
                    arrow_us.append(1e6 * (t2 - t1) / len(msgs))
                    del p, blocks
        finally:
            if gc_was_on:
                gc.enable()
        return {"events": len(msgs), "project_batch_us": round(min(rows_us), 2), "arrow_us": round(min(arrow_us), 2),
                "project_batch_all": [round(x, 2) for x in rows_us], "arrow_all": [round(x, 2) for x in arrow_us]}


def main(args: argparse.Namespace) -> int:
    row = measure(args.projection_events, max(1, args.projection_repeat))
    print(f"\n== projection rows: {row['events']} events, best of {len(row['project_batch_all'])}")
    print(f"  decode + rows (Projector.project_batch): {row['project_batch_us']} us CPU an event")
    print(f"  Arrow columns + IPC messages + pickle:    {row['arrow_us']} us CPU an event")
    print("\n" + msgspec.json.format(msgspec.json.encode(row)).decode())
    return 0
