"""`python -m bench` (what `veribus bench` runs): throughput, CPU and memory per service through
the real stack, by default on issue 12's workload (1,000 generated questions, template-only,
64 model calls in flight, latency 0 and 300 ms lognormal); `--all` adds the first latency again with
opt-in hedged requests, the replica scaling and the projections rebuild, and prints every
issue-12 figure beside its target (a lognormal run there is the mean of 3 simulator seeds: one
seed is one fixed set of latency draws, and seed 0's has one call of 8 mean latencies near the
end); `--backpressure`,
`--analysis`, `--limits`, `--sandbox`, `--scaling`, `--rebuild` and `--projection-rows` select the other benchmarks.

The benchmarks are a separate program, not part of the `shared` library: the CLI starts this
module as a child process and passes its exit code through.
"""

from __future__ import annotations

import argparse
import sys

from bench import analysis, backpressure, limits, rebuild, rows, run, sandbox


def build_parser() -> argparse.ArgumentParser:
    b = argparse.ArgumentParser(prog="veribus bench", description=__doc__)
    b.add_argument("--all", action="store_true",
                   help="the main runs, the first latency again hedged after 1.5 latencies (opt-in hedging), "
                        "--scaling and --rebuild, then every issue-12 figure beside its target; each lognormal "
                        "run on 3 simulator seeds (--seeds)")
    b.add_argument("--questions", type=int, default=1000, help="generated questions (template-only)")
    b.add_argument("--latency-ms", type=float, nargs="*", default=[0.0, 300.0],
                   help="the simulator's mean model latency, one run each")
    b.add_argument("--latency-dist", choices=run.LATENCY_DISTS, default="lognormal",
                   help="the simulator's latency distribution (lognormal: its mean is --latency-ms)")
    b.add_argument("--latency-sigma", type=float, default=0.5, help="sigma of the lognormal latency")
    b.add_argument("--concurrency", type=int, default=64,
                   help="C, model calls in flight in total (each of the two models gets C/2)")
    b.add_argument("--replicas", nargs="*", metavar="SERVICE=N")
    b.add_argument("--hedge-after-ms", type=run.hedge_after_arg, default=None,
                   help="both models' hedge_after_s, in ms: a second copy of a call unanswered that long, on a "
                        "free slot, or 'auto' (the model's own 95th percentile; opt-in, off by default)")
    b.add_argument("--limit-scope", choices=("model", "endpoint"), default="model",
                   help="model: each model's limit is C/2 (the issue's workload); endpoint: both models share "
                        "one limit of C on their common endpoint (limit_scope: endpoint)")
    b.add_argument("--seeds", type=run.positive_int, default=None,
                   help="simulator seeds (one set of latency draws each) a lognormal run is measured on, "
                        "reported as their mean beside each seed's figure (default 1; --all: 3)")
    b.add_argument("--api-base", help="measure against this OpenAI-compatible server instead of the simulator")
    b.add_argument("--bench-model", help="answering model at --api-base (default openai/bench-answerer)")
    b.add_argument("--bench-judge", help="judge model at --api-base (default openai/bench-judge)")
    b.add_argument("--backpressure", action="store_true",
                   help="instead: queue --jobs jobs behind a slow model and report every service's RSS")
    b.add_argument("--jobs", type=int, default=10_000, help="jobs for --backpressure")
    b.add_argument("--hold-s", type=float, default=20.0, help="seconds to hold the queue for --backpressure")
    b.add_argument("--analysis", action="store_true",
                   help="instead: time summaries and a streamed export over a synthetic results table")
    b.add_argument("--limits", action="store_true",
                   help="instead: the per-call overhead of the deployment-wide model limiter")
    b.add_argument("--limit-calls", type=int, default=3000, help="calls for --limits")
    b.add_argument("--scaling", action="store_true",
                   help="instead: throughput with 1 and then 2 replicas of the bottleneck stages (generation, "
                        "parsing) at the first non-zero --latency-ms, the model limit set not to cap them")
    b.add_argument("--scaling-workers", type=int, default=8,
                   help="handlers per replica of each scaled stage for --scaling (a replica's capacity)")
    b.add_argument("--scaling-questions", type=int,
                   help="questions for each --scaling run (default: --questions)")
    b.add_argument("--sandbox", action="store_true",
                   help="instead: the template sandbox's cost per call (jail vs unsafe)")
    analysis.add_arguments(b)
    sandbox.add_arguments(b)
    rebuild.add_arguments(b)
    rows.add_arguments(b)
    return b


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.all:
        return run.main(args)
    if args.backpressure:
        return backpressure.main(args)
    if args.analysis:
        return analysis.main(args)
    if args.limits:
        return limits.main(args)
    if args.sandbox:
        return sandbox.main(args)
    if args.rebuild:
        return rebuild.main(args)
    if args.projection_rows:
        return rows.main(args)
    return run.main(args)


if __name__ == "__main__":
    sys.exit(main())
