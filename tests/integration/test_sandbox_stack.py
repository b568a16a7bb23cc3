"""Issue 10 items 1-3 replayed through the real stack (nats-server, simulator, every service,
embedded ClickHouse): the services start with an API key in their environment; hostile
templates (verify(), class body) and a callable trait try to read it from every process they
can see, kill their parent and every process, patch the helpers and builtins, write into the
stack's home, reach a loopback listener and start `setsid sleep`. Every case must end in a
recorded result, the key must be nowhere (results, events, stream files, logs), no service may
die or be replaced, and a later unrelated run must get exactly the verdicts it should.
"""

from __future__ import annotations

import json
import secrets
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from bench import workload
from bench.workload import int_template
from shared.control import runner
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.runtime import bus
from shared.runtime.content import ContentStore, lean_requests
from shared.store.reads import run_query
from tests.support.stack import (
    Listener,
    Stack,
    generated_benchmark,
    plan_and_submit,
    results_of,
    start_stack,
    stop_stack,
    sync,
    wait_projected,
    wait_projector_idle,
    wait_results,
)

KEY = "sk-jail-planted-" + secrets.token_hex(16)
NAP = str(9000 + secrets.randbelow(900))

READ_EVERYTHING = """
import json, os, socket, builtins, _posixsubprocess
r = {{}}
def environ(path):
    with open(path, 'rb') as f:
        return f.read().decode('latin-1')
for p in ['self', str(os.getppid())] + [p for p in os.listdir('/proc') if p.isdigit()]:
    try:
        r['environ_' + p] = environ('/proc/' + p + '/environ')
    except OSError as exc:
        r['environ_' + p] = 'ERR ' + str(exc)
r['own_env'] = repr(dict(os.environ))
for name, fn in (
        ('home', lambda: os.listdir(os.environ.get('VERIBUS_HOME', '.veribus'))),
        ('home_abs', lambda: os.listdir('{home}')),
        ('write_home', lambda: open('{home}/logs/pwned.txt', 'w').write('x')),
        ('connect', lambda: socket.create_connection(('127.0.0.1', {port}), timeout=2)),
        ('kill_parent', lambda: os.kill(os.getppid(), 9)),
        ('kill_all', lambda: os.kill(-1, 9)),
        ('setsid_sleep', lambda: _posixsubprocess.fork_exec(
            ['/usr/bin/setsid', '/usr/bin/sleep', '{nap}'], [b'/usr/bin/setsid'], True, (), None, None,
            -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1, None, None, None, -1, None, False)),
        ('fork', lambda: os.fork())):
    try:
        r[name] = 'OK ' + repr(fn())[:200]
    except BaseException as exc:
        r[name] = 'ERR ' + type(exc).__name__ + ': ' + str(exc)[:200]
"""

PATCHES = """
import builtins, sys
builtins.abs = lambda x: 0
import shared.templates.calls
shared.templates.calls._as_bool = lambda value: True
shared.templates.calls.worker_verify = lambda *a, **k: {{'verify_result': True, 'template_verification_performed': True}}
import shared.templates.confine
shared.templates.confine._WRITE_FLAGS = 0
shared.templates.confine._BLOCKED_EVENTS = frozenset()
"""

VICTIM = 'return abs(self.value - self.correct["value"]) == 0'  # a verify() that uses abs()


def _attack_fn(attack: str) -> str:
    return "import json\n\ndef attack():\n" + textwrap.indent(attack, "    ") + "\n    return r\n"


def _template(n: int, attack: str, *, where: str) -> str:
    head = "from karenina.schemas.entities import BaseAnswer\nfrom pydantic import Field\n" + _attack_fn(attack)
    if where == "class":  # runs while the class body executes, at validation (a verify() to be published)
        return head + ("\nclass Answer(BaseAnswer):\n    value: int = Field(description='The number asked for')\n\n"
                       "    def verify(self) -> bool:\n        return True\n\n"
                       "    raise RuntimeError('ATTACK ' + json.dumps(attack()))\n")
    return head + (f"\nclass Answer(BaseAnswer):\n    value: int = Field(description='The number asked for')\n\n"
                   f"    def model_post_init(self, __context):\n        self.correct = {{'value': {n}}}\n\n"
                   f"    def verify(self) -> bool:\n        raise RuntimeError('ATTACK ' + json.dumps(attack()))\n")


@pytest.fixture(scope="module")
def jstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("jail") / "home"
    st = start_stack(home, extra_env={"OPENAI_API_KEY": KEY})
    try:
        yield st
    finally:
        stop_stack(st)


