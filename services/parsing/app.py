"""Parsing service: guards.checked -> template.parsed (template modes only)."""

from __future__ import annotations

from services.parsing.stage import STAGE, parse_template
from shared.core import events
from shared.core.stage import SANDBOX_SCOPE
from shared.runtime.harness import StageService
from shared.templates.cache import TemplateInfoCache

service = StageService("parsing")
llm = service.llm_client()
templates = TemplateInfoCache()



def _no_template(ev: events.StageEvent) -> bool:
    return ev.job.evaluation_mode == "rubric_only"


@service.handles(events.GUARDS_CHECKED, events.StageEvent, give_up=service.fail_forward(events.TEMPLATE_PARSED, STAGE),
                 skip=_no_template)
async def on_guards_checked(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
    job = ev.job
    if _no_template(ev):
        return []  # no template branch in this mode: the finalizer does not wait for one (see `skip`)
    info = None
    if job.template_code and not ev.state.error:
        info = await templates.get(job.template_id, job.template_code, job.question_id, scope=SANDBOX_SCOPE.get())
    state = await parse_template(job, ev.state, llm, info)
    return [service.emit(events.TEMPLATE_PARSED, job, events.StageEvent(job, state))]
