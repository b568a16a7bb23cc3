"""What veribus changes in nats-py 2.16, applied once when this module is imported (by
`shared.runtime.bus`, which every process that talks to NATS imports): a bare timeout from a pull
`fetch` raised as nats' own, fast paths for `next_msg` and `request` that profiling found
costly (issue 12), and every consumer created under a name in the request's subject (the bus
roles allow no other create). Each patch marks what it replaced, so importing twice changes nothing."""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

from nats import errors as nats_errors
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from nats.js.manager import JetStreamManager


def _patch_pull_fetch_timeout() -> None:
    """nats-py 2.16 can raise a bare asyncio.TimeoutError from `fetch` (a second fetch after a
    partial batch), which FastStream 0.7.8 does not catch: its pull loop then dies with the batch
    it already holds, and those messages wait a whole ack_wait for redelivery. Re-raise it as
    nats' own TimeoutError, which FastStream handles."""
    sub_cls = JetStreamContext.PullSubscription
    if getattr(sub_cls.fetch, "_veribus_patched", False):
        return
    original = sub_cls.fetch

    async def fetch(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN001
        try:
            return await original(self, *args, **kwargs)
        except nats_errors.TimeoutError:
            raise
        except TimeoutError as exc:
            raise nats_errors.TimeoutError from exc

    fetch._veribus_patched = True  # type: ignore[attr-defined]
    sub_cls.fetch = fetch  # type: ignore[method-assign]


_patch_pull_fetch_timeout()


def _patch_next_msg_fast_path() -> None:
    """nats-py 2.16's `Subscription.next_msg` makes a uuid4, a task and a `wait_for` timer for
    every message, even one already waiting in the subscription's queue; pull `fetch` calls it
    once per message of a batch. Profiled (issue 12), that was a fifth of the projector's CPU.
    A message already queued is returned at once, with the same bookkeeping; an empty queue
    takes the original path (wait, timeout, errors)."""
    if getattr(Subscription.next_msg, "_veribus_patched", False):
        return
    original = Subscription.next_msg

    async def next_msg(self, timeout: float | None = 1.0) -> Any:  # noqa: ANN001
        queue = self._pending_queue
        if queue.empty() or self._cb or self._conn.is_closed:
            return await original(self, timeout)
        msg = queue.get_nowait()
        self._pending_size -= len(msg.data)
        queue.task_done()
        return msg

    next_msg._veribus_patched = True  # type: ignore[attr-defined]
    Subscription.next_msg = next_msg  # type: ignore[method-assign]


_patch_next_msg_fast_path()


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(nats_errors.TimeoutError())


def _patch_request_fast_path() -> None:
    """nats-py 2.16's `request` makes a NUID and two random bytes (an `os.urandom` call) for each
    reply token and waits with `wait_for` (a timer, a waiter future, callbacks); every handled
    message makes two or three requests (its content read, its publish's PubAck). Profiled (issue
    12), a tenth of a stage service's CPU. A per-process counter is as unique under the
    connection's own reply prefix (a token is never reused, so a late reply finds nothing), and a
    timer failing the future ends the wait the same way: `nats.errors.TimeoutError`. A counter
    alone was guessable, and a client that can see the inbox answered the next requests before
    the server did (`test_bus_trust.py::test_no_role_reads_or_answers_another_roles_replies`):
    each token is 8 random bytes (one `os.urandom`, ~0.4 us) before the counter, which keeps it
    unique."""
    if getattr(NATS._request_new_style, "_veribus_patched", False):
        return
    tokens = itertools.count()

    async def _request_new_style(self, subject: str, payload: bytes, timeout: float = 1,  # noqa: ANN001
                                 headers: dict[str, Any] | None = None) -> Any:
        if self.is_draining_pubs:
            raise nats_errors.ConnectionDrainingError
        if not self._resp_sub_prefix:
            await self._init_request_sub()
        token = f"{os.urandom(8).hex()}{next(tokens):x}"
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._resp_map[token] = future
        timer = loop.call_later(timeout, _expire, future)
        try:
            await self.publish(subject, payload, reply=self._resp_sub_prefix.decode() + token, headers=headers)
            return await future
        finally:
            timer.cancel()
            self._resp_map.pop(token, None)

    _request_new_style._veribus_patched = True  # type: ignore[attr-defined]
    NATS._request_new_style = _request_new_style  # type: ignore[method-assign]


_patch_request_fast_path()


def _patch_named_consumer_creates() -> None:
    """nats-py 2.16 creates an ephemeral consumer (an ordered consumer following the stream, a
    push `subscribe` without a durable, an `add_consumer` without a name) on
    `$JS.API.CONSUMER.CREATE.<stream>`, and a durable without `name` on the legacy
    `$JS.API.CONSUMER.DURABLE.CREATE.<stream>.<durable>`. The first names no consumer in its
    subject, so NATS permissions cannot tell a new consumer from an update of a service's durable
    (the server applies the body to the consumer it names), and `cli` may not use it
    (`bus_auth.CLI_CONSUMER_API`). Every create gets a name: the durable's own, else a fresh NUID
    (each time: an ordered consumer re-created after a gap must not update the one it replaces),
    which nats-py then puts in the subject. The caller's config is not changed."""
    if getattr(JetStreamManager.add_consumer, "_veribus_patched", False):
        return
    original = JetStreamManager.add_consumer

    async def add_consumer(self, stream: str, config: ConsumerConfig | None = None,  # noqa: ANN001
                           timeout: float | None = None, **params: Any) -> Any:
        config = (config or ConsumerConfig()).evolve(**params)
        if not config.name:
            config = config.evolve(name=config.durable_name or self._nc._nuid.next().decode())
        return await original(self, stream, config=config, timeout=timeout)

    add_consumer._veribus_patched = True  # type: ignore[attr-defined]
    JetStreamManager.add_consumer = add_consumer  # type: ignore[method-assign]


_patch_named_consumer_creates()
