"""The MCP agent loop without a bus or a model server: a scripted LLM double drives the loop and
the tools are our own MCP server (tests/fixtures/mcp_server.py) connected in-process, so every
tool call goes through the real `mcp` client session; guards and fold run on the result."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from services.generation.agent import SUSPECT_FAILURE, agent_metrics, render_trace
from services.generation.stage import generate_answer
from services.guards.stage import check_guards
from shared.core import events, prompts
from shared.core.fold import fold_result
from shared.runtime.llm.reply import LLMError, LLMReply
from shared.runtime.mcp import MCPPool, exposed_tool_name, parse_target
from tests.conftest import LLM_RESPONSES
from tests.fixtures.mcp_server import build_server

TOOLS = "inproc:test-tools"


class AgentLLM:
    """Replies turn by turn: a list of (name, arguments) tool calls, a text answer, or an exception.
    The last entry repeats once the script runs out."""

    def __init__(self, turns: list[Any]) -> None:
        self.turns = turns
        self.calls: list[dict[str, Any]] = []

    async def complete(self, model: events.ModelSpec, messages: list[dict[str, Any]], *, stage: str,
                       tools: list[dict[str, Any]] | None = None, replicate: int | None = None,
                       **_: Any) -> LLMReply:
        n = len(self.calls)
        self.calls.append({"messages": [dict(m) for m in messages], "tools": tools, "stage": stage,
                           "replicate": replicate})
        step = self.turns[min(n, len(self.turns) - 1)]
        if isinstance(step, Exception):
            raise step
        usage = {"input_tokens": 10 + n, "output_tokens": 5, "total_tokens": 15 + n, "model": model.model_name}
        if isinstance(step, str):
            return LLMReply(text=step, usage=usage)
        tool_calls = [{"id": f"call_{n}_{i}", "type": "function",
                       "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
                      for i, (name, args) in enumerate(step)]
        return LLMReply(text=f"thinking {n}", usage=usage, tool_calls=tool_calls)


@pytest.fixture
async def pool() -> AsyncIterator[MCPPool]:
    p = MCPPool(connect_timeout=10, call_timeout=1, server_objects={TOOLS: build_server()})
    yield p
    await p.aclose()


def job(max_turns: int = 5, servers: dict[str, str] | None = None, **kw: Any) -> events.Job:
    answering = events.ModelSpec(model_name="openai/agent", system_prompt="Use the tools.",
                                 mcp_servers=servers if servers is not None else {"calc": TOOLS},
                                 max_turns=max_turns)
    return events.Job(
        run_id="r", result_id="res1", answer_id="a1", question_id="q1", question_text="What is 2+3?",
        answering=answering, parsing=events.ModelSpec(model_name="openai/j"),
        timestamp="2026-01-01T00:00:00+00:00", evaluation_mode="rubric_only", replicate=2, **kw,
    )


async def test_tool_call_then_answer(pool: MCPPool) -> None:
    llm = AgentLLM([[("mcp__calc__add", {"a": 2, "b": 3})], "The sum is 5."])
    st = await generate_answer(job(), llm, pool)  # type: ignore[arg-type]
    assert st.error is None
    t = st.template
    assert [m["role"] for m in t["trace_messages"]] == ["assistant", "tool", "assistant"]
    call, result, final = t["trace_messages"]
    assert call["tool_calls"] == [{"id": "call_0_0", "name": "mcp__calc__add", "arguments": {"a": 2, "b": 3}}]
    assert result == {"role": "tool", "content": "5", "tool_call_id": "call_0_0", "name": "mcp__calc__add",
                      "is_error": False}
    assert final == {"role": "assistant", "content": "The sum is 5."}
    assert t["recursion_limit_reached"] is False
    assert t["answering_mcp_servers"] == ["calc"]
    assert t["agent_metrics"] == {
        "iterations": 2, "tool_calls": 1, "tools_used": ["mcp__calc__add"], "tool_call_counts": {"mcp__calc__add": 1},
        "suspect_failed_tool_calls": 0, "suspect_failed_tools": [], "limit_reached": False,
    }
    # usage summed over both turns (10+5, 11+5 tokens)
    assert st.usage["answer_generation"] == {"input_tokens": 21, "output_tokens": 10, "total_tokens": 31,
                                             "model": "openai/agent", "model_calls": 2, "cached_replies": 0}
    # the raw response is the whole trace in the reference's layout, ending with the answer
    raw = t["raw_llm_response"]
    assert raw.startswith("--- AI Message ---\nthinking 0\nTool Calls:\n  mcp__calc__add (call_0_0)")
    assert "--- Tool Message (call_id: call_0_0) ---\n5" in raw
    assert raw.endswith("--- AI Message ---\nThe sum is 5.")
    # what the model saw: the tool specs each turn, then its call and the result appended
    first, second = llm.calls
    names = [s["function"]["name"] for s in first["tools"]]
    assert names == ["mcp__calc__add", "mcp__calc__lookup_capital", "mcp__calc__always_fails", "mcp__calc__slow"]
    add_spec = first["tools"][0]["function"]
    assert add_spec["parameters"]["required"] == ["a", "b"] and "Add two numbers" in add_spec["description"]
    assert first["replicate"] == 2 and first["stage"] == "answer_generation"
    assert second["messages"][-2]["tool_calls"][0]["function"] == {"name": "mcp__calc__add",
                                                                   "arguments": '{"a": 2, "b": 3}'}
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_0_0", "content": "5"}

    # the guards validate the trace and hand the final answer to later stages
    st = await check_guards(job(), st, llm, None)  # type: ignore[arg-type]
    assert st.signals.final_ai_message == "The sum is 5."
    assert st.signals.trace_validation_failed is False
    assert [r.status for r in st.stages if r.stage == "trace_validation_autofail"] == ["performed"]


async def test_max_turns_sets_recursion_limit_and_fails_trace_validation(pool: MCPPool) -> None:
    llm = AgentLLM([[("mcp__calc__add", {"a": 1, "b": 1})]])  # asks for a tool call forever
    j = job(max_turns=3)
    st = await generate_answer(j, llm, pool)  # type: ignore[arg-type]
    assert st.error is None
    t = st.template
    assert len(llm.calls) == 3
    assert t["recursion_limit_reached"] is True
    m = t["agent_metrics"]
    # three model turns; the calls of the last turn are not run
    assert (m["iterations"], m["tool_calls"], m["limit_reached"]) == (3, 2, True)
    assert m["tool_call_counts"] == {"mcp__calc__add": 3}
    last = t["trace_messages"][-1]
    assert last["role"] == "assistant" and last["content"] == "thinking 2" and last["tool_calls"]
    assert t["raw_llm_response"].endswith("Args: {'a': 1, 'b': 1}")

    st = await check_guards(j, st, llm, None)  # type: ignore[arg-type]
    assert st.signals.recursion_limit is True
    assert st.signals.trace_validation_failed is True
    assert "requests tool calls" in st.root["trace_extraction_error"]


async def test_failing_tools_are_suspect(pool: MCPPool) -> None:
    llm = AgentLLM([
        [("mcp__calc__always_fails", {}), ("mcp__calc__lookup_capital", {"country": "Atlantis"}),
         ("mcp__calc__lookup_capital", {"country": "Kenya"})],
        "Nairobi.",
    ])
    st = await generate_answer(job(), llm, pool)  # type: ignore[arg-type]
    tools = [m for m in st.template["trace_messages"] if m["role"] == "tool"]
    assert [(m["content"], m["is_error"]) for m in tools] == [
        ("Error executing tool always_fails: upstream service unavailable (HTTP 503)", True),
        ("Country 'Atlantis' not found", False),
        ("The capital of Kenya is Nairobi.", False),
    ]
    m = st.template["agent_metrics"]
    assert m["tool_calls"] == 3
    assert m["suspect_failed_tool_calls"] == 2
    assert m["suspect_failed_tools"] == ["mcp__calc__always_fails", "mcp__calc__lookup_capital"]
    assert m["tools_used"] == ["mcp__calc__always_fails", "mcp__calc__lookup_capital"]
    assert st.template["raw_llm_response"].endswith("Nairobi.")


async def test_bad_tool_calls_come_back_as_errors_and_the_loop_goes_on(pool: MCPPool) -> None:
    llm = AgentLLM([
        [("no_such_tool", {}), ("mcp__calc__add", "{not json"), ("lookup_capital", {"country": "Japan"}),
         ("mcp__calc__slow", {"seconds": 5})],
        "Tokyo.",
    ])
    st = await generate_answer(job(), llm, pool)  # type: ignore[arg-type]
    tools = [m for m in st.template["trace_messages"] if m["role"] == "tool"]
    assert tools[0]["is_error"] and tools[0]["content"].startswith("Error: unknown tool 'no_such_tool'")
    assert tools[1]["is_error"] and "not valid JSON" in tools[1]["content"]
    assert st.template["trace_messages"][0]["tool_calls"][1]["arguments"] == "{not json"
    # a bare name unique across servers is resolved to its namespaced tool
    assert (tools[2]["name"], tools[2]["content"], tools[2]["is_error"]) == (
        "mcp__calc__lookup_capital", "The capital of Japan is Tokyo.", False)
    assert tools[3]["is_error"] and "timed out after 1 s" in tools[3]["content"]
    m = st.template["agent_metrics"]
    assert m["suspect_failed_tool_calls"] == 3
    assert st.template["trace_messages"][-1] == {"role": "assistant", "content": "Tokyo."}


async def test_two_servers_namespace_their_tools(pool: MCPPool) -> None:
    llm = AgentLLM([[("mcp__a__add", {"a": 1, "b": 2}), ("mcp__b__add", {"a": 3, "b": 4})], "3 and 7"])
    j = job(servers={"b": TOOLS, "a": TOOLS})
    st = await generate_answer(j, llm, pool)  # type: ignore[arg-type]
    assert st.template["answering_mcp_servers"] == ["a", "b"]
    assert [m["content"] for m in st.template["trace_messages"] if m["role"] == "tool"] == ["3", "7"]
    assert len(llm.calls[0]["tools"]) == 8
    # an ambiguous bare name is refused rather than guessed
    llm2 = AgentLLM([[("add", {"a": 1, "b": 2})], "?"])
    st2 = await generate_answer(j, llm2, pool)  # type: ignore[arg-type]
    assert st2.template["trace_messages"][1]["is_error"] is True


async def test_few_shot_examples_use_the_shared_prompt_builder(pool: MCPPool) -> None:
    shots = [{"question": "What is 1+1?", "answer": "2"}, {"question": "What is 2+2?", "answer": "4"}]
    j = job(few_shot_examples=shots)
    llm = AgentLLM([[("mcp__calc__add", {"a": 2, "b": 3})], "5"])
    st = await generate_answer(j, llm, pool)  # type: ignore[arg-type]
    expected = prompts.answer_messages(j.question_text, "Use the tools.", shots)
    assert llm.calls[0]["messages"] == expected
    assert llm.calls[1]["messages"][:len(expected)] == expected
    # the prompt is not part of the trace (the result records question, system prompt, few-shot)
    assert [m["role"] for m in st.template["trace_messages"]] == ["assistant", "tool", "assistant"]
    r = fold_result(j, st, st, time.time())
    assert r.metadata.few_shot_enabled is True and r.metadata.few_shot_example_count == 2


async def test_llm_error_and_unreachable_server_are_fatal(pool: MCPPool) -> None:
    llm = AgentLLM([LLMError("rate_limit", "rate_limit: model openai/agent failed after 5 attempt(s) (HTTP 429)")])
    st = await generate_answer(job(), llm, pool)  # type: ignore[arg-type]
    assert st.error is not None and st.error.type == "LLMError" and "429" in st.error.message

    st = await generate_answer(job(servers={"ghost": "stdio:/nonexistent/bin/mcp-server --port 1"}),
                               AgentLLM(["unused"]), pool)  # type: ignore[arg-type]
    assert st.error is not None and st.error.stage == "generate_answer" and st.error.type == "MCPConnectionError"
    assert st.error.message.startswith(
        "MCP server 'ghost' (stdio:/nonexistent/bin/mcp-server --port 1) could not be reached: FileNotFoundError")
    assert [(r.stage, r.status) for r in st.stages] == [("generate_answer", "failed")]


async def test_connections_are_pooled(pool: MCPPool) -> None:
    llm = AgentLLM([[("mcp__calc__add", {"a": 1, "b": 1})], "2"])
    await generate_answer(job(), llm, pool)  # type: ignore[arg-type]
    conn = await pool.connection("calc", TOOLS)
    await generate_answer(job(), AgentLLM([[("mcp__calc__add", {"a": 1, "b": 1})], "2"]), pool)  # type: ignore[arg-type]
    assert await pool.connection("calc", TOOLS) is conn


async def test_manual_message_trace_is_kept_and_not_validated() -> None:
    trace = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "t1", "name": "add", "input": {"a": 2, "b": 3}}]},
        {"role": "tool", "content": "5", "tool_call_id": "t1"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "tool", "content": "trailing tool output", "tool_call_id": "t2"},
    ]
    answering = events.ModelSpec(model_name="manual", interface="manual", manual_traces={"q1": trace},
                                 mcp_servers={"calc": TOOLS})
    j = msgspec.structs.replace(job(), answering=answering)
    llm = AgentLLM([AssertionError("no model call for manual traces")])
    st = await generate_answer(j, llm)  # type: ignore[arg-type]
    assert st.error is None
    assert st.template["trace_messages"] == trace
    assert st.template["raw_llm_response"] == "It is 5."
    assert st.template["agent_metrics"]["tools_used"] == ["add"]
    st = await check_guards(j, st, llm, None)  # type: ignore[arg-type]
    # a trace ending in a tool message would fail validation; manual traces are trusted
    assert [(r.status, r.reason) for r in st.stages if r.stage == "trace_validation_autofail"] == [
        ("skipped", "not an MCP agent trace")]
    assert st.signals.trace_validation_failed is False
    assert st.root["evaluation_input"] == "It is 5."


@pytest.mark.skipif(not (LLM_RESPONSES / "claude_tool_trace").is_dir(), reason="reference traces not present")
def test_metrics_and_rendering_of_a_reference_trace() -> None:
    data = json.loads(next((LLM_RESPONSES / "claude_tool_trace").glob("*.json")).read_text())
    trace = data["trace_messages"]
    m = agent_metrics(trace)
    assert m["iterations"] == 4 and m["tool_calls"] == 3
    assert m["tools_used"] == ["get_open_targets_graphql_schema", "query_open_targets_graphql"]
    assert m["tool_call_counts"] == {"get_open_targets_graphql_schema": 1, "query_open_targets_graphql": 2}
    # "Error calling tool ..." is suspect although the result was not flagged is_error
    tool_texts = [t["content"] for t in trace if t["role"] == "tool"]
    expected = sum(1 for text in tool_texts if SUSPECT_FAILURE.search(text))
    assert m["suspect_failed_tool_calls"] == expected >= 1
    assert "query_open_targets_graphql" in m["suspect_failed_tools"]
    # our rendering reproduces the reference's raw trace block structure
    ours = render_trace(trace)
    headers = [line for line in ours.splitlines() if line.startswith("--- ")]
    theirs = [line for line in data["raw_trace"].splitlines() if line.startswith("--- ")]
    assert headers == theirs
    assert ours.endswith(data["raw_trace"][-200:])


def test_suspect_pattern_and_tool_names() -> None:
    for text in ("Error: boom", "request failed", "HTTP 503 Service Unavailable", "status code: 404",
                 "Traceback (most recent call last)", "gene not found", "Permission denied", "timed out"):
        assert SUSPECT_FAILURE.search(text), text
    for text in ("The capital of France is Paris.", "terrorism statistics", "errorless run", "population 5031",
                 "42"):
        assert not SUSPECT_FAILURE.search(text), text
    assert exposed_tool_name("open targets", "query.graphql") == "mcp__open_targets__query_graphql"
    long = exposed_tool_name("s" * 40, "t" * 40)
    assert len(long) == 64 and long != exposed_tool_name("s" * 40, "t" * 41)


def test_parse_target() -> None:
    import sys

    assert parse_target(" http://127.0.0.1:9/mcp ") == "http://127.0.0.1:9/mcp"
    p = parse_target("stdio:python -m tests.fixtures.mcp_server --flag 'a b'")
    assert (p.command, p.args) == (sys.executable, ["-m", "tests.fixtures.mcp_server", "--flag", "a b"])
    p = parse_target("npx -y @modelcontextprotocol/server-everything")
    assert (p.command, p.args) == ("npx", ["-y", "@modelcontextprotocol/server-everything"])
    with pytest.raises(ValueError, match="empty"):
        parse_target("stdio:  ")


def test_event_loop_isolation_of_default_pool() -> None:
    from shared.runtime.mcp import default_pool

    async def get() -> MCPPool:
        return default_pool()

    a = asyncio.run(get())
    b = asyncio.run(get())
    assert a is not b
