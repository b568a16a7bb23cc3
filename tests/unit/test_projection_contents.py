"""The projector copies the contents lean events refer to into ClickHouse once each: read from the
content store only when ClickHouse does not have them, again after a failed insert, never for a
content the store has lost (said once), and not at all for events without refs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from shared.core import events
from shared.core.config import Settings
from shared.store.projection import Projector
from shared.store.rows import Projection, content_refs


class FakeStore:
    """The two store calls the projector makes, over in-memory rows."""

    def __init__(self, fail_inserts: int = 0) -> None:
        self.contents: list[list[Any]] = []
        self.events: list[list[Any]] = []
        self.fail_inserts = fail_inserts

    def existing_contents(self, keys: list[str]) -> set[str]:
        return {r[0] for r in self.contents} & set(keys)

    def insert_projection(self, p: Projection) -> None:
        if self.fail_inserts:
            self.fail_inserts -= 1
            raise RuntimeError("insert refused")
        self.contents += p.contents
        self.events += p.events

    def query(self, sql: str) -> Any:
        return SimpleNamespace(rows=[(1,)])


class FakeContentStore:
    def __init__(self, blobs: dict[str, bytes], broken: set[str] | None = None) -> None:
        self.blobs, self.broken = blobs, broken or set()
        self.reads: list[str] = []

    async def get_raw(self, key: str) -> bytes | None:
        self.reads.append(key)
        if key in self.broken:
            raise ConnectionError("bucket unreachable")
        return self.blobs.get(key)


def _msg(event_type: str, run_id: str, rid: str, refs: dict[str, str]) -> Any:
    job = events.Job(refs=refs)
    payload: Any = (events.AnswerRequested(jobs=[job]) if event_type == events.ANSWER_REQUESTED
                    else events.StageEvent(job=job, state=events.State()))
    env = events.make_envelope(event_type, run_id, rid, payload, "test/1")
    return SimpleNamespace(data=events.wire(env), subject=env.subject)


def _projector(store: FakeStore, blobs: FakeContentStore) -> Projector:
    p = Projector(Settings(), fetch_content=blobs.get_raw)
    p.store = store  # type: ignore[assignment]
    return p


BLOBS = {"c_q1": b'{"rubric":{"traits":[]}}', "c_q2": b'{"rubric":null}', "c_o": b'{"options":{}}'}


async def test_each_content_is_read_once_and_stored_once() -> None:
    store, kv = FakeStore(), FakeContentStore(BLOBS)
    proj = _projector(store, kv)
    first = [_msg(events.ANSWER_REQUESTED, "r1", "a1", {"q": "c_q1", "o": "c_o"}),
             _msg(events.ANSWER_GENERATED, "r1", "x1", {"q": "c_q1", "o": "c_o"}),
             _msg(events.ANSWER_GENERATED, "r1", "x2", {"q": "c_q2", "o": "c_o"})]
    assert await proj.handle_batch(first) == (first, [])
    assert sorted(kv.reads) == ["c_o", "c_q1", "c_q2"]
    assert sorted(store.contents) == [["c_o", "o", "r1", BLOBS["c_o"]], ["c_q1", "q", "r1", BLOBS["c_q1"]],
                                      ["c_q2", "q", "r1", BLOBS["c_q2"]]]
    # the same events again (a replay) and another run with the same question: nothing read or added
    again = [*first, _msg(events.ANSWER_GENERATED, "r2", "y1", {"q": "c_q1"})]
    assert await proj.handle_batch(again) == (again, [])
    assert len(kv.reads) == 3 and len(store.contents) == 3 and proj.stats.contents == 3
    assert len(store.events) == 7


async def test_a_fresh_projector_asks_clickhouse_before_the_content_store() -> None:
    store = FakeStore()
    store.contents = [["c_q1", "q", "r0", BLOBS["c_q1"]]]
    kv = FakeContentStore(BLOBS)
    await _projector(store, kv).handle_batch([_msg(events.ANSWER_GENERATED, "r1", "x1", {"q": "c_q1", "o": "c_o"})])
    assert kv.reads == ["c_o"]
    assert [r[:3] for r in store.contents] == [["c_q1", "q", "r0"], ["c_o", "o", "r1"]]


async def test_lost_content_is_said_once_and_the_events_still_go_in(caplog: pytest.LogCaptureFixture) -> None:
    store, kv = FakeStore(), FakeContentStore({})
    proj = _projector(store, kv)
    for rid in ("x1", "x2"):
        await proj.handle_batch([_msg(events.ANSWER_GENERATED, "r1", rid, {"q": "c_gone"})])
    assert kv.reads == ["c_gone"] and store.contents == [] and len(store.events) == 2
    assert proj.stats.contents_missing == 1
    assert [r.getMessage() for r in caplog.records if "c_gone" in r.getMessage()] == [
        "1 content(s) (kinds q; first c_gone) of run r1 are not in the content store any more: "
        "ClickHouse will not have that run's question/template/rubric"]


async def test_lost_contents_of_a_run_are_said_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    store, kv = FakeStore(), FakeContentStore({})
    await _projector(store, kv).handle_batch([_msg(events.ANSWER_GENERATED, "r1", f"x{i}", {"q": f"c_gone{i}",
                                                                                             "o": "c_opts"})
                                              for i in range(3)])
    lines = [r.getMessage() for r in caplog.records if "not in the content store" in r.getMessage()]
    assert lines == ["4 content(s) (kinds o, q; first c_gone0) of run r1 are not in the content store any more: "
                     "ClickHouse will not have that run's question/template/rubric"]


async def test_unreadable_content_is_tried_again_later() -> None:
    store, kv = FakeStore(), FakeContentStore(BLOBS, broken={"c_q1"})
    proj = _projector(store, kv)
    await proj.handle_batch([_msg(events.ANSWER_GENERATED, "r1", "x1", {"q": "c_q1"})])
    assert store.contents == [] and len(store.events) == 1
    kv.broken.clear()
    await proj.handle_batch([_msg(events.ANSWER_GENERATED, "r1", "x2", {"q": "c_q1"})])
    assert kv.reads == ["c_q1", "c_q1"] and [r[0] for r in store.contents] == ["c_q1"]


async def test_a_failed_insert_reads_the_content_again() -> None:
    store, kv = FakeStore(fail_inserts=1), FakeContentStore(BLOBS)
    proj = _projector(store, kv)
    msgs = [_msg(events.ANSWER_GENERATED, "r1", "x1", {"q": "c_q1"})]
    assert await proj.handle_batch(msgs) == (msgs, [])  # the batch failed, the message alone went in
    assert kv.reads == ["c_q1", "c_q1"] and [r[0] for r in store.contents] == ["c_q1"]


def test_refs_come_from_job_events_only() -> None:
    fat = events.make_envelope(events.ANSWER_GENERATED, "r1", "x1",
                               events.StageEvent(job=events.Job(question_text="inline"), state=events.State()), "t/1")
    other = events.make_envelope(events.TEMPLATE_PARSED, "r1", "x1",
                                 events.StageEvent(job=events.Job(refs={"q": "c_q1"}), state=events.State()), "t/1")
    assert content_refs(fat) == [] and content_refs(other) == []
