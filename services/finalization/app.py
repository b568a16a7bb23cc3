"""Finalization service: template.verified / rubric.evaluated -> result.finalized."""

from __future__ import annotations

import time

from services.finalization.stage import finalize_dead_letter, try_finalize
from shared.core import events
from shared.core.fold import fold_result
from shared.core.stage import stage_error
from shared.runtime import bus
from shared.runtime.harness import StageService

service = StageService("finalization")


async def _lookup(subject: str) -> events.StageEvent | None:
    env = await service.last_event(subject)
    return events.payload_as(env, events.StageEvent) if env else None


def _finalized(ev: events.StageEvent, result_dump: dict) -> events.Envelope:
    return service.emit(events.RESULT_FINALIZED, ev.job, events.ResultFinalized.wire(result_dump))


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


async def _first_valid(subject: str) -> events.StageEvent | None:
    """The first message on `subject` that decodes and passes the wire limits."""
    seq = 1
    for _ in range(16):  # a handful of copies at most (redeliveries are deduplicated)
        try:
            msg = await service.js.get_msg(events.STREAM, seq=seq, subject=subject, next=True)
        except Exception:  # noqa: BLE001 - NotFoundError: no (further) message on the subject
            return None
        try:
            env = events.decode(msg.data, subject)
            ev = events.payload_as(env, events.StageEvent)
        except Exception:  # noqa: BLE001 - a bad copy: look at the next
            seq = (msg.seq or seq) + 1
            continue
        ev.job = await service.content.hydrate(ev.job)  # a lean job: its question and models back in
        return ev
    return None


async def _is_finalized(run_id: str, result_id: str) -> bool:
    return await bus.last_event(service.js, events.subject(events.RESULT_FINALIZED, run_id, result_id)) is not None


@service.handles(events.DEAD_LETTER, events.DeadLetter, durable="finalization-dead")
async def on_dead_letter(env: events.Envelope, dl: events.DeadLetter) -> list[events.Envelope]:
    """A dead letter for a job that can no longer finish becomes that job's finalized error result."""
    result = await finalize_dead_letter(dl, env.run_id, env.result_id, _first_valid,
                                        lambda rid: _is_finalized(env.run_id, rid))
    if result is None:
        return []
    return [events.make_envelope(events.RESULT_FINALIZED, env.run_id, env.result_id,
                                 events.ResultFinalized.wire(result.model_dump(mode="json")), service.producer)]
