"""`veribus run`: the run's config from --config and the flags, every check before anything is
published, then plan, publish, follow and grade (one run or several)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from infra.simulator.from_benchmark import simulator_script_for
from shared.cli import analysis as cli_analysis
from shared.cli import scale as cli_scale
from shared.cli.aio import interruptible, run_main
from shared.cli.common import err, say, validation_text
from shared.cli.progress import ProgressPrinter, RunProgress, StackWatch
from shared.cli.simulator_script import merge_scripts, post_script, script_beside
from shared.cli.stack import simulator_args
from shared.control import deployment, runner, stack, wait
from shared.control.credentials import config_problems, unadvertised_notes
from shared.core.benchmark.model import Benchmark
from shared.core.benchmark.question import BenchmarkError
from shared.core.config import Settings, VerificationConfig, config_uses_simulator
from shared.core.limits import check_config_size
from shared.core.outcome import EXIT_BAD_INPUT as EXIT_INPUT
from shared.core.outcome import EXIT_INTERRUPTED, EXIT_OK, NO_JOBS_HINT, MaxErrors, judge
from shared.core.outcome import EXIT_RESULTS_MISSING as EXIT_NOT_STORED
from shared.core.verdict import has_verdicts
from shared.runtime.costcontrol import set_cost_budget
from shared.runtime.runcontrol import pop_budget, set_budget
from shared.store.event_usage import with_event_usage
from shared.store.reads import run_query


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


def _load_config(args: argparse.Namespace, simulated_base: str | None):  # noqa: ANN202
    """The run's VerificationConfig from --config and the flags. With --simulate every model
    goes to the simulator at `simulated_base`; otherwise models keep their api_base as given
    (`--api-base` fills it only where a model has none), and `simulator`-interface models of a
    config without an api_base get `simulated_base`."""
    data = _read_config_file(args)
    data.pop("gates", None)
    from_file = set(data)
    if args.config:
        budget = pop_budget(data)
        if budget is not None and getattr(args, "max_tokens_budget", None) is None:
            args.max_tokens_budget = budget

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
            if args.simulate and "model_name" in m:  # without one: validation says it is required
                name = str(m["model_name"]).split("/", 1)[-1].strip()
                # interface "simulator": results are labelled as simulated in every row and export;
                # an empty name stays empty, refused as it is without --simulate (not `openai/`)
                m.update(model_name=f"openai/{name}" if name else name, api_base=simulated_base, id=name,
                         interface="simulator")
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
    try:
        return VerificationConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(validation_text(exc, _field_sources(args, from_file))) from None


# the run options that set a VerificationConfig field: (field, option, its argparse dest)
FIELD_FLAGS = (("answering_models", "--model", "model"), ("parsing_models", "--judge", "judge"),
               ("replicate_count", "--replicates", "replicates"), ("evaluation_mode", "--mode", "mode"),
               ("run_name", "--run-name", "run_name"), ("rubric_evaluation_strategy", "--strategy", "strategy"),
               ("response_cache", "--cache", "response_cache"),
               ("response_cache_ttl_s", "--cache-ttl", "response_cache_ttl_s"),
               ("abstention_enabled", "--abstention", "abstention_enabled"),
               ("sufficiency_enabled", "--sufficiency", "sufficiency_enabled"),
               ("embedding_check_enabled", "--embedding-check", "embedding_check_enabled"),
               ("deep_judgment_enabled", "--deep-judgment", "deep_judgment_enabled"))


def _field_sources(args: argparse.Namespace, from_file: set[str]) -> dict[str, str]:
    """Where each config field came from, for its error (`validation_text`): the option when it
    set the field, `in FILE` when --config did; a field neither set is named by its option."""
    where = {field: f"in {args.config}" for field in from_file}
    for field, flag, dest in FIELD_FLAGS:
        if getattr(args, dest, None) not in (None, False, []) or field not in from_file:
            where[field] = flag
    return where


def _is_simulated(args: argparse.Namespace) -> bool:
    """Only when asked: --simulate, or a `simulator` interface in the config. Never because a
    provider key is missing (that is refused instead)."""
    if args.simulate:
        return True
    try:
        return config_uses_simulator(_read_config_file(args))  # the only way, besides --simulate
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


def _validate_run(args: argparse.Namespace, benchmark: Any, simulated: bool,  # noqa: ANN202
                  services_environ: dict[str, str] | None = None, check_keys: bool = True):
    """Every check that needs no bus, before anything starts or is published: config, plan (0 jobs
    is refused with a hint), provider keys unless `check_keys` is False (in `services_environ`, the
    running local stack's, when given: its services make the calls; a configured deployment's
    are checked once its bus answers, `_deployment_key_problems`), gates (metric, operator,
    range), --max-errors. Returns (config, gates, max_errors); raises ValueError with the message
    to print."""
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis.gates import check_gates, known_metrics
    from shared.analysis.report import trait_ranges_from_benchmark

    config = _load_config(args, "http://simulator.invalid/v1" if simulated else None)
    plan = runner.plan_run(benchmark, config, include_unfinished=args.include_unfinished)
    set_budget(plan.run_event, args.max_tokens_budget)
    set_cost_budget(plan.run_event, getattr(args, "max_cost_usd", None))
    if plan.job_count == 0:
        if not benchmark.questions:  # nothing to include: the hint about unfinished questions would mislead
            raise ValueError(f"{benchmark.name!r}: 0 jobs to run: the benchmark has no questions "
                             f"(read from {args.benchmark})")
        raise ValueError(f"{benchmark.name!r}: {NO_JOBS_HINT}")
    problems = config_problems(config, services_environ) if check_keys else []
    if problems:
        raise ValueError("refused before publishing:\n  " + "\n  ".join(problems))
    gates = cli_analysis.validate_run_gates(args)
    traits = _trait_names(benchmark)
    # read on the scales the run's scores are normalised by (a trait's 4 on 1..5 is 0.75; 6 is refused)
    gates = check_gates(gates, known_metrics(traits), _models_of(config), trait_ranges_from_benchmark(benchmark))
    _check_gates_have_data(gates, traits, config.evaluation_mode, lambda: _mode_source(args))
    return config, gates, MaxErrors.parse(getattr(args, "max_errors", None))


def _deployment_key_problems(dep: deployment.Deployment, config: Any) -> list[str]:
    """A configured deployment's provider keys, checked where its services make the calls (the key
    names each live replica said on the bus; this process's environment when none of them has):
    the problems refuse the run; a stage none of whose replicas has said them is a note."""
    adverts = dep.calls_adverts()
    for note in unadvertised_notes(config, adverts):
        say(f"note: {note}")
    return config_problems(config, adverts=adverts)


def _mode_source(args: argparse.Namespace) -> str:
    """Where the run's evaluation mode came from, for a refusal that names it."""
    if getattr(args, "mode", None):
        return "--mode"
    try:
        if "evaluation_mode" in _read_config_file(args):
            return f"evaluation_mode in {args.config}"
    except ValueError:
        pass
    return "the default mode"


