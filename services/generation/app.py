"""Generation service: answer.requested -> answer.generated (one per judge's job)."""

from __future__ import annotations

from typing import Any

import msgspec

from services.generation.stage import STAGE, generate_answer
from shared.core import events
from shared.core.stage import stage_error
from shared.core.usage import shared_reply
from shared.runtime.harness import StageService
from shared.runtime.mcp import default_pool

service = StageService("generation")
llm = service.llm_client()


@service.app.on_shutdown
async def _close_mcp() -> None:
    await default_pool().aclose()


def _give_up(env: events.Envelope, req: events.AnswerRequested, exc: BaseException) -> list[events.Envelope]:
    state = events.State(error=stage_error(STAGE, exc))
    return [service.emit(events.ANSWER_GENERATED, job, events.StageEvent(job, state, "failed", str(exc)))
            for job in req.jobs]


@service.handles(events.ANSWER_REQUESTED, events.AnswerRequested, give_up=_give_up)
async def on_answer_requested(env: events.Envelope, req: events.AnswerRequested) -> list[Any]:
    state = await generate_answer(req.jobs[0], llm)
    status = "failed" if state.error else "performed"
    first, *others = req.jobs
    out = [service.emit(events.ANSWER_GENERATED, first, events.StageEvent(first, state, status))]
    if others:  # one call, counted once: the answer's other judges' jobs carry its tokens, no call nor cost
        shared = msgspec.structs.replace(state, usage={k: shared_reply(e) for k, e in state.usage.items()})
        out += [service.emit(events.ANSWER_GENERATED, job, events.StageEvent(job, shared, status)) for job in others]
    return out
