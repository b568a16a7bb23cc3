"""The decode limits and lean jobs together: a job that carries its model specs by reference
(empty until the service hydrates it) passes the limits; an empty model without that
reference is still refused, naming the field."""

from __future__ import annotations

import pytest

from shared.core import events
from shared.core.limits import InvalidEvent, check_job
from shared.runtime.content import MODELS


def _job(**kw: object) -> events.Job:
    base = dict(run_id="run1", result_id="r1", answer_id="a1", question_id="q1", question_text="2+2?",
                answering=events.ModelSpec(model_name=""), parsing=events.ModelSpec(model_name=""),
                timestamp="t")
    base.update(kw)
    return events.Job(**base)  # type: ignore[arg-type]


def test_a_lean_job_passes_the_limits() -> None:
    check_job(_job(refs={MODELS: "c_" + "0" * 40}))


def test_an_empty_model_without_a_reference_is_refused() -> None:
    with pytest.raises(InvalidEvent, match="job.answering.model_name is 0 characters"):
        check_job(_job())
    with pytest.raises(InvalidEvent, match="job.parsing.model_name"):
        check_job(_job(answering=events.ModelSpec(model_name="m"), refs={"q": "c_" + "1" * 40}))
