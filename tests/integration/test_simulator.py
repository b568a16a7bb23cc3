"""The LLM simulator as a real subprocess, called through LLMClient (litellm over loopback HTTP)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.core.events import ModelSpec
from shared.runtime.llm.cache import MemoryCache
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import LLMError
from tests.support.procs import stop_process

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = {
    "defaults": {"true_fields": ["is_sufficient"]},
    "questions": [
        {"match": "What is the capital of France?", "answer": "Paris is the capital.",
         "answers_by_model": {"openai/weak-model": "Lyon, I think."},
         "parsed": {"capital": "Paris"}, "judge": {"confidence": 5}},
        {"match": "Rate limited question here", "errors": [429]},
        {"match": "Flaky server question here", "errors": [500, 500]},
        {"match": "Always failing question here", "errors": [500, 500, 500, 500]},
        {"match": "Malformed judge question here", "judge_errors": ["malformed"], "parsed": {"capital": "Rome"}},
        {"match": "Slow question here", "errors": ["slow"]},
        {"match": "Which variant is most severe?", "answer": "missense_variant",
         "tool_calls": [[{"name": "search", "arguments": {"query": "variant"}}]]},
    ],
}

CAPITAL_SCHEMA = {
    "type": "object",
    "title": "Answer",
    "properties": {
        "capital": {"type": "string", "description": "The capital city"},
        "confidence": {"type": "integer", "minimum": 1, "maximum": 5},
        "is_sufficient": {"type": "boolean"},
        "reasoning": {"type": "string"},
    },
    "required": ["capital"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sim:
    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.api_base = f"{self.url}/v1"
        self.http = httpx.Client(base_url=self.url, timeout=5)

    def get(self, path: str) -> Any:
        return self.http.get(path).json()

    def post(self, path: str, body: Any = None) -> httpx.Response:
        return self.http.post(path, json=body if body is not None else {})

    def stop(self) -> None:
        self.http.close()
        stop_process(self.proc)

    def model(self, name: str = "openai/sim-judge", **kw: Any) -> ModelSpec:
        return ModelSpec(model_name=name, api_base=self.api_base, **kw)


def _start(tmp: Path, *args: str) -> Sim:
    port = _free_port()
    script = tmp / f"script-{port}.json"
    script.write_text(json.dumps(SCRIPT))
    cmd = [sys.executable, "-m", "infra.simulator", "--host", "127.0.0.1", "--port", str(port),
           "--script", str(script), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"simulator exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    else:
        stop_process(proc)
        raise RuntimeError("simulator did not start listening within 20 s")
    return Sim(proc, port)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = _start(tmp_path_factory.mktemp("sim"), "--retry-after", "0.3", "--slow-ms", "3000", "--seed", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = _start(tmp_path_factory.mktemp("slowsim"), "--latency-ms", "100")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tail_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """A long-tailed latency (lognormal, median 40 ms, sigma 2): a few calls take seconds."""
    s = _start(tmp_path_factory.mktemp("tailsim"), "--latency-ms", "40", "--latency-dist", "lognormal",
               "--latency-sigma", "2.0", "--seed", "5")
    yield s
    s.stop()


@pytest.fixture(autouse=True, params=["direct", "litellm"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every behaviour holds on both HTTP paths: the direct OpenAI-compatible one and litellm."""
    monkeypatch.setenv("VERIBUS_LLM_TRANSPORT", request.param)
    return str(request.param)


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> None:
    for name in ("sim", "slow_sim", "tail_sim"):
        if name in request.fixturenames:
            request.getfixturevalue(name).post("/simulator/reset")


def _client(cache: MemoryCache | None = None) -> LLMClient:
    return LLMClient(cache=cache, backoff_base=0.02, backoff_cap=0.1)


def _tokens(text: str) -> int:
    return (len(text) + 3) // 4


# ------------------------------------------------------------------ plain HTTP surface


def test_health_models_and_fingerprint(sim: Sim) -> None:
    assert sim.get("/health")["status"] == "ok"
    ids = {m["id"] for m in sim.get("/v1/models")["data"]}
    assert {"simulator", "openai/weak-model", "weak-model"} <= ids
    for path in ("/v1/chat/completions", "/chat/completions"):
        body = sim.post(path, {"model": "m", "messages": [{"role": "user", "content": "Hello?"}]}).json()
        assert body["system_fingerprint"] == "veribus-simulator"
        assert body["choices"][0]["message"]["content"] == "Simulated answer to: Hello?"
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": _tokens("Simulated answer to: Hello?"),
                                 "total_tokens": 2 + _tokens("Simulated answer to: Hello?")}
    assert sim.post("/v1/chat/completions", {"model": "m", "messages": []}).status_code == 400


