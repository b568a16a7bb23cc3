"""What a bench run's timing says: the stream's timeline of a run (`timeline`), its steady-state
rate, the share of the model slots busy in each part of it (`slot_occupancy`, from the
simulator's record of every call), and what the simulator itself allows with minimal callers
(`simulator_ceiling`): the figures `bench.run` prints beside its throughput, read after the run
(none of this is part of the measurement).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx

from shared.control import streams
from shared.core import events
from shared.core.config import Settings
from shared.runtime import bus


async def event_times(settings: Settings, run_id: str) -> dict[str, list[float]]:
    """Event type -> the stream's timestamps (epoch seconds) of a run's events: where the run's
    time went, read from the stream after the run (not part of the measurement)."""
    out: dict[str, list[float]] = {}
    async with bus.session(settings) as nc:
        msgs = await streams.read_messages(nc.jetstream(), events.subject("*.*", run_id, "*"))
    for m in msgs:
        parts = m.subject.split(".")
        if m.metadata and m.metadata.timestamp is not None:
            out.setdefault(f"{parts[1]}.{parts[2]}", []).append(m.metadata.timestamp.timestamp())
    return out


def timeline(times: dict[str, list[float]], t0: float, submit_s: float, n: int, latency_ms: float,
             concurrency: int) -> dict[str, Any]:
    """Seconds from the start of `submit` to the first and last event of each stage, and the ideal
    whole run at latency (each model busy with C/2 calls from its first call: N*2L/C, plus the
    parse model's idle first L), so a report can say what the fill and the drain cost."""
    def span(et: str) -> tuple[float, float] | None:
        ts = times.get(et)
        return (round(min(ts) - t0, 3), round(max(ts) - t0, 3)) if ts else None

    out: dict[str, Any] = {"submit_s": round(submit_s, 3)}
    for key, et in (("requested", events.ANSWER_REQUESTED), ("answered", events.ANSWER_GENERATED),
                    ("parsed", events.TEMPLATE_PARSED), ("finalized", events.RESULT_FINALIZED)):
        out[key] = span(et)
    if latency_ms > 0:
        lat = latency_ms / 1000
        out["ideal_s"] = round(n * 2 * lat / concurrency + lat, 3)
    return out


def slot_occupancy(drawn: Sequence[tuple[str, float, str, float]], t0: float, arrivals: Sequence[float],
                   concurrency: int) -> dict[str, float] | None:
    """The share of the C model slots busy with a call (the simulator's arrivals and drawn
    latencies; a hedge's copy holds a slot too) in each part of the run: the fill (submit to the
    10th percentile of results), the steady state (10th to 90th), the drain (90th to the last
    result) and the whole run. Where whole-run throughput goes short of C/(2L): slots left idle."""
    n = len(arrivals)
    if not drawn or n < 10 or concurrency <= 0:
        return None
    lo, hi = arrivals[n // 10], arrivals[n - 1 - n // 10]
    parts = {"fill": (t0, lo), "steady": (lo, hi), "drain": (hi, arrivals[-1]), "whole": (t0, arrivals[-1])}
    out: dict[str, float] = {}
    for name, (a, b) in parts.items():
        if b <= a:
            continue
        busy = sum(max(0.0, min(b, at + ms / 1000) - max(a, at)) for _, ms, _, at in drawn)
        out[name] = round(busy / (concurrency * (b - a)), 3)
    return out


def timeline_line(tl: dict[str, Any]) -> str:
    parts = [f"submit {tl['submit_s']} s"]
    for key in ("requested", "answered", "parsed", "finalized"):
        if tl.get(key):
            first, last = tl[key]
            parts.append(f"{key} {first}..{last}")
    parts.append(f"last result seen by the client {tl.get('last_arrival_s')}, collect returned {tl.get('collected_s')}, "
                 f"all rows queryable {tl.get('queryable_s')}")
    if tl.get("ideal_s"):
        parts.append(f"ideal whole run N*2L/C+L {tl['ideal_s']} s")
    return "  timeline (s from the start of submit, first..last event): " + ", ".join(parts)


async def _ceiling(url: str, concurrency: int, latency_ms: float, seconds: float, skip_s: float) -> float:
    calls_per_model = max(1, concurrency // 2)
    done: list[float] = []
    # local import: aiohttp is heavy and only this calibration needs an async HTTP client
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async def caller(model: str, i: int) -> None:
            body = {"model": model, "messages": [{"role": "user", "content": f"Calibration call {i}: what is 1 plus 1?"}]}
            while True:
                async with session.post(url + "/chat/completions", json=body) as resp:
                    await resp.read()
                done.append(time.perf_counter())

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(caller(m, i)) for m in ("bench-answerer", "bench-judge")
                 for i in range(calls_per_model)]
        await asyncio.sleep(skip_s + seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    in_window = sum(1 for t in done if t0 + skip_s <= t < t0 + skip_s + seconds)
    # calls/s over the window, as results/s (two calls a result) over the bound C/(2L)
    return round(in_window / seconds / 2 / (concurrency / (2 * latency_ms / 1000)), 3)


def simulator_ceiling(url: str, concurrency: int, latency_ms: float, seconds: float = 4.0,
                      skip_s: float = 1.0) -> float | None:
    """The fraction of C/(2L) the simulator itself allows right now: C/2 minimal callers per model
    calling back to back (no veribus), completions counted over `seconds` after `skip_s`. On a
    shared machine the simulator's and the client's event loops wait for a core too, so this
    ceiling moves with the load: veribus's figure over it is what veribus itself costs."""
    if latency_ms <= 0:
        return None
    return asyncio.run(_ceiling(url, concurrency, latency_ms, seconds, skip_s))


def simulator_delays(url: str, since: int = 0) -> list[tuple[str, float, str, float]]:
    """The latencies (kind, ms, request key, arrival on the monotonic clock in s) the simulator
    drew per call, in call order, after the first `since`."""
    resp = httpx.get(url.removesuffix("/v1") + "/simulator/delays", params={"since": since}, timeout=30)
    resp.raise_for_status()
    return [(str(kind), float(ms), str(key), float(at)) for kind, ms, key, at in resp.json()]


def steady_rate(arrivals: list[float]) -> float | None:
    """Results/s between the 10th and the 90th percentile of arrivals: the pipeline's throughput
    without its fill (the first result waits for every stage's latency) and drain."""
    n = len(arrivals)
    lo, hi = n // 10, n - 1 - n // 10
    if n < 10 or arrivals[hi] <= arrivals[lo]:
        return None
    return round((hi - lo) / (arrivals[hi] - arrivals[lo]), 1)
