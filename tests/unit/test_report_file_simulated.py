"""A results file whose rows the offline simulator answered is reported SIMULATED, as the stored run
and its HTML page are: `veribus report FILE` in every format `veribus export` writes (json, jsonl,
csv, parquet) prints `Results:  (SIMULATED LLM)` and its `--output` header says `simulated`; a
file of real models' rows stays unlabelled. Through the CLI's own `main`, no deployment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.analysis.export import export_results
from shared.cli.commands import main
from tests.support.results import GPT, make

FORMATS = ("json", "jsonl", "csv", "parquet")


def _exported(tmp_path: Path, fmt: str, interface: str) -> Path:
    """Two results of `interface`'s models, written as `veribus export FILE --format fmt` writes them."""
    seed = tmp_path / f"seed-{interface}.jsonl"
    export_results([make("q1", GPT, True, interface=interface, run_name="small"),
                    make("q2", GPT, False, interface=interface, run_name="small")], "jsonl", seed)
    out = tmp_path / f"exp-{interface}.{fmt}"
    assert main(["export", str(seed), "--format", fmt, "--output", str(out)]) == 0
    return out


@pytest.fixture(autouse=True)
def _no_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_simulated_results_file_is_reported_simulated(fmt: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    simulated, real = _exported(tmp_path, fmt, "simulator"), _exported(tmp_path, fmt, "litellm")
    capsys.readouterr()
    assert main(["report", str(simulated), "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Results:  (SIMULATED LLM)" in out, out
    assert "Total samples: 2" in out, out
    assert json.loads((tmp_path / "out" / "header.json").read_text())["simulated"] is True
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["simulated"] is True
    # a file of real models' rows stays unlabelled
    assert main(["report", str(real)]) == 0
    out = capsys.readouterr().out
    assert "Results:\n" in out and "SIMULATED" not in out, out
