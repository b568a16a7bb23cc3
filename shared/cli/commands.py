"""`veribus` command line: the local stack, runs, and queries over ClickHouse."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from shared.control.credentials import PROVIDER_KEYS
from shared.core.config import Settings
from shared.core.limits import check_config_size
from shared.core.outcome import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RESULTS_MISSING,
    NO_JOBS_HINT,
    MaxErrors,
)

EXIT_INPUT = EXIT_BAD_INPUT  # the names older callers import
PROVIDER_KEY_VARS = tuple(v for names in PROVIDER_KEYS.values() for v in names)
EXIT_RUN_ERROR = EXIT_RESULTS_MISSING


def _settings():  # noqa: ANN202
    from shared.control.deployment import select

    return select().settings


def _err(msg: str) -> None:
    print(f"veribus: error: {msg}", file=sys.stderr)


def _parse_replicas(items: list[str] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items or []:
        name, _, n = item.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--replicas expects SERVICE=N with N >= 1, got {item!r}")
        out[name] = int(n)
    return out


def cmd_up(args: argparse.Namespace) -> int:
    from shared.control import stack

    settings = _settings()
    sim_args = _simulator_args(args)
    state = stack.up(settings, replicas=_parse_replicas(args.replicas), simulator=not args.no_simulator,
                     simulator_args=sim_args, nats_cluster=args.nats_cluster,
                     extra_env={"VERIBUS_LOG_FORMAT": args.log_format} if args.log_format else None)
    print(f"stack up: nats {state.nats_url}" + (f", simulator {state.simulator_url}" if state.simulator_url else ""))
    restarted = set(state.restarted)
    if args.nats_cluster != state.nats_cluster and len(restarted) < len(state.procs):
        print(f"  note: the running stack has {state.nats_cluster} NATS node(s), not {args.nats_cluster}; "
              "`veribus down` first to change that")
    if len(restarted) < len(state.procs):
        print("  already running; " + (f"restarted: {', '.join(state.restarted)}" if restarted else "nothing to restart"))
    for p in state.procs:
        print(f"  {p.name:<16} pid {p.pid}" + ("  (started)" if p.name in restarted else ""))
    return EXIT_OK


def _simulator_args(args: argparse.Namespace) -> list[str]:
    out = []
    if getattr(args, "sim_latency_ms", None):
        out += ["--latency-ms", str(args.sim_latency_ms)]
    if getattr(args, "sim_error_rate", None):
        out += ["--error-rate", str(args.sim_error_rate)]
    return out


def cmd_down(args: argparse.Namespace) -> int:
    from shared.control import stack

    stopped = stack.down(_settings())
    print("stack down: " + (", ".join(stopped) if stopped else "nothing was running"))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from shared.control import stack

    settings = _settings()
    st = stack.status(settings)
    if os.environ.get("VERIBUS_NATS_URL"):
        from shared.control.deployment import select

        print(select().describe())
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
        from shared.control.runref import RunNotFound, list_runs
        from shared.control.status import format_run_problems, run_problems
        from shared.store.reads import run_query

        try:
            run_id = resolve_run_arg(settings, args.run, stream=False)
        except RunNotFound:
            run_id = args.run  # events without a run row yet (or a foreign run id): show what there is
        res = run_query(settings, "SELECT count() AS results, countIf(ifNull(verify_result, false)) AS passed, "
                                  "countIf(NOT completed_without_errors) AS errors FROM verification_results FINAL "
                                  "WHERE run_id = {run:String}", {"run": run_id})
        row = next((r for r in list_runs(settings, limit=100000) if r["run_id"] == run_id), None)
        state = f"; {row['jobs']} jobs, {row['state']}, name {row['run_name'] or '-'}" if row else ""
        print(f"run {run_id}: " + ", ".join(f"{c}={v}" for c, v in zip(res.columns, res.rows[0], strict=False))
              + state)
        print(format_run_problems(run_problems(settings, run_id)))
    return EXIT_OK


def resolve_run_arg(settings: Any, ref: str, *, stream: bool) -> str:
    """A run id or name -> the run id (the most recent run of a name; said when it is ambiguous)."""
    from shared.control.runref import resolve

    picked = resolve(settings, ref, stream=stream)
    if picked.note:
        _say(f"note: {picked.note}")
    return picked.run_id


def cmd_runs(args: argparse.Namespace) -> int:
    import json

    from shared.control.runref import format_runs, list_runs

    rows = list_runs(_settings(), limit=args.limit)
    if args.format == "json":
        print(json.dumps(rows, indent=2, default=str))
    elif not rows:
        print("no runs yet")
    else:
        print(format_runs(rows))
    return EXIT_OK


def cmd_query(args: argparse.Namespace) -> int:
    from shared.store.reads import format_json, format_table, run_query

    res = run_query(_settings(), args.sql)
    print(format_json(res) if args.format == "json" else format_table(res))
    return EXIT_OK


def cmd_view(args: argparse.Namespace) -> int:
    from shared.cli.view import serve  # aiohttp: only `veribus view` serves HTTP

    return serve(_settings(), host=args.host, port=args.port, open_browser=args.open)


def _read_config_file(args: argparse.Namespace) -> dict[str, Any]:
    """The --config file's mapping ({} without one); raises ValueError naming the file."""
    if not args.config:
        return {}
    path = Path(args.config)
    if not path.exists():
        raise ValueError(f"run config {path} does not exist")
    check_config_size(path.stat().st_size, f"run config {path}")  # InputTooLarge is a ValueError
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"run config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"run config {path} must be a mapping of VerificationConfig fields")
    return data


