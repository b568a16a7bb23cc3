"""The tool-using answering agent (spec/003 stage 2, MCP path): an LLM <-> MCP tool loop.

The model gets the MCP servers' tools as OpenAI function specs (named `mcp__<server>__<tool>`,
the Claude Agent SDK convention; a bare tool name that is unique across servers is accepted
too) through `LLMClient.complete(..., tools=...)`. Each reply's tool calls are run on their
servers (concurrently within a turn) and their results appended, until the model answers
without tool calls or `max_turns` model calls have been made; the tool calls of that last
turn are then not run and `recursion_limit_reached` is set.

What the run leaves for the result (spec/002 3.2, 3.4), following the reference:
- `trace_messages`: the agent's own messages (not the prompt, which the result records
  elsewhere): `{"role": "assistant", "content", "tool_calls": [{"id", "name", "arguments"}]}`
  and `{"role": "tool", "content", "tool_call_id", "name", "is_error"}`;
- `raw_llm_response`: that trace as text in the reference's raw-trace format
  (`--- AI Message ---` / `--- Tool Message (call_id: ...) ---` blocks), so stages that use the
  full trace see the tool calls, while the guards extract the final AI message from
  `trace_messages` for stages that use only the answer;
- `agent_metrics`: iterations, tool calls, tools used, per-tool counts and suspected failed
  tool calls (an MCP error result, or a result whose text reads like an error);
- usage summed over the turns.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.core import prompts
from shared.core.config import Settings
from shared.core.events import Job
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import add_usage, usage_entry
from shared.runtime.mcp import MCPPool, MCPTool, ToolOutcome

# What the model reads of one tool result, and what the trace (and so the event) keeps of it:
# events travel over NATS (1 MB default max payload) and land in ClickHouse rows.
_mcp = Settings.from_env("mcp_max_result_chars", "mcp_max_trace_chars")  # one read, just these fields
MAX_TOOL_RESULT_CHARS = _mcp.mcp_max_result_chars
MAX_TRACE_TOOL_CHARS = _mcp.mcp_max_trace_chars

# A tool result "looks like" a failure (reference: suspect_failed_tool_calls). One alternation,
# compiled once, case-insensitive, on word boundaries so "terror"/"errorless" do not match.
SUSPECT_FAILURE = re.compile(
    r"\b(?:errors?|failed|failure|exceptions?|traceback|stack\s+trace|timed\s+out|timeout|invalid"
    r"|unauthori[sz]ed|forbidden|not\s+found|cannot|unable\s+to|denied"
    r"|(?:HTTP|status(?:\s+code)?)\W{0,3}[45]\d\d|40[0134]|429|50[0234])\b",
    re.IGNORECASE,
)


class Toolbox(Protocol):
    """What the loop needs from the tools (an `MCPToolbox`, or a double in tests)."""

    @property
    def specs(self) -> list[dict[str, Any]]: ...

    async def call(self, name: str, arguments: dict[str, Any]) -> tuple[MCPTool | None, ToolOutcome]: ...


@dataclass
class AgentRun:
    """The outcome of one agent run (see module docstring)."""

    final_text: str
    trace: list[dict[str, Any]]
    usage: dict[str, Any]
    metrics: dict[str, Any]
    recursion_limit_reached: bool
    servers: list[str] = field(default_factory=list)

    @property
    def raw_response(self) -> str:
        return render_trace(self.trace)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - limit} more characters not kept]"


def _parse_call(raw: dict[str, Any], turn: int, index: int) -> tuple[str, str, dict[str, Any] | None, str]:
    """(id, name, arguments or None, problem) of an OpenAI-format tool call."""
    fn = raw.get("function") if isinstance(raw.get("function"), dict) else raw
    call_id = str(raw.get("id") or f"call_{turn}_{index}")
    name = str(fn.get("name") or "")
    args_raw = fn.get("arguments", fn.get("input", {}))
    if isinstance(args_raw, dict):
        return call_id, name, args_raw, ""
    try:
        args = json.loads(args_raw or "{}")
    except (TypeError, ValueError) as exc:
        return call_id, name, None, f"arguments are not valid JSON ({exc}): {str(args_raw)[:200]!r}"
    if not isinstance(args, dict):
        return call_id, name, None, f"arguments must be a JSON object, got {type(args).__name__}"
    return call_id, name, args, ""


def _raw_args(raw: dict[str, Any]) -> Any:
    fn = raw.get("function") if isinstance(raw.get("function"), dict) else raw
    return fn.get("arguments", fn.get("input", ""))


async def run_agent(job: Job, llm: LLMClient, toolbox: Toolbox, servers: list[str] | None = None) -> AgentRun:
    """Run the tool loop for `job`'s question (prompt built as for plain generation)."""
    model = job.answering
    specs = toolbox.specs
    convo: list[dict[str, Any]] = list(
        prompts.answer_messages(job.question_text, model.system_prompt, job.few_shot_examples))
    trace: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    max_turns = max(1, int(model.max_turns))
    final_text = ""
    limit_reached = False
    for turn in range(1, max_turns + 1):
        reply = await llm.complete(model, convo, stage="answer_generation", replicate=job.replicate,
                                   tools=specs or None)
        usage = add_usage(usage, usage_entry(reply))
        final_text = reply.text or ""
        calls = [_parse_call(tc, turn, i) for i, tc in enumerate(reply.tool_calls)]
        step: dict[str, Any] = {"role": "assistant", "content": final_text}
        if calls:  # unparseable arguments are kept as the model sent them
            step["tool_calls"] = [{"id": cid, "name": name, "arguments": args if args is not None else _raw_args(tc)}
                                  for (cid, name, args, _), tc in zip(calls, reply.tool_calls, strict=True)]
        trace.append(step)
        if not calls:
            break
        if turn == max_turns:
            limit_reached = True
            break
        convo.append({
            "role": "assistant", "content": final_text or None,
            "tool_calls": [{"id": cid, "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args) if args is not None
                                         else str(_raw_args(tc))}}
                           for (cid, name, args, _), tc in zip(calls, reply.tool_calls, strict=True)],
        })
        outcomes = await asyncio.gather(*(_run_call(toolbox, name, args, problem)
                                          for _cid, name, args, problem in calls))
        for (cid, name, _args, _problem), (tool, outcome) in zip(calls, outcomes, strict=True):
            shown = tool.exposed if tool is not None else name
            convo.append({"role": "tool", "tool_call_id": cid, "content": _clip(outcome.text, MAX_TOOL_RESULT_CHARS)})
            trace.append({"role": "tool", "content": _clip(outcome.text, MAX_TRACE_TOOL_CHARS), "tool_call_id": cid,
                          "name": shown, "is_error": outcome.is_error})
    metrics = agent_metrics(trace)
    metrics["limit_reached"] = limit_reached
    return AgentRun(final_text=final_text, trace=trace, usage=usage, metrics=metrics,
                    recursion_limit_reached=limit_reached, servers=sorted(servers or []))


