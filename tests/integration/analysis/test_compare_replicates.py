"""The viewer's compare page pairs a run of one replicate (its results carry no replicate) with
replicate 1 of a run of several, as `veribus compare` does (shared.analysis.stats.paired_replicate)."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from shared.cli.view import build_app, queries
from shared.cli.view.filters import Filters
from shared.store.engine import Store
from shared.store.rows import result_to_row
from tests.support.analysis_store import AsyncStoreSource
from tests.support.results import make

SINGLE = "20260422T100000-single01"
MULTI = "20260422T110000-multi001"



async def test_a_one_replicate_run_pairs_with_replicate_1(store: Store) -> None:
    single = [make(q, "gpt-x", q != "q2") for q in ("q1", "q2")]
    multi = [make(q, "gpt-x", rep != 2, replicate=rep) for q in ("q1", "q2") for rep in (1, 2, 3)]
    store.insert_results([result_to_row(r, SINGLE, version=1) for r in single])
    store.insert_results([result_to_row(r, MULTI, version=1) for r in multi])
    src = AsyncStoreSource(store)
    got = await queries.compare(src, queries.Side(SINGLE), queries.Side(MULTI), Filters())
    assert (got["pairs"], got["unpaired_a"], got["unpaired_b"]) == (2, 0, 4)
    assert (got["both_pass"], got["a_only"], got["b_only"], got["both_fail"]) == (1, 0, 1, 0)
    assert [(f["question_id"], f["replicate"]) for f in got["flips"]] == [("q2", 1)]
    async with TestClient(TestServer(build_app(src))) as c:
        resp = await c.get(f"/compare?run={SINGLE}&run_b={MULTI}")
        page = await resp.text()
    assert resp.status == 200 and "No paired verdicts" not in page and "2 (unpaired: A 0, B 4)" in page, page[-3000:]