def _config_uses_simulator(data: dict[str, Any]) -> bool:
    """True when the config names the `simulator` interface for a model (the only way, besides
    --simulate, that the simulator answers)."""
    return any(isinstance(m, dict) and m.get("interface") == "simulator"
               for key in ("answering_models", "parsing_models") for m in data.get(key) or [])


def _load_config(args: argparse.Namespace, simulated_base: str | None):  # noqa: ANN202
    """The run's VerificationConfig from --config and the flags. With --simulate every model
    goes to the simulator at `simulated_base`; otherwise models keep their api_base as given
    (`--api-base` fills it only where a model has none), and `simulator`-interface models of a
    config without an api_base get `simulated_base`."""
    from shared.core.config import VerificationConfig

    data = _read_config_file(args)
    data.pop("gates", None)
    if args.config:
        from shared.runtime.runcontrol import pop_budget

        budget = pop_budget(data)
        if budget is not None and getattr(args, "max_tokens_budget", None) is None:
            args.max_tokens_budget = budget
    from shared.cli import scale as cli_scale

    cli_scale.apply_run_options(args, data)  # --cache, --cache-ttl, --max-cost-usd (and budget_cost_usd)
    if args.model:
        data["answering_models"] = [{"model_name": m} for m in args.model]
    if args.judge:
        data["parsing_models"] = [{"model_name": m} for m in args.judge]
    if args.simulate:
        data.setdefault("answering_models", [{"model_name": "sim-answerer"}])
        data.setdefault("parsing_models", [{"model_name": "sim-judge"}])
    for key in ("answering_models", "parsing_models"):
        models = []
        entries = data.get(key, [])
        if not isinstance(entries, list):
            raise ValueError(f"{key}: expected a list of models, got {type(entries).__name__} {str(entries)[:40]!r}")
        for i, m in enumerate(entries):
            if not isinstance(m, str | dict):
                raise ValueError(f"{key}[{i}]: expected a model name or a mapping of ModelConfig fields, "
                                 f"got {type(m).__name__} {str(m)[:40]!r}")
            m = {"model_name": m} if isinstance(m, str) else dict(m)
            if args.api_base and not args.simulate and m.get("interface") != "simulator":
                m.setdefault("api_base", args.api_base)
            if args.simulate:
                name = str(m["model_name"]).split("/", 1)[-1]
                # interface "simulator": results are labelled as simulated in every row and export
                m.update(model_name=f"openai/{name}", api_base=simulated_base, id=name, interface="simulator")
            elif m.get("interface") == "simulator" and not m.get("api_base"):
                m["api_base"] = simulated_base
            models.append(m)
        data[key] = models
    for flag, field in (("replicates", "replicate_count"), ("mode", "evaluation_mode"), ("run_name", "run_name"),
                        ("strategy", "rubric_evaluation_strategy")):
        val = getattr(args, flag, None)
        if val is not None:
            data[field] = val
    for flag in ("abstention_enabled", "sufficiency_enabled", "embedding_check_enabled", "deep_judgment_enabled"):
        if getattr(args, flag, False):
            data[flag] = True
    return VerificationConfig.model_validate(data)


