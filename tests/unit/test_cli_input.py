"""Bad input to the `veribus` command line is refused while the command line is read (exit 2,
naming the option and what it takes), before any deployment is asked or anything is published;
a query that fails is exit 2 when the query is at fault and 3 only when the store is. No bus, no
store: the parser and the classification alone (the commands against a real stack are in
tests/integration/test_honest_cli.py and test_cli_degraded.py)."""

from __future__ import annotations

import pytest

from shared.cli.commands import build_parser, main
from shared.cli.stack import query_error_code


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The argparse refusal of `argv`: exit 2, and its message."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "0", "-0.5", "nan", "inf", "soon"])
def test_a_run_timeout_that_is_not_a_positive_number_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["run", "bench.yaml", "--simulate", "--timeout", value], capsys)
    assert "argument --timeout:" in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "says"), [
    (["run", "b.yaml", "--replicates", "0"], "argument --replicates: must be >= 1"),
    (["run", "b.yaml", "--max-tokens-budget", "-5"], "argument --max-tokens-budget: must be >= 1"),
    (["run", "b.yaml", "--sim-error-rate", "1.5"], "argument --sim-error-rate: must be <= 1"),
    (["run", "b.yaml", "--sim-latency-ms", "-1"], "argument --sim-latency-ms: must be >= 0 ms"),
    (["cancel", "r", "--wait", "--timeout", "-1"], "argument --timeout: must be > 0 seconds"),
    (["resume", "r", "--timeout", "0"], "argument --timeout: must be > 0 seconds"),
    (["regrade", "r", "--timeout", "-3"], "argument --timeout: must be > 0 seconds"),
    (["projections", "rebuild", "--timeout", "0"], "argument --timeout: must be > 0 seconds"),
    (["up", "--nats-cluster", "0"], "argument --nats-cluster: must be >= 1"),
    (["view", "--port", "70000"], "argument --port: must be <= 65535"),
    (["export", "r", "-o", "x.json", "--page-size", "0"], "argument --page-size: must be >= 1"),
])
def test_numeric_options_out_of_range_are_refused(argv: list[str], says: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert says in refused(argv, capsys)


def test_runs_limit_negative_is_refused_and_0_means_every_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --limit: must be >= 0, got -1" in refused(["runs", "--limit", "-1"], capsys)
    assert build_parser().parse_args(["runs", "--limit", "0"]).limit == 0
    assert build_parser().parse_args(["runs"]).limit == 50
    help_text = build_parser()._subparsers._group_actions[0].choices["runs"].format_help()  # noqa: SLF001
    assert "0: every run" in help_text


def test_results_by_an_unknown_grouping_is_refused_naming_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["results", "some-run", "--by", "nosuchcol"], capsys)
    assert "argument --by: cannot group by 'nosuchcol': use one of answering_model, parsing_model, question_id, " \
           "replicate, run_name, template_id" in err
    assert "KeyError" not in err and "columns are" not in err
    assert build_parser().parse_args(["results", "r", "--by", "judge"]).by == "parsing_model"  # an alias
    assert build_parser().parse_args(["results", "r", "--by", "replicate"]).by == "replicate"


