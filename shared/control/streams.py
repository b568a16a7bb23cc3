"""Reading a run's history back from the stream (the source of truth) for the run commands."""

from __future__ import annotations

import logging
import time
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from shared.core import events
from shared.runtime import bus, bus_auth

log = logging.getLogger("veribus.lifecycle")


# durable consumers whose queued messages still lead to results: the stage services' (their
# contract, `bus_auth.SERVICE_IO`) but the finalizer's dead letters; the projector's do not
STAGE_DURABLES = tuple(d for d in bus_auth.SERVICE_DURABLES if d != "finalization-dead")
PROJECTOR_DURABLE = "projector"


class LifecycleError(RuntimeError):
    """A lifecycle command that cannot proceed; the message says why and what to do."""


async def read_events(js: JetStreamContext, subject_filter: str, *, batch: int = 1000,
                      timeout: float = 60.0) -> list[events.Envelope]:
    """Every decodable event on `subject_filter`, in stream order, complete as the stream's
    leader holds it (`read_messages`); an undecodable message is not part of a run's history."""
    out: list[events.Envelope] = []
    for m in await read_messages(js, subject_filter, batch=batch, timeout=timeout):
        try:
            out.append(events.decode(m.data, m.subject))
        except Exception:  # noqa: BLE001
            pass
    return out


async def read_messages(js: JetStreamContext, subject_filter: str, *, batch: int = 1000,
                        timeout: float = 60.0) -> list[Msg]:
    """Every message on `subject_filter`, in stream order (an ephemeral consumer), complete as
    the stream's leader holds it (`read_consumer`)."""
    psub = await js.pull_subscribe(
        subject_filter, durable=None, stream=events.STREAM,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                              inactive_threshold=30.0, max_ack_pending=-1),
    )
    try:
        return await read_consumer(js, psub, subject_filter, batch=batch, timeout=timeout)
    finally:
        try:
            await psub.unsubscribe()
        except Exception:  # noqa: BLE001
            pass


async def leader_next_seq(js: JetStreamContext, subject_filter: str, after: int) -> int | None:
    """The stream sequence of the first message on `subject_filter` past `after`, as the stream's
    leader holds it, or None. (A non-direct message get is answered by the leader only.)"""
    try:
        msg = await bus.retry_cluster(
            lambda: js.get_msg(events.STREAM, seq=after + 1, subject=subject_filter, next=True), "message get")
    except NotFoundError:
        return None
    return int(msg.seq or 0) or None


async def copy_was_behind(js: JetStreamContext, subject_filter: str, last: int, end: int,
                          deadline: float, timeout: float) -> bool:
    """After a consumer said it was done at sequence `last`: whether the stream's leader holds a
    message on `subject_filter` in last+1..`end`, i.e. the copy the consumer read was behind and
    the read must go on. A copy still behind at `deadline` is an error naming the message: a
    read never returns a shorter answer than the leader holds."""
    behind = await leader_next_seq(js, subject_filter, last) if last < end else None
    if behind is None or behind > end:
        return False
    if time.monotonic() > deadline:
        raise LifecycleError(
            f"reading {subject_filter}: the stream's leader holds message {behind}, which the "
            f"replica serving the read had not caught up on after {timeout:.0f} s")
    log.debug("read of %s: the consumer's replica is behind the leader (seq %d); reading on", subject_filter, behind)
    return True


