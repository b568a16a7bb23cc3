"""Statistics for benchmark results: confidence intervals, pass@k, paired model comparison.

Everything here is plain Python (no scipy) so the core install stays small:

- `wilson_interval`: the Wilson score interval for a binomial proportion. It behaves at 0/n and
  n/n (where the textbook Wald interval collapses to a point), which is common for pass rates.
- `percent`: the one rounding of every rate, Wilson limit and difference an output shows or
  writes (`Proportion.ci_percent` for an interval), so that outputs of the same run agree.
- `pass_at_k` / `pass_hat_k`: the unbiased estimators over n replicates with c passes
  (Chen et al. 2021 for pass@k; pass^k = all k draws pass, as in tau-bench).
- `mcnemar_exact` and `newcombe_paired_diff`: paired comparison of two models on the same jobs.
- `describe`: mean, std, min, max and a t-based 95% interval (multi-run aggregate stats).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

from shared.core.verdict import verdict_of

if TYPE_CHECKING:
    from shared.core.models import VerificationResult


# --------------------------------------------------------------------------------------------
# Distributions
# --------------------------------------------------------------------------------------------


def z_value(confidence: float = 0.95) -> float:
    """Two-sided normal quantile: 1.959964 for 95%."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(ln)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student t cumulative distribution."""
    x = df / (df + t * t)
    tail = 0.5 * betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def t_value(confidence: float, df: float) -> float:
    """Two-sided Student t quantile (12.706 for 95% and df=1), found by bisection on the cdf."""
    if df <= 0:
        raise ValueError("df must be positive")
    target = 0.5 + confidence / 2.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < target:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2.0


def binom_cdf(k: int, n: int, p: float = 0.5) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed exactly in log space."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    total = 0.0
    for i in range(k + 1):
        total += math.exp(
            math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
            + (i * math.log(p) if i else 0.0) + ((n - i) * math.log1p(-p) if n - i else 0.0)
        )
    return min(total, 1.0)


# --------------------------------------------------------------------------------------------
# Intervals
# --------------------------------------------------------------------------------------------


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for `successes` out of `n`; (0, 1) when n == 0 (nothing is known)."""
    if n <= 0:
        return (0.0, 1.0)
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n], got {successes}/{n}")
    z = z_value(confidence)
    p = successes / n
    z2n = z * z / n
    centre = (p + z2n / 2.0) / (1.0 + z2n)
    half = z * math.sqrt(p * (1.0 - p) / n + z2n / (4.0 * n)) / (1.0 + z2n)
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return (lo, hi)


PERCENT_PLACES = Decimal("0.1")  # every percentage shown or written: one decimal


def percent(fraction: float) -> float:
    """`fraction` (0.206549...) as the percentage every output shows and writes (20.7): rounded
    once, half away from zero, from its exact value. Never round a rounded figure again (20.65
    shown to one place is 20.6, while 20.6549 is 20.7): format this with `:.1f`."""
    return float((Decimal(fraction) * 100).quantize(PERCENT_PLACES, rounding=ROUND_HALF_UP))


@dataclass
class Proportion:
    """A pass rate with its Wilson interval (what every rate in reports carries)."""

    successes: int
    n: int
    rate: float | None
    ci_low: float
    ci_high: float

    @classmethod
    def of(cls, successes: int, n: int, confidence: float = 0.95) -> Proportion:
        lo, hi = wilson_interval(successes, n, confidence)
        return cls(successes, n, successes / n if n else None, lo, hi)

    @property
    def ci_percent(self) -> tuple[float, float]:
        """The Wilson interval in percent, as every output shows and writes it (`percent`)."""
        return percent(self.ci_low), percent(self.ci_high)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(values: Sequence[float], confidence: float = 0.95) -> dict[str, float | int | None]:
    """mean, sample std, min, max and a t-based confidence interval of the mean."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(vals)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None, "ci95_low": None, "ci95_high": None}
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    half = t_value(confidence, n - 1) * std / math.sqrt(n) if n > 1 else 0.0
    return {"n": n, "mean": mean, "std": std, "min": min(vals), "max": max(vals),
            "ci95_low": mean - half, "ci95_high": mean + half}


