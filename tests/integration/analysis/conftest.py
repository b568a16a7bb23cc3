"""Fixtures of the analysis tests against the real engine (embedded chdb). chdb opens one folder
per process: every test here uses one session folder (`analysis_folder`), a store that is opened
per module and closed at its end, and its own database (`settings`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.core import events
from shared.core.config import Settings
from shared.store.engine import Store, open_store
from shared.store.rows import result_to_row
from tests.support.analysis_store import RUN_A, RUN_B, stage_events
from tests.support.results import grid_results, spec_results

_FOLDER: dict[str, Path] = {}


@pytest.fixture(scope="session")
def analysis_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one chdb folder of this process for the analysis tests."""
    if "home" not in _FOLDER:
        _FOLDER["home"] = tmp_path_factory.mktemp("veribus-analysis")
    return _FOLDER["home"]


@pytest.fixture(scope="module")
def settings(analysis_folder: Path) -> Settings:
    return Settings(home=analysis_folder, clickhouse_database=f"a_{uuid.uuid4().hex[:12]}",
                    nats_url="nats://127.0.0.1:1")  # nothing listens there: no projector


@pytest.fixture(scope="module")
def store(settings: Settings) -> Iterator[Store]:
    """Two runs written through the store: the 36-result grid (with events and its run row) and
    the 4 results of the spec's examples."""
    st = open_store(settings)
    try:
        grid = grid_results()
        st.insert_results([result_to_row(r, RUN_A, version=1) for r in grid])
        st.insert_results([result_to_row(r, RUN_B, version=1) for r in spec_results()])
        st.insert_runs([events.RunRequested(
            run_id=RUN_A, timestamp="2025-06-15T10:00:00Z", job_count=36, answer_count=18, run_name="grid",
            benchmark_name="grid-bench", evaluation_mode="template_and_rubric", unfinished_skipped=["draft-1", "draft-2"],
            config={"answering_models": [{"model_name": "model-a", "temperature": 0.0},
                                         {"model_name": "model-b", "temperature": 0.0}],
                    "parsing_models": [{"model_name": "judge-1"}, {"model_name": "judge-2"}],
                    "replicate_count": 3, "evaluation_mode": "template_and_rubric"})])
        st.insert_events(stage_events(grid, RUN_A))
        yield st
    finally:
        st.client.command(f"DROP DATABASE IF EXISTS {settings.clickhouse_database}")
        st.close()

