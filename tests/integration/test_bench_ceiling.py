"""`bench.timing.simulator_ceiling` against a real simulator: it measures completed calls as a
fraction of the bound C/(2L), which no client can beat (a figure, not a timing assertion)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.run import simulator_latency
from bench.timing import simulator_ceiling
from shared.control.processes import free_port
from shared.runtime.bus import wait_for_port
from tests.support.procs import stop_process

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_simulators_ceiling_is_a_fraction_of_the_bound() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "infra.simulator", "--host", "127.0.0.1", "--port", str(port),
                             *simulator_latency(50.0, "fixed")], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 20)
        c = simulator_ceiling(f"http://127.0.0.1:{port}/v1", 8, 50.0, seconds=1.0, skip_s=0.2)
        # 4 callers per model, 50 ms calls: at most 21 completions each in a 1 s window, so <= 1.05
        assert c is not None and 0 < c <= 1.05, c
        assert simulator_ceiling(f"http://127.0.0.1:{port}/v1", 8, 0.0) is None, "no bound at zero latency"
    finally:
        stop_process(proc)
