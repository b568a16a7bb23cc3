"""Report outputs (`spec/004`): per-sample grades, the run summary, the console block, and the
files in `--output DIR` (header.json, summary.json, results.jsonl; run_N/ + aggregate_stats.json
for several runs).

Scores are 0..1 per sample and per metric:

- `accuracy`: 1.0 when the template's `verify()` passed, 0.0 when it failed;
- one metric per rubric trait: booleans 1/0, score traits scaled by their range (the trait's
  min/max when known, 1..5 otherwise), metric traits by their f1 (else the mean of their
  metrics); literal (class) traits are labels, not scores, and are left out;
- the sample's own score is its accuracy, or in rubric_only mode the mean of its traits.

A result that did not complete without errors counts in `total`, not in `total_attempted`, and
scores 0.0 in `avg_score_total` (and in results.jsonl, with the error as the rationale). A sample
passes a metric when its score satisfies the pass criterion: `score >= 1.0` by default, or a
gate's `pass_op`/`pass_value` for the gate's metric.
"""

from __future__ import annotations

import json
import math
import operator
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from shared.analysis.export import veribus_version
from shared.analysis.stats import Proportion, describe, percent
from shared.analysis.stored import iter_sorted
from shared.core.models import VerificationResult
from shared.core.outcome import VERIFY_RAISED, error_kind, error_lines
from shared.core.usage import UsageTally, usage_lines
from shared.core.verdict import verdict_of

ACCURACY = "accuracy"
DEFAULT_SCORE_RANGE = (1.0, 5.0)
OPS: dict[str, Callable[[float, float], bool]] = {
    "gt": operator.gt, "gte": operator.ge, "lt": operator.lt, "lte": operator.le, "eq": operator.eq,
}
OP_SYMBOLS = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<=", "eq": "=="}


@dataclass(frozen=True)
class PassCriterion:
    """Per-sample pass rule for one metric: `score <op> value`."""

    op: str = "gte"
    value: float = 1.0

    def __call__(self, score: float) -> bool:
        return OPS[self.op](score, self.value)


DEFAULT_PASS = PassCriterion()


# --------------------------------------------------------------------------------------------
# Per-sample scores
# --------------------------------------------------------------------------------------------


def trait_ranges_from_rubric(rubric: Mapping[str, Any] | None) -> dict[str, tuple[float, float]]:
    """{trait: (min, max)} for score traits of a rubric definition (reference `Rubric` shape or
    our wire shape {"traits": [...]})."""
    out: dict[str, tuple[float, float]] = {}
    if not rubric:
        return out
    traits: list[Any] = list(rubric.get("traits") or [])
    for key in ("llm_traits", "callable_traits"):
        traits += list(rubric.get(key) or [])
    for t in traits:
        if not isinstance(t, dict):
            continue
        lo, hi = t.get("min_score"), t.get("max_score")
        if t.get("kind") == "score" and isinstance(lo, int | float) and isinstance(hi, int | float) and hi > lo:
            out[str(t["name"])] = (float(lo), float(hi))
        elif t.get("kind") == "score" and lo is None and hi is None and t.get("name"):
            out[str(t["name"])] = DEFAULT_SCORE_RANGE  # what trait_score reads it on; named so gates know it
    return out


def numeric_traits(r: VerificationResult) -> set[str]:
    """Traits that one result scores with a plain number (a score, not a boolean, a label or
    metrics): what `trait_score` scales by the trait's range, or 1..5 when none is known."""
    rub = r.rubric
    if rub is None:
        return set()
    labels = rub.llm_trait_labels or {}
    return {name for scores in (rub.llm_trait_scores, rub.regex_trait_scores, rub.callable_trait_scores)
            for name, v in (scores or {}).items()
            if name not in labels and isinstance(v, int | float) and not isinstance(v, bool)}


