"""Hedged requests (shared/runtime/llm/hedge.py): a second copy of a slow call goes out only on a
free slot, the first good reply wins, the loser runs to its end holding its lease, and what it
may have cost is counted; `auto` hedges after the model's own 95th percentile. Through `LLMClient.complete` with a scripted litellm stand-in, and
against both limiters (per process, and the deployment-wide ledger)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from shared.core.config import ModelConfig
from shared.core.events import ModelSpec
from shared.runtime.call_limits import IDLE_FOR_HEDGE_S
from shared.runtime.ledger_store import MemoryLedgerStore
from shared.runtime.limits import Limiter
from shared.runtime.llm import hedge
from shared.runtime.llm import transport as llm_transport
from shared.runtime.llm.client import CALL_GATE, LLMClient
from shared.runtime.llm.hedge import first_reply
from shared.runtime.llm.reply import LLMError, usage_entry


class SlowTransport:
    """litellm.acompletion with a scripted (seconds, outcome) per request, in the order sent: the
    outcome an exception to raise or the text of a real litellm ModelResponse (`mock_response`).
    Records which requests were cancelled mid-flight."""

    def __init__(self, script: list[tuple[float, Any]]) -> None:
        self.script = list(script)
        self.real = llm_transport._get_litellm()
        self.sent = 0
        self.cancelled: list[int] = []
        self.finished: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def acompletion(self, **kwargs: Any) -> Any:
        n = self.sent
        self.sent += 1
        delay, outcome = self.script[n] if n < len(self.script) else (0.0, "ok")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled.append(n)
            raise
        finally:
            self.in_flight -= 1
        self.finished.append(n)
        if isinstance(outcome, BaseException):
            raise outcome
        kw = {k: v for k, v in kwargs.items() if k not in ("api_base", "api_key", "response_format", "tools")}
        return await self.real.acompletion(mock_response=outcome, **kw)


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VERIBUS_LLM_TRANSPORT", "litellm")  # the stand-in replaces litellm's call

    def install(script: list[tuple[float, Any]]) -> SlowTransport:
        t = SlowTransport(script)
        monkeypatch.setattr(llm_transport, "_get_litellm", lambda: t)
        return t
    return install


PRICED = dict(model_name="openai/slow-model", api_base="http://127.0.0.1:9/v1", max_retries=0,
              input_cost_per_million_tokens=1.0, output_cost_per_million_tokens=2.0)
MSGS = [{"role": "user", "content": "What is 2 + 2?"}]


def _spec(**kw: Any) -> ModelSpec:
    return ModelSpec(**{**PRICED, **kw})


async def _soon(check: Any, limit_s: float = 5.0) -> bool:
    """Whether `check()` holds within `limit_s`: a cancelled copy stops on a later turn of the loop."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not check():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.005)
    return True


async def test_a_slow_call_is_hedged_and_the_fast_copy_wins(slow) -> None:
    t = slow([(1.0, "the slow copy"), (0.02, "the fast copy")])
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    reply = await LLMClient().complete(_spec(hedge_after_s=0.05, max_concurrency=4), MSGS, stage="answer")
    took = loop.time() - t0
    assert reply.text == "the fast copy" and took < 0.8 and t.sent == 2
    # the slow copy is not cancelled: a provider would go on with it, so it runs to its end
    assert await _soon(lambda: t.finished == [1, 0]) and t.cancelled == []
    # two requests were sent; the abandoned one is counted as costing what the reply did
    single = await LLMClient().complete(_spec(), MSGS, stage="answer")
    assert reply.attempts == 2 and reply.retries == {"hedge": 1}
    assert reply.usage["input_tokens"] == 2 * single.usage["input_tokens"]
    assert reply.cost_usd == pytest.approx(2 * single.cost_usd)
    entry = usage_entry(reply)
    assert entry["model_calls"] == 2 and entry["retries"] == {"hedge": 1}


