"""`projections rebuild` on a stream that retention has cut (real nats-server, real chdb): the
kept runs come back exactly, and the report names the run whose events are gone."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import nats
import pytest

from bench.rebuild import result_events
from shared.cli import lifecycle as cli_lifecycle
from shared.control import rebuild, retention
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus
from shared.store.engine import open_store


def _run_events(run_id: str, n: int, first: int) -> list[events.Envelope]:
    ts = "2025-01-01T00:00:00+00:00"
    out = [events.make_envelope(events.RUN_REQUESTED, run_id, events.RUN_KEY, events.RunRequested(
        run_id=run_id, timestamp=ts, job_count=n, answer_count=n, benchmark_name="bench"), "cli/test")]
    for i in range(first, first + n):
        out.extend(result_events(run_id, i, ts, time.time()))
    return out


async def _publish(settings: Settings, envs: list[events.Envelope]) -> int:
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js, settings)
        await bus.publish_many(js, envs)
        return int((await js.stream_info(events.STREAM)).state.bytes)
    finally:
        await nc.close()


async def _limit_bytes(settings: Settings, max_bytes: int) -> None:
    """What `VERIBUS_STREAM_MAX_BYTES` does to a stream that holds more: the oldest events go."""
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        cfg = (await js.stream_info(events.STREAM)).config
        cfg.max_bytes = max_bytes
        await js.update_stream(cfg)
    finally:
        await nc.close()


def _results(settings: Settings) -> dict[str, bytes]:
    store = open_store(settings)
    try:
        rows = store.query("SELECT result_id, result_json FROM verification_results FINAL ORDER BY result_id").rows
    finally:
        store.close()
    return {r: bytes(j, "utf-8") if isinstance(j, str) else bytes(j) for r, j in rows}


def test_rebuild_after_retention_names_what_is_gone(nats_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    settings = Settings(home=tmp_path / "home", nats_url=nats_server.url)
    old, kept = "20250101T000000-oldrun01", "20250102T000000-keptrun2"
    size_old = asyncio.run(_publish(settings, _run_events(old, 12, 100)))
    size_all = asyncio.run(_publish(settings, _run_events(kept, 20, 500)))
    first = rebuild.rebuild_projections(settings)
    assert first.after["verification_results"][0] == 32 and first.after["runs"][0] == 2
    before = _results(settings)

    asyncio.run(_limit_bytes(settings, size_all - size_old))  # exactly the older run's events go
    monkeypatch.setattr(cli_lifecycle, "deployment_settings", lambda: settings)
    assert cli_lifecycle.cmd_projections_rebuild(argparse.Namespace(timeout=120.0)) == 0
    out = capsys.readouterr().out

    assert "older events are gone" in out and "cannot be rebuilt" in out
    assert f"1 run(s) could not be rebuilt (their events are gone): {old}" in out
    assert kept not in out.split("could not be rebuilt")[1]  # the kept run is not named as lost
    after = _results(settings)
    assert after == {rid: j for rid, j in before.items() if rid in after} and len(after) == 20  # kept run: identical rows
    kept_state = asyncio.run(retention.stream_retention(settings))
    assert kept_state.max_bytes == size_all - size_old and kept_state.removed == 12 * 6 + 1
