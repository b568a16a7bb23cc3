"""The two runs the analysis tests load into the real engine (the 36-result grid and the spec's
four results), and the stage events the services would publish for them. The fixtures that
write them are in `tests/integration/analysis/conftest.py`."""

from __future__ import annotations

from typing import Any

from shared.core import events
from shared.core.models import VerificationResult
from shared.store.engine import QueryResult, Store

RUN_A, RUN_B = "20260101T000000-grid0001", "20260101T000000-spec0001"
RUBRIC_WIRE = {"traits": [
    {"type": "llm", "name": "clarity", "kind": "score", "min_score": 1, "max_score": 5, "description": "clear"},
    {"type": "llm", "name": "safe", "kind": "boolean"},
    {"type": "regex", "name": "cites", "pattern": "BCL"},
]}


def job_for(r: VerificationResult, run_id: str) -> events.Job:
    m = r.metadata
    return events.Job(
        run_id=run_id, result_id=m.result_id, answer_id=m.result_id[:8], question_id=m.question_id,
        question_text=m.question_text, answering=events.ModelSpec(model_name=m.answering.model_name),
        parsing=events.ModelSpec(model_name=m.parsing.model_name), timestamp=m.timestamp,
        evaluation_mode="template_and_rubric", rubric=RUBRIC_WIRE, replicate=m.replicate,
    )


def stage_events(results: list[VerificationResult], run_id: str, t0: float = 1_700_000_000.0) -> list[events.Envelope]:
    """The stage events of each result as the services publish them (cumulative stage logs):
    generation 2 s, parsing 0.5 s, verification 0.01 s, rubric 1 s."""
    out = []
    plan = [(events.ANSWER_GENERATED, "generate_answer", 2.0), (events.TEMPLATE_PARSED, "parse_template", 0.5),
            (events.TEMPLATE_VERIFIED, "verify_template", 0.01), (events.RUBRIC_EVALUATED, "rubric_evaluation", 1.0)]
    for i, r in enumerate(results):
        t = t0 + i
        stages: list[events.StageRecord] = []
        for event_type, stage, dur in plan:
            stages = [*stages, events.StageRecord(stage=stage, status="performed", started_at=t, ended_at=t + dur)]
            t += dur
            state = events.State(stages=stages, usage={"answer_generation": {"input_tokens": 100, "output_tokens": 50}})
            out.append(events.make_envelope(event_type, run_id, r.metadata.result_id,
                                            events.StageEvent(job=job_for(r, run_id), state=state), "test/1"))
    return out


class AsyncStoreSource:
    """The viewer's async source (`shared.cli.view.queries`) over an open store, as the projector
    answers it: read-only queries."""

    def __init__(self, st: Store) -> None:
        self.store = st

    async def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        return self.store.query_read_only(sql, params)
