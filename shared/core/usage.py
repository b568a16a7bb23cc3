"""The usage counters beside the tokens: cost in money, model calls, cached replies.

Prices are looked up where calls are made (`shared.runtime.llm.pricing`); a model without a
price has an unknown cost: `cost_usd` is left out of its usage entry and the summary names it,
rather than pretending it was free.

Each `usage_metadata` stage entry (spec/001) keeps its token fields and gains:
`cost_usd` (when known), `model_calls` (requests sent, retries included; 0 for a cached reply)
and `cached_replies` (replies served without a call: from the response cache, or a regraded
run's stored answer, whose call and cost that run counts: `reused`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

COUNT_KEYS = ("model_calls", "cached_replies")
COST_KEY = "cost_usd"
USD_PLACES = Decimal("0.000001")  # every amount of money shown or written: to the micro-dollar


def usd(amount: float) -> float:
    """An amount of dollars as every output writes it (summary.json, --format json): rounded
    once, half away from zero, from its exact value. Sum the exact amounts and round the sum:
    never sum rounded amounts nor round a rounded figure again (100 calls of $0.00030302 are
    $0.030302, while rounding each first makes $0.030300). Show it with `money` / `format_usd`."""
    return float(Decimal(amount).quantize(USD_PLACES, rounding=ROUND_HALF_UP))


def format_usd(amount: float) -> str:
    """`0.030302`: an amount of dollars in a table cell (the HTML report, the viewer)."""
    return f"{usd(amount):,.6f}"


def money(amount: float) -> str:
    """`$0.030302`: an amount of dollars as every output shows it (console summary, `report`,
    the HTML report, the viewer), from its exact value (`usd`)."""
    return "$" + format_usd(amount)


def usage_extras(*, cost_usd: float | None, attempts: int, cached: bool) -> dict[str, Any]:
    """The extra fields of one reply's usage entry."""
    out: dict[str, Any] = {"model_calls": 0 if cached else max(0, int(attempts)),
                           "cached_replies": 1 if cached else 0}
    if cached:
        out[COST_KEY] = 0.0  # nothing was paid for this reply
    elif cost_usd is not None:
        out[COST_KEY] = cost_usd
    return out


