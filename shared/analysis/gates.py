"""Quality gates (`spec/004`): pass/fail a run on a metric, for CI.

A gate is `METRIC OP VALUE`, optionally with a per-sample pass criterion `pass OP VALUE`:

    accuracy>=0.8                      share of attempted samples whose template verdict passed
    avg_score>0.7                      mean 0..1 sample score over attempted samples
    avg_score_total>=0.7               the same with errors scored 0
    pass_rate>=0.9 pass>=0.5           share of attempted samples whose score passes the criterion
    error_rate<=0.05                   errors / total  (also: errors, total, total_attempted)
    clarity>=0.6                       mean 0..1 score of a rubric trait (with `pass ...`: share passing)
    pass_rate:litellm:gpt-4o>=0.9      any metric, restricted to one answering model (display
    accuracy:gpt-4o>=0.8               string or model name) after the first ':'

OP is one of > >= < <= == (or gt gte lt lte eq). VALUE for a rate (every metric but the counts
errors/total/total_attempted) is a fraction 0..1, a percentage ("80%"), or a whole number in
(1, 100] read as a percentage (80 -> 0.8); a fractional one (1.5) must carry its % sign, since it
may as well be a mistyped fraction. A score trait with a known scale (a rubric trait of kind
"score" with min_score..max_score, e.g. 1..5; not 0..1) reads a number outside 0..1 as a mean on
that scale (`Clarity>=4` on 1..5 -> (4-1)/(5-1) = 0.75, the normalised mean the gate compares
with), and refuses one off the scale; 0..1 and "70%" stay fractions of the trait's range. The scale
is known once the run's rubric is (`check_gates(..., scales)`, `resolve_gates`, or the
trait_ranges given to `evaluate_gates`); each reading that converts a number is noted. In a YAML
run config, `gates:` is a list of such strings or of mappings {metric (or metric_key), op, value,
pass_op, pass_value}; a letta-style single `gate:` mapping is read too.

`evaluate_gates` returns a GateReport; exit codes: 0 all gates pass, 1 a gate failed (2 and 3
stay the CLI's input and run errors). `write_junit` writes one testcase per gate and per sample.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from shared.analysis.report import (
    ACCURACY,
    DEFAULT_PASS,
    DEFAULT_SCORE_RANGE,
    OP_SYMBOLS,
    OPS,
    PassCriterion,
    Sample,
    sample_of,
    trait_ranges_from_rubric,
)
from shared.analysis.stats import model_matches
from shared.core.models import VerificationResult

EXIT_OK = 0
EXIT_GATE_FAILED = 1

_SYMBOL_OPS = {">=": "gte", "<=": "lte", ">": "gt", "<": "lt", "==": "eq", "=": "eq"}
_OP_RE = r"(>=|<=|==|=|>|<|\bgte\b|\blte\b|\bgt\b|\blt\b|\beq\b)"
_GATE_RE = re.compile(rf"^\s*(?P<metric>[^<>=\s].*?)\s*(?P<op>{_OP_RE})\s*(?P<value>[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?%?)\s*$")
_PASS_RE = re.compile(rf"\s+pass\s*(?P<op>{_OP_RE})\s*(?P<value>[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?%?)\s*$")
RUN_METRICS = ("accuracy", "avg_score", "avg_score_total", "pass_rate", "error_rate", "errors", "total",
               "total_attempted")


class GateError(ValueError):
    """A gate that cannot be parsed (an input error: exit 2)."""


def _op(op: str) -> str:
    op = op.strip().lower()
    op = _SYMBOL_OPS.get(op, op)
    if op not in OPS:
        raise GateError(f"unknown gate operator {op!r}: use gt, gte, lt, lte, eq (or > >= < <= ==)")
    return op


def _number(text: Any) -> float:
    if isinstance(text, bool):
        raise GateError(f"gate value must be a number, got {text!r}")
    if isinstance(text, int | float):
        return float(text)
    s = str(text).strip()
    try:
        return float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError as exc:
        raise GateError(f"gate value must be a number, got {text!r}") from exc


@dataclass(frozen=True)
class Gate:
    metric: str
    op: str
    value: float
    pass_op: str | None = None
    pass_value: float | None = None
    aggregate: str | None = None  # "avg_score" (mean) or "accuracy" (share passing), letta's `metric`
    text: str | None = field(default=None, compare=False)  # as the user wrote it
    note: str | None = field(default=None, compare=False)  # how a value was read (80 -> 0.8)
    raw: str | None = field(default=None, compare=False, repr=False)  # the threshold as written ("4", "80%")
    raw_pass: str | None = field(default=None, compare=False, repr=False)
    scale: tuple[float, float] | None = field(default=None, compare=False)  # the trait scale it was read on
    # a refusal that stands unless the trait turns out to have a scale that reads the number
    problem: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.metric.strip():
            raise GateError("gate metric must not be empty")
        if self.op not in OPS:
            raise GateError(f"unknown gate operator {self.op!r}")
        if (self.pass_op is None) != (self.pass_value is None):
            raise GateError(f"gate {self.metric!r}: pass_op and pass_value go together")
        if self.pass_op is not None and self.pass_op not in OPS:
            raise GateError(f"unknown pass operator {self.pass_op!r}")
        if self.aggregate not in (None, "avg_score", "accuracy"):
            raise GateError(f"gate {self.metric!r}: metric kind must be avg_score or accuracy, got {self.aggregate!r}")

    @property
    def criterion(self) -> PassCriterion | None:
        if self.pass_op is None or self.pass_value is None:
            return None
        return PassCriterion(self.pass_op, self.pass_value)

    @property
    def reads_mean(self) -> bool:
        """The gate compares a mean of the metric (not a share of samples passing) with `value`."""
        return self.criterion is None and self.aggregate != "accuracy"

    def label(self) -> str:
        text = f"{self.metric} {OP_SYMBOLS[self.op]} {self.value:g}"
        if self.scale is not None and self.reads_mean:
            text += f" (a mean of {_on_scale(self.value, self.scale):g} on {_span(self.scale)})"
        if self.criterion is not None:
            text += f", sample passes at score {OP_SYMBOLS[self.criterion.op]} {self.criterion.value:g}"
            if self.scale is not None:
                text += f" ({_on_scale(self.criterion.value, self.scale):g} on {_span(self.scale)})"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items()
                if v is not None and k not in ("text", "note", "raw", "raw_pass", "problem")}

    def understood(self) -> str:
        """How the gate was read, for the run's output: `pass_rate>=80` and `>=0.8` read the same."""
        said = f" (from {self.text!r}" + (f"; {self.note}" if self.note else "") + ")" if self.text else ""
        return f"gate {self.label()}{said}"


