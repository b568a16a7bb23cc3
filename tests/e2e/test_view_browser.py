"""`veribus view` in a real browser: headless Chromium (Debian's `chromium`, driven by
Playwright's Python package pointed at it) goes runs -> run -> sample -> compare on a real stack
(nats-server, simulator, the seven services, chdb in the projector), clicks filters and checks
what is rendered against ClickHouse. A screenshot of every page is kept under
out/test-artifacts/view/.

Runs made here:
- `base`: the example benchmark with two answering models (sim-a, sim-b);
- `changed`: the same with a simulator script that makes one question fail and one question's
  generation error out (HTTP 500 on every attempt);
- `live`: the example with 4 replicates against a slow simulator, watched while it runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from shared.control import stack
from shared.core.config import Settings
from shared.store.reads import run_query
from tests.conftest import EXAMPLE, REPO

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = REPO / "out" / "test-artifacts" / "view"
FAIL_Q = "What is 17 multiplied by 23?"
ERROR_Q = "What is the square root of 144?"


@dataclass
class ViewStack:
    settings: Settings
    env: dict[str, str]
    url: str
    runs: dict[str, str]  # label -> run id


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "VERIBUS_HOME": str(home)}
    for key in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "VERIBUS_NATS_URL"):
        env.pop(key, None)
    return env


def _veribus(env: dict[str, str], *args: str, timeout: float = 300, expect: int = 0) -> str:
    proc = subprocess.run([sys.executable, "-m", "shared.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"run id: (\S+)", proc.stdout)
    assert m, proc.stdout[-2000:]
    return m.group(1)


def _changed_benchmark(folder: Path) -> Path:
    """The example, with its simulator script changed: FAIL_Q parsed wrong, ERROR_Q's answers
    refused with HTTP 500 every time."""
    folder.mkdir(parents=True, exist_ok=True)
    bench = folder / "changed.yaml"
    shutil.copy(EXAMPLE, bench)
    script = yaml.safe_load(EXAMPLE.with_name("example.simulator.yaml").read_text())
    for q in script["questions"]:
        if q["match"] == FAIL_Q:
            q["parsed"] = {"product": 390}
        if q["match"] == ERROR_Q:
            q["answer_errors"] = [500] * 40
    (folder / "changed.simulator.yaml").write_text(yaml.safe_dump(script))
    return bench


@pytest.fixture(scope="module")
def view_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ViewStack]:
    home = tmp_path_factory.mktemp("view") / "home"
    settings = Settings(home=home)
    state = stack.up(settings, simulator_args=["--latency-ms", "150"])
    settings.nats_url = state.nats_url
    env = _env(home)
    viewer: subprocess.Popen[str] | None = None
    try:
        runs = {
            "base": _veribus(env, "run", str(EXAMPLE), "--simulate", "--mode", "template_and_rubric",
                             "--model", "sim-a", "--model", "sim-b", "--run-name", "view-base"),
            "changed": _veribus(env, "run", str(_changed_benchmark(tmp_path_factory.mktemp("bench"))), "--simulate",
                                "--mode", "template_and_rubric", "--model", "sim-a", "--model", "sim-b",
                                "--run-name", "view-changed", expect=4),  # ERROR_Q's jobs end in error: exit 4
        }
        viewer = subprocess.Popen([sys.executable, "-m", "shared.cli", "view", "--port", "0"], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert viewer.stdout is not None
        line = viewer.stdout.readline()
        m = re.search(r"(http://localhost:\d+/)", line)
        assert m, f"viewer did not print its URL: {line!r}"
        yield ViewStack(settings, env, m.group(1), runs)
    finally:
        if viewer is not None and viewer.poll() is None:
            viewer.terminate()
            viewer.wait(20)
        stack.down(settings)
        for p in state.procs:
            assert not p.alive(), f"{p.name} (pid {p.pid}) still running after down"


@pytest.fixture(scope="module")
def browser(view_stack: ViewStack) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Debian's chromium is required: apt-get install -y chromium (.ci/run does)"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: object, view_stack: ViewStack) -> Iterator[object]:
    ctx = browser.new_context(viewport={"width": 1300, "height": 900})  # type: ignore[attr-defined]
    pg = ctx.new_page()
    outside: list[str] = []
    pg.on("request", lambda r: outside.append(r.url) if not r.url.startswith(view_stack.url) else None)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        yield pg
    finally:
        ctx.close()
    assert outside == [], f"the viewer fetched something that is not its own: {outside}"
    assert errors == [], f"JavaScript errors: {errors}"


def _rows(st: ViewStack, sql: str, **params: object) -> list[tuple]:
    return run_query(st.settings, sql, params).rows


def _shot(pg: object, name: str) -> None:
    """A full-page screenshot, and one of the first screen (what the README shows)."""
    path = ARTIFACTS / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    assert path.stat().st_size > 20_000
    pg.screenshot(path=str(ARTIFACTS / f"{name}-screen.png"))  # type: ignore[attr-defined]


def test_runs_run_sample_compare(page: object, view_stack: ViewStack) -> None:
    pg, st = page, view_stack
    base, changed = st.runs["base"], st.runs["changed"]

    # ---- runs ----
    pg.goto(st.url)
    rows = pg.locator("#runs tbody tr")
    assert rows.count() >= 2
    text = pg.inner_text("#runs")
    assert "view-base" in text and "view-changed" in text and "SIMULATED" in text and "finished" in text
    changed_row = pg.locator("#runs tbody tr", has_text="view-changed").inner_text()
    n_err = _rows(st, "SELECT countIf(NOT completed_without_errors) FROM verification_results FINAL "
                      "WHERE run_id = {r:String}", r=changed)[0][0]
    assert n_err >= 2  # ERROR_Q for both models
    assert re.search(rf"\b{n_err}\b", changed_row.split("]")[-1]), changed_row
    _shot(pg, "1-runs")

    # ---- run ----
    with pg.expect_navigation():
        pg.click("#runs a.run-link:has-text('view-base')")
    assert pg.url.startswith(f"{st.url}run/{base}")
    heat = pg.inner_text("#heatmap")
    questions = [q["question"] for q in yaml.safe_load(EXAMPLE.read_text())["questions"] if q.get("finished", True)]
    for q in questions:
        assert q.split()[0] in heat  # question names label the heat map rows
    assert FAIL_Q in heat and "openai/sim-a" in heat and "openai/sim-b" in heat
    assert "Pass rate per answering model" in pg.inner_text("#main") and pg.locator("#traits").count() == 1
    assert "generate_answer" in pg.inner_text("#latency")
    total = _rows(st, "SELECT count() FROM verification_results FINAL WHERE run_id = {r:String}", r=base)[0][0]
    assert pg.inner_text("#samples-count").startswith(f"{total} results match")

    # filter: model
    with pg.expect_navigation():
        pg.select_option("#f-model", label="simulator:openai/sim-b")
    n_b = _rows(st, "SELECT count() FROM verification_results FINAL WHERE run_id = {r:String} "
                    "AND answering_model = 'simulator:openai/sim-b'", r=base)[0][0]
    assert pg.inner_text("#samples-count").startswith(f"{n_b} results match")
    assert "simulator:openai/sim-a" not in pg.inner_text("#samples-table")
    # filter: failed (on top of the model)
    with pg.expect_navigation():
        pg.select_option("#f-status", "failed")
    failed = _rows(st, "SELECT question_text FROM verification_results FINAL WHERE run_id = {r:String} "
                       "AND answering_model = 'simulator:openai/sim-b' AND verify_result = false", r=base)
    assert pg.inner_text("#samples-count").startswith(f"{len(failed)} results match")
    table = pg.inner_text("#samples-table")
    assert all(t[0][:30] in table for t in failed) and "pass\t" not in table
    assert "model=simulator" in pg.url and "status=failed" in pg.url  # deep link
    _shot(pg, "2-run-filtered")
    # deep link: the same URL in a fresh page shows the same filtered view
    url = pg.url
    pg.goto(url)
    assert pg.inner_text("#samples-count").startswith(f"{len(failed)} results match")
    # text search
    pg.goto(f"{st.url}run/{base}")
    pg.fill("#f-q", "Galilean")
    with pg.expect_navigation():
        pg.click("#apply")
    assert pg.inner_text("#samples-count").startswith("2 results match")
    assert pg.locator("#samples-table tbody tr").count() == 2
    _shot(pg, "2-run")  # overwritten below with the unfiltered page for the README

    # ---- sample ----
    with pg.expect_navigation():
        pg.locator("#samples-table a.sample-link").first.click()
    rid = pg.url.split("?")[0].rsplit("/", 1)[-1]
    (qtext, response, verdict, gt), = _rows(
        st, "SELECT question_text, raw_llm_response, verify_result, JSONExtractString(result_json, 'metadata', "
            "'raw_answer') FROM verification_results FINAL WHERE run_id = {r:String} AND result_id = {id:String}",
        r=base, id=rid)
    assert pg.inner_text("#question").startswith(qtext)
    assert pg.inner_text("pre.answer") == response and pg.inner_text("pre.gt") == gt
    parse = pg.inner_text("#parse")
    assert "moons" in parse and "Callisto" in parse and "Titan" in parse  # expected beside the judge's parse
    assert ("fail" if not verdict else "pass") in pg.inner_text("#verify")
    assert "Clarity" in pg.inner_text("#rubric-scores")
    timeline = pg.inner_text("#timeline")
    assert "generate_answer" in timeline and "parse_template" in timeline and "rubric_evaluation" in timeline
    assert "result.finalized" in pg.inner_text("#events")
    assert pg.locator("a.next").count() == 1  # the other Galilean result, in the filtered list
    _shot(pg, "3-sample")
    with pg.expect_navigation():
        pg.click("a.next")
    assert "q=Galilean" in pg.url and pg.locator("a.prev").count() == 1 and pg.locator("a.next").count() == 0
    assert "Galilean" in pg.inner_text("#question")

    # an errored sample, reached from the run's errors section
    pg.goto(f"{st.url}run/{changed}")
    errs = pg.inner_text("#errors")
    assert "generate_answer" in errs and "HTTP 500" in errs
    with pg.expect_navigation():
        pg.locator("#errors a", has_text="open").first.click()
    assert ERROR_Q in pg.inner_text("#question")
    assert "generate_answer" in pg.inner_text("#error") and "500" in pg.inner_text("#error")
    _shot(pg, "3-sample-error")

    # ---- compare: two runs ----
    pg.goto(f"{st.url}compare")
    pg.select_option("#c-run", base)
    pg.select_option("#c-run_b", changed)
    with pg.expect_navigation():
        pg.click("#c-go")
    summary = pg.inner_text("#compare-summary")
    assert "McNemar" in summary and "difference" in summary
    pairs = _rows(st, "SELECT count() FROM (SELECT question_id, ifNull(replicate, 0) AS rep, parsing_model, "
                      "answering_model FROM verification_results FINAL WHERE run_id = {a:String} AND verify_result "
                      "IS NOT NULL) AS A INNER JOIN (SELECT question_id, ifNull(replicate, 0) AS rep, parsing_model, "
                      "answering_model FROM verification_results FINAL WHERE run_id = {b:String} AND verify_result "
                      "IS NOT NULL) AS B USING (question_id, rep, parsing_model, answering_model)", a=base, b=changed)[0][0]
    assert f"{pairs} (unpaired" in summary
    flips = pg.inner_text("#flips")
    assert FAIL_Q in flips and pg.locator("#flips tbody tr").count() == 2  # FAIL_Q for sim-a and sim-b
    assert ERROR_Q not in flips  # an error has no verdict: unpaired, not a flip
    _shot(pg, "4-compare-runs")

    # ---- compare: two models of one run ----
    pg.goto(f"{st.url}run/{base}")
    with pg.expect_navigation():
        pg.click("a.compare-link")
    summary = pg.inner_text("#compare-summary")
    assert "+0.0 points" in summary and "p" in summary
    assert "No flips" in pg.inner_text("#main")
    _shot(pg, "4-compare-models")

    # the README's run page: unfiltered
    pg.goto(f"{st.url}run/{base}")
    _shot(pg, "2-run")


def test_bad_links_say_what_is_wrong(page: object, view_stack: ViewStack) -> None:
    pg, st = page, view_stack
    resp = pg.goto(f"{st.url}run/no-such-run")
    assert resp.status == 404 and "no-such-run" in pg.inner_text("#problem")
    resp = pg.goto(f"{st.url}run/{st.runs['base']}?status=maybe")
    assert resp.status == 400 and "status" in pg.inner_text("#problem") and "maybe" in pg.inner_text("#problem")
    resp = pg.goto(f"{st.url}compare?run={st.runs['base']}&a=simulator:openai/sim-a")
    assert resp.status == 400 and "model B" in pg.inner_text("#problem")


def test_a_running_run_updates_live(page: object, view_stack: ViewStack) -> None:
    pg, st = page, view_stack
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "run", str(EXAMPLE), "--simulate", "--mode",
                             "template_and_rubric", "--replicates", "6", "--run-name", "view-live", "--quiet"],
                            cwd=REPO, env=st.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pg.goto(st.url)
        deadline = time.monotonic() + 120
        while "view-live" not in pg.inner_text("#main") and time.monotonic() < deadline:
            time.sleep(0.5)
            pg.reload()
        row = pg.locator("#runs tbody tr", has_text="view-live")
        row_text = row.inner_text()
        if "running" in row_text:  # seen while it runs: the page refreshes itself until it finishes
            assert pg.evaluate("document.body.dataset.live") == "1"
            _shot(pg, "1-runs-live")
            row.locator("text=finished").wait_for(timeout=240_000)  # no reload: the page updated itself
            assert pg.evaluate("document.body.dataset.refreshed") is not None
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        pg.reload()
        assert "finished" in pg.locator("#runs tbody tr", has_text="view-live").inner_text()
        assert "running" in row_text, f"the run finished before the page saw it running: {row_text!r}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
