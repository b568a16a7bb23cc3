"""Issue 13: the static report and `from_store` never hold a whole run. A run of 1,440 results
with 6 KB responses (about 9 MB of response text, and several times that as parsed results) is
written straight into the real engine (chdb); the report path (summary, gates, verdict,
results.jsonl, the HTML page with its appendix, JUnit) runs under tracemalloc and must peak
well below what holding the run costs. The same bound is checked against holding the run, so the
check is shown to fail when a path loads everything. A counting source also proves that no
query of result rows returns more than the page size."""

from __future__ import annotations

import gc
import tracemalloc
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from shared.analysis import report
from shared.analysis.gates import evaluate_gates, parse_gate
from shared.analysis.html_report import iter_html, load_run_data, write_html
from shared.analysis.junit import write_junit
from shared.analysis.resultset import ResultSetTooLarge, VerificationResultSet
from shared.core.config import Settings
from shared.core.models import VerificationResult
from shared.core.outcome import judge
from shared.store.engine import QueryResult, Store, open_store
from shared.store.reads import StoreSource
from shared.store.rows import result_to_row
from tests.support.results import grid_results

RUN = "20260101T000000-bigrun01"
COPIES = 40  # x 36 grid results = 1,440 results over 120 questions
RESPONSE = 6000
PAGE = 50
BOUND = 6 * 1024 * 1024  # bytes: the report path's peak must stay under this


