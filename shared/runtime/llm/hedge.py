"""Hedged requests: a second copy of a call that is slow to answer, sent only on idle capacity.

Why: with a long-tailed latency a run waits at its end for its slowest few calls while the model's
slots sit free (the drain). A model with `hedge_after_s` set gets, for a call still unanswered
after that long, one more copy of the same request, but only when its limit has a free slot that
no call of this process waits for (`try_acquire`): in the steady state every slot is busy and
nothing is hedged, so a hedge never delays other work and never goes past the model's limits.
The first good reply wins; the other copy runs to its end holding its slot (see `first_reply`).

`hedge_after_s: auto` needs no knowledge of the model's latency: a call is hedged once it has
waited longer than the 95th percentile of the model's last `AUTO_WINDOW` reply times in this
process (every copy that answers counts, a losing one too), from `AUTO_MIN_CALLS` replies on;
"after the 95th-percentile expected latency" is the rule of Dean and Barroso's "The Tail at
Scale", where it costs about 5 % more calls at most; here fewer, as only free slots are used.

What it costs, said plainly: the losing copy is billed by the provider, and its reply comes after
the result is written. It is counted as costing what the winning reply did (`abandoned`, which
the caller adds to the usage), and each hedge is counted in the result's `retry_counts` as
`hedge` and in `model_calls`. Opt-in for that reason.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shared.core.events import ModelSpec
from shared.runtime.call_limits import IDLE_FOR_HEDGE_S

POLL_S = 0.05  # how often a slow call looks for a free slot once it is due a hedge
# a poll woken this much later than asked finds the event loop was stopped (a long garbage
# collection, the CPU taken by others): a slot freed just before looks idle for the whole stop,
# though the call about to take it could not run; such a poll hedges nothing
STALL_S = IDLE_FOR_HEDGE_S / 2
AUTO = "auto"
AUTO_QUANTILE = 0.95
AUTO_MIN_CALLS = 20  # replies seen before `auto` hedges at all
AUTO_WINDOW = 200  # the latest replies `auto` reads its quantile from

# reply times (s) per model and endpoint, for `hedge_after_s: auto`
_LATENCIES: dict[str, deque[float]] = {}


def _latency_key(model: ModelSpec) -> str:
    return f"{model.canonical_key}|{model.api_base or ''}"


def hedge_delay(model: ModelSpec) -> float | None:
    """How long a call of `model` waits before it may be hedged; None: not hedged."""
    after = model.hedge_after_s
    if after != AUTO:
        return after or None
    window = _LATENCIES.get(_latency_key(model))
    if window is None or len(window) < AUTO_MIN_CALLS:
        return None
    ranked = sorted(window)
    return ranked[min(len(ranked) - 1, int(AUTO_QUANTILE * len(ranked)))]


def _timed(send: Callable[[], Awaitable[Any]], model: ModelSpec) -> Callable[[], Awaitable[Any]]:
    """`send`, each reply's time added to the model's window (for `auto`)."""
    key = _latency_key(model)
    window = _LATENCIES.get(key)
    if window is None:
        window = _LATENCIES[key] = deque(maxlen=AUTO_WINDOW)

    async def timed() -> Any:
        start = time.monotonic()
        resp = await send()
        window.append(time.monotonic() - start)
        return resp

    return timed


@dataclass
class Hedged:
    """What `first_reply` got: the response, how many copies were abandoned in flight, and
    whether it took over the caller's lease (a hedge went out: the lease goes with its copy)."""

    response: Any
    abandoned: int = 0
    owns_lease: bool = False


# losing copies still running: referenced until they end (asyncio keeps only weak references)
_RUNNING_ON: set[asyncio.Future[Any]] = set()


