"""Issue 10 (no bus): secret scrubbing, credentials bound to endpoints, wire limits at decode,
size limits at load. Each test plays the attacker's message or input and checks what comes out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import msgspec
import pytest
import yaml

from services.generation.stage import generate_answer
from shared.control.runner import RunInputError, plan_run
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.benchmark.question import BenchmarkError
from shared.core.config import ModelConfig, VerificationConfig
from shared.core.limits import (
    MAX_EVENT_BYTES,
    MAX_QUESTION_CHARS,
    MAX_REPLY_CHARS,
    MAX_TEMPLATE_CHARS,
    InvalidEvent,
)
from shared.core.scrub import REDACTED, ScrubFilter, scrub_bytes, scrub_text
from shared.core.stage import stage_error
from shared.runtime.endpoints import EndpointRefused, Policy, normalize_url
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import RETRYABLE, LLMError

PLANTED = "sk-planted-" + os.urandom(12).hex()
TEMPLATE = '''from karenina.schemas.entities import BaseAnswer
class Answer(BaseAnswer):
    value: int
    def verify(self) -> bool:
        return self.value == 4
'''


# ------------------------------------------------------------------------------- scrubbing


def test_planted_key_scrubbed_from_error_traceback_and_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """A template that read the key (e.g. from /proc/<ppid>/environ) and raised it, or returned
    it in a parsed field: neither the stage error nor the published payload holds it."""
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    try:
        raise RuntimeError(f"leaked environ: OPENAI_API_KEY={PLANTED}")
    except RuntimeError as exc:
        err = stage_error("verification", exc)
    assert PLANTED not in err.message and PLANTED not in err.traceback and REDACTED in err.message
    job_like = {"parsed": {"value": PLANTED, "quoted": f'he said "{PLANTED}"'}}
    env = events.make_envelope(events.TEMPLATE_VERIFIED, "run-1", "abcdef0123456789", job_like, "test")
    raw = events.encode(env)
    assert PLANTED.encode() not in raw
    assert json.loads(bytes(env.payload))["parsed"]["value"] == REDACTED  # still valid JSON


def test_scrub_json_escaped_and_patterns(monkeypatch: pytest.MonkeyPatch) -> None:
    tricky = 'pa"ss\\word-0123456789'
    monkeypatch.setenv("MY_DB_PASSWORD", tricky)
    encoded = msgspec.json.encode({"x": tricky})
    assert tricky.encode() not in scrub_bytes(encoded) and json.dumps(tricky)[1:-1].encode() not in scrub_bytes(encoded)
    # keys this process never had: shapes
    text = ("Authorization: Bearer abcdefghijklmnop1234 and sk-ant-api03-ABCDEFGHIJKLMNOPQRST and "
            "AKIAABCDEFGHIJKLMNOP and url?api_key=zzzzzzzzzz9 and ghp_abcdefghijklmnopqrstuvwxyz0123")
    out = scrub_text(text)
    for leaked in ("abcdefghijklmnop1234", "ABCDEFGHIJKLMNOPQRST", "AKIAABCDEFGHIJKLMNOP", "zzzzzzzzzz9", "ghp_abc"):
        assert leaked not in out
    assert scrub_text("the answer is 42, true") == "the answer is 42, true"  # ordinary text untouched


def test_log_records_are_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", PLANTED)
    record = logging.LogRecord("veribus.x", logging.ERROR, __file__, 1, "call failed: %s", (f"key {PLANTED}",), None)
    try:
        raise ValueError(PLANTED)
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    assert ScrubFilter().filter(record)
    formatted = logging.Formatter("%(message)s").format(record)
    assert PLANTED not in formatted and "call failed" in formatted and "ValueError" in formatted


# ----------------------------------------------------------------------- endpoint binding


def test_policy_binds_keys_to_endpoints() -> None:
    p = Policy.from_env({"VERIBUS_ENDPOINTS": "http://gpu-box:8000/v1/=VLLM_KEY, https://api.anthropic.com=MY_ANT"})
    # the provider's own key to the provider's own endpoint
    p.check("openai/gpt-4.1-mini", None, "OPENAI_API_KEY")
    p.check("openai/gpt-4.1-mini", "https://API.openai.com:443/v1/", "OPENAI_API_KEY")
    p.check("claude-haiku-4-5", None, "ANTHROPIC_API_KEY")
    # operator-listed pairs
    p.check("openai/qwen", "http://gpu-box:8000/v1", "VLLM_KEY")
    p.check("anthropic/claude-haiku-4-5", None, "MY_ANT")
    # no key variable: nothing secret leaves, any api_base
    p.check("openai/qwen", "http://127.0.0.1:9/v1", None)
    refused = [
        ("openai/gpt-4.1-mini", "http://127.0.0.1:4444/v1", "OPENAI_API_KEY"),  # the forged job
        ("openai/qwen", "http://gpu-box:8000/v1", "OPENAI_API_KEY"),  # a listed endpoint, another variable
        ("openai/gpt-4.1-mini", None, "ANTHROPIC_API_KEY"),  # another provider's key to OpenAI
        ("openai/qwen", "http://gpu-box:8001/v1", "VLLM_KEY"),  # another port
        ("mystery/model", None, "VLLM_KEY"),  # provider unknown: where would it go?
    ]
    for model, base, var in refused:
        with pytest.raises(EndpointRefused):
            p.check(model, base, var)
    for params in ({"base_url": "http://evil/v1"}, {"api_key": "x"}, {"extra_headers": {"a": "b"}}):
        with pytest.raises(EndpointRefused, match="re-route"):
            p.check("openai/gpt-4.1-mini", None, None, params)
    with pytest.raises(EndpointRefused, match="credentials in the URL"):
        normalize_url("http://user:pw@host/v1")


def test_policy_file(tmp_path: Path) -> None:
    f = tmp_path / "endpoints.yaml"
    f.write_text(yaml.safe_dump({"endpoints": [{"api_base": "http://10.0.0.5:8000/v1", "api_key_env": "LAB_KEY"}]}))
    p = Policy.from_env({"VERIBUS_ENDPOINTS_FILE": str(f)})
    p.check("openai/x", "http://10.0.0.5:8000/v1", "LAB_KEY")
    with pytest.raises(EndpointRefused):
        p.check("openai/x", "http://10.0.0.6:8000/v1", "LAB_KEY")


async def test_forged_job_sends_nothing_and_records_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forged answer.requested of the issue: api_base at the attacker's listener and the
    service's OPENAI_API_KEY. A real listener counts connections: none arrive; the job ends
    with an endpoint_refused error on its own state."""
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    monkeypatch.delenv("VERIBUS_ENDPOINTS", raising=False)
    hits: list[bytes] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append(await reader.read(4096))
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        spec = events.ModelSpec(model_name="openai/gpt-4.1-mini", api_base=f"http://127.0.0.1:{port}/v1",
                                api_key_env="OPENAI_API_KEY", max_retries=0, timeout=5)
        job = events.Job(run_id="r1", result_id="0123456789abcdef", answer_id="0123456789abcdef", question_id="q",
                         question_text="What is 2+2?", answering=spec, parsing=spec, timestamp="t")
        state = await generate_answer(job, LLMClient())
        await asyncio.sleep(0.2)
    finally:
        server.close()
        await server.wait_closed()
    assert hits == []
    assert state.error is not None and "endpoint_refused" in state.error.message
    assert PLANTED not in state.error.message and "OPENAI_API_KEY" in state.error.message
    with pytest.raises(LLMError) as ei:
        await LLMClient().complete(spec, [{"role": "user", "content": "x"}], stage="parsing")
    assert ei.value.kind == "endpoint_refused" and ei.value.kind not in RETRYABLE


