"""The viewer's pages against the real engine (chdb), through aiohttp's test client: numbers
match an independent computation in Python, filters narrow what every section shows, and an
attacker's inputs (SQL in filters and paths, HTML in stored results, a foreign Host header, path
traversal to the package's files) get nothing.

Uses the analysis tests' chdb folder and grid run (one chdb folder per process)."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from shared.analysis.stats import Proportion, compare_models
from shared.cli.view import build_app
from shared.cli.view.queries import PAGE_SIZE
from shared.cli.view.source import ViewSource
from shared.core.config import Settings
from shared.core.models import VerificationResult
from shared.store.engine import QueryResult, Store
from shared.store.reads import QueryError
from shared.store.rows import result_to_row
from tests.conftest import NatsServer
from tests.support.analysis_store import RUN_A
from tests.support.results import grid_results, make

RUN_EVIL = "20260101T000000-evil0001"
RUN_BIG = "20260101T000000-big00001"
EVIL_TEXT = "<script>alert('q')</script> & <img src=x onerror=alert(1)>"
EVIL_MODEL = "evil'); DROP TABLE verification_results; --<b>"
BIG = 3000


class Recording:
    """Async source over an open Store that records how many rows each query returned."""

    def __init__(self, st: Store) -> None:
        self.store = st
        self.returned: list[tuple[int, str]] = []

    async def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        res = self.store.query_read_only(sql, params)
        self.returned.append((len(res.rows), sql))
        return res


@pytest.fixture(scope="module")
def seeded(store: Store) -> Store:  # noqa: F811 - fixture
    evil = make("q-evil", EVIL_MODEL, False, judge="judge<i>", run_name=EVIL_TEXT,
                error="parse_template: ValueError: <svg onload=alert(2)>")
    evil.metadata.question_text = EVIL_TEXT
    store.insert_results([result_to_row(evil, RUN_EVIL, version=1)])
    store.insert_results([result_to_row(r, RUN_BIG, version=1) for r in big_run()])
    return store


def big_run() -> list[VerificationResult]:
    """BIG results: the grid's outcomes spread over 500 questions."""
    out = []
    base = grid_results()
    for i in range(BIG):
        r = base[i % len(base)].model_copy(deep=True)
        r.metadata.question_id = f"bq{i % 500:03d}"
        r.metadata.question_text = f"Big question number {i % 500}"
        r.metadata.replicate = i // 500 + 1
        r.metadata.result_id = uuid.uuid5(uuid.NAMESPACE_OID, f"big{i}").hex[:16]
        out.append(r)
    return out


@pytest.fixture
async def client(seeded: Store) -> AsyncIterator[TestClient]:
    src = Recording(seeded)
    app = build_app(src)
    async with TestClient(TestServer(app)) as c:
        c.src = src  # type: ignore[attr-defined]
        yield c


async def _get(c: TestClient, url: str, status: int = 200, **kw: Any) -> str:
    resp = await c.get(url, **kw)
    text = await resp.text()
    assert resp.status == status, text[:2000]
    return text


def _count(page: str) -> int:
    m = re.search(r"id='samples-count'>([\d,]+) results match", page)
    assert m, page[:3000]
    return int(m.group(1).replace(",", ""))


async def test_run_page_numbers_match_python(client: TestClient) -> None:
    grid = grid_results()
    page = await _get(client, f"/run/{RUN_A}")
    for model in ("model-a", "model-b"):
        mine = [r for r in grid if r.metadata.answering.model_name == model and r.template.verify_result is not None]
        p = Proportion.of(sum(1 for r in mine if r.template.verify_result), len(mine))
        assert f"{100 * p.rate:.1f}%" in page and f"{100 * p.ci_low:.1f}% – {100 * p.ci_high:.1f}%" in page
    # question names in the heat map, linked to the filtered run
    heat = page.split("id='heatmap'")[1].split("</table>")[0]
    assert "What is the putative target of venetoclax?" in heat and "Question q2?" in heat
    assert f"/run/{RUN_A}?q=q1" in heat
    # errors grouped by stage and type, with the example
    errors = page.split('id="errors"')[1].split("</table>")[0]
    assert "generate_answer" in errors and "TimeoutError" in errors and "model took too long" in errors
    assert _count(page) == len(grid)
    assert "clarity" in page and "coverage.f1" in page  # trait table, metric traits per metric


