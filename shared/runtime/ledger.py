"""The model-limit ledger, pure arithmetic (no I/O, unit tested): per limit key, the slots each
process ("holder") holds under a lease, the AIMD window (a 429 halves it once per congestion
event, successes grow it back up to the cap) and the token buckets for requests and tokens per
minute. `shared.runtime.limits` explains why there is a shared ledger at all."""

from __future__ import annotations

import math

import msgspec


class Holder(msgspec.Struct, omit_defaults=True):
    n: int = 0  # slots held
    want: int = 0  # slots it waits for (tells others to shed down to their fair share)
    exp: float = 0.0  # lease end (wall clock)


class Bucket(msgspec.Struct, omit_defaults=True):
    level: float
    ts: float


class Ledger(msgspec.Struct, omit_defaults=True):
    cap: int
    window: float
    holders: dict[str, Holder] = {}
    last_decrease: float = 0.0
    decreases: int = 0
    rpm: Bucket | None = None
    tpm: Bucket | None = None


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Ledger)


def encode_ledger(ledger: Ledger) -> bytes:
    return _enc.encode(ledger)


def decode_ledger(data: bytes) -> Ledger:
    return _dec.decode(data)


def new_ledger(cap: int) -> Ledger:
    return Ledger(cap=cap, window=float(cap), holders={})


def prune(ledger: Ledger, now: float) -> list[str]:
    """Drop holders whose lease has expired (dead or stalled processes); returns who was dropped."""
    dead = [k for k, h in ledger.holders.items() if h.exp < now]
    for k in dead:
        del ledger.holders[k]
    return dead


def set_cap(ledger: Ledger, cap: int) -> None:
    """The configured cap of the newest caller wins; the window never exceeds it."""
    cap = max(1, int(cap))
    if cap != ledger.cap:
        ledger.cap = cap
    ledger.window = min(max(1.0, ledger.window), float(cap))


def slots(ledger: Ledger) -> int:
    """Whole slots the window allows (at least one, so a model is never starved to zero)."""
    return max(1, math.floor(ledger.window))


def held_total(ledger: Ledger) -> int:
    return sum(h.n for h in ledger.holders.values())


def shares(ledger: Ledger) -> tuple[int, int]:
    """(floor, ceil) of the window split over the holders that hold or want slots."""
    active = max(1, sum(1 for h in ledger.holders.values() if h.n > 0 or h.want > 0))
    return slots(ledger) // active, math.ceil(slots(ledger) / active)


def _starving(ledger: Ledger, me: str, floor: int) -> bool:
    """Another holder waits while holding less than its floor share (at least one slot)."""
    least = max(1, floor)
    return any(h.want > 0 and h.n < least for k, h in ledger.holders.items() if k != me)


def others_want(ledger: Ledger, me: str) -> bool:
    """Another holder waits for slots."""
    return any(h.want > 0 for k, h in ledger.holders.items() if k != me)


def spare(ledger: Ledger, me: str) -> bool:
    """A slot is free and no other holder wants one: what a hedge may take (never one that
    another process waits for, nor past the window)."""
    return slots(ledger) > held_total(ledger) and not others_want(ledger, me)


def grant(ledger: Ledger, me: str, want: int, batch: int, now: float, lease_s: float) -> int:
    """Give `me` up to min(want, batch) free slots, no more than its share while others wait;
    record what it still wants; renew its lease."""
    h = ledger.holders.setdefault(me, Holder())
    h.want = want
    free = slots(ledger) - held_total(ledger)
    g = max(0, min(free, want, batch))
    floor, ceil = shares(ledger)
    if _starving(ledger, me, floor):
        g = min(g, max(0, max(1, floor) - h.n))
    elif others_want(ledger, me):
        g = min(g, max(0, ceil - h.n))
    h.n += g
    h.want = max(0, want - g)
    h.exp = now + lease_s
    return g


def give_back(ledger: Ledger, me: str, k: int, now: float, lease_s: float) -> int:
    h = ledger.holders.get(me)
    if h is None:
        return 0
    k = max(0, min(k, h.n))
    h.n -= k
    h.exp = now + lease_s
    if h.n == 0 and h.want == 0:
        del ledger.holders[me]
    return k


def over_window(ledger: Ledger) -> bool:
    """The holders hold more than the window allows (a 429 shrank it): no slot may start a call
    until enough are given back, not even one just granted."""
    return held_total(ledger) > slots(ledger)


def must_shed(ledger: Ledger, me: str, held: int) -> bool:
    """True when `me` should give a freed slot back instead of reusing it: the ledger is over the
    window (it shrank), or another holder waits with less than its share while `me` has more."""
    if over_window(ledger):
        return True
    floor, _ = shares(ledger)
    return held > floor and _starving(ledger, me, floor)


def shed_amount(ledger: Ledger, me: str, held: int) -> int:
    """How many slots `me` should give back now (see `must_shed`)."""
    total, allowed = held_total(ledger), slots(ledger)
    floor, _ = shares(ledger)
    over = held - floor if _starving(ledger, me, floor) else 0
    if total > allowed:
        over = max(over, min(total - allowed, max(1, held - floor)))
    return max(0, over)


def decrease(ledger: Ledger, now: float, min_interval_s: float) -> bool:
    """Multiplicative decrease after a 429 (once per congestion event)."""
    if now - ledger.last_decrease < min_interval_s:
        return False
    ledger.window = max(1.0, ledger.window / 2.0)
    ledger.last_decrease = now
    ledger.decreases += 1
    return True


def increase(ledger: Ledger, successes: int) -> None:
    """Additive increase: one slot per window's worth of successful calls, up to the cap."""
    if successes > 0:
        ledger.window = min(float(ledger.cap), ledger.window + successes / max(1.0, ledger.window))


def take(bucket: Bucket, per_minute: float, k: float, now: float, *, whole: bool) -> float:
    """Refill a token bucket (capacity one minute's worth) and take up to `k` from it."""
    rate = per_minute / 60.0
    bucket.level = min(per_minute, bucket.level + max(0.0, now - bucket.ts) * rate)
    bucket.ts = now
    avail = math.floor(bucket.level) if whole else bucket.level
    g = max(0.0, min(k, avail))
    bucket.level -= g
    return g


def refund(bucket: Bucket, per_minute: float, k: float) -> None:
    bucket.level = min(per_minute, bucket.level + max(0.0, k))


def wait_for(bucket: Bucket, per_minute: float, need: float) -> float:
    """Seconds until the bucket holds `need`."""
    missing = need - bucket.level
    return 0.0 if missing <= 0 else missing / (per_minute / 60.0)
