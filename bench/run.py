"""`veribus bench`: a generated benchmark through the real multi-process stack against the
simulator. Reports results/s, CPU ms per result per service, and peak RSS per service, at
each requested model latency, and where the run's time went (`timeline`). Figures, not
assertions: the machine is shared and noisy.

The defaults are issue 12's workload: 1,000 generated questions, template-only verification,
64 model calls in flight, latency 0 and 300 ms, lognormal. A lognormal latency of `L` ms here
has a *mean* of `L` (the simulator's median is set to `L * exp(-sigma**2 / 2)`), so C/(2L) stays
the bound Little's law gives: with `L` as the median, the mean call takes exp(sigma**2 / 2)
longer (13 % at sigma 0.5) and even a perfect pipeline would stay under 0.89 of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import ideal, rebuild
from bench.targets import figure, met
from bench.timing import (
    event_times,
    simulator_ceiling,
    simulator_delays,
    slot_occupancy,
    steady_rate,
    timeline,
    timeline_line,
)
from bench.workload import generated_benchmark
from shared.control import processes, runner, stack, wait
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, Settings, VerificationConfig
from shared.runtime import bus


class Sampler(threading.Thread):
    """Polls RSS of the stack's processes to find each one's peak."""

    def __init__(self, procs: list[processes.Proc]) -> None:
        super().__init__(daemon=True)
        self.procs = {p.name: psutil.Process(p.pid) for p in procs if p.alive()}
        self.peak: dict[str, float] = dict.fromkeys(self.procs, 0.0)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for name, p in self.procs.items():
                try:
                    self.peak[name] = max(self.peak[name], p.memory_info().rss / 2**20)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.1)


def cpu_seconds(procs: list[processes.Proc]) -> dict[str, float]:
    """CPU seconds per stack process, and as `<name>:sandbox` that of its sandbox workers (the
    jails and their zygotes, with the call processes they have reaped)."""
    out = {}
    for p in procs:
        try:
            proc = psutil.Process(p.pid)
            t = proc.cpu_times()
            out[p.name] = t.user + t.system
            jail = 0.0
            for child in proc.children(recursive=True):
                try:
                    c = child.cpu_times()
                    jail += c.user + c.system + c.children_user + c.children_system
                except psutil.Error:
                    continue
            if jail:
                out[f"{p.name}:sandbox"] = jail
        except psutil.NoSuchProcess:
            out[p.name] = 0.0
    return out


async def stream_bytes(settings: Settings) -> int:
    """Bytes the event stream holds now (its growth over a run / results = the log's cost)."""
    async with bus.session(settings) as nc:
        return int((await nc.jetstream().stream_info(events.STREAM)).state.bytes or 0)


LATENCY_DISTS = ("fixed", "lognormal")


def simulator_latency(latency_ms: float, dist: str = "lognormal", sigma: float = 0.5) -> list[str]:
    """The simulator's latency arguments for calls that take `latency_ms` on average: a lognormal's
    median is set below the mean (`latency_ms * exp(-sigma**2 / 2)`), so C/(2L) is the real bound."""
    if latency_ms <= 0 or dist == "fixed":
        return ["--latency-ms", f"{latency_ms:g}"]
    median = ideal.lognormal_quantile(latency_ms, sigma, 0.5)
    return ["--latency-ms", f"{median:.3f}", "--latency-dist", dist, "--latency-sigma", f"{sigma:g}"]


def latency_label(latency_ms: float, latency_dist: str = "lognormal", latency_sigma: float = 0.5) -> str:
    if latency_ms <= 0 or latency_dist == "fixed":
        return f"latency {latency_ms:g} ms"
    return f"latency {latency_ms:g} ms {latency_dist} (mean; sigma {latency_sigma:g})"


async def quiesce(settings: Settings, timeout: float = 60.0, settle_s: float = 0.3) -> bool:
    """Wait until every durable consumer of the stream (the stages and the projector) has nothing
    pending and nothing unacknowledged, twice in a row `settle_s` apart: the warm-up's events are
    then handled and projected, so none of its work (or CPU) falls into the measured run.
    Returns False when `timeout` ran out first (the run is measured anyway)."""
    deadline = time.monotonic() + timeout
    calm = 0
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        while time.monotonic() < deadline:
            infos = [c for c in await js.consumers_info(events.STREAM) if c.config.durable_name]
            busy = sum(int(c.num_pending or 0) + int(c.num_ack_pending or 0) for c in infos)
            calm = calm + 1 if busy == 0 else 0
            if calm >= 2:
                return True
            await asyncio.sleep(settle_s)
    return False


def run_once(n: int, latency_ms: float, concurrency: int, replicas: dict[str, int],
             api_base: str | None = None, model: str | None = None, judge: str | None = None, *,
             extra_env: dict[str, str] | None = None, model_limit: int | None = None,
             latency_dist: str = "lognormal", latency_sigma: float = 0.5,
             hedge_after_ms: float | str | None = None, limit_scope: str = "model", seed: int = 0) -> dict[str, Any]:
    """One measured run. With `api_base`, against that OpenAI-compatible server (no simulator;
    its latency is whatever it is, `latency_ms` is only a label). `extra_env` goes to every
    process of the stack; `model_limit` replaces each model's `max_concurrency` (C/2);
    `hedge_after_ms` sets both models' `hedge_after_s` (shared.runtime.llm.hedge; "auto" too); `limit_scope`
    "endpoint" gives both models one limit of C on their common endpoint instead of C/2 each."""
    with tempfile.TemporaryDirectory(prefix="veribus-bench-") as tmp:
        home = Path(tmp)
        settings = Settings(home=home / "home")
        bench_file, script = generated_benchmark(home / "bench.yaml", n, prefix="Bench", ids="bench-{i}")
        benchmark = Benchmark.load(bench_file)
        state = stack.up(settings, replicas=replicas, simulator=api_base is None,
                         simulator_args=[*simulator_latency(latency_ms, latency_dist, latency_sigma), "--seed", str(seed)],
                         extra_env=extra_env)
        settings.nats_url = state.nats_url
        try:
            ceiling = None
            if api_base is None:
                ceiling = simulator_ceiling(state.simulator_url, concurrency, latency_ms)
                httpx.post(state.simulator_url.removesuffix("/v1") + "/simulator/script", json=script, timeout=10)
            # C is the total number of model calls in flight: each result makes two sequential
            # calls (answer, then parse) in two services, so each model gets C/2.
            shared_limit = limit_scope == "endpoint"
            models = {"api_base": api_base or state.simulator_url, "limit_scope": limit_scope,
                      "max_concurrency": model_limit or (concurrency if shared_limit else max(1, concurrency // 2)),
                      "hedge_after_s": (hedge_after_ms if hedge_after_ms == "auto"
                                        else hedge_after_ms / 1000 if hedge_after_ms else None)}
            config = VerificationConfig(
                answering_models=[ModelConfig(model_name=model or "openai/bench-answerer", **models)],
                parsing_models=[ModelConfig(model_name=judge or "openai/bench-judge", **models)],
            )
            # warm-up: a few jobs so imports and template compilation are not in the measurement,
            # then wait until every consumer (the projector too) is done with them
            warm = runner.plan_run(Benchmark.load(bench_file), config, run_id="warmup")
            warm.requests = warm.requests[:4]
            asyncio.run(runner.submit(settings, warm))
            asyncio.run(runner.collect(settings, "warmup", set(warm.result_ids), timeout=120))
            quiet = asyncio.run(quiesce(settings))

            plan = runner.plan_run(benchmark, config)
            delays0 = len(simulator_delays(state.simulator_url)) if api_base is None else 0
            bytes0 = asyncio.run(stream_bytes(settings))
            sampler = Sampler(state.procs)
            sampler.start()
            cpu0 = cpu_seconds(state.procs)
            arrivals: list[float] = []
            wall0 = time.time()
            t0 = time.perf_counter()
            asyncio.run(runner.submit(settings, plan))
            submit_s = time.perf_counter() - t0
            outcome = asyncio.run(runner.collect(settings, plan.run_id, set(plan.result_ids), timeout=1800,
                                                 on_result=lambda _: arrivals.append(time.perf_counter())))
            elapsed = time.perf_counter() - t0
            # what `veribus run` waits for after the last result: its rows queryable in the store
            projected = wait.wait_projected(settings, plan.run_id, len(outcome.results), timeout=60.0)
            projected_s = time.perf_counter() - t0
            # let the projector finish this run's rows before reading its CPU
            asyncio.run(quiesce(settings, timeout=30.0))
            cpu1 = cpu_seconds(state.procs)
            sampler.stop.set()
            done = len(outcome.results)
            stream_delta = asyncio.run(stream_bytes(settings)) - bytes0
            tl = timeline(asyncio.run(event_times(settings, plan.run_id)), wall0, submit_s, n, latency_ms,
                          concurrency)
            tl["last_arrival_s"] = round(arrivals[-1] - t0, 3) if arrivals else None
            tl["collected_s"] = round(elapsed, 3)
            tl["queryable_s"] = round(projected_s, 3) if projected else None
            per_service = {name: round(1000 * max(0.0, cpu1[name] - cpu0.get(name, 0.0)) / max(done, 1), 3)
                           for name in cpu1}
            pipeline_cpu = sum(v for k, v in per_service.items() if k not in ("nats", "simulator"))
            bound = concurrency / (2 * latency_ms / 1000) if latency_ms > 0 else None
            possible = None
            hedges = sum(int(((r.metadata.retry_counts or {}).get("hedge") or {}).get("used", 0))
                         for r in outcome.results.values())
            # the run's own draws replayed, the slots shared as the run shared them; hedged, its
            # first copies' draws with each copy drawn afresh (the mean over sets of copies' draws)
            hedged_possible = occupancy = None
            if api_base is None and bound:
                drawn = simulator_delays(state.simulator_url, since=delays0)
                occupancy = slot_occupancy(drawn, t0, arrivals, concurrency)
                answers, judges, _repeats = ideal.first_copies(drawn)
                if not hedge_after_ms:
                    possible = ideal.replay_fraction(answers, judges, concurrency, latency_ms, shared=shared_limit)
                elif latency_dist == "lognormal":
                    after_ms = (ideal.lognormal_quantile(latency_ms, latency_sigma, 0.95) if hedge_after_ms == "auto"
                                else float(hedge_after_ms))  # auto: the model's 95th percentile, once it has one
                    hedged_possible = ideal.hedged_replay_fraction(answers, judges, concurrency, latency_ms, after_ms,
                                                                   latency_sigma, trials=30, shared=shared_limit)
            rate = done / elapsed if elapsed else 0.0
            steady = steady_rate(arrivals)
            return {
                "questions": n, "latency_ms": latency_ms, "concurrency": concurrency, "results": done,
                "latency_dist": latency_dist if latency_ms > 0 and api_base is None else None,
                "latency_sigma": latency_sigma if latency_ms > 0 and latency_dist != "fixed" else None,
                "elapsed_s": round(elapsed, 3), "results_per_s": round(rate, 1),
                "bound_results_per_s": round(bound, 1) if bound else None,
                "fraction_of_bound": round(rate / bound, 3) if bound else None,
                "steady_fraction_of_bound": round(steady / bound, 3) if bound and steady else None,
                "simulator_ceiling_fraction": ceiling,
                "zero_overhead_fraction": possible,
                "hedged_zero_overhead_fraction": hedged_possible,
                "slot_occupancy": occupancy,
                "queryable_results_per_s": round(done / projected_s, 1) if projected and projected_s else None,
                "queryable_fraction_of_bound": (round(done / projected_s / bound, 3)
                                                if bound and projected and projected_s else None),
                "cpu_ms_per_result": per_service,
                "cpu_ms_per_result_services_total": round(pipeline_cpu, 3),
                "peak_rss_mb": {k: round(v, 1) for k, v in sampler.peak.items()},
                "passed": sum(1 for r in outcome.results.values() if r.template and r.template.verify_result),
                "stream_bytes_per_result": round(stream_delta / max(done, 1)),
                "steady_results_per_s": steady,
                "hedge_after_ms": hedge_after_ms or None,
                "limit_scope": limit_scope,
                "hedged_calls": hedges,
                "replicas": dict(replicas),
                "warmup_settled": quiet,
                "timeline": tl,
            }
        finally:
            stack.down(settings)


SCALED = ("generation", "parsing")
"""The bottleneck at model latency: the two stages that wait on the model (each result makes one
call in each). Profiled at zero latency every stage is CPU-bound on the same two cores, so a
replica there adds no capacity; at latency a replica adds its own worker slots."""


def _dist(args: argparse.Namespace) -> dict[str, Any]:
    return {"latency_dist": getattr(args, "latency_dist", "lognormal"),
            "latency_sigma": getattr(args, "latency_sigma", 0.5)}


def _model_options(args: argparse.Namespace) -> dict[str, Any]:
    """`--hedge-after-ms` and `--limit-scope`, as `run_once` takes them."""
    return {"hedge_after_ms": getattr(args, "hedge_after_ms", None) or None,
            "limit_scope": getattr(args, "limit_scope", None) or "model"}


def scaling(args: argparse.Namespace) -> dict[str, Any]:
    """The same workload with one and then two replicas of the bottleneck stages, each replica
    capped at `--scaling-workers` handlers, and a deployment-wide model limit (`max_concurrency`)
    four times that, so the model never caps it: the ratio is what a second replica buys."""
    lat = next((x for x in args.latency_ms if x > 0), 300.0)
    workers = args.scaling_workers
    questions = getattr(args, "scaling_questions", None) or args.questions
    env = {f"VERIBUS_{name.upper()}_WORKERS": str(workers) for name in SCALED}
    rows = []
    for n in (1, 2):
        row = run_once(questions, lat, args.concurrency, dict.fromkeys(SCALED, n),
                       extra_env=env, model_limit=4 * workers, **_dist(args))
        rows.append(row)
        print(f"\n== scaling: {n} replica(s) of {' and '.join(SCALED)}, {workers} workers each, "
              f"{latency_label(lat, **_dist(args))}, model limit {4 * workers}, {row['results']} results")
        print(f"  throughput: {row['results_per_s']} results/s in {row['elapsed_s']} s, steady state "
              f"{row['steady_results_per_s']} results/s (stage bound n*workers/L = {n * workers / (lat / 1000):.1f}/s); "
              f"CPU ms/result, services: {row['cpu_ms_per_result_services_total']}")
    one, two = rows

    def ratio(key: str) -> float | None:
        return round(two[key] / one[key], 3) if one.get(key) and two.get(key) else None

    return {"latency_ms": lat, **_dist(args), "workers_per_replica": workers, "model_limit": 4 * workers,
            "stages": list(SCALED), "one": one, "two": two, "ratio": ratio("steady_results_per_s"),
            "ratio_whole_run": ratio("results_per_s")}


def hedge_label(hedge_after_ms: float | str) -> str:
    return "its model's 95th percentile (auto)" if hedge_after_ms == "auto" else f"{hedge_after_ms:g} ms"


def positive_int(text: str) -> int:
    """`--seeds`: a whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0, not {text}")
    return value


def hedge_after_arg(text: str) -> float | str:
    """`--hedge-after-ms`: milliseconds, or "auto"."""
    if text == "auto":
        return text
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--hedge-after-ms must be above 0 or 'auto', not {text}")
    return value


def print_run(row: dict[str, Any], where: str, concurrency: int) -> None:
    """One run's figures, as it ends."""
    shared_limit = " (one limit shared by both models on their endpoint)" if row.get("limit_scope") == "endpoint" else ""
    print(f"\n== {where}, {row['results']} results, concurrency {concurrency}{shared_limit}")
    print(f"  throughput, whole run: {row['results_per_s']} results/s in {row['elapsed_s']} s"
          + (f"  (bound C/(2L) = {row['bound_results_per_s']}/s, {100 * row['fraction_of_bound']:.1f}% of it)"
             if row["bound_results_per_s"] else ""))
    print(f"  steady state (10th to 90th percentile of results): {row['steady_results_per_s']} results/s"
          + (f", {100 * row['steady_fraction_of_bound']:.1f}% of the bound" if row["steady_fraction_of_bound"] else ""))
    if row.get("zero_overhead_fraction"):
        z = row["zero_overhead_fraction"]
        print(f"  a pipeline without overhead, on this run's own drawn latencies, reaches {z} of C/(2L) "
              f"(its fill and the slowest last calls): veribus reached {row['fraction_of_bound'] / z:.3f} of that")
    if row.get("hedged_zero_overhead_fraction"):
        h = row["hedged_zero_overhead_fraction"]
        print(f"  a pipeline without overhead, hedged the same way, reaches {h} of C/(2L) on this run's own first "
              f"copies' draws (each copy drawn afresh, mean of 30): veribus reached {row['fraction_of_bound'] / h:.3f} of that")
    if row.get("simulator_ceiling_fraction"):
        c = row["simulator_ceiling_fraction"]
        print(f"  the simulator itself allows {c} of C/(2L) now (minimal callers, no veribus): whole run "
              f"{row['fraction_of_bound'] / c:.3f} of that, steady {(row['steady_fraction_of_bound'] or 0) / c:.3f}")
    if row.get("hedge_after_ms"):
        print(f"  hedged requests: a second copy of a call unanswered after {hedge_label(row['hedge_after_ms'])}, on a "
              f"free slot; {row['hedged_calls']} copies sent ({row['hedged_calls'] / max(1, 2 * row['results']):.1%}"
              " of the calls), each counted in cost as the reply it raced")
    if row.get("slot_occupancy"):
        occ = row["slot_occupancy"]
        print("  model slots busy (share of C, from the simulator's calls): "
              + ", ".join(f"{k} {occ[k]:.1%}" for k in ("fill", "steady", "drain", "whole") if k in occ))
    print(timeline_line(row["timeline"]))
    print(f"  CPU ms per result, services total: {row['cpu_ms_per_result_services_total']}")
    print(f"  event stream: {row['stream_bytes_per_result']} bytes per result (target <= 6144)")
    for name, ms in row["cpu_ms_per_result"].items():
        print(f"    {name:<14} {ms:>8.3f} ms/result   peak RSS {row['peak_rss_mb'].get(name, 0):>7.1f} MB")


def _replicas(args: argparse.Namespace) -> dict[str, int]:
    """`--replicas SERVICE=N ...` as {service: N}."""
    replicas = {}
    for item in getattr(args, "replicas", None) or []:
        name, _, k = item.partition("=")
        replicas[name] = int(k)
    return replicas


def main_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The main measurement: one run per `--latency-ms` (one run against `--api-base`), each
    printed as it ends."""
    replicas = _replicas(args)
    rows = []
    api_base = getattr(args, "api_base", None)
    for lat in (args.latency_ms if api_base is None else [0.0]):
        rows.append(measured(args, lat, f"server {api_base}" if api_base else latency_label(lat, **_dist(args)),
                             replicas=replicas, api_base=api_base, model=getattr(args, "bench_model", None),
                             judge=getattr(args, "bench_judge", None), **_model_options(args)))
    return rows


ALL_SEEDS = 3
"""`--all`'s simulator seeds for each run at a random latency (`--seeds` sets another number)."""


def seeds_for(args: argparse.Namespace, latency_ms: float) -> int:
    """How many simulator seeds a run at `latency_ms` is measured on: one unless the latency is
    drawn (lognormal) and `--seeds` (or `--all`: `ALL_SEEDS`) asks for more."""
    if latency_ms <= 0 or _dist(args)["latency_dist"] == "fixed" or getattr(args, "api_base", None):
        return 1
    return max(1, getattr(args, "seeds", None) or (ALL_SEEDS if getattr(args, "all", False) else 1))


MEAN_OVER_SEEDS = ("results_per_s", "fraction_of_bound", "steady_results_per_s", "steady_fraction_of_bound",
                   "zero_overhead_fraction", "hedged_zero_overhead_fraction", "simulator_ceiling_fraction",
                   "queryable_results_per_s", "queryable_fraction_of_bound", "cpu_ms_per_result_services_total",
                   "elapsed_s", "hedged_calls", "stream_bytes_per_result")


def mean_of_seeds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of one workload on different simulator seeds as one row: the mean of each figure
    (None unless every run has it), each service's CPU the mean too and its peak RSS the
    largest; `seeds` keeps every run's own whole-run figures. The simulator draws each call's
    latency from its seed and the request, so one seed is one fixed set of draws: on seed 0 the
    1,000-question workload's 980th parse call draws 2.5 s (8 mean latencies, 4.5 sigma: about
    one set of 2,000 draws in 150 has one), and that one call near the end sets the run's length."""
    def mean(values: list[Any]) -> float | None:
        return round(sum(values) / len(values), 3) if values and len(values) == len(rows) else None

    row = {k: v for k, v in rows[0].items() if k not in ("timeline", "seed")}
    for key in MEAN_OVER_SEEDS:
        row[key] = mean([r[key] for r in rows if r.get(key) is not None])
    if row.get("stream_bytes_per_result") is not None:
        row["stream_bytes_per_result"] = round(row["stream_bytes_per_result"])
    if row.get("hedged_calls") is not None:
        row["hedged_calls"] = round(row["hedged_calls"])
    row["passed"] = round(sum(r.get("passed", 0) for r in rows) / len(rows))
    occupancies = [r["slot_occupancy"] for r in rows if r.get("slot_occupancy")]
    row["slot_occupancy"] = ({k: mean([o[k] for o in occupancies if k in o]) for k in occupancies[0]}
                             if len(occupancies) == len(rows) else None)
    row["cpu_ms_per_result"] = {name: mean([r["cpu_ms_per_result"].get(name, 0.0) for r in rows])
                                for name in rows[0]["cpu_ms_per_result"]}
    row["peak_rss_mb"] = {name: max(r["peak_rss_mb"].get(name, 0.0) for r in rows) for name in rows[0]["peak_rss_mb"]}
    row["seeds"] = [{"seed": r.get("seed"), "fraction_of_bound": r.get("fraction_of_bound"),
                     "zero_overhead_fraction": r.get("zero_overhead_fraction"),
                     "hedged_zero_overhead_fraction": r.get("hedged_zero_overhead_fraction"),
                     "steady_fraction_of_bound": r.get("steady_fraction_of_bound"),
                     "elapsed_s": r.get("elapsed_s"), "timeline": r.get("timeline")} for r in rows]
    return row


def measured(args: argparse.Namespace, lat: float, where: str, **kw: Any) -> dict[str, Any]:
    """One workload (`run_once`'s keywords in `kw`) run once, or on `seeds_for` simulator seeds
    (0, 1, ...), each printed as it ends, then their means (`mean_of_seeds`)."""
    seeds = seeds_for(args, lat)
    if seeds == 1:
        row = run_once(args.questions, lat, args.concurrency, **_dist(args), **kw)
        print_run(row, where, args.concurrency)
        return row
    rows = []
    for seed in range(seeds):
        row = run_once(args.questions, lat, args.concurrency, seed=seed, **_dist(args), **kw)
        row["seed"] = seed
        print_run(row, f"{where}, simulator seed {seed}", args.concurrency)
        rows.append(row)
    mean = mean_of_seeds(rows)
    print(f"\n== {where}: mean of {len(rows)} simulator seeds: whole run {mean['fraction_of_bound']} of C/(2L) ("
          + ", ".join(f"seed {r['seed']}: {r['fraction_of_bound']}" for r in mean["seeds"])
          + f"), steady {mean['steady_fraction_of_bound']}"
          + (f", zero-overhead pipeline {mean['zero_overhead_fraction']}" if mean.get("zero_overhead_fraction") else "")
          + (f", hedged zero-overhead pipeline {mean['hedged_zero_overhead_fraction']}"
             if mean.get("hedged_zero_overhead_fraction") else ""))
    return mean


HEDGE_AFTER_LATENCIES = 1.5
"""`--all`'s hedged run: a call is raced after 1.5 mean latencies (450 ms at 300 ms)."""


def hedged_run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--all` on the simulator, unless `--hedge-after-ms` hedged the main runs already: the first
    latency's run again with opt-in hedging (`hedge_after_s`), so the figures show what it buys
    beside the issue's unhedged workload; then hedged with one limit of C for both models on
    their endpoint (`limit_scope: endpoint`, unless `--limit-scope` set it for every run), where
    the idle model's slots serve the other in the fill and the drain: still C calls in flight."""
    lat = next((x for x in args.latency_ms if x > 0), None)
    if lat is None or getattr(args, "api_base", None) or getattr(args, "hedge_after_ms", None):
        return []
    hedge_ms = round(HEDGE_AFTER_LATENCIES * lat)
    scopes = [_model_options(args)["limit_scope"]]
    if scopes[0] != "endpoint":
        scopes.append("endpoint")
    rows = []
    for scope in scopes:
        where = latency_label(lat, **_dist(args)) + f", hedged after {hedge_ms} ms (opt-in)"
        options = {**_model_options(args), "hedge_after_ms": hedge_ms, "limit_scope": scope}
        rows.append(measured(args, lat, where, replicas=_replicas(args), **options))
    return rows


def main(args: argparse.Namespace) -> int:
    """`veribus bench` (the main runs), `--scaling`, or `--all`: the main runs, the hedged run,
    the scaling runs and the rebuild, then one block with every issue-12 figure beside its target."""
    everything = getattr(args, "all", False)
    rows = main_runs(args) if everything or not getattr(args, "scaling", False) else []
    if everything:
        rows += hedged_run(args)
    scaled = scaling(args) if everything or getattr(args, "scaling", False) else None
    rebuilt = None
    if everything:
        rebuilt = rebuild.measure(args.rebuild_events, args.rebuild_runs)
        print(f"\n== projections rebuild: {rebuilt.get('events')} events, fold {rebuilt.get('fold_s')} s, "
              f"whole command {rebuilt.get('rebuild_s')} s")
    print("\n" + targets_block(rows, getattr(args, "api_base", None), scaling=scaled, rebuilt=rebuilt))
    report: Any = {"runs": rows, "scaling": scaled, "rebuild": rebuilt} if everything else (scaled or rows)
    print("\n" + json.dumps(report, indent=2))
    return 0


STEADY = "10th to 90th percentile of results"
WHOLE = "with the pipeline's fill and drain"


def targets_block(rows: list[dict[str, Any]], api_base: str | None = None,
                  scaling: dict[str, Any] | None = None, rebuilt: dict[str, Any] | None = None) -> str:
    """Issue 12's figures beside their targets, the whole run first (what a user waits for), the
    steady state beside it. On a shared machine absolute throughput means little: compare
    ratios measured in one sitting. `scaling`: the result of `--scaling`; `rebuilt`: of
    `bench.rebuild.measure`."""
    lines = ["Issue 12 figures vs targets (" + (f"server {api_base}" if api_base else "simulator")
             + "; on a shared machine compare ratios within one run, not absolute rates):"]
    verdicts: list[tuple[str, bool]] = []  # (figure, under which heading), met
    heading = ""

    def _figure(name: str, value: Any, target: str | None = None, note: str | None = None) -> str:
        ok = met(value, target) if target else None
        if ok is not None:
            verdicts.append((f"{name} ({heading})", ok))
        return figure(name, value, target, note)

    for row in rows:
        lat = row["latency_ms"]
        label = latency_label(lat, row.get("latency_dist") or "fixed", row.get("latency_sigma") or 0.5)
        hedged = (f", hedged after {hedge_label(row['hedge_after_ms'])} ({row.get('hedged_calls', 0)} copies)"
                  if row.get("hedge_after_ms") else "")
        if row.get("limit_scope") == "endpoint":
            hedged += ", one limit of C shared by both models on their endpoint"
        heading = f"your server{hedged}" if api_base else f"{label}{hedged}"
        each = f" on each of {len(row['seeds'])} simulator seeds" if row.get("seeds") else ""
        lines.append(f"  your server{hedged}:" if api_base else f"  {label}, {row.get('results', '?')} results{each}, "
                     f"C = {row.get('concurrency', '?')}{hedged}:")
        queryable = "until `veribus run` returns: the projector wrote every row"
        if lat == 0:
            lines.append(_figure("results/s, whole run", row["results_per_s"], ">= 120"))
            if row.get("steady_results_per_s") is not None:
                lines.append(_figure("results/s, steady", row["steady_results_per_s"], ">= 120", STEADY))
            if row.get("queryable_results_per_s") is not None:
                lines.append(_figure("results/s, rows queryable", row["queryable_results_per_s"], note=queryable))
            lines.append(_figure("CPU ms/result, services", row["cpu_ms_per_result_services_total"], "<= 10"))
        elif row.get("fraction_of_bound") is not None:
            seeds = row.get("seeds") or []
            own = f"the {len(seeds)} runs' own drawn latencies (mean)" if seeds else "this run's own drawn latencies"
            lines.append(_figure("fraction of C/(2L), whole run", row["fraction_of_bound"], ">= 0.90", WHOLE + (
                f"; mean of {len(seeds)} simulator seeds: " + ", ".join(f"{s['fraction_of_bound']}" for s in seeds)
                if seeds else "")))
            if row.get("steady_fraction_of_bound") is not None:
                lines.append(_figure("fraction of C/(2L), steady", row["steady_fraction_of_bound"], ">= 0.90", STEADY))
            if row.get("zero_overhead_fraction"):
                z = row["zero_overhead_fraction"]
                lines.append(_figure("zero-overhead pipeline", z, note=f"{own}, no time "
                                     "outside the calls: the fill and the slowest last calls; veribus reached "
                                     f"{row['fraction_of_bound'] / z:.3f} of it"))
            if row.get("hedged_zero_overhead_fraction"):
                h = row["hedged_zero_overhead_fraction"]
                lines.append(_figure("zero-overhead pipeline, hedged", h, note="the same hedging, no time outside the "
                                     f"calls, on {own.replace('drawn latencies', 'first copies draws')}, each copy drawn afresh (mean of 30: "
                                     f"`bench.ideal.hedged_replay_fraction`); veribus reached {row['fraction_of_bound'] / h:.3f} of it"))
            occ = row.get("slot_occupancy") or {}
            if "whole" in occ:
                lines.append(_figure("model slots busy, whole run", occ["whole"], note="share of C; fill "
                                     f"{occ.get('fill', '-')}, steady {occ.get('steady', '-')}, drain "
                                     f"{occ.get('drain', '-')}: where the run's idle slots are"))
            if row.get("simulator_ceiling_fraction"):
                lines.append(_figure("simulator's own ceiling", row["simulator_ceiling_fraction"],
                                     note="C/2 minimal callers per model, same sitting: the load's share"))
            if row.get("queryable_fraction_of_bound") is not None:
                lines.append(_figure("fraction of C/(2L), queryable", row["queryable_fraction_of_bound"], note=queryable))
        lines.append(_figure("stream bytes per result", row["stream_bytes_per_result"], "<= 6144"))
    if scaling is not None:
        lat_label = latency_label(scaling["latency_ms"], scaling.get("latency_dist") or "fixed",
                                  scaling.get("latency_sigma") or 0.5)
        heading = "replica scaling"
        lines.append(f"  replica scaling ({' and '.join(scaling['stages'])}, {lat_label}, "
                     f"model limit {scaling['model_limit']}):")
        one, two = scaling["one"], scaling["two"]
        lines.append(_figure("2 replicas / 1 replica, steady", scaling["ratio"], ">= 1.8",
                             f"{two['steady_results_per_s']} vs {one['steady_results_per_s']} results/s, "
                             "10th to 90th percentile of results"))
        lines.append(_figure("2 replicas / 1 replica, whole", scaling["ratio_whole_run"],
                             note=f"{two['results_per_s']} vs {one['results_per_s']} results/s, {WHOLE}"))
    if rebuilt is not None:
        heading = "projections rebuild"
        lines.append(f"  projections rebuild ({rebuilt.get('events')} events into a fresh chdb):")
        lines.append(_figure("rebuild events/s, fold", rebuilt.get("fold_events_per_s"), ">= 50,000"))
        lines.append(_figure("rebuild events/s, whole command", rebuilt.get("events_per_s")))
    missing = []
    if scaling is None:
        missing.append("replica scaling (>= 1.8x: `veribus bench --scaling`)")
    if rebuilt is None:
        missing.append("rebuild events/s (>= 50,000: `veribus bench --rebuild`)")
    if missing:
        lines.append("  not measured by this command: " + ", ".join(missing) + "; `veribus bench --all` measures all")
    missed = [name for name, ok in verdicts if not ok]
    lines.append(f"  {len(verdicts) - len(missed)} of {len(verdicts)} targets met"
                 + (": not met: " + "; ".join(missed) if missed else ""))
    return "\n".join(lines)