async def test_the_losing_copy_keeps_its_slot_until_it_ends(slow) -> None:
    """Two slots: the slow first copy loses the race but is still at the provider, so only one
    slot is free until it ends; releasing its slot at once would allow three calls on a limit of 2."""
    slow([(1.0, "slow"), (0.02, "fast")])
    spec = _spec(hedge_after_s=0.05, max_concurrency=2)
    client = LLMClient()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    reply = await client.complete(spec, MSGS, stage="answer")
    assert reply.text == "fast"
    free = await asyncio.wait_for(client.limiter.acquire(spec), 1)  # the winner's slot
    second = asyncio.ensure_future(client.limiter.acquire(spec))
    await asyncio.sleep(0.2)
    assert not second.done()  # the loser's slot is still taken
    lease = await asyncio.wait_for(second, 5)
    assert loop.time() - t0 >= 0.9  # given back only when the slow copy ended
    client.limiter.release(free)
    client.limiter.release(lease)


async def test_without_a_free_slot_nothing_is_hedged(slow) -> None:
    t = slow([(0.4, "only copy")])
    reply = await LLMClient().complete(_spec(hedge_after_s=0.05, max_concurrency=1), MSGS, stage="answer")
    assert reply.text == "only copy" and t.sent == 1 and t.max_in_flight == 1
    assert reply.attempts == 1 and reply.retries == {}


async def test_busy_slots_are_never_exceeded_by_hedges(slow) -> None:
    """Eight calls on four slots, every one slow enough to be due a hedge: while calls queue for
    the slots nothing is hedged, and in flight never passes the limit."""
    slow([(0.15, f"r{i}") for i in range(40)])
    spec = _spec(hedge_after_s=0.01, max_concurrency=4)
    client = LLMClient()
    replies = await asyncio.gather(*[client.complete(spec, [{"role": "user", "content": f"q{i}"}], stage="a")
                                     for i in range(8)])
    t = llm_transport._get_litellm()
    assert len(replies) == 8 and t.max_in_flight <= 4
    # hedges only go out once the queue has drained (the last four calls' slots)
    assert sum(r.retries.get("hedge", 0) for r in replies) <= 4


async def _slow_call_among_busy_workers(slow, stalls_after: tuple[int, ...] = ()) -> tuple[Any, Any, list[int]]:  # noqa: ANN001
    """A slow call due a hedge after 0.02 s while three workers of another stage keep the other
    slots busy, each taking its next call 3 ms after its last ends (the next message's arrival);
    the first worker blocks the event loop for 0.15 s after each of its calls numbered in
    `stalls_after`, as a stall does. Returns the slow call's reply, the transport, and how many
    calls each worker made."""
    import time

    script: list[tuple[float, Any]] = [(1.0, "slow")] + [(0.05, "w")] * 200
    t = slow(script)
    hedged = _spec(hedge_after_s=0.02, max_concurrency=4)
    plain = _spec(max_concurrency=4)
    client = LLMClient()
    stop = False

    async def worker(stalls: bool) -> int:
        n = 0
        while not stop:
            await client.complete(plain, [{"role": "user", "content": f"w{n}"}], stage="a", use_cache=False)
            n += 1
            if stalls and n in stalls_after:
                time.sleep(0.15)  # the loop stops: no callback runs, its slot is free meanwhile
            await asyncio.sleep(0.003)  # the next message's arrival
        return n

    slow_call = asyncio.ensure_future(client.complete(hedged, MSGS, stage="answer"))
    await asyncio.sleep(0.01)
    workers = [asyncio.ensure_future(worker(i == 0)) for i in range(3)]
    reply = await slow_call
    stop = True
    return reply, t, list(await asyncio.gather(*workers))


async def test_a_slot_between_two_calls_of_a_busy_stage_is_not_taken(slow) -> None:
    """The steady state of a stage: its workers take their next call a few ms after the last
    ends (the next message arriving), so a slot is free only in those gaps. A slow call due a
    hedge must not take one: the next call would wait for it."""
    reply, t, done = await _slow_call_among_busy_workers(slow)
    assert reply.text == "slow" and reply.retries == {} and t.max_in_flight <= 4
    assert min(done) >= 5  # the workers kept their slots busy all along


