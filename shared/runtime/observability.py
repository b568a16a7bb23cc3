"""What a running service tells the outside: `/healthz`, `/readyz` and Prometheus `/metrics` on
a small HTTP server, JSON logs, and model-call failures logged once per cause.

- The server starts when `VERIBUS_<SERVICE>_METRICS_PORT` or `VERIBUS_METRICS_PORT` is set
  (0 = any free port; the bound port is logged); host `VERIBUS_METRICS_HOST` (default 127.0.0.1).
- `/healthz`: 200 while the process's event loop answers. `/readyz`: 200 once the service is
  connected to NATS and subscribed, else 503 with the reason.
- `/metrics` (text format 0.0.4): `veribus_messages_total{service,event_type,outcome}` (outcome:
  handled, failed = nacked for redelivery, gave_up, dead_letter, stopped),
  `veribus_messages_redelivered_total`, `veribus_handler_seconds` (histogram),
  `veribus_in_flight`, `veribus_model_calls_total{model,outcome}` (ok, cache_hit,
  retry_<kind>, failed_<kind>), and `veribus_consumer_pending` / `veribus_consumer_ack_pending`
  read from JetStream at scrape time.
- `VERIBUS_LOG_FORMAT=json` (or `veribus up --log-format json`): one JSON object per log line.

The harness calls `METRICS.*` and `start_for(service)`; nothing here imports the harness.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from shared.core.config import Settings
from shared.core.events import STREAM
from shared.core.scrub import ScrubFilter

log = logging.getLogger("veribus.observability")

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(str(v))}"' for k, v in pairs) + "}" if pairs else ""


class Metrics:
    """Process-wide counters, gauges and one latency histogram (thread-safe, no dependency)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.messages: dict[tuple[str, str, str], int] = defaultdict(int)
        self.redelivered: dict[tuple[str, str], int] = defaultdict(int)
        self.in_flight: dict[str, int] = defaultdict(int)
        self.model_calls: dict[tuple[str, str], int] = defaultdict(int)
        self.hist: dict[tuple[str, str], list[float]] = {}  # bucket counts..., sum, count
        self._logged_causes: set[tuple[str, str]] = set()

    @contextmanager
    def handling(self, service: str, event_type: str, delivered: int) -> Iterator[dict[str, str]]:
        """Around one message: in-flight, latency, redelivery; the caller sets `outcome`."""
        box = {"outcome": "handled"}
        with self._lock:
            self.in_flight[service] += 1
            if delivered > 1:
                self.redelivered[(service, event_type)] += 1
        t0 = time.perf_counter()
        try:
            yield box
        except BaseException:
            if box["outcome"] == "handled":  # not set by the caller (which may say "handed_back")
                box["outcome"] = "failed"
            raise
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.in_flight[service] -= 1
                self.messages[(service, event_type, box["outcome"])] += 1
                h = self.hist.setdefault((service, event_type), [0.0] * (len(BUCKETS) + 2))
                for i, b in enumerate(BUCKETS):
                    if dt <= b:
                        h[i] += 1
                h[-2] += dt
                h[-1] += 1

    def count(self, service: str, event_type: str, outcome: str) -> None:
        with self._lock:
            self.messages[(service, event_type, outcome)] += 1

    def model_call(self, model: str, outcome: str, detail: str = "") -> None:
        """Count a model call's outcome; a failure's cause is logged once per (model, outcome)."""
        with self._lock:
            self.model_calls[(model, outcome)] += 1
            first = outcome.startswith("failed_") and (model, outcome) not in self._logged_causes
            if first:
                self._logged_causes.add((model, outcome))
        if first:
            log.warning("model %s: calls fail (%s): %s (logged once per cause; see veribus_model_calls_total)",
                        model, outcome.removeprefix("failed_"), detail[:500])

    def render(self, extra: Sequence[tuple[str, str, Sequence[tuple[Sequence[tuple[str, str]], float]]]] = ()) -> str:
        """Prometheus text exposition. `extra`: (name, help, [(labels, value)]) gauges."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: Sequence[tuple[str, Sequence[tuple[str, str]], float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for suffix, labels, value in samples:
                out.append(f"{name}{suffix}{_labels(labels)} {value:g}" if isinstance(value, float)
                           else f"{name}{suffix}{_labels(labels)} {value}")

        with self._lock:
            family("veribus_messages_total", "counter", "Messages handled, by outcome.",
                   [("", (("service", s), ("event_type", e), ("outcome", o)), v)
                    for (s, e, o), v in sorted(self.messages.items())])
            family("veribus_messages_redelivered_total", "counter", "Messages seen again (delivery > 1).",
                   [("", (("service", s), ("event_type", e)), v) for (s, e), v in sorted(self.redelivered.items())])
            family("veribus_in_flight", "gauge", "Messages being handled now.",
                   [("", (("service", s),), v) for s, v in sorted(self.in_flight.items())])
            hist: list[tuple[str, Sequence[tuple[str, str]], float]] = []
            for (s, e), h in sorted(self.hist.items()):
                base = (("service", s), ("event_type", e))
                for i, b in enumerate(BUCKETS):
                    hist.append(("_bucket", (*base, ("le", f"{b:g}")), h[i]))
                hist.append(("_bucket", (*base, ("le", "+Inf")), h[-1]))
                hist.append(("_sum", base, h[-2]))
                hist.append(("_count", base, h[-1]))
            family("veribus_handler_seconds", "histogram", "Time to handle one message.", hist)
            family("veribus_model_calls_total", "counter", "Model calls by outcome.",
                   [("", (("model", m), ("outcome", o)), v) for (m, o), v in sorted(self.model_calls.items())])
        for name, help_, samples in extra:
            family(name, "gauge", help_, [("", labels, value) for labels, value in samples])
        return "\n".join(out) + "\n"


METRICS = Metrics()


# --------------------------------------------------------------------------------------------
# HTTP endpoints
# --------------------------------------------------------------------------------------------

ReadyCheck = Callable[[], str | None]  # None when ready, else the reason
LagProbe = Callable[[], Awaitable[list[tuple[str, int, int]]]]  # (consumer, pending, ack pending)


def metrics_port(service: str) -> int | None:
    """The service's own port setting, else the shared one (a bad value is refused by name)."""
    settings = Settings.from_env()
    own = getattr(settings, f"{service}_metrics_port", None)
    return own if own is not None else settings.metrics_port


