"""The analysis API against the real engine (embedded chdb): results written through the store
load back with `from_store`, stream out in pages in every export format, feed the analysis views,
and are also read through the projector over a real nats-server.

chdb opens one folder per process: every test here uses one session folder (`analysis_folder`,
in `conftest.py`, shared with test_html_report.py), a store that is opened per module and closed at its end, and
its own database.
"""

from __future__ import annotations

import asyncio
import csv
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shared.analysis.export import export_from_source, export_results, export_run
from shared.analysis.resultset import VerificationResultSet
from shared.analysis.stats import wilson_interval
from shared.core import events
from shared.core.config import Settings
from shared.core.models import VerificationResult
from shared.store.engine import QueryResult, Store
from shared.store.reads import (
    NatsSource,
    QueryError,
    ResultFilter,
    StoreSource,
    iter_pages,
    open_source,
    resolve_run,
)
from shared.store.rows import result_to_row
from tests.support.analysis_store import RUBRIC_WIRE, RUN_A, RUN_B, job_for
from tests.support.csv_attack import attack_results, check_escaped, check_raw
from tests.support.results import grid_results, spec_results


def _key(r: VerificationResult) -> str:
    return r.metadata.result_id


def test_from_store_loads_every_result_exactly(settings: Settings, store: Store) -> None:
    rs = VerificationResultSet.from_store(settings, run_id=RUN_A, page_size=7)
    assert len(rs) == 36 and rs.run_ids == [RUN_A]
    assert sorted(rs, key=_key) == sorted(grid_results(), key=_key)
    assert rs.get_template_results().aggregate_pass_rate(by="answering_model") == {
        "litellm:model-a": 10 / 18, "litellm:model-b": 13 / 17}
    spec = VerificationResultSet.from_store(settings, run_id=RUN_B)
    assert spec.get_template_results().get_template_summary()["pass_rate"] == 0.75
    both = VerificationResultSet.from_store(settings)
    assert len(both) == 40 and both.run_ids == [RUN_A, RUN_B]


def test_from_store_filters_in_sql(settings: Settings, store: Store) -> None:
    def n(**kw: Any) -> int:
        return len(VerificationResultSet.from_store(settings, run_id=RUN_A, **kw))

    assert n(question_ids=["q1", "q2"]) == 24
    assert n(answering_models=["model-a"]) == 18 and n(answering_models=["litellm:model-b"]) == 18
    assert n(parsing_models=["judge-2"]) == 18
    assert n(replicates=[1, 2]) == 24
    assert n(completed_only=True) == 35
    assert n(limit=5) == 5
    assert len(VerificationResultSet.from_store(settings, run_name="grid")) == 36


def test_resolve_run_by_id_or_name(store: Store) -> None:
    src = StoreSource(store)
    assert resolve_run(src, RUN_A) == RUN_A
    assert resolve_run(src, "grid") == RUN_A
    assert resolve_run(src, "spec") == RUN_B  # no runs row: found through its results
    with pytest.raises(ValueError, match="no run"):
        resolve_run(src, "nope")