def _is_simulated(args: argparse.Namespace) -> bool:
    """Only when asked: --simulate, or a `simulator` interface in the config. Never because a
    provider key is missing (that is refused instead)."""
    if args.simulate:
        return True
    try:
        return _config_uses_simulator(_read_config_file(args))
    except ValueError:
        return False


def _models_of(config: Any) -> list[tuple[str, str]]:
    return [(f"{m.interface}:{m.model_name}", m.model_name) for m in config.answering_models]


def _trait_names(benchmark: Any) -> set[str]:
    names: set[str] = set()
    rubrics = [benchmark.global_rubric] + [q.rubric for q in benchmark.questions]
    for rub in rubrics:
        if rub is None:
            continue
        data = rub.model_dump(mode="json")
        for key, traits in data.items():
            if key.endswith("traits") and isinstance(traits, list):
                names.update(str(t["name"]) for t in traits if isinstance(t, dict) and t.get("name"))
    return names


def _validate_run(args: argparse.Namespace, benchmark: Any, simulated: bool):  # noqa: ANN202
    """Every check that needs no bus, before anything starts or is published: config, plan (0 jobs
    is refused with a hint), provider keys, gates (metric, operator, range), --max-errors.
    Returns (config, gates, max_errors); raises ValueError with the message to print."""
    from shared.analysis.gates import check_gates, known_metrics
    from shared.cli import analysis as cli_analysis
    from shared.control import runner
    from shared.control.credentials import config_problems
    from shared.runtime.costcontrol import set_cost_budget
    from shared.runtime.runcontrol import set_budget

    config = _load_config(args, "http://simulator.invalid/v1" if simulated else None)
    plan = runner.plan_run(benchmark, config, include_unfinished=args.include_unfinished)
    set_budget(plan.run_event, args.max_tokens_budget)
    set_cost_budget(plan.run_event, getattr(args, "max_cost_usd", None))
    if plan.job_count == 0:
        raise ValueError(f"{benchmark.name!r}: {NO_JOBS_HINT}")
    problems = config_problems(config)
    if problems:
        raise ValueError("refused before publishing:\n  " + "\n  ".join(problems))
    gates = cli_analysis.validate_run_gates(args)
    check_gates(gates, known_metrics(_trait_names(benchmark)), _models_of(config))
    return config, gates, MaxErrors.parse(getattr(args, "max_errors", None))


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from infra.simulator.from_benchmark import simulator_script_for
    from shared.analysis import report
    from shared.control import deployment, runner, stack
    from shared.core.benchmark.model import Benchmark
    from shared.core.benchmark.question import BenchmarkError

    dep = deployment.select()
    settings = dep.settings
    bench_path = Path(args.benchmark)
    try:
        benchmark = Benchmark.load(bench_path)
    except BenchmarkError as exc:
        _err(str(exc))
        return EXIT_INPUT
    simulated = _is_simulated(args)
    try:
        config, gates, max_errors = _validate_run(args, benchmark, simulated)
    except (ValidationError, ValueError) as exc:
        _err(str(exc))
        return EXIT_INPUT
    for g in gates:
        if not args.quiet or g.note:
            _say(g.understood())
    if simulated and dep.kind == "configured" and not settings.simulator_url:
        _err("--simulate (or a `simulator` model) on a configured deployment needs the simulator's URL as the "
             "services reach it: set VERIBUS_SIMULATOR_URL")
        return EXIT_INPUT
    temporary = dep.kind == "none"
    if temporary:
        _say("deployment: none configured (--nats-url / VERIBUS_NATS_URL) and no local stack running")
        _say("step 1/2: starting a temporary local stack (nats-server, " + ("simulator, " if simulated else "")
             + "7 services); it stops when the run ends ...")
        t0 = time.monotonic()
        state = stack.up(settings, simulator=simulated, simulator_args=_simulator_args(args))
        settings.nats_url = state.nats_url
        settings.simulator_url = state.simulator_url
        _say(f"  temporary stack ready in {time.monotonic() - t0:.1f} s (NATS {state.nats_url}, home {state.home})")
        _say("step 2/2: running")
    else:
        deployment.check_bus(dep)
        _say(dep.describe())
    current: dict[str, Any] = {}
    try:
        if simulated:
            if not settings.simulator_url:
                _err("the running stack has no LLM simulator (started with --no-simulator); restart it with "
                     "`veribus down && veribus up`, or set VERIBUS_SIMULATOR_URL")
                return EXIT_INPUT
            config = _load_config(args, settings.simulator_url)
            script = simulator_script_for(benchmark)
            extra = bench_path.with_name(bench_path.stem + ".simulator.yaml")
            if extra.exists():
                script = _merge_scripts(script, yaml.safe_load(extra.read_text()) or {})
            for base in sorted({m.api_base for m in config.answering_models + config.parsing_models
                                if m.interface == "simulator" and m.api_base}):
                _post_script(base, script)
        trait_ranges = report.trait_ranges_from_benchmark(benchmark)
        runs: list[tuple[list[Any], dict[str, Any]]] = []
        run_ids: list[str] = []
        exit_code = EXIT_OK
        for i in range(args.num_runs):
            if args.num_runs > 1:
                print(f"\n=== run {i + 1} of {args.num_runs} ===")
            results, summary, code, plan = _one_run(settings, benchmark, config, args, simulated, trait_ranges,
                                                    max_errors, current)
            runs.append((results, summary))
            run_ids.append(plan.run_id)
            exit_code = max(exit_code, code)
            if args.output and args.num_runs == 1:
                report.write_outputs(Path(args.output), benchmark.name, plan.run_id, results, summary,
                                     plan.run_event.config, simulated, trait_ranges=trait_ranges)
        if args.output and args.num_runs > 1:
            report.write_multi_run(Path(args.output), runs, suite=benchmark.name, run_ids=run_ids,
                                   config=runner.public_config(config), simulated=simulated,
                                   trait_ranges=trait_ranges)
            if not args.quiet:
                print(f"\naggregate over {args.num_runs} runs written to {args.output}/aggregate_stats.json")
        return exit_code
    except KeyboardInterrupt:
        rid = current.get("run_id")
        if rid is None:
            _err("interrupted before the run was published; nothing was submitted")
        elif not current.get("submitted"):
            _err(f"interrupted while publishing run {rid}: some of its jobs may be queued. `veribus cancel {rid}` "
                 f"stops them; `veribus resume {rid}` publishes the rest"
                 + (" (after `veribus up`: the temporary stack is stopping now)" if temporary else ""))
        elif temporary:
            _err(f"interrupted: run {rid} was submitted; the temporary stack is stopping now, and its unfinished "
                 f"jobs stay queued in {settings.home}/nats. `veribus up` picks them up again (then "
                 f"`veribus status {rid}`); `veribus up && veribus cancel {rid}` drops them.")
        else:
            _err(f"interrupted: run {rid} keeps running on NATS {deployment.mask_url(settings.nats_url)} (the "
                 f"services finish its jobs). Follow it: `veribus status {rid}`; results so far: "
                 f"`veribus results {rid}`; stop it: `veribus cancel {rid}`; re-run missing jobs later: "
                 f"`veribus resume {rid}`.")
        return EXIT_INTERRUPTED
    finally:
        if temporary:
            stack.down(settings)


