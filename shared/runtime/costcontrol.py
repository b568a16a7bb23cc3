"""A money budget per run (`veribus run --max-cost-usd X`, `budget_cost_usd` in `--config`).

It works like the token budget (`shared.runtime.runcontrol.RunControl`): every service adds what each
handled event cost to the run's counter in JetStream KV (micro-dollars, compare-and-set, flushed
in the background), and the generation service stops dispatching new answers once the run has
spent its budget: those jobs finalize with a `BudgetExhausted` error (the same stop `resume`
re-runs). In-flight work can overshoot by what was already dispatched. Calls whose price is
unknown cost nothing here: the summary names those models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from nats.js import JetStreamContext

from shared.core import events
from shared.core.outcome import COST_BUDGET_MESSAGE
from shared.runtime import bus
from shared.runtime.runcontrol import BudgetExhausted, RunControl, usage_growth

log = logging.getLogger("veribus.cost")

COST_BUCKET = "vb_run_cost"
BUDGET_KEY = "budget_cost_usd"
MICRO = 1_000_000


class _CostEntry(msgspec.Struct):
    cost_usd: float = 0.0


class _CostState(msgspec.Struct):
    usage: dict[str, _CostEntry | None] = {}


class _CostProbe(msgspec.Struct):
    state: _CostState | None = None


_probe = msgspec.json.Decoder(_CostProbe)


def micro_usd(usage: dict[str, Any] | None) -> int:
    """Micro-dollars of a state's `usage` map (stage entries; a `total` entry is ignored)."""
    if not usage:
        return 0
    total = 0.0
    for k, v in usage.items():
        if k == "total" or v is None:
            continue
        c = v.get("cost_usd") if isinstance(v, dict) else getattr(v, "cost_usd", 0.0)
        total += float(c or 0.0)
    return round(total * MICRO)


def cost_before(payload: Any) -> int:
    return micro_usd(payload.state.usage) if isinstance(payload, events.StageEvent) else 0


def cost_spent(before: int, outs: Iterable[events.Envelope]) -> int:
    """Micro-dollars one handled event spent (fan-out copies count once: the max is taken)."""
    return usage_growth(before, outs, _probe, micro_usd)


def set_cost_budget(run_event: events.RunRequested, usd: float | None) -> None:
    """Record a money budget in the run's config (before submitting)."""
    if usd is None:
        return
    if isinstance(usd, bool) or not isinstance(usd, int | float) or usd <= 0:
        raise ValueError(f"max_cost_usd / {BUDGET_KEY} must be a positive amount of US dollars, got {usd!r}")
    run_event.config = {**run_event.config, BUDGET_KEY: float(usd)}


def pop_cost_budget(config_data: dict[str, Any]) -> float | None:
    """Take `budget_cost_usd` out of a run-config mapping (it is not a VerificationConfig field)."""
    raw = config_data.pop(BUDGET_KEY, None)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float) or raw <= 0:
        raise ValueError(f"{BUDGET_KEY}: expected a positive amount of US dollars, got {raw!r}")
    return float(raw)


class CostControl(RunControl):
    """The run's money budget, read and spent like `RunControl`'s token budget (its counter
    and flushing are reused, on their own bucket, in micro-dollars)."""

    bucket = COST_BUCKET

    def __init__(self, js: Callable[[], JetStreamContext], **kw: Any) -> None:
        super().__init__(js, **kw)
        self._budgets: dict[str, int | None] = {}

    async def budget(self, run_id: str) -> int | None:  # type: ignore[override]
        """The run's budget in micro-dollars, or None (read from its run.requested once)."""
        if run_id in self._budgets:
            return self._budgets[run_id]
        budget: int | None = None
        try:
            env = await bus.last_event(self._js(), events.subject(events.RUN_REQUESTED, run_id))
        except Exception as exc:  # noqa: BLE001 - fail open, read again on the next message
            log.warning("cost budget: cannot read run %s: %s", run_id, exc)
            return None
        if env is not None:
            b = events.payload_as(env, events.RunRequested).config.get(BUDGET_KEY)
            budget = round(float(b) * MICRO) if isinstance(b, int | float) and b > 0 else None
        if len(self._budgets) > self.max_runs:
            self._budgets.clear()
        self._budgets[run_id] = budget
        return budget

    async def stop_reason(self, run_id: str, published_at: float = 0.0) -> BudgetExhausted | None:  # type: ignore[override]
        budget = await self.budget(run_id)
        if budget is None:
            return None
        used = await self.usage(run_id)
        if used >= budget:
            return BudgetExhausted(f"{COST_BUDGET_MESSAGE}: run {run_id} has spent ${used / MICRO:.6f} of its "
                                   f"${budget / MICRO:.6f} budget; this answer was not generated")
        return None


async def run_cost_spent(js: JetStreamContext, run_id: str) -> float:
    """Dollars the run's services have reported spending (the budget counter)."""
    return await CostControl(lambda: js)._read_counter(run_id) / MICRO
