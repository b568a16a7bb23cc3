"""The README's Python analysis API against a running local stack (`veribus up`), in a process of its
own as a user runs it, with only VERIBUS_HOME set (the stack's bus is on a port of its own):

- the README's snippet, verbatim, reads the run's results through the stack's projector, as the
  CLI does (it once said `Settings.from_env()`, which does not find the stack: the chdb lock error);
- settings that name no bus (`Settings.from_env()`) get a `FolderHeld` error that says what to do
  (the deployment's settings), from `from_store` and from `stream`, never chdb's own lock error.

Every process is started by `up_and_down` and stopped by it (by PID)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.core.config import Settings
from shared.store.reads import run_query
from tests.conftest import REPO
from tests.integration.test_honest_cli import cli_env, veribus, write_bench
from tests.support.stack import up_and_down


def readme_snippet() -> str:
    """The README's Python block under "Python, mirroring the reference's analysis API"."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    at = text.index("Python, mirroring the reference's analysis API")
    block = re.search(r"```python\n(.*?)```", text[at:], re.S)
    assert block is not None
    return block.group(1)


def python_json(env: dict[str, str], code: str) -> tuple[Any, str]:
    """Run `code` (whose last line of output is JSON) as a user's own script: (that JSON, stderr)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Settings, str]]:
    """A local stack with one simulated run named `demo` (the README's name) of 2 questions."""
    tmp = tmp_path_factory.mktemp("python-api")
    with up_and_down(tmp / "home") as (settings, _state):
        env = cli_env(settings.home)
        out = veribus(env, "run", str(write_bench(tmp / "b.yaml", 2, prefix="PyApi")), "--simulate",
                      "--run-name", "demo")
        assert out.returncode == 0, out.stdout + out.stderr
        rows = run_query(settings, "SELECT run_id FROM runs FINAL WHERE run_name = 'demo'").rows
        assert len(rows) == 1, rows
        yield env, settings, str(rows[0][0])


def test_the_readme_snippet_reads_a_running_local_stack(demo_run: tuple[dict[str, str], Settings, str]) -> None:
    env, _settings, run_id = demo_run
    assert "VERIBUS_NATS_URL" not in env and "VERIBUS_HOME" in env
    code = readme_snippet() + (
        "\nimport json\nprint(json.dumps({'n': len(rs.results), 'run_ids': rs.run_ids, "
        "'questions': sorted(r.metadata.question_id for r in rs.results), "
        "'streamed': len(VerificationResultSet.stream(settings, run_name='demo'))}))\n")
    got, stderr = python_json(env, code)
    assert got == {"n": 2, "run_ids": [run_id], "questions": ["h0", "h1"], "streamed": 2}, got
    assert "Cannot lock file" not in stderr, stderr


def test_settings_that_miss_the_stack_say_what_to_do(demo_run: tuple[dict[str, str], Settings, str]) -> None:
    env, settings, _run_id = demo_run
    code = ("import json\nfrom shared.config import Settings\nfrom shared.results import VerificationResultSet\n"
            "said = []\n"
            "for read in (lambda: VerificationResultSet.from_store(Settings.from_env(), run_name='demo'),\n"
            "             lambda: len(VerificationResultSet.stream(Settings.from_env(), run_name='demo'))):\n"
            "    try:\n        read()\n    except RuntimeError as exc:\n        said.append([type(exc).__name__, str(exc)])\n"
            "print(json.dumps(said))\n")
    said, stderr = python_json(env, code)
    assert len(said) == 2, said
    chdb = Path(settings.chdb_path).resolve()
    for kind, text in said:
        assert kind == "FolderHeld", (kind, text)
        assert f"the chdb folder {chdb} is open in another process" in text, text
        assert "shared.control.deployment.select().settings" in text and "VERIBUS_NATS_URL" in text, text
    assert "Cannot lock file" not in stderr and "BAD_ARGUMENTS" not in stderr, stderr
