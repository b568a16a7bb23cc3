"""FinalizeResult (spec/003 stage 13): join the branches the job's mode expects, then fold.

The join reads the other branch's event from the stream (the last message on its exact
subject: a direct get, and the stream's leader on a miss, as a replica may lag). Two finalizers
racing on the two branch events cannot both miss: the one handling the later-published event
sees the earlier one. Both may finalize; the deterministic event id makes the server keep one.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from shared.core import events
from shared.core.fold import fold_result, needs_rubric, needs_template
from shared.core.limits import valid_id
from shared.core.models import VerificationResult

Lookup = Callable[[str], Awaitable[events.StageEvent | None]]


async def try_finalize(ev_type: str, ev: events.StageEvent, lookup: Lookup) -> VerificationResult | None:
    """Fold the result when every expected branch has ended, else None (wait for the other).

    Requires: the incoming branch's event (`template.verified` or `rubric.evaluated`) and the
    job's evaluation mode (which branches it expects).
    Produces: the VerificationResult of `shared.core.fold.fold_result`, or None.
    Calls: `lookup(subject)` for the other branch's newest event (no model, no sandbox).
    """
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


# ---- dead letters ----------------------------------------------------------------------------

STAGE_EVENT_TYPES = (events.ANSWER_GENERATED, events.GUARDS_CHECKED, events.TEMPLATE_PARSED,
                     events.TEMPLATE_VERIFIED, events.RUBRIC_EVALUATED)

ValidOn = Callable[[str], Awaitable[events.StageEvent | None]]
"""The first decodable, valid stage event on an exact subject (None when there is none)."""


async def finalize_dead_letter(
    dl: events.DeadLetter, run_id: str, result_id: str, valid_on: ValidOn, finalized: Callable[[str], Awaitable[bool]],
) -> VerificationResult | None:
    """The finalized error result a dead letter stands for, or None.

    Only `result.finalized` ends a job, so a job whose message was dead-lettered must still get
    one, made here, by a service: when the dead-lettered subject names a result whose job is
    known from one of its valid stage events, no valid message exists on the dead-lettered
    subject itself (else that one carries the job on, and an error result would overwrite a
    live job: a forged bad copy of a real message changes nothing), and the result is not
    finalized yet. A dead letter whose job cannot be known (its only message was unreadable)
    finalizes nothing: the run reports it missing, with the dead letter, at its timeout."""
    if not (valid_id(run_id) and valid_id(result_id)) or await finalized(result_id):
        return None
    parts = dl.subject.split(".")
    dead_type = f"{parts[1]}.{parts[2]}" if len(parts) == 5 else ""
    if dead_type in STAGE_EVENT_TYPES and await valid_on(dl.subject) is not None:
        return None
    known: events.StageEvent | None = None
    for et in STAGE_EVENT_TYPES:
        if et == dead_type:
            continue
        ev = await valid_on(events.subject(et, run_id, result_id))
        if ev is not None:
            known = ev
    if known is None:
        return None
    state = known.state
    state.error = events.StageError(
        stage=dl.consumer or "unknown", type="DeadLetter",
        message=f"a message of this job could not be processed and was dead-lettered by {dl.consumer}: {dl.error}"[:2000],
    )
    return fold_result(known.job, state, None, time.time())
