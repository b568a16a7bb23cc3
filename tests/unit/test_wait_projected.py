"""`wait.wait_projected` (what `veribus run` waits for before its summary): done as soon as the
store has every row of the run, asks again after errors, gives up after its timeout."""

from __future__ import annotations

from typing import Any

import pytest

from shared.control import wait
from shared.core.config import Settings
from shared.store.engine import QueryResult

pytestmark = pytest.mark.unit


class _Store:
    """Answers the count query from a script of counts (an exception is raised, not returned)."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.asked: list[dict[str, Any]] = []
        self.sleeps: list[float] = []

    def query(self, settings: Settings, sql: str, params: dict[str, Any]) -> QueryResult:
        self.asked.append(params)
        a = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(a, Exception):
            raise a
        return QueryResult(columns=["count()"], rows=[[a]])


def _patch(monkeypatch: pytest.MonkeyPatch, store: _Store, clock: list[float]) -> None:
    monkeypatch.setattr(wait, "run_query", store.query)

    def sleep(s: float) -> None:
        store.sleeps.append(s)
        clock[0] += s

    monkeypatch.setattr(wait.time, "sleep", sleep)
    monkeypatch.setattr(wait.time, "monotonic", lambda: clock[0])


def test_returns_once_every_row_is_there_and_polls_less_often_as_it_waits(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path) -> None:  # noqa: ANN001
    store = _Store([0, RuntimeError("projector starting"), 3, 5, 7, 10])
    _patch(monkeypatch, store, [0.0])
    assert wait.wait_projected(Settings(home=tmp_path), "run-1", 10)
    assert len(store.asked) == 6 and store.asked[0] == {"r": "run-1"}
    assert store.sleeps[0] == pytest.approx(0.02) and store.sleeps == sorted(store.sleeps)
    assert max(store.sleeps) <= 0.25


def test_gives_up_after_its_timeout(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    store = _Store([4])
    _patch(monkeypatch, store, [0.0])
    assert not wait.wait_projected(Settings(home=tmp_path), "run-1", 5, timeout=3.0)
    assert sum(store.sleeps) == pytest.approx(3.0) and max(store.sleeps) == pytest.approx(0.25)
