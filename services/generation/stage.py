"""GenerateAnswer (spec/003 stage 2): one answer per question x answering model x replicate,
shared by every judge's job. Three paths: a manual trace is used as given (no model call); a
model with MCP servers runs the tool-using agent (`services.generation.agent`); any other model
gets one plain completion. All three build the prompt with `shared.core.prompts.answer_messages`
(system prompt, few-shot pairs, question).
"""

from __future__ import annotations

import time
from typing import Any

from services.generation import agent
from shared.core import prompts
from shared.core.events import Job, State
from shared.runtime.harness import record, stage_error
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import LLMError, usage_entry
from shared.runtime.mcp import MCPConnectionError, MCPPool, default_pool

STAGE = "generate_answer"


def _manual_answer(job: Job) -> tuple[str, list[dict[str, Any]]]:
    """A pre-recorded answer: a string, or a list of chat messages whose last AI message answers."""
    traces = job.answering.manual_traces
    trace = traces.get(job.question_id, traces.get(job.question_text))
    if trace is None:
        raise KeyError(f"no manual trace for question {job.question_id!r}")
    if isinstance(trace, str):
        return trace, []
    if isinstance(trace, list):
        msgs = [m for m in trace if isinstance(m, dict)]
        ai = [m for m in msgs if m.get("role") in ("assistant", "ai")]
        return (str(ai[-1].get("content", "")) if ai else ""), msgs
    raise TypeError(f"manual trace for question {job.question_id!r} must be a string or a message list")


async def generate_answer(job: Job, llm: LLMClient, mcp: MCPPool | None = None) -> State:
    """Answer `job`'s question; errors are recorded on the state (fatal for the job), never raised.

    `mcp`: the MCP connection pool for agent runs (default: the process-wide pool of this loop).
    """
    started = time.time()
    state = State(started_at=started)
    tmpl: dict[str, Any] = state.template
    tmpl["answering_mcp_servers"] = job.answering.tools or None
    try:
        if job.answering.interface == "manual":
            text, trace = _manual_answer(job)
            tmpl["raw_llm_response"] = text
            tmpl["trace_messages"] = trace
            if trace:
                tmpl["agent_metrics"] = agent.agent_metrics(trace)
        elif job.answering.mcp_servers:
            run = await agent.answer_with_tools(job, llm, mcp if mcp is not None else default_pool())
            tmpl["raw_llm_response"] = run.raw_response
            tmpl["trace_messages"] = run.trace
            tmpl["recursion_limit_reached"] = run.recursion_limit_reached
            tmpl["agent_metrics"] = run.metrics
            state.usage["answer_generation"] = run.usage
        else:
            msgs = prompts.answer_messages(job.question_text, job.answering.system_prompt, job.few_shot_examples)
            reply = await llm.complete(job.answering, msgs, stage="answer_generation", replicate=job.replicate)
            tmpl["raw_llm_response"] = reply.text
            tmpl["trace_messages"] = []
            state.usage["answer_generation"] = usage_entry(reply)
        record(state, STAGE, "performed", started)
    except (LLMError, KeyError, TypeError, MCPConnectionError) as exc:
        state.error = stage_error(STAGE, exc)
        record(state, STAGE, "failed", started, str(exc)[:300])
    return state
