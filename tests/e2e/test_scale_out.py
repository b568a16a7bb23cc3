"""Scale-out (DESIGN invariant 6): replicas of a stage share one durable consumer — each job is
handled by exactly one of them, and both take work."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from bench.run import generated_benchmark
from shared.control import runner, stack
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, Settings, VerificationConfig
from shared.store.reads import run_query

pytestmark = pytest.mark.e2e


def test_replicas_share_the_work(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    state = stack.up(settings, replicas={"parsing": 2, "generation": 2},
                     simulator_args=["--latency-ms", "30"])
    settings.nats_url = state.nats_url
    try:
        bench_file, script = generated_benchmark(tmp_path / "b.yaml", 80)
        httpx.post(state.simulator_url.removesuffix("/v1") + "/simulator/script", json=script, timeout=10)
        models = {"api_base": state.simulator_url, "max_concurrency": 8}
        config = VerificationConfig(answering_models=[ModelConfig(model_name="openai/a", **models)],
                                    parsing_models=[ModelConfig(model_name="openai/j", **models)])
        plan = runner.plan_run(Benchmark.load(bench_file), config)
        asyncio.run(runner.submit(settings, plan))
        outcome = asyncio.run(runner.collect(settings, plan.run_id, set(plan.result_ids), timeout=180))
        assert not outcome.timed_out and len(outcome.results) == 80
        # 90% of the generated answers are right (every tenth is scripted wrong)
        assert sum(1 for r in outcome.results.values() if r.template.verify_result) == 72

        def producers(event_type: str) -> dict[str, int]:
            for _ in range(300):
                rows = run_query(settings, "SELECT producer, count() FROM events FINAL WHERE run_id = {r:String} "
                                           "AND event_type = {t:String} GROUP BY producer", {"r": plan.run_id,
                                                                                           "t": event_type}).rows
                if sum(n for _, n in rows) >= 80:
                    return dict(rows)
                time.sleep(0.2)
            raise AssertionError(f"projector did not catch up on {event_type}")

        parsed_by = producers("template.parsed")
        assert len(parsed_by) == 2, parsed_by  # both parsing replicas took work ...
        assert sum(parsed_by.values()) == 80   # ... and each job was parsed exactly once
        finalized_by = producers("result.finalized")  # polls until the projector has them all
        assert sum(finalized_by.values()) == 80
        unique = run_query(settings, "SELECT uniqExact(result_id) FROM events FINAL WHERE run_id = {r:String} "
                                     "AND event_type = 'result.finalized'", {"r": plan.run_id}).rows[0][0]
        assert unique == 80
    finally:
        stack.down(settings)
