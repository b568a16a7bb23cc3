"""rubric_only results carry no usage section (`template` is None, and `usage_metadata` lives
there: spec/001), so the outputs once said "Model calls: 0, Cost: $0.000000" for a run that made
its calls. From the store, the calls and cost come from the run's stage events (`events`:
per-event tokens and cost, the entries' model_calls in the payload): the report's console and
summary.json, the HTML report, and the viewer's run page; the results themselves stay as the
spec has them (no usage invented in a VerificationResult)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from shared.cli.view import build_app, queries
from shared.cli.view.filters import Filters
from shared.core import events
from shared.core.config import Settings
from shared.core.models import VerificationResult
from shared.store.engine import QueryResult, Store
from shared.store.rows import result_to_row
from tests.support.analysis_store import AsyncStoreSource, job_for
from tests.support.results import make

RUN = "20260423T100000-rubric01"
BARE = "20260423T110000-rubric02"  # results only: no stage events were stored
QUESTIONS = ("q1", "q2", "q3")
ANSWER = {"input_tokens": 100, "output_tokens": 40, "total_tokens": 140, "model": "gpt-x", "model_calls": 1,
          "cached_replies": 0, "cost_usd": 0.00030302}
RUBRIC = {"input_tokens": 60, "output_tokens": 10, "total_tokens": 70, "model": "judge-x", "model_calls": 2,
          "cached_replies": 0, "cost_usd": 0.0001}



def _results() -> list[VerificationResult]:
    return [make(q, "gpt-x", None, judge="judge-x", with_template=False, run_name="rub",
                 rubric={"llm_trait_scores": {"clarity": 4}}) for q in QUESTIONS]


def _events(results: list[VerificationResult], run_id: str) -> list[events.Envelope]:
    """answer.generated, then rubric.evaluated, whose state carries the answer's entry too (the
    state goes on from stage to stage): each stage's own entries are its event's."""
    out = []
    for r in results:
        job = job_for(r, run_id)
        for event_type, usage in ((events.ANSWER_GENERATED, {"answer_generation": ANSWER}),
                                  (events.RUBRIC_EVALUATED, {"answer_generation": ANSWER, "rubric_evaluation": RUBRIC})):
            out.append(events.make_envelope(event_type, run_id, r.metadata.result_id,
                                            events.StageEvent(job=job, state=events.State(usage=usage)), "test/1"))
    return out


@pytest.fixture(scope="module")
def stored(store: Store) -> Store:
    results = _results()
    store.insert_results([result_to_row(r, RUN, version=1) for r in results])
    store.insert_events(_events(results, RUN))
    store.insert_runs([events.RunRequested(run_id=run, timestamp="2026-04-23T10:00:00Z", job_count=3, answer_count=3,
                                           run_name=name, evaluation_mode="rubric_only", config={})
                       for run, name in ((RUN, "rub"), (BARE, "bare"))])
    store.insert_results([result_to_row(r, BARE, version=1) for r in _results()])
    return store


def test_the_usage_comes_from_the_stage_events(stored: Store) -> None:
    from shared.store.event_usage import with_event_usage

    def query(sql: str, params: dict[str, Any]) -> QueryResult:
        return stored.query_read_only(sql, params)

    unknown = {"model_calls": None, "cached_replies": None, "cost_usd": None, "cost_unknown_models": [],
               "results_without_usage": 3, "not_recorded": "rubric_only results carry no usage section"}
    got = with_event_usage(dict(unknown), RUN, query)
    # 3 answers (1 call each) + 3 rubric evaluations (2 calls each); the answer's entry that the
    # rubric event's state carries on is not counted again
    assert (got["model_calls"], got["cached_replies"], got["source"]) == (9, 0, "events")
    assert got["cost_usd"] == round(3 * (0.00030302 + 0.0001), 6)
    assert (got["input_tokens"], got["output_tokens"]) == (3 * 160, 3 * 50)
    assert got["not_recorded"] == "rubric_only results carry no usage section"
    assert with_event_usage(dict(unknown), BARE, query) == unknown  # no events: still "not recorded"


def test_report_from_the_store_shows_the_real_calls_and_cost(settings: Settings, stored: Store, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from shared.cli.analysis import main

    monkeypatch.setenv("VERIBUS_HOME", str(settings.home))
    monkeypatch.setenv("VERIBUS_CLICKHOUSE_DATABASE", settings.clickhouse_database)
    monkeypatch.setenv("VERIBUS_NATS_URL", "nats://127.0.0.1:1")
    assert main(["report", RUN, "--html", str(tmp_path / "r.html"), "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Model calls: 9 (from the run's stage events: rubric_only results carry no usage section)" in out, out
    assert "Cost: $0.001209" in out and "Model calls: 0" not in out and "$0.000000" not in out
    usage = json.loads((tmp_path / "out" / "summary.json").read_text())["metrics"]["usage"]
    assert (usage["model_calls"], usage["cost_usd"], usage["source"]) == (9, 0.001209, "events")
    html = (tmp_path / "r.html").read_text()
    assert "<b>$0.001209</b><span>cost</span>" in html and "Total cost: <b>$0.001209</b> · 9 model calls" in html
    for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines():  # the results as the spec has them
        result = json.loads(line)["result"]
        assert result["template"] is None and "usage" not in json.dumps(result)
    # a stored run without its stage events says the usage is not recorded
    assert main(["report", BARE]) == 0
    out = capsys.readouterr().out
    assert "Model calls: not recorded (rubric_only results carry no usage section)" in out
    assert "Cost: not recorded (rubric_only results carry no usage section)" in out


async def test_the_viewer_shows_the_real_calls_and_cost(stored: Store) -> None:
    src = AsyncStoreSource(stored)
    cost = await queries.cost(src, RUN, Filters())
    assert (cost["source"], cost["calls"], round(cost["total_usd"], 6)) == ("events", 9, 0.001209)
    narrowed = await queries.cost(src, RUN, Filters(q="q1"))
    assert narrowed["calls"] == 3  # a filter narrows the events to its results'
    h = await queries.run_header(src, RUN)
    assert h["input_tokens"] + h["output_tokens"] == 3 * 210 and h["tokens_recorded"]
    async with TestClient(TestServer(build_app(src))) as c:
        page = await (await c.get(f"/run/{RUN}")).text()
        bare = await (await c.get(f"/run/{BARE}")).text()
    section = page.split("<h2 id='cost'>", 1)[1].split("<h2", 1)[0]
    assert "Total cost: <b>$0.001209</b> · 9 model calls" in section and "From the run's stage events" in section
    assert "No cost recorded" not in section
    section = bare.split("<h2 id='cost'>", 1)[1].split("<h2", 1)[0]
    assert "Model calls and cost not recorded: rubric_only results carry no usage section" in section
    assert "<b>not recorded</b><span>tokens</span>" in bare