async def test_filters_narrow_every_section(client: TestClient) -> None:
    grid = grid_results()

    def n(pred: Any) -> int:
        return sum(1 for r in grid if pred(r))

    assert _count(await _get(client, f"/run/{RUN_A}?model=model-a")) == n(lambda r: r.metadata.answering.model_name == "model-a")
    assert _count(await _get(client, f"/run/{RUN_A}?model=litellm:model-b")) == 18
    assert _count(await _get(client, f"/run/{RUN_A}?status=errored")) == n(lambda r: not r.metadata.completed_without_errors)
    page = await _get(client, f"/run/{RUN_A}?judge=judge-2&status=failed")
    assert _count(page) == n(lambda r: r.metadata.parsing.model_name == "judge-2" and r.template.verify_result is False)
    assert "judge-1</a>" not in page.split("id='judges'")[1].split("</table>")[0]
    assert _count(await _get(client, f"/run/{RUN_A}?q=VENETOCLAX")) == n(lambda r: r.metadata.question_id == "q1")
    # the page of results is bounded and links to the next one with the filters kept
    page = await _get(client, f"/run/{RUN_BIG}?model=model-a")
    assert _count(page) == sum(1 for r in big_run() if r.metadata.answering.model_name == "model-a")
    assert page.count("class=\"sample-link\"") == PAGE_SIZE
    assert f"/run/{RUN_BIG}?model=model-a&amp;page=1#samples" in page


async def test_no_query_returns_a_whole_run(client: TestClient) -> None:
    """A run of 3000 results renders from aggregates and pages: no query returns more than a
    few hundred rows (the page size, the heat map's question page times models, traits)."""
    client.src.returned.clear()  # type: ignore[attr-defined]
    await _get(client, f"/run/{RUN_BIG}")
    await _get(client, f"/run/{RUN_BIG}?page=3&hpage=2")
    await _get(client, "/")
    await _get(client, f"/compare?run={RUN_BIG}&a=model-a&b=model-b")
    biggest = max(client.src.returned)  # type: ignore[attr-defined]
    assert biggest[0] <= 200, biggest


async def test_compare_matches_the_python_statistics(client: TestClient) -> None:
    grid = grid_results()
    want = compare_models(grid, "model-a", "model-b")
    page = await _get(client, f"/compare?run={RUN_A}&a=model-a&b=model-b")
    assert f"{want.pairs:,} (unpaired: A {want.unpaired_a}, B {want.unpaired_b})" in page
    assert f"{want.both_pass} / {want.a_only} / {want.b_only} / {want.both_fail}" in page
    assert f"{100 * want.difference:+.1f} points [{100 * want.diff_ci_low:+.1f}, {100 * want.diff_ci_high:+.1f}]" in page
    assert f"{want.mcnemar_p:.3g}" in page
    flips = page.split('id="flips"')[1].split("</table>")[0]
    assert flips.count("<tr>") - 1 == want.a_only + want.b_only
    # a run against itself: every pair agrees
    same = await _get(client, f"/compare?run={RUN_A}&run_b={RUN_A}")
    assert "No flips" in same and "+0.0 points" in same


async def test_stored_html_is_shown_as_text(client: TestClient) -> None:
    for url in ("/", f"/run/{RUN_EVIL}", f"/run/{RUN_EVIL}?status=failed"):
        page = await _get(client, url)
        assert "<script>alert" not in page and "<img src=x" not in page and "--<b>" not in page
        assert "<svg onload" not in page
    page = await _get(client, f"/run/{RUN_EVIL}")
    assert "&lt;script&gt;alert(&#x27;q&#x27;)&lt;/script&gt;" in page
    rid = re.search(r"/sample/([0-9a-f]+)", page).group(1)
    sample = await _get(client, f"/run/{RUN_EVIL}/sample/{rid}")
    assert "<script>alert" not in sample and "&lt;svg onload=alert(2)&gt;" in sample