async def test_a_stalled_event_loop_does_not_make_a_busy_stages_slot_look_idle(slow) -> None:
    """A process whose event loop stops for a while (a long garbage collection, a CPU taken by
    others) sees every slot's last use that long ago when it runs again: the slow call's poll,
    due during the stall, found the slot a worker had just freed idle for 0.15 s and took it, and
    the worker's next call waited for the copy (seen in CI as a flaky hedge test). Here a worker
    blocks the loop for 0.15 s between two of its calls, as a stall does."""
    reply, t, done = await _slow_call_among_busy_workers(slow, stalls_after=(3, 6))
    assert reply.text == "slow" and reply.retries == {} and t.max_in_flight <= 4, reply.text
    assert min(done) >= 5


async def test_a_hedge_waits_for_a_slot_to_free(slow) -> None:
    """The other slot is busy when the call becomes due; the hedge goes out once it frees."""
    t = slow([(1.5, "stuck"), (0.01, "rescued")])
    spec = _spec(hedge_after_s=0.05, max_concurrency=2)
    client = LLMClient()
    other = await client.limiter.acquire(spec)  # another call holds the second slot for 0.3 s
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, client.limiter.release, other)
    t0 = loop.time()
    reply = await client.complete(spec, MSGS, stage="answer")
    assert reply.text == "rescued" and 0.3 <= loop.time() - t0 < 1.4
    assert await _soon(lambda: t.finished == [1, 0])


async def test_a_failed_first_copy_leaves_the_hedge_to_answer(slow) -> None:
    boom = llm_transport._get_litellm().InternalServerError("upstream fell over", llm_provider="openai", model="m")
    t = slow([(0.15, boom), (0.3, "second copy")])
    reply = await LLMClient().complete(_spec(hedge_after_s=0.05, max_concurrency=2), MSGS, stage="answer")
    assert reply.text == "second copy" and t.sent == 2 and t.cancelled == []
    assert reply.usage["input_tokens"] > 0 and reply.retries == {"hedge": 1}


async def test_both_copies_failing_raise_the_first_error_and_free_both_slots(slow) -> None:
    lit = llm_transport._get_litellm()
    t = slow([(0.1, lit.InternalServerError("first", llm_provider="openai", model="m")),
              (0.05, lit.InternalServerError("second", llm_provider="openai", model="m"))])
    spec = _spec(hedge_after_s=0.05, max_concurrency=2)
    client = LLMClient()
    with pytest.raises(LLMError) as ei:
        await client.complete(spec, MSGS, stage="answer")
    assert ei.value.kind == "server_error" and "first" in str(ei.value) and t.sent == 2
    assert ei.value.attempts == 2
    # both leases came back: two calls can take both slots at once again
    a, b = await client.limiter.acquire(spec), await client.limiter.try_acquire(spec)
    assert b is not None
    client.limiter.release(a)
    client.limiter.release(b)


async def test_cancelling_a_hedged_call_cancels_both_copies_and_frees_the_slots(slow) -> None:
    t = slow([(30.0, "a"), (30.0, "b")])
    spec = _spec(hedge_after_s=0.05, max_concurrency=2)
    client = LLMClient()
    task = asyncio.ensure_future(client.complete(spec, MSGS, stage="answer"))
    while t.sent < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _soon(lambda: sorted(t.cancelled) == [0, 1])
    leases = [await client.limiter.try_acquire(spec) for _ in range(2)]
    assert all(lease is not None for lease in leases)


async def test_a_spent_budget_holds_the_hedge_back(slow) -> None:
    """The dispatch gate (a run's money budget, a cancel) stops a hedge as it stops a call."""
    t = slow([(0.3, "only copy")])

    async def spent() -> BaseException | None:
        return RuntimeError("budget spent") if t.sent else None  # lets the first copy through only

    token = CALL_GATE.set(spent)
    try:
        reply = await LLMClient().complete(_spec(hedge_after_s=0.05, max_concurrency=4), MSGS, stage="answer")
    finally:
        CALL_GATE.reset(token)
    assert reply.text == "only copy" and t.sent == 1 and reply.retries == {}