def trait_score(value: Any, rng: tuple[float, float] | None = None) -> float | None:
    """One trait value -> 0..1 (None when it is not a score: a label, a list, a string)."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        if math.isnan(float(value)):
            return None
        lo, hi = rng or DEFAULT_SCORE_RANGE
        if hi <= lo:
            return None
        return max(0.0, min(1.0, (float(value) - lo) / (hi - lo)))
    if isinstance(value, dict):
        if isinstance(value.get("f1"), int | float):
            return max(0.0, min(1.0, float(value["f1"])))
        ms = [float(value[k]) for k in ("precision", "recall", "specificity", "accuracy")
              if isinstance(value.get(k), int | float)]
        return sum(ms) / len(ms) if ms else None
    return None


def metric_scores(r: VerificationResult, trait_ranges: Mapping[str, tuple[float, float]] | None = None) -> dict[str, float]:
    """{metric: 0..1 score} of one result: accuracy and every scoring rubric trait."""
    out: dict[str, float] = {}
    v = verdict_of(r)
    if v is not None:
        out[ACCURACY] = 1.0 if v else 0.0
    rub = r.rubric
    if rub is not None:
        labels = rub.llm_trait_labels or {}
        ranges = trait_ranges or {}
        for scores in (rub.llm_trait_scores, rub.regex_trait_scores, rub.callable_trait_scores,
                       rub.metric_trait_scores):
            for name, value in (scores or {}).items():
                if name in labels:
                    continue
                s = trait_score(value, ranges.get(name))
                if s is not None:
                    out[name] = s
    return out


def score_of(r: VerificationResult, trait_ranges: Mapping[str, tuple[float, float]] | None = None) -> float | None:
    """0..1 score of one result, or None when it was not attempted (an error)."""
    if not r.metadata.completed_without_errors:
        return None
    ms = metric_scores(r, trait_ranges)
    if ACCURACY in ms:
        return ms[ACCURACY]
    traits = [v for k, v in ms.items() if k != ACCURACY]
    return sum(traits) / len(traits) if traits else 0.0


@dataclass
class Sample:
    """One result as the report sees it."""

    result: VerificationResult
    attempted: bool
    score: float  # 0.0 for errors
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.result.metadata.answering_model


def sample_of(r: VerificationResult, trait_ranges: Mapping[str, tuple[float, float]] | None = None) -> Sample:
    """One result scored once (overall score and per-metric scores), for every tally that reads it."""
    s = score_of(r, trait_ranges)
    return Sample(r, s is not None, s if s is not None else 0.0, metric_scores(r, trait_ranges) if s is not None else {})


def rationale_of(r: VerificationResult) -> str:
    if not r.metadata.completed_without_errors:
        return f"Error: {r.metadata.error}"
    t = r.template
    if t is None:
        return "rubric only: mean of the rubric trait scores"
    for flag, why in (
        (t.abstention_override_applied, "abstention detected"),
        (t.sufficiency_override_applied, "response insufficient"),
        (t.recursion_limit_reached, "recursion limit reached"),
        (t.embedding_override_applied, "embedding check judged the answer equivalent"),
    ):
        if flag:
            return why
    if t.field_verification_error:
        return f"verify() raised: {t.field_verification_error}"
    return f"verify() -> {t.verify_result}; parsed {t.parsed_llm_response} vs expected {t.parsed_gt_response}"


def _trajectory(r: VerificationResult) -> list[list[dict[str, Any]]]:
    t = r.template
    if t is not None and t.trace_messages:
        return [list(t.trace_messages)]
    answer = t.raw_llm_response if t is not None else (r.evaluation_input or "")
    return [[{"role": "user", "content": r.metadata.question_text}, {"role": "assistant", "content": answer}]]


def _error_type(r: VerificationResult) -> str | None:
    failure = r.metadata.failure or {}
    if failure.get("category"):
        return str(failure["category"])
    err = r.metadata.error or ""
    head = err.split(":", 2)
    return head[1].strip() if len(head) > 2 else None


def result_line(r: VerificationResult, trait_ranges: Mapping[str, tuple[float, float]] | None = None) -> dict[str, Any]:
    """One results.jsonl line: sample, submission, grade, grades per metric, trajectory,
    model_name, usage (`spec/004`), plus the full result."""
    m = r.metadata
    ok = m.completed_without_errors
    score = score_of(r, trait_ranges)
    usage = (r.template.usage_metadata if r.template else None) or {}
    grade: dict[str, Any] = {"score": score if score is not None else 0.0, "rationale": rationale_of(r),
                             "metadata": {"model": m.parsing_model, "usage": usage.get("parsing")}}
    if not ok:
        grade["metadata"].update(error=m.error, error_type=_error_type(r))
    grades: dict[str, Any] = {}
    if ok:
        raw = r.rubric.get_all_trait_scores() if r.rubric else {}
        for name, s in metric_scores(r, trait_ranges).items():
            g: dict[str, Any] = {"score": s, "rationale": rationale_of(r) if name == ACCURACY else "rubric trait"}
            if name != ACCURACY:
                g["value"] = raw.get(name)
            grades[name] = g
    return {
        "sample": {"id": m.question_id, "input": m.question_text, "ground_truth": m.raw_answer,
                   "metadata": {"replicate": m.replicate, "keywords": m.keywords, "result_id": m.result_id,
                                "run_name": m.run_name}},
        "submission": (r.template.raw_llm_response if r.template else r.evaluation_input) or "",
        "grade": grade,
        "grades": grades,
        "trajectory": _trajectory(r),
        "agent_id": None,
        "model_name": m.answering_model,
        "judge_name": m.parsing_model,
        "usage": usage,
        "agent_usage": [usage["answer_generation"]] if isinstance(usage.get("answer_generation"), dict) else [],
        "result": r.model_dump(mode="json"),
    }


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


def _rate(num: float, den: int) -> float:
    """`num / den` as a percentage to two places; 0.0 when `den` is 0."""
    if not den:
        return 0.0
    return round(100.0 * num / den, 2)


class _Tally:
    """Counts of samples: total, attempted, sum of scores, passed (by one criterion)."""

    __slots__ = ("attempted", "passed", "score_sum", "total")

    def __init__(self) -> None:
        self.total = self.attempted = self.passed = 0
        self.score_sum = 0.0

    def add(self, attempted: bool, score: float, passed: bool) -> None:
        self.total += 1
        if attempted:
            self.attempted += 1
            self.score_sum += score
            self.passed += 1 if passed else 0


class SummaryTally:
    """`summarize` one result at a time: aggregate counts only (per model, per metric, per error
    kind), so a run streamed from the store is summarised without holding its results."""

    def __init__(self, *, trait_ranges: Mapping[str, tuple[float, float]] | None = None,
                 criterion: PassCriterion = DEFAULT_PASS, criteria: Mapping[str, PassCriterion] | None = None) -> None:
        self.trait_ranges, self.criterion, self.criteria = trait_ranges, criterion, dict(criteria or {})
        self.all = _Tally()
        self.models: dict[str, _Tally] = defaultdict(_Tally)
        self.metrics: dict[str, _Tally] = defaultdict(_Tally)  # over samples that have the metric
        self.groups: dict[tuple[str, str], dict[str, Any]] = {}
        self.usage = UsageTally()  # the exact cost, rounded once in `summary`

    def add(self, item: VerificationResult | Sample) -> None:
        """One result, or its `Sample` when the caller scored it already (with these trait ranges)."""
        s = item if isinstance(item, Sample) else sample_of(item, self.trait_ranges)
        r, attempted, score = s.result, s.attempted, s.score
        passed = attempted and self.criterion(score)
        self.all.add(attempted, score, passed)
        self.models[r.metadata.answering_model].add(attempted, score, passed)
        if attempted:
            for name, v in s.metrics.items():
                self.metrics[name].add(True, v, self.criteria.get(name, DEFAULT_PASS)(v))
        kind = error_kind(r)
        if kind is not None:
            stage, etype, message = kind
            g = self.groups.setdefault((stage, etype), {"stage": stage, "type": etype, "count": 0,
                                                        "example": message[:300],
                                                        "example_question": r.metadata.question_id})
            g["count"] += 1
        self.usage.add(r)

    def summary(self, unfinished_skipped: int = 0) -> dict[str, Any]:
        a = self.all
        total, att, passed = a.total, a.attempted, a.passed
        # some attempted sample had no template verdict (rubric_only): it was scored on its rubric
        by_rubric = att > (self.metrics[ACCURACY].attempted if ACCURACY in self.metrics else 0)
        p = Proportion.of(passed, att)
        per_model: list[dict[str, Any]] = []
        for model, t in sorted(self.models.items()):
            pp = Proportion.of(t.passed, t.attempted)
            per_model.append({
                "model_name": model,
                "total": t.total,
                "total_attempted": t.attempted,
                "avg_score_attempted": round(t.score_sum / t.attempted, 4) if t.attempted else 0.0,
                "avg_score_total": round(t.score_sum / t.total, 4) if t.total else 0.0,
                "passed_samples": t.passed,
                "failed_samples": t.attempted - t.passed,
                "errors": t.total - t.attempted,
                "pass_rate": _rate(t.passed, t.attempted) if t.attempted else None,
                "pass_rate_ci95": list(pp.ci_percent),
            })
        by_metric: dict[str, Any] = {}
        for name in sorted(self.metrics, key=lambda n: (n != ACCURACY, n)):
            t = self.metrics[name]
            mp = Proportion.of(t.passed, t.attempted)
            by_metric[name] = {
                "samples": t.attempted,
                "avg_score_attempted": round(t.score_sum / t.attempted, 4) if t.attempted else 0.0,
                "avg_score_total": round(t.score_sum / total, 4) if total else 0.0,
                "pass_rate": _rate(t.passed, t.attempted),
                "pass_rate_ci95": list(mp.ci_percent),
                "passed_attempts": t.passed,
                "failed_attempts": t.attempted - t.passed,
            }
        groups = sorted(self.groups.values(), key=lambda g: (-g["count"], g["stage"], g["type"]))
        raised = sum(g["count"] for g in groups if g["type"].startswith(VERIFY_RAISED))
        return {
            "total": total,
            "total_attempted": att,
            "avg_score_attempted": round(a.score_sum / att, 4) if att else 0.0,
            "avg_score_total": round(a.score_sum / total, 4) if total else 0.0,
            "passed_attempts": passed,
            "failed_attempts": att - passed,
            "pass_rate": _rate(passed, att),
            "pass_rate_ci95": list(p.ci_percent),
            "errors": total - att,
            "verify_raised": raised,
            "failed_plain": max(0, att - passed - raised),
            "error_groups": groups,
            "unfinished_questions_skipped": unfinished_skipped,
            "by_metric": by_metric,
            "per_model": per_model,
            # model calls, cached replies, cost in USD (shared.core.usage: summed exactly, rounded once)
            "usage": self.usage.as_dict(),
            # what `passed_attempts` passed: the template's verdict, or (rubric_only) the rubric traits' mean
            "passed_by_rubric": by_rubric,
            "pass_rule": (f"{'the mean of its rubric trait scores (each 0-1)' if by_rubric else ACCURACY} "
                          f"{OP_SYMBOLS[self.criterion.op]} {self.criterion.value:g}"),
        }


def summarize(
    results: Iterable[VerificationResult], unfinished_skipped: int = 0, *,
    trait_ranges: Mapping[str, tuple[float, float]] | None = None,
    criterion: PassCriterion = DEFAULT_PASS, criteria: Mapping[str, PassCriterion] | None = None,
) -> dict[str, Any]:
    """Run metrics (`spec/004` summary `metrics`): totals, attempted, average scores, passed and
    failed attempts (per-sample `criterion` on the sample score), by_metric, per_model, and the
    Wilson interval of every pass rate. `criteria` overrides the pass rule per metric. One pass
    over `results` (which may be streamed from the store), keeping counts only."""
    tally = SummaryTally(trait_ranges=trait_ranges, criterion=criterion, criteria=criteria)
    for r in results:
        tally.add(r)
    return tally.summary(unfinished_skipped)


# --------------------------------------------------------------------------------------------
# Console
# --------------------------------------------------------------------------------------------


def from_simulator(r: VerificationResult) -> bool:
    """Whether the offline LLM simulator answered or judged this result: its run is labelled
    SIMULATED (the store asks the same of its rows: `answering_interface = 'simulator' OR
    parsing_interface = 'simulator'`)."""
    return "simulator" in (r.metadata.answering.interface, r.metadata.parsing.interface)


def results_block(summary: Mapping[str, Any], gate_lines: Sequence[str] = (), simulated: bool = False) -> str:
    """The console results block of `spec/004`: totals, attempted, avg score, passed, gate
    line(s), then one line per model."""
    s = summary
    pct = percent(s["passed_attempts"] / s["total_attempted"]) if s["total_attempted"] else 0.0
    lines = ["Results:" + ("  (SIMULATED LLM)" if simulated else ""),
             f"  Total samples: {s['total']}",
             f"  Attempted: {s['total_attempted']}",
             f"  Avg score: {s['avg_score_total']:.2f} (attempted: {s['avg_score_attempted']:.2f})",
             f"  Passed: {s['passed_attempts']} ({pct:.1f}%)"]
    if s.get("passed_by_rubric"):  # rubric_only: say what passed means here
        lines[-1] += f", by the rubric: a result passes when {s['pass_rule']} (no template verdicts in rubric_only)"
    if "failed_plain" in s:
        lines.append(f"  Failed: {s['failed_plain']}")
    if s.get("verify_raised"):
        lines.append(f"  verify() raised: {s['verify_raised']} (template errors, counted apart from plain fails)")
    if s.get("errors"):
        lines.append(f"  Errors: {s['errors']}")
    groups = s.get("error_groups") or []
    if groups:
        lines.append("  Errors by stage and type (count x stage / type: example):")
        lines.extend(error_lines(groups))
    if s.get("unfinished_questions_skipped"):
        lines.append(f"  Unfinished questions skipped: {s['unfinished_questions_skipped']}")
    if s.get("dead_lettered"):
        lines.append(f"  Dead-lettered jobs: {s['dead_lettered']}")
    if isinstance(s.get("usage"), Mapping):  # model calls, cached replies, cost (shared.core.usage)
        lines.extend(usage_lines(s["usage"]))
    if gate_lines:
        lines.append("")
        lines.extend(gate_lines)
    models = s.get("per_model") or []
    if models:
        width = max(len(m["model_name"]) for m in models)
        lines.append("")
        lines.append("Results by model:")
        for m in models:
            rate = "n/a" if m.get("pass_rate") is None else f"{_shown_rate(m):.1f}%"
            lo, hi = m.get("pass_rate_ci95") or (0.0, 100.0)  # `percent`-rounded by `summary`
            extra = f", {m['errors']} error(s)" if m.get("errors") else ""
            lines.append(f"  {m['model_name']:<{width}}  - Avg: {m['avg_score_attempted']:.2f}, Pass: {rate} "
                         f"(95% CI {lo:.1f}-{hi:.1f}%){extra}")
    verdict = s.get("outcome")
    if verdict:
        lines.append("")
        lines.append("Outcome: " + ("✓ PASSED" if verdict["exit_code"] == 0 else "✗ FAILED: " + "; ".join(verdict["reasons"]))
                     + f" (exit {verdict['exit_code']})")
    return "\n".join(lines)


def _shown_rate(m: Mapping[str, Any]) -> float:
    """A model's pass rate as every output shows it (`percent` of its counts, not the rounded
    `pass_rate` rounded again); a summary without the counts shows its `pass_rate`."""
    if m.get("total_attempted") and "passed_samples" in m:
        return percent(m["passed_samples"] / m["total_attempted"])
    return float(m["pass_rate"])


def print_results(summary: Mapping[str, Any], gate_lines: Sequence[str] = (), *, simulated: bool = False,
                  run_id: str | None = None, file: TextIO | None = None) -> None:
    """Print the results block (and, with `run_id`, how to query the rows)."""
    out = file or sys.stdout
    print(file=out)
    print(results_block(summary, gate_lines, simulated), file=out)
    if run_id:
        print(f"\nrun id: {run_id}  -  rows: veribus query \"SELECT * FROM verification_results FINAL "
              f"WHERE run_id = '{run_id}'\"", file=out)


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def write_outputs(
    out_dir: Path, suite: str, run_id: str, results: Iterable[VerificationResult], summary: dict[str, Any],
    config: dict[str, Any], simulated: bool, *, gates: Sequence[Mapping[str, Any]] | None = None,
    trait_ranges: Mapping[str, tuple[float, float]] | None = None,
) -> None:
    """header.json, summary.json and results.jsonl in `out_dir` (`spec/004`). results.jsonl is in
    (question, answering model, judge, replicate) order, streamed line by line from the store
    for a `StoredResults` (`shared.analysis.stored.iter_sorted`)."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {"suite_name": suite, "run_id": run_id, "timestamp": datetime.now(UTC).isoformat(),
              "version": veribus_version(), "simulated": simulated}
    (out_dir / "header.json").write_text(json.dumps(header, indent=2))
    body = {"suite": suite, "run_id": run_id, "simulated": simulated,
            "config": {**config, "gates": list(gates or summary.get("gates") or [])},
            "metrics": summary, "gates_passed": bool(summary.get("gates_passed", True)),
            "error_groups": summary.get("error_groups") or [], "outcome": summary.get("outcome")}
    (out_dir / "summary.json").write_text(json.dumps(body, indent=2, default=str))
    with (out_dir / "results.jsonl").open("w", encoding="utf-8") as fh:
        for r in iter_sorted(results):
            fh.write(json.dumps(result_line(r, trait_ranges), default=str, ensure_ascii=False) + "\n")


