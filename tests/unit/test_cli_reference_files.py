"""The reference's exports read as RUN by the analysis commands (`RUN` may be a results file):
no deployment is asked, and nothing points at a store the file's rows are not in."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.cli.commands import main
from tests.conftest import REFERENCE

FULL = REFERENCE / "export_format" / "results_export_full.json"


def test_report_of_a_reference_export_points_at_no_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """It printed `run id: results_export_full - rows: veribus query "SELECT * ... WHERE run_id =
    'results_export_full'"`, a query that finds nothing: the rows are in the file."""
    monkeypatch.setenv("VERIBUS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)
    assert main(["report", str(FULL)]) == 4  # q-timeout ended in error (format 2.2: metadata.failure)
    out = capsys.readouterr().out
    assert "Total samples: 2" in out and "Errors: 1" in out and "1 x generate_answer / timeout" in out
    assert "veribus query" not in out and "run id:" not in out, out
    assert not (tmp_path / "home").exists()  # no stack, no chdb folder made for a file
