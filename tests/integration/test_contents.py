"""Lean jobs keep their question, template and rubric in the content store (KV), not in the events;
the projector copies each referenced content into ClickHouse's `contents` table, so exports and
reports read a run's rubric (global and question-specific traits) from ClickHouse alone, also
after `projections rebuild`."""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from shared.analysis.export import export_run, rubric_definition_from_store, trait_split_from_store
from shared.control import processes, rebuild, rebuild_parallel, runner
from shared.runtime import bus, content
from shared.store.reads import ResultFilter, open_source
from tests.support.stack import (
    Stack,
    generated_benchmark,
    plan_and_submit,
    rows,
    start_stack,
    stop_stack,
    sync,
    wait_projected,
    wait_projector_idle,
    wait_results,
)

N = 4
# question 0 only: matches "The sum is 0." the simulator answers
QUESTION_RUBRIC = {"regex_traits": [{"name": "SaysSum", "pattern": "(?i)sum"}]}


@pytest.fixture(scope="module")
def cstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = start_stack(tmp_path_factory.mktemp("contents") / "home")
    try:
        yield st
    finally:
        stop_stack(st)


@pytest.fixture(scope="module")
def rubric_run(cstack: Stack, tmp_path_factory: pytest.TempPathFactory) -> runner.RunPlan:
    path, script = generated_benchmark(tmp_path_factory.mktemp("bench") / "bench.yaml", N, prefix="Contents")
    doc = yaml.safe_load(path.read_text())
    doc["questions"][0]["rubric"] = QUESTION_RUBRIC
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    cstack.post_script(script)
    plan = plan_and_submit(cstack, path, cstack.config())
    wait_results(cstack, plan.run_id, N)
    wait_projected(cstack, plan.run_id, N)
    wait_projector_idle(cstack)
    return plan


def _check_exports(st: Stack, run_id: str, tmp_path: Path) -> None:
    with open_source(st.settings) as source:
        definition = rubric_definition_from_store(source, run_id)
        split = trait_split_from_store(source, run_id, ResultFilter(run_id=run_id))
    assert definition is not None, "the run's rubric is lost to lean events"
    assert [t["name"] for t in definition["llm_traits"]] == ["Clarity"]
    assert sorted(t["name"] for t in definition["regex_traits"]) == ["NoApology", "SaysSum"]
    assert split == (["Clarity", "NoApology"], ["SaysSum"])

    stats = export_run(st.settings, run_id, "json", tmp_path / "run.json")
    doc = json.loads(Path(stats.path).read_text())
    assert doc["shared_data"]["rubric_definition"] == definition
    stats = export_run(st.settings, run_id, "csv", tmp_path / "run.csv")
    with open(stats.path, newline="") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == N
    assert {"rubric_Clarity", "rubric_NoApology", "question_specific_rubrics"} <= set(table[0])
    assert "rubric_SaysSum" not in table[0]
    specific = {r["question_id"]: json.loads(r["question_specific_rubrics"] or "{}") for r in table}
    assert [q for q, traits in specific.items() if "SaysSum" in traits] == ["q0000"]


def _contents(st: Stack, run_id: str) -> dict[str, int]:
    return dict(rows(st, "SELECT kind, count() FROM contents FINAL WHERE run_id = {r:String} GROUP BY kind",
                     r=run_id))


def test_export_reads_the_rubric_of_a_lean_run_from_clickhouse(cstack: Stack, rubric_run: runner.RunPlan,
                                                               tmp_path: Path) -> None:
    run_id = rubric_run.run_id
    # the events carry refs only: the rubric is not inline on any of them
    assert rows(cstack, "SELECT count() FROM events WHERE run_id = {r:String} AND event_type = 'answer.generated' "
                        "AND JSONExtractRaw(payload, 'job', 'rubric') NOT IN ('', 'null')", r=run_id) == [(0,)]
    # one content per question, one options set, one model pair
    assert _contents(cstack, run_id) == {"q": N, "o": 1, "m": 1, "s": 1}  # and the run's code manifest
    body = rows(cstack, "SELECT body FROM contents FINAL WHERE run_id = {r:String} AND kind = 'q' "
                        "AND JSONExtractString(body, 'question_id') = 'q0000'", r=run_id)[0][0]
    assert "SaysSum" in body and "Clarity" in body
    _check_exports(cstack, run_id, tmp_path)


def test_rebuild_copies_the_contents_again(cstack: Stack, rubric_run: runner.RunPlan, tmp_path: Path) -> None:
    """Re-projecting the stream (the projector re-reads it from the start) refetches every content
    from the content store: same rows, nothing duplicated, exports unchanged."""
    before = _contents(cstack, rubric_run.run_id)
    rep = rebuild.rebuild_projections(cstack.settings, timeout=120)
    assert rep.mode == "stack" and rep.identical, (rep.before, rep.after)
    assert rep.after["contents"][0] >= N + 2 and rep.contents_missing == {} and rep.contents_lines() == []
    assert _contents(cstack, rubric_run.run_id) == before
    assert rows(cstack, "SELECT count() FROM contents") == rows(cstack, "SELECT count() FROM contents FINAL")
    _check_exports(cstack, rubric_run.run_id, tmp_path)


@pytest.mark.parametrize("workers", [0, 2])
def test_rebuild_in_process_copies_the_contents(cstack: Stack, rubric_run: runner.RunPlan, tmp_path: Path,
                                                workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a running projector, the rebuild folds the stream in this process (or in worker
    processes, which project events only, the contents then copied in SQL-found order) and reads
    the contents from the bucket itself."""
    monkeypatch.setattr(rebuild_parallel, "CHUNK", 7)  # many chunks, so the workers do run
    before = _contents(cstack, rubric_run.run_id)
    processes.stop_proc(cstack.proc("projector"), timeout=30.0)
    try:
        rep = rebuild._rebuild_in_process(cstack.settings, lambda _m: None, time.monotonic(), workers=workers)
    finally:
        cstack.restart("projector")
    assert rep.mode == "in-process" and rep.identical, (rep.before, rep.after)
    assert rep.contents_missing == {}
    wait_projector_idle(cstack)
    assert _contents(cstack, rubric_run.run_id) == before
    _check_exports(cstack, rubric_run.run_id, tmp_path)


def test_rebuild_says_which_runs_lost_their_contents(cstack: Stack, rubric_run: runner.RunPlan) -> None:
    """Content gone from the bucket cannot be copied by a rebuild: the report names the run (this
    test deletes content, so it runs last)."""
    run_id = rubric_run.run_id
    key = rows(cstack, "SELECT key FROM contents FINAL WHERE run_id = {r:String} AND kind = 'q' "
                       "AND JSONExtractString(body, 'question_id') = 'q0001'", r=run_id)[0][0]

    async def delete() -> None:
        nc = await bus.connect(cstack.settings)
        try:
            await (await nc.jetstream().key_value(content.BUCKET)).purge(key)
        finally:
            await nc.close()

    sync(delete())
    rep = rebuild.rebuild_projections(cstack.settings, timeout=120)
    assert rep.contents_missing == {run_id: 1}
    (line,) = rep.contents_lines()
    assert f"{run_id} (1)" in line and content.BUCKET in line
    assert _contents(cstack, run_id)["q"] == N - 1
    assert rows(cstack, "SELECT count() FROM contents FINAL WHERE key = {k:String}", k=key) == [(0,)]
