"""A real service process (guards) against a real nats-server: /healthz, /readyz and /metrics on
its configured port; a forged, undecodable bus message shows up as a dead letter in the metrics
and in the consumer counts; readiness follows the NATS connection (server killed: 503 with the
reason; restarted: 200 again); `VERIBUS_LOG_FORMAT=json` gives one JSON object per log line."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.control.processes import free_port
from tests.conftest import REPO, NatsServer


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def _wait(pred, timeout: float = 60.0, what: str = "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def guards(nats_server: NatsServer, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    port = free_port()
    log = tmp_path / "guards.log"
    env = {**os.environ, "VERIBUS_NATS_URL": nats_server.url, "VERIBUS_HOME": str(tmp_path / "home"),
           "VERIBUS_METRICS_PORT": str(port), "VERIBUS_LOG_FORMAT": "json", "VERIBUS_CONSUMER_MAX_DELIVER": "1"}
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "services.guards"], cwd=REPO, env=env, stdout=fh,
                                stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _get(port, "/readyz")[0] == 200 or proc.poll() is not None, 90, "guards ready")
        assert proc.poll() is None, log.read_text()[-3000:]
        yield port, log
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_health_readiness_and_metrics_of_a_service(guards: tuple[int, Path], nats_server: NatsServer) -> None:
    port, log = guards
    assert _get(port, "/healthz") == (200, "ok\n")
    status, text = _get(port, "/metrics")
    assert status == 200 and "# TYPE veribus_handler_seconds histogram" in text
    assert _metric(text, "veribus_consumer_pending", service="guards", consumer="guards") == 0

    # an attacker (or a broken producer) publishes bytes that are no envelope
    async def forge() -> None:
        import nats

        nc = await nats.connect(nats_server.url)
        try:
            await nc.jetstream().publish("vb.answer.generated.run-x.res-1", b"\x00not an envelope{")
        finally:
            await nc.close()

    asyncio.run(forge())
    _wait(lambda: (_metric(_get(port, "/metrics")[1], "veribus_messages_total", service="guards",
                           outcome="dead_letter") or 0) >= 1, 60, "the dead letter in the metrics")
    text = _get(port, "/metrics")[1]
    assert _metric(text, "veribus_messages_total", service="guards", event_type="answer.generated",
                   outcome="handled") is None
    assert _metric(text, "veribus_handler_seconds_count", service="guards", event_type="answer.generated") == 1
    assert _metric(text, "veribus_handler_seconds_bucket", service="guards", event_type="answer.generated",
                   le="+Inf") == 1
    assert _metric(text, "veribus_in_flight", service="guards") == 0

    # readiness follows the connection to NATS
    nats_server.stop()
    _wait(lambda: _get(port, "/readyz")[0] == 503, 60, "/readyz 503 with NATS down")
    assert "NATS connection lost" in _get(port, "/readyz")[1]
    assert _get(port, "/healthz")[0] == 200  # alive, just not ready
    nats_server.start()
    _wait(lambda: _get(port, "/readyz")[0] == 200, 90, "/readyz 200 after NATS is back")

    lines = [line for line in log.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records and all({"ts", "level", "service", "message"} <= set(r) for r in records)
    assert any(r["message"] == "guards ready" for r in records)
    assert any("dead-lettered" in r["message"] and r["level"] == "ERROR" for r in records)
