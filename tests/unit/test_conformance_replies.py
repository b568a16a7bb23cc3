"""Conformance with real judge replies, through the whole pipeline: the reference's recorded
claude-haiku-4-5 abstention replies (e2e_abstention/) are the judge's replies for the question and
response each recording holds, and the finalized records must carry what the reply decided - the
verdict, the reasoning text, the override, and the reference's failure entry - with parsing and
verification skipped exactly when the model abstained.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from shared.core import events
from shared.core.ids import template_id_for
from shared.runtime.llm.reply import extract_json
from tests.conftest import LLM_RESPONSES
from tests.support.conformance import ScriptedJudge, run_job

TEMPLATE = '''from karenina.schemas.entities import BaseAnswer
from pydantic import Field


class Answer(BaseAnswer):
    answer: str = Field(description="The answer the response gives")

    def model_post_init(self, __context):
        self.correct = {"answer": "recorded"}

    def verify(self) -> bool:
        return bool(self.answer)
'''
RECORDED = sorted((LLM_RESPONSES / "e2e_abstention").glob("*.json"))


def _between(text: str, tag: str) -> str:
    m = re.search(rf"<{tag}>\s*(.*?)\s*</{tag}>", text, re.S)
    assert m, f"recording without <{tag}>"
    return m.group(1)


def _recording(path: Path) -> tuple[str, str, str]:
    data = json.loads(path.read_text(encoding="utf-8"))
    user = next(m["content"] for m in data["request"]["messages"] if "human" in m["type"].lower())
    return _between(user, "original_question"), _between(user, "model_response"), data["response"]["content"]


def test_the_recordings_hold_both_verdicts() -> None:
    verdicts = {extract_json(_recording(p)[2])["abstention_detected"] for p in RECORDED}
    assert verdicts == {True, False} and len(RECORDED) == 10


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem[:8] for p in RECORDED])
def test_recorded_abstention_reply_sets_the_record(path: Path) -> None:
    question, response, reply = _recording(path)
    oracle = json.loads(re.sub(r"^```(?:json)?\s*|\s*```$", "", reply.strip()))  # independent of extract_json
    job = events.Job(
        run_id="rec", result_id=path.stem[:16], answer_id=path.stem[:16], question_id=path.stem[:16],
        question_text=question,
        answering=events.ModelSpec(model_name="recorded", interface="manual",
                                   manual_traces={path.stem[:16]: response}),
        parsing=events.ModelSpec(model_name="claude-haiku-4-5"), timestamp="2026-01-11T21:00:00+00:00",
        template_code=TEMPLATE, template_id=template_id_for(TEMPLATE), options={"abstention_enabled": True},
    )
    judge = ScriptedJudge({"abstention_check": reply, "parsing": {"answer": "recorded"}})
    r = asyncio.run(run_job(job, judge, finalized_at=1.0))
    t = r.template
    assert t is not None and t.raw_llm_response == response and r.evaluation_input == response
    assert t.abstention_check_performed is True
    assert t.abstention_detected is oracle["abstention_detected"]
    assert t.abstention_reasoning == oracle["reasoning"]
    assert t.abstention_override_applied is oracle["abstention_detected"]
    # the judge saw the recorded question and response
    (msgs,) = judge.prompts("abstention_check")
    assert question in msgs[-1]["content"] and response in msgs[-1]["content"]
    if oracle["abstention_detected"]:
        assert [s for s, _ in judge.calls] == ["abstention_check"]
        assert t.verify_result is False and t.parsed_llm_response is None
        assert r.metadata.failure == {"category": "abstention", "stage": "abstention_check",
                                      "reason": oracle["reasoning"].strip()[:500], "details": None,
                                      "group": "abstained"}
        assert r.metadata.completed_without_errors is True  # a verdict: it counts against accuracy
    else:
        assert [s for s, _ in judge.calls] == ["abstention_check", "parsing"]
        assert t.verify_result is True and r.metadata.failure is None and r.metadata.completed_without_errors
