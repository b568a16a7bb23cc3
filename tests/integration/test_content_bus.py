"""Job contents on a real nats-server: `lean_requests` stores them once and publishes thin jobs;
a fresh store (another process) fills them back from the bucket; missing content is named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.msg import Msg
from nats.js.errors import InvalidKeyError

from shared.control import runner
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, VerificationConfig
from shared.runtime import content
from tests.support.stack import generated_benchmark


def _plan(tmp_path: Path, n: int, prefix: str, **config: Any) -> runner.RunPlan:
    """A run of `n` generated questions for one answering model and one judge."""
    path, _ = generated_benchmark(tmp_path / "b.yaml", n, prefix=prefix)
    cfg = VerificationConfig(answering_models=[ModelConfig(model_name="openai/a")],
                             parsing_models=[ModelConfig(model_name="openai/j")], **config)
    return runner.plan_run(Benchmark.load(path), cfg)

async def test_store_once_fill_elsewhere(nats_server, tmp_path: Path) -> None:  # noqa: ANN001
    plan = _plan(tmp_path, 4, "Lean", replicate_count=3)
    nc = await nats.connect(nats_server.url)
    try:
        writer = content.ContentStore(lambda: nc.jetstream())
        thin = await content.lean_requests(writer, plan.requests)
        kv = await nc.jetstream().key_value(content.BUCKET)
        assert (await kv.status()).values == 4 + 1 + 1  # 4 questions, one options set, one judge
        reader = content.ContentStore(lambda: nc.jetstream())
        for fat, lean in zip(plan.requests, thin, strict=True):
            assert lean.jobs[0].question_text == ""
            # over the wire as submit publishes it and a service reads it (ids from the envelope)
            env = events.make_envelope(events.ANSWER_REQUESTED, plan.run_id, fat.jobs[0].answer_id, lean, "cli/test")
            got = events.payload_as(events.decode(events.wire(env), env.subject), events.AnswerRequested)
            filled = await reader.hydrate(got.jobs[0])
            assert (filled.run_id, filled.answer_id, filled.question_id) == (
                fat.jobs[0].run_id, fat.jobs[0].answer_id, fat.jobs[0].question_id)
            assert filled.question_text == fat.jobs[0].question_text
            assert filled.template_code == fat.jobs[0].template_code and filled.options == fat.jobs[0].options
        assert reader.reads == 6  # each content read once, then cached
        missing = thin[0].jobs[0].__class__(**{**{f: getattr(thin[0].jobs[0], f)
                                                   for f in thin[0].jobs[0].__struct_fields__},
                                                "refs": {"q": "c_" + "0" * 40}})
        with pytest.raises(content.ContentMissing, match="c_0000"):
            await reader.hydrate(missing)
    finally:
        await nc.close()


async def test_direct_reads_ask_the_leader_on_a_miss(nats_server, tmp_path: Path) -> None:  # noqa: ANN001
    """The bucket answers direct gets; a direct get answered "not found" by a replica that has not
    applied the write yet (simulated: the direct read misses) is asked again of the leader."""
    plan = _plan(tmp_path, 2, "Direct")
    nc = await nats.connect(nats_server.url)
    try:
        thin = await content.lean_requests(content.ContentStore(lambda: nc.jetstream()), plan.requests)
        reader = content.ContentStore(lambda: nc.jetstream())
        kv = await reader._bucket()
        assert kv._direct  # created with allow_direct: reads skip the JSON API
        fat = plan.requests[0].jobs[0]  # over the wire, as a service reads it (ids from the envelope)
        env = events.make_envelope(events.ANSWER_REQUESTED, plan.run_id, fat.answer_id, thin[0], "cli/test")
        job = events.payload_as(events.decode(events.wire(env), env.subject), events.AnswerRequested).jobs[0]
        assert (await kv.get(job.refs["q"])).value  # a direct get answers

        async def lagging_replica(kv: object, key: str) -> Msg:
            return Msg(nc, subject="", data=b"", headers={"Status": "404", "Description": "Message Not Found"})

        reader._replica_reply = lagging_replica  # type: ignore[method-assign]
        filled = await reader.hydrate(job)
        assert filled.question_text == plan.requests[0].jobs[0].question_text
        with pytest.raises(content.ContentMissing):  # a key the leader lacks too is still missing
            await reader.get("c_" + "1" * 40)
    finally:
        await nc.close()


async def test_direct_read_refuses_a_key_that_is_not_a_key(nats_server) -> None:  # noqa: ANN001
    """A forged ref (from an event) is never spliced into a request subject: a wildcard or a space
    would read another subject or break the protocol line."""
    nc = await nats.connect(nats_server.url)
    try:
        reader = content.ContentStore(lambda: nc.jetstream())
        for bad in ("c_x.>", "c_x *", "c_x\r\nPUB a 1", ".c_x", "c_x."):
            with pytest.raises(InvalidKeyError):
                await reader.get(bad)
        assert nc.is_connected
    finally:
        await nc.close()


async def test_a_stage_without_use_for_the_question_does_not_read_it(nats_server, tmp_path: Path) -> None:  # noqa: ANN001
    """`hydrate_payload(needs_question=...)`: options and models are filled in first; when the
    stage says it does not need the question, its content is not read and the job keeps the
    reference (downstream stages fill it in); otherwise everything is filled as before."""
    plan = _plan(tmp_path, 2, "Lazy")
    nc = await nats.connect(nats_server.url)
    try:
        thin = await content.lean_requests(content.ContentStore(lambda: nc.jetstream()), plan.requests)
        fat = plan.requests[0].jobs[0]
        lean_job = msgspec.structs.replace(thin[0].jobs[0], run_id=fat.run_id, answer_id=fat.answer_id,
                                           result_id=fat.result_id)  # the ids an envelope gives it
        asked: list[dict[str, object]] = []

        def never(job: events.Job) -> bool:
            asked.append(job.options)
            return False

        reader = content.ContentStore(lambda: nc.jetstream())
        ev = events.StageEvent(lean_job, events.State())
        out = await reader.hydrate_payload(ev, never)
        assert asked == [fat.options], "asked with the run's options filled in"
        assert out.job.question_text == "" and out.job.template_code is None and out.job.refs == lean_job.refs
        assert out.job.answering == fat.answering and out.job.parsing == fat.parsing
        assert reader.reads == 2 and lean_job.refs["q"] not in reader.cache
        again = await reader.hydrate_payload(events.StageEvent(lean_job, events.State()), lambda job: True)
        assert again.job.question_text == fat.question_text and again.job.template_code == fat.template_code
        assert reader.reads == 3
    finally:
        await nc.close()


async def test_a_content_changed_in_the_bucket_is_not_used(nats_server, tmp_path: Path) -> None:  # noqa: ANN001
    """Whoever may write the content bucket (the `cli` role submits contents) put another
    template under a key another run's jobs refer to: a service that had not read it yet took
    `verify()` from the attacker. A key is its content's hash, so a changed value is missing."""
    plan = _plan(tmp_path, 2, "Poison")
    nc = await nats.connect(nats_server.url)
    try:
        thin = await content.lean_requests(content.ContentStore(lambda: nc.jetstream()), plan.requests)
        fat = plan.requests[0].jobs[0]
        env = events.make_envelope(events.ANSWER_REQUESTED, plan.run_id, fat.answer_id, thin[0], "cli/test")
        job = events.payload_as(events.decode(events.wire(env), env.subject), events.AnswerRequested).jobs[0]
        key = job.refs["q"]
        stored = msgspec.json.decode((await (await nc.jetstream().key_value(content.BUCKET)).get(key)).value)
        forged = {**stored, "template_code": stored["template_code"].replace("def verify(self)", "def verify(self):\n"
                                                                            "        return True\n    def _was(self)")}
        assert forged["template_code"] != stored["template_code"]
        await nc.jetstream().publish(f"$KV.{content.BUCKET}.{key}", msgspec.json.encode(forged))  # as an attacker
        reader = content.ContentStore(lambda: nc.jetstream())  # a service that has not read it yet
        with pytest.raises(content.ContentMissing, match="changed"):  # before: the job had the forged verify()
            await reader.hydrate(job)
    finally:
        await nc.close()
