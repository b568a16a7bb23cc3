"""`veribus` command line: the parser, the entry point `main` (every failure one line on stderr
and an exit code), and the pre-flight check of the deployment a command talks to. The commands
themselves: `stack` (up, down, status, runs, query, view), `run`, `analysis`, `lifecycle`, `scale`."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

from shared.cli import analysis as cli_analysis
from shared.cli import asyncapi as cli_asyncapi
from shared.cli import lifecycle as cli_lifecycle
from shared.cli import scale as cli_scale
from shared.cli.common import SECONDS, NotStored, err, error_text, number_arg, say
from shared.cli.outputs import check_output_paths
from shared.cli.run import cmd_run
from shared.cli.stack import cmd_down, cmd_query, cmd_runs, cmd_status, cmd_up, cmd_view
from shared.control import deployment
from shared.control.deployment import FLAG_ENV, Unreachable, mask_url
from shared.control.runref import RunNotFound
from shared.core.config import Settings
from shared.core.outcome import EXIT_BAD_INPUT, EXIT_CODES, EXIT_INTERRUPTED, EXIT_RESULTS_MISSING

DESCRIPTION = "`veribus` command line: the local stack, runs, and queries over ClickHouse."
LATENCY_MS = number_arg(float, low=0, what=" ms")
RATE = number_arg(float, low=0, high=1)


class Parser(argparse.ArgumentParser):
    """argparse, with a refusal said in one line (`veribus run: error: argument --replicates: must
    be >= 1, got 0`, exit 2) and a pointer to --help instead of the whole usage text before it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--nats-url", default=argparse.SUPPRESS, metavar="URL",
                        help="the deployment's NATS server (default: VERIBUS_NATS_URL, else the local stack); "
                             "auth/TLS from VERIBUS_NATS_USER/_PASSWORD/_TOKEN/_TLS_CA")
    common.add_argument("--clickhouse-url", default=argparse.SUPPRESS, metavar="URL",
                        help="a ClickHouse server for results (default: VERIBUS_CLICKHOUSE_URL, else embedded)")
    p = Parser(prog="veribus", description=DESCRIPTION, parents=[common],
               epilog=_exit_codes_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    _orig_add_parser = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return _orig_add_parser(name, parents=[common], **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign] - every command takes --nats-url

    up = sub.add_parser("up", help="start the local stack (nats-server, simulator, every service)")
    up.add_argument("--replicas", nargs="*", metavar="SERVICE=N", help="replicas per service, e.g. parsing=3")
    up.add_argument("--no-simulator", action="store_true", help="do not start the LLM simulator")
    up.add_argument("--nats-cluster", type=number_arg(int, low=1), default=None, metavar="N",
                    help="run N NATS nodes as one cluster (routes on loopback); stream replicas min(3, N) "
                         "(default: 1 node)")
    up.add_argument("--sim-latency-ms", type=LATENCY_MS, help="simulator latency per call")
    up.add_argument("--sim-error-rate", type=RATE, help="simulator injected error rate (0 to 1)")
    up.add_argument("--log-format", choices=["text", "json"], help="service log lines: text (default) or JSON")
    up.set_defaults(fn=cmd_up)

    down = sub.add_parser("down", help="stop the local stack")
    down.set_defaults(fn=cmd_down)

    st = sub.add_parser("status", help="what runs; with RUN, that run's progress")
    st.add_argument("run", nargs="?", help="run id or run name")
    st.set_defaults(fn=cmd_status)

    run = sub.add_parser("run", help="verify a benchmark end to end")
    run.add_argument("benchmark", help="checkpoint (.jsonld), YAML/JSON benchmark, or CSV")
    run.add_argument("--model", action="append", help="answering model (litellm model string); repeatable")
    run.add_argument("--judge", action="append", help="parsing/judge model; repeatable")
    run.add_argument("--api-base", help="OpenAI-compatible base URL for every model (vLLM, Ollama, ...)")
    run.add_argument("--replicates", type=number_arg(int, low=1), help="replicates per question x model")
    run.add_argument("--mode", choices=["template_only", "template_and_rubric", "rubric_only"],
                     help="what is verified: the answer templates (default), templates and rubric traits, or "
                          "rubric traits only")
    run.add_argument("--strategy", choices=["batch", "sequential"], help="rubric evaluation strategy")
    run.add_argument("--rubric", metavar="FILE",
                     help="add these traits to the benchmark's global rubric (YAML/JSON: a benchmark's `rubric:` "
                          "block), e.g. to run a Question,Answer CSV in rubric_only mode")
    run.add_argument("--run-name", help="a name for the run; RUN arguments take it (its most recent run)")
    run.add_argument("--config", help="YAML run config (VerificationConfig fields)")
    run.add_argument("--output", help="write header.json, summary.json, results.jsonl here")
    run.add_argument("--simulate", action="store_true", help="use the offline LLM simulator")
    run.add_argument("--sim-latency-ms", type=LATENCY_MS, help="simulator latency (temporary stack only)")
    run.add_argument("--sim-error-rate", type=RATE, help="simulator error rate, 0 to 1 (temporary stack only)")
    run.add_argument("--abstention", dest="abstention_enabled", action="store_true",
                     help="judge whether the answer refuses or hedges (an abstention fails it)")
    run.add_argument("--sufficiency", dest="sufficiency_enabled", action="store_true",
                     help="judge whether the answer holds enough to fill the template (template modes)")
    run.add_argument("--embedding-check", dest="embedding_check_enabled", action="store_true",
                     help="a failed verify() may pass when the answer is semantically equivalent")
    run.add_argument("--deep-judgment", dest="deep_judgment_enabled", action="store_true",
                     help="the judge quotes excerpts and reasoning for each template field")
    run.add_argument("--include-unfinished", action="store_true",
                     help="also verify questions not marked finished (skipped and counted by default)")
    run.add_argument("--max-tokens-budget", type=number_arg(int, low=1), metavar="N",
                     help="stop dispatching new answers once the run has spent N tokens (also budget_tokens in --config)")
    run.add_argument("--timeout", type=SECONDS, default=3600.0, help="seconds to wait for results (> 0)")
    run.add_argument("--quiet", action="store_true", help="print only ✓ PASSED / ✗ FAILED: why")
    run.add_argument("--max-errors", metavar="N|F%",
                     help="jobs that may end in error and the run still pass: a count or a share (default: none)")
    cli_analysis.add_run_options(run)
    cli_scale.add_run_options(run)  # --cache, --cache-ttl, --max-cost-usd
    run.set_defaults(fn=cmd_run)

    rs = sub.add_parser("runs", help="list runs: id, name, started, jobs, done, passed, errors, state")
    rs.add_argument("--limit", type=number_arg(int, low=0), default=50, metavar="N",
                    help="the N most recent runs (default 50; 0: every run)")
    rs.add_argument("--format", choices=["table", "json"], default="table", help="table (default) or json")
    rs.set_defaults(fn=cmd_runs)

    q = sub.add_parser("query", help="read-only SQL over the results in ClickHouse")
    q.add_argument("sql", help="one read-only statement, e.g. 'SELECT count() FROM verification_results FINAL'")
    q.add_argument("--format", choices=["table", "json"], default="table", help="table (default) or json")
    q.set_defaults(fn=cmd_query)

    cli_analysis.register(sub)  # results, export, report, compare
    v = sub.add_parser("view", help="browse runs, results and comparisons in a local web app")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    v.add_argument("--port", type=number_arg(int, low=0, high=65535), default=8765, help="port (default 8765; 0: any free port)")
    v.add_argument("--open", action="store_true", help="open the page in a web browser")
    v.set_defaults(fn=cmd_view)


    cli_lifecycle.register(sub)  # resume, regrade, cancel, projections rebuild
    cli_scale.register(sub)  # cache clear / info
    cli_asyncapi.register(sub)  # docs asyncapi

    b = sub.add_parser("bench", add_help=False,
                       help="measure throughput, CPU and memory per service (`python -m bench`; "
                            "`veribus bench --help` lists its options)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    """`veribus bench ...` = `python -m bench ...`: the benchmarks are a separate program (they
    start their own stacks), so the library does not import them."""
    return run_bench(list(args.bench_args))


def run_bench(bench_args: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "bench", *bench_args], check=False).returncode


BUS_COMMANDS = frozenset({"resume", "regrade", "cancel", "projections"})
READ_COMMANDS = frozenset({"query", "results", "export", "report", "compare", "runs", "status"})


def _exit_codes_text() -> str:
    return "exit codes:\n" + "\n".join(f"  {code:>3}  {text}" for code, text in sorted(EXIT_CODES.items()))


def _apply_deployment_flags(args: argparse.Namespace) -> None:
    """--nats-url / --clickhouse-url win over the environment, for this process and what it starts."""
    if getattr(args, "nats_url", None):
        os.environ["VERIBUS_NATS_URL"] = args.nats_url
        os.environ[FLAG_ENV] = args.nats_url
    if getattr(args, "clickhouse_url", None):
        os.environ["VERIBUS_CLICKHOUSE_URL"] = args.clickhouse_url


def _reads_a_file(args: argparse.Namespace) -> bool:
    run = getattr(args, "run", None)
    return bool(run) and Path(run).is_file()


def _preflight(args: argparse.Namespace) -> None:
    """Say which deployment this command talks to, and fail fast (one line, no retries) when
    its bus cannot be reached. `run` does this itself, after checking its input."""
    cmd = args.command
    reads = cmd in READ_COMMANDS and not _reads_a_file(args)
    if cmd not in BUS_COMMANDS and not reads:
        return
    dep = deployment.select()
    if cmd == "status" and not args.run and dep.kind != "configured":
        return  # the local stack's processes: shown by `status` itself
    if dep.kind == "degraded":  # not "no stack": its projector may hold the folder, its bus is gone
        raise deployment.Unreachable(dep.degraded_error())
    if cmd in BUS_COMMANDS:
        if dep.kind == "none":
            raise deployment.Unreachable(
                f"`veribus {cmd}` needs a running deployment: nothing is configured (--nats-url / "
                "VERIBUS_NATS_URL) and no local stack runs here (start one with `veribus up`)")
        deployment.check_bus(dep)
    elif dep.kind != "none" and not dep.settings.clickhouse_url:
        deployment.check_bus(dep)  # reads go through the projector on this bus
    say(dep.describe())


def _debug() -> bool:
    """`Settings.debug` (`VERIBUS_DEBUG`): show the traceback. Read on its own, so that a bad
    value of another variable cannot fail the error handler; a value that is not a boolean
    still asks for the traceback."""
    try:
        return Settings.from_env("debug").debug
    except ValueError:
        return True


EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command killed by SIGPIPE


def main(argv: list[str] | None = None) -> int:
    """Entry point: every failure becomes one line on stderr and an exit code from
    `shared.core.outcome` (VERIBUS_DEBUG=1 re-raises unexpected errors with their traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option, --help included, belongs to `python -m bench`
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    _apply_deployment_flags(args)
    try:
        check_output_paths(args)  # bad input, refused before a deployment is asked or anything runs
        _preflight(args)
        return int(args.fn(args))
    except KeyboardInterrupt:
        err("interrupted; results already finalized are stored")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): no error line for that, the shell's code
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more at exit either
        return EXIT_BROKEN_PIPE
    except (Unreachable, NotStored) as exc:  # the deployment, or the rows it should have: exit 3
        err(str(exc))
        return EXIT_RESULTS_MISSING
    except (RunNotFound, ValueError, FileNotFoundError) as exc:  # a pydantic ValidationError is a ValueError
        text = error_text(exc)
        quoted = len(text) > 1 and text[0] == text[-1] and text[0] in "'\""  # a KeyError's str() is its repr
        err(text[1:-1] if quoted else text)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback (unless asked)
        if _debug():
            raise

        text = mask_url(str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        err(f"{type(exc).__name__}: {text}" if not isinstance(exc, RuntimeError | TimeoutError) or not text
             else text)
        return EXIT_RESULTS_MISSING


if __name__ == "__main__":
    sys.exit(main())
