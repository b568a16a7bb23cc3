"""The thin FastStream harness every stage service uses: subscribe to one event type on a
durable pull consumer, call the stage, publish what it returns, ack after publishing.

Failure policy (at-least-once, exactly-once effect):
- a handler error is redelivered with backoff up to `consumer_max_deliver` times;
- after that the job is not dropped: a `stage.failed` event records the error and the
  stage's fallback event (its normal output, with `state.error` set) lets the run finish;
- a message that cannot be decoded at all goes to `dead.letter` with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from faststream import AckPolicy, FastStream
from faststream.nats import JStream, NatsBroker, NatsMessage, PullSub
from nats.js import JetStreamContext
from nats.js.api import AckPolicy as JsAckPolicy
from nats.js.api import ConsumerConfig, DeliverPolicy

from shared import bus, events
from shared.config import Settings
from shared.llm import CACHE_SCOPE, LLMClient, NatsKVCache, close_transports

log = logging.getLogger("veribus.service")

VERSION = "0.1.0"

Handler = Callable[[events.Envelope, Any], Awaitable[list[events.Envelope]]]
GiveUp = Callable[[events.Envelope, Any, BaseException], list[events.Envelope]]


async def _raw_body(msg: NatsMessage) -> bytes:
    """Hand handlers the raw bytes: envelopes are decoded once, by msgspec, in `_dispatch`."""
    return msg.body


def backoff_s(delivered: int) -> float:
    return min(30.0, 0.5 * (2 ** max(0, delivered - 1)))


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
        for key in ("user", "password", "token", "tls"):
            if key in opts:
                kwargs[key] = opts[key]
        self.broker = NatsBroker(opts["servers"], **kwargs)
        self.app = FastStream(self.broker, on_startup=[self._startup], after_startup=[self._after_startup],
                              on_shutdown=[close_transports])
        self._js: JetStreamContext | None = None
        self._stream = JStream(name=events.STREAM, declare=False)
        self.startup_hooks: list[Callable[[], Awaitable[None]]] = []

    def llm_client(self) -> LLMClient:
        """The service's model client; its response cache moves to the shared JetStream KV bucket
        at start-up (so a redelivered or replayed stage does not pay for the same call twice)."""
        client = LLMClient()

        async def attach_cache() -> None:
            if self.settings.llm_cache:
                client.cache = NatsKVCache(self.js)

        self.startup_hooks.append(attach_cache)
        return client

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise RuntimeError("service not started")
        return self._js

    async def _startup(self) -> None:
        nc = await bus.connect(self.settings, name=f"veribus-{self.name}-admin")
        try:
            await bus.ensure_stream(nc.jetstream())
        finally:
            await nc.close()

    async def _after_startup(self) -> None:
        self._js = self.broker.connection.jetstream()
        for hook in self.startup_hooks:
            await hook()
        log.info("%s ready", self.name)

    def emit(self, event_type: str, job: events.Job, payload: Any, attempt: int = 1) -> events.Envelope:
        return events.make_envelope(event_type, job.run_id, job.result_id, payload, self.producer, attempt)

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
    ) -> Callable[[Handler], Handler]:
        """Register `fn(envelope, payload) -> [envelopes to publish]` for one event type."""
        workers = max_workers or int(os.environ.get(f"VERIBUS_{self.name.upper()}_WORKERS", "64"))
        max_deliver = self.settings.consumer_max_deliver
        config = ConsumerConfig(
            durable_name=durable or self.name,
            ack_policy=JsAckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            max_ack_pending=self.settings.consumer_max_ack_pending,
            ack_wait=self.settings.consumer_ack_wait_s,
            max_deliver=max_deliver + 1,  # the last delivery is ours: it records the give-up
        )

        def decorator(fn: Handler) -> Handler:
            @self.broker.subscriber(
                events.subscription(event_type),
                stream=self._stream,
                durable=durable or self.name,
                pull_sub=PullSub(batch_size=min(batch_size, workers)),
                config=config,
                ack_policy=AckPolicy.MANUAL,
                max_workers=workers,
                decoder=_raw_body,
            )
            async def _on_message(body: bytes) -> None:
                msg: NatsMessage = self.broker.context.get_local("message")
                await self._dispatch(fn, payload_type, give_up, body, msg, max_deliver)

            return fn

        return decorator

    async def _dispatch(
        self,
        fn: Handler,
        payload_type: type,
        give_up: GiveUp | None,
        body: bytes,
        msg: NatsMessage,
        max_deliver: int,
    ) -> None:
        raw = msg.raw_message
        delivered = raw.metadata.num_delivered if raw.metadata else 1
        try:
            env = events.decode(body)
            payload = events.payload_as(env, payload_type)
        except Exception as exc:  # undecodable or wrong schema: cannot be processed, ever
            if delivered >= max_deliver:
                await self._dead_letter(raw.subject, body, exc, delivered)
                await msg.ack()
            else:
                await msg.nack(delay=backoff_s(delivered))
            return
        CACHE_SCOPE.set(env.run_id)
        try:
            outs = await fn(env, payload)
            await self.publish(outs)
            await msg.ack()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s: handling %s failed (delivery %d): %r", self.name, env.event_id, delivered, exc)
            if delivered < max_deliver:
                await msg.nack(delay=backoff_s(delivered))
                return
            fallback = give_up(env, payload, exc) if give_up else []
            failed = self._stage_failed(env, exc, delivered)
            try:
                await self.publish([failed, *fallback])
                await msg.ack()
            except Exception:
                log.exception("%s: could not record the give-up of %s", self.name, env.event_id)
                await msg.nack(delay=backoff_s(delivered))

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
        run_id = parts[3] if len(parts) >= 5 else "unknown"
        result_id = parts[4] if len(parts) >= 5 else "unknown"
        dl = events.DeadLetter(
            subject=subject, consumer=self.name, error=f"{type(exc).__name__}: {exc}",
            deliveries=delivered, data=body[:4096].decode("utf-8", "replace"),
        )
        env = events.make_envelope(events.DEAD_LETTER, run_id, result_id, dl, self.producer, delivered)
        env.event_id = f"{result_id}:{events.DEAD_LETTER}:{self.name}:{abs(hash(body)) % 10**12}"
        await bus.publish(self.js, env)
        log.error("%s: dead-lettered %s after %d deliveries: %s", self.name, subject, delivered, dl.error)


def stage_error(stage: str, exc: BaseException, attempt: int = 1) -> events.StageError:
    return events.StageError(
        stage=stage,
        type=type(exc).__name__,
        message=str(exc)[:2000] or type(exc).__name__,
        traceback="".join(traceback.format_exception(exc))[-4000:],
        attempt=attempt,
    )


def record(state: events.State, stage: str, status: str, started: float, reason: str = "") -> None:
    """Append this stage's outcome to the state's stage log (for timing and skip analysis)."""
    state.stages.append(
        events.StageRecord(stage=stage, status=status, reason=reason, started_at=started, ended_at=time.time())  # type: ignore[arg-type]
    )


def run(service: StageService) -> None:
    """Entry point of `python -m services.<name>`."""
    logging.basicConfig(
        level=os.environ.get("VERIBUS_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {service.name} %(levelname)s %(message)s",
    )
    logging.getLogger("faststream").setLevel(logging.WARNING)
    asyncio.run(service.app.run())
