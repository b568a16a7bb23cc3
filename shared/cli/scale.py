"""CLI pieces of issue 12: `veribus run --cache / --cache-ttl / --max-cost-usd`, and
`veribus cache clear|info` (the response cache across runs, `shared.runtime.response_cache`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shared.cli.aio import run_main
from shared.control.stack import stack_settings
from shared.runtime import bus
from shared.runtime.costcontrol import check_cost_budget, pop_cost_budget


def add_run_options(run: argparse.ArgumentParser) -> None:
    run.add_argument("--cache", dest="response_cache", action="store_true", default=None,
                     help="reuse model replies across runs (keyed by model, parameters, messages); "
                          "also response_cache: true in --config")
    run.add_argument("--cache-ttl", dest="response_cache_ttl_s", type=float, metavar="SECONDS",
                     help="a cached reply older than this is asked again (default 7 days)")
    run.add_argument("--max-cost-usd", type=float, metavar="USD",
                     help="stop dispatching new answers once the run has spent this much (also budget_cost_usd "
                          "in --config); models without a known price count as free")


def apply_run_options(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Fold the flags into the run-config mapping (flags win over --config); take the money
    budget out of it (it is a run setting, not a VerificationConfig field)."""
    budget = pop_cost_budget(data)
    if budget is not None and getattr(args, "max_cost_usd", None) is None:
        args.max_cost_usd = budget
    if getattr(args, "response_cache", None):
        data["response_cache"] = True
    ttl = getattr(args, "response_cache_ttl_s", None)
    if ttl is not None:
        if ttl <= 0:
            raise ValueError(f"--cache-ttl must be a positive number of seconds, got {ttl}")
        data["response_cache_ttl_s"] = ttl
    usd = getattr(args, "max_cost_usd", None)
    if usd is not None:
        check_cost_budget(usd)


def register(sub: Any) -> None:
    cache = sub.add_parser("cache", help="the response cache across runs")
    csub = cache.add_subparsers(dest="cache_command", required=True)
    clear = csub.add_parser("clear", help="empty the cross-run response cache")
    clear.add_argument("--all", action="store_true",
                       help="also the run-scoped cache (redeliveries of running runs may then pay again)")
    clear.set_defaults(fn=cmd_cache_clear)
    info = csub.add_parser("info", help="entries and bytes per cache bucket")
    info.add_argument("--format", choices=["table", "json"], default="table", help="table (default) or json")
    info.set_defaults(fn=cmd_cache_info)


def _settings() -> Any:
    return stack_settings()


async def _with_js(settings: Any, fn: Any) -> Any:
    async with bus.session(settings, max_reconnect_attempts=1, connect_timeout=3) as nc:
        return await fn(nc.jetstream())


def cmd_cache_clear(args: argparse.Namespace) -> int:
    # local import: shared.runtime.llm (client, caches) would slow every command's start-up
    from shared.runtime import response_cache

    removed = run_main(_with_js(_settings(), lambda js: response_cache.clear(
        js, include_run_scoped=args.all)))
    for bucket, n in removed.items():
        print(f"{bucket}: {n} entr{'y' if n == 1 else 'ies'} removed")
    return 0


def _duration(seconds: float) -> str:
    """2592000 -> '30 days', 3600 -> '1 h', 90 -> '90 s' (a bucket's max age as it was set)."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{n} {'day' if unit == 'days' and n == 1 else unit}"
    return f"{seconds:g} s"


def cmd_cache_info(args: argparse.Namespace) -> int:
    # local import: shared.runtime.llm (client, caches) would slow every command's start-up
    from shared.runtime import response_cache

    data = run_main(_with_js(_settings(), response_cache.info))
    if args.format == "json":
        print(json.dumps(data, indent=2))
    else:
        for bucket, d in data.items():
            if not d.get("exists", True):
                print(f"{bucket}: not created yet (the first run that uses it creates it)")
                continue
            age = f"max age {_duration(d['max_age_s'])}" if d.get("max_age_s") else "no max age (kept until cleared)"
            print(f"{bucket}: {d['entries']} entries, {d['bytes']} bytes, {age}")
    return 0
