"""`veribus status` names a local stack's state with the words every other command uses for it
(`deployment.select`): NATS dead while some of it still runs is "degraded" (what `runs`,
`results`, ... refuse with exit 3), and a stack whose NATS runs is "running", with how many of
its processes are DEAD. Processes are this test's own (alive) and a finished child (dead)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil

from shared.control import stack
from shared.control.processes import Proc
from shared.core.config import Settings


def _procs(tmp_path: Path) -> tuple[Proc, Proc]:
    me = psutil.Process()
    alive = Proc(name="x", pid=me.pid, cmd=me.cmdline(), log="x", create_time=me.create_time())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = Proc(name="x", pid=child.pid, cmd=["gone"], log="x", create_time=1.0)
    return alive, dead


def _state(tmp_path: Path, nats: Proc, service: Proc) -> str:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    procs = [Proc(**{**nats.__dict__, "name": "nats"}), Proc(**{**service.__dict__, "name": "parsing"})]
    stack.StackState(home=str(home), nats_url="nats://127.0.0.1:1", simulator_url=None, procs=procs).save()
    return stack.status(Settings(home=home))["state"]


def test_status_words_match_what_the_commands_say(tmp_path: Path) -> None:
    alive, dead = _procs(tmp_path)
    # was "down", while `veribus runs` said "the local stack in HOME is degraded (nats DEAD; still running: ...)"
    assert _state(tmp_path, dead, alive) == "degraded"
    # was "degraded", while every command used this stack (its bus runs) and named the dead process
    assert _state(tmp_path, alive, dead) == "running, 1 DEAD"
    assert _state(tmp_path, alive, alive) == "running"
    assert _state(tmp_path, dead, dead) == "down"