COUNT_METRICS = ("errors", "total", "total_attempted")


def _base_metric(metric: str) -> str:
    return metric if metric in RUN_METRICS else metric.split(":", 1)[0]


def _span(scale: tuple[float, float]) -> str:
    return f"{scale[0]:g}–{scale[1]:g}"


def _on_scale(fraction: float, scale: tuple[float, float]) -> float:
    """A 0..1 fraction of a trait's range as a score on its scale (0.75 on 1..5 -> 4)."""
    return scale[0] + fraction * (scale[1] - scale[0])


def _as_rate(what: str, value: float, raw: str, *, trait: bool = False) -> tuple[float, str | None, str | None]:
    """A rate threshold in 0..1, a note on how it was read, and a deferred refusal. A whole
    number 1 < value <= 100 is a percentage (80 -> 0.8); a fractional one (1.5: 1.5 %, or a
    mistyped 0.15?) is refused unless written with its % sign. For a `trait` (whose scale may yet
    read the number: `Clarity>=3.5` on 1..5) such a refusal, and one of a negative number, is
    returned instead of raised, with a provisional reading."""
    if value > 100 or (value > 1 and raw.endswith("%")) or (value < 0 and not trait):
        hint = ("; a score trait's threshold is a fraction of its range (0..1, or a percentage), or a mean on "
                "its own scale") if trait else ""
        raise GateError(f"{what}: threshold {raw!r} is out of range: a rate is between 0 and 1 (or 0% and 100%)"
                        f"{hint}")
    if value < 0:
        return value, None, (f"{what}: threshold {raw!r} is out of range: a rate is between 0 and 1 (or 0% and "
                             "100%), and no known scale of this trait has negative scores")
    if value > 1:
        note = f"{raw} read as {value / 100.0:g} ({value:g}%)"
        if not value.is_integer():
            problem = (f"{what}: threshold {raw} is not a whole percentage, and a rate is between 0 and 1: write "
                       f"{raw}% for {value / 100.0:g}, or the fraction you meant")
            if not trait:
                raise GateError(problem)
            return value / 100.0, note, problem
        return value / 100.0, note, None
    return value, None, None


