"""The usage counters beside the tokens: cost in money, model calls, cached replies.

Prices are looked up where calls are made (`shared.runtime.llm.pricing`); a model without a
price has an unknown cost: `cost_usd` is left out of its usage entry and the summary names it,
rather than pretending it was free.

Each `usage_metadata` stage entry (spec/001) keeps its token fields and gains:
`cost_usd` (when known), `model_calls` (requests sent, retries included; 0 for a cached reply)
and `cached_replies` (replies served from the response cache).
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


class UsageTally:
    """Model calls, cached replies and the exact cost (unrounded) over results added one at a
    time; `as_dict` rounds the cost once (`usd`)."""

    __slots__ = ("cached", "calls", "cost", "unknown")

    def __init__(self) -> None:
        self.calls = self.cached = 0
        self.cost = 0.0
        self.unknown: set[str] = set()

    def add(self, r: Any) -> None:
        for stage, e in _usage_of(r).items():
            if stage == "total" or not isinstance(e, Mapping):
                continue
            self.calls += int(e.get("model_calls", 0) or 0)
            self.cached += int(e.get("cached_replies", 0) or 0)
            if COST_KEY in e:
                self.cost += float(e[COST_KEY] or 0.0)
            elif int(e.get("model_calls", 0) or 0) > 0 or ("model_calls" not in e and e.get("total_tokens")):
                self.unknown.add(str(e.get("model") or stage))

    def as_dict(self) -> dict[str, Any]:
        return {"model_calls": self.calls, "cached_replies": self.cached, "cost_usd": usd(self.cost),
                "cost_unknown_models": sorted(self.unknown)}


def run_usage(results: Iterable[Any]) -> dict[str, Any]:
    """Model calls, cached replies and cost over a run's results (VerificationResult models or
    dicts), with the models whose cost is unknown: what the summary and the report show."""
    tally = UsageTally()
    for r in results:
        tally.add(r)
    return tally.as_dict()


def _usage_of(r: Any) -> Mapping[str, Any]:
    if isinstance(r, Mapping):
        t = r.get("template") or {}
        u = t.get("usage_metadata") if isinstance(t, Mapping) else None
    else:
        t = getattr(r, "template", None)
        u = getattr(t, "usage_metadata", None) if t is not None else None
    return u if isinstance(u, Mapping) else {}


def usage_lines(usage: Mapping[str, Any]) -> list[str]:
    """Console lines for a run's usage (see `run_usage`)."""
    calls, cached = usage.get("model_calls", 0), usage.get("cached_replies", 0)
    line = f"  Model calls: {calls}"
    if cached:
        line += f" ({cached} repl{'y' if cached == 1 else 'ies'} from the response cache)"
    lines = [line]
    cost = f"  Cost: {money(usage.get('cost_usd', 0.0))}"
    if usage.get("cost_unknown_models"):
        cost += f" (unknown for {', '.join(usage['cost_unknown_models'])}: no price in litellm's map or the config)"
    lines.append(cost)
    return lines
