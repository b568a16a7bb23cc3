"""Optional OpenTelemetry tracing of the services (issue 13).

Off unless `VERIBUS_OTEL_ENDPOINT` (or the standard `OTEL_EXPORTER_OTLP_ENDPOINT`) names an OTLP
HTTP collector: then each service exports one span per handled message (`<service>
<event_type>`, kind CONSUMER, attributes `result_id`, `run_id`, `veribus.stage`,
`veribus.event_type`, `messaging.*`) and every event it publishes while handling carries the W3C
`traceparent` header, so the next service's span is a child of this one and one result's spans
form one trace across processes. The SDK and exporter are the optional extra `otel`
(`pip install -e '.[otel]'`).

Off, nothing of OpenTelemetry is imported: `handling()` returns one shared no-op context
manager and `inject()` returns at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import MutableMapping
from typing import Any

from shared.core.config import Settings

log = logging.getLogger("veribus.tracing")

_NULL = contextlib.nullcontext()
_STATE: _Tracing | None = None
_EXPORTERS: set[int | str] = set()  # what this process already exports to (several services may share it)


def endpoint_of(settings: Settings) -> str | None:
    """The collector's base URL: VERIBUS_OTEL_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT."""
    return settings.otel_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP's traces path on a base URL (`http://collector:4318` -> `.../v1/traces`)."""
    e = endpoint.rstrip("/")
    return e if e.endswith("/v1/traces") else e + "/v1/traces"


class _Tracing:
    """The tracer and the W3C propagator, once tracing is on."""

    def __init__(self) -> None:
        # local import: OpenTelemetry is an optional extra, imported only when tracing is on
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.tracer = trace.get_tracer("veribus")
        self.propagator = TraceContextTextMapPropagator()
        self.kind = trace.SpanKind.CONSUMER

    def span(self, service: str, event_type: str, subject: str, headers: Any) -> Any:
        parts = subject.split(".")
        run_id, result_id = (parts[3], parts[4]) if len(parts) == 5 else ("", "")
        ctx = self.propagator.extract(carrier=dict(headers or {}))
        return self.tracer.start_as_current_span(
            f"{service} {event_type}", context=ctx, kind=self.kind,
            attributes={"result_id": result_id, "run_id": run_id, "veribus.stage": service,
                        "veribus.event_type": event_type, "messaging.system": "nats",
                        "messaging.destination.name": subject, "messaging.operation.type": "process"})


def configure(service: str, settings: Settings | None = None, *, exporter: Any = None) -> bool:
    """Turn tracing on for this process when an endpoint is configured (or a test hands in an
    `exporter`, e.g. the SDK's InMemorySpanExporter); False, importing nothing, when neither is."""
    global _STATE
    endpoint = endpoint_of(settings) if settings is not None else None
    if exporter is None and not endpoint:
        return False
    try:
        # local import: OpenTelemetry is an optional extra, imported only when tracing is on
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        log.warning("%s: tracing is configured (%s) but the OpenTelemetry SDK is missing (pip install "
                    "'veribus[otel]'): no spans - %s", service, endpoint, exc)
        return False

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the first service of this process sets it
        provider = TracerProvider(resource=Resource.create({"service.name": f"veribus-{service}"}))
        trace.set_tracer_provider(provider)
    key: int | str = id(exporter) if exporter is not None else traces_url(str(endpoint))
    if key not in _EXPORTERS:
        _EXPORTERS.add(key)
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            # local import: the OTLP exporter (optional extra) only when an endpoint is configured
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=str(key))))
            log.info("%s: exporting spans to %s", service, key)
    if _STATE is None:
        _STATE = _Tracing()
    return True


def enabled() -> bool:
    return _STATE is not None


def handling(service: str, event_type: str, msg: Any) -> Any:
    """The span of one handled message (`msg`: the nats message, its subject and headers), as
    the current span while the handler runs; a shared no-op when tracing is off."""
    st = _STATE
    if st is None:
        return _NULL
    return st.span(service, event_type, str(getattr(msg, "subject", "")), getattr(msg, "headers", None))


def inject(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current span's `traceparent` (and `tracestate`) to outgoing message headers."""
    st = _STATE
    if st is not None:
        st.propagator.inject(headers)
    return headers


def shutdown() -> None:
    """Flush and stop the exporters (tests; a service's exit flushes through the SDK's atexit)."""
    global _STATE
    if _STATE is None:
        return
    provider = _STATE.trace.get_tracer_provider()
    with contextlib.suppress(Exception):
        provider.force_flush()  # type: ignore[attr-defined]
    _STATE = None
