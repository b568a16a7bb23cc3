"""The viewer's pure parts, without a bus or a store: filters (parsing, SQL, links), run states,
and what the sample page shows of a result (every check with its reasoning, the parse beside
the expected values), escaped."""

from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from shared.analysis.stats import Proportion
from shared.cli.view import markup, pages, sample_page
from shared.cli.view.filters import FilterError, Filters
from shared.cli.view.queries import run_state
from shared.cli.view.source import StoreUnavailable
from shared.core.verdict import SQL_ERRORED, SQL_FAILED
from shared.store.engine import FolderHeld
from tests.support.results import make


def test_filters_parse_and_refuse_by_name() -> None:
    f = Filters.from_query({"model": " gpt-4o ", "status": "errored", "q": "moons", "other": "ignored"})
    assert (f.model, f.status, f.q, f.judge) == ("gpt-4o", "errored", "moons", "")
    with pytest.raises(FilterError, match="'status'.*'all'"):
        Filters.from_query({"status": "all"})
    with pytest.raises(FilterError, match="'q'.*longer than"):
        Filters.from_query({"q": "x" * 501})
    with pytest.raises(FilterError, match="'judge'.*NUL"):
        Filters.from_query({"judge": "a\x00b"})


def test_filter_values_never_enter_the_sql_text() -> None:
    hostile = "x' OR 1=1; DROP TABLE runs --"
    f = Filters(model=hostile, judge=hostile, keyword=hostile, q=hostile, status="failed")
    sql, params = f.sql()
    assert hostile not in sql and "DROP" not in sql
    assert set(params.values()) == {hostile} and len(params) == 4
    assert SQL_FAILED in sql  # the failed verdict, as every output counts it (shared.core.verdict)
    assert Filters().sql() == ("1", {})
    assert Filters(status="errored").sql()[0] == SQL_ERRORED  # verify() raising included


def test_filters_round_trip_through_links() -> None:
    f = Filters(model="litellm:gpt-4o", status="passed", q="a&b=c #d")
    qs = f.query_string(page=2, hpage=None)
    parsed = {k: v[0] for k, v in parse_qs(qs).items()}
    assert parsed == {"model": "litellm:gpt-4o", "status": "passed", "q": "a&b=c #d", "page": "2"}
    assert Filters.from_query(parsed) == f
    assert markup.run_url("run/1?x", f, anchor="samples").startswith("/run/run%2F1%3Fx?model=")


@pytest.mark.parametrize(("jobs", "done", "age", "cancelled", "state"), [
    (10, 10, 5, False, "finished"),
    (10, 12, None, False, "finished"),
    (10, 3, 5, False, "running"),
    (10, 3, 5000, False, "incomplete"),
    (10, 3, None, False, "incomplete"),
    (10, 3, 5, True, "cancelled"),
    (10, 10, 5000, True, "cancelled"),  # every job ended, the stopped ones as cancelled results
    (0, 4, None, False, "finished"),
])
def test_run_state(jobs: int, done: int, age: float | None, cancelled: bool, state: str) -> None:
    assert run_state(jobs, done, age, cancelled) == state


def _sample(result: dict) -> str:
    return sample_page.sample_page("run-1", {"result": result, "events": [], "siblings": [],
                                       "stages": [{"stage": "generate_answer", "status": "performed", "start_ms": 0.0,
                                                   "duration_ms": 120.0},
                                                  {"stage": "abstention_check", "status": "skipped", "start_ms": 120.0,
                                                   "duration_ms": 0.0}]})


def test_sample_page_shows_every_check_and_the_parse() -> None:
    r = make("q1", "gpt-4o", False, parsed={"target": "MCL1"}, gt={"target": "BCL2"}).model_dump(mode="json")
    t = r["template"]
    t.update(field_results={"target": False}, abstention_check_performed=True, abstention_detected=False,
             abstention_reasoning="The model commits to an answer.", sufficiency_check_performed=True,
             sufficiency_detected=True, sufficiency_reasoning="Enough detail to fill every field.",
             embedding_check_performed=True, embedding_similarity_score=0.42, embedding_model_used="mini-lm")
    r["deep_judgment"] = {"deep_judgment_performed": True,
                          "extracted_excerpts": {"target": [{"text": "the target is MCL1"}]},
                          "attribute_reasoning": {"target": "The excerpt names MCL1."},
                          "hallucination_risk_assessment": {"target": "low"}}
    page = _sample(r)
    parse = page.split('id="parse"')[1].split("</table>")[0]
    assert "BCL2" in parse and "MCL1" in parse and "differs" in parse
    checks = page.split('id="checks"')[1].split("</table>")[0]
    for text in ("abstention", "The model commits to an answer.", "sufficiency", "Enough detail to fill every field.",
                 "similarity 0.42", "mini-lm", "deep judgment · target", "the target is MCL1",
                 "The excerpt names MCL1.", "hallucination risk: low"):
        assert text in checks, text
    assert "generate_answer" in page and "120.0 ms" in page
    assert "The target is MCL1." in page.split("class='answer'")[1]