def _on_trait(what: str, trait: str, value: float, raw: str, scale: tuple[float, float]) -> tuple[float, str | None]:
    """A threshold on a score trait with a known scale, as the 0..1 fraction of its range that the
    gate compares with (the normalised mean, `report.trait_score`): a percentage and 0..1 are
    fractions of the range, any other number a score on the scale (refused off the scale)."""
    lo, hi = scale
    span = _span(scale)
    if raw.endswith("%"):  # 0..1 already (checked when read)
        return value, None if lo == 0 else f"{raw} of {trait}'s {span} range: a mean of {_on_scale(value, scale):g}"
    if 0 <= value <= 1:
        as_score = (value - lo) / (hi - lo)
        if lo <= value <= hi and not math.isclose(as_score, value):  # both readings possible: say which
            return value, (f"{raw} read as {value:g} of {trait}'s {span} range (a mean of "
                           f"{_on_scale(value, scale):g}); for a mean of {value:g} write {100 * as_score:g}%")
        return value, None
    if not lo <= value <= hi:
        raise GateError(f"{what}: threshold {raw} is outside {trait}'s {span} scale: give a mean score from "
                        f"{lo:g} to {hi:g}, a fraction of the range from 0 to 1, or a percentage of it (e.g. 75%)")
    fraction = (value - lo) / (hi - lo)
    return fraction, f"{raw} read on {trait}'s {span} scale as {fraction:g}"


def _trait_scale(metric: str, scales: Mapping[str, tuple[float, float]] | None) -> tuple[str, tuple[float, float]] | None:
    """(trait name, scale) of a gate's metric when it is a score trait whose scale reads numbers
    (not a run metric, not a 0..1 scale: that one reads as a rate), else None."""
    if not scales or _base_metric(metric) in RUN_METRICS:
        return None
    name = metric if metric in scales else metric.split(":", 1)[0]
    if name not in scales:
        return None
    lo, hi = (float(x) for x in scales[name])
    if hi <= lo or (lo >= 0 and hi <= 1):
        return None
    return name, (lo, hi)


def normalize_gate(gate: Gate, raw_value: Any = None, raw_pass: Any = None,
                   scales: Mapping[str, tuple[float, float]] | None = None) -> Gate:
    """Rates (every metric but errors/total/total_attempted) to 0..1 and counts >= 0; a score
    trait found in `scales` ({trait: (min, max)}) read on its scale (see the module docstring).
    Raises GateError on a threshold out of range; a trait's threshold that only its scale could
    read (3.5, -1) is kept as `problem`, raised by `resolve_gates` when no scale reads it."""
    base = _base_metric(gate.metric)
    trait = base not in RUN_METRICS
    found = _trait_scale(gate.metric, scales)
    said = f"gate {gate.text or gate.label()!r}"
    raw_v = str(raw_value).strip() if raw_value is not None else f"{gate.value:g}"
    raw_p = None if gate.pass_value is None else str(raw_pass).strip() if raw_pass is not None else f"{gate.pass_value:g}"
    notes, problems = [], []
    value = gate.value
    if base in COUNT_METRICS:
        if value < 0:
            raise GateError(f"{said}: threshold {raw_v!r} is out of range: a count is >= 0")
    else:
        if found is not None and gate.reads_mean:
            value, note = _on_trait(said, found[0], value, raw_v, found[1])
            problem = None
        else:  # a rate, or a share of samples passing (`pass ...`, kind accuracy)
            value, note, problem = _as_rate(said, value, raw_v, trait=trait and gate.reads_mean)
        notes.append(note)
        problems.append(problem)
    pass_value = gate.pass_value
    if pass_value is not None and raw_p is not None:
        if found is not None:
            pass_value, note = _on_trait(f"{said} pass criterion", found[0], pass_value, raw_p, found[1])
            problem = None
        else:
            pass_value, note, problem = _as_rate(f"{said} pass criterion", pass_value, raw_p, trait=trait)
        notes.append(note and "pass " + note)
        problems.append(problem)
    return replace(gate, value=value, pass_value=pass_value, note="; ".join(n for n in notes if n) or None,
                   raw=raw_v, raw_pass=raw_p, scale=None if found is None else found[1],
                   problem="; ".join(p for p in problems if p) or None)


