"""Finalization service: template.verified / rubric.evaluated -> result.finalized."""

from __future__ import annotations

import time

from services.finalization.stage import try_finalize
from shared.core import events
from shared.core.fold import fold_result
from shared.runtime.harness import StageService, stage_error

service = StageService("finalization")


async def _lookup(subject: str) -> events.StageEvent | None:
    env = await service.last_event(subject)
    return events.payload_as(env, events.StageEvent) if env else None


def _finalized(ev: events.StageEvent, result_dump: dict) -> events.Envelope:
    return service.emit(events.RESULT_FINALIZED, ev.job, events.ResultFinalized(result=result_dump))


def _give_up(env: events.Envelope, ev: events.StageEvent, exc: BaseException) -> list[events.Envelope]:
    ev.state.error = ev.state.error or stage_error("finalize_result", exc)
    result = fold_result(ev.job, ev.state, None, time.time())
    return [_finalized(ev, result.model_dump(mode="json"))]


async def _handle(ev_type: str, ev: events.StageEvent) -> list[events.Envelope]:
    result = await try_finalize(ev_type, ev, _lookup)
    return [] if result is None else [_finalized(ev, result.model_dump(mode="json"))]


@service.handles(events.TEMPLATE_VERIFIED, events.StageEvent, durable="finalization-template", give_up=_give_up)
async def on_template_verified(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
    return await _handle(events.TEMPLATE_VERIFIED, ev)


@service.handles(events.RUBRIC_EVALUATED, events.StageEvent, durable="finalization-rubric", give_up=_give_up)
async def on_rubric_evaluated(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
    return await _handle(events.RUBRIC_EVALUATED, ev)
