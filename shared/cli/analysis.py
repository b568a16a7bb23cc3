"""Analysis commands of `veribus`: export, report, results, compare; and the gate options and
helpers `veribus run` uses.

Wiring (in shared/cli.py): `register(sub)` adds the subcommands; `add_run_options(run_parser)`
adds `--gate`, `--junit`, `--num-runs`; `validate_run_gates(args)` refuses bad gates before a run
starts (ValueError: exit 2); `apply_gates(args, results, summary)` evaluates them after the run
and returns the exit code (0 pass, 1 a gate failed).

RUN arguments accept a run id, a run name (its latest run), or a results file (our JSON/JSONL
export, the reference's export, a report's results.jsonl).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from shared.analysis.gates import Gate
    from shared.analysis.html_report import RunData
    from shared.analysis.junit import JUnitRun
    from shared.core.models import VerificationResult

from shared.cli.common import NotStored, deployment_settings, err, number_arg, resolve_run_arg, unstored
from shared.cli.outputs import check_output_paths
from shared.core.outcome import EXIT_BAD_INPUT as EXIT_INPUT
from shared.core.outcome import EXIT_GATE_FAILED, EXIT_OK, EXIT_RESULTS_MISSING, MaxErrors, judge
from shared.core.verdict import NO_TEMPLATE_VERDICTS
from shared.store.event_usage import with_event_usage
from shared.store.reads import ResultFilter, run_query

__all__ = ["EXIT_GATE_FAILED", "EXIT_INPUT", "EXIT_OK", "add_run_options", "apply_gates", "register",
           "validate_run_gates"]


# --------------------------------------------------------------------------------------------
# Options for `veribus run`
# --------------------------------------------------------------------------------------------


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The gate and multi-run options of `veribus run`."""
    parser.add_argument("--gate", action="append", metavar="EXPR",
                        help="quality gate, e.g. 'accuracy>=0.8', 'pass_rate:gpt-4o>=0.9', "
                             "'clarity>=0.6 pass>=0.75'; repeatable (also `gates:` in --config)")
    parser.add_argument("--junit", metavar="FILE", help="write a JUnit XML report (one testcase per gate and sample; "
                                                        "with --num-runs, a gates and a samples testsuite per run)")
    parser.add_argument("--num-runs", type=int, default=1, metavar="N",
                        help="run the benchmark N times; with --output: run_1/..run_N/ and aggregate_stats.json; "
                             "with --junit: every run in the one file (veribus.run_1.gates, ...)")


def _config_gates(config_path: str | None) -> list[Gate]:
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis.gates import GateError, gates_from_config

    if not config_path:
        return []
    path = Path(config_path)
    if not path.exists():
        return []  # the run's own config check reports the missing file
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return []
    if not isinstance(data, dict):
        return []
    try:
        return gates_from_config(data)
    except GateError as exc:
        raise GateError(f"run config {path}: {exc}") from exc


def validate_run_gates(args: argparse.Namespace) -> list[Gate]:
    """Every gate of this run (--gate and the config's `gates:`), parsed; raises
    shared.analysis.gates.GateError (a ValueError) on a malformed gate, before anything runs."""
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis.gates import parse_gates

    if getattr(args, "num_runs", 1) is not None and getattr(args, "num_runs", 1) < 1:
        raise ValueError("--num-runs must be >= 1")
    return parse_gates(getattr(args, "gate", None)) + _config_gates(getattr(args, "config", None))