async def serve(service: str, port: int, ready: ReadyCheck, lag: LagProbe | None = None,
                host: str | None = None) -> tuple[Any, int]:
    """Start the endpoints on the running loop; returns (runner, bound port)."""
    from aiohttp import web  # local import: aiohttp.web (~0.1 s), only with a metrics port

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        reason = ready()
        return web.Response(text="ready\n") if reason is None else web.Response(text=f"{reason}\n", status=503)

    async def metrics(_: web.Request) -> web.Response:
        extra = []
        if lag is not None:
            try:
                rows = await asyncio.wait_for(lag(), timeout=5)
            except Exception as exc:  # noqa: BLE001 - a scrape must not fail on the bus
                log.debug("consumer lag unavailable: %r", exc)
                rows = []
            extra = [("veribus_consumer_pending", "Messages not yet delivered to the consumer.",
                      [((("service", service), ("consumer", c)), p) for c, p, _ in rows]),
                     ("veribus_consumer_ack_pending", "Messages delivered and not yet acknowledged.",
                      [((("service", service), ("consumer", c)), a) for c, _, a in rows])]
        return web.Response(text=METRICS.render(extra), content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host or Settings.from_env().metrics_host, port)
    await site.start()
    bound = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    log.info("%s: /healthz /readyz /metrics on port %d", service, bound)
    return runner, bound


async def start(name: str, not_ready: ReadyCheck, js: Callable[[], Any], durables: Sequence[str]) -> Any:
    """The endpoints of one service process when a metrics port is configured; returns the
    runner to clean up, or None. `js()` gives the JetStream context for the consumer lag."""
    port = metrics_port(name)
    if port is None:
        return None

    async def lag() -> list[tuple[str, int, int]]:
        out = []
        for durable in durables:
            info = await js().consumer_info(STREAM, durable)
            out.append((durable, int(info.num_pending or 0), int(info.num_ack_pending or 0)))
        return out

    runner, _ = await serve(name, port, not_ready, lag)
    return runner


def broker_not_ready(broker: Any, started: Callable[[], bool]) -> ReadyCheck:
    """/readyz of a FastStream NATS broker: subscribed (`started()`) and connected."""

    def check() -> str | None:
        if not started():
            return "starting: not subscribed yet"
        conn = getattr(broker, "_connection", None)
        if conn is None or not conn.is_connected:
            return "NATS connection lost (reconnecting)"
        return None

    return check


async def start_for(service: Any) -> Any:
    """`start` for a StageService (its name, broker, JetStream handle and durable consumers)."""
    return await start(service.name, broker_not_ready(service.broker, lambda: service._js is not None),
                       lambda: service.js, service.durables)


# --------------------------------------------------------------------------------------------
# Logs
# --------------------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message (+ exception)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname, "service": self.service,
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:  # already formatted (and scrubbed) by ScrubFilter
            out["exception"] = record.exc_text
        return json.dumps(out, ensure_ascii=False)


def configure_logging(service: str, fmt: str | None = None, level: str | None = None) -> None:
    """`VERIBUS_LOG_FORMAT` = text (default) or json."""
    settings = Settings.from_env() if fmt is None or level is None else None
    fmt = (fmt or (settings.log_format if settings else "text")).lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"VERIBUS_LOG_FORMAT: {fmt!r} is not 'text' or 'json'")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s"))
    handler.addFilter(ScrubFilter())  # no secret value or key-shaped token reaches a log (issue 10)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or (settings.log_level if settings else "INFO")).upper())
