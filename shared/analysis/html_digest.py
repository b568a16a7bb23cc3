"""One pass over a run's results, keeping only what the report's sections draw.

`RunDigest.of(results)` reads the results once (a list, or `StoredResults` streamed page by page)
and keeps counts whose size grows with the number of models, questions, traits and error
kinds, never with the number of results. The end-to-end time quantiles of a stored run come from
SQL (`StoredResults.execution_time_by_model`); for a list (already in memory) the digest keeps one
float per result. The sections in `html_sections` render from the digest.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.analysis.report import from_simulator, trait_score
from shared.analysis.stored import StoredResults
from shared.core.models import VerificationResult
from shared.core.outcome import error_kind
from shared.core.usage import COST_KEY
from shared.core.verdict import verdict_of


def _quantile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default; ClickHouse's
    quantileExactInclusive)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _bucket(v: Any) -> Any:
    if isinstance(v, float) and not v.is_integer():
        return round(v, 1)
    if isinstance(v, float):
        return int(v)
    return v


@dataclass
class TraitTally:
    """One trait's values for one answering model: a count per value and the numeric mean; for
    a metric trait, the sum and count of each metric (precision, recall, ...)."""

    n: int = 0
    buckets: Counter[Any] = field(default_factory=Counter)
    num_sum: float = 0.0
    num_n: int = 0
    metric_sum: dict[str, float] = field(default_factory=dict)
    metric_n: dict[str, int] = field(default_factory=dict)

    def add(self, value: Any) -> None:
        self.n += 1
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, int | float):
                    self.metric_sum[k] = self.metric_sum.get(k, 0.0) + float(v)
                    self.metric_n[k] = self.metric_n.get(k, 0) + 1
                else:
                    self.metric_n.setdefault(k, 0)
                    self.metric_sum.setdefault(k, 0.0)
            return
        self.buckets[_bucket(value)] += 1
        if isinstance(value, int | float):
            s = trait_score(value) if isinstance(value, bool) else float(value)
            self.num_sum += float(s or 0.0)
            self.num_n += 1


@dataclass
class RunDigest:
    """Aggregates of a run for the report (see the module docstring)."""

    total: int = 0
    errored: int = 0
    simulated: bool = False
    models: set[str] = field(default_factory=set)
    judges: set[str] = field(default_factory=set)
    # per answering model: passed, verdicts, results, errors
    per_model: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0, 0]))
    # (model, question) and question: passed, verdicts; results per question; question texts
    cells: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    per_q: dict[str, list[int]] = field(default_factory=dict)
    q_results: Counter[str] = field(default_factory=Counter)
    texts: dict[str, str] = field(default_factory=dict)
    traits: dict[str, dict[str, TraitTally]] = field(default_factory=lambda: defaultdict(dict))
    trait_kinds: dict[str, str] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    e2e: dict[str, array] = field(default_factory=lambda: defaultdict(lambda: array("d")))
    replicates: dict[tuple[str, str, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    errors: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # (model, stage): model calls, cached replies, cost in USD, entries without a price, tokens
    cost: dict[tuple[str, str], list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0.0, 0, 0]))
    # end-to-end time per model: (model, results, p50, p95, max) from SQL for a stored run, else
    # from the per-result times kept in `e2e` (`track_e2e`)
    e2e_rows: list[tuple[str, int, float | None, float | None, float | None]] | None = None
    track_e2e: bool = True

    @classmethod
    def for_results(cls, results: Iterable[VerificationResult]) -> RunDigest:
        """An empty digest for these results: a stored run's end-to-end quantiles come from SQL
        (so nothing per result is kept), a list's from its times."""
        if isinstance(results, StoredResults):
            return cls(e2e_rows=results.execution_time_by_model(), track_e2e=False)
        return cls()

    @classmethod
    def of(cls, results: Iterable[VerificationResult]) -> RunDigest:
        d = cls.for_results(results)
        for r in results:
            d.add(r)
        return d

    def add(self, r: VerificationResult) -> None:
        m, t = r.metadata, r.template
        model, q = m.answering_model, m.question_id
        self.total += 1
        self.models.add(model)
        self.judges.add(m.parsing_model)
        self.simulated = self.simulated or from_simulator(r)
        c = self.per_model[model]
        c[2] += 1
        if not m.completed_without_errors:
            c[3] += 1
            self.errored += 1
        self.texts.setdefault(q, m.question_text)
        self.q_results[q] += 1
        cell = self.cells.setdefault((model, q), [0, 0])
        per_q = self.per_q.setdefault(q, [0, 0])
        v = verdict_of(r)  # an error is never a pass
        if v is not None:
            c[1] += 1
            c[0] += 1 if v else 0
            for x in (cell, per_q):
                x[1] += 1
                x[0] += 1 if v else 0
            rep = self.replicates[(model, m.parsing_model, q)]
            rep[0] += 1
            rep[1] += 1 if v else 0
        self._add_traits(r)
        usage = (t.usage_metadata if t else None) or {}
        for stage, e in usage.items():
            if stage == "total" or not isinstance(e, dict):
                continue
            tok = self.tokens[stage]
            tok[0] += int(e.get("input_tokens") or 0)
            tok[1] += int(e.get("output_tokens") or 0)
            tok[2] += 1
            calls = int(e.get("model_calls") or 0)
            k = self.cost[(str(e.get("model") or stage), stage)]
            k[0] += calls
            k[1] += int(e.get("cached_replies") or 0)
            if COST_KEY in e:
                k[2] += float(e[COST_KEY] or 0.0)
            elif calls or ("model_calls" not in e and e.get("total_tokens")):
                k[3] += 1
            k[4] += int(e.get("input_tokens") or 0) + int(e.get("output_tokens") or 0)
        if self.track_e2e:
            self.e2e[model].append(float(m.execution_time or 0.0))
        kind = error_kind(r)
        if kind is not None:
            stage, etype, message = kind
            g = self.errors.setdefault((stage, etype), {"stage": stage, "type": etype, "count": 0, "questions": set(),
                                                         "example": message,
                                                         "example_question": m.question_text or q})
            g["count"] += 1
            g["questions"].add(q)

    def _add_traits(self, r: VerificationResult) -> None:
        rub = r.rubric
        if rub is None or not rub.rubric_evaluation_performed:
            return
        model = r.metadata.answering_model
        labels = rub.llm_trait_labels or {}
        for kind, scores in (("llm", rub.llm_trait_scores), ("regex", rub.regex_trait_scores),
                             ("callable", rub.callable_trait_scores), ("metric", rub.metric_trait_scores)):
            for name, v in (scores or {}).items():
                self.trait_kinds.setdefault(name, "literal" if name in labels else kind)
                tally = self.traits[name].setdefault(model, TraitTally())
                tally.add(labels.get(name, v) if name in labels else v)

    def e2e_table(self) -> list[tuple[str, int, float | None, float | None, float | None]]:
        """(answering model, results, p50 s, p95 s, max s) of the end-to-end execution time."""
        if self.e2e_rows is not None:
            return self.e2e_rows
        return [(m, len(v), _quantile(v, 0.5), _quantile(v, 0.95), max(v)) for m, v in sorted(self.e2e.items())]

    def error_groups(self) -> list[dict[str, Any]]:
        """Errored results by (stage, type), most frequent first (`shared.core.outcome.error_kind`)."""
        return sorted(self.errors.values(), key=lambda g: (-g["count"], g["stage"], g["type"]))

    def hardest_first(self) -> list[str]:
        per_q = self.per_q
        return sorted(per_q, key=lambda q: (per_q[q][0] / per_q[q][1] if per_q[q][1] else 2.0, q))