def _one_run(settings: Any, benchmark: Any, config: Any, args: argparse.Namespace, simulated: bool,
             trait_ranges: dict[str, tuple[float, float]], max_errors: MaxErrors | None = None,
             current: dict[str, Any] | None = None) -> tuple[list[Any], dict[str, Any], int, Any]:
    """Plan, publish, follow and grade one run; returns (results, summary, exit code, plan)."""
    from shared.analysis import report
    from shared.cli import analysis as cli_analysis
    from shared.control import runner
    from shared.core.outcome import judge
    from shared.runtime.costcontrol import set_cost_budget
    from shared.runtime.runcontrol import set_budget

    plan = runner.plan_run(benchmark, config, include_unfinished=args.include_unfinished)
    set_budget(plan.run_event, args.max_tokens_budget)
    set_cost_budget(plan.run_event, getattr(args, "max_cost_usd", None))
    label = " [SIMULATED LLM: answers and judgments come from the offline simulator]" if simulated else ""
    if not args.quiet:
        print(f"run {plan.run_id}: {plan.job_count} jobs ({len(plan.requests)} answers to generate) "
              f"from {benchmark.name!r}{label}" + (f", name {plan.run_name!r}" if plan.run_name else ""), flush=True)
        if plan.unfinished:
            print(f"  {len(plan.unfinished)} unfinished question(s) skipped: {', '.join(plan.unfinished)}")
    if current is not None:
        current.update(run_id=plan.run_id, submitted=False)
    asyncio.run(runner.submit(settings, plan))
    if current is not None:
        current["submitted"] = True
    if not args.quiet:
        print(f"submitted run {plan.run_id}; following its results (Ctrl-C stops following, not the run)",
              flush=True)
    outcome = asyncio.run(_follow(settings, plan, args.timeout, quiet=args.quiet))
    results = list(outcome.results.values())
    summary: dict[str, Any] = {"unfinished_questions_skipped": len(plan.unfinished),
                               "dead_lettered": len(outcome.dead_letters)}
    cli_analysis.apply_gates(args, results, summary, trait_ranges)
    failed_gates = [g["label"] for g in summary.get("gates") or [] if not g["passed"]]
    verdict = judge(results, expected=plan.job_count, timed_out=outcome.timed_out, failed_gates=failed_gates,
                    max_errors=max_errors, run_ref=plan.run_name or plan.run_id)
    # dead letters are reported, never counted as results or errors: only result.finalized ends a
    # job (a service turns a dead letter of a job that cannot finish into its error result), so a
    # forged bad message can neither complete nor fail someone else's run
    summary["outcome"] = verdict.as_dict()
    if outcome.timed_out:
        missing = len(plan.result_ids) - len(results)  # only result.finalized ends a job
        dead = f" ({len(outcome.dead_letters)} dead letter(s))" if outcome.dead_letters else ""
        _err(f"timed out after {args.timeout}s with {missing} job(s) unfinished{dead}; "
             f"results so far are stored; `veribus status {plan.run_id}` shows progress")
    _await_projection(settings, plan.run_id, len(results))
    if args.quiet:
        print(verdict.headline)
    else:
        report.print_results(summary, summary.get("gate_lines") or [], simulated=simulated, run_id=plan.run_id)
    return results, summary, verdict.code, plan