async def test_sql_in_filters_and_paths_is_only_data(client: TestClient, seeded: Store) -> None:
    before = seeded.count("verification_results")
    page = await _get(client, f"/run/{RUN_A}", params={"model": "x' OR 1=1 --"})
    assert _count(page) == 0
    page = await _get(client, f"/run/{RUN_A}", params={"q": "%' OR '1'='1"})
    assert _count(page) == 0
    await _get(client, "/run/x' OR '1'='1", status=404)
    await _get(client, f"/run/{RUN_A}/sample/' UNION SELECT result_json FROM verification_results --", status=404)
    page = await _get(client, f"/run/{RUN_EVIL}", params={"model": EVIL_MODEL})
    assert _count(page) == 1  # the hostile model name is matched as a value, not run as SQL
    await _get(client, "/", params={"q": "'; DROP TABLE runs; --"})
    assert seeded.count("verification_results") == before


async def test_bad_parameters_are_refused_by_name(client: TestClient) -> None:
    assert "&#x27;status&#x27;" in await _get(client, f"/run/{RUN_A}?status=all", status=400)
    assert "&#x27;page&#x27;" in await _get(client, f"/run/{RUN_A}?page=-1", status=400)
    assert "longer than" in await _get(client, f"/run/{RUN_A}?q={'x' * 600}", status=400)
    assert "no run with id or name" in await _get(client, "/run/nope", status=404)


async def test_static_files_only_from_the_package_list(client: TestClient) -> None:
    css = await _get(client, "/static/view.css")
    assert "font-family" in css
    js = await client.get("/static/view.js")
    assert js.status == 200 and js.headers["Content-Type"].startswith("application/javascript")
    for path in ("/static/..%2fserver.py", "/static/%2e%2e%2f%2e%2e%2fconfig.py", "/static/__init__.py",
                 "/static/../server.py"):
        resp = await client.get(path)
        body = await resp.text()
        assert resp.status == 404 and "import" not in body, path


async def test_pages_load_nothing_from_elsewhere_and_send_a_csp(client: TestClient) -> None:
    for url in ("/", f"/run/{RUN_A}", "/compare", f"/compare?run={RUN_A}&a=model-a&b=model-b"):
        resp = await client.get(url)
        page = await resp.text()
        assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
        refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)""", page)
        assert refs and all(r.startswith(("/", "#")) for r in refs), [r for r in refs if not r.startswith("/")]


async def test_a_foreign_host_header_is_refused(seeded: Store) -> None:
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example."""
    app = build_app(Recording(seeded), allowed_hosts={"localhost:1"})
    async with TestClient(TestServer(app)) as c:
        resp = await c.get("/", headers={"Host": "evil.example:8765"})
        assert resp.status == 421 and "evil.example" in await resp.text()
        resp = await c.get("/", headers={"Host": "localhost:1"})
        assert resp.status == 200


async def test_runs_page_lists_searches_and_serves_json(client: TestClient) -> None:
    page = await _get(client, "/")
    for run in (RUN_A, RUN_EVIL, RUN_BIG):
        assert run in page
    assert "grid-bench" in page and "model-a, model-b" in page  # benchmark and models from the run's config
    found = await _get(client, "/?q=evil0001")
    assert RUN_EVIL in found and RUN_A not in found and RUN_BIG not in found
    assert "No run matches" in await _get(client, "/?q=no-such-run-anywhere")
    resp = await client.get("/api/runs")
    data = await resp.json()
    by_id = {r["run_id"]: r for r in data["runs"]}
    grid = grid_results()
    verdicts = [r for r in grid if r.template.verify_result is not None]
    assert by_id[RUN_A]["done"] == len(grid) and by_id[RUN_A]["jobs"] == 36
    assert by_id[RUN_A]["verdicts"] == len(verdicts)
    assert by_id[RUN_A]["pass_rate"] == sum(1 for r in verdicts if r.template.verify_result) / len(verdicts)
    assert by_id[RUN_A]["state"] == "finished" and by_id[RUN_BIG]["state"] == "finished"


