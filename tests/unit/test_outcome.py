"""Honest outcomes without a bus: exit codes and their precedence, --max-errors, error groups
(verify() raising apart from plain fails), gate reading and checking, provider keys, the
deployment choice, run names, the progress line, and the summary/HTML that show errors."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from shared.analysis import report
from shared.analysis.gates import GateError, check_gates, known_metrics, parse_gate
from shared.cli.progress import ProgressPrinter, RunProgress
from shared.control.credentials import config_problems, missing_key
from shared.control.runref import RunNotFound, RunRef, next_regrade_name, pick
from shared.core import outcome
from shared.core.fold import _error_text, _failure_entry
from shared.core.models import (
    ModelIdentity,
    VerificationResult,
    VerificationResultMetadata,
    VerificationResultTemplate,
)
from shared.core.outcome import EXIT_CODES, MaxErrors, judge

_N = iter(range(10_000))


def result(verify: bool | None = True, *, stage_error: tuple[str, str, str] | None = None,
           verify_raised: str | None = None, qid: str | None = None) -> VerificationResult:
    """One result as the finalizer folds it: a stage error goes through fold's own
    `_failure_entry`/`_error_text`, so the grouping reads what real results carry."""
    from shared.core.events import StageError

    qid = qid or f"q{next(_N)}"
    failure = error = None
    if stage_error is not None:
        err = StageError(stage=stage_error[0], type=stage_error[1], message=stage_error[2])
        failure, error = _failure_entry("unexpected_error", err.stage, err.message), _error_text(err)
    meta = VerificationResultMetadata(
        question_id=qid, answering=ModelIdentity(model_name="openai/m"), parsing=ModelIdentity(model_name="openai/j"),
        result_id=qid, completed_without_errors=stage_error is None, error=error, failure=failure)
    tmpl = VerificationResultTemplate(verify_result=verify, template_verification_performed=verify is not None,
                                      field_verification_error=verify_raised)
    return VerificationResult(metadata=meta, template=tmpl)


CONN = ("generate_answer", "LLMError", "connection: model openai/m at stage generate_answer failed after 5 "
        "attempt(s) (no HTTP status): APIConnectionError: Connection refused")


# --------------------------------------------------------------------------------------------
# exit codes
# --------------------------------------------------------------------------------------------


def test_exit_codes_are_the_documented_ones() -> None:
    assert (outcome.EXIT_OK, outcome.EXIT_GATE_FAILED, outcome.EXIT_BAD_INPUT, outcome.EXIT_RESULTS_MISSING,
            outcome.EXIT_JOB_ERRORS) == (0, 1, 2, 3, 4)
    assert set(EXIT_CODES) >= {0, 1, 2, 3, 4}


def test_every_job_in_error_is_exit_4_never_passed() -> None:
    results = [result(None, stage_error=CONN) for _ in range(18)]
    v = judge(results, expected=18)
    assert v.code == 4 and v.status == "errors" and not v.ok
    assert "18 of 18 job(s) ended in error" in v.headline and v.headline.startswith("✗ FAILED")


def test_clean_run_is_0_and_plain_fails_are_not_errors() -> None:
    v = judge([result(True), result(False), result(True)], expected=3)
    assert v.code == 0 and v.headline == "✓ PASSED" and v.errors == 0


@pytest.mark.parametrize(("text", "errors", "code"), [
    ("0", 1, 4), (None, 1, 4), ("1", 1, 0), ("1", 2, 4), ("20%", 2, 0), ("20%", 3, 4), ("100%", 10, 0),
])
def test_max_errors_tolerates_a_count_or_a_share(text: str | None, errors: int, code: int) -> None:
    results = [result(None, stage_error=CONN) for _ in range(errors)] + [result(True) for _ in range(10 - errors)]
    assert judge(results, expected=10, max_errors=MaxErrors.parse(text)).code == code


@pytest.mark.parametrize("text", ["-1", "abc", "120%", "x%", "1.5"])
def test_bad_max_errors_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--max-errors"):
        MaxErrors.parse(text)


def test_results_missing_wins_over_errors_and_gates() -> None:
    v = judge([result(None, stage_error=CONN)], expected=5, timed_out=True, failed_gates=["accuracy >= 0.8"])
    assert v.code == 3 and v.missing == 4
    assert any("4 of 5 job(s) have no result" in r for r in v.reasons)
    assert any("gate(s) failed: accuracy >= 0.8" in r for r in v.reasons)


def test_gate_failure_alone_is_exit_1_and_named() -> None:
    v = judge([result(False)], expected=1, failed_gates=["accuracy >= 0.8"])
    assert v.code == 1 and "accuracy >= 0.8" in v.headline


@pytest.mark.parametrize(("etype", "status", "word"), [("RunCancelled", "cancelled", "cancelled"),
                                                         ("BudgetExhausted", "budget_stopped", "budget")])
def test_cancelled_and_budget_stopped_runs_say_so_and_are_not_0(etype: str, status: str, word: str) -> None:
    stopped = ("generate_answer", etype, "the run was stopped")
    results = [result(True), result(None, stage_error=stopped)]
    v = judge(results, expected=2, max_errors=MaxErrors.parse("100%"), run_ref="nightly")
    assert v.code == 4 and v.status == status and word in v.headline
    assert "veribus resume nightly" in v.headline


def test_a_money_budget_stop_is_named_as_such_not_as_the_token_budget() -> None:
    # the message the cost control writes (shared.runtime.costcontrol), through the fold
    stopped = ("generate_answer", "BudgetExhausted", "cost budget exhausted: run r1 has spent $0.010000 of its "
               "$0.010000 budget; this answer was not generated")
    v = judge([result(True), result(None, stage_error=stopped)], expected=2, run_ref="nightly")
    assert v.code == 4 and v.status == "budget_stopped"
    assert "cost budget (--max-cost-usd) stopped the run (1 job(s) not run)" in v.headline
    assert "token budget" not in v.headline and "--max-tokens-budget" not in v.headline


# --------------------------------------------------------------------------------------------
# error groups
# --------------------------------------------------------------------------------------------


def test_errors_group_by_stage_and_type_with_one_example() -> None:
    parse = ("parse_template", "LLMError", "rate_limit: model openai/j at stage parse_template failed after 5 "
             "attempt(s) (HTTP 429): RateLimitError")
    results = ([result(None, stage_error=CONN) for _ in range(3)] + [result(None, stage_error=parse)]
               + [result(False, verify_raised="Field verification failed: ZeroDivisionError: division by zero")]
               + [result(False), result(True)])
    summary = report.summarize(results)
    groups = summary["error_groups"]
    assert [(g["stage"], g["type"], g["count"]) for g in groups] == [
        ("generate_answer", "LLMError(connection)", 3),
        ("parse_template", "LLMError(rate_limit)", 1),
        ("verify_template", "verify() raised: ZeroDivisionError", 1),
    ]
    assert "Connection refused" in groups[0]["example"]
    assert summary["errors"] == 4 and summary["verify_raised"] == 1
    assert summary["failed_plain"] == 1  # the plain fail only; verify() raising is counted apart
    block = report.results_block(summary)
    assert "Errors by stage and type" in block and "generate_answer / LLMError(connection)" in block
    assert "verify() raised: 1" in block and "Failed: 1" in block


def test_a_template_whose_verify_raises_fails_the_run() -> None:
    results = [result(False, verify_raised="Field verification failed: KeyError: 'x'"), result(True)]
    v = judge(results, expected=2)
    assert v.code == 4 and v.verify_raised == 1 and "verify() raised" in v.headline


def test_html_report_shows_error_groups(tmp_path) -> None:  # noqa: ANN001
    from shared.analysis.html_report import RunData, render_html

    results = [result(None, stage_error=CONN), result(False, verify_raised="Field verification failed: "
                                                                           "ValueError: bad"), result(True)]
    page = render_html(RunData(run_id="r1", results=results))
    assert "Errors by stage and type" in page and "LLMError(connection)" in page
    assert "verify() raised: ValueError" in page and "Connection refused" in page


def test_summary_json_carries_groups_and_outcome(tmp_path) -> None:  # noqa: ANN001
    import json

    results = [result(None, stage_error=CONN), result(True)]
    summary = report.summarize(results)
    summary["outcome"] = judge(results, expected=2).as_dict()
    report.write_outputs(tmp_path, "suite", "r1", results, summary, {}, False)
    body = json.loads((tmp_path / "summary.json").read_text())
    assert body["outcome"]["exit_code"] == 4 and body["error_groups"][0]["count"] == 1
    assert body["error_groups"][0]["type"] == "LLMError(connection)"


# --------------------------------------------------------------------------------------------
# gates
# --------------------------------------------------------------------------------------------


def test_percent_and_fraction_gates_mean_the_same_and_say_how_they_were_read() -> None:
    a, b, c = parse_gate("pass_rate>=80"), parse_gate("pass_rate>=0.8"), parse_gate("pass_rate >= 80%")
    assert a == b == c and a.value == pytest.approx(0.8)
    assert "80 read as 0.8" in a.understood() and "pass_rate >= 0.8" in b.understood()


@pytest.mark.parametrize("text", ["accuracy>=150", "accuracy>=-0.1", "accuracy>=101%", "errors>=-1",
                                  "clarity>=0.5 pass>=200"])
def test_out_of_range_thresholds_are_refused(text: str) -> None:
    with pytest.raises(GateError, match="out of range"):
        parse_gate(text)


@pytest.mark.parametrize("text", ["accuracy=>0.8", "accuracy ~ 0.8", "accuracy >> 0.8"])
def test_bad_operators_are_refused(text: str) -> None:
    with pytest.raises(GateError):
        parse_gate(text)


def test_unknown_metric_is_refused_with_a_suggestion() -> None:
    metrics = known_metrics({"Clarity"})
    with pytest.raises(GateError, match=r"unknown metric 'acuracy'.*did you mean 'accuracy'"):
        check_gates([parse_gate("acuracy>=0.8")], metrics)
    check_gates([parse_gate("accuracy>=0.8"), parse_gate("Clarity>=0.5"), parse_gate("errors<1")], metrics)
    with pytest.raises(GateError, match="no model 'gpt-9'"):
        check_gates([parse_gate("accuracy:gpt-9>=0.8")], metrics, [("litellm:openai/m", "openai/m")])
    check_gates([parse_gate("accuracy:openai/m>=0.8")], metrics, [("litellm:openai/m", "openai/m")])


# --------------------------------------------------------------------------------------------
# provider keys
# --------------------------------------------------------------------------------------------


def test_missing_provider_key_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.core.config import ModelConfig, VerificationConfig

    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "MY_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert missing_key(ModelConfig(model_name="gpt-4.1-mini")) == ["OPENAI_API_KEY"]
    assert missing_key(ModelConfig(model_name="anthropic/claude-haiku-4-5")) == ["ANTHROPIC_API_KEY"]
    assert missing_key(ModelConfig(model_name="x", api_key_env="MY_KEY")) == ["MY_KEY"]
    assert missing_key(ModelConfig(model_name="openai/qwen", api_base="http://gpu:8000/v1")) == []
    assert missing_key(ModelConfig(model_name="openai/sim", interface="simulator")) == []
    cfg = VerificationConfig(answering_models=[ModelConfig(model_name="gpt-4.1-mini")],
                             parsing_models=[ModelConfig(model_name="claude-haiku-4-5")])
    problems = config_problems(cfg)
    assert any("'gpt-4.1-mini'" in p and "OPENAI_API_KEY" in p for p in problems)
    assert any("'claude-haiku-4-5'" in p and "ANTHROPIC_API_KEY" in p for p in problems)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("MY_KEY", "k")
    assert missing_key(ModelConfig(model_name="gpt-4.1-mini")) == []
    assert missing_key(ModelConfig(model_name="x", api_key_env="MY_KEY")) == []


def test_keys_are_looked_for_where_the_local_stack_makes_the_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a local stack running, its services make the model calls with the environment `up`
    gave them: a key set only for `veribus run` reached no service, and every job failed after
    five retries as a provider outage; a key given to `up` alone was refused here."""
    from shared.core.config import ModelConfig, VerificationConfig

    cfg = VerificationConfig(answering_models=[ModelConfig(model_name="gpt-4.1-mini")],
                             parsing_models=[ModelConfig(model_name="openai/x", api_key_env="MY_KEY")])
    monkeypatch.setenv("OPENAI_API_KEY", "sk-here")
    monkeypatch.setenv("MY_KEY", "k")
    problems = config_problems(cfg, {"PATH": "/usr/bin"})
    assert len(problems) == 2, problems
    assert "'gpt-4.1-mini': OPENAI_API_KEY is set here, but the local stack's services were started without it" \
        in problems[0] and "`veribus down`, then `veribus up` with OPENAI_API_KEY set" in problems[0]
    assert "'openai/x': MY_KEY is set here, but the local stack's services" in problems[1]
    monkeypatch.delenv("OPENAI_API_KEY")
    monkeypatch.delenv("MY_KEY")
    assert config_problems(cfg, {"OPENAI_API_KEY": "sk-up", "MY_KEY": "k"}) == []
    missing = config_problems(cfg, {"OPENAI_API_KEY": "sk-up"})
    assert missing == ["judge model 'openai/x': no API key: set MY_KEY where `veribus up` runs (the local stack's services "
                       "make the calls; `veribus down` first) (or give the model an api_base, or run with --simulate "
                       "for the offline simulator)"]