def _merge_scripts(base: dict, extra: dict) -> dict:
    by_match = {q["match"]: q for q in base.get("questions", [])}
    for q in extra.get("questions", []):
        by_match[q["match"]] = {**by_match.get(q["match"], {}), **q}
    return {**base, **{k: v for k, v in extra.items() if k != "questions"}, "questions": list(by_match.values())}


def _post_script(simulator_url: str, script: dict) -> None:
    import httpx

    base = simulator_url.removesuffix("/v1")
    try:
        resp = httpx.post(f"{base}/simulator/script", json=script, timeout=10)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot load the benchmark's script into the simulator at {simulator_url}: {exc}") from exc


async def _follow(settings, plan, timeout: float | None, quiet: bool):  # noqa: ANN001, ANN202
    """Collect the run's results, showing progress on stderr (redrawn on a terminal, a plain line
    every VERIBUS_PROGRESS_INTERVAL_S seconds, default 10, when piped)."""
    from shared.cli.progress import ProgressPrinter, RunProgress
    from shared.control import runner

    expected = set(plan.result_ids)
    if quiet:
        return await _interruptible(runner.collect(settings, plan.run_id, expected, timeout=timeout))
    prog = RunProgress(total=len(expected), started=time.monotonic())
    printer = ProgressPrinter(prog, interval_s=Settings.from_env().progress_interval_s)

    def on_result(result: Any) -> None:
        prog.add(result)
        printer.update()

    def on_tick(retrying: int) -> None:
        prog.retrying = retrying
        printer.update()

    try:
        return await _interruptible(runner.collect(settings, plan.run_id, expected, timeout=timeout,
                                                   on_result=on_result, on_tick=on_tick))
    finally:
        printer.finish()