def apply_gates(args: argparse.Namespace, results: Sequence[VerificationResult], summary: dict[str, Any],
                trait_ranges: dict[str, tuple[float, float]] | None = None, *,
                junit_runs: list[JUnitRun] | None = None, run_id: str = "") -> int:
    """Evaluate the run's gates on its results and fold the outcome into `summary` (in place:
    passed/failed attempts by the gate's per-sample criterion, `gates_passed`, `gates`,
    `gate_lines`); write --junit, or, given `junit_runs` (one of several runs: `--num-runs`), add
    this run to it for `write_junit_runs`. Returns 0 when every gate passes (or there are none), else 1.
    Print the block afterwards with `shared.analysis.report.print_results(summary, summary["gate_lines"])`."""
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis import report
    from shared.analysis.gates import evaluate_gates, resolve_gates, summary_criterion
    from shared.analysis.junit import JUnitRun, write_junit

    gates = resolve_gates(validate_run_gates(args), trait_ranges)  # a trait's threshold on its scale
    overall, per_metric = summary_criterion(gates)
    extra = {k: v for k, v in summary.items() if k in ("dead_lettered",)}
    summary.update(report.summarize(list(results), int(summary.get("unfinished_questions_skipped", 0) or 0),
                                    trait_ranges=trait_ranges, criterion=overall, criteria=per_metric))
    summary.update(extra)
    rep = evaluate_gates(results, gates, trait_ranges)
    summary["gates_passed"] = rep.passed
    summary["gates"] = rep.as_dict()["outcomes"]
    summary["gate_lines"] = rep.lines
    if junit_runs is not None:
        junit_runs.append(JUnitRun(run_id, rep, list(results), overall))
    elif getattr(args, "junit", None):
        write_junit(args.junit, rep, results, overall, trait_ranges)
    return rep.exit_code


# --------------------------------------------------------------------------------------------
# Loading a RUN argument
# --------------------------------------------------------------------------------------------


RESULT_FILE_SUFFIXES = (".json", ".jsonl", ".ndjson", ".csv", ".parquet")  # what `export` writes, and the reference's


def _is_file(run: str) -> bool:
    p = Path(run)
    return p.is_file() and p.suffix.lower() in RESULT_FILE_SUFFIXES


def load_run_arg(run: str) -> RunData:
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis.files import iter_results_from_file
    from shared.analysis.html_report import RunData, load_run
    from shared.analysis.report import from_simulator

    if Path(run).suffix.lower() in RESULT_FILE_SUFFIXES and not Path(run).is_file():
        # a results file's name, not a run's: "no run '/x/r.json': no run has that id or name" misled
        raise ValueError(f"no results file {run}: {'it is a folder' if Path(run).is_dir() else 'no such file'}")
    if _is_file(run):
        results = list(iter_results_from_file(run))
        rubric = None
        try:
            with open(run, encoding="utf-8") as fh:
                head = fh.readline()
            if head.rstrip().endswith('"results":['):
                meta = json.loads(head.rstrip()[: -len(',"results":[')] + "}")
                rubric = (meta.get("shared_data") or {}).get("rubric_definition")
        except (OSError, ValueError):
            pass
        # labelled SIMULATED as a stored run is (and its HTML page): by the rows' interfaces
        return RunData(run_id=Path(run).stem, results=results,
                       run_name=results[0].metadata.run_name if results else None, rubric_definition=rubric,
                       simulated=any(map(from_simulator, results)))
    settings = deployment_settings()
    return load_run(settings, resolve_run_arg(settings, run, stream=False))


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis.export import check_format, export_results, export_run
    from shared.analysis.files import iter_results_from_file

    fmt = check_format(args.format or _format_from_suffix(args.output), args.csv_raw)  # before any reading
    where = ResultFilter(question_ids=args.question, answering_models=args.model, parsing_models=args.judge,
                         completed_only=args.completed_only)
    if _is_file(args.run):
        # local import: shared.analysis (15 modules) would slow every command's start-up
        from shared.analysis.resultset import VerificationResultSet

        rs = VerificationResultSet(iter_results_from_file(args.run)).filter(
            question_ids=args.question, answering_models=args.model, parsing_models=args.judge,
            completed_only=args.completed_only)
        stats = export_results(rs, fmt, args.output, job_id=Path(args.run).stem, csv_raw=args.csv_raw)
    else:
        settings = deployment_settings()
        run_id = resolve_run_arg(settings, args.run, stream=False)
        stats = export_run(settings, run_id, fmt, args.output, page_size=args.page_size, where=where,
                           csv_raw=args.csv_raw)
    print(f"exported {stats.rows} results to {stats.path} ({stats.format}, {stats.bytes:,} bytes, "
          f"{stats.seconds:.2f} s)")
    return EXIT_OK if _is_file(args.run) else _store_complete(args.run, run_id)


