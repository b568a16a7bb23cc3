"""`python -m infra.simulator --host 127.0.0.1 --port N [--script FILE] ...`"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aiohttp import web

from infra.simulator.script import DEFAULT_ERROR_MIX, LATENCY_DISTS, Script, SimConfig
from infra.simulator.server import create_app


def _mix(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        kind, _, weight = part.partition("=")
        try:
            out[kind.strip()] = float(weight)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--error-mix expects kind=weight pairs, got {part!r}") from exc
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.simulator", description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--script", help="YAML or JSON script: {defaults: {...}, questions: [...]}")
    ap.add_argument("--keep-script", metavar="FILE",
                    help="keep every script posted in FILE, and start from it when it exists (after --script): "
                         "a simulator started again answers as before (the local stack's, `veribus up`)")
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--latency-dist", choices=LATENCY_DISTS, default="fixed")
    ap.add_argument("--latency-sigma", type=float, default=0.5, help="lognormal sigma")
    ap.add_argument("--error-rate", type=float, default=0.0)
    ap.add_argument("--error-mix", type=_mix, default=dict(DEFAULT_ERROR_MIX),
                    help="weights of injected errors, e.g. 429=0.4,500=0.4,slow=0.2")
    ap.add_argument("--retry-after", type=float, default=0.1, help="Retry-After seconds sent with 429")
    ap.add_argument("--slow-ms", type=float, default=30_000.0, help="delay of a 'slow' injected error")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-in-flight", type=int, default=0,
                    help="per model: answer 429 to calls beyond this many in flight (a provider's limit)")
    args = ap.parse_args(argv)
    try:
        script = Script.load(args.script) if args.script else Script()
        kept = Path(args.keep_script) if args.keep_script else None
        if kept is not None and kept.exists():
            try:
                script.merge(Script.load(kept).raw())
            except (OSError, ValueError) as exc:  # a kept script never keeps the simulator from starting
                print(f"simulator: ignoring the kept script {kept}: {exc}", file=sys.stderr)
        config = SimConfig(
            latency_ms=args.latency_ms, latency_dist=args.latency_dist, latency_sigma=args.latency_sigma,
            error_rate=args.error_rate, error_mix=args.error_mix, retry_after_s=args.retry_after,
            slow_ms=args.slow_ms, seed=args.seed, max_in_flight=args.max_in_flight,
        )
    except (OSError, ValueError) as exc:
        print(f"simulator: {exc}", file=sys.stderr)
        return 2
    print(f"veribus LLM simulator on http://{args.host}:{args.port}/v1 "
          f"({len(script.entries)} scripted questions, seed {args.seed})", flush=True)
    web.run_app(create_app(script, config, kept), host=args.host, port=args.port, access_log=None,
                print=None, handle_signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
