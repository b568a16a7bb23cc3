"""Rubric service: guards.checked -> rubric.evaluated (rubric modes only)."""

from __future__ import annotations

from services.rubric.stage import STAGE, evaluate_rubric
from shared.core import events
from shared.core.stage import stage_error
from shared.runtime.harness import StageService

service = StageService("rubric")
llm = service.llm_client()


def _give_up(env: events.Envelope, ev: events.StageEvent, exc: BaseException) -> list[events.Envelope]:
    # Rubric failure is non-fatal for the result (spec/003 stage 11): record it, keep the job.
    ev.state.signals.rubric_error = str(stage_error(STAGE, exc).message)
    return [service.emit(events.RUBRIC_EVALUATED, ev.job, events.StageEvent(ev.job, ev.state, "failed", str(exc)))]


def _no_rubric(ev: events.StageEvent) -> bool:
    return ev.job.evaluation_mode == "template_only"


@service.handles(events.GUARDS_CHECKED, events.StageEvent, give_up=_give_up, skip=_no_rubric)
async def on_guards_checked(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
    if _no_rubric(ev):
        return []  # no rubric branch in this mode (the harness acks these before hydrating: `skip`)
    state = await evaluate_rubric(ev.job, ev.state, llm)
    return [service.emit(events.RUBRIC_EVALUATED, ev.job, events.StageEvent(ev.job, state))]
