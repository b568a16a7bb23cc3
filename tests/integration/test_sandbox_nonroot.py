"""The sandbox as most users run it: not as root. bwrap then makes an unprivileged user namespace
(`--unshare-user --disable-userns`) and there is no uid to drop to, a different path from the
root one the rest of the suite takes on this machine. Here the whole attack corpus
(`tests/unit/test_sandbox_attacks.py`: reading /proc and the environment, `_posixsubprocess`,
sockets, signals, the zygote's memory, patched module globals, forged protocol frames) and the
sandbox's own tests run again as `nobody`, in a child pytest, and must pass on that path.

The interpreter may live under root's 0700 home (pyenv); the child then runs in a private mount
namespace where /root is a 0755 tmpfs holding only a bind of the interpreter's tree, so the
user it runs as reaches exactly what it would own on a normal install."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, SHARED

pytestmark = pytest.mark.integration

USER = "nobody"
SUITES = ["tests/unit/test_sandbox_attacks.py", "tests/unit/test_sandbox.py", "tests/unit/test_templates.py"]


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "the suite itself runs as a non-root user: every sandbox test already takes this path"
    for tool in ("runuser", "unshare", "mount", "bwrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def _inaccessible(path: Path) -> Path | None:
    """The first directory on the way to `path` that other users cannot pass (None: all can)."""
    for d in [*reversed(path.parents), path]:
        if d.is_dir() and not os.stat(d).st_mode & 0o001:
            return d
    return None


def _nonroot_command(tmp: Path, args: list[str]) -> list[str]:
    """`python args` as USER, in a private mount namespace where what it needs under root's
    0700 home (the interpreter, the repository) is bound into a 0755 tmpfs /root."""
    python = Path(sys.executable)
    script = ["set -e"]
    tops: list[Path] = []
    for need in (python.resolve().parent, REPO, Path(sys.prefix), SHARED.resolve()):
        blocked = _inaccessible(need)
        if blocked is None:
            continue
        if blocked != Path("/root"):
            pytest.skip(f"{need} is under {blocked}, which {USER} cannot enter")
        top = Path("/root") / need.relative_to("/root").parts[0]  # e.g. /root/.pyenv
        if top not in tops:
            tops.append(top)
    held = [tmp / f"held{i}" for i in range(len(tops))]
    for top, h in zip(tops, held, strict=True):
        h.mkdir(exist_ok=True)
        script.append(f"mount --bind {shlex.quote(str(top))} {shlex.quote(str(h))}")
    if tops:
        script.append("mount -t tmpfs -o mode=755 tmpfs /root")
    for top, h in zip(tops, held, strict=True):
        q = shlex.quote(str(top))
        script += [f"mkdir -p {q}", f"mount --bind {shlex.quote(str(h))} {q}"]
    env = ["env", "-i", "PATH=/usr/bin:/bin", f"HOME={tmp}", f"TMPDIR={tmp}", f"PYTHONPATH={REPO}",
           "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1"]
    script += [f"cd {shlex.quote(str(REPO))}", "exec " + shlex.join(["runuser", "-u", USER, "--", *env, str(python), *args])]
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script)]


@pytest.fixture
def nonroot_tmp() -> Iterator[Path]:
    """A folder USER owns, on a path USER can reach (pytest's own tmp_path is under a 0700 root
    folder); removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="veribus-nonroot-"))
    try:
        shutil.chown(d, USER)
        os.chmod(d, 0o755)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_attack_corpus_holds_on_the_non_root_path(nonroot_tmp: Path) -> None:
    why = _why_not()
    if why:
        pytest.skip(why)
    userns = subprocess.run(["runuser", "-u", USER, "--", "unshare", "--user", "true"], capture_output=True, text=True,
                            timeout=30)
    if userns.returncode != 0:  # then the sandbox fails closed as USER (its own tests show that)
        pytest.skip(f"{USER} cannot make a user namespace here: {userns.stderr.strip()[:200]}")
    probe = subprocess.run(_nonroot_command(nonroot_tmp, [
        "-c", "import os; from shared.templates import boundary; p = boundary.plan(); "
              "print(os.geteuid(), p.privileged, p.error, p.drop_to, '|'.join(p.layers))"]),
        capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    uid, privileged, error, drop_to, layers = probe.stdout.strip().splitlines()[-1].split(" ", 4)
    assert uid != "0" and privileged == "False" and error == "None" and drop_to == "None", probe.stdout
    assert "user namespace" in layers and "seccomp" in layers, layers

    run = subprocess.run(_nonroot_command(nonroot_tmp, [
        "-m", "pytest", *SUITES, "-p", "no:cacheprovider", "-q", "-m", "not needs_root",
        "--basetemp", str(nonroot_tmp / "pt")]), capture_output=True, text=True, timeout=900)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 100, summary  # the suites ran, not a handful