async def test_the_deployment_limiter_lends_only_an_idle_slot() -> None:
    """`Limiter.try_acquire` (the ledger shared by replicas): a lease when this process holds a
    free slot and none of its calls waits, else None; a hedge through it stays within the cap."""
    store = MemoryLedgerStore()
    lim = Limiter(store, "p0", linger_s=5.0)
    spec = _spec(hedge_after_s=0.02, max_concurrency=2)
    try:
        first, spare = await asyncio.gather(lim.acquire(spec), lim.acquire(spec))  # this process holds both
        lim.release(spare)
        assert await lim.try_acquire(spec) is None  # free, but both were busy a moment ago
        await asyncio.sleep(IDLE_FOR_HEDGE_S + 0.05)
        second = await lim.try_acquire(spec)
        assert second is not None  # the second of its two slots was free
        assert await lim.try_acquire(spec) is None  # both taken: no third
        waiting = asyncio.ensure_future(lim.acquire(spec))
        await asyncio.sleep(0.05)
        lim.release(second)
        await asyncio.wait_for(waiting, 5)  # the freed slot went to the waiting call, not a hedge
        assert await lim.try_acquire(spec) is None
        lim.release(first)
        lim.release(waiting.result())

        in_flight = peak = 0

        async def send() -> str:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await asyncio.sleep(0.2)
                return "r"
            finally:
                in_flight -= 1

        async def call() -> Any:
            lease = await lim.acquire(spec)
            try:
                return await first_reply(send, spec, lim, lease, 0)
            finally:
                lim.release(lease)

        got = await asyncio.gather(*[call() for _ in range(6)])
        assert [g.response for g in got] == ["r"] * 6 and peak <= 2
    finally:
        await lim.close()


def test_hedging_is_opt_in_and_checked() -> None:
    assert ModelConfig(model_name="openai/m").to_spec().hedge_after_s is None
    assert ModelConfig(model_name="openai/m", hedge_after_s=2.5).to_spec().hedge_after_s == 2.5
    assert ModelConfig(model_name="openai/m", hedge_after_s="auto").to_spec().hedge_after_s == "auto"
    for bad in (0, -1, "soon"):
        with pytest.raises(ValueError, match="hedge_after_s"):
            ModelConfig(model_name="openai/m", hedge_after_s=bad)


def test_a_forged_hedge_setting_on_the_bus_is_refused() -> None:
    """A job's model comes off the bus: a negative delay (a hedge at once for every call) or an
    unknown word does not decode."""
    dec = msgspec.json.Decoder(ModelSpec)
    assert dec.decode(b'{"model_name": "openai/m", "hedge_after_s": "auto"}').hedge_after_s == "auto"
    for bad in (b'-1', b'0', b'"soon"', b'"AUTO"'):
        with pytest.raises(msgspec.ValidationError, match="hedge_after_s"):
            dec.decode(b'{"model_name": "openai/m", "hedge_after_s": %s}' % bad)


