"""Model limits for the whole deployment: concurrency, requests/minute and tokens/minute per model
(or per endpoint), shared by every replica of every service, adapting to 429s (AIMD).

Why a ledger and not a semaphore: `max_concurrency` used to be per process, so three replicas of
generation and three of parsing put six times the cap on a provider. Here every process that
calls a model shares one *ledger* per limit key (a JetStream KV entry, updated by compare-and-set):

- **Slots.** The ledger records, per process ("holder"), how many slots it holds and until when
  (`exp`, a lease). A process takes a small batch of slots in one CAS and reuses them for call
  after call without touching the bus; it gives surplus back when it idles, when others wait
  (fair share) or when the window shrinks. A slot it was granted serves one call before it can
  be shed (unless a 429 shrank the window below what is held), so with more processes than slots
  each still gets its turn. A holder that dies stops renewing; once its lease has expired any
  other process drops it from the ledger and its slots are free again.
- **Rates.** Requests and tokens per minute are token buckets in the same ledger; a process
  takes a batch of permits at a time (lost if it dies: conservative, never an overshoot).
- **AIMD.** A 429 halves the shared window (at most once per `decrease_interval_s`, so one burst
  of 429s is one congestion event); successes grow it back by one slot per window's worth of
  successes, up to the configured cap.

The ledger arithmetic is pure (`grant`, `give_back`, `decrease`, ... on a `Ledger`) and unit
tested; `Limiter` runs one small task per limit key per process that does all ledger writes,
while `acquire`/`release` touch only local state. `LedgerStore` is where ledgers live:
`KVLedgerStore` (JetStream KV, the deployment) or `MemoryLedgerStore` (one process, tests).
The ledger is `shared.runtime.ledger`, its stores `shared.runtime.ledger_store`, and a call's
limit key, estimate and lease `shared.runtime.call_limits`.

Clocks: lease expiry compares wall clocks of different hosts; keep them NTP-synchronised (skew
well under `lease_s`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.core.events import ModelSpec
from shared.runtime.call_limits import IDLE_FOR_HEDGE_S, Lease, limit_key
from shared.runtime.ledger import (
    Bucket,
    Holder,
    Ledger,
    decode_ledger,
    decrease,
    encode_ledger,
    give_back,
    grant,
    held_total,
    increase,
    must_shed,
    new_ledger,
    over_window,
    prune,
    refund,
    set_cap,
    shed_amount,
    slots,
    spare,
    take,
    wait_for,
)
from shared.runtime.ledger_store import Conflict, KVLedgerStore, LedgerStore

log = logging.getLogger("veribus.limits")


@dataclass
class _Waiter:
    fut: asyncio.Future[None]
    estimate: int


@dataclass
class _KeyState:
    key: str
    cap: int
    rpm: int | None
    tpm: int | None
    held: int = 0
    in_use: int = 0
    fresh: int = 0  # held slots granted and unused since: not shed for fair share before a call used them
    rpm_local: int = 0
    tpm_local: float = 0.0
    waiters: deque[_Waiter] = field(default_factory=deque)
    view: Ledger | None = None  # the newest ledger seen (watch or own write): for shedding decisions
    base: Ledger | None = None  # the ledger at `revision` (own read or write): the base of a CAS
    revision: int = 0
    valid_until: float = 0.0  # local slots may be used until then (lease renewed before)
    successes: int = 0
    rate_limited: bool = False
    last_busy: float = 0.0
    full_at: float = 0.0  # when every held slot was last in use, or a call last had to wait
    spare_asked: float = 0.0  # when a hedge last asked the ledger for a free slot (`try_acquire`)
    spare_wanted: bool = False
    next_retry: float = 0.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    registered: bool = False
    wanting: bool = False  # our ledger entry says we wait for slots
    dirty: bool = False  # the ledger changed in a way that may help us
    last_write: float = 0.0
    last_written: bytes = b""


def _fresh_kept(st: _KeyState, ledger: Ledger) -> int:
    """Free slots kept from shedding: those granted and not used yet, as each serves one call
    first (with more processes than slots the fair share is 0, and a granted slot shed at once
    went round unused), unless a 429 shrank the window below what is held."""
    return 0 if over_window(ledger) else min(st.fresh, st.held - st.in_use)


class Limiter:
    """Deployment-wide model limits (see module docstring). One per process."""

    def __init__(self, store: LedgerStore, owner: str, *, lease_s: float = 10.0, batch: int = 4,
                 linger_s: float = 0.5, decrease_interval_s: float = 1.0, poll_s: float = 1.0) -> None:
        self.store = store
        self.owner = owner
        self.lease_s = lease_s
        self.batch = max(1, batch)
        self.linger_s = linger_s
        self.decrease_interval_s = decrease_interval_s
        self.poll_s = poll_s
        self._states: dict[str, _KeyState] = {}
        self._closed = False
        self.calls = 0  # admitted calls (for the per-call overhead figure: store.ops / calls)

    # -- the two calls on the hot path (local state only)

    async def acquire(self, model: ModelSpec, estimate: int = 0) -> Lease:
        st = self._state(model)
        self.calls += 1
        if st.tpm is None:
            estimate = 0
        if not st.waiters and self._can_admit(st, estimate):
            self._admit(st, estimate)
            return Lease(st.key, estimate)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), estimate)
        st.waiters.append(waiter)
        st.full_at = time.monotonic()
        st.wake.set()
        try:
            await waiter.fut
        except asyncio.CancelledError:
            if waiter.fut.done() and not waiter.fut.cancelled():
                self.release(Lease(st.key, estimate))  # admitted just as we were cancelled
            else:
                try:
                    st.waiters.remove(waiter)
                except ValueError:
                    pass
            raise
        return Lease(st.key, estimate)

    async def try_acquire(self, model: ModelSpec, estimate: int = 0) -> Lease | None:
        """A lease only if this process holds a free slot now, none of its calls waits, and its
        slots have not all been busy for `IDLE_FOR_HEDGE_S`: a hedge (`shared.runtime.llm.hedge`)
        uses capacity that would otherwise idle, never a slot the next call is about to take."""
        st = self._state(model)
        if st.tpm is None:
            estimate = 0
        now = time.monotonic()
        if st.waiters or now - st.full_at < IDLE_FOR_HEDGE_S:
            return None
        if not self._can_admit(st, estimate):
            # an idle process gives its free slots back after `linger_s`, so a call that turns slow
            # later (hedge_after_s of many seconds) finds none here: ask the writer for one the
            # ledger has free and nobody wants, at most once per `poll_s`; the caller polls again
            if now - st.spare_asked >= self.poll_s:
                st.spare_asked = now
                st.spare_wanted = True
                st.wake.set()
            return None
        self.calls += 1
        self._admit(st, estimate)
        return Lease(st.key, estimate)

    def release(self, lease: Lease, *, tokens: int | None = None, rate_limited: bool = False) -> None:
        """The call is over: `tokens` it really used (settles the estimate), whether it got a 429."""
        if lease.released:
            return
        lease.released = True
        st = self._states.get(lease.key)
        if st is None:
            return
        st.in_use -= 1
        st.last_busy = time.monotonic()
        if st.tpm is not None and tokens is not None:
            st.tpm_local -= max(0, tokens) - lease.estimate  # negative: a debt the next take repays
        if rate_limited:
            st.rate_limited = True
        else:
            st.successes += 1
        self._serve(st)
        st.wake.set()

    # -- local admission

    def _can_admit(self, st: _KeyState, estimate: int) -> bool:
        if st.in_use >= st.held or time.monotonic() >= st.valid_until:
            return False
        v = st.view
        if v is not None and must_shed(v, self.owner, st.held) and not _fresh_kept(st, v):
            return False  # a freed slot goes back to a process that waits (a fresh one serves once)
        if st.rpm is not None and st.rpm_local < 1:
            return False
        return not (st.tpm is not None and st.tpm_local < estimate)

    def _admit(self, st: _KeyState, estimate: int) -> None:
        st.in_use += 1
        st.fresh = max(0, st.fresh - 1)
        st.last_busy = time.monotonic()
        if st.in_use >= st.held:
            st.full_at = st.last_busy
        if st.rpm is not None:
            st.rpm_local -= 1
        if st.tpm is not None:
            st.tpm_local -= estimate

    def _serve(self, st: _KeyState) -> None:
        while st.waiters and self._can_admit(st, st.waiters[0].estimate):
            w = st.waiters.popleft()
            if w.fut.done():
                continue
            self._admit(st, w.estimate)
            w.fut.set_result(None)

    def _state(self, model: ModelSpec) -> _KeyState:
        key = limit_key(model)
        st = self._states.get(key)
        rpm = getattr(model, "requests_per_minute", None) or None
        tpm = getattr(model, "tokens_per_minute", None) or None
        if st is None:
            st = self._states[key] = _KeyState(key, max(1, model.max_concurrency), rpm, tpm)
        else:
            st.cap, st.rpm, st.tpm = max(1, model.max_concurrency), rpm, tpm
        if st.task is None or st.task.done():
            st.task = asyncio.get_running_loop().create_task(self._run(st), name=f"veribus-limit-{key}")
        return st

    # -- the one writer per key

    async def _run(self, st: _KeyState) -> None:
        if not st.registered:
            try:
                await self.store.watch(st.key, lambda data: self._on_change(st, data))
                st.registered = True
            except Exception as exc:  # noqa: BLE001 - polling still works
                log.warning("limits: cannot watch %s: %r", st.key, exc)
        while not self._closed:
            timeout = self.poll_s
            st.wake.clear()
            try:
                if self._needs_write(st):
                    await self._write(st)
                self._serve(st)
                if st.waiters:
                    ahead = st.next_retry - time.time()
                    timeout = min(self.poll_s, max(0.005, ahead)) if ahead > 0 else self.poll_s
                else:
                    timeout = min(self.lease_s / 3, self.linger_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the bus is down: retry, never admit blindly
                log.warning("limits: ledger %s write failed: %r", st.key, exc)
                timeout = self.poll_s
            try:
                await asyncio.wait_for(st.wake.wait(), timeout)
            except TimeoutError:
                pass

    def _on_change(self, st: _KeyState, data: bytes) -> None:
        """Another process wrote the ledger: keep the view, and wake the writer when something
        became free (slots, or a new window) or others now wait (we may have to shed)."""
        if not data or data == st.last_written:
            return
        try:
            view = decode_ledger(data)
        except msgspec.DecodeError:
            return
        st.view = view
        if slots(view) - held_total(view) > 0 or must_shed(view, self.owner, st.held):
            st.dirty = True
            st.wake.set()

    def _needs_write(self, st: _KeyState) -> bool:
        now = time.monotonic()
        if st.rate_limited or st.spare_wanted:
            return True
        if st.waiters and time.time() >= st.next_retry:
            free_local = st.held - st.in_use
            blocked = (len(st.waiters) > free_local or now >= st.valid_until
                       or (st.rpm is not None and st.rpm_local < 1)
                       or (st.tpm is not None and st.tpm_local < st.waiters[0].estimate))
            if blocked and (not st.wanting or st.dirty or now - st.last_write >= self.poll_s):
                return True
        if st.held > 0 or st.rpm_local > 0 or st.tpm_local > 0:
            if now >= st.valid_until - self.lease_s * 0.3:  # renew before the lease runs out
                return True
            if st.held > st.in_use:
                if not st.waiters and now - st.last_busy >= self.linger_s:
                    return True
                v = st.view
                if v is not None and must_shed(v, self.owner, st.held) and st.held - st.in_use > _fresh_kept(st, v):
                    return True
        v = st.view
        return bool(st.successes and v is not None and v.window < st.cap and st.successes >= max(1.0, v.window / 2))

    async def _write(self, st: _KeyState) -> None:
        """One read-modify-CAS of the ledger: take what waiters need, give back surplus, renew,
        and fold in this process's 429s and successes. Retries on conflict."""
        for _ in range(50):
            # the base of a compare-and-set is only ever what this process last read or wrote at
            # `revision`: the watched view may be older or newer than that revision
            if st.base is None or st.revision == 0:
                ledger, rev = await self.store.get(st.key)
            else:
                ledger, rev = st.base, st.revision
            ledger = msgspec.structs.replace(ledger) if ledger is not None else new_ledger(st.cap)
            ledger.holders = {k: msgspec.structs.replace(h) for k, h in ledger.holders.items()}
            wall = time.time()
            prune(ledger, wall)
            set_cap(ledger, st.cap)
            mine = ledger.holders.get(self.owner)
            if mine is None and st.held > 0:  # our lease lapsed (a stall): claim what is in flight
                st.held, st.fresh = st.in_use, 0
                if st.held:
                    ledger.holders[self.owner] = Holder(n=st.held, exp=wall + self.lease_s)
            elif mine is not None and mine.n != st.held:
                mine.n = st.held
            if st.rate_limited:
                decrease(ledger, wall, self.decrease_interval_s)
            increase(ledger, st.successes)
            # give back what is not needed, take what waiters need
            free_local = st.held - st.in_use
            give = 0
            if free_local > 0:
                if must_shed(ledger, self.owner, st.held):
                    give = min(free_local - _fresh_kept(st, ledger), shed_amount(ledger, self.owner, st.held))
                elif not st.waiters and time.monotonic() - st.last_busy >= self.linger_s:
                    give = free_local
            if give:
                give_back(ledger, self.owner, give, wall, self.lease_s)
            need = max(0, len(st.waiters) - (free_local - give))
            for_hedge = st.spare_wanted and not need and spare(ledger, self.owner)
            if for_hedge:
                need = 1  # a hedge's slot: only one that is free and wanted by no one
            got = 0
            if need or st.held - give > 0:
                got = grant(ledger, self.owner, need, need, wall, self.lease_s)
            if st.held - give + got == 0 and not need:
                ledger.holders.pop(self.owner, None)
            rpm_got, tpm_got, retry_at = self._rates(st, ledger, wall)
            # What this write gives back leaves the local count before the round trip: a call
            # admitted while the write is on its way must not take a slot (or permit) that the
            # ledger is handing to another process. Restored only if the write surely failed.
            st.held -= give
            unfreshed = max(0, st.fresh - (st.held - st.in_use))
            st.fresh -= unfreshed
            st.rpm_local += min(0, int(rpm_got))
            st.tpm_local += min(0.0, tpm_got)
            try:
                rev = await self.store.cas(st.key, ledger, rev)
            except Conflict:
                st.held += give
                st.fresh = min(st.fresh + unfreshed, st.held - st.in_use)
                st.rpm_local -= min(0, int(rpm_got))
                st.tpm_local -= min(0.0, tpm_got)
                st.base, st.revision = None, 0
                continue
            except BaseException:
                st.base, st.revision = None, 0  # written or not: read the ledger before the next write
                raise
            st.base, st.view, st.revision = ledger, ledger, rev
            st.last_written = encode_ledger(ledger)
            st.last_write = time.monotonic()
            st.dirty = False
            st.wanting = need - got > 0
            st.held += got
            st.fresh += got
            st.spare_wanted = False  # asked once: granted now, or the hedge's next poll asks again
            if for_hedge:
                st.last_busy = time.monotonic()  # not given back as idle before the hedge takes it
            st.rpm_local += max(0, int(rpm_got))
            st.tpm_local += max(0.0, tpm_got)
            st.rate_limited = False
            st.successes = 0
            st.valid_until = time.monotonic() + self.lease_s * 0.8
            st.next_retry = retry_at if st.waiters else 0.0
            return
        raise RuntimeError(f"ledger {st.key}: too many conflicting writers")

    def _rates(self, st: _KeyState, ledger: Ledger, wall: float) -> tuple[float, float, float]:
        """Take request / token permits for the waiters (a small batch ahead); give back unused
        ones when idle. Returns (requests taken, tokens taken, wall time worth retrying at)."""
        retry_at = 0.0
        idle = not st.waiters and time.monotonic() - st.last_busy >= self.linger_s
        rpm_got = tpm_got = 0.0
        if st.rpm is not None:
            if ledger.rpm is None:
                ledger.rpm = Bucket(level=float(st.rpm), ts=wall)
            if idle and st.rpm_local > 0:
                refund(ledger.rpm, st.rpm, st.rpm_local)
                rpm_got = -st.rpm_local
            else:
                need = max(0, len(st.waiters) - st.rpm_local)
                if need:
                    ahead = max(0, min(self.batch, st.rpm // 60) - 1)
                    rpm_got = take(ledger.rpm, st.rpm, need + ahead, wall, whole=True)
                    if rpm_got < need:
                        retry_at = wall + wait_for(ledger.rpm, st.rpm, 1.0)
        if st.tpm is not None:
            if ledger.tpm is None:
                ledger.tpm = Bucket(level=float(st.tpm), ts=wall)
            if idle and st.tpm_local > 0:
                refund(ledger.tpm, st.tpm, st.tpm_local)
                tpm_got = -st.tpm_local
            else:
                need_t = sum(w.estimate for w in st.waiters) - st.tpm_local
                if st.waiters and need_t > 0:
                    first = max(0.0, st.waiters[0].estimate - st.tpm_local)
                    if first > st.tpm:  # a call bigger than a whole minute's tokens: let it through alone
                        need_t = first = float(st.tpm)
                    tpm_got = take(ledger.tpm, st.tpm, need_t, wall, whole=False)
                    if tpm_got < first:
                        retry_at = max(retry_at, wall + wait_for(ledger.tpm, st.tpm, first - tpm_got))
                elif need_t > 0 and not st.waiters:  # repay a debt from an underestimate
                    tpm_got = take(ledger.tpm, st.tpm, need_t, wall, whole=False)
        return rpm_got, tpm_got, retry_at

    async def close(self) -> None:
        """Give every slot and unused permit back (a clean shutdown frees them at once)."""
        self._closed = True
        for st in self._states.values():
            if st.task is not None:
                st.task.cancel()
                try:
                    await st.task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass
            for w in st.waiters:
                if not w.fut.done():
                    w.fut.cancel()
            try:
                await self._leave(st)
            except Exception as exc:  # noqa: BLE001 - the lease expires anyway
                log.debug("limits: leaving %s failed: %r", st.key, exc)
        await self.store.close()

    async def _leave(self, st: _KeyState) -> None:
        for _ in range(20):
            ledger, rev = await self.store.get(st.key)
            if ledger is None:
                return
            wall = time.time()
            ledger.holders.pop(self.owner, None)
            if ledger.rpm is not None and st.rpm and st.rpm_local > 0:
                refund(ledger.rpm, st.rpm, st.rpm_local)
            if ledger.tpm is not None and st.tpm and st.tpm_local > 0:
                refund(ledger.tpm, st.tpm, st.tpm_local)
            prune(ledger, wall)
            try:
                await self.store.cas(st.key, ledger, rev)
                st.held = st.rpm_local = 0
                st.tpm_local = 0.0
                return
            except Conflict:
                continue

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """This process's view per key: held, in use, waiting, window (for status and tests)."""
        return {k: {"held": s.held, "in_use": s.in_use, "waiting": len(s.waiters),
                    "window": s.view.window if s.view else None} for k, s in self._states.items()}


def deployment_limiter(nc: Any, owner: str, lease_s: float = 10.0) -> Limiter:
    """The limiter a service attaches to its model client: ledgers in JetStream KV."""
    return Limiter(KVLedgerStore(nc), owner, lease_s=lease_s)
