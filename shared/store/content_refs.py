"""The content keys a job event refers to (`Job.refs`), read with small decoders that skip the
rest of the payload. Apart from `shared.store.rows` (which re-exports `content_refs`) only to keep
that module short."""

from __future__ import annotations

import msgspec

from shared.core.events import ANSWER_GENERATED, ANSWER_REQUESTED, Envelope


class _JobRefs(msgspec.Struct):
    refs: dict[str, str] = {}


job_refs_decoder = msgspec.json.Decoder(_JobRefs | None)  # a job's refs alone (rows: answer.generated's job bytes)


class _GeneratedRefs(msgspec.Struct):
    """The content keys of an answer.generated payload's job; the rest is skipped."""

    job: _JobRefs | None = None


class _RequestedRefs(msgspec.Struct):
    jobs: list[_JobRefs] = []


_generated_refs = msgspec.json.Decoder(_GeneratedRefs)
_requested_refs = msgspec.json.Decoder(_RequestedRefs)


def content_refs(env: Envelope) -> list[tuple[str, str]]:
    """(kind, key) of the contents a job event refers to (`Job.refs`): read from the events
    every job has once, answer.requested and answer.generated; [] for others or fat jobs."""
    if env.event_type == ANSWER_GENERATED:
        job = _generated_refs.decode(env.payload).job
        return list(job.refs.items()) if job is not None else []
    if env.event_type == ANSWER_REQUESTED:
        return [item for j in _requested_refs.decode(env.payload).jobs for item in j.refs.items()]
    return []
