"""Guards service: answer.generated -> guards.checked."""

from __future__ import annotations

from services.guards.stage import check_guards
from shared.core import events
from shared.core.stage import SANDBOX_SCOPE
from shared.runtime.harness import StageService
from shared.templates.cache import TemplateInfoCache

service = StageService("guards")
llm = service.llm_client()
templates = TemplateInfoCache()



def _judge_checks(job: events.Job) -> bool:
    """Whether a judge check (abstention, sufficiency) may run: only those read the question's
    text and template; without them the guards need neither, and the harness does not read them."""
    return bool(job.options.get("abstention_enabled") or job.options.get("sufficiency_enabled"))


@service.handles(events.ANSWER_GENERATED, events.StageEvent, give_up=service.fail_forward(events.GUARDS_CHECKED, "guards"),
                 needs_question=_judge_checks)
async def on_answer_generated(env: events.Envelope, ev: events.StageEvent) -> list[events.Envelope]:
    job = ev.job
    schema = None
    if job.options.get("sufficiency_enabled") and job.template_code and not ev.state.error:
        schema = await templates.schema(job.template_id, job.template_code, scope=SANDBOX_SCOPE.get())  # the run's process
    state = await check_guards(job, ev.state, llm, schema)
    return [service.emit(events.GUARDS_CHECKED, job, events.StageEvent(job, state))]