def test_sample_page_escapes_the_result() -> None:
    r = make("q1", "gpt-4o", None, error="parse_template: ValueError: <script>x()</script>").model_dump(mode="json")
    r["metadata"]["question_text"] = "<img src=x onerror=alert(1)>"
    r["template"]["raw_llm_response"] = "</pre><script>alert(2)</script>"
    page = _sample(r)
    assert "<script>" not in page.replace('<script src="/static/view.js" defer></script>', "")
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "id='error'" in page and "ValueError" in page


def test_runs_page_is_live_only_while_a_run_runs() -> None:
    row = {"run_id": "r1", "run_name": "<b>n</b>", "requested_at": None, "benchmark": "b", "models": ["m"],
           "judges": [], "jobs": 4, "done": 2, "errors": 1, "rate": Proportion.of(1, 2), "simulated": True,
           "last_event": None, "state": "running"}
    page = pages.runs_page({"runs": [row], "more": False, "page": 0}, "", None, "embedded (chdb)")
    assert 'data-live="1"' in page and "SIMULATED" in page and "&lt;b&gt;n&lt;/b&gt;" in page
    assert "bus: not connected" in page
    page = pages.runs_page({"runs": [{**row, "state": "finished"}], "more": False, "page": 0}, "", None, "x")
    assert 'data-live="0"' in page


def test_a_port_in_use_is_one_line_of_bad_input(tmp_path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`veribus view --port P` with P taken: exit 2 and a line naming the port and `--port 0`,
    not an OSError with exit 3 (which means an unreachable deployment)."""
    import socket

    from shared.cli.commands import main

    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["view", "--port", str(port)]) == 2
    line = capsys.readouterr().err.strip()
    assert line == (f"veribus: error: cannot listen on 127.0.0.1:{port}: address already in use; another program "
                    "(a `veribus view`?) listens there; `--port 0` takes any free port"), line


class _Failing:
    """A source whose every query raises `exc`."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def query(self, sql: str, params: dict | None = None) -> object:
        raise self.exc


@pytest.mark.parametrize(("exc", "status", "says"), [
    (FolderHeld("the chdb folder /h/chdb is open in another process (one process per folder)", Path("/h/chdb")),
     503, ["the chdb folder /h/chdb is open in another process", "reload in a few seconds", "veribus status"]),
    (StoreUnavailable("the local stack in /h runs but its projector did not answer; reload in a few seconds"),
     503, ["its projector did not answer", "reload in a few seconds"]),
    (RuntimeError("something unforeseen"), 500, ["RuntimeError: something unforeseen", "restart `veribus view`"]),
])
async def test_a_store_that_cannot_be_read_is_a_page_that_says_why(exc: BaseException, status: int,
                                                                    says: list[str]) -> None:
    """Whatever stops a read (the folder held by a starting stack's projector, a stack whose
    projector does not answer, anything unforeseen) is an HTML page naming it and what to do, on
    every page: never aiohttp's bare 500 ("Server got itself in trouble")."""
    from aiohttp.test_utils import TestClient, TestServer

    from shared.cli.view import build_app

    async with TestClient(TestServer(build_app(_Failing(exc)))) as client:
        for path in ("/", "/run/r1", "/run/r1/sample/x", "/compare?run=r1", "/api/runs"):
            resp = await client.get(path)
            text = await resp.text()
            assert resp.status == status, (path, resp.status, text[:300])
            assert resp.content_type == "text/html", (path, resp.content_type)
            assert "Server got itself in trouble" not in text and "Traceback" not in text, (path, text[:300])
            page = html.unescape(text)
            for words in says:
                assert words in page, (path, words, page[:1000])


async def test_a_compare_parameter_too_long_is_named_as_itself() -> None:
    """`/compare?run=<5,000 characters>` answered "filter 'q': longer than 500 characters": the
    compare form's parameters were checked as if they were the text filter."""
    from aiohttp.test_utils import TestClient, TestServer

    from shared.cli.view import build_app

    async with TestClient(TestServer(build_app(_Failing(RuntimeError("not reached"))))) as client:
        for name in ("run", "a", "run_b", "b"):
            resp = await client.get("/compare", params={name: "x" * 5000})
            text = html.unescape(await resp.text())
            assert resp.status == 400, (name, resp.status)
            assert f"parameter '{name}': longer than 500 characters" in text and "filter 'q'" not in text, text[:500]
