"""Metrics exposition, once-per-cause failure logs and JSON log lines (no bus)."""

from __future__ import annotations

import json
import logging

import pytest

from shared.runtime.observability import JsonFormatter, Metrics, configure_logging, metrics_port


def test_histogram_is_cumulative_and_labels_are_escaped() -> None:
    m = Metrics()
    for outcome in ("handled", "handled", "failed"):
        with m.handling('svc"x', "a.b", delivered=2) as box:
            box["outcome"] = outcome
    text = m.render([("veribus_extra", "An extra gauge.", [((("k", 'v\n"q'),), 3)])])
    assert 'veribus_messages_total{service="svc\\"x",event_type="a.b",outcome="handled"} 2' in text
    assert 'veribus_messages_total{service="svc\\"x",event_type="a.b",outcome="failed"} 1' in text
    assert 'veribus_messages_redelivered_total{service="svc\\"x",event_type="a.b"} 3' in text
    buckets = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("veribus_handler_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 3  # cumulative, +Inf = count
    assert 'veribus_extra{k="v\\n\\"q"} 3' in text
    assert 'veribus_in_flight{service="svc\\"x"} 0' in text


def test_an_exception_in_a_handler_counts_as_failed() -> None:
    m = Metrics()
    with pytest.raises(RuntimeError), m.handling("s", "e", 1):
        raise RuntimeError("boom")
    assert m.messages[("s", "e", "failed")] == 1 and m.in_flight["s"] == 0


def test_a_failing_model_is_logged_once_per_cause(caplog: pytest.LogCaptureFixture) -> None:
    m = Metrics()
    with caplog.at_level(logging.WARNING, logger="veribus.observability"):
        for _ in range(5):
            m.model_call("gpt-x", "failed_connection", "HTTP none: connection refused")
        m.model_call("gpt-x", "failed_rate_limit", "HTTP 429")
        m.model_call("gpt-x", "ok")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2
    assert "connection refused" in msgs[0] and "429" in msgs[1]
    assert m.model_calls[("gpt-x", "failed_connection")] == 5


def test_json_log_lines_and_bad_settings() -> None:
    rec = logging.LogRecord("veribus.x", logging.ERROR, __file__, 1, "bad %s", ("thing",), None)
    out = json.loads(JsonFormatter("parsing").format(rec))
    assert out["message"] == "bad thing" and out["service"] == "parsing" and out["level"] == "ERROR"
    with pytest.raises(ValueError, match="'yaml'"):
        configure_logging("x", fmt="yaml")


def test_metrics_port_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VERIBUS_METRICS_PORT", raising=False)
    monkeypatch.delenv("VERIBUS_PARSING_METRICS_PORT", raising=False)
    assert metrics_port("parsing") is None
    monkeypatch.setenv("VERIBUS_METRICS_PORT", "9100")
    assert metrics_port("parsing") == 9100
    monkeypatch.setenv("VERIBUS_PARSING_METRICS_PORT", "9200")
    assert metrics_port("parsing") == 9200
    monkeypatch.setenv("VERIBUS_PARSING_METRICS_PORT", "http")
    with pytest.raises(ValueError, match="'http'"):
        metrics_port("parsing")