# ------------------------------------------------------------------------ limits at decode


def _job(**kw: object) -> events.Job:
    spec = events.ModelSpec(model_name="m")
    base: dict[str, object] = dict(run_id="r1", result_id="0123456789abcdef", answer_id="0123456789abcdef",
                                   question_id="q", question_text="q?", answering=spec, parsing=spec, timestamp="t")
    base.update(kw)
    return events.Job(**base)  # type: ignore[arg-type]


def _wire(event_type: str, run_id: str, result_id: str, payload: object) -> tuple[bytes, str]:
    env = events.make_envelope(event_type, run_id, result_id, payload, "attacker")
    return events.encode(env), env.subject


def test_decode_refuses_forged_ids_and_sizes() -> None:
    long_id = "a" * 5000  # the 5,000-character result_id
    data, subject = _wire(events.ANSWER_REQUESTED, "r1", long_id, events.AnswerRequested(jobs=[_job()]))
    with pytest.raises(InvalidEvent, match="result_id"):
        events.decode(data)
    for bad_run in ("r.1", "r>", "r 1", ""):
        data, _ = _wire(events.ANSWER_REQUESTED, bad_run, "0123456789abcdef", events.AnswerRequested(jobs=[_job()]))
        with pytest.raises(InvalidEvent, match="run_id"):
            events.decode(data)
    # arrived on another subject than it names
    data, subject = _wire(events.ANSWER_REQUESTED, "r1", "0123456789abcdef", events.AnswerRequested(jobs=[_job()]))
    with pytest.raises(InvalidEvent, match="arrived on"):
        events.decode(data, subject.replace("r1", "r2"))
    env = events.decode(data, subject)
    # payload: a job of another run, an oversized question, a key variable that is not a name
    for job, match in ((_job(run_id="other"), "not the event's run"),
                       (_job(question_text="x" * (MAX_QUESTION_CHARS + 1)), "question_text"),
                       (_job(answer_id="fedcba9876543210"), "answer_id"),
                       (_job(answering=events.ModelSpec(model_name="m", api_key_env="A B;rm")), "api_key_env")):
        data, subject = _wire(events.ANSWER_REQUESTED, "r1", "0123456789abcdef", events.AnswerRequested(jobs=[job]))
        env = events.decode(data, subject)
        with pytest.raises(InvalidEvent, match=match):
            events.payload_as(env, events.AnswerRequested)


