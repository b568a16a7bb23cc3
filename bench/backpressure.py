"""Backpressure and memory (Invariant 5): queue thousands of jobs against a slow model and watch
every process's RSS while the queue is deep. In-flight work per service is bounded by its
workers and the consumers' max_ack_pending, so memory must stay flat however deep the queue is.

`run_backpressure(...)` starts a temporary stack, submits the jobs, samples RSS and the durable
consumers for `hold_s` seconds, then cancels the run (the queued answers finalize as cancelled
results, so the stack drains quickly) and reports the figures. `main(args)` prints them
(`veribus bench --backpressure`, see the report for the wiring).
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

from bench.workload import generated_benchmark
from shared.control import lifecycle, processes, runner, stack, streams, wait
from shared.core import events
from shared.core.benchmark.model import Benchmark
from shared.core.config import ModelConfig, Settings, VerificationConfig
from shared.runtime import bus


class RssSampler(threading.Thread):
    """RSS (MB) of each stack process (and its children: sandbox workers), every `interval` s."""

    def __init__(self, procs: list[processes.Proc], interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.procs = {p.name: psutil.Process(p.pid) for p in procs if p.alive()}
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stop_event = threading.Event()

    @staticmethod
    def rss(p: psutil.Process) -> float:
        total = p.memory_info().rss
        for c in p.children(recursive=True):
            try:
                total += c.memory_info().rss
            except psutil.Error:
                pass
        return total / 2**20

    def sample(self) -> dict[str, float]:
        out = {}
        for name, p in self.procs.items():
            try:
                out[name] = round(self.rss(p), 1)
            except psutil.Error:
                out[name] = 0.0
        return out

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.samples.append((time.monotonic(), self.sample()))
            time.sleep(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)


async def consumer_figures(settings: Settings) -> dict[str, dict[str, int]]:
    """pending / unacknowledged / max_ack_pending of every durable consumer of the stream."""
    async with bus.session(settings) as nc:
        js = nc.jetstream()
        out = {}
        for name in (*streams.STAGE_DURABLES, streams.PROJECTOR_DURABLE):
            try:
                ci = await js.consumer_info(events.STREAM, name)
            except Exception:  # noqa: BLE001 - not created yet
                continue
            out[name] = {"pending": int(ci.num_pending or 0), "ack_pending": int(ci.num_ack_pending or 0),
                         "max_ack_pending": int(ci.config.max_ack_pending or 0)}
        return out


def run_backpressure(
    jobs: int = 10_000,
    latency_ms: float = 200.0,
    concurrency: int = 16,
    hold_s: float = 20.0,
    drain_timeout_s: float = 600.0,
    sample_s: float = 0.25,
    extra_env: dict[str, str] | None = None,
    home: Path | None = None,
) -> dict[str, Any]:
    """Queue `jobs` jobs against a model answering in `latency_ms` with `concurrency` calls in
    flight, hold `hold_s` seconds after the last is queued (the queue deep), cancel, wait for
    every job to be finalized. Returns RSS per process (before, peak, end of hold), consumer
    figures, timings."""
    with tempfile.TemporaryDirectory(prefix="veribus-backpressure-") as tmp:
        base = Path(home) if home is not None else Path(tmp)
        settings = Settings(home=base / "home")
        _, script = generated_benchmark(base / "bench.yaml", jobs, wrong_every=0, prefix="Backpressure", ids="bp-{i}")
        state = stack.up(settings, simulator_args=["--latency-ms", str(latency_ms)], extra_env=extra_env)
        settings.nats_url = state.nats_url
        try:
            assert state.simulator_url
            httpx.post(state.simulator_url.removesuffix("/v1") + "/simulator/script", json=script,
                       timeout=60).raise_for_status()
            model = {"api_base": state.simulator_url, "max_concurrency": concurrency}
            config = VerificationConfig(answering_models=[ModelConfig(model_name="openai/bp-answerer", **model)],
                                        parsing_models=[ModelConfig(model_name="openai/bp-judge", **model)])
            plan = runner.plan_run(Benchmark.load(base / "bench.yaml"), config)
            sampler = RssSampler(state.procs, sample_s)
            before = sampler.sample()
            sampler.start()
            t0 = time.monotonic()
            asyncio.run(runner.submit(settings, plan))
            submitted_s = time.monotonic() - t0
            # held `hold_s` once every job is queued, with one reading at least: counted from before
            # the submit, a submit slower than the hold (6.3 s for 3,000 jobs on a loaded host) left
            # no reading at all, and the figures had no consumers
            consumers: list[dict[str, dict[str, int]]] = []
            t_queued = time.monotonic()
            while True:
                consumers.append(asyncio.run(consumer_figures(settings)))
                if time.monotonic() - t_queued >= hold_s:
                    break
                time.sleep(1.0)
            hold_end = sampler.sample()
            done_at_cancel = len(asyncio.run(wait.finalized_counts(settings, plan.run_id)))
            asyncio.run(lifecycle.cancel(settings, plan.run_id, "backpressure measurement"))
            t1 = time.monotonic()
            done, timed_out = asyncio.run(wait.wait_for_results(settings, plan.run_id, count=plan.job_count,
                                                                     timeout=drain_timeout_s, poll_s=1.0))
            drain_s = time.monotonic() - t1
            sampler.stop()
            names = list(before)
            peak = {n: max((s[1].get(n, 0.0) for s in sampler.samples), default=0.0) for n in names}
            durables = sorted({d for c in consumers for d in c})
            max_ack = {d: max((c.get(d, {}).get("ack_pending", 0) for c in consumers), default=0) for d in durables}
            return {
                "jobs": jobs, "latency_ms": latency_ms, "concurrency": concurrency, "hold_s": hold_s,
                "submit_s": round(submitted_s, 2), "finalized_before_cancel": done_at_cancel,
                "finalized": done, "timed_out": timed_out, "drain_after_cancel_s": round(drain_s, 1),
                "rss_mb_before": before, "rss_mb_peak": peak, "rss_mb_end_of_hold": hold_end,
                "rss_mb_growth": {n: round(peak[n] - before[n], 1) for n in names},
                "max_ack_pending_seen": max_ack,
                "consumers_at_end_of_hold": consumers[-1] if consumers else {},
                "samples": len(sampler.samples),
            }
        finally:
            stack.down(settings)


def print_figures(row: dict[str, Any]) -> None:
    print(f"\n== backpressure: {row['jobs']} jobs queued, model latency {row['latency_ms']:g} ms, "
          f"{row['concurrency']} calls in flight per model; held {row['hold_s']:g} s")
    print(f"  submitted in {row['submit_s']} s; {row['finalized_before_cancel']} finalized before the cancel; "
          f"all {row['finalized']} finalized {row['drain_after_cancel_s']} s after it"
          + (" (TIMED OUT)" if row["timed_out"] else ""))
    print(f"  {'process':<14} {'RSS before':>11} {'peak':>9} {'growth':>8}   (RSS includes sandbox workers)")
    for name in row["rss_mb_before"]:
        print(f"  {name:<14} {row['rss_mb_before'][name]:>8.1f} MB {row['rss_mb_peak'][name]:>6.1f} MB "
              f"{row['rss_mb_growth'][name]:>+7.1f}")
    print(f"  {'consumer':<22} {'queued at end of hold':>22} {'max unacked seen':>17} {'limit':>6}")
    for name, c in row["consumers_at_end_of_hold"].items():
        print(f"  {name:<22} {c['pending']:>22} {row['max_ack_pending_seen'].get(name, 0):>17} "
              f"{c['max_ack_pending']:>6}")


def main(args: argparse.Namespace) -> int:
    """Run and print. Reads `jobs`, `hold_s`, `concurrency` and the latency (`latency_ms_bp`, or
    the largest of `veribus bench`'s `--latency-ms` list) from `args`, with defaults."""
    latency = getattr(args, "latency_ms_bp", None)
    if latency is None:
        lat = getattr(args, "latency_ms", None)
        latency = max(lat) if isinstance(lat, list) and lat and max(lat) > 0 else 200.0
    row = run_backpressure(jobs=getattr(args, "jobs", None) or 10_000, latency_ms=float(latency),
                           concurrency=getattr(args, "concurrency", None) or 16,
                           hold_s=getattr(args, "hold_s", None) or 20.0)
    print_figures(row)
    print(json.dumps(row, indent=2))
    return 0 if not row["timed_out"] else 3


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.backpressure", description=__doc__)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--latency-ms", dest="latency_ms_bp", type=float, default=200.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--hold-s", type=float, default=20.0)
    raise SystemExit(main(ap.parse_args()))
