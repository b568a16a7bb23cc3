"""A service's durable consumer as its service made it: `settle_consumer` at start-up puts back
what its settings decide and what decides which messages it gets, whoever changed them."""

from __future__ import annotations

import logging
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError

log = logging.getLogger("veribus.bus")

SETTLED_CONSUMER_FIELDS = ("ack_wait", "max_ack_pending", "max_deliver")
"""A durable consumer's fields its settings decide (`consumer_ack_wait_s`, ...)."""
# What else decides which messages a durable gets and how it may pull them, that an update of the
# durable can change (nats-server 2.15 refuses to change the deliver, ack and replay policies) and
# that no service sets: set, each stalls or starves the service (a pull over `max_batch` refused, a
# pull without the priority group refused, bodies left out, a durable deleted while its service is
# down). Raw API names: nats-py 2.16 models only the first three.
UNSET_CONSUMER_FIELDS = ("headers_only", "backoff", "inactive_threshold", "max_batch", "max_expires",
                         "max_bytes", "priority_groups", "priority_policy")
FIXED_CONSUMER_FIELDS = ("deliver_policy", "ack_policy", "replay_policy", "opt_start_seq", "opt_start_time")


def _unset(value: Any) -> bool:
    return value in (None, 0, False, "", "none") or value == [] or value == {}


def _filters(cfg: ConsumerConfig) -> list[str] | None:
    return sorted(cfg.filter_subjects or ([cfg.filter_subject] if cfg.filter_subject else [])) or None


async def settle_consumer(js: JetStreamContext, stream: str, durable: str, want: ConsumerConfig) -> bool:
    """Put an existing durable consumer back as its service makes it: `want`'s ack wait, max ack
    pending and max deliver (a changed setting takes effect when its services restart: the server
    keeps a durable's configuration, and binding to it changes nothing), its filter subject(s)
    (when `want` names them), none of the `UNSET_CONSUMER_FIELDS`, not paused. Whoever changed
    those (`cli` could, before the bus roles named every create: `verification` re-pointed at
    `vb.nothing.*.*` stalled every later run, across restarts), a warning names each; after a
    wrong filter the durable is reset to its ack floor, as what it passed over meanwhile is behind
    its position. Returns whether the consumer exists (one not there yet is left to its creation)."""
    try:
        info = await js._api_request(f"{js._prefix}.CONSUMER.INFO.{stream}.{durable}", b"",  # type: ignore[attr-defined]
                                     timeout=js._timeout)  # type: ignore[attr-defined]
    except NotFoundError:
        return False
    raw = dict(info.get("config") or {})
    have = ConsumerConfig.from_response(dict(raw))
    changed = {f: getattr(want, f) for f in SETTLED_CONSUMER_FIELDS
               if getattr(want, f) is not None and getattr(have, f) != getattr(want, f)}
    wrong = {f: raw.get(f) for f in UNSET_CONSUMER_FIELDS if not _unset(raw.get(f)) and _unset(getattr(want, f, None))}
    refiltered = _filters(want) is not None and _filters(have) != _filters(want)
    if refiltered:
        wrong["filter"] = _filters(have)
    fixed = {f: getattr(have, f) for f in FIXED_CONSUMER_FIELDS
             if getattr(want, f) is not None and getattr(have, f) != getattr(want, f)}
    if fixed:
        log.error("consumer %s: %s on the server, not this service's (%s); an update cannot change that: "
                  "the durable must be deleted (as admin) for the service to make it again", durable,
                  ", ".join(f"{k} {v}" for k, v in fixed.items()),
                  ", ".join(f"{k} {getattr(want, k)}" for k in fixed))
    if changed or wrong:
        for field, value in changed.items():
            setattr(have, field, value)
        for field in UNSET_CONSUMER_FIELDS:  # the unmodeled ones go with the update (absent: unset)
            if hasattr(have, field):
                setattr(have, field, getattr(want, field))
        if _filters(want) is not None:
            have.filter_subject, have.filter_subjects = want.filter_subject, want.filter_subjects
        have.pause_until = None  # an update does not pause nor resume (below)
        await js.add_consumer(stream, config=have)  # the server's create-or-update: these fields are editable
    if changed:
        log.info("consumer %s: %s updated from the settings", durable,
                 ", ".join(f"{k} {v:g}" for k, v in changed.items()))
    if wrong:
        log.warning("consumer %s: %s on the server, not what this service reads (filter %s); restored", durable,
                    ", ".join(f"{k} {v}" for k, v in wrong.items()), ", ".join(_filters(want) or ["as it was"]))
    if refiltered:
        await _reset_to_ack_floor(js, stream, durable)
    if info.get("paused"):
        log.warning("consumer %s: paused on the server until %s; resumed", durable, raw.get("pause_until"))
        await js.resume_consumer(stream, durable)
    return True


async def _reset_to_ack_floor(js: JetStreamContext, stream: str, durable: str) -> None:
    """Deliver again everything past the durable's ack floor: what a wrong filter passed over
    (its position moved past them) is redelivered; handling is idempotent (deterministic event
    ids), so the rest is only handled twice. A server before 2.14 has no reset."""
    try:
        await js.reset_consumer(stream, durable)
    except Exception as exc:  # noqa: BLE001 - reported: the runs in flight then need `veribus resume`
        log.warning("consumer %s: could not be reset to its ack floor (%s): the events that arrived while its "
                    "filter was wrong are not redelivered; `veribus resume` the runs in flight", durable, exc)
        return
    log.warning("consumer %s: reset to its ack floor: what arrived while its filter was wrong is delivered now",
                durable)
