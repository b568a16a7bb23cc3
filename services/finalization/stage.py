"""FinalizeResult (spec/003 stage 13): join the branches the job's mode expects, then fold.

The join reads the other branch's event from the stream (direct get of the last message on
its exact subject). Two finalizers racing on the two branch events cannot both miss: the one
handling the later-published event sees the earlier one. Both may finalize; the deterministic
event id makes the server keep one.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from shared.core import events
from shared.core.fold import fold_result, needs_rubric, needs_template
from shared.core.models import VerificationResult

Lookup = Callable[[str], Awaitable[events.StageEvent | None]]


async def try_finalize(ev_type: str, ev: events.StageEvent, lookup: Lookup) -> VerificationResult | None:
    """Fold the result when every expected branch has ended, else None (wait for the other)."""
    job = ev.job
    template_state: events.State | None = None
    rubric_state: events.State | None = None
    if ev_type == events.TEMPLATE_VERIFIED:
        template_state = ev.state
        if needs_rubric(job):
            other = await lookup(events.subject(events.RUBRIC_EVALUATED, job.run_id, job.result_id))
            if other is None:
                return None
            rubric_state = other.state
    else:
        rubric_state = ev.state
        if needs_template(job):
            other = await lookup(events.subject(events.TEMPLATE_VERIFIED, job.run_id, job.result_id))
            if other is None:
                return None
            template_state = other.state
    return fold_result(job, template_state, rubric_state, time.time())