async def test_without_a_stack_the_viewer_reads_the_folder_and_lets_it_go(settings: Settings, seeded: Store,  # noqa: F811
                                                                          nats_server: NatsServer) -> None:
    """No projector (first no NATS at all, then a NATS server with nobody on the query subject):
    the viewer opens the chdb folder itself, refuses writes, and closes the folder when idle so a
    stack started later can take it."""
    for url in (settings.nats_url, nats_server.url):
        src = ViewSource(settings.model_copy(update={"nats_url": url}))
        try:
            res = await src.query("SELECT count() FROM verification_results FINAL WHERE run_id = {r:String}",
                                  {"r": RUN_A})
            assert res.rows[0][0] == len(grid_results())
            assert src._store is not None
            with pytest.raises(QueryError, match="refused"):
                await src.query("INSERT INTO runs (run_id) VALUES ('x')")
            deadline = asyncio.get_running_loop().time() + 60
            while src._store is not None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.5)
            assert src._store is None, "the chdb folder was not released after the idle time"
            assert (await src.query("SELECT 1")).rows == [(1,)]  # reopened on demand
            bus = await src.bus_status()
            assert bus is None or bus["consumers"] == []  # no stream yet on a bare server
        finally:
            await src.close()
        assert src._store is None


async def test_previous_and_next_walk_the_filtered_results_in_order(client: TestClient) -> None:
    page = await _get(client, f"/run/{RUN_A}?model=model-a&status=passed")
    listed = re.findall(r'/sample/([0-9a-f]+)\?model=model-a&amp;status=passed" class="sample-link"', page)
    assert len(listed) == _count(page) > 2
    walked, url = [], f"/run/{RUN_A}/sample/{listed[0]}?model=model-a&status=passed"
    while url:
        sample = await _get(client, url)
        walked.append(url.split("/sample/")[1].split("?")[0])
        nxt = re.search(r'<a href="([^"]+)" class="next">', sample)
        url = nxt.group(1).replace("&amp;", "&") if nxt else ""
        assert len(walked) <= len(listed)
    assert walked == listed
    last = await _get(client, f"/run/{RUN_A}/sample/{listed[-1]}?model=model-a&status=passed")
    assert 'class="next"' not in last and f'/sample/{listed[-2]}?model=model-a&amp;status=passed" class="prev"' in last


async def test_run_page_shows_cost_total_per_model_and_per_stage(client: TestClient, seeded: Store) -> None:
    run = "20260101T000000-cost0001"
    rs = grid_results()
    for i, r in enumerate(rs):
        r.template.usage_metadata = {
            "answer_generation": {"input_tokens": 100, "output_tokens": 50, "model": r.metadata.answering.model_name,
                                  "model_calls": 1, "cached_replies": 0, "cost_usd": 0.002},
            "parsing": {"input_tokens": 80, "output_tokens": 20, "model": r.metadata.parsing.model_name,
                        "model_calls": 0 if i % 4 == 0 else 1, "cached_replies": 1 if i % 4 == 0 else 0,
                        "cost_usd": 0.0 if i % 4 == 0 else 0.001},
        }
    seeded.insert_results([result_to_row(r, run, version=1) for r in rs])
    page = await _get(client, f"/run/{run}")
    section = page.split("<h2 id='cost'>", 1)[1].split("<h2", 1)[0]
    # 36 x 0.002 + 27 x 0.001 = 0.099; 36 + 27 calls, 9 cached
    assert "Total cost: <b>$0.099000</b> · 63 model calls · 9 cached replies" in section
    by_model = dict(re.findall(r"<tr><td>([^<]+)</td><td>(\d\.\d{6})</td></tr>",
                               section.split('id="cost-by-model"', 1)[1].split("</table>", 1)[0]))
    assert by_model["model-a"] == by_model["model-b"] == "0.036000"
    assert abs(float(by_model["judge-1"]) + float(by_model["judge-2"]) - 0.027) < 1e-9
    stages = section.split('id="cost-by-stage"', 1)[1].split("</table>", 1)[0]
    assert "<td>model-a</td><td>answer_generation</td><td>18</td><td>0.036000</td>" in stages
    # a filter narrows the cost too
    page = await _get(client, f"/run/{run}?model=model-a")
    mine = sum(e["cost_usd"] for r in rs if r.metadata.answering.model_name == "model-a"
               for e in r.template.usage_metadata.values())
    assert f"Total cost: <b>${mine:,.6f}</b>" in page.split("<h2 id='cost'>", 1)[1] and mine < 0.099
    # a run without prices says so
    assert "id='no-cost'" in await _get(client, f"/run/{RUN_A}")