def _format_from_suffix(output: str) -> str:
    suffix = Path(output).suffix.lower().lstrip(".")
    if suffix in ("json", "jsonl", "csv", "parquet"):
        return suffix
    if suffix == "ndjson":
        return "jsonl"
    raise ValueError(f"cannot tell the export format from {output!r}: pass --format json|jsonl|csv|parquet")


def _gate_inputs(data: RunData) -> tuple[set[str], list[tuple[str, str]], dict[str, tuple[float, float]]]:
    """What a gate may name on this run, from one pass over its results: the metrics (run
    metrics, the rubric's traits, every metric its results carry), the (answering model,
    model name) pairs, and the trait scales a threshold is read on (`gates.trait_scales`)."""
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis.gates import known_metrics, trait_scales
    from shared.analysis.report import metric_scores, numeric_traits

    names: set[str] = set()
    numeric: set[str] = set()
    models: set[tuple[str, str]] = set()
    for r in data.results:
        names.update(metric_scores(r))
        numeric.update(numeric_traits(r))
        models.add((r.metadata.answering_model, r.metadata.answering.model_name))
    rub = data.rubric_definition or {}
    for key, traits in rub.items():
        if key.endswith("traits") and isinstance(traits, list):
            names.update(str(t.get("name")) for t in traits if isinstance(t, dict) and t.get("name"))
    return known_metrics(names), sorted(models), trait_scales(data.rubric_definition, numeric)


def _job_count(run_id: str) -> int | None:
    """The run's planned job count (from its run.requested row), so missing results count."""
    try:
        rows = run_query(deployment_settings(), "SELECT job_count FROM runs FINAL WHERE run_id = {r:String}", {"r": run_id}).rows
    except Exception:  # noqa: BLE001 - a results table without a runs row: judge by the results alone
        return None
    return int(rows[0][0]) if rows and rows[0][0] else None


def cmd_report(args: argparse.Namespace) -> int:
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis.html_report import write_html

    data = load_run_arg(args.run)
    try:
        return _report(args, data, write_html)
    finally:
        data.close()