def test_script_merge_endpoint(sim: Sim) -> None:
    r = sim.post("/simulator/script", {"questions": [{"match": "Merged question about tea", "answer": "Earl Grey"}]})
    assert r.status_code == 200 and r.json()["entries"] == len(SCRIPT["questions"]) + 1
    body = sim.post("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "Merged question about tea, please"}]}).json()
    assert body["choices"][0]["message"]["content"] == "Earl Grey"
    assert sim.post("/simulator/script", {"questions": [{"answer": "x"}]}).status_code == 400


def test_judge_schema_from_prompt_text(sim: Sim) -> None:
    prompt = ("Parse the answer to: What is the capital of France?\n**JSON SCHEMA:**\n```json\n"
              + json.dumps(CAPITAL_SCHEMA) + "\n```\nYOUR JSON RESPONSE:")
    body = sim.post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": prompt}]}).json()
    assert json.loads(body["choices"][0]["message"]["content"]) == {
        "capital": "Paris", "confidence": 5, "is_sufficient": True, "reasoning": "simulated reasoning"}
    assert sim.get("/simulator/stats")["judge"] == 1


# ------------------------------------------------------------------ through LLMClient / litellm


async def test_answer_per_model_and_usage(sim: Sim) -> None:
    client = _client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    strong = await client.complete(sim.model("openai/strong-model"), msgs, stage="answer_generation")
    weak = await client.complete(sim.model("openai/weak-model"), msgs, stage="answer_generation")
    assert strong.text == "Paris is the capital." and weak.text == "Lyon, I think."
    prompt_tokens = _tokens("Be brief.\nWhat is the capital of France?")
    assert strong.usage == {"input_tokens": prompt_tokens, "output_tokens": _tokens(strong.text),
                            "total_tokens": prompt_tokens + _tokens(strong.text), "model": "openai/strong-model"}
    assert sim.get("/simulator/stats")["by_model"] == {"strong-model": 1, "weak-model": 1}


async def test_structured_call_and_cache(sim: Sim) -> None:
    client = _client(cache=MemoryCache())
    msgs = [{"role": "user", "content": "Extract from the answer to 'What is the capital of France?': Paris."}]
    seen: list[Any] = []

    def validate(obj: Any) -> dict[str, Any]:
        seen.append(obj)
        assert set(obj) == set(CAPITAL_SCHEMA["properties"])
        return obj

    first = await client.complete(sim.model(), msgs, stage="parsing", response_schema=CAPITAL_SCHEMA,
                                  schema_name="Answer", validate=validate)
    assert first.parsed == {"capital": "Paris", "confidence": 5, "is_sufficient": True,
                            "reasoning": "simulated reasoning"}
    assert not first.cached and first.attempts == 1 and first.usage["output_tokens"] == _tokens(first.text)
    req = sim.get("/simulator/requests")[-1]
    assert req["kind"] == "judge"
    second = await client.complete(sim.model(), msgs, stage="parsing", response_schema=CAPITAL_SCHEMA,
                                   schema_name="Answer", validate=validate)
    assert second.cached and second.parsed == first.parsed and second.usage == first.usage
    assert sim.get("/simulator/stats")["requests"] == 1  # the hit did not reach the server
    assert len(seen) == 2  # the cached text is validated again


async def test_429_retry_honours_retry_after(sim: Sim) -> None:
    t0 = time.monotonic()
    reply = await _client().complete(sim.model(max_retries=2), [{"role": "user", "content": "Rate limited question here"}],
                                     stage="answer_generation")
    elapsed = time.monotonic() - t0
    assert reply.attempts == 2 and reply.text.startswith("Simulated answer to:")
    assert elapsed >= 0.3  # the server's Retry-After (0.3 s), well above our 0.02 s backoff base
    assert sim.get("/simulator/stats")["errors_injected"] == {"429": 1}


async def test_500_retries_then_success_and_exhaustion(sim: Sim) -> None:
    reply = await _client().complete(sim.model(max_retries=2), [{"role": "user", "content": "Flaky server question here"}],
                                     stage="answer_generation")
    assert reply.attempts == 3
    with pytest.raises(LLMError) as ei:
        await _client().complete(sim.model(max_retries=1), [{"role": "user", "content": "Always failing question here"}],
                                 stage="parsing")
    err = ei.value
    assert err.kind == "server_error" and err.status_code == 500 and err.attempts == 2
    assert "openai/sim-judge" in str(err) and "HTTP 500" in str(err) and "2 attempt" in str(err)
    assert sim.get("/simulator/stats")["errors_injected"] == {"500": 4}


async def test_malformed_json_retried_with_feedback(sim: Sim) -> None:
    msgs = [{"role": "user", "content": "Malformed judge question here. Extract the capital."}]
    reply = await _client().complete(sim.model(), msgs, stage="parsing", response_schema=CAPITAL_SCHEMA)
    assert reply.attempts == 2 and reply.parsed["capital"] == "Rome"
    first, second = sim.get("/simulator/requests")[-2:]
    assert len(first["messages"]) == 1
    bad, feedback = second["messages"][1], second["messages"][2]
    assert bad["role"] == "assistant" and "unterminated" in bad["content"]
    assert feedback["role"] == "user" and "no JSON object found" in feedback["content"]
    assert reply.usage["input_tokens"] == _tokens(msgs[0]["content"]) + _tokens(
        "\n".join(m["content"] for m in second["messages"]))


async def test_timeout_is_retried_then_reported(sim: Sim) -> None:
    msgs = [{"role": "user", "content": "Slow question here"}]
    with pytest.raises(LLMError) as ei:
        await _client().complete(sim.model(timeout=0.5, max_retries=0), msgs, stage="answer_generation")
    assert ei.value.kind == "timeout"
    sim.post("/simulator/reset")
    reply = await _client().complete(sim.model(timeout=0.5, max_retries=1), msgs, stage="answer_generation")
    assert reply.attempts == 2


async def test_tool_calls_then_answer(sim: Sim) -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Which variant is most severe?"}]
    client = _client()
    first = await client.complete(sim.model(), msgs, stage="answer_generation", tools=tools)
    assert len(first.tool_calls) == 1 and first.tool_calls[0]["function"]["name"] == "search"
    assert json.loads(first.tool_calls[0]["function"]["arguments"]) == {"query": "variant"}
    msgs += [first.raw_message, {"role": "tool", "tool_call_id": first.tool_calls[0]["id"], "content": "[]"}]
    second = await client.complete(sim.model(), msgs, stage="answer_generation", tools=tools)
    assert second.tool_calls == [] and second.text == "missense_variant"
    assert sim.get("/simulator/stats")["tool_call"] == 1


async def test_concurrency_limit_respected(slow_sim: Sim) -> None:
    client = _client()
    spec = slow_sim.model(max_concurrency=3)
    t0 = time.monotonic()
    replies = await asyncio.gather(*[
        client.complete(spec, [{"role": "user", "content": f"question {i}"}], stage="answer_generation")
        for i in range(12)
    ])
    elapsed = time.monotonic() - t0
    stats = slow_sim.get("/simulator/stats")
    assert len(replies) == 12 and stats["requests"] == 12
    assert stats["max_in_flight"] == 3
    assert elapsed >= 0.4  # 4 waves of 100 ms
    other = slow_sim.model("openai/other-model", max_concurrency=6)
    slow_sim.post("/simulator/reset")
    await asyncio.gather(*[client.complete(other, [{"role": "user", "content": f"q {i}"}], stage="a")
                           for i in range(12)])
    assert slow_sim.get("/simulator/stats")["max_in_flight"] == 6


async def test_hedged_calls_cut_the_tail_on_a_real_server(tail_sim: Sim) -> None:
    """40 calls at once on a long-tailed server, hedged after 0.3 s: the slowest first copies are
    raced by a second one (the server draws a repeated request afresh) and the batch ends well
    before its slowest first copy would have; every reply is the server's for its question."""
    questions = [f"tail question {i}" for i in range(40)]
    spec = tail_sim.model(max_concurrency=64, hedge_after_s=0.3)
    client = _client()
    await client.complete(spec, [{"role": "user", "content": "warm up"}], stage="answer_generation")  # imports
    tail_sim.post("/simulator/reset")
    t0 = time.monotonic()
    replies = await asyncio.gather(*[client.complete(spec, [{"role": "user", "content": q}], stage="answer_generation")
                                     for q in questions])
    elapsed = time.monotonic() - t0
    drawn = [ms / 1000 for _, ms, _, _ in tail_sim.get("/simulator/delays")]
    first, copies = drawn[:40], drawn[40:]
    hedges = sum(r.retries.get("hedge", 0) for r in replies)
    assert max(first) > 2.0, "the seed gives a slow first copy (else this test shows nothing)"
    # every first copy slower than 1 s was raced; a copy is counted when it starts, so one cancelled
    # before the server read it (its race already won, on a loaded machine) counts but is not drawn
    assert hedges >= len(copies) >= 1 and hedges >= sum(1 for d in first if d > 1.0)
    assert elapsed < max(first) - 0.5
    assert all(r.text and r.attempts == 1 + r.retries.get("hedge", 0) for r in replies)


def test_deterministic_for_same_seed(tmp_path: Path) -> None:
    def run(seed: int) -> list[tuple[int, str]]:
        s = _start(tmp_path, "--error-rate", "0.4", "--error-mix", "429=0.5,500=0.5", "--seed", str(seed),
                   "--latency-ms", "1", "--latency-dist", "lognormal", "--retry-after", "0")
        try:
            out = []
            for i in range(40):
                r = s.post("/v1/chat/completions", {"model": "m", "messages": [
                    {"role": "user", "content": f"question {i % 10}"}]})
                out.append((r.status_code, r.text if r.status_code == 200 else ""))
            return [(code, text.split('"model"', 1)[1] if text else "") for code, text in out]
        finally:
            s.stop()

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c
    codes = [code for code, _ in a]
    assert {200, 429, 500} <= set(codes)


# ------------------------------------------------------------------ shared cache on JetStream KV


@pytest.fixture
def nats_url(nats_server) -> str:  # noqa: ANN001 - tests/conftest.py's real nats-server (JetStream on)
    return nats_server.url


async def test_nats_kv_cache_shared_between_clients(sim: Sim, nats_url: str) -> None:
    import nats

    from shared.runtime.llm.cache import NatsKVCache

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        cache = NatsKVCache(js, bucket="vb_llm_cache_test", ttl_s=60)
        assert await cache.get("missing") is None
        await cache.put("k1", {"text": "t", "usage": {"input_tokens": 1}})
        assert await cache.get("k1") == {"text": "t", "usage": {"input_tokens": 1}}
        status = await (await js.key_value("vb_llm_cache_test")).status()
        assert status.bucket == "vb_llm_cache_test" and status.ttl == 60  # created with the TTL

        msgs = [{"role": "user", "content": "Extract: What is the capital of France?"}]
        first = await _client(cache=cache).complete(sim.model(), msgs, stage="parsing",
                                                    response_schema=CAPITAL_SCHEMA, replicate=1)
        # a second replica (new client, new cache object on the same bucket) does not pay again
        other = NatsKVCache(js, bucket="vb_llm_cache_test")
        again = await _client(cache=other).complete(sim.model(), msgs, stage="parsing",
                                                    response_schema=CAPITAL_SCHEMA, replicate=1)
        assert not first.cached and again.cached
        assert again.parsed == first.parsed and again.usage == first.usage
        assert sim.get("/simulator/stats")["requests"] == 1
    finally:
        await nc.close()


# ------------------------------------------------------------------ CPU measurements (printed, not asserted)


async def test_llm_client_cpu_per_call(sim: Sim) -> None:
    client = _client()
    spec = sim.model(max_concurrency=16)
    schema = {"type": "object", "properties": {"result": {"type": "integer"}}}
    for i in range(20):  # warm-up: litellm's lazy imports and client cache
        await client.complete(spec, [{"role": "user", "content": f"warm {i}"}], stage="w", response_schema=schema)
    n = 200
    t0 = time.process_time()
    sem = asyncio.Semaphore(16)

    async def one(i: int) -> Any:
        async with sem:
            return await client.complete(spec, [{"role": "user", "content": f"What is {i}+{i}?"}], stage="parsing",
                                         response_schema=schema)

    replies = await asyncio.gather(*[one(i) for i in range(n)])
    per_call_ms = (time.process_time() - t0) * 1000 / n
    print(f"\nLLMClient CPU per structured call through litellm: {per_call_ms:.2f} ms")
    assert all(r.parsed == {"result": 0} for r in replies)


async def test_simulator_cpu_per_request(sim: Sim) -> None:
    import aiohttp
    import psutil

    proc = psutil.Process(sim.proc.pid)
    body = json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "You are a careful evaluator. " * 40},
        {"role": "user", "content": "Extract from: What is the capital of France? Answer: Paris."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": CAPITAL_SCHEMA}}}).encode()
    n = 3000
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as http:
        async def worker(k: int) -> None:
            for _ in range(k):
                async with http.post(sim.api_base + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200
                    await r.read()

        before = proc.cpu_times()
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(n // 30) for _ in range(30)])
        wall = time.perf_counter() - t0
        after = proc.cpu_times()
    cpu_ms = ((after.user - before.user) + (after.system - before.system)) * 1000 / n
    print(f"\nsimulator: {cpu_ms:.3f} ms CPU per judge request ({1000 / cpu_ms:.0f} req/s per core; "
          f"{n / wall:.0f} req/s wall with the client on the same machine)")