def _check_gates_have_data(gates: list[Any], traits: set[str], mode: str, source: Callable[[], str]) -> None:
    """Refuse a gate the run's mode leaves without data (it could only fail, `no data`, after every
    model call was made): a rubric trait in template_only mode, which evaluates no rubric, and
    accuracy (the template's verdict) in rubric_only mode, which runs no template."""
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis.gates import RUN_METRICS
    from shared.analysis.report import ACCURACY

    known = traits | set(RUN_METRICS) | {ACCURACY}
    for g in gates:
        base = g.metric if g.metric in known else g.metric.split(":", 1)[0]
        said = f"gate {g.text or g.label()!r}"
        if mode == "template_only" and base in traits:  # `source` reads the config again: refusals only
            raise ValueError(
                f"{said}: {base!r} is a rubric trait, and rubric traits are not evaluated in template_only mode "
                f"({source()}), so the gate could only fail with no data: a rubric trait gate needs a mode that "
                "evaluates rubrics: --mode template_and_rubric or --mode rubric_only")
        if mode == "rubric_only" and base == ACCURACY and base not in traits:
            raise ValueError(
                f"{said}: accuracy is the answer template's verdict, and templates are not run in rubric_only mode "
                f"({source()}), so the gate could only fail with no data: gate on the rubric's traits, on pass_rate "
                "or avg_score (a sample's score is the mean of its traits), or use --mode template_only or "
                "template_and_rubric")