def _big_results() -> Iterator[VerificationResult]:
    base = grid_results()
    for k in range(COPIES):
        for i, r in enumerate(base):
            c = r.model_copy(deep=True)
            m = c.metadata
            m.result_id = f"{k:04d}{i:04d}{uuid.uuid4().hex[:8]}"
            m.question_id = f"{m.question_id}-{k}"
            m.question_text = f"{m.question_text} (copy {k})"
            m.run_name = "big"
            if c.template is not None:
                c.template.raw_llm_response = (f"answer {k}/{i} " * (RESPONSE // 12))[:RESPONSE]
            yield c


@pytest.fixture(scope="module")
def big(analysis_folder: Path) -> Iterator[tuple[Store, Settings]]:
    settings = Settings(home=analysis_folder, clickhouse_database=f"big_{uuid.uuid4().hex[:12]}",
                        nats_url="nats://127.0.0.1:1")
    st = open_store(settings)
    try:
        batch: list[dict[str, Any]] = []
        for r in _big_results():
            batch.append(result_to_row(r, RUN, version=1))
            if len(batch) == 240:
                st.insert_results(batch)
                batch = []
        st.insert_results(batch)
        yield st, settings
    finally:
        st.client.command(f"DROP DATABASE IF EXISTS {settings.clickhouse_database}")
        st.close()


class CountingSource:
    """A StoreSource that records the most result rows any one query returned."""

    def __init__(self, store: Store) -> None:
        self.inner = StoreSource(store)
        self.max_result_rows = 0
        self.result_queries = 0

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
        res = self.inner.query(sql, params)
        if "result_json" in sql:
            self.result_queries += 1
            self.max_result_rows = max(self.max_result_rows, len(res.rows))
        return res


def _peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, out


def _report_path(source: Any, out: Path) -> dict[str, Any]:
    """What `veribus report RUN --output DIR --html FILE --junit FILE --gate ...` does."""
    data = load_run_data(source, RUN, page_size=PAGE)
    gates = [parse_gate("accuracy>=0.5"), parse_gate("clarity:model-a>=0.3")]
    summary = report.summarize(data.results)
    rep = evaluate_gates(data.results, gates)
    verdict = judge(data.results, failed_gates=[o.gate.label() for o in rep.outcomes if not o.passed])
    summary["outcome"] = verdict.as_dict()
    report.write_outputs(out / "report", "big", data.run_id, data.results, summary, {}, False)
    write_html(out / "report.html", data, rep.lines)
    write_junit(out / "junit.xml", rep, data.results)
    return {"summary": summary, "lines": rep.lines}


def test_the_report_path_streams_a_large_run(big: tuple[Store, Settings], tmp_path: Path) -> None:
    big_store, _ = big
    source = CountingSource(big_store)
    peak, got = _peak(lambda: _report_path(source, tmp_path))
    s = got["summary"]
    n = COPIES * 36
    # the numbers are the run's (the grid's, forty times): nothing was dropped to save memory
    assert s["total"] == n and s["errors"] == COPIES and s["total_attempted"] == n - COPIES
    assert s["passed_attempts"] == COPIES * 23
    assert len((tmp_path / "report" / "results.jsonl").read_text().splitlines()) == n
    page = (tmp_path / "report.html").read_text()
    assert "Showing the first 2,000" not in page and page.count("<details class='resp'>") == n
    assert page.count("<details class='q'>") == COPIES * 3
    assert source.result_queries > n // PAGE and 0 < source.max_result_rows <= PAGE
    assert peak < BOUND, f"report path peaked at {peak / 2**20:.1f} MiB (bound {BOUND / 2**20:.1f} MiB)"

    # the bound is one that holding the run breaks: the check can fail
    held, rows = _peak(lambda: list(load_run_data(StoreSource(big_store), RUN, page_size=PAGE).results))
    assert len(rows) == n and held > 2 * BOUND, f"holding the run took only {held / 2**20:.1f} MiB"


def test_the_cli_report_streams_a_large_run(big: tuple[Store, Settings], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`veribus report RUN --output --html --junit --gate` (its body, on a loaded run): the same bound."""
    import argparse

    from shared.cli import analysis as cli_analysis

    monkeypatch.setattr(cli_analysis, "_job_count", lambda run_id: COPIES * 36)
    args = argparse.Namespace(run=RUN, gate=["accuracy>=0.5"], max_errors="5%", quiet=False,
                              output=str(tmp_path / "out"), html=str(tmp_path / "r.html"), junit=str(tmp_path / "j.xml"))
    source = CountingSource(big[0])

    def run() -> int:
        data = load_run_data(source, RUN, page_size=PAGE)
        return cli_analysis._report(args, data, write_html)

    peak, code = _peak(run)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"Total samples: {COPIES * 36}" in out and f"Errors: {COPIES}" in out and "PASSED" in out
    assert (tmp_path / "r.html").read_text().count("<details class='resp'>") == COPIES * 36
    assert (tmp_path / "j.xml").read_text().count("<testcase ") == COPIES * 36 + 2  # + the gate and the outcome
    assert 0 < source.max_result_rows <= PAGE
    assert peak < BOUND, f"the CLI report peaked at {peak / 2**20:.1f} MiB (bound {BOUND / 2**20:.1f} MiB)"


def test_the_appendix_is_capped_with_a_note(big: tuple[Store, Settings]) -> None:
    data = load_run_data(StoreSource(big[0]), RUN, page_size=PAGE)
    page = "".join(iter_html(data, appendix_limit=100))
    assert "Showing the first 100 of 1,440 responses" in page and "veribus view" in page
    assert page.count("<details class='resp'>") == 100


def test_from_store_is_bounded_and_streams(big: tuple[Store, Settings]) -> None:
    settings = big[1]
    with pytest.raises(ResultSetTooLarge, match="1,440 results match"):
        VerificationResultSet.from_store(settings, run_id=RUN, max_results=1000)
    assert len(VerificationResultSet.from_store(settings, run_id=RUN, limit=70)) == 70
    stream = VerificationResultSet.stream(settings, run_id=RUN, page_size=PAGE)
    assert len(stream) == COPIES * 36
    peak, total = _peak(lambda: report.summarize(stream)["total"])
    assert total == COPIES * 36 and peak < BOUND
    frames = list(VerificationResultSet.iter_dataframes(settings, run_id=RUN, batch_size=500))
    assert [len(f) for f in frames] == [500, 500, 440] and "question_id" in frames[0].columns
