"""`veribus` command line: the local stack, runs, and queries over ClickHouse."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import ValidationError

from infra.simulator.from_benchmark import simulator_script_for
from shared.analysis import report
from shared.cli import analysis as cli_analysis
from shared.cli import lifecycle as cli_lifecycle
from shared.cli import scale as cli_scale
from shared.control import runner, stack
from shared.control.stack import stack_settings
from shared.control.status import format_run_problems, run_problems
from shared.core.benchmark.model import Benchmark
from shared.core.benchmark.question import BenchmarkError
from shared.core.config import VerificationConfig
from shared.runtime.costcontrol import set_cost_budget
from shared.runtime.runcontrol import pop_budget, set_budget
from shared.store.reads import format_json, format_table, run_query

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_INPUT = 2
EXIT_RUN_ERROR = 3

PROVIDER_KEY_VARS = (
    "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "MISTRAL_API_KEY",
    "GROQ_API_KEY", "TOGETHERAI_API_KEY", "DEEPSEEK_API_KEY", "OPENROUTER_API_KEY", "AZURE_API_KEY",
    "COHERE_API_KEY", "XAI_API_KEY", "FIREWORKS_AI_API_KEY",
)


def _settings():  # noqa: ANN202

    return stack_settings()


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
    settings = _settings()
    sim_args = _simulator_args(args)
    state = stack.up(settings, replicas=_parse_replicas(args.replicas), simulator=not args.no_simulator,
                     simulator_args=sim_args,
                     extra_env={"VERIBUS_LOG_FORMAT": args.log_format} if args.log_format else None)
    print(f"stack up: nats {state.nats_url}" + (f", simulator {state.simulator_url}" if state.simulator_url else ""))
    for p in state.procs:
        print(f"  {p.name:<16} pid {p.pid}")
    return EXIT_OK


def _simulator_args(args: argparse.Namespace) -> list[str]:
    out = []
    if getattr(args, "sim_latency_ms", None):
        out += ["--latency-ms", str(args.sim_latency_ms)]
    if getattr(args, "sim_error_rate", None):
        out += ["--error-rate", str(args.sim_error_rate)]
    return out


def cmd_down(args: argparse.Namespace) -> int:
    stopped = stack.down(_settings())
    print("stack down: " + (", ".join(stopped) if stopped else "nothing was running"))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    settings = _settings()
    st = stack.status(settings)
    if not st["running"]:
        print("stack: not running")
    else:
        print(f"stack: running (nats {st['nats_url']}, home {st['home']})")
        for p in st["procs"]:
            extra = f" rss {p.get('rss_mb')} MB cpu {p.get('cpu_s')} s" if p["alive"] else ""
            if p.get("metrics_port"):
                extra += f" metrics http://127.0.0.1:{p['metrics_port']}/metrics"
            print(f"  {p['name']:<16} pid {p['pid']:<8} {'up' if p['alive'] else 'DOWN'}{extra}")
    if args.run:
        sql = (
            "SELECT count() AS results, countIf(verify_result) AS passed, countIf(NOT completed_without_errors) "
            "AS errors FROM verification_results FINAL WHERE run_id = {run:String} OR run_name = {run:String}"
        )
        res = run_query(settings, sql, {"run": args.run})
        print(f"run {args.run}: " + ", ".join(f"{c}={v}" for c, v in zip(res.columns, res.rows[0], strict=False)))

        print(format_run_problems(run_problems(settings, args.run)))
    return EXIT_OK


def cmd_query(args: argparse.Namespace) -> int:
    res = run_query(_settings(), args.sql)
    print(format_json(res) if args.format == "json" else format_table(res))
    return EXIT_OK


def cmd_view(args: argparse.Namespace) -> int:
    from shared.cli.view import serve  # aiohttp: only `veribus view` serves HTTP

    return serve(_settings(), host=args.host, port=args.port, open_browser=args.open)


def _load_config(args: argparse.Namespace, simulated_base: str | None):  # noqa: ANN202

    data: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.exists():
            raise ValueError(f"run config {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"run config {path} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"run config {path} must be a mapping of VerificationConfig fields")
        data.pop("gates", None)

        budget = pop_budget(data)
        if budget is not None and getattr(args, "max_tokens_budget", None) is None:
            args.max_tokens_budget = budget
    cli_scale.apply_run_options(args, data)  # --cache, --cache-ttl, --max-cost-usd (and budget_cost_usd)
    if args.model:
        data["answering_models"] = [{"model_name": m} for m in args.model]
    if args.judge:
        data["parsing_models"] = [{"model_name": m} for m in args.judge]
    if simulated_base is not None:
        data.setdefault("answering_models", [{"model_name": "sim-answerer"}])
        data.setdefault("parsing_models", [{"model_name": "sim-judge"}])
    for key in ("answering_models", "parsing_models"):
        models = []
        for m in data.get(key, []):
            m = {"model_name": m} if isinstance(m, str) else dict(m)
            if args.api_base:
                m.setdefault("api_base", args.api_base)
            if simulated_base is not None:
                name = m["model_name"].split("/", 1)[-1]
                # interface "simulator": results are labelled as simulated in every row and export
                m.update(model_name=f"openai/{name}", api_base=simulated_base, id=name, interface="simulator")
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
    if args.simulate:
        return True
    if args.api_base:
        return False
    if any(os.environ.get(v) for v in PROVIDER_KEY_VARS):
        return False
    return True


def cmd_run(args: argparse.Namespace) -> int:

    settings = _settings()
    bench_path = Path(args.benchmark)
    try:
        benchmark = Benchmark.load(bench_path)
    except BenchmarkError as exc:
        _err(str(exc))
        return EXIT_INPUT
    simulated = _is_simulated(args)
    try:
        # validate everything before anything starts or is published
        config = _load_config(args, "http://simulator.invalid/v1" if simulated else None)
        probe = runner.plan_run(benchmark, config, include_unfinished=args.include_unfinished).run_event
        set_budget(probe, args.max_tokens_budget)
        set_cost_budget(probe, getattr(args, "max_cost_usd", None))
        cli_analysis.validate_run_gates(args)
    except (ValidationError, ValueError) as exc:
        _err(str(exc))
        return EXIT_INPUT

    state = stack.running_stack(settings)
    temporary = state is None
    if temporary:
        print("starting a temporary local stack (stopped when the run ends) ...", file=sys.stderr)
        state = stack.up(settings, simulator=simulated, simulator_args=_simulator_args(args))
    settings.nats_url = state.nats_url
    try:
        if simulated:
            if not state.simulator_url:
                _err("the running stack has no LLM simulator; pass --api-base or set a provider key")
                return EXIT_INPUT
            config = _load_config(args, state.simulator_url)
            script = simulator_script_for(benchmark)
            extra = bench_path.with_name(bench_path.stem + ".simulator.yaml")
            if extra.exists():
                script = _merge_scripts(script, yaml.safe_load(extra.read_text()) or {})
            _post_script(state.simulator_url, script)
        trait_ranges = report.trait_ranges_from_benchmark(benchmark)
        runs: list[tuple[list[Any], dict[str, Any]]] = []
        run_ids: list[str] = []
        exit_code = EXIT_OK
        for i in range(args.num_runs):
            if args.num_runs > 1:
                print(f"\n=== run {i + 1} of {args.num_runs} ===")
            results, summary, code, plan = _one_run(settings, benchmark, config, args, simulated, trait_ranges)
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
    finally:
        if temporary:
            stack.down(settings)


def _one_run(settings: Any, benchmark: Any, config: Any, args: argparse.Namespace, simulated: bool,
             trait_ranges: dict[str, tuple[float, float]]) -> tuple[list[Any], dict[str, Any], int, Any]:
    """Plan, publish, follow and grade one run; returns (results, summary, exit code, plan)."""
    plan = runner.plan_run(benchmark, config, include_unfinished=args.include_unfinished)
    set_budget(plan.run_event, args.max_tokens_budget)
    set_cost_budget(plan.run_event, getattr(args, "max_cost_usd", None))
    label = " [SIMULATED LLM: answers and judgments come from the offline simulator]" if simulated else ""
    if not args.quiet:
        print(f"run {plan.run_id}: {plan.job_count} jobs ({len(plan.requests)} answers to generate) "
              f"from {benchmark.name!r}{label}")
        if plan.unfinished:
            print(f"  {len(plan.unfinished)} unfinished question(s) skipped: {', '.join(plan.unfinished)}")
    asyncio.run(runner.submit(settings, plan))
    outcome = asyncio.run(_follow(settings, plan, args.timeout, quiet=args.quiet))
    results = list(outcome.results.values())
    summary: dict[str, Any] = {"unfinished_questions_skipped": len(plan.unfinished),
                               "dead_lettered": len(outcome.dead_letters)}

    gate_code = cli_analysis.apply_gates(args, results, summary, trait_ranges)
    if outcome.timed_out:
        missing = len(plan.result_ids) - len(results) - len(outcome.dead_letters)
        _err(f"timed out after {args.timeout}s with {missing} job(s) unfinished; "
             f"results so far are stored; `veribus status {plan.run_id}` shows progress")
    _await_projection(settings, plan.run_id, len(results))
    if args.quiet:
        print("✓ PASSED" if gate_code == 0 and not outcome.timed_out else "✗ FAILED")
    else:
        report.print_results(summary, summary.get("gate_lines") or [], simulated=simulated, run_id=plan.run_id)
    code = EXIT_RUN_ERROR if outcome.timed_out else (EXIT_GATE_FAILED if gate_code else EXIT_OK)
    return results, summary, code, plan


def _merge_scripts(base: dict, extra: dict) -> dict:
    by_match = {q["match"]: q for q in base.get("questions", [])}
    for q in extra.get("questions", []):
        by_match[q["match"]] = {**by_match.get(q["match"], {}), **q}
    return {**base, **{k: v for k, v in extra.items() if k != "questions"}, "questions": list(by_match.values())}


def _post_script(simulator_url: str, script: dict) -> None:
    base = simulator_url.removesuffix("/v1")
    resp = httpx.post(f"{base}/simulator/script", json=script, timeout=10)
    resp.raise_for_status()


async def _follow(settings, plan, timeout: float | None, quiet: bool):  # noqa: ANN001, ANN202
    from rich.progress import (  # rich: only the interactive progress bar needs it
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )


    expected = set(plan.result_ids)
    if quiet:
        return await runner.collect(settings, plan.run_id, expected, timeout=timeout)
    with Progress(TextColumn(f"Running evaluation: {plan.run_name or plan.run_id}"), BarColumn(),
                  MofNCompleteColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  transient=False) as progress:
        task = progress.add_task("run", total=len(expected))
        return await runner.collect(settings, plan.run_id, expected, timeout=timeout,
                                    progress=lambda done, total: progress.update(task, completed=done))


def _await_projection(settings, run_id: str, expected: int, timeout: float = 30.0) -> None:  # noqa: ANN001
    """Wait until the projector has written this run's rows, so queries right after see them."""
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
    p = argparse.ArgumentParser(prog="veribus", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the local stack (nats-server, simulator, every service)")
    up.add_argument("--replicas", nargs="*", metavar="SERVICE=N", help="replicas per service, e.g. parsing=3")
    up.add_argument("--no-simulator", action="store_true", help="do not start the LLM simulator")
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
    run.add_argument("--quiet", action="store_true", help="print only ✓ PASSED / ✗ FAILED")
    cli_analysis.add_run_options(run)
    cli_scale.add_run_options(run)  # --cache, --cache-ttl, --max-cost-usd
    run.set_defaults(fn=cmd_run)

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
    return subprocess.run([sys.executable, "-m", "bench", *bench_args], check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option, --help included, belongs to `python -m bench`
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        _err("interrupted; results already finalized are stored")
        return EXIT_RUN_ERROR
    except (ValueError, FileNotFoundError, TimeoutError, RuntimeError) as exc:
        _err(str(exc))
        return EXIT_INPUT if isinstance(exc, ValueError | FileNotFoundError) else EXIT_RUN_ERROR


if __name__ == "__main__":
    sys.exit(main())
