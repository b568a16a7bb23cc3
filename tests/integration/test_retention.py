"""Stream retention from Settings on a real nats-server: the limits are applied, a process without
them keeps them, the oldest events go first, and the rebuild report says what is gone."""

from __future__ import annotations

from types import SimpleNamespace

import nats

from shared.control import retention
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus


def _env(i: int) -> events.Envelope:
    return events.make_envelope(events.RUN_CANCELLED, f"run{i:03d}", events.RUN_KEY,
                                {"reason": "x" * 400}, "test")


async def test_retention_limits_and_what_is_gone(nats_server) -> None:  # noqa: ANN001
    settings = Settings(nats_url=nats_server.url, stream_max_bytes=20_000, stream_max_age_s=3600)
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js, settings)
        await bus.ensure_stream(js, Settings(nats_url=nats_server.url))  # no limits configured here ...
        await bus.ensure_stream(js)
        cfg = (await js.stream_info(events.STREAM)).config
        assert (cfg.max_bytes, cfg.max_age) == (20_000, 3600)  # ... so the operator's stay
        for i in range(100):
            await bus.publish(js, _env(i))
        kept = await retention.stream_retention(settings)
    finally:
        await nc.close()
    assert kept.bytes <= 20_000 and 0 < kept.messages < 100
    assert kept.removed == 100 - kept.messages and kept.first_seq == kept.removed + 1
    text = "\n".join(kept.lines())
    assert "max age 3600 s" in text and "max 20000 bytes" in text
    assert f"{kept.removed} older events are gone" in text and "cannot be rebuilt" in text


def test_rebuild_loss_names_lost_and_partial_runs() -> None:
    before = {"a": 10, "b": 10, "c": 5}
    after = {"a": 10, "b": 4}
    loss = retention.compare(before, after)
    assert loss.lost_runs == ["c"] and loss.partial_runs == {"b": (10, 4)}
    text = "\n".join(loss.lines())
    assert "1 run(s) could not be rebuilt" in text and "c" in text and "run b: 4 of its 10 results" in text
    assert retention.compare({"a": 1}, {"a": 1}).lines() == [
        "  every run in the tables before the rebuild was rebuilt with all its results"]
    assert retention.results_per_run(lambda sql: SimpleNamespace(rows=[("a", 3)])) == {"a": 3}
