"""The MCP agent end to end, all real processes on loopback: the LLM simulator (scripted to emit
tool calls) called through the real LLMClient/litellm, and our own MCP server
(tests/fixtures/mcp_server.py) over stdio (spawned by the MCP pool) and over streamable HTTP
(started here on a free port). Every process is stopped by PID in teardown."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from services.generation.stage import generate_answer
from services.guards.stage import check_guards
from shared.control.processes import free_port
from shared.core import events
from shared.runtime.bus import wait_for_port
from shared.runtime.llm.client import LLMClient
from shared.runtime.mcp import MCPPool
from tests.support.procs import stop_process

ROOT = Path(__file__).resolve().parents[2]
STDIO = "stdio:python -m tests.fixtures.mcp_server"

GOOD_Q = "Which city is the capital of Kenya, and what is 2+3?"
LOOP_Q = "Keep adding numbers until told to stop, please."
SCRIPT = {
    "questions": [
        {"match": GOOD_Q, "answer": "The capital of Kenya is Nairobi, and 2+3 = 5.",
         "tool_calls": [
             [{"name": "mcp__geo__lookup_capital", "arguments": {"country": "Kenya"}},
              {"name": "mcp__calc__add", "arguments": {"a": 2, "b": 3}}],
             [{"name": "mcp__calc__always_fails", "arguments": {}}],
         ]},
        {"match": LOOP_Q, "answer": "never reached",
         "tool_calls": [[{"name": "mcp__calc__add", "arguments": {"a": i, "b": 1}}] for i in range(10)]},
    ],
}


def _spawn(cmd: list[str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_for_port("127.0.0.1", port, 20)
    except TimeoutError:
        stop_process(proc)
        raise
    return proc


@pytest.fixture(scope="module")
def simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    script = tmp_path_factory.mktemp("sim") / "script.json"
    script.write_text(json.dumps(SCRIPT))
    proc = _spawn([sys.executable, "-m", "infra.simulator", "--host", "127.0.0.1", "--port", str(port),
                   "--script", str(script)], port)
    yield f"http://127.0.0.1:{port}"
    stop_process(proc)


@pytest.fixture(scope="module")
def http_mcp() -> Iterator[str]:
    port = free_port()
    proc = _spawn([sys.executable, "-m", "tests.fixtures.mcp_server", "--http", "--port", str(port)], port)
    yield f"http://127.0.0.1:{port}/mcp"
    stop_process(proc)


@pytest.fixture
async def pool() -> AsyncIterator[MCPPool]:
    p = MCPPool(connect_timeout=20, call_timeout=5)
    yield p
    await p.aclose()


def _stdio_children() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "tests.fixtures.mcp_server" in " ".join(child.cmdline()) and "--http" not in child.cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _job(simulator: str, question: str, servers: dict[str, str], max_turns: int = 10) -> events.Job:
    answering = events.ModelSpec(model_name="openai/sim-agent", api_base=f"{simulator}/v1", mcp_servers=servers,
                                 max_turns=max_turns, system_prompt="Answer with the help of the tools.",
                                 max_retries=0, timeout=20)
    return events.Job(run_id="r1", result_id="res-agent", answer_id="ans-agent", question_id="q-agent",
                      question_text=question, answering=answering,
                      parsing=events.ModelSpec(model_name="openai/sim-judge", api_base=f"{simulator}/v1"),
                      timestamp="2026-01-01T00:00:00+00:00", evaluation_mode="template_only")


def _sim(simulator: str, method: str, path: str) -> Any:
    with httpx.Client(base_url=simulator, timeout=5) as http:
        return (http.post(path) if method == "POST" else http.get(path)).json()


async def test_agent_over_stdio_and_http(simulator: str, http_mcp: str, pool: MCPPool) -> None:
    _sim(simulator, "POST", "/simulator/reset")
    j = _job(simulator, GOOD_Q, {"geo": STDIO, "calc": http_mcp})
    st = await generate_answer(j, LLMClient(), pool)
    assert st.error is None, st.error
    t = st.template
    trace = t["trace_messages"]
    assert [m["role"] for m in trace] == ["assistant", "tool", "tool", "assistant", "tool", "assistant"]
    assert [c["name"] for c in trace[0]["tool_calls"]] == ["mcp__geo__lookup_capital", "mcp__calc__add"]
    assert trace[0]["tool_calls"][0]["arguments"] == {"country": "Kenya"}
    # results from the real servers: the stdio one and the HTTP one
    assert [(m["name"], m["content"], m["is_error"]) for m in trace if m["role"] == "tool"] == [
        ("mcp__geo__lookup_capital", "The capital of Kenya is Nairobi.", False),
        ("mcp__calc__add", "5", False),
        ("mcp__calc__always_fails", "Error executing tool always_fails: upstream service unavailable (HTTP 503)",
         True),
    ]
    assert [m["tool_call_id"] for m in trace if m["role"] == "tool"] == [
        trace[0]["tool_calls"][0]["id"], trace[0]["tool_calls"][1]["id"], trace[3]["tool_calls"][0]["id"]]
    assert trace[-1] == {"role": "assistant", "content": "The capital of Kenya is Nairobi, and 2+3 = 5."}
    assert t["recursion_limit_reached"] is False
    assert t["answering_mcp_servers"] == ["calc", "geo"]
    assert t["agent_metrics"] == {
        "iterations": 3, "tool_calls": 3,
        "tools_used": ["mcp__calc__add", "mcp__calc__always_fails", "mcp__geo__lookup_capital"],
        "tool_call_counts": {"mcp__calc__add": 1, "mcp__calc__always_fails": 1, "mcp__geo__lookup_capital": 1},
        "suspect_failed_tool_calls": 1, "suspect_failed_tools": ["mcp__calc__always_fails"], "limit_reached": False,
    }
    raw = t["raw_llm_response"]
    assert raw.count("--- AI Message ---") == 3 and raw.count("--- Tool Message") == 3
    assert raw.endswith("--- AI Message ---\nThe capital of Kenya is Nairobi, and 2+3 = 5.")
    # usage summed over the three model turns matches what the simulator counted
    stats = _sim(simulator, "GET", "/simulator/stats")
    assert stats["tool_call"] == 2 and stats["answer"] == 1
    usage = st.usage["answer_generation"]
    assert usage["input_tokens"] == stats["prompt_tokens"]
    assert usage["output_tokens"] == stats["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]

    st = await check_guards(j, st, LLMClient(), None)
    assert st.signals.final_ai_message == "The capital of Kenya is Nairobi, and 2+3 = 5."
    assert st.signals.trace_validation_failed is False and st.signals.recursion_limit is False
    assert st.root["evaluation_input"] == "The capital of Kenya is Nairobi, and 2+3 = 5."

    # the stdio server is a child of this process while pooled, and gone once the pool closes
    assert len(_stdio_children()) == 1
    await pool.aclose()
    deadline = time.monotonic() + 10
    while _stdio_children() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _stdio_children() == []


async def test_max_turns_over_http(simulator: str, http_mcp: str, pool: MCPPool) -> None:
    _sim(simulator, "POST", "/simulator/reset")
    j = _job(simulator, LOOP_Q, {"calc": http_mcp}, max_turns=3)
    st = await generate_answer(j, LLMClient(), pool)
    assert st.error is None, st.error
    t = st.template
    assert t["recursion_limit_reached"] is True
    assert [m["content"] for m in t["trace_messages"] if m["role"] == "tool"] == ["1", "2"]
    last = t["trace_messages"][-1]
    assert last["role"] == "assistant" and last["tool_calls"][0]["arguments"] == {"a": 2, "b": 1}
    assert t["agent_metrics"]["iterations"] == 3 and t["agent_metrics"]["limit_reached"] is True
    assert _sim(simulator, "GET", "/simulator/stats")["tool_call"] == 3

    st = await check_guards(j, st, LLMClient(), None)
    assert st.signals.recursion_limit is True and st.signals.trace_validation_failed is True
    assert st.root["trace_extraction_error"] == (
        "trace ends with an AI message that requests tool calls, not an answer")


async def test_unreachable_servers_fail_fast(simulator: str, pool: MCPPool) -> None:
    dead = f"http://127.0.0.1:{free_port()}/mcp"
    st = await generate_answer(_job(simulator, GOOD_Q, {"calc": dead}), LLMClient(), pool)
    assert st.error is not None and st.error.type == "MCPConnectionError"
    assert st.error.message.startswith(f"MCP server 'calc' ({dead}) could not be reached: ConnectError")

    st = await generate_answer(_job(simulator, GOOD_Q, {"geo": "stdio:python -m tests.fixtures.no_such_server"}),
                               LLMClient(), pool)
    assert st.error is not None and "No module named tests.fixtures.no_such_server" in st.error.message
