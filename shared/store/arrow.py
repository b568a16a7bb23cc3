"""Rows -> an Arrow table typed from the ClickHouse columns, for inserts in Arrow format.

clickhouse-connect's own insert serialises every value in Python (about a microsecond each, ~90
values per result); building Arrow columns from the same Python lists runs in C and ClickHouse
reads the block natively, so the projector and `projections rebuild` spend their time on the
events, not on the insert. The values are the rows `shared.store.rows` builds, unchanged: the
same Python values typed by the same columns, so the stored rows are the same either way (the
store falls back to the Native insert for anything Arrow cannot type).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger("veribus.store")

_UNITS = {0: "s", 3: "ms", 6: "us", 9: "ns"}


def _split_args(inner: str) -> list[str]:
    """`String, Map(String, Float64)` -> its top-level arguments."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(inner[start:i].strip())
            start = i + 1
    out.append(inner[start:].strip())
    return out


def arrow_type(ch_type: str) -> Any:
    """The Arrow type a ClickHouse column reads from (ValueError for one not handled here)."""
    import pyarrow as pa  # local import: pyarrow is heavy and only the store's inserts need it

    t = ch_type.strip()
    for wrapper in ("LowCardinality(", "Nullable("):
        if t.startswith(wrapper):
            return arrow_type(t[len(wrapper):-1])
    if t.startswith("Array("):
        return pa.list_(arrow_type(t[6:-1]))
    if t.startswith("Map("):
        key, value = _split_args(t[4:-1])
        return pa.map_(arrow_type(key), arrow_type(value))
    if t.startswith("DateTime64("):
        args = _split_args(t[11:-1])
        tz = args[1].strip("'") if len(args) > 1 else None
        return pa.timestamp(_UNITS[int(args[0])], tz=tz)
    simple = {
        "String": pa.binary(), "Bool": pa.bool_(), "Float64": pa.float64(), "Float32": pa.float32(),
        "UInt8": pa.uint8(), "UInt16": pa.uint16(), "UInt32": pa.uint32(), "UInt64": pa.uint64(),
        "Int8": pa.int8(), "Int16": pa.int16(), "Int32": pa.int32(), "Int64": pa.int64(),
    }
    if t in simple:
        return simple[t]
    raise ValueError(f"no Arrow type for ClickHouse type {ch_type!r}")


def arrow_types(ch_types: dict[str, str]) -> dict[str, Any]:
    """{column: ClickHouse type} -> {column: Arrow type} (a column not handled raises ValueError)."""
    return {name: arrow_type(t) for name, t in ch_types.items()}


def to_arrow(types: Mapping[str, Any], column_names: Sequence[str], columns: Sequence[Sequence[Any]]) -> Any:
    """An Arrow table of `columns` (one sequence of values per column name)."""
    import pyarrow as pa  # local import: pyarrow is heavy and only the store's inserts need it

    arrays = [pa.array(values, type=types[name]) for name, values in zip(column_names, columns, strict=True)]
    return pa.Table.from_arrays(arrays, names=list(column_names))


STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an Arrow IPC stream's end-of-stream marker


def ipc_parts(table: Any) -> tuple[bytes, list[bytes]]:
    """An Arrow table as IPC messages: its schema's and its record batches'. Concatenated, the
    schema, the batches of any tables of that schema and `STREAM_END` are one IPC stream, what
    ClickHouse's `ArrowStream` input reads: a rebuild worker makes them, the inserting process
    joins several chunks' into one insert without decoding them (`IpcStream`)."""
    return table.schema.serialize().to_pybytes(), [b.serialize().to_pybytes() for b in table.to_batches()]


def ipc_buffers(table: Any) -> tuple[pickle.PickleBuffer, list[pickle.PickleBuffer]]:
    """`ipc_parts` for pickling: the messages' Arrow buffers, read-only, which pickle writes
    straight from Arrow's memory (no `to_pybytes` copy first: ~1 us an event of a rebuild's
    worker) and which unpickle as the same `bytes` as `ipc_parts`'."""
    def view(buf: Any) -> pickle.PickleBuffer:
        return pickle.PickleBuffer(memoryview(buf).toreadonly())

    return view(table.schema.serialize()), [view(b.serialize()) for b in table.to_batches()]


def preload() -> None:
    """Build one Arrow array now: pyarrow imports pandas on its first `pa.array` (~0.3 s of CPU,
    more on a busy machine), which would otherwise be paid inside the first insert (the live
    projector's first batch, a rebuild worker's first chunk; profiled, issue 12)."""
    import pyarrow as pa  # local import: heavy, and only the processes that fill Arrow columns need it

    pa.array([b""], type=pa.binary())


class IpcStream(tuple):
    """One IPC stream of a schema's message and record batch messages (`ipc_parts`), kept as its
    pieces: the insert writes them out one after the other, so the stream is never joined into
    one buffer first (a fresh ~40 MB allocation and copy per rebuild insert: ~2 us an event)."""

    __slots__ = ()

    def __new__(cls, schema: bytes, batches: Sequence[bytes]) -> IpcStream:
        return super().__new__(cls, (schema, *batches, STREAM_END))

    def __bytes__(self) -> bytes:
        return b"".join(self)


def block_or_none(types_of: Callable[[str], Mapping[str, Any]], table: str, column_names: Sequence[str],
                  columns: Sequence[Sequence[Any]]) -> Any | None:
    """`to_arrow` with the column types `types_of(table)` gives, or None when either fails: the
    caller then inserts natively, so a row is never lost to the format."""
    try:
        return to_arrow(types_of(table), column_names, columns)
    except Exception as exc:  # noqa: BLE001 - any Arrow problem: the slower, general insert
        log.debug("no Arrow block for %s (%s); inserting natively", table, exc)
        return None