# ------------------------------------------------------------------------- limits at load


def _config(**kw: object) -> VerificationConfig:
    return VerificationConfig(answering_models=[ModelConfig(model_name="a")],
                              parsing_models=[ModelConfig(model_name="j")], **kw)  # type: ignore[arg-type]


# each field alone larger than a whole event may be (far over its own limit)
@pytest.mark.parametrize("field", ["question", "template", "answer"])
def test_oversized_benchmark_refused_at_load(tmp_path: Path, field: str) -> None:
    size = MAX_EVENT_BYTES + 100_000
    q = {"id": "big", "question": "What is 2+2?", "answer": "4", "template": TEMPLATE}
    q[field] = q[field] + "#" * size if field == "template" else "x" * size
    path = tmp_path / "bench.yaml"
    doc = {"name": "b", "questions": [q, {"id": "ok", "question": "1+1?", "answer": "2", "template": TEMPLATE}]}
    # libyaml's dumper when there is one: the pure-Python one takes seconds over megabytes
    path.write_text(yaml.dump(doc, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper)))
    with pytest.raises(BenchmarkError) as ei:
        Benchmark.load(path)
    assert "'big'" in str(ei.value) and field in str(ei.value) and "limit" in str(ei.value)


def test_plan_refuses_events_over_the_bus_limit() -> None:
    """Each field under its limit, but one answer request carries a job per judge: measured."""
    from shared.core.benchmark.question import Question

    q = Question(id="fat", text="q" * (MAX_QUESTION_CHARS - 10), raw_answer="4",
                 template_code=TEMPLATE + "#" * (MAX_TEMPLATE_CHARS - len(TEMPLATE) - 10))
    bench = Benchmark(name="b", questions=[q])
    judges = [ModelConfig(model_name=f"j{i}") for i in range(12)]
    cfg = VerificationConfig(answering_models=[ModelConfig(model_name="a")], parsing_models=judges)
    with pytest.raises(RunInputError, match="'fat'.*judge"):
        plan_run(bench, cfg)
    assert plan_run(bench, _config()).job_count == 1


