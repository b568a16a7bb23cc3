"""JUnit XML of a gate report (`veribus run/report --junit`): a `gates` testsuite, one testcase
per gate, a `samples` testsuite, one testcase per result, and an `outcome` testsuite, one testcase
failing with the run's reasons when its outcome is not a pass (jobs without a result at
--timeout, too many errors, results not stored: a file all green beside exit 3 misled CI); with
`run --num-runs N` these once per run (`veribus.run_1.gates`, ...), in one file."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.analysis.gates import GateReport
from shared.analysis.report import DEFAULT_PASS, OP_SYMBOLS, PassCriterion, Sample, score_of
from shared.core.models import VerificationResult
from shared.core.verdict import verify_raised


def junit_xml(report: GateReport, results: Iterable[VerificationResult] | None = None,
              criterion: PassCriterion = DEFAULT_PASS, suite: str = "veribus",
              trait_ranges: Mapping[str, tuple[float, float]] | None = None,
              outcome: Mapping[str, Any] | None = None) -> str:
    """JUnit XML: a `gates` testsuite (one testcase per gate), a `samples` testsuite (one
    testcase per result: failure when its score misses the criterion, error when it errored or
    its verify() raised), and, given the run's `outcome` (`Verdict.as_dict`), an `outcome` one."""
    root = ET.Element("testsuites", name=suite)
    _add_run(root, suite, report, results, criterion, trait_ranges, outcome=outcome)
    return _text(root)


def junit_xml_runs(runs: Sequence[JUnitRun], suite: str = "veribus",
                   trait_ranges: Mapping[str, tuple[float, float]] | None = None) -> str:
    """JUnit XML of `veribus run --num-runs N`, every run in one file: run i's `SUITE.run_i.gates`
    and `SUITE.run_i.samples` testsuites (as `--output` writes run_i/), each with a `run_id`
    property naming the run."""
    root = ET.Element("testsuites", name=suite)
    for i, run in enumerate(runs, 1):
        _add_run(root, f"{suite}.run_{i}", run.report, run.results, run.criterion, trait_ranges, run.run_id,
                 outcome=run.outcome)
    return _text(root)


@dataclass
class JUnitRun:
    """One run of several for `junit_xml_runs`: its id, gate report, results and pass criterion."""

    run_id: str
    report: GateReport
    results: Sequence[VerificationResult]
    criterion: PassCriterion = DEFAULT_PASS
    outcome: Mapping[str, Any] | None = None  # the run's `Verdict.as_dict`, once judged


def _add_run(root: ET.Element, suite: str, report: GateReport, results: Iterable[VerificationResult] | None,
             criterion: PassCriterion, trait_ranges: Mapping[str, tuple[float, float]] | None,
             run_id: str | None = None, outcome: Mapping[str, Any] | None = None) -> None:
    """The `SUITE.gates`, `SUITE.samples` and (given `outcome`) `SUITE.outcome` testsuites of one run."""
    gs = ET.SubElement(root, "testsuite", name=f"{suite}.gates", tests=str(len(report.outcomes)),
                       failures=str(sum(1 for o in report.outcomes if not o.passed)), errors="0")
    _run_property(gs, run_id)
    for o in report.outcomes:
        tc = ET.SubElement(gs, "testcase", classname=f"{suite}.gates", name=o.gate.label())
        if not o.passed:
            ET.SubElement(tc, "failure", message=o.line, type="GateFailed").text = o.line
    ss = ET.SubElement(root, "testsuite", name=f"{suite}.samples")
    _run_property(ss, run_id)
    tests = fails = errs = 0
    for r in results or ():  # one result at a time: a streamed run is never held
        sc = score_of(r, trait_ranges)
        s = Sample(r, sc is not None, sc if sc is not None else 0.0)
        raised = s.attempted and verify_raised(r)  # a template error, never a plain fail (shared.core.verdict)
        tests += 1
        fails += 1 if s.attempted and not raised and not criterion(s.score) else 0
        errs += 0 if s.attempted and not raised else 1
        m = r.metadata
        rep = f" r{m.replicate}" if m.replicate is not None else ""
        tc = ET.SubElement(ss, "testcase", classname=f"{suite}.samples.{m.answering_model}",
                           name=f"{m.question_id} [{m.parsing_model}{rep}]", time=f"{m.execution_time or 0.0:.3f}")
        if not s.attempted:
            ET.SubElement(tc, "error", message=str(m.error or "error"), type="ResultError").text = str(m.error or "")
        elif raised:
            why = f"verify() raised: {r.template.field_verification_error if r.template else ''}"
            ET.SubElement(tc, "error", message=why, type="VerifyRaised").text = why
        elif not criterion(s.score):
            msg = f"score {s.score:.3g} fails {OP_SYMBOLS[criterion.op]} {criterion.value:g}"
            ET.SubElement(tc, "failure", message=msg, type="SampleFailed").text = msg
    ss.set("tests", str(tests))
    ss.set("failures", str(fails))
    ss.set("errors", str(errs))
    if outcome is not None:
        failed = int(outcome.get("exit_code", 0) or 0) != 0
        run_suite = ET.SubElement(root, "testsuite", name=f"{suite}.outcome", tests="1",
                                  failures=str(int(failed)), errors="0")
        _run_property(run_suite, run_id)
        tc = ET.SubElement(run_suite, "testcase", classname=f"{suite}.outcome", name="run outcome")
        if failed:
            why = "; ".join(map(str, outcome.get("reasons") or [])) or f"exit {outcome.get('exit_code')}"
            ET.SubElement(tc, "failure", message=why, type="RunFailed").text = why


def _run_property(suite: ET.Element, run_id: str | None) -> None:
    if run_id:
        ET.SubElement(ET.SubElement(suite, "properties"), "property", name="run_id", value=run_id)


def _text(root: ET.Element) -> str:
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(path: str | Path, report: GateReport, results: Iterable[VerificationResult] | None = None,
                criterion: PassCriterion = DEFAULT_PASS,
                trait_ranges: Mapping[str, tuple[float, float]] | None = None,
                outcome: Mapping[str, Any] | None = None) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(junit_xml(report, results, criterion, trait_ranges=trait_ranges, outcome=outcome), encoding="utf-8")
    return p


def write_junit_runs(path: str | Path, runs: Sequence[JUnitRun], suite: str = "veribus",
                     trait_ranges: Mapping[str, tuple[float, float]] | None = None) -> Path:
    """`junit_xml_runs` into `path` (its missing folders made)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(junit_xml_runs(runs, suite, trait_ranges), encoding="utf-8")
    return p
