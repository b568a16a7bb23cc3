"""Deployment-wide model limits: the ledger arithmetic, and the limiter on an in-memory store
(several limiters sharing one store stand for several processes sharing the KV bucket)."""

from __future__ import annotations

import asyncio

import pytest

from shared.core.events import ModelSpec
from shared.runtime import call_limits, ledger
from shared.runtime.call_limits import Lease
from shared.runtime.ledger import Holder, new_ledger
from shared.runtime.ledger_store import MemoryLedgerStore
from shared.runtime.limits import Limiter
from tests.support.limits import GatedStore, RoundTripStore
from tests.support.limits import hammer as _hammer


def test_grant_never_exceeds_the_window() -> None:
    led = new_ledger(5)
    assert ledger.grant(led, "a", 4, 4, now=0, lease_s=10) == 4
    assert ledger.grant(led, "b", 4, 4, now=0, lease_s=10) == 1
    assert led.holders["b"].want == 3
    assert ledger.held_total(led) == 5
    assert ledger.grant(led, "c", 1, 1, now=0, lease_s=10) == 0


def test_expired_holders_are_pruned_and_their_slots_reused() -> None:
    led = new_ledger(2)
    ledger.grant(led, "dead", 2, 2, now=0, lease_s=10)
    assert ledger.grant(led, "live", 1, 1, now=5, lease_s=10) == 0  # the lease still holds
    assert ledger.prune(led, now=10.5) == ["dead"]
    assert ledger.grant(led, "live", 1, 1, now=10.5, lease_s=10) == 1


def test_aimd_halves_once_per_event_and_grows_back_to_the_cap() -> None:
    led = new_ledger(16)
    assert ledger.decrease(led, now=100.0, min_interval_s=1.0)
    assert not ledger.decrease(led, now=100.5, min_interval_s=1.0)  # same burst of 429s
    assert led.window == 8.0
    assert ledger.decrease(led, now=101.5, min_interval_s=1.0)
    assert led.window == 4.0
    for _ in range(200):
        ledger.increase(led, 1)
    assert led.window == 16.0  # capped
    for _ in range(10):
        ledger.decrease(led, now=200.0 + _ * 2, min_interval_s=1.0)
    assert led.window == 1.0 and ledger.slots(led) == 1  # never below one slot


def test_must_shed_over_window_and_over_fair_share() -> None:
    led = new_ledger(8)
    led.holders = {"a": Holder(n=8, exp=1e12)}
    assert not ledger.must_shed(led, "a", 8)
    led.holders["b"] = Holder(n=0, want=2, exp=1e12)
    assert ledger.must_shed(led, "a", 8)  # b waits; a holds more than 8/2
    assert not ledger.over_window(led)  # fair share only: a slot a was just granted serves once
    assert not ledger.must_shed(led, "a", 4)
    led.holders["b"].want = 0
    led.window = 4.0
    assert ledger.must_shed(led, "a", 8)  # the window shrank below what is held
    assert ledger.over_window(led)  # then no slot starts a call, not even a fresh one


def test_token_bucket_refills_at_the_rate() -> None:
    b = ledger.Bucket(level=60.0, ts=0.0)
    assert ledger.take(b, 60, 100, now=0.0, whole=True) == 60
    assert ledger.take(b, 60, 1, now=0.5, whole=True) == 0  # half a token
    assert ledger.take(b, 60, 5, now=2.0, whole=True) == 2
    assert ledger.wait_for(b, 60, 1.0) == pytest.approx(1.0)


def test_limit_identity_by_model_or_endpoint() -> None:
    a = ModelSpec(model_name="openai/a", api_base="http://x/v1")
    b = ModelSpec(model_name="openai/b", api_base="http://x/v1")
    assert call_limits.limit_key(a) != call_limits.limit_key(b)
    ea = ModelSpec(model_name="openai/a", api_base="http://x/v1", limit_scope="endpoint")
    eb = ModelSpec(model_name="openai/b", api_base="http://x/v1", limit_scope="endpoint")
    assert call_limits.limit_key(ea) == call_limits.limit_key(eb)


async def test_three_limiters_share_one_cap() -> None:
    store = MemoryLedgerStore()
    lims = [Limiter(store, f"p{i}", linger_s=0.05) for i in range(3)]
    model = ModelSpec(model_name="openai/m", max_concurrency=4)
    try:
        peak, done = await _hammer(lims, model, 300)
    finally:
        for lim in lims:
            await lim.close()
    assert done == 300
    assert peak <= 4
    assert peak >= 2  # the limiters did run calls side by side (not one at a time)
    assert store.ops < 300  # slots are reused locally: not a ledger write per call


@pytest.mark.parametrize("seed", range(4))
async def test_more_processes_than_slots_all_get_their_turn(seed: int) -> None:
    """Six processes with work, three slots: the fair share is under one slot, and a slot granted
    to a waiting process is used by it before it can be shed to the next (it once went round
    unused for ever). Over a store with round trips and a watch that lags, as on the bus."""
    store = RoundTripStore(seed)
    lims = [Limiter(store, f"p{i}", linger_s=0.01, poll_s=0.01) for i in range(6)]
    model = ModelSpec(model_name="openai/m", max_concurrency=3)
    try:
        peak, done = await asyncio.wait_for(_hammer(lims, model, 400, seed=seed), 60)
    finally:
        for lim in lims:
            await lim.close()
    assert done == 400
    assert peak <= 3, f"{peak} calls in flight for a limit of 3"
    assert peak >= 2


