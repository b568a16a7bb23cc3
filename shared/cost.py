"""Cost in money per model call, and the usage counters beside the tokens.

Prices come from litellm's cost map, read offline from the JSON file litellm ships
(`model_prices_and_context_window_backup.json`; litellm itself is not imported, it takes
seconds), or from per-model overrides in the run config (`input_cost_per_million_tokens`,
`output_cost_per_million_tokens`) for private endpoints and models the map does not know. A
model with neither has an unknown cost: `cost_usd` is left out of its usage entry and the
summary names it, rather than pretending it was free.

Each `usage_metadata` stage entry (spec/001) keeps its token fields and gains:
`cost_usd` (when known), `model_calls` (requests sent, retries included; 0 for a cached reply)
and `cached_replies` (replies served from the response cache).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger("veribus.cost")

COUNT_KEYS = ("model_calls", "cached_replies")
COST_KEY = "cost_usd"


@lru_cache(maxsize=1)
def cost_map() -> dict[str, dict[str, Any]]:
    """litellm's model price map, from the file it ships (no network, no litellm import)."""
    path = os.environ.get("VERIBUS_COST_MAP")
    if not path:
        spec = importlib.util.find_spec("litellm")
        if spec is None or spec.origin is None:
            return {}
        path = str(Path(spec.origin).parent / "model_prices_and_context_window_backup.json")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("cost map %s unreadable: %s; costs are unknown", path, exc)
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def _map_prices(model_name: str) -> tuple[float, float] | None:
    prices = cost_map()
    candidates = [model_name]
    if "/" in model_name:
        provider, bare = model_name.split("/", 1)
        candidates.append(bare)
    else:
        provider = ""
    for name in candidates:
        entry = prices.get(name)
        if not entry:
            continue
        if name != model_name and provider and entry.get("litellm_provider") not in (None, provider) and not str(
                entry.get("litellm_provider", "")).startswith(provider):
            continue  # "openai/x" must not pick up another provider's "x"
        inp, out = entry.get("input_cost_per_token"), entry.get("output_cost_per_token")
        if isinstance(inp, int | float) and isinstance(out, int | float):
            return float(inp), float(out)
    return None


def prices_for(model: Any) -> tuple[float, float] | None:
    """(USD per input token, USD per output token) of a ModelSpec/ModelConfig, or None (unknown).
    Overrides in the config win over litellm's map."""
    inp = getattr(model, "input_cost_per_million_tokens", None)
    out = getattr(model, "output_cost_per_million_tokens", None)
    if inp is not None or out is not None:
        return (float(inp or 0.0) / 1e6, float(out or 0.0) / 1e6)
    return _map_prices(str(getattr(model, "model_name", "")))


def call_cost(model: Any, input_tokens: int, output_tokens: int) -> float | None:
    prices = prices_for(model)
    if prices is None:
        return None
    return round(input_tokens * prices[0] + output_tokens * prices[1], 10)


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


def run_usage(results: Iterable[Any]) -> dict[str, Any]:
    """Model calls, cached replies and cost over a run's results (VerificationResult models or
    dicts), with the models whose cost is unknown: what the summary and the report show."""
    calls = cached = 0
    cost = 0.0
    unknown: set[str] = set()
    for r in results:
        usage = _usage_of(r)
        for stage, e in usage.items():
            if stage == "total" or not isinstance(e, Mapping):
                continue
            calls += int(e.get("model_calls", 0) or 0)
            cached += int(e.get("cached_replies", 0) or 0)
            if COST_KEY in e:
                cost += float(e[COST_KEY] or 0.0)
            elif int(e.get("model_calls", 0) or 0) > 0 or ("model_calls" not in e and e.get("total_tokens")):
                unknown.add(str(e.get("model") or stage))
    return {"model_calls": calls, "cached_replies": cached, "cost_usd": round(cost, 6),
            "cost_unknown_models": sorted(unknown)}


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
    cost = f"  Cost: ${usage.get('cost_usd', 0.0):.6f}"
    if usage.get("cost_unknown_models"):
        cost += f" (unknown for {', '.join(usage['cost_unknown_models'])}: no price in litellm's map or the config)"
    lines.append(cost)
    return lines
