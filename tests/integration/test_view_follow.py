"""`veribus view` outlives the local stack it reads: after `veribus down` and `veribus up` (a new
NATS port) its pages are read from the new stack's projector, never from the chdb folder that
projector holds (it answered HTTP 500 "Server got itself in trouble" on every page, for good:
the viewer kept the old NATS URL and tried to open the held folder).

- a real stack, a run, `python -m shared.cli view` as a user starts it; down (the view reads the
  folder itself, and lets it go); up again on a new port: every page answers 200 with the run;
- a stack whose NATS runs and whose projector process is alive but does not answer (it is
  starting): the viewer follows its NATS URL, does not open the folder, and says so.

Every process is started here or by `stack.up` and stopped in `finally` (by PID or `stack.down`)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from shared.cli.view.source import StoreUnavailable, ViewSource
from shared.control import stack
from shared.control.processes import Proc, free_port
from shared.core.config import Settings
from shared.store.engine import flock_holders
from tests.conftest import REPO, NatsServer
from tests.integration.test_honest_cli import cli_env, veribus, write_bench
from tests.support.procs import stop_process


@pytest.fixture
def viewer(tmp_path: Path) -> Iterator[dict[str, object]]:
    """Starts `veribus view --port 0` on demand (`start(env)`); stopped by PID at teardown."""
    box: dict[str, object] = {}

    def start(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
        err = (tmp_path / "view.stderr").open("w")
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "view", "--port", "0"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
        box["proc"] = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"(http://localhost:\d+/)", line)
        assert m, f"viewer did not print its URL: {line!r}; stderr: {(tmp_path / 'view.stderr').read_text()[-2000:]}"
        return proc, m.group(1)

    box["start"] = start
    try:
        yield box
    finally:
        proc = box.get("proc")
        if isinstance(proc, subprocess.Popen):
            stop_process(proc)


def _get(url: str, path: str) -> tuple[int, str]:
    r = httpx.get(url.rstrip("/") + path, timeout=180)
    return r.status_code, r.text


def test_the_view_follows_the_local_stack_through_down_and_up(tmp_path: Path, viewer: dict[str, object]) -> None:
    home = tmp_path / "home"
    settings = Settings(home=home)
    env = cli_env(home)
    states = [stack.up(settings)]
    try:
        out = veribus(env, "run", str(write_bench(tmp_path / "b.yaml", 2, prefix="Follow")), "--simulate",
                      "--run-name", "view-follow")
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        m = re.search(r"run id: (\S+)", out.stdout)
        assert m, out.stdout[-2000:]
        run_id = m.group(1)
        proc, url = viewer["start"](env)  # type: ignore[operator]
        err = tmp_path / "view.stderr"

        def pages_show_the_run(when: str) -> None:
            status, text = _get(url, "/")
            assert status == 200 and "view-follow" in text, (when, status, text[-1500:], err.read_text()[-3000:])
            status, text = _get(url, f"/run/{run_id}")
            assert status == 200 and "Follow question 1" in text, (when, status, text[-1500:])
            sample = re.search(rf"/run/{re.escape(run_id)}/sample/([0-9a-zA-Z_-]+)", text)
            assert sample, (when, text[-1500:])
            status, text = _get(url, sample.group(0))
            assert status == 200 and "Follow question" in text, (when, status, text[-1500:])

        pages_show_the_run("first stack")
        first_url = states[0].nats_url
        stack.down(settings)
        pages_show_the_run("no stack: the view reads the folder itself")

        # the view lets the folder go after a few idle seconds, so that a stack started later can take it
        status_file = settings.chdb_path / "status"
        deadline = time.monotonic() + 60
        while proc.pid in flock_holders(status_file) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.pid not in flock_holders(status_file), "the view did not let the chdb folder go"

        # a new NATS port, as when the old one was taken meanwhile (`up` takes the old ports again when free)
        states.append(stack.up(settings, nats_port=free_port()))
        assert states[1].nats_url != first_url, "the second stack must listen elsewhere for this test to mean anything"
        pages_show_the_run("second stack, on a new NATS port")
        projector = stack.proc_named(states[1], "projector")
        holders = flock_holders(status_file)
        assert proc.pid not in holders and projector.pid in holders, (holders, proc.pid, projector.pid)
        assert "FolderHeld" not in err.read_text() and "Traceback" not in err.read_text(), err.read_text()[-3000:]
    finally:
        stack.down(settings)
        for state in states:
            for p in state.procs:
                assert not p.alive(), f"{p.name} (pid {p.pid}) still running after down"


def _proc(name: str, pid: int, home: Path) -> Proc:
    ps = psutil.Process(pid)
    return Proc(name=name, pid=pid, cmd=ps.cmdline(), log=str(home / f"{name}.log"), create_time=ps.create_time())


async def test_a_starting_stack_is_followed_and_its_folder_left_alone(tmp_path: Path, nats_server: NatsServer) -> None:
    """stack.json names a live NATS (not the URL the viewer started with) and a live projector
    process that does not answer yet: the viewer connects to that NATS, does not open the folder
    the projector is about to take, and says why and what to do."""
    home = (tmp_path / "home").resolve()
    home.mkdir()
    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        stack.StackState(home=str(home), nats_url=nats_server.url, simulator_url=None,
                         procs=[_proc("nats", nats_server.proc.pid, home), _proc("projector", starting.pid, home)],
                         started_at=time.time()).save()
        src = ViewSource(Settings(home=home, nats_url="nats://127.0.0.1:1"), follow=True)
        try:
            with pytest.raises(StoreUnavailable, match=r"its projector \(pid \d+\) did not answer.*reload in a few"):
                await src.query("SELECT 1")
            assert src.settings.nats_url == nats_server.url
            nc = await src.connection()
            assert nc is not None and nc.is_connected and nc.connected_url.port == nats_server.port
            assert src._store is None and not flock_holders(home / "chdb" / "status")
        finally:
            await src.close()
    finally:
        stop_process(starting)
