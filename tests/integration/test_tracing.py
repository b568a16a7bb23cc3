"""OpenTelemetry tracing (issue 13): two services on the real harness and a real nats-server hand
one result's event from one to the other; with the SDK's in-memory exporter, each handled message
is one span carrying result_id, run_id and the stage, and the second service's span is a child of
the first's (trace context carried in the message's `traceparent` header), so one result's spans
form one trace. Without an endpoint nothing of the SDK is imported."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus, tracing
from shared.runtime.harness import StageService
from tests.conftest import REPO, NatsServer
from tests.support.analysis_store import job_for
from tests.support.results import grid_results

RUN = "20260101T000000-trace001"


@pytest.fixture
def exporter() -> Any:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    assert tracing.configure("test", exporter=exp)
    yield exp
    exp.clear()
    tracing.shutdown()


def _relay(name: str, settings: Settings, in_type: str, out_type: str) -> StageService:
    """A service that answers `in_type` with `out_type` for the same job (a stage that does nothing)."""
    svc = StageService(name, settings)

    @svc.handles(in_type, events.StageEvent, durable=f"trace-{name}")
    async def relay(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
        return [svc.emit(out_type, ev.job, events.StageEvent(ev.job, ev.state))]

    return svc


@pytest.fixture
async def two_services(nats_server: NatsServer, tmp_path: Path, exporter: Any) -> AsyncIterator[Settings]:
    settings = Settings(nats_url=nats_server.url, home=tmp_path / "home")
    services = [_relay("guards", settings, events.ANSWER_GENERATED, events.GUARDS_CHECKED),
                _relay("parsing", settings, events.GUARDS_CHECKED, events.TEMPLATE_PARSED)]
    started = []
    try:
        for svc in services:
            await asyncio.wait_for(svc.app.start(), 60)
            started.append(svc)
        yield settings
    finally:
        for svc in started:
            await asyncio.wait_for(svc.app.stop(), 60)


async def _publish(settings: Settings, result_index: int) -> str:
    r = grid_results()[result_index]
    job = job_for(r, RUN)
    env = events.make_envelope(events.ANSWER_GENERATED, RUN, job.result_id,
                               events.StageEvent(job, events.State()), "test/1")
    async with bus.session(settings) as nc:
        await bus.publish(nc.jetstream(), env)
    return job.result_id


async def test_one_results_spans_form_one_trace_across_two_services(two_services: Settings, exporter: Any) -> None:
    rids = [await _publish(two_services, 0), await _publish(two_services, 1)]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        spans = [s for s in exporter.get_finished_spans() if s.attributes.get("run_id") == RUN]
        if len(spans) >= 4:
            break
        await asyncio.sleep(0.2)
    by_result: dict[str, list[Any]] = {}
    for s in spans:
        by_result.setdefault(str(s.attributes["result_id"]), []).append(s)
    assert set(by_result) == set(rids), [(s.name, dict(s.attributes)) for s in spans]
    traces = set()
    for rid, ss in by_result.items():
        names = {s.name: s for s in ss}
        assert set(names) == {f"guards {events.ANSWER_GENERATED}", f"parsing {events.GUARDS_CHECKED}"}
        first, second = names[f"guards {events.ANSWER_GENERATED}"], names[f"parsing {events.GUARDS_CHECKED}"]
        # one trace: the second service's span is the child of the first's, across the bus
        assert first.context.trace_id == second.context.trace_id
        assert second.parent is not None and second.parent.span_id == first.context.span_id
        assert first.attributes["veribus.stage"] == "guards" and second.attributes["veribus.stage"] == "parsing"
        assert second.attributes["messaging.destination.name"] == f"vb.{events.GUARDS_CHECKED}.{RUN}.{rid}"
        traces.add(first.context.trace_id)
    assert len(traces) == 2  # two results, two traces


def test_without_an_endpoint_nothing_is_imported_or_sent(tmp_path: Path) -> None:
    """A service built with no endpoint configured imports no SDK and adds no header."""
    code = (
        "import sys\n"
        "from shared.core.config import Settings\n"
        "from shared.runtime import bus, tracing\n"
        "from shared.runtime.harness import StageService\n"
        "from shared.core import events\n"
        "StageService('guards', Settings(home=sys.argv[1]))\n"
        "env = events.make_envelope(events.RUN_CANCELLED, 'r', events.RUN_KEY, events.RunControlChange(), 't/1')\n"
        "assert bus.msg_headers(env) == {'Nats-Msg-Id': env.event_id}, bus.msg_headers(env)\n"
        "assert not tracing.enabled()\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')], 'SDK imported'\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERIBUS_OTEL"))}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_with_an_endpoint_spans_reach_the_collector_over_otlp_http(tmp_path: Path) -> None:
    """A process configured with VERIBUS_OTEL_ENDPOINT posts its spans to `<endpoint>/v1/traces`
    (protobuf), with the result id in them."""
    import http.server
    import threading

    got: list[tuple[str, bytes]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            got.append((self.path, self.rfile.read(int(self.headers.get("Content-Length") or 0))))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    code = (
        "from types import SimpleNamespace\n"
        "from shared.core.config import Settings\n"
        "from shared.runtime import tracing\n"
        "assert tracing.configure('guards', Settings.from_env())\n"
        "msg = SimpleNamespace(subject='vb.answer.generated.run-otlp.res-otlp-42', headers=None)\n"
        "with tracing.handling('guards', 'answer.generated', msg):\n"
        "    pass\n"
        "tracing.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(PYTHONPATH=str(REPO), VERIBUS_OTEL_ENDPOINT=f"http://127.0.0.1:{server.server_port}")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                             cwd=REPO)
    finally:
        server.shutdown()
        thread.join(10)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [p for p, _ in got] == ["/v1/traces"]
    body = got[0][1]
    assert b"res-otlp-42" in body and b"run-otlp" in body and b"guards answer.generated" in body