def cmd_run(args: argparse.Namespace) -> int:
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis import report
    from shared.analysis.junit import write_junit_runs

    dep = deployment.select()
    settings = dep.settings
    bench_path = Path(args.benchmark)
    try:
        benchmark = Benchmark.load(bench_path, rubric=args.rubric)
    except BenchmarkError as exc:
        err(str(exc))
        return EXIT_INPUT
    simulated = _is_simulated(args)
    try:
        config, gates, max_errors = _validate_run(args, benchmark, simulated, dep.calls_environ(),
                                                  check_keys=not dep.configured)
    except ValueError as exc:  # a pydantic ValidationError too: `err` says it in one line
        err(exc)
        return EXIT_INPUT
    for g in gates:
        if not args.quiet or g.note:
            say(g.understood())
    for note in config.sampling_notes():
        say(f"note: {note}")
    if simulated and dep.kind == "configured" and not settings.simulator_url:
        err("--simulate (or a `simulator` model) on a configured deployment needs the simulator's URL as the "
             "services reach it: set VERIBUS_SIMULATOR_URL")
        return EXIT_INPUT
    temporary = dep.kind == "none"
    if temporary:
        say("deployment: none configured (--nats-url / VERIBUS_NATS_URL) and no local stack running")
        say("step 1/2: starting a temporary local stack (nats-server, " + ("simulator, " if simulated else "")
             + "7 services); it stops when the run ends ...")
        t0 = time.monotonic()
        state = stack.up(settings, simulator=simulated, simulator_args=simulator_args(args))
        settings.nats_url = state.nats_url
        settings.simulator_url = state.simulator_url
        say(f"  temporary stack ready in {time.monotonic() - t0:.1f} s (NATS {state.nats_url}, home {state.home})")
        say("step 2/2: running")
    else:
        deployment.check_bus(dep, with_adverts=True)  # the services' key names, on the probe's connection
        say(dep.describe())
        problems = _deployment_key_problems(dep, config) if dep.configured else []
        if problems:
            err("refused before publishing:\n  " + "\n  ".join(problems))
            return EXIT_INPUT
        ignored = [f"{flag} {value}" for flag, value in (("--sim-latency-ms", args.sim_latency_ms),
                                                          ("--sim-error-rate", args.sim_error_rate)) if value]
        if ignored:  # the running simulator keeps what it was started with
            say(f"note: {' and '.join(ignored)} not applied: the --sim-* options set up a temporary stack's "
                "simulator, and this run goes to a running deployment, whose simulator keeps its own settings "
                "(locally: `veribus down`, then `veribus up --sim-...`)")
    current: dict[str, Any] = {}
    sim_extra: dict[str, Any] | None = None  # the benchmark's .simulator.yaml, kept with each run for a regrade
    try:
        if simulated:
            if not settings.simulator_url:
                err("the running stack has no LLM simulator (started with --no-simulator); restart it with "
                     "`veribus down && veribus up`, or set VERIBUS_SIMULATOR_URL")
                return EXIT_INPUT
            config = _load_config(args, settings.simulator_url)
            script = simulator_script_for(benchmark)
            sim_extra = script_beside(bench_path)
            if sim_extra is not None:
                script = merge_scripts(script, sim_extra)
            for base in sorted({m.api_base for m in config.answering_models + config.parsing_models
                                if m.interface == "simulator" and m.api_base}):
                post_script(base, script)
        trait_ranges = report.trait_ranges_from_benchmark(benchmark)
        runs: list[tuple[list[Any], dict[str, Any]]] = []
        run_ids: list[str] = []
        junit_runs: list[Any] | None = [] if args.junit and args.num_runs > 1 else None  # one file, every run
        exit_code = EXIT_OK
        for i in range(args.num_runs):
            if args.num_runs > 1:
                print(f"\n=== run {i + 1} of {args.num_runs} ===")
            results, summary, code, plan = _one_run(settings, benchmark, config, args, simulated, trait_ranges,
                                                    max_errors, current, junit_runs, sim_extra)
            runs.append((results, summary))
            run_ids.append(plan.run_id)
            exit_code = max(exit_code, code)
            if args.output and args.num_runs == 1:
                report.write_outputs(Path(args.output), benchmark.name, plan.run_id, results, summary,
                                     plan.run_event.config, simulated, trait_ranges=trait_ranges)
        if junit_runs is not None:
            write_junit_runs(args.junit, junit_runs, trait_ranges=trait_ranges)
            if not args.quiet:
                print(f"JUnit report of the {args.num_runs} runs written to {args.junit} "
                      f"(testsuites veribus.run_1.* .. veribus.run_{args.num_runs}.*)")
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
            err("interrupted before the run was published; nothing was submitted")
        elif not current.get("submitted"):
            err(f"interrupted while publishing run {rid}: some of its jobs may be queued. `veribus cancel {rid}` "
                 f"stops them; `veribus resume {rid}` publishes the rest"
                 + (" (after `veribus up`: the temporary stack is stopping now)" if temporary else ""))
        elif temporary:
            err(f"interrupted: run {rid} was submitted; the temporary stack is stopping now, and its unfinished "
                 f"jobs stay queued in {settings.home}/nats. `veribus up` picks them up again (then "
                 f"`veribus status {rid}`); `veribus up && veribus cancel {rid}` drops them.")
        else:
            err(f"interrupted: run {rid} keeps running on NATS {deployment.mask_url(settings.nats_url)} (the "
                 f"services finish its jobs). Follow it: `veribus status {rid}`; results so far: "
                 f"`veribus results {rid}`; stop it: `veribus cancel {rid}`; re-run missing jobs later: "
                 f"`veribus resume {rid}`.")
        return EXIT_INTERRUPTED
    finally:
        if temporary:
            stack.down(settings)


