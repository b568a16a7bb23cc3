"""The thin harness every stage service uses: subscribe to one event type on a durable pull
consumer, call the stage, publish what it returns, ack after publishing.

FastStream runs the app (connection, auth, start-up and shutdown hooks); the stage consumers
are pulled by `shared.runtime.pump.Pump`, a lean loop on nats-py: pull requests held open for as many messages as
there are free worker slots, a task started per message as it arrives. Profiled (issue 12),
FastStream's per-message path (context, middlewares, anyio task groups and semaphores) cost a
fifth of a stage service's CPU, and its fetch loop waits for a whole batch once the consumer is
drained.

Failure policy (at-least-once, exactly-once effect):
- a handler error is redelivered with backoff up to `consumer_max_deliver` times;
- after that the job is not dropped: a `stage.failed` event records the error and the
  stage's fallback event (its normal output, with `state.error` set) lets the run finish;
- a message that cannot be decoded at all goes to `dead.letter` with the reason;
- a message whose handling was cut off (its service stopped or was killed) comes back, and a
  delivery counts each time; after `consumer_max_interrupted` more than `consumer_max_deliver`,
  the next delivery records the give-up without running the handler (a job that kills its
  process, or is handed back by many `down`s, is never left without a result; the consumer keeps
  one spare delivery in case that publish fails).

Run control (`shared.runtime.runcontrol.RunControl`): an `answer.requested` of a run that was cancelled or
has spent its token budget is not handled; the stage's fallback event (its normal output with
the stop recorded as the error) is published instead, so the job still finalizes. Services add
the tokens each handled event spent to the run's counter when the run has a budget. Events a
service publishes carry the attempt key of the event they answer (`resume` re-runs).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from faststream import FastStream
from faststream.nats import NatsBroker, NatsMessage
from faststream.nats.security import NatsSecurity, NatsToken, NatsUserPassword
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy as JsAckPolicy
from nats.js.api import ConsumerConfig, DeliverPolicy

from shared.core import events
from shared.core.config import Settings
from shared.core.limits import safe_token
from shared.core.scrub import scrub_text
from shared.core.stage import SANDBOX_SCOPE, stage_error
from shared.runtime import bus, durables, observability, tracing
from shared.runtime.content import ContentStore
from shared.runtime.costcontrol import CostControl, cost_before, cost_spent
from shared.runtime.limits import deployment_limiter
from shared.runtime.llm.cache import CACHE_JOB, CACHE_SCOPE
from shared.runtime.llm.client import CALL_GATE, LLMClient
from shared.runtime.llm.transport import close_transports
from shared.runtime.pump import Delivery, Pump, hand_back
from shared.runtime.response_cache import job_for, scope_for, service_cache
from shared.runtime.runcontrol import (
    RunControl,
    RunStates,
    RunStopped,
    attempt_key,
    carry_attempt_key,
    tokens_before,
    tokens_spent,
)
from shared.runtime.service_keys import KeyAdvertiser

log = logging.getLogger("veribus.service")

VERSION = "0.1.0"

OUTCOME: ContextVar[str] = ContextVar("veribus_outcome", default="")
"""How `deliver` ended a message when not simply handled or nacked (for the metrics)."""

ATTEMPT_KEY: ContextVar[str] = ContextVar("veribus_attempt_key", default="")
"""The attempt key of the event being handled ('' for a first run; see `runcontrol.attempt_key`)."""

Handler = Callable[[events.Envelope, Any], Awaitable[list[events.Envelope]]]
GiveUp = Callable[[events.Envelope, Any, BaseException], list[events.Envelope]]


@dataclass(frozen=True)
class Subscription:
    """A handler as `StageService.handles` registered it: what `deliver` runs for one event type."""

    event_type: str
    fn: Handler
    payload_type: type
    give_up: GiveUp | None
    max_deliver: int
    durable: str = ""
    workers: int = 64
    batch_size: int = 32
    config: ConsumerConfig | None = None
    skip: Callable[[Any], bool] | None = None
    needs_question: Callable[[events.Job], bool] | None = None


def broker_auth_kwargs(opts: dict[str, Any]) -> dict[str, Any]:
    """NATS auth and TLS for a FastStream `NatsBroker` (`security=`) from nats-py's connect options
    (`bus.connect_options`): FastStream 0.7 takes no `user`/`password`/`tls` keyword arguments;
    and the role's reply inboxes (`inbox_prefix`), the only ones its permissions let it read."""
    ssl_context = opts.get("tls")
    out: dict[str, Any] = {"inbox_prefix": opts["inbox_prefix"]} if "inbox_prefix" in opts else {}
    if opts.get("user"):
        out["security"] = NatsUserPassword(opts["user"], opts.get("password") or "", ssl_context=ssl_context)
    elif opts.get("token"):
        out["security"] = NatsToken(opts["token"], ssl_context=ssl_context)
    elif ssl_context is not None:
        out["security"] = NatsSecurity(ssl_context=ssl_context)
    return out