# --------------------------------------------------------------------------------------------
# pass@k across replicates
# --------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k: probability that at least one of k draws (of n, c correct) passes."""
    _check_nck(n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k: probability that all of k draws (of n, c correct) pass."""
    _check_nck(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


def _check_nck(n: int, c: int, k: int) -> None:
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")


def flakiness(n: int, c: int) -> float:
    """0 when every replicate agrees, 1 at a 50/50 split: 1 - |2p - 1|."""
    if n == 0:
        return 0.0
    return 1.0 - abs(2.0 * c / n - 1.0)


@dataclass
class PassAtK:
    """pass@k / pass^k per (answering model, judge), and every question's replicate outcomes."""

    ks: list[int]
    per_model: list[dict[str, Any]] = field(default_factory=list)
    per_question: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def replicate_outcomes(results: Iterable[VerificationResult]) -> dict[tuple[str, str, str], tuple[int, int]]:
    """(answering model, judge, question) -> (n verdicts, n passes) over replicates.

    Results without a template verdict (errors, rubric_only) are not samples (`verdict_of`)."""
    out: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in results:
        v = verdict_of(r)
        if v is None:
            continue
        key = (r.metadata.answering_model, r.metadata.parsing_model, r.metadata.question_id)
        out[key][0] += 1
        out[key][1] += 1 if v else 0
    return {k: (n, c) for k, (n, c) in out.items()}


def pass_at_k_report(results: Iterable[VerificationResult], ks: Sequence[int] | None = None) -> PassAtK:
    """pass@k and pass^k per model (mean over questions that have >= k replicates), and per
    question: n, c, pass rate with its Wilson interval, flaky flag and flakiness."""
    return pass_at_k_from_outcomes(replicate_outcomes(results), ks)


def pass_at_k_from_outcomes(outcomes: Mapping[tuple[str, str, str], tuple[int, int]],
                            ks: Sequence[int] | None = None) -> PassAtK:
    """`pass_at_k_report` from counts already gathered ((model, judge, question) -> (n, c)), so a
    streamed run needs no second pass over its results."""
    max_n = max((n for n, _ in outcomes.values()), default=0)
    ks = sorted({k for k in (ks or range(1, max_n + 1)) if k >= 1})
    report = PassAtK(ks=list(ks))
    by_model: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for (model, judge, qid), (n, c) in sorted(outcomes.items()):
        by_model[(model, judge)].append((n, c))
        p = Proportion.of(c, n)
        report.per_question.append({
            "answering_model": model, "parsing_model": judge, "question_id": qid, "n": n, "passed": c,
            "pass_rate": p.rate, "ci_low": p.ci_low, "ci_high": p.ci_high,
            "flaky": 0 < c < n, "flakiness": flakiness(n, c),
        })
    for (model, judge), qs in sorted(by_model.items()):
        row: dict[str, Any] = {"answering_model": model, "parsing_model": judge, "questions": len(qs),
                               "min_replicates": min(n for n, _ in qs), "max_replicates": max(n for n, _ in qs),
                               "flaky_questions": sum(1 for n, c in qs if 0 < c < n)}
        for k in ks:
            usable = [(n, c) for n, c in qs if n >= k]
            row[f"pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in usable) / len(usable) if usable else None
            row[f"pass^{k}"] = sum(pass_hat_k(n, c, k) for n, c in usable) / len(usable) if usable else None
            row[f"questions@{k}"] = len(usable)
        report.per_model.append(row)
    return report


# --------------------------------------------------------------------------------------------
# Paired comparison
# --------------------------------------------------------------------------------------------


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b, c discordant pairs (binomial test at p = 0.5)."""
    if b < 0 or c < 0:
        raise ValueError("counts must be >= 0")
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * binom_cdf(min(b, c), n, 0.5))


def newcombe_paired_diff(a: int, b: int, c: int, d: int, confidence: float = 0.95) -> tuple[float, float, float]:
    """Difference p_A - p_B of paired proportions and its interval (Newcombe 1998, method 10:
    Wilson limits of each marginal rate, combined with the phi correlation of the pairs).

    a: both pass, b: A passes only, c: B passes only, d: both fail. As published, the interval
    is degenerate (zero width) when b = c = 0 and both rates are exactly 1/2."""
    n = a + b + c + d
    if n == 0:
        return (0.0, -1.0, 1.0)
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, confidence)
    l2, u2 = wilson_interval(a + c, n, confidence)
    denom = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(denom) if denom > 0 else 0.0
    diff = p1 - p2
    dl = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    du = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return (diff, max(-1.0, diff - dl), min(1.0, diff + du))


@dataclass
class PairedComparison:
    model_a: str
    model_b: str
    pairs: int
    both_pass: int
    a_only: int
    b_only: int
    both_fail: int
    pass_rate_a: Proportion
    pass_rate_b: Proportion
    difference: float
    diff_ci_low: float
    diff_ci_high: float
    mcnemar_p: float
    unpaired_a: int = 0
    unpaired_b: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """A short human summary."""
        pa, pb = self.pass_rate_a, self.pass_rate_b

        def rate(p: Proportion) -> str:
            lo, hi = p.ci_percent
            return "n/a" if p.rate is None else f"{percent(p.rate):.1f}% [{lo:.1f}, {hi:.1f}]"

        verdict = "significant at 5%" if self.mcnemar_p < 0.05 else "not significant at 5%"
        return [
            f"paired jobs: {self.pairs} (unpaired: A {self.unpaired_a}, B {self.unpaired_b})",
            f"A {self.model_a}: {pa.successes}/{pa.n} passed, {rate(pa)}",
            f"B {self.model_b}: {pb.successes}/{pb.n} passed, {rate(pb)}",
            f"both pass {self.both_pass}, A only {self.a_only}, B only {self.b_only}, both fail {self.both_fail}",
            f"difference A - B: {percent(self.difference):+.1f} points, 95% CI [{percent(self.diff_ci_low):+.1f}, "
            f"{percent(self.diff_ci_high):+.1f}]",
            f"exact McNemar p = {self.mcnemar_p:.4g} ({verdict})",
        ]


def model_matches(display: str, model_name: str, query: str) -> bool:
    """A model filter matches the display string (`litellm:gpt-4o`), the bare model name
    (`gpt-4o`, `openai/gpt-4o`), or the name after the provider prefix."""
    return query in (display, model_name) or model_name.split("/", 1)[-1] == query


def answering_models(results: Iterable[VerificationResult]) -> list[tuple[str, str]]:
    """(display string, model name) of each answering model of `results`, sorted; results in the
    store (`StoredResults`) are asked in one query instead of read."""
    listed = getattr(results, "answering_models", None)
    if callable(listed):
        return listed()
    return sorted({(r.metadata.answering_model, r.metadata.answering.model_name) for r in results})


def unknown_model(results: Iterable[VerificationResult], model: str) -> list[str] | None:
    """None when `model` names an answering model of `results` (as `model_matches` reads it);
    else the model names there are (empty: no results), for the error that says so."""
    models = answering_models(results)
    if any(model_matches(display, name, model) for display, name in models):
        return None
    return sorted({name for _, name in models})


def paired_replicate(replicate: int | None) -> int:
    """The replicate a result is paired by. Replicates are numbered 1, 2, 3 ... (spec/001); a run
    of one replicate records none (None), and that one is the first: paired with replicate 1 of a
    run of several (`ifNull(replicate, 1)` in the viewer's SQL)."""
    return 1 if replicate is None else int(replicate)


def _verdicts(results: Iterable[VerificationResult], model: str) -> dict[tuple[Any, ...], bool]:
    out: dict[tuple[Any, ...], bool] = {}
    for r in results:
        m = r.metadata
        if not model_matches(m.answering_model, m.answering.model_name, model):
            continue
        v = verdict_of(r)
        if v is None:
            continue
        out[(m.question_id, paired_replicate(m.replicate), m.parsing_model)] = bool(v)
    return out


def compare_models(
    results_a: Iterable[VerificationResult], model_a: str, model_b: str,
    results_b: Iterable[VerificationResult] | None = None, confidence: float = 0.95,
) -> PairedComparison:
    """Compare two answering models on the same jobs, paired by (question, replicate, judge); a
    result without a replicate (a one-replicate run) pairs with replicate 1 (`paired_replicate`).

    With `results_b`, model B is read from that second result set (two runs). A re-iterable input
    (a list, or a run streamed from the store) is read twice rather than copied; only the
    verdicts are kept."""
    ra = results_a if hasattr(results_a, "__len__") else list(results_a)
    va = _verdicts(ra, model_a)
    vb = _verdicts(ra if results_b is None else results_b, model_b)
    keys = sorted(set(va) & set(vb), key=repr)
    if not keys:
        raise ValueError(f"no paired verdicts for {model_a!r} and {model_b!r} (same question, replicate and judge)")
    a = sum(1 for k in keys if va[k] and vb[k])
    b = sum(1 for k in keys if va[k] and not vb[k])
    c = sum(1 for k in keys if not va[k] and vb[k])
    d = len(keys) - a - b - c
    diff, lo, hi = newcombe_paired_diff(a, b, c, d, confidence)
    return PairedComparison(
        model_a=model_a, model_b=model_b, pairs=len(keys), both_pass=a, a_only=b, b_only=c, both_fail=d,
        pass_rate_a=Proportion.of(a + b, len(keys), confidence), pass_rate_b=Proportion.of(a + c, len(keys), confidence),
        difference=diff, diff_ci_low=lo, diff_ci_high=hi, mcnemar_p=mcnemar_exact(b, c),
        unpaired_a=len(va) - len(keys), unpaired_b=len(vb) - len(keys),
    )
