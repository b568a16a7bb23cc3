"""`veribus up`, `down`, `status`, `runs`, `query` and `view`: the local stack and what runs
on the deployment."""

from __future__ import annotations

import argparse
import json
import re

from shared.cli.common import deployment_settings, err, resolve_run_arg, say, stale_store, unstored
from shared.control import stack
from shared.control.deployment import mask_url, select
from shared.control.runref import format_runs, list_runs
from shared.control.status import format_run_problems, run_counts, run_problems
from shared.core.config import Settings
from shared.core.outcome import EXIT_BAD_INPUT, EXIT_OK, EXIT_RESULTS_MISSING
from shared.core.verdict import NO_TEMPLATE_VERDICTS, has_verdicts
from shared.store.reads import QueryError, format_json, format_table, run_query
from shared.store.sql_guard import RESULT_TOO_LARGE


def _parse_replicas(items: list[str] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items or []:
        name, _, n = item.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--replicas expects SERVICE=N with N >= 1, got {item!r}")
        out[name] = int(n)
    return out


def _refuse_nats_url(args: argparse.Namespace) -> None:
    """`up` and `down` act on the local stack only: a --nats-url given to them would be ignored
    (`up` started a local stack with its own NATS anyway), so it is refused (exit 2), saying
    what the command does and what to use for an existing deployment."""
    url = getattr(args, "nats_url", None)
    if not url:
        return
    shown = mask_url(url)
    if args.command == "up":
        raise ValueError(
            f"`veribus up` takes no --nats-url: it starts a local stack with its own NATS server (nats-server, "
            f"simulator, every service, in VERIBUS_HOME), never one on {shown}. For an existing deployment start "
            f"nothing here: run its services where it runs (e.g. docker-compose) and pass --nats-url {shown} (or "
            "VERIBUS_NATS_URL) to the commands that use it: run, status, runs, query, results, report, view, ...")
    raise ValueError(
        f"`veribus down` takes no --nats-url: it stops the local stack of VERIBUS_HOME, never a deployment on "
        f"{shown}; stop that where it runs (e.g. `docker compose down`)")


def cmd_up(args: argparse.Namespace) -> int:
    _refuse_nats_url(args)
    settings = deployment_settings()
    sim_args = simulator_args(args)
    replicas = _parse_replicas(args.replicas)
    state = stack.up(settings, replicas=replicas, simulator=not args.no_simulator,
                     simulator_args=sim_args, nats_cluster=args.nats_cluster or 1,
                     extra_env={"VERIBUS_LOG_FORMAT": args.log_format} if args.log_format else None)
    print(f"stack up: nats {state.nats_url}" + (f", simulator {state.simulator_url}" if state.simulator_url else ""))
    for note in state.notes:  # a port the stack had before `down` that another program has taken
        print(f"  note: {note}")
    restarted = set(state.restarted)
    if len(restarted) < len(state.procs):  # a stack that ran already: what was asked and is not so
        for line in _not_applied(args, replicas, sim_args, state):
            print(f"  note: {line}; `veribus down` first to change that")
        print("  already running; " + (f"restarted: {', '.join(state.restarted)}" if restarted else "nothing to restart"))
    for p in state.procs:
        print(f"  {p.name:<16} pid {p.pid}" + ("  (started)" if p.name in restarted else ""))
    return EXIT_OK


def _not_applied(args: argparse.Namespace, replicas: dict[str, int], sim_args: list[str],
                 state: stack.StackState) -> list[str]:
    """The options of this `up` that a stack already running does not have (it is healed, never
    rebuilt): one line each, naming what runs. Only options given are compared (`up` alone
    heals whatever shape the stack has)."""
    out = []
    if args.nats_cluster is not None and args.nats_cluster != state.nats_cluster:
        out.append(f"the running stack has {state.nats_cluster} NATS node(s), not {args.nats_cluster}")
    for name, n in sorted(replicas.items()):
        have = len(state.replicas_of(name))
        if have != n:
            out.append(f"the running stack has {have} {name} process(es), not {n} (--replicas {name}={n})")
    sim = next((p for p in state.procs if p.name == "simulator"), None)
    if args.no_simulator and sim is not None:
        out.append("the running stack has its LLM simulator (--no-simulator)")
    if sim is not None:
        running = sim.cmd[sim.cmd.index("--port") + 2:] if "--port" in sim.cmd else []
        for flag, value in zip(sim_args[::2], sim_args[1::2], strict=True):
            now = running[running.index(flag) + 1] if flag in running[:-1] else "its default"
            if _number(now) != _number(value):
                out.append(f"the running simulator has {flag} {now}, not {value} "
                           f"(--sim-{flag.removeprefix('--')})")
    return out


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def simulator_args(args: argparse.Namespace) -> list[str]:
    out = []
    if getattr(args, "sim_latency_ms", None):
        out += ["--latency-ms", str(args.sim_latency_ms)]
    if getattr(args, "sim_error_rate", None):
        out += ["--error-rate", str(args.sim_error_rate)]
    return out


def cmd_down(args: argparse.Namespace) -> int:
    _refuse_nats_url(args)
    dep = select()
    if dep.kind == "local":  # its NATS runs: say what is in flight (a few stream reads, never a refusal)
        for line in in_flight_lines(stack.in_flight(dep.settings), dep.settings.consumer_ack_wait_s):
            say(line)
    stopped = stack.down(dep.settings)
    print("stack down: " + (", ".join(stopped) if stopped else "nothing was running"))
    return EXIT_OK


def in_flight_lines(flight: stack.InFlight | None, ack_wait_s: float) -> list[str]:
    """What `down` says (on stderr) before it stops a stack with work in flight: which runs
    have jobs without a result, and what becomes of them. Nothing when nothing is in flight."""
    if flight is None:
        return ["note: could not tell whether runs are in flight (the stack's NATS did not answer in time); "
                "stopping anyway"]
    if not flight.queued:
        return []
    shown = [f"{r.run_name or r.run_id} ({r.done} of {r.jobs} jobs have a result; run {r.run_id})"
             for r in flight.runs[:5]]
    more = len(flight.runs) - len(shown)
    if shown:
        head = (f"warning: {len(flight.runs)} run(s) still in flight: " + "; ".join(shown)
                + (f"; and {more} more" if more else "") + f"; {flight.queued} message(s) queued for the services")
    else:
        head = f"warning: work still in flight: {flight.queued} message(s) queued for the services"
    if flight.partial:
        head += " (not every run was looked at in time: `veribus runs` lists them)"
    return [
        head,
        "  stopping anyway: their jobs stay in the event stream (in VERIBUS_HOME), and `veribus up` from this home "
        "takes them up where they stopped. Jobs the services are still working on get a few seconds to finish; "
        "the rest are handed back and made again after `up` (those of a service that cannot hand them back, "
        f"killed or cut off from NATS, after the consumers' ack wait, {ack_wait_s:g} s); the simulator comes back "
        "on the same port with its script. No `veribus resume` is needed.",
        "  a `veribus run` following one of them stops waiting now (exit 3): after `veribus up`, `veribus status "
        "RUN` shows its progress",
    ]


def cmd_status(args: argparse.Namespace) -> int:
    settings = deployment_settings()
    st = stack.status(settings)
    if Settings.given("nats_url"):
        dep = select()
        print(dep.describe())
        print("\n".join(dep.describe_services()))
    elif not st["procs"]:
        print("stack: not running")
    else:
        print(f"stack: {st['state']} (nats {st['nats_url']}, home {st['home']})")
        for p in st["procs"]:
            extra = f" rss {p.get('rss_mb')} MB cpu {p.get('cpu_s')} s" if p["alive"] else ""
            if p.get("metrics_port"):
                extra += f" metrics http://127.0.0.1:{p['metrics_port']}/metrics"
            print(f"  {p['name']:<16} pid {p['pid']:<8} {'up' if p['alive'] else 'DEAD'}{extra}")
        if st["dead"]:
            print(f"  dead: {', '.join(st['dead'])}; `veribus up` restarts them")
    if st["orphans"]:
        print(f"  orphans (not in stack.json): pids {', '.join(map(str, st['orphans']))}; `veribus down` stops them")
    if args.run:
        # a run ClickHouse does not know is looked up in the stream: NotStored (exit 3) when only the
        # stream has it, RunNotFound (exit 2: "no run 'X'") when neither does
        run_id = resolve_run_arg(settings, args.run, stream=False)
        counts = run_counts(settings, run_id)
        row = next((r for r in list_runs(settings, limit=100000) if r["run_id"] == run_id), None)
        state = f"; {row['jobs']} jobs, {row['state']}, name {row['run_name'] or '-'}" if row else ""
        if row and row.get("resumed"):
            state += f"; {row['resumed']} job(s) being run again by a resume (counted above by their earlier results until they end)"
        shown: dict[str, object] = dict(counts)
        if row and not has_verdicts(row.get("mode")):  # no template verdicts to count: never "passed=0"
            shown.update(passed="-", failed="-")
            state += f"\n  {NO_TEMPLATE_VERDICTS}"
        print(f"run {run_id}: " + ", ".join(f"{c}={v}" for c, v in shown.items()) + state)
        print(format_run_problems(run_problems(settings, run_id)))
        behind = unstored(run_id)
        if behind:  # the counts above are ClickHouse's: say what the stream holds beyond them
            err(behind)
            return EXIT_RESULTS_MISSING
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    rows = list_runs(deployment_settings(), limit=args.limit)
    if args.format == "json":
        print(json.dumps(rows, indent=2, default=str))
    elif not rows:
        print("no runs yet")
    else:
        print(format_runs(rows))
    stale = stale_store(select())
    if stale:  # the counts above will not catch up by themselves
        err(stale)
        return EXIT_RESULTS_MISSING
    return EXIT_OK


def cmd_query(args: argparse.Namespace) -> int:
    try:
        res = run_query(deployment_settings(), args.sql)
    except QueryError as exc:
        err(str(exc))
        return query_error_code(str(exc))
    print(format_json(res) if args.format == "json" else format_table(res))
    stale = stale_store(select())
    if stale:  # the rows above are what ClickHouse has; it lacks what the stream holds beyond them
        err(stale)
        return EXIT_RESULTS_MISSING
    return EXIT_OK


# engine errors that are the query's own fault (its text, names, types or arguments): bad input
BAD_QUERY_ERRORS = frozenset({
    "SYNTAX_ERROR", "UNKNOWN_IDENTIFIER", "UNKNOWN_TABLE", "UNKNOWN_DATABASE", "UNKNOWN_FUNCTION",
    "UNKNOWN_AGGREGATE_FUNCTION", "UNKNOWN_TYPE", "UNKNOWN_SETTING", "UNKNOWN_QUERY_PARAMETER",
    "BAD_QUERY_PARAMETER", "NO_SUCH_COLUMN_IN_TABLE", "NOT_FOUND_COLUMN_IN_BLOCK", "THERE_IS_NO_COLUMN",
    "AMBIGUOUS_COLUMN_NAME", "AMBIGUOUS_IDENTIFIER", "MULTIPLE_EXPRESSIONS_FOR_ALIAS", "ILLEGAL_TYPE_OF_ARGUMENT",
    "ILLEGAL_COLUMN", "TYPE_MISMATCH", "NO_COMMON_TYPE", "NUMBER_OF_ARGUMENTS_DOESNT_MATCH",
    "TOO_FEW_ARGUMENTS_FOR_FUNCTION", "TOO_MANY_ARGUMENTS_FOR_FUNCTION", "BAD_ARGUMENTS", "ILLEGAL_AGGREGATION",
    "NOT_AN_AGGREGATE", "CANNOT_PARSE_TEXT", "CANNOT_PARSE_NUMBER", "CANNOT_PARSE_DATE", "CANNOT_PARSE_DATETIME",
    "CANNOT_PARSE_INPUT_ASSERTION_FAILED", "CANNOT_CONVERT_TYPE", "ARGUMENT_OUT_OF_BOUND", "ILLEGAL_DIVISION",
    "INCORRECT_QUERY", "EMPTY_QUERY", "READONLY", "ACCESS_DENIED", "SUPPORT_IS_DISABLED", "NOT_IMPLEMENTED",
    "FUNCTION_NOT_ALLOWED", "UNSUPPORTED_METHOD", "ILLEGAL_PREWHERE", "ILLEGAL_FINAL",
    "INVALID_JOIN_ON_EXPRESSION", "UNKNOWN_JOIN", "DUPLICATE_COLUMN", "INVALID_LIMIT_EXPRESSION",
    # what the query asked for is refused by the function itself: its own input is at fault
    "FUNCTION_THROW_IF_VALUE_IS_NON_ZERO", "TOO_LARGE_STRING_SIZE", "TOO_LARGE_ARRAY_SIZE", "TOO_SLOW",
    "PARAMETER_OUT_OF_BOUND", "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE", "DECIMAL_OVERFLOW", "SIZES_OF_ARRAYS_DONT_MATCH",
    "ZERO_ARRAY_OR_TUPLE_INDEX", "INCORRECT_ELEMENT_OF_SET", "TOO_DEEP_AST", "TOO_BIG_AST", "UNEXPECTED_EXPRESSION",
    "CANNOT_PARSE_ESCAPE_SEQUENCE", "CANNOT_PARSE_QUOTED_STRING", "CANNOT_PARSE_BOOL", "CANNOT_PARSE_UUID",
    "ILLEGAL_TYPE_OF_COLUMN_FOR_FILTER", "BAD_TYPE_OF_FIELD",
})


def query_error_code(message: str) -> int:
    """The exit code of a query that failed: 2 (bad input) when the query itself is at fault
    (refused as not read-only, not parsed, a name, type or argument the engine rejects, a result
    too large to send back), 3 when the store is (unreachable, no answer in time, a limit on time
    or memory, a folder it cannot open)."""
    if message.startswith(("refused:", RESULT_TOO_LARGE)):
        return EXIT_BAD_INPUT
    if "Unable to open the chdb engine" in message or "Cannot lock file" in message:
        return EXIT_RESULTS_MISSING  # the folder (held by another process): whatever code it names
    named = re.findall(r"\(([A-Z][A-Z_]+)\)", message)
    return EXIT_BAD_INPUT if named and named[-1] in BAD_QUERY_ERRORS else EXIT_RESULTS_MISSING


def cmd_view(args: argparse.Namespace) -> int:
    from shared.cli.view import serve  # local import: aiohttp.web; only `veribus view` serves HTTP

    return serve(deployment_settings(), host=args.host, port=args.port, open_browser=args.open)