class CountingSource:
    """A row source that records every query's LIMIT and row count."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pages: list[int] = []

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
        res = self.inner.query(sql, params)
        if " LIMIT " in sql and "ORDER BY run_id, result_id" in sql:
            self.pages.append(len(res.rows))
        return res


def test_keyset_pages_are_bounded_and_complete(store: Store) -> None:
    src = CountingSource(StoreSource(store))
    seen = [row[1] for page in iter_pages(src, "verify_result", ResultFilter(run_id=RUN_A), page_size=5)
            for row in page.rows]
    assert len(seen) == 36 and len(set(seen)) == 36 and seen == sorted(seen)
    assert max(src.pages) == 5 and len(src.pages) == 8  # 7 full pages, one of 1
    # a re-projection (a newer version of the same rows) does not duplicate anything under FINAL
    store.insert_results([result_to_row(r, RUN_A, version=2) for r in grid_results()[:10]])
    again = [row[1] for page in iter_pages(StoreSource(store), "verify_result", ResultFilter(run_id=RUN_A),
                                           page_size=4) for row in page.rows]
    assert again == seen


def test_pages_shrink_when_a_reply_is_too_large(store: Store) -> None:
    class Limited:
        def __init__(self) -> None:
            self.sizes: list[int] = []

        def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
            size = int(sql.rsplit("LIMIT", 1)[1])
            self.sizes.append(size)
            if size > 3:
                raise QueryError("result too large for a NATS reply (2000000 bytes, 50 rows, limit 1047552)")
            return StoreSource(store).query(sql, params)

    src = Limited()
    rows = [r for page in iter_pages(src, "result_json", ResultFilter(run_id=RUN_A), page_size=50) for r in page.rows]
    assert len(rows) == 36 and src.sizes[:3] == [50, 12, 3]


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "parquet"])
def test_streamed_export_matches_the_in_memory_export(store: Store, tmp_path: Path, fmt: str) -> None:
    src = CountingSource(StoreSource(store))
    streamed = export_from_source(src, RUN_A, fmt, tmp_path / f"s.{fmt}", page_size=5)
    assert streamed.rows == 36 and max(src.pages) <= 5
    memory = export_results(grid_results(), fmt, tmp_path / f"m.{fmt}", run_id=RUN_A)
    assert memory.rows == 36
    if fmt in ("json", "jsonl"):
        got = sorted(VerificationResultSet.from_file(streamed.path), key=_key)
        assert got == sorted(grid_results(), key=_key)
    if fmt == "json":
        doc = json.loads(Path(streamed.path).read_text())
        meta = doc["metadata"]
        assert meta["job_id"] == RUN_A and meta["karenina_version"].startswith("veribus ")
        assert meta["job_summary"]["total_questions"] == 36 and meta["job_summary"]["failed_count"] == 1
        assert meta["job_summary"]["is_complete"] is True and meta["job_summary"]["total_duration"] is not None
        assert [m["name"] for m in meta["verification_config"]["answering_models"]] == ["model-a", "model-b"]
        rubric = doc["shared_data"]["rubric_definition"]
        assert [t["name"] for t in rubric["llm_traits"]] == ["clarity", "safe"]
        assert [t["name"] for t in rubric["regex_traits"]] == ["cites"]
    if fmt == "csv":
        with open(streamed.path, newline="") as a, open(memory.path, newline="") as b:
            ra, rb = list(csv.DictReader(a)), list(csv.DictReader(b))
        assert list(ra[0]) == list(rb[0])  # same columns, traits included
        key = lambda row: row["result_id"]  # noqa: E731
        for x, y in zip(sorted(ra, key=key), sorted(rb, key=key), strict=True):
            assert {k: x[k] for k in ("verify_result", "trait.clarity", "trait.coverage.f1", "answering_model",
                                      "completed_without_errors", "input_tokens")} == \
                {k: y[k] for k in ("verify_result", "trait.clarity", "trait.coverage.f1", "answering_model",
                                   "completed_without_errors", "input_tokens")}
    if fmt == "parquet":
        import pyarrow.parquet as pq

        t = pq.read_table(streamed.path)
        assert t.num_rows == 36 and t.schema.names == pq.read_table(memory.path).schema.names
        got = sorted((VerificationResult.model_validate_json(x) for x in t.column("result_json").to_pylist()), key=_key)
        assert got == sorted(grid_results(), key=_key)


def test_export_run_resolves_names_and_filters(settings: Settings, store: Store, tmp_path: Path) -> None:
    stats = export_run(settings, "grid", "jsonl", tmp_path / "g.jsonl", page_size=10,
                       where=ResultFilter(answering_models=["model-b"], completed_only=True))
    assert stats.rows == 17
    assert {r.metadata.answering.model_name for r in VerificationResultSet.from_file(stats.path)} == {"model-b"}


def test_analysis_views(store: Store) -> None:
    def q(sql: str) -> list[dict[str, Any]]:
        return store.query_read_only(sql, {"r": RUN_A}).as_dicts()

    runs = q("SELECT * FROM v_run_results WHERE run_id = {r:String}")[0]
    assert (runs["results"], runs["errors"], runs["verified"], runs["passed"]) == (36, 1, 35, 23)
    lo, hi = wilson_interval(23, 35)
    assert runs["wilson_low"] == pytest.approx(lo, abs=1e-6) and runs["wilson_high"] == pytest.approx(hi, abs=1e-6)
    assert runs["questions"] == 3 and runs["replicates"] == 3

    models = q("SELECT answering_model, sum(passed) AS p, sum(verified) AS n FROM v_model_pass_rate "
               "WHERE run_id = {r:String} GROUP BY answering_model ORDER BY answering_model")
    assert [(m["p"], m["n"]) for m in models] == [(10, 18), (13, 17)]
    one = q("SELECT * FROM v_model_pass_rate WHERE run_id = {r:String} AND answering_model = 'litellm:model-a' "
            "AND parsing_model = 'litellm:judge-1'")[0]
    lo, hi = wilson_interval(5, 9)
    assert (one["passed"], one["verified"]) == (5, 9) and one["wilson_low"] == pytest.approx(lo, abs=1e-6)

    questions = {x["question_id"]: x for x in q("SELECT * FROM v_question_pass_rate WHERE run_id = {r:String}")}
    assert questions["q1"]["passed"] == 8 and questions["q1"]["flaky"]
    assert questions["q3"]["verified"] == 11 and questions["q3"]["passed"] == 5

    reps = q("SELECT * FROM v_replicate_outcomes WHERE run_id = {r:String} AND answering_model = 'litellm:model-a' "
             "AND parsing_model = 'litellm:judge-1' ORDER BY question_id")
    assert [(x["n"], x["passed"], bool(x["flaky"])) for x in reps] == [(3, 3, False), (3, 2, True), (3, 0, False)]

    traits = {(x["trait_type"], x["trait_name"]): x for x in q(
        "SELECT trait_type, trait_name, sum(n) AS n, avg(mean_score) AS m FROM v_trait_stats "
        "WHERE run_id = {r:String} GROUP BY trait_type, trait_name")}
    assert set(traits) == {("llm", "clarity"), ("llm", "safe"), ("regex", "cites"), ("metric", "coverage.precision"),
                           ("metric", "coverage.recall"), ("metric", "coverage.f1")}
    assert traits[("llm", "safe")]["n"] == 35 and traits[("llm", "safe")]["m"] == 1.0

    stages = {x["stage"]: x for x in q("SELECT * FROM v_stage_latency_by_stage WHERE run_id = {r:String}")}
    assert set(stages) == {"generate_answer", "parse_template", "verify_template", "rubric_evaluation"}
    assert stages["generate_answer"]["n"] == 36  # counted once though every later event repeats it
    assert stages["generate_answer"]["p50_ms"] == pytest.approx(2000, rel=1e-3)
    assert stages["parse_template"]["p95_ms"] == pytest.approx(500, rel=1e-3)


def test_reads_through_the_projector_over_nats(settings: Settings, store: Store, nats_server: Any) -> None:
    """open_source picks the projector when one answers on veribus.query; pages shrink to fit
    the projector's reply limit."""
    from shared.core.events import QUERY_SUBJECT
    from shared.store.projection import Projector

    nats_settings = settings.model_copy(update={"nats_url": nats_server.url})
    projector = Projector(nats_settings)
    projector.open()  # same folder, same process: a second handle on the open database
    projector.max_reply_bytes = 20_000  # ~10 results per reply
    ready, stop = threading.Event(), threading.Event()

    async def serve() -> None:
        import nats

        nc = await nats.connect(nats_server.url)

        async def handle(msg: Any) -> None:
            await msg.respond(await asyncio.to_thread(projector.answer_query, msg.data))

        await nc.subscribe(QUERY_SUBJECT, cb=handle)
        await nc.flush()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await nc.close()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
        with open_source(nats_settings) as src:
            assert isinstance(src, NatsSource)
        rs = VerificationResultSet.from_store(nats_settings, run_id=RUN_A, page_size=50)
        assert sorted(rs, key=_key) == sorted(grid_results(), key=_key)
        assert projector.stats.queries >= 4  # probe + pages that shrank to fit
    finally:
        stop.set()
        thread.join(10)
        projector.close()


