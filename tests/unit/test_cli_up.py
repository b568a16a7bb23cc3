"""`veribus up` on a stack that already runs heals it and never rebuilds it: what it prints
says which of the options given the running stack does not have (and only those), without
starting anything (`shared.control.stack.up` is replaced by one that returns the running
stack as a healed stack is returned; the real heal is in tests/integration/test_heal.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.cli import stack as cli_stack
from shared.cli.commands import main
from shared.control.deployment import FLAG_ENV
from shared.control.processes import Proc
from shared.control.stack import SERVICES, StackState


def _running(home: Path, *, nodes: int = 1, parsing: int = 1, sim: list[str] | None = None) -> StackState:
    procs = [Proc(name=f"nats-{i + 1}" if nodes > 1 else "nats", pid=100 + i, cmd=["nats-server"], log="x")
             for i in range(nodes)]
    procs.append(Proc(name="simulator", pid=200, log="x",
                      cmd=["python", "-m", "infra.simulator", "--host", "127.0.0.1", "--port", "9", *(sim or [])]))
    for name in SERVICES:
        for i in range(parsing if name == "parsing" else 1):
            procs.append(Proc(name=name if i == 0 else f"{name}-{i + 1}", pid=300 + len(procs), cmd=["python"], log="x"))
    return StackState(home=str(home), nats_url="nats://127.0.0.1:4222", simulator_url="http://127.0.0.1:9/v1",
                      procs=procs, nats_cluster=nodes, restarted=[])


def _up(argv: list[str], state: StackState, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    monkeypatch.setattr(cli_stack.stack, "up", lambda *a, **kw: state)
    assert main(["up", *argv]) == 0
    return capsys.readouterr().out


def test_up_alone_heals_a_cluster_without_a_note(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`veribus up` is how a dead node of `--nats-cluster 3` comes back: no "not 1" note for an
    option that was not given."""
    out = _up([], _running(tmp_path, nodes=3), monkeypatch, tmp_path, capsys)
    assert "note:" not in out and "nothing to restart" in out
    out = _up(["--nats-cluster", "1"], _running(tmp_path, nodes=3), monkeypatch, tmp_path, capsys)
    assert "note: the running stack has 3 NATS node(s), not 1; `veribus down` first to change that" in out


def test_options_a_running_stack_does_not_have_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--replicas, --sim-error-rate, --sim-latency-ms and --no-simulator given to `up` on a
    running stack were dropped without a word ("already running; nothing to restart")."""
    state = _running(tmp_path, sim=["--latency-ms", "50"])
    out = _up(["--replicas", "parsing=2", "generation=1", "--sim-error-rate", "0.5", "--sim-latency-ms", "50"],
              state, monkeypatch, tmp_path, capsys)
    notes = [line.strip() for line in out.splitlines() if "note:" in line]
    assert notes == [
        "note: the running stack has 1 parsing process(es), not 2 (--replicas parsing=2); `veribus down` first "
        "to change that",
        "note: the running simulator has --error-rate its default, not 0.5 (--sim-error-rate); `veribus down` "
        "first to change that",
    ], out
    out = _up(["--no-simulator"], state, monkeypatch, tmp_path, capsys)
    assert "note: the running stack has its LLM simulator (--no-simulator)" in out
    # what the stack has already is no note
    out = _up(["--replicas", "parsing=2", "--sim-latency-ms", "50"], _running(tmp_path, parsing=2, sim=["--latency-ms", "50"]),
              monkeypatch, tmp_path, capsys)
    assert "note:" not in out


@pytest.mark.parametrize("command", ["up", "down"])
def test_up_and_down_refuse_a_nats_url_they_would_ignore(command: str, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`veribus up --nats-url X` started a local stack with its own NATS and never used X (and
    `down --nats-url X` stopped the local one): refused (exit 2), saying what the command does
    and what to use for a deployment that already runs; nothing is started or stopped."""
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    for var in ("VERIBUS_NATS_URL", FLAG_ENV):  # main() puts --nats-url in the environment: restored after
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)

    def touched(*_a: object, **_kw: object) -> object:
        raise AssertionError(f"the local stack was acted on by `{command} --nats-url`")

    monkeypatch.setattr(cli_stack.stack, "up", touched)
    monkeypatch.setattr(cli_stack.stack, "down", touched)
    assert main([command, "--nats-url", "nats://ci:s3cret@nats.internal:4222"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and "s3cret" not in said.err
    assert f"`veribus {command}` takes no --nats-url" in said.err and "nats://ci:***@nats.internal:4222" in said.err
    if command == "up":
        assert "starts a local stack with its own NATS server" in said.err and "docker-compose" in said.err
    else:
        assert "stops the local stack" in said.err
    assert not (tmp_path / "home").exists()
