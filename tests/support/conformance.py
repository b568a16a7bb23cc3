"""Run one planned job through every stage function, without a bus, the way the services chain
them: generation -> guards -> (parsing -> verification) and (rubric), then the fold.

The model port is a scripted judge: replies by stage (and, when a stage maps to a dict keyed by
question text, by question), returned through the same validators the real `LLMClient` applies.
The template sandbox and the callable-trait runner are the real ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from services.generation.stage import generate_answer
from services.guards.stage import check_guards
from services.parsing.stage import parse_template
from services.rubric.stage import evaluate_rubric
from services.verification.stage import verify_template
from shared.core import events
from shared.core.fold import fold_result, needs_rubric, needs_template
from shared.core.models import VerificationResult
from shared.runtime.llm.reply import LLMReply, extract_json
from shared.templates.calls import validate_template

Reply = Any  # dict (parsed JSON), str (answer text, or a judge's raw reply), Exception, or callable(messages)


class ByQuestion(dict):  # type: ignore[type-arg]
    """Replies for one stage keyed by question text (the longest question quoted in the prompt wins)."""


class ScriptedJudge:
    """`LLMClient.complete` double: `replies[stage]` is a reply, or a `ByQuestion` of replies."""

    def __init__(self, replies: dict[str, Reply]) -> None:
        self.replies = replies
        self.calls: list[tuple[str, list[dict[str, Any]]]] = []

    def prompts(self, stage: str) -> list[list[dict[str, Any]]]:
        return [m for s, m in self.calls if s == stage]

    async def complete(self, model: events.ModelSpec, messages: list[dict[str, Any]], *, stage: str,
                       response_schema: dict[str, Any] | None = None, validate: Callable[[Any], Any] | None = None,
                       **_: Any) -> LLMReply:
        self.calls.append((stage, messages))
        if stage not in self.replies:
            raise AssertionError(f"unexpected model call at stage {stage!r}")
        value = self.replies[stage]
        if isinstance(value, ByQuestion):
            text = "\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))
            matches = [q for q in value if q in text]
            if not matches:
                raise AssertionError(f"no scripted {stage} reply for this prompt")
            value = value[max(matches, key=len)]
        if callable(value) and not isinstance(value, dict):
            value = value(messages)
        if isinstance(value, Exception):
            raise value
        usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15, "model": model.model_name}
        if isinstance(value, str):
            if response_schema is None:
                return LLMReply(text=value, usage=usage)
            # a recorded model reply: read it the way LLMClient does (fenced JSON, JSON in prose)
            obj = extract_json(value)
            return LLMReply(text=value, usage=usage, parsed=validate(obj) if validate else obj)
        parsed = validate(value) if validate else value
        return LLMReply(text=str(value), usage=usage, parsed=parsed)


def _copy(state: events.State) -> events.State:
    return msgspec.json.decode(msgspec.json.encode(state), type=events.State)


async def run_job(job: events.Job, judge: ScriptedJudge, finalized_at: float = 0.0) -> VerificationResult:
    """The job's finalized result, stage by stage as the services would produce it."""
    info = await validate_template(job.template_code, job.question_id) if job.template_code else None
    state = await generate_answer(job, judge)  # type: ignore[arg-type]
    state = await check_guards(job, state, judge, info.json_schema if info is not None else None)  # type: ignore[arg-type]
    template_state = rubric_state = None
    if needs_rubric(job):
        rubric_state = await evaluate_rubric(job, _copy(state), judge)  # type: ignore[arg-type]
    if needs_template(job):
        template_state = await parse_template(job, _copy(state), judge, info)  # type: ignore[arg-type]
        template_state = await verify_template(job, template_state)
    return fold_result(job, template_state, rubric_state, finalized_at or state.started_at)
