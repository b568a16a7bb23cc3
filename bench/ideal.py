"""What a pipeline with no overhead at all would reach on the bench's workload, so the whole-run
fraction of C/(2L) can be read against what the latency distribution itself allows.

C/(2L) assumes every one of the C/2 slots of each model is busy from the first moment to the
last. A real run cannot be: the parse model has nothing to do until the first answers come back
(the fill), and at the end the run waits for the slowest of the last calls (the drain). With a
lognormal latency the drain is the maximum of many draws: on 1,000 questions one call of a few
times the mean is expected, and the whole run waits for it however fast veribus is.

`hedged_fraction` is the same pipeline with veribus's opt-in hedged requests
(`shared.runtime.llm.hedge`): what hedging can win back of the drain at best.

`zero_overhead_fraction` simulates exactly that pipeline: N answer calls on C/2 slots in question
order, each answer's parse call queued on the judge's C/2 slots the moment the answer exists, no
time spent anywhere but in the calls; the makespan's results/s over C/(2L), averaged over trials.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections import deque
from typing import Any


def _draws(rng: random.Random, n: int, latency_s: float, dist: str, sigma: float) -> list[float]:
    if dist == "fixed":
        return [latency_s] * n
    if dist == "uniform":
        return [2 * latency_s * rng.random() for _ in range(n)]
    median = lognormal_quantile(latency_s, sigma, 0.5)  # the bench's lognormal has mean `latency_s`
    return [median * math.exp(sigma * rng.gauss(0.0, 1.0)) for _ in range(n)]


def lognormal_quantile(mean: float, sigma: float, q: float) -> float:
    """The `q` quantile of the bench's lognormal latency with mean `mean` (in its unit); q = 0.5
    is the median the simulator is given."""
    return mean * math.exp(-sigma * sigma / 2 + sigma * statistics.NormalDist().inv_cdf(q))


def _finish_times(ready: list[float], durations: list[float], slots: int) -> list[float]:
    """FIFO by ready time on `slots` servers: when each job ends."""
    free = [0.0] * slots
    ends = [0.0] * len(ready)
    for i in sorted(range(len(ready)), key=ready.__getitem__):
        start = max(ready[i], heapq.heappop(free))
        ends[i] = start + durations[i]
        heapq.heappush(free, ends[i])
    return ends


def makespan(n: int, latency_s: float, concurrency: int, dist: str, sigma: float, rng: random.Random) -> float:
    """Seconds until the last of `n` results, each an answer call then a parse call."""
    slots = max(1, concurrency // 2)
    answered = _finish_times([0.0] * n, _draws(rng, n, latency_s, dist, sigma), slots)
    return max(_finish_times(answered, _draws(rng, n, latency_s, dist, sigma), slots))


def zero_overhead_fraction(n: int, latency_ms: float, concurrency: int, dist: str = "lognormal",
                           sigma: float = 0.5, trials: int = 30, seed: int = 0) -> float | None:
    """The whole-run fraction of C/(2L) a pipeline without overhead reaches (mean over `trials`)."""
    if latency_ms <= 0 or n <= 0:
        return None
    lat = latency_ms / 1000
    bound = concurrency / (2 * lat)
    rng = random.Random(seed)
    fractions = [n / makespan(n, lat, concurrency, dist, sigma, rng) / bound for _ in range(max(1, trials))]
    return round(sum(fractions) / len(fractions), 3)


def replay_fraction(answer_s: list[float], judge_s: list[float], concurrency: int, latency_ms: float) -> float | None:
    """The whole-run fraction of C/(2L) a pipeline without overhead reaches on one run's own
    latencies (the simulator's draws, in call order: answer i's parse is the i-th judge call)."""
    n = min(len(answer_s), len(judge_s))
    if latency_ms <= 0 or n == 0:
        return None
    slots = max(1, concurrency // 2)
    answered = _finish_times([0.0] * n, answer_s[:n], slots)
    span = max(_finish_times(answered, judge_s[:n], slots))
    return round(n / span / (concurrency / (2 * latency_ms / 1000)), 3) if span > 0 else None


def hedged_makespan(n: int, latency_s: float, concurrency: int, hedge_s: float, rng: random.Random,
                    sigma: float = 0.5, idle_s: float = 0.1, poll_s: float = 0.05) -> tuple[float, int]:
    """`makespan` (lognormal) with hedging as `LLMClient` does it: a call unanswered after
    `hedge_s` gets one second copy (a fresh draw) once its model has a free slot that has been idle
    for `idle_s` with nothing waiting (`call_limits.IDLE_FOR_HEDGE_S`), looked at every `poll_s`;
    the first copy to end answers, and the other keeps its slot until it ends. Returns (seconds
    until the last result, copies sent)."""
    slots = max(1, concurrency // 2)
    free = {"answer": slots, "judge": slots}
    full_at = {"answer": 0.0, "judge": 0.0}  # when the model's slots were last all taken or wanted
    queue: dict[str, deque[int]] = {"answer": deque(range(n)), "judge": deque()}
    calls: dict[int, list[Any]] = {}  # call -> [model, question, answered, hedged]
    timeline: list[tuple[float, int, str, int]] = []
    seq = itertools.count()

    def draw() -> float:
        return _draws(rng, 1, latency_s, "lognormal", sigma)[0]

    def dispatch(model: str, t: float) -> None:
        while queue[model] and free[model] > 0:
            call = next(seq)
            calls[call] = [model, queue[model].popleft(), False, False]
            free[model] -= 1
            heapq.heappush(timeline, (t + draw(), next(seq), "end", call))
            heapq.heappush(timeline, (t + hedge_s, next(seq), "hedge", call))
        if queue[model] or not free[model]:
            full_at[model] = t

    dispatch("answer", 0.0)
    done = copies = 0
    t = 0.0
    while done < n:
        t, _, kind, call = heapq.heappop(timeline)
        model, question, answered, hedged = calls[call]
        if kind == "end":  # a copy ended: its slot is free; the first copy to end answers
            free[model] += 1
            if not answered:
                calls[call][2] = True
                if model == "answer":
                    queue["judge"].append(question)
                    dispatch("judge", t)
                else:
                    done += 1
            dispatch(model, t)
        elif not answered and not hedged:
            if free[model] and not queue[model] and t - full_at[model] >= idle_s:
                free[model] -= 1
                copies += 1
                calls[call][3] = True
                heapq.heappush(timeline, (t + draw(), next(seq), "end", call))
            else:
                heapq.heappush(timeline, (t + poll_s, next(seq), "hedge", call))
    return t, copies


def hedged_fraction(n: int, latency_ms: float, concurrency: int, hedge_after_ms: float, sigma: float = 0.5,
                    trials: int = 30, seed: int = 0) -> tuple[float, float] | None:
    """The whole-run fraction of C/(2L) a pipeline without overhead reaches hedged after
    `hedge_after_ms` (lognormal latency with mean `latency_ms`), and the copies it sends as a
    share of the calls; means over `trials`."""
    if latency_ms <= 0 or n <= 0:
        return None
    lat = latency_ms / 1000
    bound = concurrency / (2 * lat)
    rng = random.Random(seed)
    runs = [hedged_makespan(n, lat, concurrency, hedge_after_ms / 1000, rng, sigma) for _ in range(max(1, trials))]
    return (round(sum(n / span / bound for span, _ in runs) / len(runs), 3),
            round(sum(c for _, c in runs) / len(runs) / (2 * n), 4))