async def read_consumer(js: JetStreamContext, psub: JetStreamContext.PullSubscription, subject_filter: str, *,
                        batch: int = 1000, timeout: float = 60.0) -> list[Msg]:
    """Every message an unacknowledged consumer on `subject_filter` delivers, until the stream's
    leader holds nothing past the last one.

    On a replicated stream the server places an R1 consumer on any member, and it delivers from
    that member's copy, which may lag the leader (a node just restarted, or the one the quorum
    did not wait for): its pending count, read right after the run's last event, can be short,
    and a read that stops there returns a run without its newest results. So the leader closes
    the read: past the last sequence delivered, it must have no message on the filter that
    existed when the read began; the consumer is asked again until its copy catches up, and a
    read still short at `timeout` is an error, never a shorter answer."""
    out: list[Msg] = []
    deadline = time.monotonic() + timeout
    target = int((await bus.leader_stream_state(js)).last_seq or 0)  # what the read must cover
    last = 0
    remaining = (await psub.consumer_info()).num_pending
    while True:
        while remaining > 0:
            if time.monotonic() > deadline:
                raise LifecycleError(f"reading {subject_filter} from the stream took longer than {timeout:.0f} s")
            try:
                msgs = await psub.fetch(min(batch, remaining), timeout=2.0)
            except Exception as exc:  # noqa: BLE001 - nats TimeoutError: ask again
                log.debug("fetch %s: %s", subject_filter, exc)
                continue
            out.extend(msgs)
            meta = msgs[-1].metadata if msgs else None
            if meta is not None:
                last = max(last, int(meta.sequence.stream))
            remaining = meta.num_pending if meta is not None else remaining - len(msgs)
        if not await copy_was_behind(js, subject_filter, last, target, deadline, timeout):
            return out
        remaining = 1


async def subject_counts(js: JetStreamContext, subject_filter: str) -> dict[str, int]:
    """Messages per subject under a filter (e.g. result.finalized per result of one run)."""
    info = await js.stream_info(events.STREAM, subjects_filter=subject_filter)
    return dict(info.state.subjects or {})


async def finalized_ids(js: JetStreamContext, run_id: str) -> set[str]:
    """Result ids of the run that have a `result.finalized` event."""
    counts = await subject_counts(js, events.subject(events.RESULT_FINALIZED, run_id, "*"))
    return {s.rsplit(".", 1)[-1] for s in counts}


async def run_event(js: JetStreamContext, run_id: str) -> events.RunRequested:
    env = await bus.last_event(js, events.subject(events.RUN_REQUESTED, run_id))
    if env is None:
        raise LifecycleError(f"no run {run_id!r} in the stream (no run.requested event)")
    return events.payload_as(env, events.RunRequested)


async def run_requests(js: JetStreamContext, deadline: float | None = None) -> tuple[list[events.RunRequested], bool]:
    """Every run's `run.requested` in the stream (the newest message of each run's subject; a
    foreign message there is left out), and whether `deadline` (monotonic) cut the reading short."""
    info = await js.stream_info(events.STREAM, subjects_filter=events.subject(events.RUN_REQUESTED, "*"))
    out: list[events.RunRequested] = []
    for subj in info.state.subjects or {}:
        if deadline is not None and time.monotonic() > deadline:
            return out, True
        env = await bus.last_event(js, subj)
        if env is None:
            continue
        try:
            out.append(events.payload_as(env, events.RunRequested))
        except Exception:  # noqa: BLE001, S112 - a foreign message on the subject
            continue
    return out, False


async def consumer_lags_leader(js: JetStreamContext, ci: Any) -> bool:
    """Whether the stream's leader holds a message on the consumer's filter past its ack floor.
    A consumer's counts are its own member's copy, which may lag the leader, so counts that say
    nothing is left are checked with this before they are believed."""
    floor = int(ci.ack_floor.stream_seq or 0) if ci.ack_floor else 0
    filters = ([ci.config.filter_subject] if ci.config.filter_subject else list(ci.config.filter_subjects or [])
               ) or events.STREAM_SUBJECTS
    for f in filters:
        if await leader_next_seq(js, f, floor) is not None:
            return True
    return False


async def queued_for_services(js: JetStreamContext) -> dict[str, int]:
    """Messages the stage services still have to handle (pending + unacked), per durable; a
    durable whose counts say none while its copy lags the leader (`consumer_lags_leader`) counts
    1, at least (how many, that copy cannot tell)."""
    out: dict[str, int] = {}
    for name in STAGE_DURABLES:
        try:
            ci = await js.consumer_info(events.STREAM, name)
        except NotFoundError:
            continue
        n = int(ci.num_pending or 0) + int(ci.num_ack_pending or 0)
        if n or await consumer_lags_leader(js, ci):
            out[name] = n or 1
    return out