async def test_a_call_arriving_while_a_slot_is_given_back_does_not_take_it() -> None:
    """Process a goes idle and its writer gives its one slot back; the write takes a round trip.
    A call that arrives on a meanwhile must wait: the slot is b's once the write lands, and a call
    on both would be two in flight for a limit of one."""
    store = GatedStore()
    model = ModelSpec(model_name="openai/m", max_concurrency=1)
    a = Limiter(store, "a", linger_s=0.05, poll_s=0.01)
    b = Limiter(store, "b", linger_s=0.05, poll_s=0.01)
    try:
        a.release(await a.acquire(model))
        store.hold()  # a's next write (the give-back, after linger_s idle) waits at the gate
        await asyncio.wait_for(store.write_waiting.wait(), 5)
        on_a = asyncio.ensure_future(a.acquire(model))
        await asyncio.sleep(0.05)
        store.open()
        on_b = asyncio.ensure_future(b.acquire(model))
        await asyncio.wait({on_a, on_b}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.2)  # time for the other one to be let in too, were it wrongly
        running = [t for t in (on_a, on_b) if t.done()]
        assert len(running) == 1, f"{len(running)} calls in flight for a limit of 1"
        (a if running[0] is on_a else b).release(running[0].result())
        waiting = on_b if running[0] is on_a else on_a
        (b if waiting is on_b else a).release(await asyncio.wait_for(waiting, 5))  # and no slot was lost
    finally:
        await a.close()
        await b.close()


async def test_a_dead_holders_slots_come_back_after_its_lease() -> None:
    store = MemoryLedgerStore()
    model = ModelSpec(model_name="openai/m", max_concurrency=2)
    dead = Limiter(store, "dead", lease_s=0.6)
    held = [await dead.acquire(model), await dead.acquire(model)]
    assert held
    for st in dead._states.values():  # the process dies: no release, no renewal, no goodbye
        assert st.task is not None
        st.task.cancel()
    live = Limiter(store, "live", lease_s=0.6, poll_s=0.05)
    try:
        ledger, _ = await store.get(call_limits.limit_key(model))
        assert ledger is not None
        expires = ledger.holders["dead"].exp
        lease = await asyncio.wait_for(live.acquire(model), 10)
        import time

        assert time.time() >= expires  # not admitted while the dead lease was valid
        live.release(lease)
    finally:
        await live.close()


async def test_429_shrinks_the_window_and_successes_grow_it_back() -> None:
    store = MemoryLedgerStore()
    model = ModelSpec(model_name="openai/m", max_concurrency=8)
    lim = Limiter(store, "p", decrease_interval_s=0.0, linger_s=0.05, poll_s=0.05)
    key = call_limits.limit_key(model)
    try:
        lease = await lim.acquire(model)
        lim.release(lease, rate_limited=True)
        for _ in range(100):
            ledger, _ = await store.get(key)
            if ledger is not None and ledger.window < 8:
                break
            await asyncio.sleep(0.02)
        assert ledger is not None and ledger.window == 4.0
        # while shrunk, a fifth call waits for one of four to finish
        held = [await lim.acquire(model) for _ in range(4)]
        fifth = asyncio.ensure_future(lim.acquire(model))
        await asyncio.sleep(0.3)
        assert not fifth.done()
        lim.release(held.pop())
        held.append(await asyncio.wait_for(fifth, 5))
        for lease in held:
            lim.release(lease)
        for _ in range(400):
            lease = await lim.acquire(model)
            lim.release(lease)
            ledger, _ = await store.get(key)
            if ledger is not None and ledger.window >= 8:
                break
            await asyncio.sleep(0)
        assert ledger is not None and ledger.window == 8.0
    finally:
        await lim.close()


async def test_requests_per_minute_are_shared() -> None:
    store = MemoryLedgerStore()
    model = ModelSpec(model_name="openai/m", max_concurrency=50, requests_per_minute=30)
    lims = [Limiter(store, f"p{i}", poll_s=0.05) for i in range(2)]
    admitted = 0

    async def one(lim: Limiter) -> None:
        nonlocal admitted
        lease = await lim.acquire(model)
        admitted += 1
        lim.release(lease)

    tasks = [asyncio.ensure_future(one(lims[i % 2])) for i in range(40)]
    await asyncio.sleep(0.5)
    try:
        # a full bucket holds a minute's worth (30); 0.5 s refills at most 0.25 more
        assert 1 <= admitted <= 30
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for lim in lims:
            await lim.close()


async def test_tokens_per_minute_are_settled_with_real_usage() -> None:
    store = MemoryLedgerStore()
    model = ModelSpec(model_name="openai/m", max_concurrency=50, tokens_per_minute=1000, max_tokens=100)
    lim = Limiter(store, "p", poll_s=0.05)
    try:
        lease = await lim.acquire(model, estimate=200)
        lim.release(lease, tokens=900)  # used far more than estimated: a 700-token debt
        second = asyncio.ensure_future(lim.acquire(model, estimate=200))
        await asyncio.sleep(0.3)
        assert not second.done()  # 1000 - 900 left is less than 200 (refill ~17 tokens/s)
        second.cancel()
    finally:
        await lim.close()


async def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    store = MemoryLedgerStore()
    model = ModelSpec(model_name="openai/m", max_concurrency=1)
    lim = Limiter(store, "p", poll_s=0.05)
    try:
        first = await lim.acquire(model)
        waiting = asyncio.ensure_future(lim.acquire(model))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        lim.release(first)
        again = await asyncio.wait_for(lim.acquire(model), 5)
        assert isinstance(again, Lease)
        lim.release(again)
    finally:
        await lim.close()
