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
from collections.abc import Sequence
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


def replay_fraction(answer_s: list[float], judge_s: list[float], concurrency: int, latency_ms: float,
                    shared: bool = False) -> float | None:
    """The whole-run fraction of C/(2L) a pipeline without overhead reaches on one run's own
    latencies (the simulator's draws, in call order: answer i's parse is the i-th judge call);
    `shared`: one limit of C for both models (`hedged_makespan`'s sharing), unhedged."""
    n = min(len(answer_s), len(judge_s))
    if latency_ms <= 0 or n == 0:
        return None
    if shared:
        span, _ = hedged_makespan(n, latency_ms / 1000, concurrency, None, random.Random(0), shared=True,
                                  drawn=(answer_s[:n], judge_s[:n]))
    else:
        slots = max(1, concurrency // 2)
        answered = _finish_times([0.0] * n, answer_s[:n], slots)
        span = max(_finish_times(answered, judge_s[:n], slots))
    return round(n / span / (concurrency / (2 * latency_ms / 1000)), 3) if span > 0 else None


def hedged_makespan(n: int, latency_s: float, concurrency: int, hedge_s: float | None, rng: random.Random,
                    sigma: float = 0.5, idle_s: float = 0.1, poll_s: float = 0.05, *, shared: bool = False,
                    drawn: tuple[list[float], list[float]] | None = None) -> tuple[float, int]:
    """`makespan` (lognormal) with hedging as `LLMClient` does it: a call unanswered after
    `hedge_s` (None: never) gets one second copy (a fresh draw) once its limit has a free slot
    that has been idle for `idle_s` with nothing waiting (`call_limits.IDLE_FOR_HEDGE_S`), looked
    at every `poll_s`; the first copy to end answers, and the other keeps its slot until it ends.
    `shared`: one limit of C for both models (`limit_scope: endpoint`) instead of C/2 each,
    shared much as the ledger shares it: while both models have calls waiting each gets up to
    C/2, otherwise one may use more (here a free slot goes to the other model at once, where a
    process keeps an idle one for the limiter's `linger_s`: a ceiling, not a replica). `drawn`:
    the answer and the parse calls' latencies in call order (a run's own draws, replayed); copies
    still draw afresh. Returns (seconds until the last result, copies sent)."""
    limit = {"answer": "endpoint", "judge": "endpoint"} if shared else {"answer": "answer", "judge": "judge"}
    free = {"endpoint": max(1, concurrency)} if shared else {"answer": max(1, concurrency // 2),
                                                           "judge": max(1, concurrency // 2)}
    share = max(1, concurrency // 2)
    full_at = dict.fromkeys(free, 0.0)  # when the limit's slots were last all taken or wanted
    queue: dict[str, deque[int]] = {"answer": deque(range(n)), "judge": deque()}
    running = {"answer": 0, "judge": 0}  # first copies in flight
    given = {"answer": iter(drawn[0]), "judge": iter(drawn[1])} if drawn else None
    calls: dict[int, list[Any]] = {}  # call -> [model, question, answered, hedged]
    timeline: list[tuple[float, int, str, int]] = []
    seq = itertools.count()

    def draw(model: str | None = None) -> float:
        if given is not None and model is not None:
            return next(given[model])
        return _draws(rng, 1, latency_s, "lognormal", sigma)[0]

    def waiting(lim: str) -> bool:
        return any(queue[m] for m in queue if limit[m] == lim)

    def next_model(lim: str) -> str | None:
        """Whose call takes a free slot of `lim`: the parse model's first (a result ends
        sooner), each within its share while the other also waits."""
        wants = [m for m in ("judge", "answer") if limit[m] == lim and queue[m]]
        if len(wants) < 2:
            return wants[0] if wants else None
        return next((m for m in wants if running[m] < share), None)

    def dispatch(lim: str, t: float) -> None:
        while free[lim] > 0:
            model = next_model(lim)
            if model is None:
                break
            call = next(seq)
            calls[call] = [model, queue[model].popleft(), False, False]
            free[lim] -= 1
            running[model] += 1
            heapq.heappush(timeline, (t + draw(model), next(seq), "end", call))
            if hedge_s is not None:
                heapq.heappush(timeline, (t + hedge_s, next(seq), "hedge", call))
        if waiting(lim) or not free[lim]:
            full_at[lim] = t

    dispatch(limit["answer"], 0.0)
    done = copies = 0
    t = 0.0
    while done < n:
        t, _, kind, call = heapq.heappop(timeline)
        model, question, answered, hedged = calls[call]
        lim = limit[model]
        if kind == "end":  # a copy ended: its slot is free; the first copy to end answers
            free[lim] += 1
            if not answered:
                calls[call][2] = True
                running[model] -= 1
                if model == "answer":
                    queue["judge"].append(question)
                else:
                    done += 1
            for each in dict.fromkeys((limit["judge"], lim)):
                dispatch(each, t)
        elif not answered and not hedged:
            if free[lim] and not waiting(lim) and t - full_at[lim] >= idle_s:
                free[lim] -= 1
                copies += 1
                calls[call][3] = True
                heapq.heappush(timeline, (t + draw(), next(seq), "end", call))
            else:
                heapq.heappush(timeline, (t + poll_s, next(seq), "hedge", call))
    return t, copies


def hedged_replay_fraction(answer_s: list[float], judge_s: list[float], concurrency: int, latency_ms: float,
                           hedge_after_ms: float, sigma: float = 0.5, trials: int = 30, seed: int = 0,
                           shared: bool = False) -> float | None:
    """`hedged_fraction` on one hedged run's own draws: its first copies' latencies (in call
    order, as `replay_fraction` takes them) replayed, each copy drawn afresh as the simulator
    draws a repeated request; the mean over `trials` sets of copies' draws."""
    n = min(len(answer_s), len(judge_s))
    if latency_ms <= 0 or n == 0:
        return None
    lat = latency_ms / 1000
    rng = random.Random(seed)
    spans = [hedged_makespan(n, lat, concurrency, hedge_after_ms / 1000, rng, sigma, shared=shared,
                             drawn=(answer_s[:n], judge_s[:n]))[0] for _ in range(max(1, trials))]
    bound = concurrency / (2 * lat)
    return round(sum(n / span / bound for span in spans) / len(spans), 3)


def first_copies(drawn: Sequence[tuple[Any, ...]]) -> tuple[list[float], list[float], int]:
    """A run's draws from /simulator/delays as (answer, judge) first copies' latencies in
    seconds, in call order, and how many calls repeated a request already drawn for (a hedge's
    copy, a retry)."""
    seen: set[str] = set()
    firsts: dict[str, list[float]] = {"answer": [], "judge": []}
    repeats = 0
    for kind, ms, key, *_ in drawn:
        if key in seen:
            repeats += 1
            continue
        seen.add(key)
        firsts.setdefault(kind, []).append(ms / 1000)
    return firsts["answer"], firsts["judge"], repeats


def hedged_fraction(n: int, latency_ms: float, concurrency: int, hedge_after_ms: float | None, sigma: float = 0.5,
                    trials: int = 30, seed: int = 0, shared: bool = False) -> tuple[float, float] | None:
    """The whole-run fraction of C/(2L) a pipeline without overhead reaches hedged after
    `hedge_after_ms` (None: unhedged; lognormal latency with mean `latency_ms`; `shared`: one
    limit of C for both models), and the copies it sends as a share of the calls; means over
    `trials`."""
    if latency_ms <= 0 or n <= 0:
        return None
    lat = latency_ms / 1000
    bound = concurrency / (2 * lat)
    rng = random.Random(seed)
    after = hedge_after_ms / 1000 if hedge_after_ms is not None else None
    runs = [hedged_makespan(n, lat, concurrency, after, rng, sigma, shared=shared) for _ in range(max(1, trials))]
    return (round(sum(n / span / bound for span, _ in runs) / len(runs), 3),
            round(sum(c for _, c in runs) / len(runs) / (2 * n), 4))
