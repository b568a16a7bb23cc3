"""The lean log's job contents: stored once by hash, stripped from the wire, filled back in."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from shared.control import runner
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, VerificationConfig
from shared.runtime import content
from tests.support.stack import generated_benchmark


def _jobs(tmp_path: Path, n: int = 3) -> list[events.Job]:
    path, _ = generated_benchmark(tmp_path / "b.yaml", n, prefix="Lean")
    m = {"api_base": "http://127.0.0.1:1/v1", "max_concurrency": 4}
    cfg = VerificationConfig(answering_models=[ModelConfig(model_name="openai/a", **m)],
                             parsing_models=[ModelConfig(model_name="openai/j", **m), ModelConfig(model_name="openai/k")],
                             evaluation_mode="template_and_rubric", replicate_count=2)
    plan = runner.plan_run(Benchmark.load(path), cfg)
    return [j for r in plan.requests for j in r.jobs]


def _with_refs(job: events.Job, known: dict) -> events.Job:
    refs = {}
    for kind, (key, data) in content.blobs_of(job).items():
        refs[kind] = key
        known[key] = msgspec.json.decode(data)
    return msgspec.structs.replace(job, refs=refs)


def test_lean_then_fill_gives_back_the_same_job(tmp_path: Path) -> None:
    known: dict = {}
    for job in _jobs(tmp_path):
        full = _with_refs(job, known)
        thin = content.lean(full, known)
        assert thin.question_text == "" and thin.template_code is None and thin.rubric is None
        assert thin.options == {} and thin.answering.model_name == ""
        assert len(msgspec.json.encode(thin)) < len(msgspec.json.encode(full)) / 2
        assert content.fill(thin, known) == full


def test_contents_are_shared_by_judges_and_replicates(tmp_path: Path) -> None:
    keys = {kind: set() for kind in ("q", "o", "m")}
    jobs = _jobs(tmp_path, n=3)
    for job in jobs:
        for kind, (key, _) in content.blobs_of(job).items():
            keys[kind].add(key)
    assert len(jobs) == 3 * 2 * 2
    assert len(keys["q"]) == 3 and len(keys["o"]) == 1 and len(keys["m"]) == 2  # per question / run / judge


def test_a_changed_field_stays_inline(tmp_path: Path) -> None:
    known: dict = {}
    full = _with_refs(_jobs(tmp_path)[0], known)
    regraded = msgspec.structs.replace(full, template_code="class Answer: pass  # new")
    thin = content.lean(regraded, known)
    assert thin.template_code == "class Answer: pass  # new"  # not the stored one
    assert content.fill(thin, known).template_code == "class Answer: pass  # new"


def test_fill_without_the_content_fails_plainly(tmp_path: Path) -> None:
    known: dict = {}
    thin = content.lean(_with_refs(_jobs(tmp_path)[0], known), known)
    with pytest.raises(KeyError):
        content.fill(thin, {})


async def test_only_code_the_run_announced_shares_the_runs_sandbox_scope(tmp_path: Path) -> None:
    """`ContentStore.sandbox_scope`: the run's own jobs share its sandbox process (the run id and
    its code manifest); a job whose template, callable trait or template id the run's manifest
    does not list runs in a fresh process (None), as does a job without a manifest."""
    jobs = _jobs(tmp_path)
    store = content.ContentStore(lambda: None)
    key, data = content.code_manifest(jobs)
    store.cache[key] = msgspec.json.decode(data)  # as `put_manifest` leaves it (no bus here)
    assert len(store.cache[key]["code"]) == 3  # three templates, shared by judges and replicates

    def event(job: events.Job, **change: object) -> events.StageEvent:
        return events.StageEvent(msgspec.structs.replace(content.with_manifest(job, key), **change), events.State())

    own = [await store.sandbox_scope(event(j)) for j in jobs]
    assert set(own) == {f"{jobs[0].run_id}.{key}"}
    foreign = "from karenina.schemas.entities import BaseAnswer\nimport builtins\nbuiltins.abs = lambda x: 0\n"
    assert await store.sandbox_scope(event(jobs[0], template_code=foreign)) is None
    assert await store.sandbox_scope(event(jobs[0], template_code=foreign,
                                            template_id=jobs[0].template_id)) is None
    other = next(j for j in jobs if j.question_id != jobs[0].question_id)
    swapped = event(jobs[0], template_code=other.template_code)  # another of the run's templates, under this id
    assert swapped.job.template_id != other.template_id and await store.sandbox_scope(swapped) is None
    trait = {"traits": [{"type": "callable", "name": "t", "kind": "boolean", "callable_code": "def f(x): return 1"}]}
    assert await store.sandbox_scope(event(jobs[0], rubric=trait)) is None
    assert await store.sandbox_scope(events.StageEvent(jobs[0], events.State())) is None  # no manifest
    with_trait = msgspec.structs.replace(jobs[0], rubric=trait)
    key2, data2 = content.code_manifest([with_trait])
    store.cache[key2] = msgspec.json.decode(data2)
    ev = events.StageEvent(content.with_manifest(with_trait, key2), events.State())
    assert await store.sandbox_scope(ev) == f"{jobs[0].run_id}.{key2}"