def aggregate_stats(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """aggregate_stats.json over several runs' summaries (`spec/004`): runs passed/failed (by
    their gates), and mean, std, min, max and a 95% interval of each score and pass rate."""
    n = len(summaries)
    passed = sum(1 for s in summaries if s.get("gates_passed", True))

    def stat(values: Iterable[Any]) -> dict[str, Any]:
        d = describe([v for v in values if v is not None])
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}

    metrics = sorted({m for s in summaries for m in (s.get("by_metric") or {})}, key=lambda m: (m != ACCURACY, m))
    models = sorted({m["model_name"] for s in summaries for m in (s.get("per_model") or [])})
    return {
        "num_runs": n,
        "runs_passed": passed,
        "runs_failed": n - passed,
        "pass_rate": round(100.0 * passed / n, 2) if n else 0.0,
        "avg_score_attempted": stat(s.get("avg_score_attempted") for s in summaries),
        "avg_score_total": stat(s.get("avg_score_total") for s in summaries),
        "sample_pass_rate": stat(s.get("pass_rate") for s in summaries),
        "per_metric": {
            m: {
                "avg_score_attempted": stat((s.get("by_metric") or {}).get(m, {}).get("avg_score_attempted")
                                            for s in summaries if m in (s.get("by_metric") or {})),
                "pass_rate": stat((s.get("by_metric") or {}).get(m, {}).get("pass_rate")
                                  for s in summaries if m in (s.get("by_metric") or {})),
            } for m in metrics
        },
        "per_model": {
            model: {
                "avg_score_attempted": stat(pm["avg_score_attempted"] for s in summaries
                                            for pm in (s.get("per_model") or []) if pm["model_name"] == model),
                "pass_rate": stat(pm["pass_rate"] for s in summaries
                                  for pm in (s.get("per_model") or []) if pm["model_name"] == model),
            } for model in models
        },
    }