def test_answering_models_not_a_model_is_a_clear_error(tmp_path: Path) -> None:
    import argparse

    from shared.cli.run import _load_config

    cfg = tmp_path / "run.yaml"
    cfg.write_text("answering_models: [42]\nparsing_models: [j]\n")
    args = argparse.Namespace(config=str(cfg), model=None, judge=None, api_base=None, replicates=None, mode=None,
                              run_name=None, strategy=None, simulate=False)
    with pytest.raises(ValueError, match=r"answering_models\[0\].*int"):
        _load_config(args, None)
    cfg.write_text("x: '" + "y" * 300_000 + "'\n")
    with pytest.raises(ValueError, match="over the limit"):
        _load_config(args, None)


async def test_long_reply_truncated_with_flag() -> None:
    spec = events.ModelSpec(model_name="m", interface="manual", manual_traces={"q": "z" * (MAX_REPLY_CHARS * 3)})
    job = _job(answering=spec)
    state = await generate_answer(job, LLMClient())
    assert state.error is None
    assert len(state.template["raw_llm_response"]) == MAX_REPLY_CHARS
    assert state.template["raw_llm_response_truncated"] is True
    assert state.template["raw_llm_response_chars"] == MAX_REPLY_CHARS * 3
    env = events.make_envelope(events.ANSWER_GENERATED, job.run_id, job.result_id,
                               events.StageEvent(job, state), "generation")
    decoded = events.decode(events.encode(env), env.subject)  # it publishes, and decodes downstream
    events.payload_as(decoded, events.StageEvent)


# ------------------------------------------------------------- dead letters -> a result


def _stage_event(job: events.Job) -> events.StageEvent:
    return events.StageEvent(job=job, state=events.State(template={"raw_llm_response": "4"}, started_at=1.0))


async def test_dead_letter_of_a_stuck_job_becomes_its_error_result() -> None:
    from services.finalization.stage import finalize_dead_letter

    job = _job()
    generated = events.subject(events.ANSWER_GENERATED, job.run_id, job.result_id)
    parsed = events.subject(events.TEMPLATE_PARSED, job.run_id, job.result_id)
    stream: dict[str, events.StageEvent] = {generated: _stage_event(job)}

    async def valid_on(subject: str) -> events.StageEvent | None:
        return stream.get(subject)

    async def not_finalized(rid: str) -> bool:
        return False

    dl = events.DeadLetter(subject=parsed, consumer="verification", error="InvalidEvent: payload is 2,000,000 bytes",
                           deliveries=1)
    result = await finalize_dead_letter(dl, job.run_id, job.result_id, valid_on, not_finalized)
    assert result is not None and result.metadata.result_id == job.result_id
    assert not result.metadata.completed_without_errors and "dead-lettered by verification" in result.metadata.error

    # a valid message on the dead-lettered subject carries the job on: a bad copy changes nothing
    stream[parsed] = _stage_event(job)
    assert await finalize_dead_letter(dl, job.run_id, job.result_id, valid_on, not_finalized) is None
    del stream[parsed]

    async def finalized(rid: str) -> bool:
        return True

    assert await finalize_dead_letter(dl, job.run_id, job.result_id, valid_on, finalized) is None
    # a job whose only message was unreadable cannot be known: nothing to finalize
    dl_req = events.DeadLetter(subject=events.subject(events.ANSWER_REQUESTED, job.run_id, "fedcba9876543210"),
                               consumer="generation", error="DecodeError", deliveries=1)
    assert await finalize_dead_letter(dl_req, job.run_id, "fedcba9876543210", valid_on, not_finalized) is None
    assert await finalize_dead_letter(dl, "invalid.run", job.result_id, valid_on, not_finalized) is None


# ------------------------------------------------------------------- bus roles (config)