def test_a_model_name_no_provider_is_known_for_is_named_before_publishing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo or a bare name litellm cannot route (every call would fail with "LLM Provider NOT
    provided") is refused with the fix; its key being set changes nothing."""
    from shared.core.config import ModelConfig, VerificationConfig

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("MY_KEY", "k")
    cfg = VerificationConfig(
        answering_models=[ModelConfig(model_name="totally-unknown-model-xyz"),
                          ModelConfig(model_name="qwen-local", api_base="http://gpu:8000/v1"),
                          ModelConfig(model_name="x", api_key_env="MY_KEY")],
        parsing_models=[ModelConfig(model_name="gpt-4.1-mini")])
    problems = config_problems(cfg)
    assert len(problems) == 3, problems
    assert "'totally-unknown-model-xyz': no provider known" in problems[0]
    assert "openai/qwen-local for an OpenAI-compatible server" in problems[1]
    assert "'x': no provider known" in problems[2]
    fine = VerificationConfig(answering_models=[ModelConfig(model_name="openai/qwen", api_base="http://gpu:8000/v1"),
                                                ModelConfig(model_name="sim", interface="simulator")],
                              parsing_models=[ModelConfig(model_name="gpt-4.1-mini")])
    assert config_problems(fine) == []


# --------------------------------------------------------------------------------------------
# runs by name
# --------------------------------------------------------------------------------------------


RUNS = [RunRef("r1", "nightly", "2026-01-01T00:00:00"), RunRef("r2", "nightly", "2026-01-03T00:00:00"),
        RunRef("r3", "nightly", "2026-01-02T00:00:00"), RunRef("r4", None, "2026-01-04T00:00:00"),
        RunRef("r5", "solo", "2026-01-01T00:00:00")]


def test_a_name_means_its_most_recent_run_and_ambiguity_is_said() -> None:
    p = pick("nightly", RUNS)
    assert p.run_id == "r2" and "matches 3 runs" in p.note and "r3" in p.note and "r1" in p.note
    assert pick("r1", RUNS).run_id == "r1" and pick("r1", RUNS).note is None
    assert pick("solo", RUNS).note is None
    with pytest.raises(RunNotFound, match="no run 'nope': no run has that id or name"):
        pick("nope", RUNS)


def test_regrade_names_count_up() -> None:
    assert next_regrade_name("nightly", ["nightly", None]) == "nightly-regrade-1"
    assert next_regrade_name("nightly", ["nightly-regrade-1", "nightly-regrade-3", "other-regrade-9"]) == \
        "nightly-regrade-4"


# --------------------------------------------------------------------------------------------
# progress
# --------------------------------------------------------------------------------------------


def test_progress_line_counts_rate_and_eta() -> None:
    prog = RunProgress(total=10, started=100.0)
    for r in [result(True), result(False), result(None, stage_error=CONN), result(True)]:
        prog.add(r)
    prog.add(result(True, qid="dup"))
    prog.add(result(True, qid="dup"))  # the same result id twice counts once
    prog.retrying = 2
    line = prog.line(110.0)
    assert line.startswith("5/10 done (50%), 3 passed, 1 failed, 1 errors, 2 retrying, 0.5/s, ETA 10s")


def test_piped_progress_is_periodic_plain_lines() -> None:
    clock = [0.0]
    out = io.StringIO()
    prog = RunProgress(total=4, started=0.0)
    printer = ProgressPrinter(prog, out, interval_s=10.0, clock=lambda: clock[0], tty=False)
    for t in (0.0, 1.0, 2.0, 11.0, 12.0):
        clock[0] = t
        prog.add(result(True))
        printer.update()
    printer.finish()
    lines = out.getvalue().splitlines()
    assert [ln.split(" done")[0] for ln in lines] == ["progress: 1/4", "progress: 4/4", "progress: 5/4"]
    assert "\r" not in out.getvalue()


def test_a_dead_process_of_the_local_stack_is_named_once_while_a_run_is_followed() -> None:
    """StackWatch: each death said once (PID, what waits, `veribus up`), on the progress line while
    it lasts, a note when it runs again; stack.json is read at most every `every_s` (fake clock)."""
    import subprocess

    import psutil

    from shared.cli.progress import StackWatch
    from shared.control.processes import Proc
    from shared.control.stack import StackState

    me = psutil.Process()
    gone = subprocess.Popen(["true"])
    gone.wait()

    def proc(name: str, alive: bool = True) -> Proc:
        return Proc(name=name, pid=me.pid if alive else gone.pid, cmd=[], log="log",
                    create_time=me.create_time() if alive else 1.0)

    def state(*dead: str) -> StackState:
        names = ("nats", "simulator", "projector", "projector-2", "parsing", "rubric")
        return StackState(home="h", nats_url="nats://x", simulator_url=None,
                          procs=[proc(n, n not in dead) for n in names])

    states, loads, clock = [state("parsing", "projector")], [], [0.0]
    watch = StackWatch(Path("h"), every_s=2.0, clock=lambda: clock[0],
                       load=lambda home: loads.append(home) or states[-1])
    assert watch.check() == [
        f"warning: the local stack's projector is DEAD (pid {gone.pid} exited): projector-2 carry on its work; "
        "`veribus up` restarts it",
        f"warning: the local stack's parsing is DEAD (pid {gone.pid} exited): the run's jobs wait for it at that "
        "stage; `veribus up` restarts it"]
    assert watch.dead == ["projector", "parsing"]
    prog = RunProgress(total=4, started=0.0, dead=watch.dead)
    assert prog.line(1.0).endswith(", DEAD: projector, parsing")
    clock[0] = 1.0
    assert watch.check() == [] and len(loads) == 1  # not looked at again within every_s
    clock[0] = 2.0
    assert watch.check() == [] and len(loads) == 2  # looked at, and said once
    states.append(state("parsing", "simulator"))
    clock[0] = 4.0
    assert watch.check() == ["note: the local stack's projector is running again",
                             f"warning: the local stack's simulator is DEAD (pid {gone.pid} exited): the simulated "
                             "models' calls fail and are retried; `veribus up` restarts it"]
    states.append(state())
    clock[0] = 6.0
    assert sorted(watch.check()) == ["note: the local stack's parsing is running again",
                                     "note: the local stack's simulator is running again"]
    assert watch.dead == []
    out = io.StringIO()  # on a terminal the warning gets a line of its own, the progress line is redrawn below
    printer = ProgressPrinter(RunProgress(total=4, started=0.0), out, clock=lambda: 0.0, tty=True)
    printer.update()
    printer.note("warning: x")
    assert out.getvalue().startswith("\r0/4 done") and "\rwarning: x\n\r0/4 done" in out.getvalue()


# --------------------------------------------------------------------------------------------
# logs say why, once per cause
# --------------------------------------------------------------------------------------------


async def test_a_refused_model_call_warns_once_per_cause(caplog: pytest.LogCaptureFixture) -> None:
    """A real call to a port where nothing listens: retried, but one WARNING naming the cause."""
    from shared.control.processes import free_port
    from shared.core.events import ModelSpec
    from shared.runtime.llm.client import LLMClient
    from shared.runtime.llm.reply import LLMError

    port = free_port()  # bound and released: nothing listens there now
    model = ModelSpec(model_name=f"openai/refused-{port}", api_base=f"http://127.0.0.1:{port}/v1", max_retries=2,
                      timeout=5)
    client = LLMClient()
    client.backoff_base = 0.01
    client.backoff_cap = 0.02
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            with pytest.raises(LLMError) as info:
                await client.complete(model, [{"role": "user", "content": "hi"}], stage="generate_answer")
            assert info.value.kind == "connection" and info.value.attempts == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and model.model_name in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # 6 failed attempts, one line
    assert "connection" in warnings[0].getMessage() and "Connect call failed" in warnings[0].getMessage()


async def test_a_missing_api_key_env_warns_once(caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.core.events import ModelSpec
    from shared.runtime.llm.client import LLMClient
    from shared.runtime.llm.reply import LLMError

    monkeypatch.delenv("VB_HONEST_UNSET_KEY", raising=False)
    monkeypatch.setenv("VERIBUS_ENDPOINTS", "https://api.openai.com/v1=VB_HONEST_UNSET_KEY")  # bound (issue 10)
    model = ModelSpec(model_name="openai/needs-key", api_key_env="VB_HONEST_UNSET_KEY", max_retries=2)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with pytest.raises(LLMError) as info:
                await LLMClient().complete(model, [{"role": "user", "content": "hi"}], stage="generate_answer")
            assert info.value.kind == "auth"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "needs-key" in r.getMessage()]
    assert len(warnings) == 1 and "missing or rejected credentials" in warnings[0]
    assert "VB_HONEST_UNSET_KEY" in warnings[0]


# --------------------------------------------------------------------------------------------
# regrade judges come from the current configuration
# --------------------------------------------------------------------------------------------


def _regrade_plan(parsing: object) -> object:
    from shared.control.lifecycle import RegradePlan
    from shared.core import events

    job = events.Job(run_id="new", result_id="r1", answer_id="a1", question_id="q1", question_text="2+2?",
                     answering=events.ModelSpec(model_name="openai/a"), parsing=parsing,
                     timestamp="2026-01-01T00:00:00+00:00")
    run = events.RunRequested(run_id="new", timestamp="t", job_count=1, answer_count=1)
    return RegradePlan("old", "new", run, [events.StageEvent(job=job, state=events.State())])


def test_regrade_never_calls_the_dead_simulator_url_of_the_old_run() -> None:
    import socket

    from shared.cli.lifecycle import resolve_judges
    from shared.control.processes import free_port
    from shared.core import events
    from shared.core.config import Settings

    dead = f"http://127.0.0.1:{free_port()}/v1"  # the old temporary stack's simulator: gone
    with socket.socket() as live:  # the simulator running now
        live.bind(("127.0.0.1", 0))
        live.listen()
        now = f"http://127.0.0.1:{live.getsockname()[1]}/v1"
        spec = events.ModelSpec(model_name="openai/sim-judge", interface="simulator", api_base=dead)
        plan = _regrade_plan(spec)
        assert resolve_judges(plan, Settings(simulator_url=now)) == []
        assert plan.generated[0].job.parsing.api_base == now
        assert plan.generated[0].job.parsing.interface == "simulator"
        nothing = _regrade_plan(spec)
        problems = resolve_judges(nothing, Settings(simulator_url=None))
        assert problems and "no simulator runs now" in problems[0] and "veribus up" in problems[0]


def test_regrade_refuses_a_judge_that_cannot_be_reached_or_has_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.cli.lifecycle import resolve_judges
    from shared.control.processes import free_port
    from shared.core import events
    from shared.core.config import Settings

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    problems = resolve_judges(_regrade_plan(events.ModelSpec(model_name="openai/j", api_base=dead)), Settings())
    assert problems == [f"judge 'openai/j' cannot be reached at {dead}: connection refused"]
    problems = resolve_judges(_regrade_plan(events.ModelSpec(model_name="gpt-4.1-mini")), Settings())
    assert problems and "set OPENAI_API_KEY" in problems[0]
    # a local stack's services make the judge calls: its environment decides, not this process's
    monkeypatch.setenv("OPENAI_API_KEY", "sk-here")
    plan = _regrade_plan(events.ModelSpec(model_name="gpt-4.1-mini"))
    problems = resolve_judges(plan, Settings(), services_environ={"PATH": "/usr/bin"})
    assert problems == ["judge model 'gpt-4.1-mini': OPENAI_API_KEY is set here, but the local stack's services were "
                        "started without it, and they make the model calls: `veribus down`, then `veribus up` with "
                        "OPENAI_API_KEY set"]
    monkeypatch.delenv("OPENAI_API_KEY")
    assert resolve_judges(plan, Settings(), services_environ={"OPENAI_API_KEY": "sk-up"}) == []


# --------------------------------------------------------------------------------------------
# no silent simulator: how models are read from flags and --config
# --------------------------------------------------------------------------------------------


def test_the_simulator_answers_only_when_asked(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    import yaml

    from shared.cli.commands import build_parser
    from shared.cli.run import _is_simulated, _load_config

    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    parser = build_parser()
    plain = parser.parse_args(["run", "b.yaml", "--model", "gpt-4.1-mini", "--judge", "gpt-4.1-mini"])
    assert _is_simulated(plain) is False  # no key is not a reason to simulate (it is refused instead)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "answering_models": [{"model_name": "openai/own", "api_base": "http://gpu-box:8000/v1"},
                             {"model_name": "openai/other"}],
        "parsing_models": [{"model_name": "openai/sim-judge", "interface": "simulator"}]}))
    args = parser.parse_args(["run", "b.yaml", "--config", str(cfg), "--api-base", "http://fallback:9/v1"])
    assert _is_simulated(args) is True  # a `simulator` interface in the config asks for it
    config = _load_config(args, "http://sim-now:1/v1")
    own, other = config.answering_models
    assert (own.api_base, own.interface) == ("http://gpu-box:8000/v1", "litellm")  # used as given
    assert other.api_base == "http://fallback:9/v1"  # --api-base only fills models without one
    judge = config.parsing_models[0]
    assert (judge.interface, judge.api_base) == ("simulator", "http://sim-now:1/v1")
    sim = parser.parse_args(["run", "b.yaml", "--simulate"])
    config = _load_config(sim, "http://sim-now:1/v1")
    assert all(m.interface == "simulator" and m.api_base == "http://sim-now:1/v1"
               for m in config.answering_models + config.parsing_models)