def backoff_s(delivered: int) -> float:
    return min(30.0, 0.5 * (2 ** max(0, delivered - 1)))


class DeliveriesExhausted(RuntimeError):
    """A message's deliveries ran out without one handler finishing it."""


def give_up_delivery(max_deliver: int, max_interrupted: int) -> int:
    """The delivery that records the give-up without handling: `max_deliver` deliveries may fail
    in the handler, `max_interrupted` more may be cut off, and this is the one after. The
    consumer's `max_deliver` is one more, for a give-up whose publish failed to be tried again."""
    return max_deliver + max_interrupted + 1


class StageService:
    """One deployable service: a broker, its subscriptions and a JetStream handle for publishing."""

    def __init__(self, name: str, settings: Settings | None = None) -> None:
        self.name = name
        self.producer = f"{name}/{VERSION}@{socket.gethostname()}:{os.getpid()}"  # which replica
        self.settings = settings or Settings.from_env()
        opts = bus.connect_options(self.settings)
        kwargs: dict[str, Any] = {
            "name": f"veribus-{name}",
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 1,
            "connect_timeout": 5,
            "logger": None,
            "apply_types": False,
            "graceful_timeout": 10.0,
        }
        kwargs.update(broker_auth_kwargs(opts))
        self.broker = NatsBroker(opts["servers"], **kwargs)
        self.app = FastStream(self.broker, on_startup=[self._startup], after_startup=[self._after_startup],
                              on_shutdown=[self._stop_pumps, close_transports, self._close_control,
                                           self._stop_observer])
        self._js: JetStreamContext | None = None
        self.subscriptions: dict[str, Subscription] = {}
        self._pumps: list[Pump] = []
        self.startup_hooks: list[Callable[[], Awaitable[None]]] = []
        # one cached read of each run's state (config, cancel) for both budgets' gates
        run_states = RunStates(lambda: self.js)
        self.control = RunControl(lambda: self.js, states=run_states)
        self.cost_control = CostControl(lambda: self.js, states=run_states)
        self.content = ContentStore(lambda: self.js)  # job contents by hash (lean events)
        # events whose handling is dispatch of new model work: skipped for a stopped run
        self.gated_event_types: frozenset[str] = frozenset({events.ANSWER_REQUESTED})
        self.durables: list[str] = []
        self._observer: Any = None  # the /healthz /readyz /metrics server (shared.runtime.observability)
        # a model-calling service says on the bus which provider keys it holds, by name (`llm_client`)
        self.key_names: KeyAdvertiser | None = None
        tracing.configure(name, self.settings)  # spans over OTLP when VERIBUS_OTEL_ENDPOINT is set

    def llm_client(self) -> LLMClient:
        """The service's model client; its response cache moves to the shared JetStream KV bucket
        at start-up (so a redelivered or replayed stage does not pay for the same call twice), and
        the service's provider key names go on the bus (`service_keys`: the CLI of a configured
        deployment checks a run's keys there)."""
        client = LLMClient()

        async def attach_cache() -> None:
            client.cache = service_cache(self.js, run_scoped=self.settings.llm_cache,
                                         max_age_s=self.settings.response_cache_max_age_s)
            if self.settings.model_limits:
                client.limiter = deployment_limiter(self.broker.connection, self.producer,
                                                    self.settings.limits_lease_s)
                self.app.on_shutdown(client.limiter.close)

        self.startup_hooks.append(attach_cache)
        if self.key_names is None:  # one entry per service, however many clients it has
            self.key_names = KeyAdvertiser(lambda: self.js, self.name, self.producer, self.settings)
            self.startup_hooks.append(self.key_names.start)
            self.app.on_shutdown(self.key_names.close)
        return client

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise RuntimeError("service not started")
        return self._js

    async def _startup(self) -> None:
        await bus.prepare_stream(self.settings, name=f"veribus-{self.name}-admin")

    async def _close_control(self) -> None:
        await self.control.close()
        await self.cost_control.close()

    def bind(self, js: JetStreamContext) -> None:
        """Publish and read through `js`: the broker's JetStream context at start-up (or an
        in-memory one when a test drives `deliver` without a server)."""
        self._js = js

    async def _after_startup(self) -> None:
        self.bind(self.broker.connection.jetstream())
        for hook in self.startup_hooks:
            await hook()
        await self._start_pumps()
        self._observer = await observability.start_for(self)
        log.info("%s ready", self.name)

    async def _start_pumps(self) -> None:
        """Create (or settle and bind to) each durable consumer and start pulling it."""
        for sub in self.subscriptions.values():
            if sub.config is not None and await durables.settle_consumer(self.js, events.STREAM, sub.durable, sub.config):
                psub = await self.js.pull_subscribe_bind(durable=sub.durable, stream=events.STREAM)
            else:
                psub = await self.js.pull_subscribe(events.subscription(sub.event_type), durable=sub.durable,
                                                    stream=events.STREAM, config=sub.config)
            await psub.unsubscribe()  # it made or bound the consumer; the pump pulls on its own inboxes
            pump = Pump(self.js._nc, psub._nms, functools.partial(self._on_message, sub),  # type: ignore[attr-defined]
                        name=self.name, durable=sub.durable, workers=sub.workers, batch_size=sub.batch_size,
                        progress_s=self.settings.consumer_ack_wait_s / 3, max_hold_s=self.settings.consumer_max_hold_s)
            await pump.start()
            self._pumps.append(pump)

    async def _stop_pumps(self) -> None:
        pumps, self._pumps = self._pumps, []
        await asyncio.gather(*(p.stop(self.settings.shutdown_grace_s) for p in pumps))

    async def _on_message(self, sub: Subscription, raw: Msg) -> None:
        """One fetched message through `deliver`, counted in the service's metrics."""
        meta = raw.metadata
        OUTCOME.set("")
        msg = Delivery(raw)
        with observability.METRICS.handling(self.name, sub.event_type, meta.num_delivered if meta else 1) as m, \
                tracing.handling(self.name, sub.event_type, raw):
            try:
                await self.deliver(sub.event_type, raw.data, msg)  # type: ignore[arg-type]
            except asyncio.CancelledError:  # the service stops (`Pump.stop`): the message goes back
                m["outcome"] = "handed_back"
                if msg.committed is None:
                    await hand_back(msg)
                raise
            m["outcome"] = OUTCOME.get() or ("failed" if msg.committed == "nacked" else "handled")

    async def _stop_observer(self) -> None:
        if self._observer is not None:
            await self._observer.cleanup()
            self._observer = None

    async def last_event(self, subject: str) -> events.Envelope | None:
        """The newest event on an exact subject, if it belongs to the same run attempt as the
        event being handled (a resumed job's join must not pick up its broken first attempt)."""
        env = await bus.last_event(self.js, subject)
        if env is not None and attempt_key(env) != ATTEMPT_KEY.get():
            # a replica's copy may hold only the earlier attempt: the leader's newest decides
            env = await bus.leader_last_event(self.js, subject)
            if env is not None and attempt_key(env) != ATTEMPT_KEY.get():
                return None
        return env

    def emit(self, event_type: str, job: events.Job, payload: Any, attempt: int = 1) -> events.Envelope:
        payload = self.content.lean_payload(payload)  # the job's contents travel as hashes
        return events.make_envelope(event_type, job.run_id, job.result_id, payload, self.producer, attempt)

    def fail_forward(self, out_type: str, stage: str) -> GiveUp:
        """The give-up of a stage whose failure ends the job's branch with an error: publish its
        normal output event carrying the error, so downstream stages skip and the job finalizes."""

        def give_up(env: events.Envelope, ev: events.StageEvent, exc: BaseException) -> list[events.Envelope]:
            ev.state.error = ev.state.error or stage_error(stage, exc)
            return [self.emit(out_type, ev.job, events.StageEvent(ev.job, ev.state, "failed", str(exc)))]

        return give_up

    async def publish(self, envs: list[events.Envelope]) -> None:
        if len(envs) == 1:
            await bus.publish(self.js, envs[0])
        elif envs:
            await bus.publish_many(self.js, envs)

    def handles(
        self,
        event_type: str,
        payload_type: type,
        *,
        durable: str | None = None,
        max_workers: int | None = None,
        batch_size: int = 32,
        give_up: GiveUp | None = None,
        skip: Callable[[Any], bool] | None = None,
        needs_question: Callable[[events.Job], bool] | None = None,
    ) -> Callable[[Handler], Handler]:
        """Register `fn(envelope, payload) -> [envelopes to publish]` for one event type.

        `skip(payload)`: a cheap check on the decoded (lean) payload; True means the handler would
        publish nothing (a branch this job's mode does not have), so the message is acked without
        reading the job's contents or calling the handler. `needs_question(job)`: asked with the
        job's options and models filled in; False means the handler does not use the question's
        content, which is then not read (`ContentStore.hydrate_payload`)."""
        workers = max_workers or int(getattr(self.settings, f"{self.name}_workers", 64))
        max_deliver = self.settings.consumer_max_deliver
        config = ConsumerConfig(
            durable_name=durable or self.name,
            filter_subject=events.subscription(event_type),  # what `settle_consumer` puts back if changed
            ack_policy=JsAckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            max_ack_pending=self.settings.consumer_max_ack_pending,
            ack_wait=self.settings.consumer_ack_wait_s,
            # the last delivery is ours: it records the give-up without handling (`deliver`)
            max_deliver=give_up_delivery(max_deliver, self.settings.consumer_max_interrupted) + 1,
        )

        self.durables.append(durable or self.name)

        def decorator(fn: Handler) -> Handler:
            self.subscriptions[event_type] = Subscription(
                event_type, fn, payload_type, give_up, max_deliver, durable=durable or self.name,
                workers=workers, batch_size=min(batch_size, workers), config=config, skip=skip,
                needs_question=needs_question)
            return fn

        return decorator

    async def deliver(self, event_type: str, body: bytes, msg: NatsMessage) -> None:
        """Handle one delivered message of `event_type` exactly as the subscription does: decode
        (dead-letter what never decodes), gate stopped runs, call the handler, publish its events
        with the attempt key, ack; on failure nack with backoff, and on the last delivery record
        the give-up. Every outcome is acked or nacked here (the subscription also counts it in the
        service's metrics)."""
        sub = self.subscriptions[event_type]
        fn, payload_type, give_up, max_deliver = sub.fn, sub.payload_type, sub.give_up, sub.max_deliver
        raw = msg.raw_message
        delivered = raw.metadata.num_delivered if raw.metadata else 1
        try:
            env = events.decode(body, raw.subject)
            payload = events.payload_as(env, payload_type)
        except Exception as exc:  # undecodable, wrong schema or over the limits: never processable
            # dead-lettered at once (a retry cannot fix the bytes); if even that fails, the next
            # delivery tries again, and the message is acked in any case once deliveries run out
            try:
                await self._dead_letter(raw.subject, body, exc, delivered)
            except Exception:  # noqa: BLE001
                log.exception("%s: could not dead-letter a message on %s", self.name, raw.subject[:200])
                if delivered < max_deliver:
                    await msg.nack(delay=backoff_s(delivered))
                    return
            await msg.ack()
            OUTCOME.set("dead_letter")
            return
        if env.event_type != sub.event_type:
            # not this consumer's type: its filter was changed under the service (a client that may
            # create consumers re-pointed `finalization-template` at answer.generated, which it may
            # publish, and the finalizer made a verdict of it); nothing is published for it
            log.error("%s: a %s event arrived on the %s consumer %r (its filter was changed?); ignored: %s",
                      self.name, env.event_type[:64], sub.event_type, sub.durable, raw.subject[:200])
            await msg.ack()
            OUTCOME.set("ignored")
            return
        if sub.skip is not None and sub.skip(payload):
            await msg.ack()  # nothing to do for this job here, and nothing to publish
            return
        CACHE_SCOPE.set(env.run_id)
        CACHE_JOB.set(None)
        SANDBOX_SCOPE.set(None)
        key = attempt_key(env)
        ATTEMPT_KEY.set(key)
        if sub.config is not None and delivered >= sub.config.max_deliver - 1:
            await self._interrupted_too_often(msg, key, env, payload, give_up, delivered, sub.config.max_deliver - 2)
            return
        gated = give_up is not None and env.event_type in self.gated_event_types
        if gated:
            stop = await self._stop_reason(env)
            if stop is not None:
                await self._stopped(msg, key, env, payload, give_up, stop)
                return
        CALL_GATE.set(functools.partial(self._stop_reason, env) if gated else None)  # asked again at each call
        before = await self._spent_before(env, payload, self.control, tokens_before, "usage")
        cost_before_ = await self._spent_before(env, payload, self.cost_control, cost_before, "cost")
        try:
            payload = await self.content.hydrate_payload(payload, sub.needs_question)
            SANDBOX_SCOPE.set(await self.content.sandbox_scope(payload))  # the run's processes, or fresh ones
            CACHE_SCOPE.set(scope_for(env.run_id, payload))  # the run's options are in the content
            CACHE_JOB.set(job_for(payload))
            outs = await fn(env, payload)
            await self.publish(carry_attempt_key(key, outs))
            await msg.ack()
        except asyncio.CancelledError:
            raise
        except RunStopped as stop:  # CALL_GATE: the run stopped while the job waited for its model slot
            if give_up is None:
                raise
            await self._stopped(msg, key, env, payload, give_up, stop)
        except Exception as exc:
            log.warning("%s: handling %s failed (delivery %d): %r", self.name, env.event_id, delivered, exc)
            if delivered < max_deliver:
                await msg.nack(delay=backoff_s(delivered))
                return
            await self._give_up(msg, key, env, payload, give_up, exc, delivered)
            return
        for control, spent_before, spent, what in ((self.control, before, tokens_spent, "usage"),
                                                   (self.cost_control, cost_before_, cost_spent, "cost")):
            if spent_before is None or not outs:
                continue
            try:
                control.record_usage(env.run_id, spent(spent_before, outs))
            except Exception as exc:  # noqa: BLE001 - accounting must never fail a handled event
                log.warning("%s: %s accounting for run %s failed: %r", self.name, what, env.run_id, exc)

    async def _spent_before(self, env: events.Envelope, payload: Any, control: Any, measure: Any,
                            what: str) -> int | None:
        """For a run with a budget on `control` (tokens: `self.control`, money: `self.cost_control`):
        `measure(payload)`, what the incoming event already carries (None: no budget)."""
        try:
            if await control.budget(env.run_id) is None:
                return None
            return measure(payload)
        except Exception as exc:  # noqa: BLE001 - accounting must never fail a handled event
            log.warning("%s: %s accounting for run %s failed: %r", self.name, what, env.run_id, exc)
            return None

    async def _stopped(self, msg: Delivery, key: str, env: events.Envelope, payload: Any, give_up: GiveUp,
                       stop: RunStopped) -> None:
        """The job is not run: its give-up events carry the stop (a finalized result saying why)."""
        await self.publish(carry_attempt_key(key, give_up(env, payload, stop)))
        await msg.ack()
        OUTCOME.set("stopped")

    async def _interrupted_too_often(self, msg: Delivery, key: str, env: events.Envelope, payload: Any,
                                     give_up: GiveUp | None, delivered: int, allowed: int) -> None:
        """The give-up delivery of a message no handler ever finished: every earlier one was
        cut off (its service stopped or killed) or failed. Not handled again, since the job may be
        what kills the process: the give-up is recorded (`stage.failed` and the stage's fallback),
        so the result still ends, failed, and says why. Acked only once that is published."""
        exc = DeliveriesExhausted(
            f"delivered {delivered} times and never handled to the end: each time its service stopped or "
            f"died while handling it, or the handler failed (VERIBUS_CONSUMER_MAX_DELIVER + "
            f"VERIBUS_CONSUMER_MAX_INTERRUPTED = {allowed} deliveries); not handled again")
        log.error("%s: %s: %s", self.name, env.event_id, exc)
        await self._give_up(msg, key, env, payload, give_up, exc, delivered)

    async def _give_up(self, msg: Delivery, key: str, env: events.Envelope, payload: Any, give_up: GiveUp | None,
                       exc: BaseException, delivered: int) -> None:
        """Record that the job is given up (`stage.failed` and the stage's fallback event), then
        ack; if that cannot be published, nack: the next delivery tries again."""
        fallback = give_up(env, payload, exc) if give_up else []
        try:
            await self.publish(carry_attempt_key(key, [self._stage_failed(env, exc, delivered), *fallback]))
            await msg.ack()
            OUTCOME.set("gave_up")
        except Exception:  # noqa: BLE001 - logged; the message comes back
            log.exception("%s: could not record the give-up of %s", self.name, env.event_id)
            await msg.nack(delay=backoff_s(delivered))

    async def _stop_reason(self, env: events.Envelope) -> RunStopped | None:
        """Why the run's next answer must not be generated (cancelled, token or money budget spent),
        or None; a check that fails lets the job go on (the gate fails open)."""
        try:
            return (await self.control.stop_reason(env.run_id, env.occurred_at)
                    or await self.cost_control.stop_reason(env.run_id, env.occurred_at))
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: run control check failed: %r", self.name, exc)
            return None

    def _stage_failed(self, env: events.Envelope, exc: BaseException, delivered: int) -> events.Envelope:
        err = stage_error(self.name, exc, delivered)
        out = events.make_envelope(
            events.STAGE_FAILED, env.run_id, env.result_id,
            events.StageFailed(error=err, event_type=env.event_type), self.producer, delivered,
        )
        out.event_id = f"{env.result_id}:{events.STAGE_FAILED}:{self.name}"
        return out

    async def _dead_letter(self, subject: str, body: bytes, exc: BaseException, delivered: int) -> None:
        parts = subject.split(".")
        # ids from the subject only when they are valid tokens: a forged 5,000-character id must
        # not become the subject of the dead letter (nats-server drops such a connection)
        run_id = safe_token(parts[3]) if len(parts) == 5 else "unknown"
        result_id = safe_token(parts[4]) if len(parts) == 5 else "unknown"
        dl = events.DeadLetter(
            subject=subject[:512], consumer=self.name, error=scrub_text(f"{type(exc).__name__}: {exc}")[:2000],
            deliveries=delivered, data=scrub_text(body[:4096].decode("utf-8", "replace")),
        )
        env = events.make_envelope(events.DEAD_LETTER, run_id, result_id, dl, self.producer, delivered)
        digest = hashlib.sha256(subject.encode() + b"\0" + body).hexdigest()[:16]  # same id in every process
        env.event_id = f"{result_id}:{events.DEAD_LETTER}:{self.name}:{digest}"
        await bus.publish(self.js, env)
        log.error("%s: dead-lettered %s (delivery %d): %s", self.name, subject[:200], delivered, dl.error[:500])



def run(service: StageService) -> None:
    """Entry point of `python -m services.<name>`."""
    observability.configure_logging(service.name)
    logging.getLogger("faststream").setLevel(logging.WARNING)
    asyncio.run(service.app.run())