def test_cli_commands(settings: Settings, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    from shared.cli.analysis import main

    monkeypatch.setenv("VERIBUS_HOME", str(settings.home))
    monkeypatch.setenv("VERIBUS_CLICKHOUSE_DATABASE", settings.clickhouse_database)
    monkeypatch.setenv("VERIBUS_NATS_URL", "nats://127.0.0.1:1")

    assert main(["export", "grid", "--output", str(tmp_path / "g.csv"), "--page-size", "7"]) == 0
    assert "exported 36 results" in capsys.readouterr().out
    assert main(["export", RUN_A, "--format", "json", "-o", str(tmp_path / "g.json")]) == 0
    assert main(["export", "nope", "--output", str(tmp_path / "x.json")]) == 2

    out_dir, html, junit = tmp_path / "out", tmp_path / "r.html", tmp_path / "j.xml"
    # the grid has one job that ended in error: by default no error is tolerated (exit 4) ...
    assert main(["report", "grid", "--gate", "accuracy>=0.6", "--quiet"]) == 4
    assert "error" in capsys.readouterr().out.lower()
    # ... and `--max-errors 1` tolerates exactly that one
    code = main(["report", "grid", "--html", str(html), "--output", str(out_dir), "--gate", "accuracy>=0.6",
                 "--junit", str(junit), "--max-errors", "1"])
    text = capsys.readouterr().out
    assert code == 0 and "Total samples: 36" in text and "Gate (accuracy >= 0.6): PASSED" in text
    assert html.stat().st_size > 5000 and junit.exists()
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["gates_passed"] is True and summary["metrics"]["total"] == 36
    assert summary["metrics"]["unfinished_questions_skipped"] == 2 and "Unfinished questions skipped: 2" in text
    assert summary["suite"] == "grid-bench" and len((out_dir / "results.jsonl").read_text().splitlines()) == 36

    assert main(["report", "grid", "--gate", "accuracy>=0.9", "--quiet", "--max-errors", "1"]) == 1
    assert capsys.readouterr().out.strip().startswith("✗ FAILED")
    assert main(["report", "grid", "--gate", "accuracy is great"]) == 2
    # a results file works wherever a run does
    assert main(["report", str(tmp_path / "g.json"), "--gate", "pass_rate:model-b>=0.7", "--quiet",
                 "--max-errors", "1"]) == 0
    assert capsys.readouterr().out.strip() == "✓ PASSED"

    assert main(["results", "grid", "--format", "json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {r["answering_model"]: (r["passed"], r["n"]) for r in res["pass_rates"]} == {
        "litellm:model-a": (10, 18), "litellm:model-b": (13, 17)}
    assert res["pass_at_k"][0]["pass@1"] is not None and len(res["flaky_questions"]) > 0
    # every format `export` writes reads back wherever a run does, with the same figures
    assert main(["export", "grid", "--format", "parquet", "-o", str(tmp_path / "g.parquet")]) == 0
    capsys.readouterr()
    for exported in ("g.csv", "g.parquet"):
        assert main(["results", str(tmp_path / exported), "--format", "json"]) == 0, exported
        again = json.loads(capsys.readouterr().out)
        assert {r["answering_model"]: (r["passed"], r["n"]) for r in again["pass_rates"]} == {
            r["answering_model"]: (r["passed"], r["n"]) for r in res["pass_rates"]}, exported
    assert main(["results", "grid", "--by", "question_id"]) == 0
    assert "pass rate by question_id" in capsys.readouterr().out

    assert main(["compare", "grid", "--model-a", "model-a", "--model-b", "model-b", "--format", "json"]) == 0
    cmp = json.loads(capsys.readouterr().out)
    assert cmp["pairs"] == 17 and cmp["mcnemar_p"] == pytest.approx(1124 / 2048)
    assert main(["compare", "grid", str(tmp_path / "g.json"), "--model-a", "model-a", "--model-b", "model-b"]) == 0
    assert "exact McNemar p" in capsys.readouterr().out
    # a model the run does not have is named with the models it has (one query), exit 2, nothing compared
    assert main(["compare", "grid", "--model-a", "model-a", "--model-b", "model-z"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err == ("veribus: error: --model-b 'model-z' is not an answering model of run grid "
                                           f"({RUN_A}): its answering models are model-a, model-b\n")


def test_analysis_bench_small(tmp_path: Path) -> None:
    """bench/analysis.py end to end on 2,000 rows, in its own process (its own chdb folder)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "bench.analysis", "--rows", "2000", "--batch", "500",
                           "--page-size", "300", "--export-format", "json", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout[proc.stdout.index("\n{") + 1:])
    assert figures["rows_in_table"] == 2000 and figures["export_rows"] == 2000
    assert figures["export_bytes"] > 0 and figures["rss_peak_mb"] >= figures["rss_before_export_mb"]
    assert 0.0 < figures["pass_rate"] < 1.0 and figures["wilson"][0] < figures["pass_rate"] < figures["wilson"][1]
    assert not Path(figures["folder"]).exists()  # the temp folder is removed


def test_streamed_csv_splits_global_and_question_traits_like_the_reference(settings: Settings, store: Store,
                                                                          tmp_path: Path) -> None:
    """The streamed CSV takes each trait's provenance from the jobs on the event log (the plan puts
    it on the rubric wire) and lays the columns out as the reference does: rubric_<global trait>,
    then question_specific_rubrics; the in-memory export, from rubric.trait_provenance, agrees."""
    run = "20260101T000000-prov0001"
    prov = {"safety": "global", "clarity": "global", "has_citations": "global",
            "under_150w": "question_specific", "drug_coverage": "question_specific"}
    results = []
    for r in spec_results():
        assert r.rubric is not None
        names = r.rubric.get_all_trait_scores()
        results.append(r.model_copy(update={"rubric": r.rubric.model_copy(
            update={"trait_provenance": {n: prov[n] for n in names}})}))
    store.insert_results([result_to_row(r, run, version=1) for r in results])
    try:
        _check_provenance_csv(store, run, results, prov, tmp_path)
    finally:  # the module's other tests count every run's rows
        db = settings.clickhouse_database
        for table in ("verification_results", "events"):
            store.client.command(f"ALTER TABLE {db}.{table} DELETE WHERE run_id = '{run}' SETTINGS mutations_sync = 1")
    assert VerificationResultSet.from_store(settings, run_id=run).results == []


def _check_provenance_csv(store: Store, run: str, results: list[VerificationResult], prov: dict[str, str],
                          tmp_path: Path) -> None:
    wire = {**RUBRIC_WIRE, "provenance": {n: "global" for n, p in prov.items() if p == "global"}}
    store.insert_events([
        events.make_envelope(events.ANSWER_GENERATED, run, r.metadata.result_id,
                             events.StageEvent(job=msgspec.structs.replace(job_for(r, run), rubric=wire),
                                               state=events.State()), "test/1")
        for r in results])
    streamed = export_from_source(StoreSource(store), run, "csv", tmp_path / "s.csv", page_size=3)
    memory = export_results(results, "csv", tmp_path / "m.csv", run_id=run)
    with open(streamed.path, newline="") as a, open(memory.path, newline="") as b:
        ra, rb = list(csv.DictReader(a)), list(csv.DictReader(b))
    header = list(ra[0])
    assert header == list(rb[0])
    assert header[12:16] == ["rubric_clarity", "rubric_has_citations", "rubric_safety", "question_specific_rubrics"]
    first = next(row for row in ra if row["result_id"] == "d5e150fab775efd9")
    assert (first["rubric_clarity"], first["rubric_safety"]) == ("4", "True")
    assert set(json.loads(first["question_specific_rubrics"])) == {"under_150w", "drug_coverage"}
    by_id = {r.metadata.result_id: r for r in results}
    assert {r.metadata.result_id: r for r in VerificationResultSet.from_file(streamed.path)} == by_id


def test_streamed_csv_quotes_formulas_an_attacker_wrote(settings: Settings, store: Store, tmp_path: Path) -> None:
    """The streamed CSV (what `veribus export RUN` writes from the store) puts a `'` before every
    text cell a spreadsheet would run (question, reply, ids, model and run names, labels), keeps
    the negative scores as numbers, and with csv_raw gives every cell back as it was."""
    run = "20260101T000000-csvi0001"
    results = attack_results()
    store.insert_results([result_to_row(r, run, version=1) for r in results])
    wire = {"traits": [{"type": "llm", "name": "delta", "kind": "score", "min_score": -5, "max_score": 5}],
            "provenance": {"delta": "global"}}
    store.insert_events([
        events.make_envelope(events.ANSWER_GENERATED, run, r.metadata.result_id,
                             events.StageEvent(job=msgspec.structs.replace(job_for(r, run), rubric=wire),
                                               state=events.State()), "test/1")
        for r in results])
    try:
        safe = export_from_source(StoreSource(store), run, "csv", tmp_path / "safe.csv", page_size=5)
        check_escaped(Path(safe.path), results)
        raw = export_run(settings, run, "csv", tmp_path / "raw.csv", page_size=5, csv_raw=True)
        check_raw(Path(raw.path), results)
        assert sorted(VerificationResultSet.from_file(safe.path), key=_key) == sorted(results, key=_key)
    finally:  # the module's other tests count every run's rows
        db = settings.clickhouse_database
        for table in ("verification_results", "events"):
            store.client.command(f"ALTER TABLE {db}.{table} DELETE WHERE run_id = '{run}' SETTINGS mutations_sync = 1")
