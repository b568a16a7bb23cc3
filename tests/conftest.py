"""Shared fixtures: a real nats-server on a free port, and the reference material paths.
Every process a fixture starts is stopped by its teardown, by PID."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the read-only reference material sits beside the repository (worktrees sit one level deeper)
SHARED = next((p / "shared" for p in REPO.parents if (p / "shared" / "reference").is_dir()), REPO.parent / "shared")
REFERENCE = SHARED / "reference" / "karenina"
CHECKPOINTS = REFERENCE / "checkpoints"
LLM_RESPONSES = REFERENCE / "llm_responses" / "claude-haiku-4-5"
EXAMPLE = REPO / "examples" / "example.yaml"

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@dataclass
class NatsServer:
    url: str
    port: int
    store: Path
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def start(self) -> None:
        """(Re)start on the same port and store: JetStream state survives a restart."""
        from shared.runtime.bus import wait_for_port

        self.proc = _spawn_nats(self.port, self.store)
        wait_for_port("127.0.0.1", self.port, 10)


def _spawn_nats(port: int, store: Path) -> subprocess.Popen[bytes]:
    from shared.control.stack import nats_server_binary

    return subprocess.Popen(
        [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    from shared.control.stack import free_port
    from shared.runtime.bus import wait_for_port

    port = free_port()
    store = tmp_path / "nats"
    proc = _spawn_nats(port, store)
    server = NatsServer(url=f"nats://127.0.0.1:{port}", port=port, store=store, proc=proc)
    try:
        wait_for_port("127.0.0.1", port, 10)
        yield server
    finally:
        server.stop()


def python() -> str:
    return sys.executable
