"""The zero-overhead pipeline the bench reads its whole-run fraction against (`bench.ideal`), and
the simulator's record of the latencies it drew (what the bench replays through it)."""

from __future__ import annotations

import random

import pytest
from aiohttp.test_utils import TestClient, TestServer

from bench.ideal import (
    first_copies,
    hedged_fraction,
    hedged_makespan,
    hedged_replay_fraction,
    makespan,
    replay_fraction,
    zero_overhead_fraction,
)
from infra.simulator.script import SimConfig
from infra.simulator.server import SIMULATOR, create_app

pytestmark = pytest.mark.unit


def test_fixed_latency_makespan_is_whole_rounds_plus_the_parse_models_first_call() -> None:
    # 64 results on 32 slots per model: two rounds of answers (0.6 s), the last parse 0.3 s later
    assert makespan(64, 0.3, 64, "fixed", 0.0, random.Random(0)) == pytest.approx(0.9)
    # one slot per model: answers end at 1, 2, 3; parses at 2, 3, 4
    assert makespan(3, 1.0, 2, "fixed", 0.0, random.Random(0)) == pytest.approx(4.0)


def test_replay_puts_each_parse_after_its_answer_on_the_judges_slots() -> None:
    # one slot each: answers end at 1, 3 (1 + 2); parse 0 runs 1..4, parse 1 waits for the slot: 4..5
    assert replay_fraction([1.0, 2.0], [3.0, 1.0], concurrency=2, latency_ms=1000) == pytest.approx(2 / 5 / 1.0)


def test_one_slow_last_call_costs_the_whole_run_what_no_pipeline_can_win_back() -> None:
    calm = [0.3] * 1000
    slow_tail = calm[:-1] + [2.5]
    assert replay_fraction(calm, calm, 64, 300) > 0.94
    assert replay_fraction(calm, slow_tail, 64, 300) < 0.80


def test_the_lognormal_tail_lowers_the_ceiling_more_the_shorter_the_run() -> None:
    short = zero_overhead_fraction(300, 300, 64, "lognormal", 0.5, trials=10)
    long = zero_overhead_fraction(5000, 300, 64, "lognormal", 0.5, trials=3)
    fixed = zero_overhead_fraction(1000, 300, 64, "fixed", trials=1)
    assert short is not None and long is not None and fixed is not None
    assert short < long < 1.0
    assert 0.9 < fixed < 1.0
    assert zero_overhead_fraction(1000, 0, 64) is None


def test_hedging_wins_back_part_of_the_drain_and_only_on_idle_slots() -> None:
    unhedged = hedged_fraction(1000, 300, 64, 1e6, trials=30)
    hedged = hedged_fraction(1000, 300, 64, 450, trials=30)
    assert unhedged is not None and hedged is not None
    assert unhedged[1] == 0.0, "a call never waits a thousand seconds: no copy"
    assert hedged[0] > unhedged[0] and 0 < hedged[1] < 0.03, "a few copies, in the drain"
    assert hedged[0] < 0.95, "the fill and the drain of two stages remain"
    # one slot per model: a running call holds the only slot, so no copy can ever be sent
    span, copies = hedged_makespan(50, 0.3, 2, 0.01, random.Random(1))
    assert copies == 0 and span > 50 * 0.3
    assert hedged_fraction(10, 0, 64, 450) is None


def test_one_limit_for_both_models_lends_the_idle_models_slots_and_splits_them_when_both_wait() -> None:
    # 64 results, C = 64, 0.3 s each: C/2 per model needs two rounds of answers and a parse round
    # after them (0.9 s); one shared limit puts all 64 answers out at once, then all 64 parses
    assert hedged_makespan(64, 0.3, 64, None, random.Random(0), sigma=0.0)[0] == pytest.approx(0.9)
    assert hedged_makespan(64, 0.3, 64, None, random.Random(0), sigma=0.0, shared=True)[0] == pytest.approx(0.6)
    # C = 2, 1 s calls: answers 0, 1 take both slots (0..1); then each model gets one while both
    # wait (parse 0 and answer 2, 1..2; parse 1 and answer 3, 2..3); parses 2, 3 take both (3..4).
    # One slot per model: answers end at 1..4, their parses at 2..5
    assert hedged_makespan(4, 1.0, 2, None, random.Random(0), sigma=0.0, shared=True)[0] == pytest.approx(4.0)
    assert hedged_makespan(4, 1.0, 2, None, random.Random(0), sigma=0.0)[0] == pytest.approx(5.0)
    # the replay with the run's own draws: the slow last parse still bounds it, the fill does not
    calm, slow_tail = [0.3] * 1000, [0.3] * 999 + [2.5]
    assert replay_fraction(calm, calm, 64, 300, shared=True) > replay_fraction(calm, calm, 64, 300)
    assert replay_fraction(calm, slow_tail, 64, 300, shared=True) < 0.80
    shared = hedged_fraction(1000, 300, 64, None, trials=20, shared=True)
    per_model = hedged_fraction(1000, 300, 64, None, trials=20)
    assert shared is not None and per_model is not None and shared[0] > per_model[0]


