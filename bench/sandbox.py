"""`veribus bench --sandbox`: what the template sandbox costs per call.

For the jail (the default) and, for comparison, `VERIBUS_SANDBOX=unsafe` (no OS boundary): the
time to start a worker, and per call (sequential, one worker) the wall time, the service
process's CPU and the jail's CPU (every process of the worker, with the call processes it has
reaped) for a ping, a template verify() and a callable trait in a fresh process each, and for
verify() and the trait with a run scope (one process per run: what the services do). The
`*_new` cases are what a benchmark run costs per result: every question has its own template,
so each validation (parsing) and each verify() (verification) compiles a class the scope
process has not seen, more of them than its class cache holds.
Figures, not assertions: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import psutil

from bench.workload import int_template
from shared.templates.calls import run_callable_trait, run_verify, validate_template
from shared.templates.sandbox import Sandbox

TEMPLATE = '''from karenina.schemas.entities import BaseAnswer
from pydantic import Field

class Answer(BaseAnswer):
    value: int = Field(description="The number asked for")

    def model_post_init(self, __context):
        self.correct = {"value": 4}

    def verify(self) -> bool:
        return self.value == self.correct["value"]
'''
TRAIT = "def evaluate(trace: str) -> bool:\n    return len(trace) < 500\n"
_CASES = ("ping", "ping_in_run", "verify", "callable_trait", "verify_in_run", "trait_in_run", "validate_new", "verify_new")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=200, help="calls per measurement for --sandbox")
    parser.add_argument("--sandbox-modes", default="jail,unsafe", help="for --sandbox: jail, unsafe or both")
    parser.add_argument("--sandbox-cases", default=",".join(_CASES),
                        help=f"for --sandbox: which cases, comma-separated (of {', '.join(_CASES)})")


def _jail_cpu(tag: str) -> float:
    """CPU seconds of the pool's processes (outer bwrap, jail init, zygote) incl. reaped calls."""
    total = 0.0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if tag.encode() not in p.joinpath("cmdline").read_bytes():
                continue
            t = psutil.Process(int(p.name)).cpu_times()
        except (OSError, psutil.Error):
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


async def _validate_new(sb: Sandbox, n: int) -> Any:
    return await validate_template(int_template(n), "q", template_id=f"t{n}", sandbox=sb, scope="bench-run")


async def _verify_new(sb: Sandbox, n: int) -> Any:
    return await run_verify(int_template(n), {"value": n}, "q", "The sum is 4.", template_id=f"t{n}", sandbox=sb,
                            scope="bench-run")


async def _measure(mode: str, calls: int, which: tuple[str, ...] = _CASES) -> dict[str, Any]:
    fresh = itertools.count()
    old = os.environ.get("VERIBUS_SANDBOX")
    os.environ["VERIBUS_SANDBOX"] = mode
    try:
        sb = Sandbox(workers=1, timeout_s=10.0, memory_mb=512)
    finally:
        if old is None:
            os.environ.pop("VERIBUS_SANDBOX", None)
        else:
            os.environ["VERIBUS_SANDBOX"] = old
    if sb.jail.error:
        return {"mode": mode, "error": sb.jail.error}
    out: dict[str, Any] = {"mode": sb.jail.mode, "layers": sb.jail.layers}
    try:
        t = time.perf_counter()
        await sb.start()
        out["worker_start_ms"] = round((time.perf_counter() - t) * 1e3, 1)
        cases = {
            "ping": lambda: sb.call("ping"),
            "ping_in_run": lambda: sb.call("ping", scope="bench-run"),  # the relay's own cost
            "verify": lambda: run_verify(TEMPLATE, {"value": 4}, "q", template_id="t", sandbox=sb),
            "callable_trait": lambda: run_callable_trait(TRAIT, "some answer", "boolean", sandbox=sb),
            # what the services do: the run id as scope, one process per run (templates compile once)
            "verify_in_run": lambda: run_verify(TEMPLATE, {"value": 4}, "q", template_id="t", sandbox=sb,
                                                scope="bench-run"),
            "trait_in_run": lambda: run_callable_trait(TRAIT, "some answer", "boolean", sandbox=sb, scope="bench-run"),
            # a benchmark run: a template per question, each validated (parsing) then verified once
            "validate_new": lambda: _validate_new(sb, next(fresh)),
            "verify_new": lambda: _verify_new(sb, next(fresh)),
        }
        for name in which:
            fn = cases[name]
            for _ in range(5):  # warm up
                await fn()
            jail0, cpu0, wall0 = _jail_cpu(sb.tag), time.process_time(), time.perf_counter()
            for _ in range(calls):
                await fn()
            wall = (time.perf_counter() - wall0) / calls
            out[name] = {"wall_ms": round(wall * 1e3, 2),
                         "service_cpu_ms": round((time.process_time() - cpu0) / calls * 1e3, 3),
                         "sandbox_cpu_ms": round((_jail_cpu(sb.tag) - jail0) / calls * 1e3, 2)}
    finally:
        await sb.close()
    return out


def main(args: argparse.Namespace) -> int:
    calls = int(getattr(args, "calls", 200))
    print(f"sandbox bench: {calls} sequential calls per case, one worker")
    which = tuple(c for c in str(getattr(args, "sandbox_cases", "") or ",".join(_CASES)).split(",") if c)
    unknown = [c for c in which if c not in _CASES]
    if unknown:
        print(f"unknown --sandbox-cases: {', '.join(unknown)} (known: {', '.join(_CASES)})")
        return 2
    modes = [m for m in str(getattr(args, "sandbox_modes", "jail,unsafe")).split(",") if m]
    figures = [asyncio.run(_measure(mode, calls, which)) for mode in modes]
    for f in figures:
        if "error" in f:
            print(f"  {f['mode']:7s} unavailable: {f['error']}")
            continue
        print(f"  {f['mode']:7s} worker start {f['worker_start_ms']} ms")
        for case in which:
            c = f[case]
            print(f"    {case:15s} wall {c['wall_ms']:7.2f} ms/call   service CPU {c['service_cpu_ms']:6.3f} ms/call"
                  f"   sandbox CPU {c['sandbox_cpu_ms']:6.2f} ms/call")
    if getattr(args, "json", False):
        print(json.dumps(figures, indent=2))
    return 0