def resolve_gates(gates: Sequence[Gate], scales: Mapping[str, tuple[float, float]] | None) -> list[Gate]:
    """The gates read again now that the run's trait scales ({trait: (min, max)}, as
    `report.trait_ranges_from_rubric` gives them) are known: a score trait's threshold on its scale,
    or refused (GateError) off it; a threshold that no scale reads now is refused (a fractional
    percentage, a negative number). Reading is from the text as written, so it may be repeated."""
    out: list[Gate] = []
    for g in gates:
        if g.raw is not None and _trait_scale(g.metric, scales) is not None:
            g = normalize_gate(replace(g, value=_number(g.raw),
                                       pass_value=None if g.raw_pass is None else _number(g.raw_pass)),
                               g.raw, g.raw_pass, scales)
        elif g.problem:
            raise GateError(g.problem)
        out.append(g)
    return out


def trait_scales(rubric: Mapping[str, Any] | None, numeric: Iterable[str] = ()) -> dict[str, tuple[float, float]]:
    """{trait: (min, max)} a gate reads a trait's threshold on, as the report scores it: the
    rubric's score traits, and any other trait whose results carry numeric scores (`numeric`,
    `report.numeric_traits`), which `report.trait_score` scales by the default 1..5."""
    out = dict.fromkeys(numeric, DEFAULT_SCORE_RANGE)
    out.update(trait_ranges_from_rubric(rubric))
    return out


def known_metrics(trait_names: Iterable[str]) -> set[str]:
    """Metric names a gate may use for a run whose rubric has these traits."""
    return {*RUN_METRICS, ACCURACY, *trait_names}


