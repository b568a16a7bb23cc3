"""Cost in money per model call: litellm's cost map, read offline from the JSON file litellm
ships (`model_prices_and_context_window_backup.json`; litellm itself is not imported, it takes
seconds; `VERIBUS_COST_MAP` names another file), or per-model overrides in the run config
(`input_cost_per_million_tokens`, `output_cost_per_million_tokens`) for private endpoints and
models the map does not know. None means unknown (see `shared.core.usage`)."""

from __future__ import annotations

import importlib.util
import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

from shared.core.config import Settings

log = logging.getLogger("veribus.cost")


@lru_cache(maxsize=1)
def cost_map() -> dict[str, dict[str, Any]]:
    """litellm's model price map, from the file it ships (no network, no litellm import)."""
    path = Settings.from_env("cost_map").cost_map
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
    Overrides in the config win over litellm's map. A simulated model (`interface: simulator`)
    costs nothing unless the config prices it: `--simulate --model gpt-4.1-mini` reported that
    model's price from the map for calls no provider ever saw."""
    inp = getattr(model, "input_cost_per_million_tokens", None)
    out = getattr(model, "output_cost_per_million_tokens", None)
    if inp is not None or out is not None:
        return (float(inp or 0.0) / 1e6, float(out or 0.0) / 1e6)
    if getattr(model, "interface", None) == "simulator":
        return (0.0, 0.0)
    return _map_prices(str(getattr(model, "model_name", "")))


def call_cost(model: Any, input_tokens: int, output_tokens: int) -> float | None:
    prices = prices_for(model)
    if prices is None:
        return None
    return round(input_tokens * prices[0] + output_tokens * prices[1], 10)