def reused(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A stage entry as a later run that reuses its reply records it (a regrade's stored answer):
    the reply's tokens, no call and no cost (the run that made the call paid for it, and counts
    it), and one reply served without a call (`cached_replies`), as from the response cache."""
    served = int(entry.get("model_calls", 0) or 0) > 0 or int(entry.get("cached_replies", 0) or 0) > 0
    return {**entry, **usage_extras(cost_usd=0.0, attempts=0, cached=served)}


def shared_reply(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A stage entry as the other jobs of one answer record it (its other judges): the reply's
    tokens, and no call nor cost, which the answer's first job counts, once, as `model_calls` is
    requests sent (with two judges the answering model is called once, not twice)."""
    return {**entry, **usage_extras(cost_usd=0.0, attempts=0, cached=False)}


def _cost_known(e: Mapping[str, Any]) -> bool:
    """An entry's cost is known when it carries one, or when it made no calls and used no tokens."""
    return COST_KEY in e or (not int(e.get("model_calls", 0) or 0) and not e.get("total_tokens"))


def add_extras(out: dict[str, Any], a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Sum the extra fields of two usage entries into `out`. The cost stays known only when both
    parts' costs are known."""
    for k in COUNT_KEYS:
        if k in a or k in b:
            out[k] = int(a.get(k, 0) or 0) + int(b.get(k, 0) or 0)
    if (COST_KEY in a or COST_KEY in b) and _cost_known(a) and _cost_known(b):
        out[COST_KEY] = round(float(a.get(COST_KEY, 0.0) or 0.0) + float(b.get(COST_KEY, 0.0) or 0.0), 10)
    return out


def total_extras(entries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The extra fields of a `usage_metadata` 'total' entry, over its stage entries."""
    out: dict[str, Any] = {}
    for e in entries:
        merged = add_extras({}, out, e)
        if out and not _cost_known(out):
            merged.pop(COST_KEY, None)
        # carry the token total so a later unknown-cost part is seen as such
        merged["total_tokens"] = int(out.get("total_tokens", 0) or 0) + int(e.get("total_tokens", 0) or 0)
        out = merged
    out.pop("total_tokens", None)
    return out


NOT_RECORDED_RUBRIC_ONLY = "rubric_only results carry no usage section"
NOT_RECORDED = "these results carry no usage section"


class UsageTally:
    """Model calls, cached replies and the exact cost (unrounded) over results added one at a
    time; `as_dict` rounds the cost once (`usd`).

    A result without a usage section says nothing of its calls: in rubric_only mode it has no
    `template`, where `usage_metadata` lives (spec/001); a reference export may carry none. Such
    results are counted (`results_without_usage`), and when no result has one the calls and the
    cost are unknown (None, with `not_recorded` saying why), never zero."""

    __slots__ = ("cached", "calls", "cost", "no_template", "results", "unknown", "without")

    def __init__(self) -> None:
        self.calls = self.cached = 0
        self.cost = 0.0
        self.unknown: set[str] = set()
        self.results = self.without = self.no_template = 0

    def add(self, r: Any) -> None:
        self.results += 1
        usage = _usage_section(r)
        if usage is None:
            self.without += 1
            self.no_template += 1 if _template_of(r) is None else 0
            return
        for stage, e in usage.items():
            if stage == "total" or not isinstance(e, Mapping):
                continue
            self.calls += int(e.get("model_calls", 0) or 0)
            self.cached += int(e.get("cached_replies", 0) or 0)
            if COST_KEY in e:
                self.cost += float(e[COST_KEY] or 0.0)
            elif int(e.get("model_calls", 0) or 0) > 0 or ("model_calls" not in e and e.get("total_tokens")):
                self.unknown.add(str(e.get("model") or stage))

    def as_dict(self) -> dict[str, Any]:
        if self.results and self.without == self.results:
            why = NOT_RECORDED_RUBRIC_ONLY if self.no_template == self.results else NOT_RECORDED
            return {"model_calls": None, "cached_replies": None, "cost_usd": None, "cost_unknown_models": [],
                    "results_without_usage": self.without, "not_recorded": why}
        return {"model_calls": self.calls, "cached_replies": self.cached, "cost_usd": usd(self.cost),
                "cost_unknown_models": sorted(self.unknown), "results_without_usage": self.without}


def recorded(usage: Mapping[str, Any] | None) -> bool:
    """Whether a usage summary knows the calls and the cost (`UsageTally.as_dict`, or a run's
    stage events: `shared.store.event_usage`)."""
    return bool(usage) and usage.get("model_calls") is not None  # type: ignore[union-attr]


def _template_of(r: Any) -> Any:
    return r.get("template") if isinstance(r, Mapping) else getattr(r, "template", None)


def _usage_section(r: Any) -> Mapping[str, Any] | None:
    """The result's `usage_metadata`; None when it has none (no template: rubric_only)."""
    t = _template_of(r)
    if isinstance(t, Mapping):
        u = t.get("usage_metadata")
    else:
        u = getattr(t, "usage_metadata", None) if t is not None else None
    return u if isinstance(u, Mapping) else None


def usage_lines(usage: Mapping[str, Any]) -> list[str]:
    """Console lines for a run's usage (`UsageTally.as_dict`; or its stage events', `source: events`)."""
    if not recorded(usage):
        why = usage.get("not_recorded") or NOT_RECORDED
        return [f"  Model calls: not recorded ({why})", f"  Cost: not recorded ({why})"]
    calls, cached = usage.get("model_calls", 0), usage.get("cached_replies", 0)
    line = f"  Model calls: {calls}"
    if cached:
        line += f" ({cached} repl{'y' if cached == 1 else 'ies'} without a call: response cache or regraded answers)"
    if usage.get("source") == "events":
        line += f" (from the run's stage events: {usage.get('not_recorded') or NOT_RECORDED})"
    lines = [line]
    cost = f"  Cost: {money(usage.get('cost_usd', 0.0))}"
    if usage.get("cost_unknown_models"):  # the sum is the priced calls' only: never a total it is not
        cost += (f" for the priced calls; unknown for {', '.join(usage['cost_unknown_models'])} (no price in "
                 "litellm's map or the config)")
    lines.append(cost)
    if usage.get("source") != "events" and usage.get("results_without_usage"):
        n = usage["results_without_usage"]
        lines.append(f"  ({n} result{'s carry' if n != 1 else ' carries'} no usage section: "
                     "not counted in the calls and cost above)")
    return lines
