"""`veribus resume | regrade | cancel | projections rebuild`: run lifecycle commands.

Wired into `shared.cli` by `register(sub)`; the work is in `shared.control.lifecycle`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import yaml

from infra.simulator.from_benchmark import simulator_script_for
from shared.cli.aio import interruptible, run_main
from shared.cli.common import SECONDS, deployment, deployment_settings, err, number_arg, resolve_run_arg, say
from shared.cli.simulator_script import merge_scripts, post_script, script_beside
from shared.control import lifecycle, rebuild, retention, runner, streams, wait
from shared.control.credentials import (
    base_reachable,
    credential_problems,
    recorded_stages,
    unadvertised_notes,
)
from shared.control.runner import SIMULATOR_SCRIPT_KEY, RunInputError
from shared.control.runref import next_regrade_name, runs_in_stream
from shared.core.benchmark.model import Benchmark
from shared.core.benchmark.question import BenchmarkError
from shared.core.config import ModelConfig
from shared.core.outcome import EXIT_BAD_INPUT as EXIT_INPUT
from shared.core.outcome import EXIT_OK, judge
from shared.core.outcome import EXIT_RESULTS_MISSING as EXIT_RUN_ERROR
from shared.core.verdict import errored
from shared.core.verdict import passed as is_pass
from shared.runtime.costcontrol import check_cost_budget
from shared.runtime.service_keys import Advert
from shared.store.reads import run_query


def _lone_rubric(args: argparse.Namespace) -> bool:
    """`--rubric` without `--benchmark` (it adds traits to that benchmark): said, before any deployment is asked."""
    if args.rubric and not args.benchmark:
        err("--rubric adds traits to the benchmark given with --benchmark; pass both")
        return True
    return False


def _wait_results(settings: Any, run_id: str, **kw: Any) -> tuple[int, bool]:
    """`wait.wait_for_results` for a command: Ctrl-C ends it even when a cancel is dropped
    (`aio.interruptible`). Returns (done, timed_out)."""
    return run_main(interruptible(wait.wait_for_results(settings, run_id, **kw)))


def cmd_resume(args: argparse.Namespace) -> int:
    if _lone_rubric(args):
        return EXIT_INPUT
    dep = deployment()
    settings = dep.settings
    calls_env, adverts = dep.calls_environ(), dep.calls_adverts()
    args.run = resolve_run_arg(settings, args.run, stream=True)
    try:
        bench = lifecycle.load_benchmark(args.benchmark, args.rubric) if args.benchmark else None
        if args.max_cost_usd is not None:
            check_cost_budget(args.max_cost_usd)  # refused with --dry-run too
        if args.dry_run:
            plan = run_main(lifecycle.plan_resume(settings, args.run, include_stopped=not args.no_stopped,
                                                  include_errors=args.errors, benchmark=bench))
            problems = lifecycle.resume_key_problems(plan, calls_env, adverts=adverts)  # refused with --dry-run too
            if problems:
                raise streams.LifecycleError("refused before publishing:\n  " + "\n  ".join(problems))
        else:
            before = run_main(wait.finalized_counts(settings, args.run))
            plan = run_main(lifecycle.resume(settings, args.run, include_stopped=not args.no_stopped,
                                             include_errors=args.errors, force=args.force, budget_tokens=args.max_tokens_budget,
                                             budget_cost_usd=args.max_cost_usd,
                                             benchmark=bench, services_environ=calls_env, adverts=adverts))
    except (streams.LifecycleError, BenchmarkError, ValueError) as exc:
        err(exc)
        return EXIT_INPUT
    for note in unadvertised_notes(lifecycle.recorded_config(plan.config), adverts) if plan.requests else ():
        say(f"note: {note}")
    print(f"run {plan.run_id}: {plan.job_count} jobs, {plan.finalized} with a result (skipped, no model calls), "
          f"{plan.stopped} cancelled/over budget, " + (f"{plan.errored} errored, " if args.errors else "")
          + f"{plan.jobs} job(s) in {len(plan.requests)} answer request(s) "
          f"{'to publish' if args.dry_run else 'published again'}")
    if plan.errored and not args.errors:
        print(f"  {plan.errored} job(s) ended in an error and stay as they are: `--errors` runs them again")
    if plan.replanned:
        print(f"  {plan.replanned} answer request(s) were never published and were planned again from the benchmark")
    if plan.never_published:
        print(f"  {plan.never_published} answer request(s) of the run are not in the stream; pass --benchmark "
              "FILE (the run's benchmark) to plan them again")
    if plan.queued:
        print("  still queued for the services: " + ", ".join(f"{k} {v}" for k, v in sorted(plan.queued.items())))
    if args.dry_run or not args.wait or not plan.requests:
        return EXIT_OK
    ids = [j.result_id for r in plan.requests for j in r.jobs]
    done, timed_out = _wait_results(settings, args.run, result_ids=ids, baseline=before, timeout=args.timeout)
    print(f"  {done}/{len(ids)} resumed job(s) finalized" + (" (timed out)" if timed_out else ""))
    return EXIT_RUN_ERROR if timed_out else EXIT_OK


def _regrade_name(settings: Any, parent_run_id: str, parent_name: str | None) -> str:
    names = [r.run_name for r in run_main(runs_in_stream(settings))]
    return next_regrade_name(parent_name or parent_run_id, names)


def resolve_judges(plan: Any, settings: Any, *, simulate: bool = False, api_base: str | None = None,
                   services_environ: Mapping[str, str] | None = None,
                   adverts: Sequence[Advert] | None = None) -> list[str]:
    """Point the regrade's judge models at the current configuration, in place: a judge that ran
    on the simulator goes to the simulator running now (VERIBUS_SIMULATOR_URL or the local
    stack's), never the URL recorded with the old run; `--api-base` replaces a recorded one.
    Returns the problems that make the judges unreachable (empty when they can be called): a key
    is looked for where the calls are made (`adverts`, a configured deployment's services' key
    names; `services_environ`, a running local stack's)."""
    problems: list[str] = []
    checked: dict[str, str | None] = {}
    for i, ev in enumerate(plan.generated):
        spec = ev.job.parsing
        new = spec
        if spec.interface == "simulator" or simulate:
            if not settings.simulator_url:
                problems.append(f"judge {spec.model_name!r} ran on the LLM simulator, and no simulator runs now: "
                                "start the local stack (`veribus up`) or set VERIBUS_SIMULATOR_URL")
                break
            new = msgspec.structs.replace(spec, api_base=settings.simulator_url, interface="simulator")
        elif api_base:
            new = msgspec.structs.replace(spec, api_base=api_base)
        if new is not spec:
            plan.generated[i] = msgspec.structs.replace(ev, job=msgspec.structs.replace(ev.job, parsing=new))
        key = f"{new.model_name}@{new.api_base}"
        if key in checked:
            continue
        cfg = ModelConfig(model_name=new.model_name, interface=new.interface, api_base=new.api_base,
                          api_key_env=new.api_key_env)
        why = "; ".join(credential_problems([("judge", cfg)], services_environ, adverts=adverts,
                                            config=recorded_stages(plan.run_event.config))) or None
        if why is None and new.api_base:
            down = base_reachable(new.api_base)
            if down:
                why = f"judge {new.model_name!r} cannot be reached at {down}"
        checked[key] = why
        if why:
            problems.append(why)
    return problems


def load_simulator_script(plan: Any, benchmark: Benchmark | None, benchmark_path: str | None) -> list[str]:
    """Give the simulator the regrade's judges go to (after `resolve_judges`) the script of the
    benchmark the regrade grades with, as `run --simulate` does before it publishes: `--benchmark`'s,
    else the stored run's questions as its jobs carry them (`lifecycle.graded_benchmark`), with the
    `<name>.simulator.yaml` beside `--benchmark`, else the one the regraded run kept
    (`runner.SIMULATOR_SCRIPT_KEY`): a regrade of unchanged templates grades as the run did. A
    simulator that was restarted since the run holds no script for them, and would parse every
    stored answer with made-up values. Returns the bases posted to; raises RuntimeError when a
    simulator refuses the script."""
    bases = sorted({ev.job.parsing.api_base for ev in plan.generated
                    if ev.job.parsing.interface == "simulator" and ev.job.parsing.api_base})
    if not bases:
        return []
    script = simulator_script_for(benchmark if benchmark is not None else lifecycle.graded_benchmark(plan))
    kept = script_beside(benchmark_path) if benchmark is not None else None
    if kept is not None:
        runner.keep_simulator_script(plan, kept)  # a regrade of this regrade is scripted the same way
    else:  # the regraded run's own (None when it had none)
        kept = plan.simulator_script
        if plan.simulator_script_lost:
            say(f"note: the regraded run's simulator script ({SIMULATOR_SCRIPT_KEY} in its config) cannot be read "
                f"back: {plan.simulator_script_lost}; the simulator grades from the stored questions alone, so "
                "answers its .simulator.yaml scripted may be graded differently")
    if kept:
        script = merge_scripts(script, kept)
    for base in bases:
        post_script(base, script)
    return bases


def cmd_regrade(args: argparse.Namespace) -> int:
    if _lone_rubric(args):
        return EXIT_INPUT
    dep = deployment()
    settings = dep.settings
    args.run = resolve_run_arg(settings, args.run, stream=True)
    try:
        bench = lifecycle.load_benchmark(args.benchmark, args.rubric) if args.benchmark else None
        plan = run_main(lifecycle.plan_regrade(settings, args.run, benchmark=bench, mode=args.mode,
                                               run_name=args.run_name))
    except (streams.LifecycleError, BenchmarkError, RunInputError, ValueError) as exc:
        err(exc)
        return EXIT_INPUT
    if not plan.generated and plan.skipped_not_in_benchmark:
        ids = sorted(set(plan.skipped_not_in_benchmark))
        err(f"none of the {len(plan.skipped_not_in_benchmark)} stored answer(s) of run {args.run} is to a question "
            f"of {args.benchmark} (the run's questions: {', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''}): "
            "nothing to regrade")
        return EXIT_INPUT
    if not plan.generated:
        err(f"run {args.run} has no stored answers to regrade")
        return EXIT_INPUT
    if args.run_name is None:
        name = _regrade_name(settings, plan.parent_run_id, plan.run_event.run_name)
        plan.run_event.run_name = name
        plan.run_event.config["run_name"] = name
        for i, ev in enumerate(plan.generated):
            plan.generated[i] = msgspec.structs.replace(ev, job=msgspec.structs.replace(ev.job, run_name=name))
    problems = resolve_judges(plan, settings, simulate=args.simulate, api_base=args.api_base,
                              services_environ=dep.calls_environ(), adverts=dep.calls_adverts())
    if problems:
        err("regrade refused before publishing:\n  " + "\n  ".join(problems))
        return EXIT_INPUT
    try:
        load_simulator_script(plan, bench, args.benchmark)
    except (RuntimeError, OSError, yaml.YAMLError) as exc:  # a simulator that refused it, a bad .simulator.yaml
        err(f"regrade refused before publishing: {exc}")
        return EXIT_INPUT
    run_main(lifecycle.submit_regrade(settings, plan))
    print(f"run {plan.run_id} ({plan.run_event.run_name}): regrade of {plan.parent_run_id}: {len(plan.generated)} "
          "jobs from stored answers (no answering-model calls)")
    if plan.skipped_not_in_benchmark:
        print(f"  {len(plan.skipped_not_in_benchmark)} job(s) skipped: question not in the new benchmark "
              f"({', '.join(sorted(set(plan.skipped_not_in_benchmark))[:10])})")
    if plan.jobs_without_answer:
        print(f"  {plan.jobs_without_answer} job(s) of the parent run have no stored answer (not regraded)")
    if args.no_wait:
        return EXIT_OK
    done, timed_out = _wait_results(settings, plan.run_id, result_ids=plan.result_ids, timeout=args.timeout)
    new = run_main(lifecycle.run_results(settings, plan.run_id))
    old = run_main(lifecycle.run_results(settings, plan.parent_run_id))
    passed = sum(1 for r in new.values() if is_pass(r))
    errors = sum(1 for r in new.values() if errored(r))  # verify() raising included, as `judge` counts
    cmp = lifecycle.compare_runs(old.values(), new.values())
    print(f"  {done}/{len(plan.generated)} finalized: {passed} passed, {errors} error(s)"
          + (" (timed out)" if timed_out else ""))
    in_error = (f"; in error: {cmp['errors_before']} before, {cmp['errors_after']} now"
                if cmp["errors_before"] or cmp["errors_after"] else "")
    print(f"  verify_result changed for {len(cmp['changed'])} of {cmp['compared']} job(s){in_error}")
    for qid, before, after in cmp["changed"][:20]:
        print(f"    {qid}: {before} -> {after}")
    verdict = judge(list(new.values()), expected=len(plan.generated), timed_out=timed_out,
                    run_ref=plan.run_event.run_name or plan.run_id)
    if not verdict.ok:
        err(verdict.headline)
    return verdict.code


def cmd_cancel(args: argparse.Namespace) -> int:

    settings = deployment_settings()
    args.run = resolve_run_arg(settings, args.run, stream=True)
    try:
        out = run_main(lifecycle.cancel(settings, args.run, args.reason or ""))
    except streams.LifecycleError as exc:
        err(str(exc))
        return EXIT_INPUT
    if out.already_finished:  # nothing published: there is nothing left to stop
        print(f"run {out.run_id} already finished ({out.finalized}/{out.job_count} results): nothing to cancel")
        return EXIT_OK
    left = out.job_count - out.generated
    print(f"run {out.run_id}: cancelled; {out.finalized}/{out.job_count} results finalized so far. "
          + (f"The {left} job(s) whose answer was not yet generated finalize as cancelled results (error "
             f"'cancelled'); the {out.generated} answered go on to their results." if left else
             f"Every answer was generated already: nothing is stopped, and the {out.job_count - out.finalized} "
             "job(s) still going finish as they are."))
    if not args.wait:
        return EXIT_OK
    done, timed_out = _wait_results(settings, args.run, count=out.job_count, timeout=args.timeout)
    print(f"  {done}/{out.job_count} results finalized" + (" (timed out)" if timed_out else ""))
    return EXIT_RUN_ERROR if timed_out else EXIT_OK


def cmd_projections_rebuild(args: argparse.Namespace) -> int:

    settings = deployment_settings()
    before_runs = retention.results_per_run(lambda sql: run_query(settings, sql))
    try:
        rep = rebuild.rebuild_projections(settings, timeout=args.timeout, progress=lambda m: print(f"  {m}"))
    except streams.LifecycleError as exc:
        err(str(exc))
        return EXIT_RUN_ERROR
    print(f"projections rebuilt from {rep.stream_messages} stream messages in {rep.elapsed_s:.1f} s ({rep.mode})")
    for table in rep.after:
        b, a = rep.before.get(table, (0, 0)), rep.after[table]
        same = "identical" if a == b else "CHANGED"
        print(f"  {table:<22} rows before {b[0]:>8}  after {a[0]:>8}  {same}")
    if not rep.identical:
        print("  (tables differ: events arrived during the rebuild, or the old tables had lost or extra rows)")
    for line in rep.contents_lines():
        print(line)
    kept = run_main(retention.stream_retention(settings))  # what retention left to rebuild from
    for line in kept.lines():
        print(line)
    for line in retention.compare(before_runs, retention.results_per_run(lambda sql: run_query(settings, sql))).lines():
        print(line)
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    """Add the lifecycle commands to `veribus`'s subcommands."""
    r = sub.add_parser("resume", help="publish again only the jobs of a run that have no result")
    r.add_argument("run", help="run id or name")
    r.add_argument("--benchmark", help="the run's benchmark file, to plan answers that were never published")
    r.add_argument("--rubric", metavar="FILE", help="with --benchmark: the rubric file the run was started with")
    r.add_argument("--no-stopped", action="store_true", help="do not re-run cancelled / over-budget jobs")
    r.add_argument("--errors", action="store_true",
                   help="also re-run jobs whose result is an error (a model call that failed after its retries, a "
                        "stage's give-up); a template whose verify() raised is not re-run: its template decides the same")
    r.add_argument("--max-tokens-budget", type=number_arg(int, low=1), help="a new token budget for the run")
    r.add_argument("--max-cost-usd", type=float, metavar="USD",
                   help="a new money budget for the run (what it has spent counts against it)")
    r.add_argument("--force", action="store_true", help="resume even while messages are still queued")
    r.add_argument("--dry-run", action="store_true", help="only print what would be published")
    r.add_argument("--wait", action="store_true", help="wait for the resumed jobs' results")
    r.add_argument("--timeout", type=SECONDS, default=3600.0, help="with --wait: seconds to wait (default 3600)")
    r.set_defaults(fn=cmd_resume)

    g = sub.add_parser("regrade", help="parse, verify and score a run's stored answers again, as a new run")
    g.add_argument("run", help="run id or name of the run whose answers are regraded")
    g.add_argument("--benchmark", help="checkpoint/benchmark with the changed templates and rubrics")
    g.add_argument("--rubric", metavar="FILE", help="with --benchmark: traits added to its global rubric (as `run --rubric`)")
    g.add_argument("--mode", choices=["template_only", "template_and_rubric", "rubric_only"],
                   help="default: the regraded run's mode")
    g.add_argument("--run-name", help="default: <parent name>-regrade-N")
    g.add_argument("--simulate", action="store_true", help="judge with the LLM simulator running now")
    g.add_argument("--api-base", help="OpenAI-compatible base URL for the judges (replaces the recorded one)")
    g.add_argument("--no-wait", action="store_true", help="publish and return")
    g.add_argument("--timeout", type=SECONDS, default=3600.0, help="seconds to wait for the results (default 3600)")
    g.set_defaults(fn=cmd_regrade)

    c = sub.add_parser("cancel", help="stop dispatching a run; answers not yet generated finalize as cancelled")
    c.add_argument("run", help="run id or name")
    c.add_argument("--reason", help="recorded on the cancel event and in the results' error")
    c.add_argument("--wait", action="store_true", help="wait until every job of the run is finalized")
    c.add_argument("--timeout", type=SECONDS, default=600.0, help="with --wait: seconds to wait (default 600)")
    c.set_defaults(fn=cmd_cancel)

    p = sub.add_parser("projections", help="the ClickHouse projections of the stream")
    psub = p.add_subparsers(dest="projections_command", required=True)
    rb = psub.add_parser("rebuild", help="drop the tables and refold them from the stream")
    rb.add_argument("--timeout", type=SECONDS, default=600.0, help="seconds to wait for the projector to catch up")
    rb.set_defaults(fn=cmd_projections_rebuild)
