"""An embedded ClickHouse folder another process holds (one process per folder: a projector, a
`veribus view` that has not let it go yet, another command) is named as such by every read
command, in one line with exit 3, never chdb's "Error initializing EmbeddedServer: .
(BAD_ARGUMENTS)" nor its "Cannot lock file" line on stderr. Both sides are processes of their own (chdb keeps one folder per process);
the holder is stopped at the end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.core.config import Settings
from shared.store.engine import open_store

REPO = Path(__file__).resolve().parents[2]
HOLD = ("import sys\nfrom shared.core.config import Settings\nfrom shared.store.engine import open_store\n"
        "store = open_store(Settings(home=sys.argv[1]))\nprint('holding', flush=True)\nsys.stdin.read()\n"
        "store.close()\n")


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Path]:
    """A veribus home whose chdb folder another process has open, until the test ends."""
    home = tmp_path / "home"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(home)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        yield home
    finally:
        proc.communicate(timeout=60)  # stdin closed: it closes the store and exits
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_folder_another_process_holds_is_named(held: Path) -> None:
    path = Path(Settings(home=held).chdb_path).resolve()
    env = {**os.environ, "VERIBUS_HOME": str(held)}
    env.pop("VERIBUS_NATS_URL", None)
    for argv in (["results", "some-run"], ["runs"], ["query", "SELECT 1"]):
        out = subprocess.run([sys.executable, "-m", "shared.cli", *argv], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
        lines = [line for line in out.stderr.splitlines() if line.startswith("veribus: error:")]
        assert out.returncode == 3, (argv, out.stderr)
        assert lines == [f"veribus: error: the chdb folder {path} is open in another process (one process per "
                         "folder: the stack's projector, a `veribus view` reading it (it lets go after a few idle "
                         "seconds), or another command); query through the running stack, or try again when it "
                         "is free"], (argv, out.stderr)
        assert "BAD_ARGUMENTS" not in out.stderr and "ProgrammingError" not in out.stderr, (argv, out.stderr)
        # the lock is read before chdb is asked, so chdb's own "Code: 76 ... Cannot lock file" line is gone
        assert "Cannot lock file" not in out.stderr and "Code: 76" not in out.stderr, (argv, out.stderr)


def test_the_folder_lock_is_read_from_the_lock_itself(held: Path, tmp_path: Path) -> None:
    from shared.store.engine import flock_holders, folder_held_elsewhere

    path = Path(Settings(home=held).chdb_path).resolve()
    assert folder_held_elsewhere(path)
    holders = flock_holders(path / "status")
    assert len(holders) == 1 and os.getpid() not in holders


def test_a_free_folder_is_not_held(tmp_path: Path) -> None:
    from shared.store.engine import folder_held_elsewhere

    settings = Settings(home=tmp_path / "home")
    from shared.store.engine import flock_holders

    store = open_store(settings)
    status = Path(settings.chdb_path).resolve() / "status"
    assert flock_holders(status) == {os.getpid()}  # this process's own open is not "another process"
    store.close()
    assert not folder_held_elsewhere(Path(settings.chdb_path).resolve())
    assert flock_holders(status) == set()
