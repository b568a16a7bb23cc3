"""End to end: the full multi-process stack (nats-server, simulator, seven services, embedded
ClickHouse in the projector) verifies a reference checkpoint and our example; rows are checked
in ClickHouse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.control import stack
from shared.core.config import Settings
from shared.store.reads import run_query
from tests.conftest import CHECKPOINTS, EXAMPLE, REPO
from tests.support.stack import up_and_down

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def running_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, stack.StackState]]:
    with up_and_down(tmp_path_factory.mktemp("stack") / "home") as both:
        yield both


def veribus(settings: Settings, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VERIBUS_HOME": str(settings.home)}
    for key in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def rows(settings: Settings, sql: str, **params: object) -> list[tuple]:
    return run_query(settings, sql, params).rows


def run_id_of(stdout: str) -> str:
    for line in stdout.splitlines():
        if line.startswith("run ") and " jobs " in line:
            return line.split()[1].rstrip(":")
    raise AssertionError(f"no run id in output:\n{stdout}")


@pytest.mark.smoke
def test_reference_checkpoint_end_to_end(running_stack, tmp_path: Path) -> None:
    settings, _ = running_stack
    out = tmp_path / "out"
    proc = veribus(settings, "run", str(CHECKPOINTS / "multi_question.jsonld"), "--simulate",
                   "--run-name", "e2e-multi", "--output", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "SIMULATED" in proc.stdout
    assert "1 unfinished question(s) skipped: urn:karenina:test:mq005" in proc.stdout
    run_id = run_id_of(proc.stdout)
    got = rows(settings, "SELECT question_id, verify_result, completed_without_errors, result_id "
                         "FROM verification_results FINAL WHERE run_id = {r:String} ORDER BY question_id", r=run_id)
    assert [g[0] for g in got] == [f"urn:karenina:test:mq00{i}" for i in (1, 2, 3, 4)]
    assert all(g[1] is True or g[1] == 1 for g in got), got
    assert all(g[2] for g in got)
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(line["result"]["metadata"]["result_id"] for line in lines) == sorted(g[3] for g in got)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["total"] == 4 and summary["metrics"]["passed_attempts"] == 4
    assert summary["metrics"]["unfinished_questions_skipped"] == 1


def test_example_benchmark_with_rubric(running_stack, tmp_path: Path) -> None:
    settings, _ = running_stack
    proc = veribus(settings, "run", str(EXAMPLE), "--simulate", "--mode", "template_and_rubric",
                   "--run-name", "e2e-example", "--output", str(tmp_path / "ex"))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    run_id = run_id_of(proc.stdout)
    got = dict(rows(settings, "SELECT question_id, verify_result FROM verification_results FINAL "
                              "WHERE run_id = {r:String}", r=run_id))
    assert len(got) == 18
    failing = {q for q, ok in got.items() if not ok}
    assert failing == {"ex-astro-galilean", "ex-history-apollo11", "ex-space-great-wall"}
    # every result carries a rubric with the example's traits
    lines = [json.loads(x) for x in (tmp_path / "ex" / "results.jsonl").read_text().splitlines()]
    for line in lines:
        rubric = line["result"]["rubric"]
        assert rubric and rubric["rubric_evaluation_performed"], line["sample"]["id"]
        assert rubric["llm_trait_scores"] and rubric["regex_trait_scores"] is not None
    # events are in ClickHouse too, one finalized event per result, no duplicates
    n_final = rows(settings, "SELECT count() FROM events FINAL WHERE run_id = {r:String} "
                             "AND event_type = 'result.finalized'", r=run_id)[0][0]
    assert n_final == 18


def test_bad_input_is_refused_before_publishing(running_stack, tmp_path: Path) -> None:
    settings, _ = running_stack
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nquestions:\n  - id: q-broken\n    question: What?\n    answer: x\n"
                   "    template: |\n      class Answer(:\n        pass\n")
    before = rows(settings, "SELECT count() FROM events FINAL")[0][0]
    proc = veribus(settings, "run", str(bad), "--simulate")
    assert proc.returncode == 2
    assert "q-broken" in proc.stderr
    missing = veribus(settings, "run", str(tmp_path / "nope.jsonld"), "--simulate")
    assert missing.returncode == 2 and "nope.jsonld" in missing.stderr
    assert rows(settings, "SELECT count() FROM events FINAL")[0][0] == before


def test_the_reference_csv_runs_in_rubric_only_mode_with_a_rubric_file(running_stack, tmp_path: Path) -> None:
    """The reference's `sample_questions.csv` (Question,Answer: no templates, no rubric) could run
    in no mode: template modes need templates, rubric_only needs traits. `--rubric FILE` adds a
    global rubric; without it, the refusal says how to run such a file."""
    from tests.conftest import REFERENCE

    settings, _ = running_stack
    csv_path = REFERENCE / "sample_questions.csv"
    refused = veribus(settings, "run", str(csv_path), "--simulate")
    assert refused.returncode == 2 and "--mode rubric_only" in refused.stderr and "--rubric FILE" in refused.stderr
    rubric = tmp_path / "rubric.yaml"
    rubric.write_text("rubric:\n  llm_traits:\n    - name: Correct\n      description: Gives the reference answer.\n"
                      "      kind: boolean\n  regex_traits:\n    - name: NoApology\n      description: No apology.\n"
                      "      pattern: '\\bsorry\\b'\n      invert_result: true\n")
    proc = veribus(settings, "run", str(csv_path), "--simulate", "--mode", "rubric_only", "--rubric", str(rubric))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id = run_id_of(proc.stdout)
    got = rows(settings, "SELECT question_text, rubric_json FROM verification_results FINAL WHERE run_id = {r:String} "
                         "ORDER BY question_text", r=run_id)
    assert [g[0] for g in got][:2] == ["What is 2 + 2?", "What is the capital of France?"] and len(got) == 5
    assert all('"Correct"' in g[1] and '"NoApology"' in g[1] for g in got), got