def _quiet(task: asyncio.Future[Any]) -> None:
    """A cancelled or losing copy's outcome is read, so asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()


async def first_reply(send: Callable[[], Awaitable[Any]], model: ModelSpec, limiter: Any, lease: Any,
                      estimate: int, *, on_hedge: Callable[[], None] | None = None,
                      may_hedge: Callable[[], Awaitable[bool]] | None = None,
                      tokens_of: Callable[[Any], int] | None = None,
                      is_rate_limit: Callable[[BaseException], bool] | None = None) -> Hedged:
    """`send()` under the caller's `lease`, and a second time under a lease of its own if the
    first is unanswered after `hedge_delay(model)` and a slot is free (`on_hedge()` is called as
    the copy goes; `may_hedge()` False holds it back, as a spent budget must). Raises the first
    copy's error when every copy sent failed.

    Each copy's lease is released when that copy ends, and a losing copy is *not* cancelled: it
    runs on in the background holding its slot until its reply comes, because a provider goes on
    with a request whose client hung up, and a slot freed at once would put one call more on it
    than the limit allows (measured: 4 in flight for a limit of 3). Releasing the caller's lease
    is left to the caller unless a hedge went out (`owns_lease`). Cancelling this cancels every
    copy."""
    if model.hedge_after_s == AUTO:
        send = _timed(send, model)
    after = hedge_delay(model)
    if not after:
        return Hedged(await send())  # no task of its own: the path of every call without hedging

    loop = asyncio.get_running_loop()
    primary = asyncio.ensure_future(send())
    tasks = [primary]
    finished = False
    try:
        due = loop.time() + after
        done, _ = await asyncio.wait({primary}, timeout=after)
        second = None
        while not done:
            # woken late: the loop was stalled, and every slot's last use looks that long ago; the
            # work that arrived meanwhile runs first, and the next poll judges the slots again
            stalled = loop.time() - due > STALL_S
            if not stalled and (may_hedge is None or await may_hedge()):
                second = await limiter.try_acquire(model, estimate)
            if second is not None:
                break
            due = loop.time() + POLL_S
            done, _ = await asyncio.wait({primary}, timeout=POLL_S)
        if done:
            finished = True
            return Hedged(primary.result())
        if on_hedge is not None:
            on_hedge()
        # from here each copy releases its own lease when it ends: the primary's is the caller's
        tasks[0] = primary = asyncio.ensure_future(_released_after(primary, limiter, lease, tokens_of, is_rate_limit))
        secondary = asyncio.ensure_future(_released_after(send(), limiter, second, tokens_of, is_rate_limit))
        tasks.append(secondary)
        pending = {primary, secondary}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in (primary, secondary):  # the primary first when both end together
                if task in done and not task.cancelled() and task.exception() is None:
                    finished = True
                    for loser in pending:  # runs on with its slot (see above)
                        _RUNNING_ON.add(loser)
                        loser.add_done_callback(_RUNNING_ON.discard)
                    return Hedged(task.result(), abandoned=len(pending), owns_lease=True)
        finished = True
        raise primary.exception()  # type: ignore[misc]  # both failed: the first copy's error
    finally:
        for task in tasks:
            if not finished and not task.done():
                task.cancel()  # this call was cancelled (a run cancel, the hard timeout): every copy goes
            task.add_done_callback(_quiet)


async def _released_after(copy: Awaitable[Any], limiter: Any, lease: Any,
                          tokens_of: Callable[[Any], int] | None,
                          is_rate_limit: Callable[[BaseException], bool] | None) -> Any:
    """A copy's outcome (its request, or the task already running it), its lease released when
    the copy ends (with its tokens, or whether it got a 429); cancelled, the copy goes with it."""
    try:
        resp = await copy
    except asyncio.CancelledError:
        if isinstance(copy, asyncio.Future):
            copy.cancel()
        limiter.release(lease)
        raise
    except Exception as exc:
        limiter.release(lease, rate_limited=bool(is_rate_limit and is_rate_limit(exc)))
        raise
    limiter.release(lease, tokens=tokens_of(resp) if tokens_of is not None else None)
    return resp
