"""Issue 12, must-have 1: `max_concurrency` holds for the whole deployment. Three replicas of
generation and three of parsing (6 processes, 64 workers each) run against the simulator, which
records the peak number of calls in flight per model; it never exceeds the configured limit,
although every replica alone would be allowed that many."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.workload import expected_verdicts
from tests.support.stack import (
    generated_benchmark,
    plan_and_submit,
    results_of,
    start_stack,
    stop_stack,
    verdicts,
    wait_results,
)

pytestmark = pytest.mark.e2e

N = 60
LIMIT = 3


def test_three_replicas_never_exceed_the_model_limit(tmp_path: Path) -> None:
    st = start_stack(tmp_path / "home", simulator_args=["--latency-ms", "40", "--latency-dist", "uniform"],
                     replicas={"generation": 3, "parsing": 3})
    try:
        path, script = generated_benchmark(tmp_path / "bench.yaml", N, rubric=False, prefix="Limit")
        st.post_script(script)
        config = st.config(mode="template_only", answer_kw={"max_concurrency": LIMIT},
                           judge_kw={"max_concurrency": LIMIT})
        plan = plan_and_submit(st, path, config)
        wait_results(st, plan.run_id, N, timeout=240)
        assert verdicts(results_of(st, plan.run_id)) == expected_verdicts(N)
        stats = st.sim_stats()
        peaks = stats["max_in_flight_by_model"]
        assert set(peaks) == {"sim-answerer", "sim-judge"}, peaks
        for model, peak in peaks.items():
            assert peak <= LIMIT, f"{model}: {peak} calls in flight, limit {LIMIT}"
            assert peak >= 2, f"{model}: calls never overlapped ({peak}); the test shows nothing"
        assert stats["by_model"]["sim-answerer"] == N and stats["by_model"]["sim-judge"] == N
    finally:
        stop_stack(st)


def test_hedged_calls_stay_within_the_deployment_limit_and_are_counted(tmp_path: Path) -> None:
    """The same three plus three replicas with hedging on (`hedge_after_s`) against a long-tailed
    latency: a hedge takes a slot of the same deployment-wide limit, so the peak still never passes
    it; every verdict is the one expected; and every request the simulator received is in the
    results' `model_calls` (a copy cancelled before it was sent is counted too: never fewer)."""
    st = start_stack(tmp_path / "home", replicas={"generation": 3, "parsing": 3},
                     simulator_args=["--latency-ms", "40", "--latency-dist", "lognormal", "--latency-sigma", "1.5"])
    try:
        path, script = generated_benchmark(tmp_path / "bench.yaml", N, rubric=False, prefix="Hedge")
        st.post_script(script)
        hedged = {"max_concurrency": LIMIT, "hedge_after_s": 0.15}
        config = st.config(mode="template_only", answer_kw=hedged, judge_kw=hedged)
        plan = plan_and_submit(st, path, config)
        wait_results(st, plan.run_id, N, timeout=240)
        results = results_of(st, plan.run_id)
        assert verdicts(results) == expected_verdicts(N)
        stats = st.sim_stats()
        for model, peak in stats["max_in_flight_by_model"].items():
            assert peak <= LIMIT, f"{model}: {peak} calls in flight, limit {LIMIT}"
        hedges = sum(((r.metadata.retry_counts or {}).get("hedge") or {}).get("used", 0) for r in results.values())
        calls = sum(int(e.get("model_calls", 0)) for r in results.values() if r.template
                    for k, e in (r.template.usage_metadata or {}).items() if k != "total" and isinstance(e, dict))
        received = sum(stats["by_model"].values())
        assert calls == 2 * N + hedges
        assert 2 * N <= received <= calls
    finally:
        stop_stack(st)
