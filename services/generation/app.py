"""Generation service: answer.requested -> answer.generated (one per judge's job)."""

from __future__ import annotations

from typing import Any

from services.generation.stage import STAGE, generate_answer
from shared.core import events
from shared.runtime.harness import StageService, stage_error
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
    return [service.emit(events.ANSWER_GENERATED, job, events.StageEvent(job, state, status)) for job in req.jobs]