async def _interruptible(coro: Any) -> Any:
    """Await `coro`; Ctrl-C cancels it and raises KeyboardInterrupt, whatever the libraries
    underneath do with the cancellation (so the caller can say what keeps running)."""
    import signal

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        pass
    try:
        result = await task
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        try:
            loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    if interrupted:
        raise KeyboardInterrupt
    return result


def _await_projection(settings, run_id: str, expected: int, timeout: float = 30.0) -> None:  # noqa: ANN001
    """Wait until the projector has written this run's rows, so queries right after see them."""
    from shared.store.reads import run_query

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            res = run_query(settings, "SELECT count() FROM verification_results FINAL WHERE run_id = {r:String}",
                            {"r": run_id})
            if int(res.rows[0][0]) >= expected:
                return
        except Exception:  # noqa: BLE001 - projector still starting
            pass
        time.sleep(0.2)
    _err(f"the projector has not written all {expected} rows of run {run_id} to ClickHouse yet")


def build_parser() -> argparse.ArgumentParser:
    from shared.cli import analysis as cli_analysis
    from shared.cli import scale as cli_scale

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--nats-url", default=argparse.SUPPRESS, metavar="URL",
                        help="the deployment's NATS server (default: VERIBUS_NATS_URL, else the local stack); "
                             "auth/TLS from VERIBUS_NATS_USER/_PASSWORD/_TOKEN/_TLS_CA")
    common.add_argument("--clickhouse-url", default=argparse.SUPPRESS, metavar="URL",
                        help="a ClickHouse server for results (default: VERIBUS_CLICKHOUSE_URL, else embedded)")
    p = argparse.ArgumentParser(prog="veribus", description=__doc__, parents=[common],
                                epilog=_exit_codes_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    _orig_add_parser = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return _orig_add_parser(name, parents=[common], **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign] - every command takes --nats-url

    up = sub.add_parser("up", help="start the local stack (nats-server, simulator, every service)")
    up.add_argument("--replicas", nargs="*", metavar="SERVICE=N", help="replicas per service, e.g. parsing=3")
    up.add_argument("--no-simulator", action="store_true", help="do not start the LLM simulator")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="run N NATS nodes as one cluster (routes on loopback); stream replicas min(3, N)")
    up.add_argument("--sim-latency-ms", type=float, help="simulator latency per call")
    up.add_argument("--sim-error-rate", type=float, help="simulator injected error rate")
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
    run.add_argument("--replicates", type=int, help="replicates per question x model")
    run.add_argument("--mode", choices=["template_only", "template_and_rubric", "rubric_only"])
    run.add_argument("--strategy", choices=["batch", "sequential"], help="rubric evaluation strategy")
    run.add_argument("--run-name")
    run.add_argument("--config", help="YAML run config (VerificationConfig fields)")
    run.add_argument("--output", help="write header.json, summary.json, results.jsonl here")
    run.add_argument("--simulate", action="store_true", help="use the offline LLM simulator")
    run.add_argument("--sim-latency-ms", type=float, help="simulator latency (temporary stack only)")
    run.add_argument("--sim-error-rate", type=float, help="simulator error rate (temporary stack only)")
    run.add_argument("--abstention", dest="abstention_enabled", action="store_true")
    run.add_argument("--sufficiency", dest="sufficiency_enabled", action="store_true")
    run.add_argument("--embedding-check", dest="embedding_check_enabled", action="store_true")
    run.add_argument("--deep-judgment", dest="deep_judgment_enabled", action="store_true")
    run.add_argument("--include-unfinished", action="store_true",
                     help="also verify questions not marked finished (skipped and counted by default)")
    run.add_argument("--max-tokens-budget", type=int, metavar="N",
                     help="stop dispatching new answers once the run has spent N tokens (also budget_tokens in --config)")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for results")
    run.add_argument("--quiet", action="store_true", help="print only ✓ PASSED / ✗ FAILED: why")
    run.add_argument("--max-errors", metavar="N|F%",
                     help="jobs that may end in error and the run still pass: a count or a share (default: none)")
    cli_analysis.add_run_options(run)
    cli_scale.add_run_options(run)  # --cache, --cache-ttl, --max-cost-usd
    run.set_defaults(fn=cmd_run)

    rs = sub.add_parser("runs", help="list runs: id, name, started, jobs, done, passed, errors, state")
    rs.add_argument("--limit", type=int, default=50)
    rs.add_argument("--format", choices=["table", "json"], default="table")
    rs.set_defaults(fn=cmd_runs)

    q = sub.add_parser("query", help="read-only SQL over the results in ClickHouse")
    q.add_argument("sql")
    q.add_argument("--format", choices=["table", "json"], default="table")
    q.set_defaults(fn=cmd_query)

    cli_analysis.register(sub)  # results, export, report, compare
    v = sub.add_parser("view", help="browse runs, results and comparisons in a local web app")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    v.add_argument("--port", type=int, default=8765, help="port (0: any free port)")
    v.add_argument("--open", action="store_true", help="open the page in a web browser")
    v.set_defaults(fn=cmd_view)

    from shared.cli import lifecycle as cli_lifecycle

    cli_lifecycle.register(sub)  # resume, regrade, cancel, projections rebuild
    cli_scale.register(sub)  # cache clear / info

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
    import subprocess

    return subprocess.run([sys.executable, "-m", "bench", *bench_args], check=False).returncode