def test_role_permissions_are_least_privilege(tmp_path: Path) -> None:
    import stat

    from shared.runtime import bus_auth

    conf = bus_auth.generate(tmp_path / "home")
    creds = json.loads(bus_auth.credentials_path(tmp_path / "home").read_text())
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600 and stat.S_IMODE(conf.parent.stat().st_mode) == 0o700
    assert len({c["password"] for c in creds.values()}) == len(creds)  # one random password per role
    roles = bus_auth.roles()
    gen = roles["generation"]
    assert "vb.answer.generated.*.*" in gen.publish and "vb.result.finalized.*.*" not in gen.publish
    assert not any(p in ("$JS.API.>", ">", "vb.>") for p in gen.publish)
    assert "$JS.API.CONSUMER.MSG.NEXT.VERIBUS.generation" in gen.publish
    assert "$JS.API.CONSUMER.MSG.NEXT.VERIBUS.parsing" not in gen.publish  # not another service's queue
    assert roles["finalization"].publish.count("vb.result.finalized.*.*") == 1
    cli = roles["cli"]
    assert "vb.answer.requested.*.*" in cli.publish and events.QUERY_SUBJECT in cli.publish
    for denied in ("vb.result.finalized.>", "vb.dead.letter.>", "vb.template.verified.>", "vb.stage.failed.>"):
        assert denied in cli.deny_publish
    assert roles["projector"].subscribe == ("_INBOX_projector.>", events.QUERY_SUBJECT)
    # each role reads only its own replies, and none may send to another role's
    for name, role in roles.items():
        if name != "admin":
            assert f"_INBOX_{name}.>" in role.subscribe and not any(s.startswith("_INBOX") and s != f"_INBOX_{name}.>"
                                                                  for s in role.subscribe), name
            replies = {f"_INBOX_{r}.>" for r in bus_auth.QUERY_ROLES} if name == "projector" else set()
            assert {s for s in role.publish if s.startswith("_INBOX")} == replies, name
    assert not any(s.startswith("$KV.vb_model_limits") for s in cli.publish)  # the ledgers are the services'
    assert events.QUERY_SUBJECT not in gen.subscribe and events.QUERY_SUBJECT not in gen.publish
    text = conf.read_text()
    assert all(c["password"] in text for c in creds.values())
    assert bus_auth.role_env("parsing-2") == {"VERIBUS_NATS_ROLE": "parsing"} and bus_auth.role_env("nats") == {}


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` one or more at the end."""
    pt, st = pattern.split("."), subject.split(".")
    for i, p in enumerate(pt):
        if p == ">":
            return len(st) > i
        if i >= len(st) or (p != "*" and p != st[i]):
            return False
    return len(pt) == len(st)


def _may_publish(role: object, subject: str) -> bool:
    return any(_matches(p, subject) for p in role.publish) and not any(  # type: ignore[attr-defined]
        _matches(d, subject) for d in role.deny_publish)  # type: ignore[attr-defined]


def test_cli_creates_only_named_consumers_and_touches_no_service_durable() -> None:
    """An unnamed create (`$JS.API.CONSUMER.CREATE.VERIBUS`) is applied by the server to the durable
    its body names, past every per-durable deny: cli re-pointed `verification` at nothing with one.
    cli may create only consumers named in the subject, on the events stream, none under a
    service's durable name; a service's durable may not be reset, paused, unpinned, stepped down,
    pulled, acked or deleted by it; and each service may repair its own durable, no other."""
    from shared.runtime import bus_auth

    roles = bus_auth.roles()
    cli = roles["cli"]
    api = "$JS.API.CONSUMER"
    ops = ("RESET", "PAUSE", "UNPIN", "LEADER.STEPDOWN", "PEER.REMOVE", "PEER.EVACUATE")
    refused = [f"{api}.CREATE.VERIBUS", f"{api}.DURABLE.CREATE.VERIBUS.mine", f"{api}.CREATE.KV_vb_model_limits",
               f"{api}.CREATE.KV_vb_model_limits.mine", f"{api}.CREATE.KV_vb_content.mine.>"]
    refused += [f"{api}.{op}.VERIBUS.mine" for op in ops]
    for d in (*bus_auth.SERVICE_DURABLES, "projector"):
        refused += [f"{api}.CREATE.VERIBUS.{d}", f"{api}.CREATE.VERIBUS.{d}.vb.nothing.*.*",
                    f"{api}.DURABLE.CREATE.VERIBUS.{d}", f"{api}.MSG.NEXT.VERIBUS.{d}", f"$JS.ACK.VERIBUS.{d}.1.5.5.0.0"]
        refused += [f"{api}.{op}.VERIBUS.{d}" for op in ops]
        if d != "projector":  # `projections rebuild` deletes the projector's, which it makes again
            refused.append(f"{api}.DELETE.VERIBUS.{d}")
    assert not [s for s in refused if _may_publish(cli, s)]
    mine = "Hk3aQnN1zW0e4yJwX5T2bC"  # a NUID, as nats_patches names cli's consumers
    allowed = [f"{api}.CREATE.VERIBUS.{mine}", f"{api}.CREATE.VERIBUS.{mine}.vb.result.finalized.R.*",
               f"{api}.INFO.VERIBUS.verification", f"{api}.LIST.VERIBUS", f"{api}.MSG.NEXT.VERIBUS.{mine}",
               f"{api}.DELETE.VERIBUS.{mine}", f"{api}.DELETE.VERIBUS.projector", f"$JS.FC.VERIBUS.{mine}.x",
               f"$JS.ACK.VERIBUS.{mine}.1.5.5.0.0"]
    assert [s for s in allowed if not _may_publish(cli, s)] == []
    for name, (inputs, _) in bus_auth.SERVICE_IO.items():
        for d in bus_auth.SERVICE_DURABLES:
            for op in ("RESET", "PAUSE"):
                assert _may_publish(roles[name], f"{api}.{op}.VERIBUS.{d}") is (d in inputs), (name, d, op)


def test_the_file_for_a_cli_user_holds_the_cli_role_only(tmp_path: Path) -> None:
    """What a deployment hands the CLI's users: with credentials.json itself (as the compose
    instructions said to copy) a CLI user connected as `admin`, and no role's limit held."""
    from shared.runtime import bus_auth

    home = tmp_path / "home"
    bus_auth.generate(home)
    handed = bus_auth.cli_credentials_path(home)
    assert stat_mode(handed) == 0o600
    assert bus_auth.load_credentials(handed, "cli") == bus_auth.load_credentials(bus_auth.credentials_path(home), "cli")
    for role in ("admin", "finalization", "projector"):
        with pytest.raises(KeyError):
            bus_auth.load_credentials(handed, role)
    bus_auth.generate(home, keep=True)  # docker-compose's every `up`: the same cli entry
    assert json.loads(handed.read_text()) == {"cli": json.loads(bus_auth.credentials_path(home).read_text())["cli"]}


def stat_mode(path: Path) -> int:
    import stat

    return stat.S_IMODE(path.stat().st_mode)


def test_untrusted_sql_on_a_clickhouse_server_goes_through_a_read_only_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a server deployment the projector's query subject and the viewer run other people's SQL.
    They used the writer client (no readonly, no limits: the SQL guard alone stood between a cli
    user and the tables). Untrusted queries now get a client of their own whose every request
    carries readonly = 2 and the query limits; the writer keeps none of them. (No ClickHouse
    server runs here: this checks the clients the store makes, not a server's answer.)"""
    import clickhouse_connect

    from shared.core.config import Settings
    from shared.store.engine import open_store

    made: list[dict] = []

    class Client:
        def __init__(self, **kw: object) -> None:
            self.kw, self.database, self.closed = kw, None, False
            made.append(kw)

        def command(self, sql: str) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(clickhouse_connect, "get_client", lambda **kw: Client(**kw))
    monkeypatch.setenv("VERIBUS_QUERY_TIMEOUT_S", "7")
    store = open_store(Settings(clickhouse_url="http://analyst:pw@ch.example:8123", home=Path("/nonexistent")),
                       migrate=False)
    writer = made[0]
    assert "settings" not in writer or not (writer.get("settings") or {}).get("readonly")
    reader = store._acquire_reader()
    assert reader is not store.client, "untrusted SQL must not run on the writer client"
    settings = reader.kw["settings"]
    assert settings["readonly"] == 2 and settings["max_execution_time"] == 7.0
    assert settings["max_result_rows"] > 0 and settings["max_memory_usage"] > 0
    assert reader.kw["dsn"] == "http://analyst:pw@ch.example:8123" and reader.kw["database"] == "veribus"
    store._release_reader(reader)
    store.close()
    assert reader.closed