def test_refusals_come_before_any_deployment_is_asked(tmp_path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A bus that cannot be reached would be exit 3: the bad option is found first (exit 2)."""
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path))
    monkeypatch.setenv("VERIBUS_NATS_URL", "nats://127.0.0.1:9")
    with pytest.raises(SystemExit) as exc:
        main(["run", str(tmp_path / "b.yaml"), "--simulate", "--timeout", "-1"])
    assert exc.value.code == 2
    assert "cannot reach" not in capsys.readouterr().err


@pytest.mark.parametrize("message", [
    "refused: only SELECT/WITH/SHOW/DESCRIBE/EXPLAIN queries are allowed, not 'DROP'",
    "refused: only one statement is allowed",
    "refused: empty query",
    "refused: function file() is not allowed in a read-only query",
    "refused: the engine does not accept this query: Syntax error: failed at position 11",
    "DatabaseError: Code: 47. DB::Exception: Unknown expression identifier `nosuchcol`. (UNKNOWN_IDENTIFIER)",
    "DatabaseError: Code: 60. DB::Exception: Unknown table expression identifier 'x'. (UNKNOWN_TABLE)",
    "DatabaseError: Code: 62. DB::Exception: Syntax error: failed at position 1. (SYNTAX_ERROR)",
    "DatabaseError: Code: 46. DB::Exception: Function with name `nosuch` does not exist. (UNKNOWN_FUNCTION)",
    # the engine's own words for a query whose function refused its input (exit 3 before: "the store's fault")
    "Code: 395. DB::Exception: Value passed to 'throwIf' function is non-zero: while executing 'FUNCTION "
    "throwIf(1_UInt8 :: 1) -> throwIf(1_UInt8) UInt8 : 2'. (FUNCTION_THROW_IF_VALUE_IS_NON_ZERO)",
    "Code: 131. DB::Exception: Too many times to repeat (100000000), maximum is: 1000000: In scope SELECT "
    "repeat('a', 100000000). (TOO_LARGE_STRING_SIZE)",
    "Code: 160. DB::Exception: The maximum sleep time is 3000000 microseconds. Requested: 5000000 microseconds: "
    "while executing 'FUNCTION sleep(5_UInt8 :: 1) -> sleep(5_UInt8) UInt8 : 2'. (TOO_SLOW)",
    "result too large for a NATS reply (9000000 bytes, 100000 rows, limit 1047552): add a LIMIT or aggregate",
    "result too large: it passed 1,047,552 bytes of JSON within its first 8,192 rows and was stopped: add a LIMIT "
    "or aggregate",  # the byte budget of a streamed result (the projector's reply, VERIBUS_QUERY_RESULT_MB)
])
def test_a_query_at_fault_is_bad_input(message: str) -> None:
    assert query_error_code(message) == 2


@pytest.mark.parametrize("message", [
    "the projector did not answer within 35 s",
    "DatabaseError: Code: 159. DB::Exception: Timeout exceeded: elapsed 30 seconds. (TIMEOUT_EXCEEDED)",
    "DatabaseError: Code: 241. DB::Exception: Memory limit exceeded. (MEMORY_LIMIT_EXCEEDED)",
    "ProgrammingError: Unable to open the chdb engine at '/x/chdb': Failed to create connection: Code: 36. "
    "DB::Exception: Error initializing EmbeddedServer: . (BAD_ARGUMENTS)",  # a folder another process holds
    "NATS request to the projector failed: ConnectionClosedError: ",
])
def test_a_store_at_fault_is_exit_3(message: str) -> None:
    assert query_error_code(message) == 3


EXAMPLE = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "example.yaml")


def one_line_refusal(argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path,  # noqa: ANN001
                     capsys: pytest.CaptureFixture[str]) -> str:
    """`veribus ARGV` with no deployment: refused with exit 2 and one line, no pydantic dump."""
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    try:
        code = main(argv)
    except SystemExit as exc:  # refused while the command line is read
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "pydantic" not in err and "Traceback" not in err and "type=" not in err, err
    return err


@pytest.mark.parametrize(("argv", "says"), [
    (["--model", "openai/x"], "veribus: error: --judge: at least one parsing (judge) model is required\n"),
    ([], "--model: at least one answering model is required; --judge: at least one parsing (judge) model"),
    (["--model", "openai/x", "--judge", "openai/j", "--replicates", "2000"], "--replicates: must be <= 1000, got 2000"),
    (["--model", "openai/x", "--judge", "openai/j", "--cache-ttl", "nan"], "--cache-ttl: must be > 0, got nan"),
    (["--model", " ", "--judge", "openai/j"], "--model: model_name must not be empty"),
    (["--model", "openai/x", "--replicates", "0"], "argument --replicates: must be >= 1, got 0"),
])
def test_a_run_option_the_config_refuses_is_one_line_naming_the_option(
        argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch, tmp_path,  # noqa: ANN001
        capsys: pytest.CaptureFixture[str]) -> None:
    assert says in one_line_refusal(["run", EXAMPLE, *argv], monkeypatch, tmp_path, capsys)


def test_a_bad_run_config_field_is_named_with_its_file_and_an_option_wins_over_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    cfg = tmp_path / "run.yaml"
    cfg.write_text("replicate_count: 0\nanswering_models:\n  - model_name: openai/a\n    timeout: -1\nfoo: 1\n")
    base = ["run", EXAMPLE, "--judge", "openai/j", "--config", str(cfg)]
    said = one_line_refusal(base, monkeypatch, tmp_path, capsys)
    assert f"replicate_count in {cfg}: must be >= 1, got 0" in said
    assert f"answering_models.0.timeout in {cfg}: must be > 0, got -1" in said
    assert f"foo in {cfg}: not a VerificationConfig field" in said
    said = one_line_refusal([*base, "--replicates", "5000"], monkeypatch, tmp_path, capsys)
    assert "--replicates: must be <= 1000, got 5000" in said and "replicate_count in" not in said


def test_any_validation_error_reaching_the_entry_point_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Not only `run`: a command whose input fails a pydantic model is said the same way, exit 2."""
    from shared.core.config import ModelConfig

    def bad(_args: object) -> int:
        ModelConfig(model_name="m", max_concurrency=0, limit_scope="nowhere")
        return 0

    monkeypatch.setattr("shared.cli.commands.cmd_down", bad)
    assert main(["down"]) == 2
    err = capsys.readouterr().err
    assert err == ("veribus: error: max_concurrency: must be >= 1, got 0; limit_scope: must be 'model' or "
                   "'endpoint', got 'nowhere'\n")


def test_every_option_of_every_command_says_what_it_does() -> None:
    """`veribus <command> --help` gives each option a line of help (run's --mode, --abstention,
    --sufficiency, --embedding-check, --deep-judgment and --run-name, query's SQL, the lifecycle
    commands' --timeout had none); `bench` passes its arguments on to `python -m bench`."""
    import argparse

    silent: list[str] = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if name != "bench":
                        walk(sub, [*path, name])
            elif action.help is None and not isinstance(action, argparse._HelpAction):
                silent.append(" ".join([*path, *(action.option_strings[:1] or [action.dest])]))

    walk(build_parser(), ["veribus"])
    assert silent == []
    assert "default 8765" in build_parser()._subparsers._group_actions[0].choices["view"].format_help()