def _report(args: argparse.Namespace, data: RunData, write_html: Any) -> int:
    """The report of one loaded run. A run from the store is streamed, never held: one paged pass
    gathers the summary, the gates and the HTML page's aggregates (counts only); the verdict,
    results.jsonl, the page's appendix and JUnit each read the results again as they write."""
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis import report
    from shared.analysis.gates import GateEvaluator, check_gates, parse_gates, summary_criterion
    from shared.analysis.html_digest import RunDigest
    from shared.analysis.junit import write_junit

    gates = parse_gates(args.gate)
    max_errors = MaxErrors.parse(args.max_errors)
    behind = None if _is_file(args.run) else unstored(data.run_id)
    if behind:  # a verdict on the rows ClickHouse has would judge a run it has not seen whole
        raise NotStored(behind)
    if not data.results:
        raise ValueError(f"{args.run} holds no results" if _is_file(args.run) else f"run {args.run!r} has no results")
    if gates:
        gates = check_gates(gates, *_gate_inputs(data))  # read on the traits' scales (off one: refused)
    for g in gates:
        if not args.quiet or g.note:
            print(g.understood(), file=sys.stderr)
    ranges = report.trait_ranges_from_rubric(data.rubric_definition)
    overall, per_metric = summary_criterion(gates)
    # one pass for the summary, the gates and the HTML page's aggregates
    tally = report.SummaryTally(trait_ranges=ranges, criterion=overall, criteria=per_metric)
    gate_eval = GateEvaluator(gates, ranges)
    digest, page_tally = (RunDigest.for_results(data.results), report.SummaryTally()) if args.html else (None, None)
    for r in data.results:
        s = report.sample_of(r, ranges)  # scored once for the summary and the gates
        tally.add(s)
        gate_eval.add(s)
        if digest is not None and page_tally is not None:
            digest.add(r)
            page_tally.add(r)
    summary = tally.summary(len(data.unfinished_skipped))
    if not _is_file(args.run):  # results without a usage section (rubric_only): from the run's stage events
        summary["usage"] = with_event_usage(summary["usage"], data.run_id,
                                            lambda sql, params: run_query(deployment_settings(), sql, params))
    rep = gate_eval.report()
    summary["gates_passed"] = rep.passed
    summary["gates"] = rep.as_dict()["outcomes"]
    expected = None if _is_file(args.run) else _job_count(data.run_id)
    verdict = judge(data.results, expected=int(expected) if expected else None,
                    failed_gates=[o.gate.label() for o in rep.outcomes if not o.passed], max_errors=max_errors,
                    run_ref=data.run_name or data.run_id)
    summary["outcome"] = verdict.as_dict()
    if args.output:
        report.write_outputs(Path(args.output), data.benchmark_name or data.run_name or data.run_id, data.run_id,
                             data.results, summary, data.config or {}, bool(data.simulated), trait_ranges=ranges)
    if args.html:
        page_summary = page_tally.summary() if page_tally is not None else None
        if page_summary is not None:
            page_summary["usage"] = summary["usage"]  # the same calls and cost (from the events, if so)
        path = write_html(args.html, data, rep.lines, digest=digest, summary=page_summary)
        if not args.quiet:
            print(f"wrote {path}")
    if args.junit:
        write_junit(args.junit, rep, data.results, overall, ranges, outcome=summary["outcome"])
    if args.quiet:
        print(verdict.headline)
    else:
        # a results file's rows are in no store: no `veribus query` line for them
        report.print_results(summary, rep.lines, simulated=bool(data.simulated),
                             run_id=None if _is_file(args.run) else data.run_id)
    return verdict.code


def cmd_results(args: argparse.Namespace) -> int:
    """Pass rates with Wilson intervals by a dimension, and pass@k across replicates."""
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis.resultset import VerificationResultSet
    from shared.analysis.stats import percent

    data = load_run_arg(args.run)
    if not data.results and _is_file(args.run):  # as `report FILE` says it (a stored run may be starting)
        raise ValueError(f"{args.run} holds no results")
    rs = VerificationResultSet(data.results, run_ids=[data.run_id])
    table = rs.pass_rates(by=args.by)
    pak = rs.pass_at_k()
    if args.format == "json":
        out = {"run_id": data.run_id, "summary": rs.get_summary(),
               "pass_rates": json.loads(table.to_json(orient="records")), "pass_at_k": pak.per_model,
               "flaky_questions": [q for q in pak.per_question if q["flaky"]]}
        print(json.dumps(out, indent=2, default=str))
        return _store_complete(args.run, data.run_id)
    s = rs.get_summary()
    raised = f" ({s['num_verify_raised']} where verify() raised)" if s["num_verify_raised"] else ""
    if s["num_completed"] and not s["num_with_template"]:  # rubric_only: no verdicts, never "0 passed"
        print(f"run {data.run_id}: {s['num_results']} results, {s['num_errors']} errors, "
              f"{s['num_questions']} questions\n  {NO_TEMPLATE_VERDICTS}")
        return _store_complete(args.run, data.run_id)
    print(f"run {data.run_id}: {s['num_results']} results, {s['num_errors']} errors{raised}, "
          f"{s['num_passed']} passed, {s['num_failed']} failed, {s['num_questions']} questions")
    print(f"\npass rate by {table.columns[0]} (Wilson 95% CI):")
    width = max([len(str(v)) for v in table.iloc[:, 0]] + [10])
    for row in table.itertuples(index=False):
        rate = "n/a" if row.pass_rate is None else f"{percent(row.pass_rate):5.1f}%"
        print(f"  {str(row[0]):<{width}}  {row.passed:>6}/{row.n:<6} {rate}  [{percent(row.ci_low):.1f}, "
              f"{percent(row.ci_high):.1f}]")
    if pak.per_model and max(m["max_replicates"] for m in pak.per_model) > 1:
        ks = [k for k in pak.ks if k <= max(m["max_replicates"] for m in pak.per_model)][:5]
        print("\nacross replicates (unbiased pass@k / pass^k):")
        for m in pak.per_model:
            cells = "  ".join(f"pass@{k} {_f(m[f'pass@{k}'])} pass^{k} {_f(m[f'pass^{k}'])}" for k in ks)
            print(f"  {m['answering_model']} / {m['parsing_model']}: {cells}  "
                  f"({m['flaky_questions']}/{m['questions']} questions flaky)")
    return _store_complete(args.run, data.run_id)


