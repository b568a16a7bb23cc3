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
from collections.abc import Iterable
from typing import Any

import msgspec
from nats.js import JetStreamContext

from shared.core import events
from shared.core.outcome import COST_BUDGET_MESSAGE
from shared.core.usage import money
from shared.runtime.runcontrol import BudgetExhausted, RunControl, positive, usage_growth

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


def check_cost_budget(usd: Any) -> float:
    """A money budget as given (`--max-cost-usd`, `budget_cost_usd`): a positive amount of dollars."""
    if isinstance(usd, bool) or not isinstance(usd, int | float) or not usd > 0 or usd == float("inf"):
        raise ValueError(f"max_cost_usd / {BUDGET_KEY} must be a positive amount of US dollars, got {usd!r}")
    return float(usd)


def set_cost_budget(run_event: events.RunRequested, usd: float | None) -> None:
    """Record a money budget in the run's config (before submitting)."""
    if usd is None:
        return
    run_event.config = {**run_event.config, BUDGET_KEY: check_cost_budget(usd)}


def pop_cost_budget(config_data: dict[str, Any]) -> float | None:
    """Take `budget_cost_usd` out of a run-config mapping (it is not a VerificationConfig field)."""
    raw = config_data.pop(BUDGET_KEY, None)
    return None if raw is None else check_cost_budget(raw)


class CostControl(RunControl):
    """The run's money budget, read and spent like `RunControl`'s token budget (its counter,
    flushing and control-change reads are reused, on their own bucket, in micro-dollars): the
    run's `budget_cost_usd`, or the newest control change's (`resume --max-cost-usd`)."""

    bucket = COST_BUCKET

    def config_budget(self, config: dict[str, Any]) -> int | None:
        return _micro_budget(config.get(BUDGET_KEY))

    def control_budget(self, control: events.RunControlChange) -> int | None:
        return _micro_budget(control.budget_cost_usd)

    def exhausted(self, run_id: str, used: int, budget: int) -> BudgetExhausted:
        return BudgetExhausted(f"{COST_BUDGET_MESSAGE}: run {run_id} has spent {money(used / MICRO)} of its "
                               f"{money(budget / MICRO)} budget; this answer was not generated")

    async def stop_reason(self, run_id: str, published_at: float = 0.0) -> BudgetExhausted | None:
        """The money budget's stop only (a cancel is `RunControl.stop_reason`'s to say)."""
        return await self.budget_stop(run_id, await self.states.get(run_id), published_at)


def _micro_budget(usd: Any) -> int | None:
    dollars = positive(usd)
    return None if dollars is None else round(dollars * MICRO)


async def run_cost_spent(js: JetStreamContext, run_id: str) -> float:
    """Dollars the run's services have reported spending (the budget counter)."""
    return await CostControl(lambda: js)._read_counter(run_id) / MICRO