async def test_the_simulator_lists_each_calls_drawn_latency_in_call_order() -> None:
    app = create_app(config=SimConfig(latency_ms=5, latency_dist="lognormal", latency_sigma=0.5))
    async with TestClient(TestServer(app)) as client:
        for i in range(3):
            body = {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}]}
            assert (await client.post("/v1/chat/completions", json=body)).status == 200
        # the first question again, as a hedge's copy sends it: drawn afresh, under the same key
        body = {"model": "m", "messages": [{"role": "user", "content": "question 0"}]}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
        drawn = await (await client.get("/simulator/delays")).json()
        assert [kind for kind, _, _, _ in drawn] == ["answer"] * 4
        assert all(ms > 0 for _, ms, _, _ in drawn) and len({ms for _, ms, _, _ in drawn}) == 4
        keys = [key for _, _, key, _ in drawn]
        assert len(set(keys[:3])) == 3 and keys[3] == keys[0]
        arrived = [at for _, _, _, at in drawn]  # on the monotonic clock, in call order
        assert arrived == sorted(arrived) and 0 < arrived[-1] - arrived[0] < 60
        answers, judges, repeats = first_copies([tuple(d) for d in drawn])
        assert answers == [ms / 1000 for _, ms, _, _ in drawn[:3]] and judges == [] and repeats == 1
        assert await (await client.get("/simulator/delays", params={"since": 2})).json() == drawn[2:]
        await client.post("/simulator/reset")
        assert await (await client.get("/simulator/delays")).json() == []


def test_first_copies_keep_each_requests_first_draw_in_call_order() -> None:
    drawn = [("answer", 100.0, "a1"), ("answer", 200.0, "a2"), ("judge", 300.0, "j1"),
             ("answer", 50.0, "a1"), ("judge", 400.0, "j2"), ("judge", 10.0, "j1")]
    assert first_copies(drawn) == ([0.1, 0.2], [0.3, 0.4], 2)


def test_the_hedged_replay_races_the_runs_own_slow_call() -> None:
    """One run's draws with a 2.5 s parse near the end (as the bench's seed gives): unhedged, the
    run waits for it; hedged after 450 ms its copy is drawn afresh and the replay ends sooner,
    and a replay without that slow call is not slowed by hedging at all."""
    calm = [0.3] * 1000
    slow_tail = calm[:980] + [2.5] + calm[981:]
    unhedged = replay_fraction(calm, slow_tail, 64, 300)
    hedged = hedged_replay_fraction(calm, slow_tail, 64, 300, 450, trials=10)
    assert unhedged is not None and hedged is not None
    assert unhedged < 0.85 < hedged
    calm_hedged = hedged_replay_fraction(calm, calm, 64, 300, 450, trials=3)
    assert calm_hedged == pytest.approx(replay_fraction(calm, calm, 64, 300), abs=0.002)
    assert hedged_replay_fraction([], [], 64, 300, 450) is None


async def test_the_simulators_latency_runs_from_the_requests_arrival() -> None:
    """Reading and matching a request in the simulator is part of the drawn latency, as a
    provider's own processing is, not added to it (its clock moves 20 ms at each look)."""
    clock = [1000.0]
    slept: list[float] = []

    def ticking() -> float:
        clock[0] += 0.02
        return clock[0]

    async def sleep(s: float) -> None:
        slept.append(s)

    app = create_app(config=SimConfig(latency_ms=300, latency_dist="fixed"))
    app[SIMULATOR].clock, app[SIMULATOR].sleep = ticking, sleep
    async with TestClient(TestServer(app)) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "question"}]}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
        drawn = await (await client.get("/simulator/delays")).json()
    assert [(ms, at) for _, ms, _, at in drawn] == [(300.0, 1000.02)]
    assert slept == [pytest.approx(0.3 - 0.02)]  # the wait, less the time already spent here
