"""Verification service: template.parsed -> template.verified."""

from __future__ import annotations

from services.verification.stage import STAGE, verify_template
from shared.core import events
from shared.runtime.harness import StageService

service = StageService("verification")
llm = service.llm_client()  # the embedding check's equivalence judge



@service.handles(events.TEMPLATE_PARSED, events.StageEvent, give_up=service.fail_forward(events.TEMPLATE_VERIFIED, STAGE))
async def on_template_parsed(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
    state = await verify_template(ev.job, ev.state, llm)
    return [service.emit(events.TEMPLATE_VERIFIED, ev.job, events.StageEvent(ev.job, state))]