async def _run_call(toolbox: Toolbox, name: str, args: dict[str, Any] | None,
                    problem: str) -> tuple[MCPTool | None, ToolOutcome]:
    if problem or args is None:
        return None, ToolOutcome(f"Error: could not call tool {name!r}: {problem}", True)
    return await toolbox.call(name, args)


async def answer_with_tools(job: Job, llm: LLMClient, pool: MCPPool) -> AgentRun:
    """Connect `job`'s MCP servers (raises MCPConnectionError) and run the agent."""
    toolbox = await pool.toolbox(job.answering.mcp_servers)
    return await run_agent(job, llm, toolbox, list(job.answering.mcp_servers))


# ---------------------------------------------------------------- trace -> metrics / text


def _tool_calls_of(msg: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(id, name, arguments) of an AI message's tool calls, in our, OpenAI's or the reference's shape."""
    out = []
    for tc in msg.get("tool_calls") or []:
        if not isinstance(tc, dict):
            continue
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        args = fn.get("arguments", fn.get("args", fn.get("input", {})))
        out.append((str(tc.get("id") or ""), str(fn.get("name") or ""), args))
    return out


def _result_call_id(msg: dict[str, Any]) -> str:
    """The id of the call a tool message answers (ours/OpenAI's `tool_call_id`, or the reference's)."""
    result = msg.get("tool_result") if isinstance(msg.get("tool_result"), dict) else {}
    return str(msg.get("tool_call_id") or result.get("tool_use_id") or "")


def _role(msg: dict[str, Any]) -> str:
    role = str(msg.get("role") or msg.get("type") or "")
    return {"ai": "assistant", "human": "user"}.get(role, role)


def agent_metrics(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """iterations (AI messages), tool_calls (tool results), tools_used, tool_call_counts,
    suspect_failed_tool_calls / suspect_failed_tools (an error result, or error-like text)."""
    iterations = 0
    tool_results = 0
    counts: dict[str, int] = {}
    names_by_id: dict[str, str] = {}
    suspect = 0
    suspect_tools: set[str] = set()
    for msg in trace:
        if not isinstance(msg, dict):
            continue
        role = _role(msg)
        if role == "assistant":
            iterations += 1
            for cid, name, _args in _tool_calls_of(msg):
                counts[name] = counts.get(name, 0) + 1
                if cid:
                    names_by_id[cid] = name
        elif role == "tool":
            tool_results += 1
            result = msg.get("tool_result") if isinstance(msg.get("tool_result"), dict) else {}
            call_id = _result_call_id(msg)
            name = names_by_id.get(call_id) or str(msg.get("name") or "")
            failed = bool(msg.get("is_error") or result.get("is_error")) or str(
                msg.get("status") or "").lower() in ("error", "failed", "failure")
            if not failed:
                failed = SUSPECT_FAILURE.search(_content_text(msg.get("content"))) is not None
            if failed:
                suspect += 1
                if name:
                    suspect_tools.add(name)
    return {
        "iterations": iterations,
        "tool_calls": tool_results,
        "tools_used": sorted(counts),
        "tool_call_counts": dict(sorted(counts.items())),
        "suspect_failed_tool_calls": suspect,
        "suspect_failed_tools": sorted(suspect_tools),
    }


def render_trace(trace: list[dict[str, Any]]) -> str:
    """The trace as text, in the reference's raw-trace layout."""
    blocks: list[str] = []
    for msg in trace:
        role = _role(msg)
        content = _content_text(msg.get("content"))
        if role == "assistant":
            lines = ["--- AI Message ---"]
            if content:
                lines.append(content)
            calls = _tool_calls_of(msg)
            if calls:
                lines.append("Tool Calls:")
                for cid, name, args in calls:
                    lines += [f"  {name} ({cid})", f"   Call ID: {cid}", f"   Args: {args!r}"]
            blocks.append("\n".join(lines))
        elif role == "tool":
            blocks.append(f"--- Tool Message (call_id: {_result_call_id(msg)}) ---\n{content}")
        elif role == "user":
            blocks.append(f"--- Human Message ---\n{content}")
        elif role == "system":
            blocks.append(f"--- System Message ---\n{content}")
    return "\n\n".join(blocks)
