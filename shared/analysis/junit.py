"""JUnit XML of a gate report (`veribus run/report --junit`): a `gates` testsuite, one testcase
per gate, and a `samples` testsuite, one testcase per result, for CI systems that read JUnit."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from pathlib import Path

from shared.analysis.gates import GateReport
from shared.analysis.report import DEFAULT_PASS, OP_SYMBOLS, PassCriterion, Sample, score_of
from shared.core.models import VerificationResult


def junit_xml(report: GateReport, results: Iterable[VerificationResult] | None = None,
              criterion: PassCriterion = DEFAULT_PASS, suite: str = "veribus",
              trait_ranges: Mapping[str, tuple[float, float]] | None = None) -> str:
    """JUnit XML: a `gates` testsuite (one testcase per gate) and a `samples` testsuite (one
    testcase per result: failure when its score misses the criterion, error when it errored)."""
    root = ET.Element("testsuites", name=suite)
    gs = ET.SubElement(root, "testsuite", name=f"{suite}.gates", tests=str(len(report.outcomes)),
                       failures=str(sum(1 for o in report.outcomes if not o.passed)), errors="0")
    for o in report.outcomes:
        tc = ET.SubElement(gs, "testcase", classname=f"{suite}.gates", name=o.gate.label())
        if not o.passed:
            ET.SubElement(tc, "failure", message=o.line, type="GateFailed").text = o.line
    ss = ET.SubElement(root, "testsuite", name=f"{suite}.samples")
    tests = fails = errs = 0
    for r in results or ():  # one result at a time: a streamed run is never held
        sc = score_of(r, trait_ranges)
        s = Sample(r, sc is not None, sc if sc is not None else 0.0)
        tests += 1
        fails += 1 if s.attempted and not criterion(s.score) else 0
        errs += 0 if s.attempted else 1
        m = r.metadata
        rep = f" r{m.replicate}" if m.replicate is not None else ""
        tc = ET.SubElement(ss, "testcase", classname=f"{suite}.samples.{m.answering_model}",
                           name=f"{m.question_id} [{m.parsing_model}{rep}]", time=f"{m.execution_time or 0.0:.3f}")
        if not s.attempted:
            ET.SubElement(tc, "error", message=str(m.error or "error"), type="ResultError").text = str(m.error or "")
        elif not criterion(s.score):
            msg = f"score {s.score:.3g} fails {OP_SYMBOLS[criterion.op]} {criterion.value:g}"
            ET.SubElement(tc, "failure", message=msg, type="SampleFailed").text = msg
    ss.set("tests", str(tests))
    ss.set("failures", str(fails))
    ss.set("errors", str(errs))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(path: str | Path, report: GateReport, results: Iterable[VerificationResult] | None = None,
                criterion: PassCriterion = DEFAULT_PASS,
                trait_ranges: Mapping[str, tuple[float, float]] | None = None) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(junit_xml(report, results, criterion, trait_ranges=trait_ranges), encoding="utf-8")
    return p
