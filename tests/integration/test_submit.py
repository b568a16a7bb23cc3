"""`runner.submit` on a real nats-server: a run larger than one chunk is published whole, once,
in plan order, and every job's contents were stored before the job that refers to them."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest

from shared.control import runner
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, Settings, VerificationConfig
from shared.runtime import content
from shared.runtime.content import ContentStore
from tests.support.stack import generated_benchmark

pytestmark = pytest.mark.integration

N = 100  # chunks of 32, 64, then 4: three chunks


async def test_submit_in_chunks_publishes_every_request_after_its_contents(nats_server, tmp_path: Path) -> None:  # noqa: ANN001
    path, _ = generated_benchmark(tmp_path / "b.yaml", N, prefix="Chunked")
    cfg = VerificationConfig(answering_models=[ModelConfig(model_name="openai/a")],
                             parsing_models=[ModelConfig(model_name="openai/j")])
    plan = runner.plan_run(Benchmark.load(path), cfg)
    assert len(runner.submit_chunks(len(plan.requests))) == 3
    settings = Settings(home=tmp_path / "home", nats_url=nats_server.url)
    assert await runner.submit(settings, plan) == N

    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        got = []
        for seq in range(1, N + 2):
            msg = await js.get_msg(events.STREAM, seq)
            got.append(msg)
        assert got[0].subject == events.subject(events.RUN_REQUESTED, plan.run_id)
        published = [m.subject.rsplit(".", 1)[-1] for m in got[1:]]
        assert published == [r.jobs[0].answer_id for r in plan.requests], "every request once, in plan order"
        reader = ContentStore(lambda: js)
        kv = await reader._bucket()
        for m, fat in zip(got[1:], plan.requests, strict=True):
            job = events.payload_as(events.decode(m.data, m.subject), events.AnswerRequested).jobs[0]
            assert job.question_text == "" and job.refs, "published lean"
            for key in job.refs.values():
                stored = await js.get_msg(kv._stream, subject=kv._pre + key)
                assert stored.time <= m.time, f"content {key} stored after the job {m.subject} referring to it"
            filled = await reader.hydrate(job)
            assert filled.template_code == fat.jobs[0].template_code
        assert (await (await js.key_value(content.BUCKET)).status()).values == N + 3  # questions, options, judge, code
        assert await runner.submit(settings, plan) == 0, "a second submit is deduplicated, chunk by chunk"
    finally:
        await nc.close()


def test_submit_chunks_cover_every_request_once_small_first() -> None:
    for n in (0, 1, 31, 32, 33, 100, 5000):
        parts = runner.submit_chunks(n)
        covered = [i for p in parts for i in range(n)[p]]
        assert covered == list(range(n))
        sizes = [p.stop - p.start for p in parts]
        assert not sizes or sizes[0] == min(n, runner.SUBMIT_FIRST_CHUNK)
        assert all(s <= runner.SUBMIT_MAX_CHUNK for s in sizes)
        assert all(b == min(2 * a, runner.SUBMIT_MAX_CHUNK) for a, b in zip(sizes[:-2], sizes[1:-1], strict=True))
