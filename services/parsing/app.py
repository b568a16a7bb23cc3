"""Parsing service: guards.checked -> template.parsed (template modes only)."""

from __future__ import annotations

from services.parsing.stage import STAGE, parse_template
from shared import events
from shared.service import StageService, stage_error
from shared.template_cache import TemplateInfoCache

service = StageService("parsing")
llm = service.llm_client()
templates = TemplateInfoCache()


def _give_up(env: events.Envelope, ev: events.StageEvent, exc: BaseException) -> list[events.Envelope]:
    ev.state.error = ev.state.error or stage_error(STAGE, exc)
    return [service.emit(events.TEMPLATE_PARSED, ev.job, events.StageEvent(ev.job, ev.state, "failed", str(exc)))]


@service.handles(events.GUARDS_CHECKED, events.StageEvent, give_up=_give_up)
async def on_guards_checked(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
    job = ev.job
    if job.evaluation_mode == "rubric_only":
        return []  # no template branch in this mode: the finalizer does not wait for one
    info = None
    if job.template_code and not ev.state.error:
        info = await templates.get(job.template_id, job.template_code, job.question_id)
    state = await parse_template(job, ev.state, llm, info)
    return [service.emit(events.TEMPLATE_PARSED, job, events.StageEvent(job, state))]