def write_multi_run(
    out_dir: Path, runs: Sequence[tuple[Sequence[VerificationResult], dict[str, Any]]], *,
    suite: str = "", run_ids: Sequence[str] | None = None, config: dict[str, Any] | None = None,
    simulated: bool = False, trait_ranges: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """`--num-runs N`: run_1/ ... run_N/ (each a full header/summary/results set) and
    aggregate_stats.json across them. Returns the aggregate stats."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, (results, summary) in enumerate(runs, 1):
        rid = run_ids[i - 1] if run_ids and i - 1 < len(run_ids) else f"run_{i}"
        write_outputs(out_dir / f"run_{i}", suite, rid, results, summary, dict(config or {}), simulated,
                      trait_ranges=trait_ranges)
    stats = aggregate_stats([s for _, s in runs])
    if run_ids:
        stats["run_ids"] = list(run_ids)
    (out_dir / "aggregate_stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def trait_ranges_from_benchmark(benchmark: Any) -> dict[str, tuple[float, float]]:
    """{trait: (min, max)} of every score trait a benchmark's questions are rated with."""
    out: dict[str, tuple[float, float]] = {}
    for q in benchmark.finished_questions():
        rubric = benchmark.rubric_for(q)
        if rubric is not None:
            out.update(trait_ranges_from_rubric(rubric.model_dump(mode="json")))
    return out