def check_gates(gates: Sequence[Gate], metrics: set[str], models: Sequence[tuple[str, str]] = (),
                scales: Mapping[str, tuple[float, float]] | None = None) -> list[Gate]:
    """Refuse a gate whose metric is not one of `metrics` (run metrics and the rubric's traits),
    or whose `:model` names no model of the run; `models` are (display, model_name) pairs. Returns
    the gates read on the run's trait `scales` (`resolve_gates`: a threshold off a trait's scale is
    refused here, before anything runs)."""
    for g in gates:
        base, model = (g.metric, None) if g.metric in metrics else _split_model(g.metric, metrics)
        if base not in metrics:
            close = difflib.get_close_matches(base, sorted(metrics), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise GateError(f"gate {g.text or g.label()!r}: unknown metric {base!r}{hint} (known: "
                            f"{', '.join(sorted(metrics))})")
        if model is not None and models and not any(model_matches(d, n, model) for d, n in models):
            raise GateError(f"gate {g.text or g.label()!r}: no model {model!r} in this run (models: "
                            f"{', '.join(sorted(n for _, n in models))})")
    return resolve_gates(gates, scales)


def parse_gate(text: str) -> Gate:
    """`"accuracy>=0.8"`, `"clarity >= 0.6 pass >= 0.75"`, `"pass_rate:litellm:gpt-4o > 90%"`."""
    s = str(text)
    pass_op = pass_value = None
    m = _PASS_RE.search(s)
    if m:
        pass_op, pass_value = _op(m.group("op")), _number(m.group("value"))
        s = s[: m.start()]
    g = _GATE_RE.match(s)
    if not g:
        raise GateError(f"cannot read gate {text!r}: expected METRIC OP VALUE with OP one of > >= < <= == "
                        "(or gt gte lt lte eq), e.g. accuracy>=0.8")
    raw_value = g.group("value")
    if re.search(r"[<>=!~]", g.group("metric")):
        raise GateError(f"cannot read gate {text!r}: bad operator; use one of > >= < <= == (or gt gte lt lte eq)")
    gate = Gate(g.group("metric").strip(), _op(g.group("op")), _number(raw_value), pass_op, pass_value,
                text=str(text).strip())
    return normalize_gate(gate, raw_value, m.group("value") if m else None)


def gate_from_mapping(d: Mapping[str, Any]) -> Gate:
    key = d.get("metric_key")
    kind = d.get("metric") if key else None
    name = key or d.get("metric") or d.get("name")
    if not name:
        raise GateError(f"gate {dict(d)!r} has no metric (or metric_key)")
    if "op" not in d or "value" not in d:
        raise GateError(f"gate {name!r} needs op and value")
    pass_op = _op(str(d["pass_op"])) if d.get("pass_op") is not None else None
    pass_value = _number(d["pass_value"]) if d.get("pass_value") is not None else None
    gate = Gate(str(name), _op(str(d["op"])), _number(d["value"]), pass_op, pass_value,
                str(kind) if kind is not None else None, text=f"{name} {d['op']} {d['value']}")
    return normalize_gate(gate, d["value"], d.get("pass_value"))


def gates_from_config(data: Mapping[str, Any] | None) -> list[Gate]:
    """The `gates:` list (strings or mappings) and/or a single `gate:` mapping of a run config."""
    if not data:
        return []
    out: list[Gate] = []
    items = data.get("gates")
    if items is not None and not isinstance(items, list):
        raise GateError("gates: expected a list of gates")
    for i, item in enumerate(items or []):
        if isinstance(item, str):
            out.append(parse_gate(item))
        elif isinstance(item, Mapping):
            out.append(gate_from_mapping(item))
        else:
            raise GateError(f"gates[{i}]: expected a string or a mapping, got {type(item).__name__}")
    single = data.get("gate")
    if isinstance(single, Mapping):
        out.append(gate_from_mapping(single))
    elif single is not None:
        raise GateError("gate: expected a mapping {metric_key, op, value}")
    return out


def parse_gates(texts: Iterable[str] | None) -> list[Gate]:
    return [parse_gate(t) for t in texts or []]


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


@dataclass
class GateOutcome:
    gate: Gate
    actual: float | None
    passed: bool
    samples: int
    detail: str = ""

    @property
    def line(self) -> str:
        state = "PASSED" if self.passed else "FAILED"
        actual = "no data" if self.actual is None else f"actual {self.actual:.4g}"
        g = self.gate
        if self.actual is not None and g.scale is not None and g.reads_mean:
            actual += f", a mean of {_on_scale(self.actual, g.scale):.4g} on {_span(g.scale)}"
        extra = f"; {self.detail}" if self.detail else ""
        return f"Gate ({self.gate.label()}): {state} ({actual}, {self.samples} samples{extra})"

    def as_dict(self) -> dict[str, Any]:
        return {"gate": self.gate.as_dict(), "label": self.gate.label(), "actual": self.actual,
                "passed": self.passed, "samples": self.samples, "detail": self.detail}


@dataclass
class GateReport:
    passed: bool
    outcomes: list[GateOutcome] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        return [o.line for o in self.outcomes]

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.passed else EXIT_GATE_FAILED

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "outcomes": [o.as_dict() for o in self.outcomes]}


def _split_model(metric: str, known: set[str]) -> tuple[str, str | None]:
    """`accuracy:litellm:gpt-4o` -> ("accuracy", "litellm:gpt-4o"); a known name is kept whole."""
    if metric in known or metric in RUN_METRICS or ":" not in metric:
        return metric, None
    base, model = metric.split(":", 1)
    return base, model


