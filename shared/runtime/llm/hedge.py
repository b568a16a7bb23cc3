"""Hedged requests: a second copy of a call that is slow to answer, sent only on idle capacity.

Why: with a long-tailed latency a run waits at its end for its slowest few calls while the model's
slots sit free (the drain). A model with `hedge_after_s` set gets, for a call still unanswered
after that long, one more copy of the same request, but only when its limit has a free slot that
no call of this process waits for (`try_acquire`): in the steady state every slot is busy and
nothing is hedged, so a hedge never delays other work and never goes past the model's limits.
The first good reply wins; the other copy is cancelled.

What it costs, said plainly: a cancelled copy may still be billed by the provider (the request
was sent), and its tokens are not known. It is counted as costing what the winning reply did
(`abandoned`, which the caller adds to the usage), and each hedge is counted in the result's
`retry_counts` as `hedge` and in `model_calls`. Opt-in for that reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shared.core.events import ModelSpec

POLL_S = 0.05  # how often a slow call looks for a free slot once it is due a hedge


@dataclass
class Hedged:
    """What `first_reply` got: the response, and how many copies were abandoned in flight."""

    response: Any
    abandoned: int = 0


def _quiet(task: asyncio.Future[Any]) -> None:
    """A cancelled or losing copy's outcome is read, so asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()


async def first_reply(send: Callable[[], Awaitable[Any]], model: ModelSpec, limiter: Any, estimate: int,
                      *, on_hedge: Callable[[], None] | None = None,
                      may_hedge: Callable[[], Awaitable[bool]] | None = None,
                      tokens_of: Callable[[Any], int] | None = None,
                      is_rate_limit: Callable[[BaseException], bool] | None = None) -> Hedged:
    """`send()` once (the caller holds its lease), and a second time under a lease of its own
    if the first is unanswered after `model.hedge_after_s` and a slot is free (`on_hedge()` is
    called as the copy goes; `may_hedge()` False holds it back, as a spent budget must). Raises
    the first copy's error when every copy sent failed; cancelling this cancels every copy."""
    after = model.hedge_after_s
    if not after:
        return Hedged(await send())  # no task of its own: the path of every call without hedging
    primary = asyncio.ensure_future(send())
    tasks = [primary]
    try:
        done, _ = await asyncio.wait({primary}, timeout=after)
        lease = None
        while not done:
            if may_hedge is None or await may_hedge():
                lease = await limiter.try_acquire(model, estimate)
            if lease is not None:
                break
            done, _ = await asyncio.wait({primary}, timeout=POLL_S)
        if done:
            return Hedged(primary.result())

        async def copy() -> Any:
            rate_limited = False
            tokens = None
            try:
                resp = await send()
                tokens = tokens_of(resp) if tokens_of is not None else None
                return resp
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                rate_limited = is_rate_limit(exc) if is_rate_limit is not None else False
                raise
            finally:
                limiter.release(lease, tokens=tokens, rate_limited=rate_limited)

        if on_hedge is not None:
            on_hedge()
        secondary = asyncio.ensure_future(copy())
        tasks.append(secondary)
        pending = {primary, secondary}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in (primary, secondary):  # the primary first when both end together
                if task in done and not task.cancelled() and task.exception() is None:
                    return Hedged(task.result(), abandoned=len(pending))
        raise primary.exception()  # type: ignore[misc]  # both failed: the first copy's error
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
            task.add_done_callback(_quiet)
