"""The projector's logic: fetched batches of `vb.>` messages -> ClickHouse rows, and read-only SQL
answers for the embedded engine. Kept apart from the FastStream wiring
(`services/projector/app.py`) so run control (`veribus projections rebuild`) and tests can drive
it in-process.

Lean events carry content keys, not the job's question, template and rubric: the projector copies
each content it sees referenced into the `contents` table, once, through a `ContentFetcher` its
caller gives it (the content store is on the bus, a layer this module does not import)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.core.config import Settings
from shared.core.events import decode
from shared.store.engine import RESULT_JSON, Store, json_safe_rows, open_store, query_error_text
from shared.store.rows import PROJECTION_FAILED, Projection, project_envelope, undecodable_row
from shared.store.sql_guard import RESULT_TOO_LARGE, ReadOnlyError

log = logging.getLogger("veribus.projector")

DEFAULT_MAX_REPLY = 1024 * 1024


# a content's stored bytes by key, or None when the content store does not have it
ContentFetcher = Callable[[str], Awaitable[bytes | None]]
MAX_KNOWN_CONTENTS = 200_000  # keys remembered as stored; past it, ClickHouse is asked again

# (run_id, kind, key) of every content a job event refers to (`Job.refs`): answer.generated
# carries one job, answer.requested a list of them (what `content_refs.content_refs` reads from an event)
CONTENT_REFS_SQL = (
    "SELECT run_id, tupleElement(kv, 1) AS kind, tupleElement(kv, 2) AS key FROM events"
    " ARRAY JOIN JSONExtractKeysAndValues(payload, 'job', 'refs', 'String') AS kv"
    " WHERE event_type = 'answer.generated'"
    " UNION ALL"
    " SELECT run_id, tupleElement(kv, 1) AS kind, tupleElement(kv, 2) AS key FROM events"
    " ARRAY JOIN JSONExtractArrayRaw(payload, 'jobs') AS j"
    " ARRAY JOIN JSONExtractKeysAndValues(j, 'refs', 'String') AS kv"
    " WHERE event_type = 'answer.requested'"
)

# (run_id, content keys its job events refer to that `contents` does not have)
MISSING_CONTENTS_SQL = (
    f"SELECT run_id, uniqExact(key) FROM ({CONTENT_REFS_SQL}) "
    "WHERE key != '' AND key NOT IN (SELECT key FROM contents) GROUP BY run_id ORDER BY run_id"
)

# key -> (kind, first run to mention it) of the referenced contents `contents` does not have
UNCOPIED_REFS_SQL = (
    f"SELECT key, any(kind), min(run_id) FROM ({CONTENT_REFS_SQL}) "
    "WHERE key != '' AND key NOT IN (SELECT key FROM contents) GROUP BY key"
)


def missing_contents(query: Callable[[str], Any]) -> dict[str, int]:
    """run_id -> how many contents its events refer to that ClickHouse does not have (their
    content was gone from the content store when the events were projected)."""
    return {str(r[0]): int(r[1]) for r in query(MISSING_CONTENTS_SQL).rows}


class _QueryRequest(msgspec.Struct):
    sql: str
    params: dict[str, Any] | None = None


_query_dec = msgspec.json.Decoder(_QueryRequest)


@dataclass
class Stats:
    batches: int = 0
    events: int = 0
    results: int = 0
    runs: int = 0
    undecodable: int = 0
    insert_failures: int = 0
    queries: int = 0
    contents: int = 0  # contents copied from the content store into ClickHouse
    contents_missing: int = 0  # referenced contents the content store did not have
    project_cpu_s: float = 0.0  # CPU of decode + row building (the per-event Python work)


class Projector:
    """The projector's logic, separate from the FastStream wiring so it can be driven directly."""

    def __init__(self, settings: Settings, fetch_content: ContentFetcher | None = None) -> None:
        self.settings = settings
        self.store: Store | None = None
        self.stats = Stats()
        self.max_reply_bytes = DEFAULT_MAX_REPLY
        self.fetch_content = fetch_content
        self._known: set[str] = set()  # keys ClickHouse has (stored by us, or found there)
        self._missing: set[str] = set()  # keys the content store did not have: said once each

    def open(self) -> None:
        """Open (and migrate) the store; call in the main thread (chdb import, folder lock)."""
        if self.store is None:
            self.store = open_store(self.settings)
            self.store.reader()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    # ---- events ----
    def project_batch(self, msgs: list[Any]) -> Projection:
        """Decode a fetched batch into rows. Never raises for a bad message."""
        t0 = time.process_time()
        out = Projection()
        bad = 0
        for m in msgs:
            try:
                env = decode(m.data, m.subject)
            except Exception as exc:  # noqa: BLE001 - any undecodable message is recorded
                out.events.append(undecodable_row(m.subject, m.data, exc))
                bad += 1
                continue
            project_envelope(env, out)
        self.stats.undecodable += bad
        self.stats.project_cpu_s += time.process_time() - t0
        return out

    def _remember(self, keys: Iterable[str]) -> None:
        if len(self._known) > MAX_KNOWN_CONTENTS:
            self._known.clear()
        self._known.update(keys)

    async def attach_contents(self, p: Projection) -> None:
        """Add to `p.contents` the referenced contents ClickHouse does not have yet, read from the
        content store once each. A content the store does not have is logged (once) and left out;
        the events still go in, and `missing_contents` names the runs it affects."""
        new = {k: v for k, v in p.refs.items() if k not in self._known and k not in self._missing}
        if not new or self.fetch_content is None:
            return
        assert self.store is not None, "Projector.open() first"
        self._remember(await asyncio.to_thread(self.store.existing_contents, list(new)))
        todo = [k for k in new if k not in self._known]
        fetch = self.fetch_content
        bodies = await asyncio.gather(*(fetch(k) for k in todo), return_exceptions=True)
        gone: dict[str, list[tuple[str, str]]] = {}  # run -> (key, kind) of contents the store no longer has
        for key, body in zip(todo, bodies, strict=True):
            kind, run_id = new[key]
            if isinstance(body, BaseException):
                log.warning("content %s (run %s) could not be read from the content store: %s; "
                            "it is tried again when an event refers to it", key, run_id, body)
            elif body is None:
                self._missing.add(key)
                self.stats.contents_missing += 1
                gone.setdefault(run_id, []).append((key, kind))
            else:
                p.contents.append([key, kind, run_id, bytes(body)])
        for run_id, lost in sorted(gone.items()):  # one line per run, not per content (a run has thousands)
            log.warning("%d content(s) (kinds %s; first %s) of run %s are not in the content store any more: "
                        "ClickHouse will not have that run's question/template/rubric", len(lost),
                        ", ".join(sorted({kind for _, kind in lost})), min(lost)[0], run_id)

    def insert(self, p: Projection) -> None:
        assert self.store is not None, "Projector.open() first"
        self.store.insert_projection(p)
        self._remember(row[0] for row in p.contents)  # only once inserted: a failed batch fetches again
        self.stats.contents += len(p.contents)
        self.stats.batches += 1
        self.stats.events += len(p.events)
        self.stats.results += len(p.results)
        self.stats.runs += len(p.runs)

    def store_ok(self) -> bool:
        try:
            assert self.store is not None
            self.store.query("SELECT 1")
            return True
        except Exception:  # noqa: BLE001 - any failure means "not available"
            return False

    async def handle_batch(self, msgs: list[Any]) -> tuple[list[Any], list[Any]]:
        """Project and insert; returns (messages to ack, messages to nak).

        A failed batch insert is retried message by message when the store itself answers, so
        one row ClickHouse refuses is recorded as a 'projection_failed' event and acked instead
        of blocking the consumer; when the store is down, everything is nak'ed for later.
        """
        p = self.project_batch(msgs)
        try:
            await self.attach_contents(p)
            await asyncio.to_thread(self.insert, p)
            return msgs, []
        except Exception as exc:  # noqa: BLE001
            self.stats.insert_failures += 1
            log.warning("batch insert of %d events failed: %s", len(msgs), exc)
        if not await asyncio.to_thread(self.store_ok):
            return [], msgs
        ack: list[Any] = []
        nak: list[Any] = []
        for m in msgs:
            one = self.project_batch([m])
            try:
                await self.attach_contents(one)
                await asyncio.to_thread(self.insert, one)
                ack.append(m)
                continue
            except Exception as exc:  # noqa: BLE001
                row = undecodable_row(m.subject, m.data, exc, kind=PROJECTION_FAILED)
                log.error("message on %s cannot be stored, recorded as projection_failed: %s", m.subject, exc)
                try:
                    await asyncio.to_thread(self.insert, Projection(events=[row]))
                    ack.append(m)
                except Exception:  # noqa: BLE001 - the store went away: retry later
                    nak.append(m)
        return ack, nak

    # ---- queries ----
    def answer_query(self, data: bytes) -> bytes:
        """A request body -> the JSON reply (never raises)."""
        self.stats.queries += 1
        try:
            req = _query_dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return RESULT_JSON.encode({"error": f"bad request: {exc}"})
        try:
            assert self.store is not None
            res = self.store.query_read_only(req.sql, req.params, max_bytes=self.max_reply_bytes)
        except ReadOnlyError as exc:
            return RESULT_JSON.encode({"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - database errors go back to the caller
            return RESULT_JSON.encode({"error": query_error_text(exc)[:4000]})
        body = RESULT_JSON.encode({"columns": res.columns, "types": res.types, "rows": json_safe_rows(res.rows)})
        if len(body) > self.max_reply_bytes:
            return RESULT_JSON.encode({
                "error": f"{RESULT_TOO_LARGE} for a NATS reply ({len(body)} bytes, {len(res.rows)} rows, "
                f"limit {self.max_reply_bytes}): add a LIMIT or aggregate"
            })
        return body
