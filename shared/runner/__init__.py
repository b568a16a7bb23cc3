"""Old import path of `shared.control.runner` (documented API), kept as a re-export."""

from shared.control.runner import (
    RunInputError,
    RunOutcome,
    RunPlan,
    collect,
    new_run_id,
    plan_run,
    public_config,
    submit,
)

__all__ = [
    "RunInputError",
    "RunOutcome",
    "RunPlan",
    "collect",
    "new_run_id",
    "plan_run",
    "public_config",
    "submit",
]