def _one_run(settings: Any, benchmark: Any, config: Any, args: argparse.Namespace, simulated: bool,
             trait_ranges: dict[str, tuple[float, float]], max_errors: MaxErrors | None = None,
             current: dict[str, Any] | None = None, junit_runs: list[Any] | None = None,
             sim_extra: dict[str, Any] | None = None) -> tuple[list[Any], dict[str, Any], int, Any]:
    """Plan, publish, follow and grade one run; returns (results, summary, exit code, plan). Its
    --junit is written, or, given `junit_runs` (one run of --num-runs), added to them."""
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis import report
    from shared.analysis.junit import write_junit

    plan = runner.plan_run(benchmark, config, include_unfinished=args.include_unfinished)
    set_budget(plan.run_event, args.max_tokens_budget)
    set_cost_budget(plan.run_event, getattr(args, "max_cost_usd", None))
    if sim_extra:
        runner.keep_simulator_script(plan, sim_extra)
    label = " [SIMULATED LLM: answers and judgments come from the offline simulator]" if simulated else ""
    if not args.quiet:
        print(f"run {plan.run_id}: {plan.job_count} jobs ({len(plan.requests)} answers to generate) "
              f"from {benchmark.name!r}{label}" + (f", name {plan.run_name!r}" if plan.run_name else ""), flush=True)
        if plan.unfinished:
            print(f"  {len(plan.unfinished)} unfinished question(s) skipped: {', '.join(plan.unfinished)}")
    if current is not None:
        current.update(run_id=plan.run_id, submitted=False)
    run_main(runner.submit(settings, plan))
    if current is not None:
        current["submitted"] = True
    if not args.quiet:
        print(f"submitted run {plan.run_id}; following its results (Ctrl-C stops following, not the run)",
              flush=True)
    outcome = run_main(_follow(settings, plan, args.timeout, quiet=args.quiet, trait_ranges=trait_ranges))
    results = list(outcome.results.values())
    summary: dict[str, Any] = {"unfinished_questions_skipped": len(plan.unfinished),
                               "dead_lettered": len(outcome.dead_letters)}
    # this run's JUnit: added to `junit_runs` (--num-runs), or written alone once its outcome is known
    judged: list[Any] = junit_runs if junit_runs is not None else []
    cli_analysis.apply_gates(args, results, summary, trait_ranges, run_id=plan.run_id, junit_runs=judged)
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
        err(f"timed out after {args.timeout}s with {missing} job(s) unfinished{dead}; "
             f"results so far are stored; `veribus status {plan.run_id}` shows progress")
    not_stored = _await_projection(settings, plan.run_id, len(results))
    if not_stored:  # one outcome, saying which part holds: never an error line beside a PASSED
        _not_stored(verdict, len(results), not_stored)
        summary["outcome"] = verdict.as_dict()
    else:  # results without a usage section (rubric_only): the calls and cost from the stage events
        summary["usage"] = with_event_usage(summary["usage"], plan.run_id,
                                            lambda sql, params: run_query(settings, sql, params))
    this = judged[-1]
    this.outcome = summary["outcome"]  # the JUnit file says what the exit code says (jobs missing, not stored, ...)
    if junit_runs is None and args.junit:
        write_junit(args.junit, this.report, this.results, this.criterion, trait_ranges, outcome=this.outcome)
    if args.quiet:
        print(verdict.headline)
    else:
        report.print_results(summary, summary.get("gate_lines") or [], simulated=simulated, run_id=plan.run_id)
    return results, summary, verdict.code, plan