async def test_cost_total_counts_the_priced_calls_of_partly_priced_results(client: TestClient, seeded: Store) -> None:
    """A result with one call of an unknown price has no total cost of its own: the run's total
    still adds up its priced calls (as the HTML report and the console do), and says which
    model has no price, instead of leaving every such result out."""
    run = "20260101T000000-cost0002"
    rs = grid_results()
    for r in rs:
        answer = {"input_tokens": 100, "output_tokens": 50, "model": r.metadata.answering.model_name,
                  "model_calls": 1, "cached_replies": 0}
        if r.metadata.answering.model_name == "model-a":
            answer["cost_usd"] = 0.002  # model-b has no price
        r.template.usage_metadata = {
            "answer_generation": answer,
            "parsing": {"input_tokens": 80, "output_tokens": 20, "model": r.metadata.parsing.model_name,
                        "model_calls": 1, "cached_replies": 0, "cost_usd": 0.001},
        }
    seeded.insert_results([result_to_row(r, run, version=1) for r in rs])
    section = (await _get(client, f"/run/{run}")).split("<h2 id='cost'>", 1)[1].split("<h2", 1)[0]
    # 18 x 0.002 (model-a's answers) + 36 x 0.001 (every parse, model-b's results too) = 0.072
    assert "Total cost: <b>$0.072000</b> · 72 model calls" in section, section[:600]
    assert "unknown for model-b: no price" in section


async def test_empty_pages_say_why(client: TestClient) -> None:
    """A search that matches no run, a page of runs or results past the last one: each says so
    (and links back), never "No runs in the store." or a "showing 0–4,950" of a store that has them."""
    page = await _get(client, "/?q=no-such-run-anywhere")
    assert "No run matches &#x27;no-such-run-anywhere&#x27;" in page and "No runs in the store." not in page
    page = await _get(client, "/?page=500")
    assert "No runs on page 501" in page and "No runs in the store." not in page
    page = await _get(client, f"/run/{RUN_A}?model=model-a&page=99")
    count = page.split("id='samples-count'>", 1)[1].split("</p>", 1)[0]
    assert "page 100 is past the last one (1)" in count and "showing" not in count, count
    assert f"/run/{RUN_A}?model=model-a&amp;page=0#samples" in count
    page = await _get(client, f"/run/{RUN_BIG}?hpage=99")
    heat = page.split("<h2 id='heat'>", 1)[1].split("<h2", 1)[0]
    assert "500 questions · page 100 is past the last one (13)" in heat, heat[:400]
    # a filtered page says its totals are the whole run's (they are not filtered)
    assert "the run's totals just below and the stage latency are for the whole run" in \
        await _get(client, f"/run/{RUN_A}?status=failed")


async def test_compare_names_a_model_the_run_does_not_have(client: TestClient) -> None:
    """As `veribus compare` refuses it: the model and the run's answering models, not "no paired
    verdicts"."""
    page = await _get(client, f"/compare?run={RUN_A}&a=model-a&b=no-such-model", status=400)
    assert "model B &#x27;no-such-model&#x27; is not an answering model of run" in page
    assert "litellm:model-a, litellm:model-b" in page and "No paired verdicts" not in page
    await _get(client, f"/compare?run={RUN_A}&a=model-a&b=litellm:model-b")  # a bare or shown name is known