async def test_auto_hedges_after_the_models_own_95th_percentile(slow, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hedge_after_s: auto`: nothing is hedged before `AUTO_MIN_CALLS` replies, however slow a
    call; then a call slower than the 95th percentile of the replies seen is raced after about
    that long, and the losing copy's time joins the window when it ends (so the window is not
    only the winners)."""
    monkeypatch.setattr(hedge, "_LATENCIES", {})
    n = hedge.AUTO_MIN_CALLS
    # five fast replies, then a slow call: over the fast ones' percentile, but too early to hedge
    script = [(0.01, f"fast {i}") for i in range(5)] + [(0.5, "slow early")]
    script += [(0.01, f"fast {i}") for i in range(5, n)]
    t = slow([*script, (1.0, "slow late"), (0.01, "its hedge")])
    spec = _spec(hedge_after_s="auto", max_concurrency=4)
    client = LLMClient()
    assert hedge.hedge_delay(spec) is None
    for i in range(n + 1):
        reply = await client.complete(spec, [{"role": "user", "content": f"q{i}"}], stage="answer")
        assert reply.retries == {}, f"call {i}: fewer than {n} replies seen, nothing is hedged"
    assert t.sent == n + 1
    delay = hedge.hedge_delay(spec)
    assert delay is not None and delay < 0.25, "the 95th percentile of 20 fast replies and one slow"
    assert max(hedge._LATENCIES[hedge._latency_key(spec)]) < 0.95
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    late = await client.complete(spec, [{"role": "user", "content": "q-late"}], stage="answer")
    assert late.text == "its hedge" and late.retries == {"hedge": 1} and loop.time() - t0 < 0.8
    window = hedge._LATENCIES[hedge._latency_key(spec)]
    assert await _soon(lambda: max(window) >= 0.95), "the losing copy's second counts too"
    assert len(window) == n + 3
    # another model, or the same name at another endpoint, has a window of its own
    assert hedge.hedge_delay(_spec(hedge_after_s="auto", api_base="http://127.0.0.1:10/v1")) is None


async def test_a_call_slow_long_after_the_rest_still_gets_a_slot_from_the_ledger() -> None:
    """An idle process gives its free slots back to the ledger after `linger_s`, so a call that
    turns slow later (a `hedge_after_s` of many seconds) holds the only slot it has. The hedge asks
    the ledger for one that is free and wanted by nobody; it never takes one another process waits
    for, and never goes past the cap."""
    store = MemoryLedgerStore()
    lim = Limiter(store, "p0", linger_s=0.05, poll_s=0.1)
    other = Limiter(store, "p1", linger_s=5.0, poll_s=0.1)
    spec = _spec(hedge_after_s=0.02, max_concurrency=3)
    try:
        stuck = await lim.acquire(spec)
        await asyncio.sleep(0.4)  # everything else done long ago: the spare slots went back
        assert lim.snapshot()[stuck.key]["held"] == 1
        lease = None
        for _ in range(40):
            lease = await lim.try_acquire(spec)
            if lease is not None:
                break
            await asyncio.sleep(0.05)
        assert lease is not None, "no spare slot came from the ledger"
        ledger, _ = await store.get(stuck.key)
        assert sum(h.n for h in ledger.holders.values()) == 2
        lim.release(lease)

        # another process takes the free slots and waits for more: a hedge gets none of them
        taken = [await other.acquire(spec) for _ in range(2)]
        waiting = asyncio.ensure_future(other.acquire(spec))
        await asyncio.sleep(0.3)
        for _ in range(10):
            assert await lim.try_acquire(spec) is None
            await asyncio.sleep(0.05)
        ledger, _ = await store.get(stuck.key)
        assert sum(h.n for h in ledger.holders.values()) <= 3
        lim.release(stuck)
        await asyncio.wait_for(waiting, 5)  # the stuck call's slot goes to the waiting process
        for lease in [*taken, waiting.result()]:
            other.release(lease)
    finally:
        await lim.close()
        await other.close()


def test_a_hedged_model_sampling_above_temperature_zero_is_told_of_the_lean_to_short_replies() -> None:
    """The first of two copies wins: at a temperature above 0 they differ and the faster is more
    often the shorter, so the run is told before it starts (answering and judge models alike;
    a temperature in `params` is the one sent)."""
    from shared.core.config import VerificationConfig

    def notes(answering: dict[str, Any], judge: dict[str, Any] | None = None) -> list[str]:
        return VerificationConfig(answering_models=[{"model_name": "openai/a", **answering}],
                                  parsing_models=[{"model_name": "openai/j", **(judge or {})}]).sampling_notes()

    said = notes({"hedge_after_s": 0.6, "temperature": 0.7})
    assert len(said) == 1 and said[0].startswith("answering model 'openai/a' is hedged (hedge_after_s: 0.6) at "
                                                 "temperature 0.7: ")
    assert "lean toward short ones" in said[0] and "leave hedge_after_s unset" in said[0]
    assert notes({"hedge_after_s": "auto", "params": {"temperature": 1}})[0].startswith(
        "answering model 'openai/a' is hedged (hedge_after_s: auto) at temperature 1: ")
    assert notes({}, {"hedge_after_s": 2.0, "temperature": 0.3})[0].startswith("judge model 'openai/j' is hedged")
    assert notes({"hedge_after_s": 0.6}) == []  # temperature 0: the copies ask for the same reply
    assert notes({"hedge_after_s": 0.6, "temperature": 0.7, "params": {"temperature": 0}}) == []  # params' is sent
    assert notes({"temperature": 0.7}) == []  # not hedged: nothing is chosen between replies
