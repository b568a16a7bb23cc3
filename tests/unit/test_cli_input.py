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
    "result too large for a NATS reply (9000000 bytes, 100000 rows, limit 1047552): add a LIMIT or aggregate",
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
