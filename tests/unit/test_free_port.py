"""`free_port` never hands out one port twice in a process: the services of a stack bind theirs
only when they start, so a repeat would give two of them the same port (guards once died with
"address already in use" on generation's metrics port, and a CI run timed out waiting for it)."""

from __future__ import annotations

import socket

import pytest

from shared.control import processes


def test_ports_handed_out_are_all_different_even_when_the_kernel_repeats_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bound = iter([41001, 41001, 41002, 41001, 41003])

    class Repeating:  # the kernel's choice for bind(("127.0.0.1", 0)), repeating itself
        def __init__(self) -> None:
            self.port = 0

        def __enter__(self) -> Repeating:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def bind(self, addr: tuple[str, int]) -> None:
            self.port = next(bound)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(processes, "_GIVEN_PORTS", set())
    monkeypatch.setattr(processes.socket, "socket", Repeating)
    assert [processes.free_port() for _ in range(3)] == [41001, 41002, 41003]


def test_real_ports_are_distinct_and_bindable() -> None:
    ports = [processes.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
