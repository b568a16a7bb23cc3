"""Planning a run: job fan-out, shared answers, stable ids, refusal of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.control.runner import RunInputError, RunOutcome, plan_run
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, VerificationConfig
from tests.conftest import CHECKPOINTS, EXAMPLE
from tests.support.results import make


def config(**kw: object) -> VerificationConfig:
    base = {
        "answering_models": [ModelConfig(model_name="openai/a1"), ModelConfig(model_name="openai/a2")],
        "parsing_models": [ModelConfig(model_name="openai/j1"), ModelConfig(model_name="openai/j2")],
    }
    base.update(kw)
    return VerificationConfig(**base)  # type: ignore[arg-type]


def test_fan_out_and_shared_answers() -> None:
    bench = Benchmark.load(CHECKPOINTS / "multi_question.jsonld")  # 4 finished + 1 unfinished
    plan = plan_run(bench, config(replicate_count=3))
    assert plan.job_count == 4 * 2 * 2 * 3
    assert len(plan.requests) == 4 * 2 * 3  # one answer per question x answering model x replicate
    assert all(len(r.jobs) == 2 for r in plan.requests)  # ... parsed by both judges
    assert len(set(plan.result_ids)) == plan.job_count
    assert plan.unfinished == ["urn:karenina:test:mq005"]
    assert plan.run_event.job_count == plan.job_count and plan.run_event.unfinished_skipped == plan.unfinished
    replicates = {j.replicate for r in plan.requests for j in r.jobs}
    assert replicates == {1, 2, 3}


def test_ids_are_stable_for_the_same_submission_time() -> None:
    bench = Benchmark.load(CHECKPOINTS / "multi_question.jsonld")
    a = plan_run(bench, config(), run_id="r1", timestamp="2026-01-01T00:00:00+00:00")
    b = plan_run(bench, config(), run_id="r1", timestamp="2026-01-01T00:00:00+00:00")
    c = plan_run(bench, config(), run_id="r2", timestamp="2026-01-02T00:00:00+00:00")
    assert a.result_ids == b.result_ids
    assert not set(a.result_ids) & set(c.result_ids)


def test_only_result_ids_selects_jobs() -> None:
    bench = Benchmark.load(CHECKPOINTS / "multi_question.jsonld")
    full = plan_run(bench, config(), run_id="r1", timestamp="t")
    keep = set(full.result_ids[:3])
    part = plan_run(bench, config(), run_id="r1", timestamp="t", only_result_ids=keep)
    assert set(part.result_ids) == keep


def test_include_unfinished() -> None:
    bench = Benchmark.load(CHECKPOINTS / "minimal.jsonld")  # its only question has no `finished` flag
    cfg = config(answering_models=[ModelConfig(model_name="openai/a")], parsing_models=[ModelConfig(model_name="openai/j")])
    assert plan_run(bench, cfg).job_count == 0
    plan = plan_run(bench, cfg, include_unfinished=True)
    assert plan.job_count == 1 and plan.unfinished == []


def test_template_that_does_not_compile_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("name: b\nquestions:\n  - id: good\n    question: Q1?\n    answer: a\n"
                    "    template: |\n      x = 1\n")
    bench = Benchmark.load(path)
    bench.questions[0].template_code = "class Answer(:\n    pass\n"
    with pytest.raises(RunInputError, match=r"question 'good'.*does not compile"):
        plan_run(bench, config())


def test_rubric_mode_needs_traits() -> None:
    bench = Benchmark.load(CHECKPOINTS / "minimal.jsonld")
    with pytest.raises(RunInputError, match="needs rubric traits"):
        plan_run(bench, config(evaluation_mode="rubric_only"), include_unfinished=True)


def test_modes_carry_the_right_inputs() -> None:
    bench = Benchmark.load(EXAMPLE)
    t_only = plan_run(bench, config(evaluation_mode="template_only"))
    assert all(j.rubric is None and j.template_code for r in t_only.requests for j in r.jobs)
    r_only = plan_run(bench, config(evaluation_mode="rubric_only"))
    assert all(j.template_code is None and j.template_id == "no_template" and j.rubric
               for r in r_only.requests for j in r.jobs)
    both = plan_run(bench, config(evaluation_mode="template_and_rubric"))
    salt = [j for r in both.requests for j in r.jobs if j.question_id == "ex-chem-salt"][0]
    names = {t["name"] for t in salt.rubric["traits"]}
    assert "NamesTheCompound" in names and "Clarity" in names  # question-specific + global traits


def test_config_requires_models() -> None:
    with pytest.raises(ValueError, match="answering_models"):
        VerificationConfig(parsing_models=[ModelConfig(model_name="j")])


def test_a_run_outcome_repr_is_a_summary_not_every_result() -> None:
    """`asyncio.run` formats its finished task's repr, result included (Python 3.11, restoring the
    SIGINT handler): the outcome of `collect` must not format every result there."""
    results = {f"r{i}": make(f"q{i}", "gpt-4o", i % 2 == 0) for i in range(500)}
    dead = [events.DeadLetter(subject="vb.x", consumer="c", error="e", deliveries=1, data="d")]
    text = repr(RunOutcome(results, dead, 12.5))
    assert text == "RunOutcome(500 results, 1 dead letters, elapsed_s=12.500, timed_out=False)"


def test_a_run_plan_repr_is_a_summary_not_every_job() -> None:
    plan = plan_run(Benchmark.load(CHECKPOINTS / "multi_question.jsonld"), config())
    assert repr(plan) == f"RunPlan({plan.run_id!r}, 8 requests, 16 jobs, 1 unfinished)"


def test_a_template_that_defines_no_answer_class_is_refused_before_publishing(tmp_path: Path) -> None:
    """`x = 1` compiles, and it was published: every answering model was called, then each job
    failed in validation ('no class named Answer'). Code that never names Answer defines neither
    an Answer nor a BaseAnswer subclass, and that is seen without running it."""
    path = tmp_path / "b.yaml"
    path.write_text("name: b\nquestions:\n  - id: noclass\n    question: Q1?\n    answer: a\n"
                    "    template: |\n      x = 1\n")
    with pytest.raises(RunInputError, match=r"question 'noclass' .*template: it defines no answer class: a template "
                                            r"needs `class Answer\(BaseAnswer\)`"):
        plan_run(Benchmark.load(path), config())
    bench = Benchmark.load(path)  # without verify(): every job failed in validation after its model call
    bench.questions[0].template_code = "class Answer(BaseAnswer):\n    value: int = 0\n"
    with pytest.raises(RunInputError, match=r"question 'noclass' .*template: its answer class has no verify\(\) "
                                            r"method: a template needs `def verify\(self\) -> bool`"):
        plan_run(bench, config())
    # a BaseAnswer subclass of another name is the sandbox's to accept
    bench.questions[0].template_code = "class Reply(BaseAnswer):\n    value: int = 0\n    def verify(self):\n" \
                                       "        return True\n"
    assert plan_run(bench, config()).job_count == 4