@pytest.fixture(scope="module")
def attacked(jstack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("jail-run")
    listener = Listener()
    home = str(jstack.settings.home)
    attack = READ_EVERYTHING.format(home=home, port=listener.port, nap=NAP)
    names = ["normal", "env_verify", "env_class", "env_trait", "patcher"]
    path, script = generated_benchmark(tmp / "attack.yaml", len(names), rubric=False, wrong_every=0, prefix="Jail")
    doc = yaml.safe_load(path.read_text())
    for i, name in enumerate(names):
        q = doc["questions"][i]
        q["id"] = name
        if name == "env_verify":
            q["template"] = _template(2 * i, attack, where="verify")
        elif name == "env_class":
            q["template"] = _template(2 * i, attack, where="class")
        elif name == "env_trait":
            code = _attack_fn(attack) + "\ndef evaluate(trace):\n    raise RuntimeError('ATTACK ' + json.dumps(attack()))\n"
            q["rubric"] = {"callable_traits": [{"name": "Leak", "kind": "boolean", "callable_code": code}]}
        elif name == "patcher":
            q["template"] = _template(2 * i, PATCHES.format() + attack, where="verify")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    jstack.post_script(script)
    service_pids = {p.name: p.pid for p in jstack.reload().procs}
    plan = plan_and_submit(jstack, path, jstack.config("template_and_rubric", template_timeout_s=5.0))
    try:
        wait_results(jstack, plan.run_id, len(names), timeout=180)
        results = {r.metadata.question_id: r for r in results_of(jstack, plan.run_id).values()}
        # a later, unrelated run whose verify() uses abs(): 10 answers, every third one wrong
        vpath, vscript = generated_benchmark(tmp / "victim.yaml", 10, rubric=False, wrong_every=3, prefix="Victim")
        vdoc = yaml.safe_load(vpath.read_text())
        for i, q in enumerate(vdoc["questions"]):
            q["template"] = int_template(2 * i, VICTIM)
        vpath.write_text(yaml.safe_dump(vdoc, sort_keys=False))
        jstack.post_script(vscript)
        vplan = plan_and_submit(jstack, vpath, jstack.config("template_only"))
        wait_results(jstack, vplan.run_id, 10, timeout=180)
        victims = {r.metadata.question_id: r for r in results_of(jstack, vplan.run_id).values()}
        wait_projected(jstack, plan.run_id, len(names))
        wait_projected(jstack, vplan.run_id, 10)
        wait_projector_idle(jstack)
        yield {"results": results, "victims": victims, "service_pids": service_pids, "listener": listener,
               "run_id": plan.run_id}
    finally:
        listener.close()


def _report(text: str) -> dict[str, str]:
    assert "ATTACK " in text, text[:500]
    return json.JSONDecoder().raw_decode(text.split("ATTACK ", 1)[1])[0]


def _reports(res: dict[str, Any]) -> dict[str, dict[str, str]]:
    out = {}
    out["env_verify"] = _report(res["env_verify"].template.field_verification_error or "")
    out["env_class"] = _report(res["env_class"].metadata.error or "")
    out["env_trait"] = _report((res["env_trait"].rubric.trait_errors or {}).get("Leak", ""))
    out["patcher"] = _report(res["patcher"].template.field_verification_error or "")
    return out


def test_every_attack_ran_failed_and_was_recorded(attacked: dict[str, Any]) -> None:
    res = attacked["results"]
    assert res["normal"].metadata.completed_without_errors and res["normal"].template.verify_result is True
    for where, report in _reports(res).items():
        for name in ("home_abs", "write_home", "connect", "kill_parent", "kill_all", "setsid_sleep", "fork"):
            assert report[name].startswith("ERR "), (where, name, report[name])
        assert report["home"].startswith("ERR "), (where, report["home"])  # VERIBUS_HOME is neither set nor visible
        assert len([k for k in report if k.startswith("environ_")]) <= 6, (where, sorted(report))
    assert attacked["listener"].connections == 0


def test_no_process_outlived_its_call(attacked: dict[str, Any]) -> None:
    needle = f"sleep {NAP}".encode()
    hits = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in p.joinpath("cmdline").read_bytes().replace(b"\0", b" "):
                    hits.append(p.name)
            except OSError:
                continue
    assert hits == []


def test_planted_key_is_nowhere(jstack: Stack, attacked: dict[str, Any]) -> None:
    for name in ("verification", "rubric"):  # planted for real: the services that run the sandbox hold it
        assert KEY.encode() in Path(f"/proc/{jstack.proc(name).pid}/environ").read_bytes(), name
    text = json.dumps([r.model_dump(mode="json") for r in attacked["results"].values()])
    assert "ATTACK " in text and KEY not in text and "OPENAI_API_KEY" not in text
    for table in ("events", "verification_results"):
        cols = [r[0] for r in run_query(jstack.settings, f"DESCRIBE TABLE {table}").rows]
        cond = " OR ".join(f"position(toString({c}), {{s:String}}) > 0" for c in cols)
        hits = run_query(jstack.settings, f"SELECT count() FROM {table} WHERE {cond}", {"s": KEY}).rows[0][0]
        assert int(hits) == 0, table
    home = Path(jstack.settings.home)
    leaked = [str(p) for p in home.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaked == []  # NATS store, logs, stack state
    assert not (home / "logs" / "pwned.txt").exists()


def test_services_survived_unreplaced(jstack: Stack, attacked: dict[str, Any]) -> None:
    now = {p.name: p.pid for p in jstack.reload().procs}
    assert now == attacked["service_pids"]
    assert all(p.alive() for p in jstack.state.procs)


def test_later_run_verdicts_are_untouched(attacked: dict[str, Any]) -> None:
    got = {qid: r.template.verify_result for qid, r in attacked["victims"].items()}
    want = {f"q{i:04d}": i % 3 != 0 for i in range(10)}
    assert got == want


PATCH_IN_CLASS_BODY = '''from karenina.schemas.entities import BaseAnswer
from pydantic import Field
import builtins
builtins.abs = lambda x: 0  # every later abs(...) == 0 in this process is True


class Answer(BaseAnswer):
    value: int = Field(description='The number asked for')

    def verify(self) -> bool:
        return True
'''


def test_a_job_published_into_another_run_cannot_patch_its_verdicts(jstack: Stack, tmp_path: Path) -> None:
    """Another client holding only the `cli` credential publishes an answer request of its own
    under a victim run's id (found by following the stream), whose template patches `abs` in its
    class body. The services once ran it in the victim run's own sandbox process (scope = run id),
    so every later `verify()` of the victim that used abs() passed. Now a run's processes take
    only the code the run announced when it was submitted (its code manifest, by hash): the
    injected job runs apart, and the victim's verdicts are exactly what its answers deserve."""
    vpath, vscript = generated_benchmark(tmp_path / "victim.yaml", 9, rubric=False, wrong_every=3, prefix="Injected")
    vdoc = yaml.safe_load(vpath.read_text())
    for i, q in enumerate(vdoc["questions"]):
        q["template"] = int_template(2 * i, VICTIM)
    vpath.write_text(yaml.safe_dump(vdoc, sort_keys=False))
    apath, ascript = workload.generated_benchmark(tmp_path / "attacker.yaml", 1, wrong_every=0, prefix="Intruder",
                                                  ids="intruder{i}")
    adoc = yaml.safe_load(apath.read_text())
    adoc["questions"][0]["template"] = PATCH_IN_CLASS_BODY
    apath.write_text(yaml.safe_dump(adoc, sort_keys=False))
    jstack.post_script({"questions": vscript["questions"] + ascript["questions"]})
    config = jstack.config("template_only")
    victim = runner.plan_run(Benchmark.load(vpath), config)
    intruder = runner.plan_run(Benchmark.load(apath), config)
    forged = [events.AnswerRequested(jobs=[msgspec.structs.replace(j, run_id=victim.run_id) for j in r.jobs])
              for r in intruder.requests]
    cli = jstack.settings.model_copy(update={"nats_role": "cli"})

    async def inject() -> None:  # what the attacker's client does: contents, then lean jobs, no run.requested
        async with bus.session(cli) as nc:
            js = nc.jetstream()
            requests = await lean_requests(ContentStore(lambda: js), forged)
            await bus.publish_many(js, [events.make_envelope(events.ANSWER_REQUESTED, victim.run_id, j.answer_id, r,
                                                             "cli/0.1.0")
                                        for r, j in zip(requests, (r.jobs[0] for r in forged), strict=True)])

    sync(inject())
    wait_results(jstack, victim.run_id, 1, timeout=120)  # the patch ran first, in whatever process it was given
    sync(runner.submit(jstack.settings, victim))
    wait_results(jstack, victim.run_id, 10, timeout=180)
    results = results_of(jstack, victim.run_id)
    intruding = [r for r in results.values() if r.metadata.question_id == "intruder0"]
    assert len(intruding) == 1 and intruding[0].template.verify_result is True  # it ran, in a process of its own
    got = {r.metadata.question_id: r.template.verify_result for r in results.values() if r not in intruding}
    assert got == {f"q{i:04d}": i % 3 != 0 for i in range(9)}, "the injected class body changed the victim's verdicts"