def _store_complete(run: str, run_id: str) -> int:
    """After a read of one run from the store: EXIT_OK, or, when ClickHouse has fewer of its
    results than the event stream holds (the projector dead or behind), one line saying so and
    EXIT_RESULTS_MISSING, never a short answer passed off as the whole run."""
    if _is_file(run):
        return EXIT_OK
    behind = unstored(run_id)
    if behind:
        err(behind)
        return EXIT_RESULTS_MISSING
    return EXIT_OK


RESULT_GROUPINGS = ("answering_model", "parsing_model", "question_id", "replicate", "run_name", "template_id")
# the spellings `shared.analysis.view` also reads (kept here: importing it would slow start-up)
GROUPING_ALIASES = {"model": "answering_model", "answering": "answering_model", "parsing": "parsing_model",
                    "judge": "parsing_model", "question": "question_id"}


def _grouping(text: str) -> str:
    """`results --by`: a grouping it knows (refused while the command line is read: exit 2)."""
    by = GROUPING_ALIASES.get(text, text)
    if by not in RESULT_GROUPINGS:
        raise argparse.ArgumentTypeError(f"cannot group by {text!r}: use one of {', '.join(RESULT_GROUPINGS)}")
    return by


def _f(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def cmd_compare(args: argparse.Namespace) -> int:
    # local import: shared.analysis (15 modules) would slow every command's start-up
    from shared.analysis.stats import compare_models, unknown_model

    a = load_run_arg(args.run)
    b = load_run_arg(args.run_b) if args.run_b else None
    # a model the run does not have is named, with those it has, before any verdict is read
    for flag, model, ref, data in (("--model-a", args.model_a, args.run, a),
                                   ("--model-b", args.model_b, args.run_b or args.run, b or a)):
        known = unknown_model(data.results, model)
        if known is not None:
            named = ref if data.run_id in (ref, Path(ref).stem) else f"{ref} ({data.run_id})"
            raise ValueError(f"{flag} {model!r} is not an answering model of run {named}: "
                             + (f"its answering models are {', '.join(known)}" if known else "it has no results"))
    cmp = compare_models(a.results, args.model_a, args.model_b, b.results if b is not None else None)
    if args.format == "json":
        print(json.dumps({"run_a": a.run_id, "run_b": b.run_id if b else a.run_id, **cmp.as_dict()}, indent=2))
    else:
        print(f"comparing {args.model_a} (run {a.run_id}) with {args.model_b} (run {b.run_id if b else a.run_id}),"
              f" paired by question, replicate (none: 1) and judge:")
        for line in cmp.lines():
            print("  " + line)
    return EXIT_OK


EXPORT_DESCRIPTION = (
    "Export a run's results (JSON in the reference's format 2.2, JSONL, CSV, Parquet). Questions and model "
    "replies are untrusted: in a CSV export, a text cell that starts with = + - @ (or a tab, a carriage "
    "return, leading spaces before one of those, or their full-width forms) is written behind a ' so that a "
    "spreadsheet shows it as text instead of running it as a formula; numbers are left as they are. "
    "--csv-raw writes the cells unchanged, for programs. JSON, JSONL and Parquet are never changed."
)


def register(sub: argparse._SubParsersAction) -> None:  # noqa: SLF001 - argparse exposes no public type
    """Add export, report, results and compare to the `veribus` parser."""
    e = sub.add_parser("export", help="export a run's results (JSON in the reference format, JSONL, CSV, Parquet)",
                       description=EXPORT_DESCRIPTION)
    e.add_argument("run", help="run id, run name, or a results file")
    e.add_argument("--format", choices=["json", "jsonl", "csv", "parquet"], help="default: from --output's suffix")
    e.add_argument("--output", "-o", required=True, help="file to write")
    e.add_argument("--question", action="append", help="only this question id; repeatable")
    e.add_argument("--model", action="append", help="only this answering model; repeatable")
    e.add_argument("--judge", action="append", help="only this parsing model; repeatable")
    e.add_argument("--completed-only", action="store_true", help="leave out results that errored")
    e.add_argument("--page-size", type=number_arg(int, low=1), default=2000, help="rows read per query (memory bound)")
    e.add_argument("--csv-raw", action="store_true",
                   help="CSV only: write every cell as it is, with no ' before formula-like text (for a program "
                        "reading the file, never for a spreadsheet: an untrusted cell could run as a formula)")
    e.set_defaults(fn=cmd_export)

    r = sub.add_parser("report", help="a run's report: console summary, --output files, --html page, gates")
    r.add_argument("run", help="run id, run name, or a results file")
    r.add_argument("--html", metavar="FILE", help="write one self-contained HTML page")
    r.add_argument("--output", metavar="DIR", help="write header.json, summary.json, results.jsonl")
    r.add_argument("--gate", action="append", metavar="EXPR", help="quality gate, e.g. accuracy>=0.8; repeatable")
    r.add_argument("--junit", metavar="FILE", help="write a JUnit XML report")
    r.add_argument("--quiet", action="store_true", help="print only ✓ PASSED, or ✗ FAILED and why (failed gates, errors)")
    r.add_argument("--max-errors", metavar="N|F%", help="errored jobs tolerated: a count or a share (default: none)")
    r.set_defaults(fn=cmd_report)

    s = sub.add_parser("results", help="pass rates with 95%% intervals, pass@k across replicates")
    s.add_argument("run", help="run id, run name, or a results file")
    s.add_argument("--by", default="answering_model", type=_grouping,
                   help="answering_model (default), parsing_model, question_id, replicate, run_name, template_id")
    s.add_argument("--format", choices=["table", "json"], default="table", help="table (default) or json")
    s.set_defaults(fn=cmd_results)

    c = sub.add_parser("compare", help="paired comparison of two answering models (exact McNemar, 95%% CI)")
    c.add_argument("run", help="run id, run name, or a results file (model A; and model B unless RUN_B)")
    c.add_argument("run_b", nargs="?", help="a second run for model B")
    c.add_argument("--model-a", required=True, help="answering model A (display string or model name)")
    c.add_argument("--model-b", required=True, help="answering model B")
    c.add_argument("--format", choices=["table", "json"], default="table", help="table (default) or json")
    c.set_defaults(fn=cmd_compare)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the analysis commands on their own (`python -m shared.cli.analysis ...`)."""
    parser = argparse.ArgumentParser(prog="veribus")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        check_output_paths(args)  # before a run is read or anything is written
        return int(args.fn(args))
    except (ValueError, FileNotFoundError) as exc:
        err(exc)
        return EXIT_INPUT


if __name__ == "__main__":
    sys.exit(main())