async def _follow(settings, plan, timeout: float | None, quiet: bool,  # noqa: ANN001, ANN202
                  trait_ranges: dict[str, tuple[float, float]] | None = None):
    """Collect the run's results, showing progress on stderr (redrawn on a terminal, a plain line
    every VERIBUS_PROGRESS_INTERVAL_S seconds, default 10, when piped). On a local stack (its own
    or a temporary one) a process that is DEAD is named once, with `veribus up`, --quiet or not,
    and on the progress line while it is (looked for with the retry count, every 2 s)."""
    expected = set(plan.result_ids)
    dep = deployment.select()
    watch = StackWatch(dep.settings.home.resolve()) if dep.kind == "local" else None
    if quiet:
        def warn(_retrying: int) -> None:
            for line in watch.check():
                say(line)

        return await interruptible(runner.collect(settings, plan.run_id, expected, timeout=timeout,
                                                   on_tick=warn if watch else None))
    prog = RunProgress(total=len(expected), started=time.monotonic(), trait_ranges=trait_ranges,
                       by_rubric=not has_verdicts(plan.run_event.config.get("evaluation_mode")))
    printer = ProgressPrinter(prog, interval_s=Settings.from_env().progress_interval_s)

    def on_result(result: Any) -> None:
        prog.add(result)
        printer.update()

    def on_tick(retrying: int) -> None:
        prog.retrying = retrying
        if watch is not None:
            for line in watch.check():
                printer.note(line)
            prog.dead = watch.dead
        printer.update()

    try:
        return await interruptible(runner.collect(settings, plan.run_id, expected, timeout=timeout,
                                                   on_result=on_result, on_tick=on_tick))
    finally:
        printer.finish()


def _await_projection(settings, run_id: str, expected: int, timeout: float = 30.0) -> str | None:  # noqa: ANN001
    """Wait until the projector has written this run's rows, so queries right after see them.
    None when they are there; else why not, for the outcome (`_not_stored`). A local stack whose
    projector is DEAD is not waited on (asked again every second): nothing would write them."""
    deadline = time.monotonic() + timeout
    while True:
        dead = deployment.select().projector_dead
        step = 0.0 if dead else min(1.0, max(0.0, deadline - time.monotonic()))
        if wait.wait_projected(settings, run_id, expected, timeout=step):
            return None
        if dead or time.monotonic() >= deadline:
            break
    try:
        stored = wait.projected_rows(settings, run_id)
    except Exception:  # noqa: BLE001 - the store cannot be read at all: none of them can be seen
        stored = 0
    why = ("the local stack's projector is DEAD: `veribus up` restarts it, and it writes them from the stream"
           if dead else f"the projector did not write them within {timeout:g} s: is it running? `veribus status`")
    return (f"{'none' if not stored else f'only {stored}'} of their {expected} rows are in ClickHouse ({why}), "
            "so `veribus results`, `report` and `query` cannot show them yet")


def _not_stored(verdict: Any, n: int, why: str) -> None:
    """Fold "the rows are not in ClickHouse" into the verdict, in place: a run that passed on its
    results from the event stream (complete and final there) is not reported as PASSED / exit 0
    while its rows cannot be read back; the reason says plainly which part holds."""
    if verdict.ok:
        verdict.code, verdict.status = EXIT_NOT_STORED, "not_stored"
        verdict.reasons.append(f"results not stored: on its {n} results from the event stream the run passed (every "
                               f"job completed, every gate passed), but {why}")
    else:
        verdict.reasons.append(f"and its {n} results from the event stream are not all stored: {why}")