def test_a_cancelled_main_task_is_an_interrupt_not_a_traceback() -> None:
    """What a Ctrl-C landing as `asyncio.run` starts does (CI saw it once): the runner's handler
    cancels the main task before our own handler is installed; `veribus run` must still say
    "interrupted" (KeyboardInterrupt, exit 130), never print a CancelledError traceback."""
    import asyncio

    from shared.cli.aio import run_main

    async def cancelled_at_start() -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        await asyncio.sleep(0)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled_at_start())  # the plain runner lets it out
    with pytest.raises(KeyboardInterrupt):
        run_main(cancelled_at_start())

    async def fine() -> int:
        return 7

    assert run_main(fine()) == 7


_CTRL_C_AS_ASYNCIO_STARTS = """
import asyncio, gc, os, selectors, signal, sys
from shared.cli.aio import run_main
# as started from a terminal: a process started in the background (`cmd &` without job control)
# inherits SIGINT ignored, Python then keeps it ignored, and the interrupt below would do nothing
signal.signal(signal.SIGINT, signal.default_int_handler)
runner, moment = sys.argv[1], sys.argv[2]
runners = {"run_main": run_main, "asyncio.run": asyncio.run}
real_selector, real_getsignal = selectors.DefaultSelector, signal.getsignal
def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
def interrupting_selector():  # the event loop's constructor makes its selector
    ctrl_c()
    return real_selector()
def interrupting_getsignal(signum):  # the runner asks, after it made the main task, before its handler
    if sys._getframe(1).f_code.co_filename.endswith("runners.py"):
        ctrl_c()
    return real_getsignal(signum)
if moment == "loop":
    selectors.DefaultSelector = interrupting_selector
else:
    signal.getsignal = interrupting_getsignal
async def work():
    return 1
try:
    runners[runner](work())
    print("finished")
except KeyboardInterrupt:
    print("interrupted")
selectors.DefaultSelector, signal.getsignal = real_selector, real_getsignal
gc.collect()
print("after", flush=True)
"""


@pytest.mark.parametrize("moment", ["loop", "task"])
@pytest.mark.parametrize("runner", ["run_main", "asyncio.run"])
def test_ctrl_c_as_asyncio_starts_is_a_clean_interrupt(runner: str, moment: str) -> None:
    """A real SIGINT delivered inside the event loop's constructor, or after the runner made the
    main task and before it installed its handler (seen under load: `veribus run` interrupted
    right after "submitted run" printed a traceback from a half-built loop's `__del__` and a
    "never awaited" warning): `run_main` raises KeyboardInterrupt with nothing else on stderr;
    the plain `asyncio.run` is the control, and shows the noise for the loop."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-W", "default", "-c", _CTRL_C_AS_ASYNCIO_STARTS, runner, moment],
                         capture_output=True, text=True, timeout=60, cwd=str(Path(__file__).parents[2]))
    assert out.stdout.split() == ["interrupted", "after"], out.stdout + out.stderr
    noise = ("Traceback", "Exception ignored", "never awaited")
    if runner == "run_main":
        assert not any(n in out.stderr for n in noise), out.stderr
    elif moment == "loop":
        assert any(n in out.stderr for n in noise), "the control no longer shows the race: " + out.stderr