class _GateTally:
    """One reading of a gate (`base` metric, optional `model` filter) counted sample by sample."""

    def __init__(self, gate: Gate, base: str, model: str | None) -> None:
        self.gate, self.base, self.model = gate, base, model
        self.total = self.attempted = self.passed = 0
        self.score_sum = 0.0
        self.vals_n = self.vals_passed = 0
        self.vals_sum = 0.0

    def add(self, model: str, model_name: str, attempted: bool, score: float, metrics: Mapping[str, float]) -> None:
        if self.model is not None and not model_matches(model, model_name, self.model):
            return
        self.total += 1
        if not attempted:
            return
        self.attempted += 1
        self.score_sum += score
        c = self.gate.criterion or DEFAULT_PASS
        self.passed += 1 if c(score) else 0
        if self.base in metrics:
            v = metrics[self.base]
            self.vals_n += 1
            self.vals_sum += v
            self.vals_passed += 1 if c(v) else 0

    def outcome(self) -> GateOutcome:
        gate, base = self.gate, self.base
        if self.model is not None and not self.total:
            return GateOutcome(gate, None, False, 0, f"no results for model {self.model!r}")
        n = self.attempted
        actual: float | None
        if base == "avg_score":
            actual = self.score_sum / n if n else None
        elif base == "avg_score_total":
            n = self.total
            actual = self.score_sum / n if n else None
        elif base == "pass_rate":
            actual = self.passed / n if n else None
        elif base in ("error_rate", "errors", "total", "total_attempted"):
            total = self.total
            actual = {"error_rate": (total - n) / total if total else None, "errors": float(total - n),
                      "total": float(total), "total_attempted": float(n)}[base]
            n = total
        else:
            n = self.vals_n
            if not n:
                return GateOutcome(gate, None, False, 0, f"no attempted sample has metric {base!r}")
            if gate.criterion is not None or gate.aggregate == "accuracy" or base == ACCURACY:
                actual = self.vals_passed / n
            else:
                actual = self.vals_sum / n
        if actual is None:
            return GateOutcome(gate, None, False, n, "no samples")
        return GateOutcome(gate, actual, _holds(gate.op, actual, gate.value), n)


def _holds(op: str, actual: float, value: float) -> bool:
    """`actual OP value`, a mean that equals the threshold but for floating point (the mean of
    normalised scores 7 on 1..10 against (7-1)/9) counting as equal."""
    if math.isclose(actual, value, rel_tol=1e-9, abs_tol=1e-12):
        return op in ("gte", "lte", "eq")
    return OPS[op](actual, value)


class GateEvaluator:
    """`evaluate_gates` one result at a time (`add`), for a caller that makes one pass over a
    streamed run for several purposes; `report()` gives the GateReport."""

    def __init__(self, gates: Sequence[Gate], trait_ranges: Mapping[str, tuple[float, float]] | None = None) -> None:
        self.trait_ranges = trait_ranges
        gates = resolve_gates(gates, trait_ranges)  # a trait's threshold read on the scale its scores are
        self.tallies: list[tuple[_GateTally, _GateTally | None]] = []
        for g in gates:  # each gate read whole and, when it has a `:model` part, split (`report` picks)
            base, model = _split_model(g.metric, set())
            self.tallies.append((_GateTally(g, g.metric, None), None if model is None else _GateTally(g, base, model)))
        self.known: set[str] = set()

    def add(self, item: VerificationResult | Sample) -> None:
        if not self.tallies:
            return
        s = item if isinstance(item, Sample) else sample_of(item, self.trait_ranges)
        self.known.update(s.metrics)
        m = s.result.metadata
        for whole, split in self.tallies:
            for t in (whole, split):
                if t is not None:
                    t.add(m.answering_model, m.answering.model_name, s.attempted, s.score, s.metrics)

    def report(self) -> GateReport:
        """A gate named `metric:model` is read whole when some sample has a metric of that
        name, else split into metric and model."""
        outcomes = [(whole if split is None or whole.gate.metric in self.known else split).outcome()
                    for whole, split in self.tallies]
        return GateReport(all(o.passed for o in outcomes), outcomes)


def evaluate_gates(
    results: Iterable[VerificationResult] | Sequence[Sample], gates: Sequence[Gate],
    trait_ranges: Mapping[str, tuple[float, float]] | None = None,
) -> GateReport:
    """Evaluate every gate; the report passes when all do (and trivially with no gates). One pass
    over `results` (which may be streamed from the store), keeping counts only."""
    ev = GateEvaluator(gates, trait_ranges)
    if gates:
        for item in results:
            ev.add(item)
    return ev.report()


def summary_criterion(gates: Sequence[Gate]) -> tuple[PassCriterion, dict[str, PassCriterion]]:
    """The per-sample pass rule for `passed_attempts` (the first gate's: its pass_op/pass_value,
    or `score >= value` for an avg_score gate, else score >= 1.0) and per-metric rules."""
    overall = DEFAULT_PASS
    if gates:
        g = gates[0]
        if g.criterion is not None:
            overall = g.criterion
        elif g.metric.split(":", 1)[0] in ("avg_score", "avg_score_total") or g.aggregate == "avg_score":
            overall = PassCriterion("gte", g.value)
    per_metric = {g.metric: g.criterion for g in gates if g.criterion is not None}
    return overall, per_metric  # type: ignore[return-value]