BUS_COMMANDS = frozenset({"resume", "regrade", "cancel", "projections"})
READ_COMMANDS = frozenset({"query", "results", "export", "report", "compare", "runs", "status"})


def _exit_codes_text() -> str:
    from shared.core.outcome import EXIT_CODES

    return "exit codes:\n" + "\n".join(f"  {code:>3}  {text}" for code, text in sorted(EXIT_CODES.items()))


def _apply_deployment_flags(args: argparse.Namespace) -> None:
    """--nats-url / --clickhouse-url win over the environment, for this process and what it starts."""
    from shared.control.deployment import FLAG_ENV

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
    from shared.control import deployment

    cmd = args.command
    if cmd in BUS_COMMANDS:
        dep = deployment.select()
        if dep.kind == "none":
            raise deployment.Unreachable(
                f"`veribus {cmd}` needs a running deployment: nothing is configured (--nats-url / "
                "VERIBUS_NATS_URL) and no local stack runs here (start one with `veribus up`)")
        deployment.check_bus(dep)
        _say(dep.describe())
    elif cmd in READ_COMMANDS and not _reads_a_file(args):
        dep = deployment.select()
        if cmd == "status" and not args.run and dep.kind != "configured":
            return  # the local stack's processes: shown by `status` itself
        if dep.kind != "none" and not dep.settings.clickhouse_url:
            deployment.check_bus(dep)  # reads go through the projector on this bus
        _say(dep.describe())


def main(argv: list[str] | None = None) -> int:
    """Entry point: every failure becomes one line on stderr and an exit code from
    `shared.outcome` (VERIBUS_DEBUG=1 re-raises unexpected errors with their traceback)."""
    from shared.control.deployment import Unreachable
    from shared.control.runref import RunNotFound

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option, --help included, belongs to `python -m bench`
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    _apply_deployment_flags(args)
    try:
        _preflight(args)
        return int(args.fn(args))
    except KeyboardInterrupt:
        _err("interrupted; results already finalized are stored")
        return EXIT_INTERRUPTED
    except Unreachable as exc:
        _err(str(exc))
        return EXIT_RESULTS_MISSING
    except (RunNotFound, ValueError, FileNotFoundError) as exc:
        _err(str(exc).strip("'\""))
        return EXIT_INPUT
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback (unless asked)
        if os.environ.get("VERIBUS_DEBUG"):  # Settings.debug, read raw: this handler must not fail itself
            raise
        from shared.control.deployment import mask_url

        text = mask_url(str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        _err(f"{type(exc).__name__}: {text}" if not isinstance(exc, RuntimeError | TimeoutError) or not text
             else text)
        return EXIT_RESULTS_MISSING


if __name__ == "__main__":
    sys.exit(main())
