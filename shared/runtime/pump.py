"""The pull loop of a stage service's durable consumer (`Pump`), and a fetched message as the
harness handles it (`Delivery`): how messages come in, how many at once, and how they are
handed back when the service stops. What is done with each one is `shared.runtime.harness`."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg

log = logging.getLogger("veribus.service")


class Delivery:
    """A fetched JetStream message with the surface `StageService.deliver` uses (the one a
    FastStream `NatsMessage` has): `raw_message`, `ack`, `nack(delay)`, `committed`."""

    __slots__ = ("committed", "raw_message")

    def __init__(self, raw: Msg) -> None:
        self.raw_message = raw
        self.committed: str | None = None

    async def ack(self) -> None:
        await self.raw_message.ack()
        self.committed = "acked"

    async def nack(self, delay: float | None = None) -> None:
        await self.raw_message.nak(delay=delay)
        self.committed = "nacked"


HAND_BACK_S = 1.0  # at shutdown: for the cancelled handlers' naks to be written and flushed
HAND_BACK_DELAY_S = 0.01  # a handed-back message's nak delay (`hand_back`: it must not be 0)
PULL_EXPIRES_S = 5.0  # an open pull request waits on the server this long for messages, then is renewed
PULL_GRACE_S = 1.0  # one the server has not ended this long after its expiry was lost (a reconnect)
RETRY_FETCH_S = 0.5  # after a pull request the server refused (reconnecting, stream leader moving)


class Pump:
    """Pulls one durable consumer the way nats.go's `consume` does: pull requests stay open on
    the server for as many messages as there are free worker slots, and each message is started
    (a task) as it arrives; a request is renewed when it expires, and more credit is asked for
    once a quarter of the slots (at most `batch_size`) has come free. Profiled (issue 12), the
    earlier fetch loop (a no-wait request, its "no messages" reply, a lingering request and its
    timers for every message or two) cost stages fed one message at a time more than the
    handling itself. Messages in flight are at most `workers` (the rest stay on the server:
    backpressure, `max_ack_pending`).

    Each request has its own inbox subscription (delivered messages carry their stream subject,
    not the request's), so what it delivered and its end (408 expired, 409) are known exactly;
    one the server never ends (lost with a connection) is given up `PULL_GRACE_S` after its
    expiry, and a message that still comes for it then is handled all the same.

    `handle(raw)` is the service's handling of one message, which acks or naks it (cancelled at
    `stop`, it hands it back: `hand_back`).

    Every `progress_s` a message still being handled is marked in progress (`+WPI`: its ack wait
    starts again), for up to `max_hold_s`: so the consumers' ack wait can be short (a killed
    service's messages come back after it) while a handler may take longer than it (a slow model
    call, its retries, a wait for a model's limit). A handler past `max_hold_s` is taken for
    stuck, and its message is redelivered after the ack wait."""

    def __init__(self, nc: Any, nms: str, handle: Callable[[Msg], Awaitable[None]], *, name: str, durable: str,
                 workers: int, batch_size: int, progress_s: float | None = None, max_hold_s: float = 3600.0) -> None:
        self.nc, self.nms, self.handle = nc, nms, handle
        self.name, self.durable, self.workers = name, durable, workers
        self.progress_s, self.max_hold_s = progress_s, max_hold_s
        self.inflight: dict[asyncio.Task[None], tuple[Msg, float]] = {}  # handler -> (its message, when it came)
        self.open: dict[str, list[Any]] = {}  # inbox -> [messages still due, deadline, its subscription]
        self.credit = 0  # messages the open requests may still deliver
        self.threshold = max(1, min(batch_size, workers // 4))
        self._ended: list[Any] = []  # subscriptions of ended requests, unsubscribed by the loop
        self._retry_at = 0.0
        self._wake = asyncio.Event()
        self._stopping = False
        self.task: asyncio.Task[None] | None = None
        self.keeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())
        if self.progress_s:
            self.keeper = asyncio.ensure_future(self._keep_held())

    def _done(self, task: asyncio.Task[None]) -> None:
        self.inflight.pop(task, None)
        if self.workers - len(self.inflight) - self.credit >= self.threshold:
            self._wake.set()
        if not task.cancelled() and task.exception() is not None:  # deliver acks or nacks everything itself
            log.error("%s: handler task failed: %r", self.name, task.exception())

    def _close(self, inbox: str) -> None:
        req = self.open.pop(inbox, None)
        if req is not None:
            self.credit -= req[0]
            self._ended.append(req[2])
            self._wake.set()

    async def _on_msg(self, inbox: str, raw: Msg) -> None:
        req = self.open.get(inbox)
        status = raw.headers.get("Status") if raw.headers and not raw.reply else None
        if status is not None:
            if status != "100":  # 408 expired, 409 (max waiting, leader change, consumer deleted), 404, 503
                self._close(inbox)
                if status != "408":
                    log.debug("%s: pull on %s ended: %s %s", self.name, self.durable, status,
                              raw.headers.get("Description", ""))
                    self._retry_at = asyncio.get_running_loop().time() + RETRY_FETCH_S
            return
        if req is not None:
            req[0] -= 1
            self.credit -= 1
            if req[0] <= 0:
                self._close(inbox)
        task = asyncio.ensure_future(self.handle(raw))
        self.inflight[task] = (raw, asyncio.get_running_loop().time())
        task.add_done_callback(self._done)

    async def _keep_held(self) -> None:
        """Mark the messages handled for longer than half a period in progress, every period."""
        assert self.progress_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.progress_s)
            now = loop.time()
            for raw, since in list(self.inflight.values()):
                if self.progress_s / 2 <= now - since < self.max_hold_s:
                    try:
                        await raw.in_progress()
                    except Exception as exc:  # noqa: BLE001 - reconnecting: the next period tries again
                        log.debug("%s: could not mark a message of %s in progress: %r", self.name, self.durable, exc)

    async def _pull(self, n: int, now: float) -> None:
        inbox = self.nc.new_inbox()
        try:
            nsub = await self.nc.subscribe(inbox, cb=functools.partial(self._on_msg, inbox))
            self.open[inbox] = [n, now + PULL_EXPIRES_S + PULL_GRACE_S, nsub]
            self.credit += n
            await self.nc.publish(self.nms, b'{"batch":%d,"expires":%d}' % (n, int(PULL_EXPIRES_S * 1e9)),
                                  reply=inbox)
        except Exception as exc:  # noqa: BLE001 - reconnecting: asked again after a pause
            log.debug("%s: pull on %s failed: %r", self.name, self.durable, exc)
            self._close(inbox)
            self._retry_at = now + RETRY_FETCH_S

    async def _unsubscribe_ended(self) -> None:
        ended, self._ended = self._ended, []
        for nsub in ended:
            try:
                await nsub.unsubscribe()
            except Exception:  # noqa: BLE001 - closed with the connection already
                pass

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            now = loop.time()
            for inbox in [i for i, req in self.open.items() if req[1] < now]:
                self._close(inbox)  # lost with a connection: its credit is asked for again
            if self._ended:
                await self._unsubscribe_ended()
            want = self.workers - len(self.inflight) - self.credit
            if want > 0 and (want >= self.threshold or not self.credit) and now >= self._retry_at:
                await self._pull(want, now)
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.05, self._retry_at - now) if want > 0 else 1.0)
            except TimeoutError:
                pass

    async def stop(self, grace_s: float) -> None:
        """Stop asking for messages, hand what has arrived to handlers, let handlers in flight
        finish for up to `grace_s` in all, then cancel the rest, each of which hands its message
        back (`hand_back`: a nak, redelivered at once to whichever replica pulls next, or after
        `veribus up`, instead of after the ack wait), and drop the subscriptions (the durable
        consumer stays; the server drops requests nobody listens to)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        self._stopping = True
        for task in (self.task, self.keeper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        pending, self.open = list(self.open.values()), {}
        try:
            await asyncio.wait_for(asyncio.gather(*(req[2].drain() for req in pending), return_exceptions=True),
                                   max(0.5, deadline - loop.time()))
        except Exception:  # noqa: BLE001 - the connection may already be gone
            pass
        if self.inflight:
            await asyncio.wait(set(self.inflight), timeout=max(0.0, deadline - loop.time()))
        cut = list(self.inflight)
        for task in cut:
            task.cancel()
        if cut:
            await asyncio.wait(cut, timeout=HAND_BACK_S)  # their naks written
            try:
                await self.nc.flush(timeout=HAND_BACK_S)  # and sent before the connection closes
            except Exception:  # noqa: BLE001 - the connection is gone: they come back after the ack wait
                pass
            log.info("%s: %d message(s) of %s handed back unfinished (redelivered at once)",
                     self.name, len(cut), self.durable)
        await self._unsubscribe_ended()


async def hand_back(msg: Delivery) -> None:
    """Nak a message whose handler was cut off, for redelivery at once (a delivery counts, as
    one after the ack wait would); a connection already gone leaves it to the ack wait.

    With a delay, however short: nats-server keeps a plain nak's redelivery in memory only, so
    after `down` stopped it too the message came back only after the ack wait; a delayed nak is
    written to the consumer's state (measured on nats-server 2.15: redelivered at once after a
    restart, a plain nak not)."""
    try:
        await msg.nack(delay=HAND_BACK_DELAY_S)
    except Exception as exc:  # noqa: BLE001
        log.debug("could not hand back a message: %r", exc)
