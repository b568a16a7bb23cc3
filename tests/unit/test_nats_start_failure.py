"""A NATS node that dies while the stack waits for it is reported by name, with its log's tail
when it has one. A probe built without a log file (`log=""`) once made the report itself fail:
`Path("")` is the current folder, and opening it raised IsADirectoryError instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from shared.control import nats_nodes
from shared.control.processes import Proc


def _dead_node(log: str) -> Proc:
    with open(log or "/dev/null", "wb") as out:
        child = subprocess.Popen([sys.executable, "-c", "print('listen tcp 127.0.0.1:4222: address already in use')"],
                                 stdout=out)
    created = psutil.Process(child.pid).create_time()
    child.wait()
    return Proc(name="nats-2", pid=child.pid, cmd=["nats-server"], log=log, create_time=created,
                port=1, http_port=1)


def test_a_dead_node_without_a_log_is_named_not_a_crash() -> None:
    with pytest.raises(RuntimeError, match=r"nats node nats-2 exited during start-up"):
        nats_nodes.wait_nats_healthy([_dead_node("")], timeout=5.0)


def test_a_dead_node_with_a_log_shows_why(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"nats-2 exited during start-up.*\n.*address already in use"):
        nats_nodes.wait_nats_healthy([_dead_node(str(tmp_path / "nats-2.log"))], timeout=5.0)


def test_a_probe_without_a_log_reads_nothing() -> None:
    assert Proc(name="nats", pid=1, cmd=[], log="").log_text() == ""
