"""Unit tests of the LLM port (shared/runtime/llm/) and the simulator's pure parts (no server, no bus)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.simulator.schema import fill_schema, find_schema_in_text
from infra.simulator.script import Script
from shared.core.events import ModelSpec
from shared.runtime.llm import reply as llm_reply
from shared.runtime.llm import transport as llm_transport
from shared.runtime.llm.cache import MemoryCache, cache_key
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import LLMError, LLMReply, add_usage, extract_json, usage_entry

REF = Path("/work/shared/reference/karenina/llm_responses/claude-haiku-4-5")
JUDGE_DIRS = ["template_parsing", "abstention", "rubric_evaluation"]




@pytest.fixture(autouse=True)
def _litellm_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests drive litellm itself (mock_response); the direct transport has its own tests."""
    monkeypatch.setenv("VERIBUS_LLM_TRANSPORT", "litellm")

def _reference_files() -> list[Path]:
    if not REF.is_dir():
        return []
    dirs = [REF / d for d in JUDGE_DIRS] + sorted(p for p in REF.glob("e2e_*") if p.is_dir())
    return sorted(f for d in dirs for f in d.glob("*.json"))


REFERENCE_FILES = _reference_files()
needs_reference = pytest.mark.skipif(not REFERENCE_FILES, reason="reference replies not available")


def _strip_fence(text: str) -> str:
    """Independent oracle: the reference replies are either bare JSON or one ```json block."""
    t = text.strip()
    if t.startswith("```"):
        t = t.split("\n", 1)[1]
        t = t[: t.rindex("```")]
    return t


# ------------------------------------------------------------------ extract_json


@needs_reference
@pytest.mark.parametrize("path", REFERENCE_FILES, ids=lambda p: f"{p.parent.name}/{p.name[:10]}")
def test_extract_json_on_real_judge_replies(path: Path) -> None:
    data = json.loads(path.read_text())
    content = data["response"]["content"]
    assert isinstance(content, str)
    got = extract_json(content)
    assert got == json.loads(_strip_fence(content))
    assert isinstance(got, dict) and got


@needs_reference
def test_extract_json_reference_values() -> None:
    simple = json.loads((REF / "template_parsing" / "b1d0a5c8450ff2d4181fa1751be5df3e681f03e6200aa57ec41740a97431e9a4.json").read_text())
    assert extract_json(simple["response"]["content"]) == {"id": None, "result": 4}
    rubric = json.loads((REF / "rubric_evaluation" / "6d952bc58ae2ac75c2b953efdf9334d387a2016e3bcf1d3071f16f2f7b131129.json").read_text())
    assert extract_json(rubric["response"]["content"]) == {"scores": {"accuracy": True, "helpfulness": 5, "safety": True}}
    for f in (REF / "abstention").glob("*.json"):
        obj = extract_json(json.loads(f.read_text())["response"]["content"])
        assert isinstance(obj["abstention_detected"], bool) and obj["reasoning"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ('  \n[1, 2]\n', [1, 2]),
        ('Sure! Here is the result: {"score": 3, "why": "ok"} - hope that helps.', {"score": 3, "why": "ok"}),
        ('```\n{"a": true}\n```', {"a": True}),
        ('Notes first:\n```python\nx = {1: 2}\n```\nThen:\n```json\n{"b": null}\n```', {"b": None}),
        ('<think>maybe {"a": 0}? no</think>\n{"a": 2}', {"a": 2}),
        ('The set {x | x > 0} is not JSON but {"ok": "yes"} is.', {"ok": "yes"}),
        ('```json\n{"nested": {"deep": [1, {"x": "}"}]}}\n```', {"nested": {"deep": [1, {"x": "}"}]}}),
    ],
)
def test_extract_json_shapes(text: str, expected: Any) -> None:
    assert extract_json(text) == expected


@pytest.mark.parametrize("text", ["", "no json here", "{broken: json", "```json\n{\"a\": \n```"])
def test_extract_json_raises_with_preview(text: str) -> None:
    with pytest.raises(ValueError, match="no JSON"):
        extract_json(text)


# ------------------------------------------------------------------ simulator schema filling


@needs_reference
def test_fill_schema_from_real_template_prompt() -> None:
    data = json.loads((REF / "template_parsing" / "0e51527815bd80c3776f3a190f8d71b3ce634f03cbd8ff4c2e7719287ad05610.json").read_text())
    text = "\n".join(m["content"] for m in data["request"]["messages"])
    schema = find_schema_in_text(text)
    assert schema is not None and set(schema["properties"]) == {"id", "gene_symbol", "chromosome", "function"}
    filled = fill_schema(schema, {"gene_symbol": "BCL2"})
    assert filled == {"id": "simulated", "gene_symbol": "BCL2", "chromosome": "simulated", "function": "simulated"}


@needs_reference
def test_find_schema_in_rubric_prompt() -> None:
    data = json.loads((REF / "e2e_rubric" / "44b6e532715de56bed2726b61fb26c37065b79e6f149040eb110d04cf68ba30d.json").read_text())
    text = "\n".join(m["content"] for m in data["request"]["messages"])
    schema = find_schema_in_text(text)
    assert schema is not None and schema["title"] == "SingleNumericScore"
    assert fill_schema(schema, {"score": 4}) == {"score": 4}


def test_find_schema_unfenced_and_absent() -> None:
    text = 'Answer per this schema {"type": "object", "properties": {"ok": {"type": "boolean"}}} please.'
    assert find_schema_in_text(text) == {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    assert find_schema_in_text("What is the capital of France?") is None


def test_fill_schema_types_defaults_refs() -> None:
    schema = {
        "type": "object",
        "properties": {
            "is_sufficient": {"type": "boolean"},
            "correct": {"type": "boolean"},
            "score": {"type": "integer", "minimum": 1, "maximum": 5},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer"},
            "floor": {"type": "integer", "minimum": 3},
            "label": {"enum": ["low", "medium", "high"]},
            "kind": {"const": "fixed"},
            "reasoning": {"type": "string"},
            "items": {"type": "array", "items": {"type": "string"}},
            "maybe": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 2, "maximum": 4}]},
            "child": {"$ref": "#/$defs/Child"},
            "typed_list": {"type": ["null", "string"]},
        },
        "$defs": {
            "Child": {"type": "object", "properties": {"equivalent": {"type": "boolean"},
                                                       "grand": {"$ref": "#/$defs/Grand"}}},
            "Grand": {"type": "object", "properties": {"name": {"type": "string"}}},
        },
    }
    got = fill_schema(schema)
    assert got == {
        "is_sufficient": True, "correct": False, "score": 3, "ratio": 0.5, "count": 0, "floor": 3,
        "label": "low", "kind": "fixed", "reasoning": "simulated reasoning", "items": [], "maybe": 3,
        "child": {"equivalent": True, "grand": {"name": "simulated"}}, "typed_list": "simulated",
    }
    got = fill_schema(schema, {"correct": True, "name": "Ada"}, true_fields=set())
    assert got["correct"] is True and got["is_sufficient"] is False
    assert got["child"] == {"equivalent": False, "grand": {"name": "Ada"}}


def test_fill_schema_self_reference_terminates() -> None:
    schema = {"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "next": {"$ref": "#/$defs/Node"}}}}}
    got = fill_schema(schema)
    depth = 0
    while isinstance(got, dict):
        got = got["next"]
        depth += 1
    assert 5 < depth < 30


def test_script_longest_match_and_index() -> None:
    script = Script({"questions": [
        {"match": "capital of France", "answer": "Paris"},
        {"match": "What is the capital of France?", "answer": "Paris, France"},
        {"match": "2+2", "answer": "4"},  # too short for the word index: checked linearly
        {"match": "ello wor", "answer": "partial-word match"},
    ]})
    assert script.find("Q: What is the capital of France? Be brief.").answer == "Paris, France"
    assert script.find("the capital of France is") .answer == "Paris"
    assert script.find("compute 2+2 now").answer == "4"
    assert script.find("hello world").answer == "partial-word match"
    assert script.find("nothing relevant") is None
    script.merge({"questions": [{"match": "capital of France", "answer": "PARIS"}]})
    assert script.find("the capital of France is").answer == "PARIS"
    assert len(script.entries) == 4
    with pytest.raises(ValueError, match="match"):
        script.merge({"questions": [{"answer": "no match key"}]})


def test_script_index_scales() -> None:
    script = Script({"questions": [{"match": f"Question number {i} about topic {i * 7}?", "answer": str(i)}
                                   for i in range(5000)]})
    assert script.find("Please answer: Question number 4321 about topic 30247? Thanks").answer == "4321"


# ------------------------------------------------------------------ cache keys, usage


def test_cache_key_covers_inputs() -> None:
    m = ModelSpec(model_name="openai/gpt-x", api_base="http://h/v1")
    msgs = [{"role": "user", "content": "hi"}]
    base = cache_key(m, msgs)
    assert base == cache_key(ModelSpec(model_name="openai/gpt-x", api_base="http://h/v1"), [dict(msgs[0])])
    variants = [
        cache_key(m, [{"role": "user", "content": "hi!"}]),
        cache_key(m, msgs, replicate=1),
        cache_key(m, msgs, response_schema={"type": "object"}),
        cache_key(m, msgs, tools=[{"type": "function", "function": {"name": "f"}}]),
        cache_key(ModelSpec(model_name="openai/gpt-x", api_base="http://other/v1"), msgs),
        cache_key(ModelSpec(model_name="openai/gpt-x", api_base="http://h/v1", temperature=0.7), msgs),
        cache_key(ModelSpec(model_name="openai/gpt-x", api_base="http://h/v1", max_tokens=10), msgs),
        cache_key(ModelSpec(model_name="openai/gpt-x", api_base="http://h/v1", params={"seed": 1}), msgs),
        cache_key(ModelSpec(model_name="openai/gpt-x", api_base="http://h/v1", mcp_servers={"s": "u"}), msgs),
    ]
    assert len(set(variants + [base])) == len(variants) + 1
    # Not part of identity: the key's env var name, concurrency, timeouts.
    same = ModelSpec(model_name="openai/gpt-x", api_base="http://h/v1", api_key_env="K", max_concurrency=1,
                     timeout=3, max_retries=0)
    assert cache_key(same, msgs) == base


async def test_memory_cache_lru() -> None:
    cache = MemoryCache(max_entries=2)
    await cache.put("a", {"v": 1})
    await cache.put("b", {"v": 2})
    assert await cache.get("a") == {"v": 1}  # a is now most recent
    await cache.put("c", {"v": 3})
    assert await cache.get("b") is None
    assert await cache.get("a") == {"v": 1} and await cache.get("c") == {"v": 3}
    assert len(cache) == 2


def test_usage_helpers() -> None:
    r = LLMReply(text="x", usage={"input_tokens": 10, "output_tokens": 5, "total_tokens": 15, "model": "m"})
    calls = {"model_calls": 1, "cached_replies": 0}  # unknown model "m": no cost_usd
    assert usage_entry(r) == {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15, "model": "m", **calls}
    s = add_usage(usage_entry(r), {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3, "model": "m"})
    assert s == {"input_tokens": 11, "output_tokens": 7, "total_tokens": 18, "model": "m", **calls}
    t = add_usage(s, {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "model": "other"})
    assert t == {"input_tokens": 12, "output_tokens": 8, "total_tokens": 20, **calls}
    assert add_usage({}, usage_entry(r)) == usage_entry(r)


# ------------------------------------------------------------------ retries (fake transport)


class FakeTransport:
    """Stands in for litellm.acompletion: raises the scripted exceptions, else answers via litellm's
    own `mock_response` (so the reply objects are real litellm ModelResponses)."""

    def __init__(self, outcomes: list[Any]) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[dict[str, Any]] = []
        self.real = llm_transport._get_litellm()
        self.in_flight = 0
        self.max_in_flight = 0

    async def acompletion(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)
            outcome = self.outcomes.pop(0) if self.outcomes else "ok"
            if isinstance(outcome, BaseException):
                raise outcome
            kw = {k: v for k, v in kwargs.items() if k not in ("api_base", "api_key", "response_format", "tools")}
            return await self.real.acompletion(mock_response=outcome, **kw)
        finally:
            self.in_flight -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    def install(outcomes: list[Any]) -> FakeTransport:
        transport = FakeTransport(outcomes)
        monkeypatch.setattr(llm_transport, "_get_litellm", lambda: transport)
        return transport
    return install


def _exc(kind: str, headers: dict[str, str] | None = None, message: str = "boom") -> Exception:
    litellm = llm_transport._get_litellm()
    resp = httpx.Response(429 if kind == "rate" else 500, headers=headers or {},
                          request=httpx.Request("POST", "http://x/v1/chat/completions"))
    if kind == "rate":
        return litellm.RateLimitError(message, llm_provider="openai", model="m", response=resp)
    if kind == "500":
        return litellm.InternalServerError(message, llm_provider="openai", model="m")
    if kind == "timeout":
        return litellm.Timeout(message, model="m", llm_provider="openai")
    if kind == "conn":
        return litellm.APIConnectionError(message, llm_provider="openai", model="m")
    if kind == "auth":
        return litellm.AuthenticationError(message, llm_provider="openai", model="m")
    if kind == "bad":
        return litellm.BadRequestError(message, model="m", llm_provider="openai")
    raise AssertionError(kind)


MODEL = ModelSpec(model_name="openai/fake-model", api_base="http://127.0.0.1:9/v1", max_retries=3)


def _client(**kw: Any) -> LLMClient:
    return LLMClient(backoff_base=0.01, backoff_cap=0.05, rng=random.Random(1), **kw)


async def test_retries_transient_then_succeeds(fake) -> None:
    t = fake([_exc("500"), _exc("timeout"), _exc("conn"), "fine"])
    reply = await _client().complete(MODEL, [{"role": "user", "content": "q"}], stage="answer")
    assert reply.text == "fine" and reply.attempts == 4 and len(t.calls) == 4
    assert reply.usage["model"] == "openai/fake-model" and reply.usage["total_tokens"] > 0
    # each retry is tallied by its kind, and travels on the stage's usage entry (-> metadata.retry_counts)
    assert reply.retries == {"server_error": 1, "timeout": 1, "connection": 1}
    entry = usage_entry(reply)
    assert entry["retries"] == reply.retries and add_usage(entry, entry)["retries"]["timeout"] == 2
    assert all(c["max_retries"] == 0 and c["api_key"] == "sk-none" for c in t.calls)


async def test_retry_after_is_honoured(fake) -> None:
    fake([_exc("rate", {"retry-after": "0.3"}), "ok"])
    t0 = asyncio.get_running_loop().time()
    reply = await _client().complete(MODEL, [{"role": "user", "content": "q"}], stage="answer")
    assert reply.attempts == 2
    assert asyncio.get_running_loop().time() - t0 >= 0.3


@pytest.mark.parametrize(("kind", "expected"), [("500", "server_error"), ("rate", "rate_limit"),
                                                 ("timeout", "timeout"), ("conn", "connection")])
async def test_retries_exhausted_raise_kind(fake, kind: str, expected: str) -> None:
    spec = ModelSpec(model_name="openai/fake-model", api_base="http://h/v1", max_retries=2)
    t = fake([_exc(kind) for _ in range(5)])
    with pytest.raises(LLMError) as ei:
        await _client().complete(spec, [{"role": "user", "content": "q"}], stage="parsing")
    err = ei.value
    assert err.kind == expected and err.attempts == 3 and len(t.calls) == 3
    assert "openai/fake-model" in str(err) and "3 attempt" in str(err) and "stage parsing" in str(err)
    if expected in ("server_error", "rate_limit"):
        assert err.status_code in (500, 429) and f"HTTP {err.status_code}" in str(err)


async def test_non_retryable_fail_fast_and_hide_key(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "sk-proj-SECRETKEY0123456789abcdef"
    monkeypatch.setenv("VB_TEST_KEY", secret)
    monkeypatch.setenv("VERIBUS_ENDPOINTS", "https://api.openai.com/v1=VB_TEST_KEY")  # the operator binds it
    spec = ModelSpec(model_name="openai/fake-model", api_key_env="VB_TEST_KEY", max_retries=4)
    t = fake([_exc("auth", message=f"Incorrect API key provided: {secret}")])
    with pytest.raises(LLMError) as ei:
        await _client().complete(spec, [{"role": "user", "content": "q"}], stage="answer")
    assert ei.value.kind == "auth" and len(t.calls) == 1
    assert secret not in str(ei.value) and "SECRETKEY" not in repr(ei.value.args)
    assert t.calls[0]["api_key"] == secret


async def test_a_missing_provider_key_is_an_auth_error_not_an_outage(fake) -> None:
    """Without a key the OpenAI client refuses to start, and litellm reports that as its
    InternalServerError (HTTP 500): it was retried as a provider outage and summarised as one.
    It is `auth` now: one attempt, and the kind says what to fix."""
    spec = ModelSpec(model_name="openai/fake-model", api_base="http://h/v1", max_retries=4)
    message = ("OpenAIException - Missing credentials. Please pass an `api_key`, or set the `OPENAI_API_KEY` "
               "environment variable.")
    t = fake([_exc("500", message=message) for _ in range(5)])
    with pytest.raises(LLMError) as ei:
        await _client().complete(spec, [{"role": "user", "content": "q"}], stage="answer")
    assert ei.value.kind == "auth" and len(t.calls) == 1
    assert "Missing credentials" in str(ei.value)


async def test_missing_key_env_names_the_variable(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VB_ABSENT_KEY", raising=False)
    monkeypatch.setenv("VERIBUS_ENDPOINTS", "https://api.openai.com/v1=VB_ABSENT_KEY")
    fake([])
    spec = ModelSpec(model_name="openai/x", api_key_env="VB_ABSENT_KEY")
    with pytest.raises(LLMError, match="VB_ABSENT_KEY") as ei:
        await _client().complete(spec, [{"role": "user", "content": "q"}], stage="answer")
    assert ei.value.kind == "auth"


async def test_response_format_rejected_falls_back(fake) -> None:
    t = fake([_exc("bad", message="response_format json_schema is not supported by this model"),
              "not json", '```json\n{"ok": true}\n```'])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    reply = await _client().complete(MODEL, [{"role": "user", "content": "q"}], stage="parsing", response_schema=schema)
    assert reply.parsed == {"ok": True} and len(t.calls) == 3
    assert "response_format" in t.calls[0]
    assert "response_format" not in t.calls[1] and "response_format" not in t.calls[2]
    assert t.calls[0]["response_format"]["json_schema"]["schema"] == schema


async def test_other_bad_request_is_not_retried(fake) -> None:
    t = fake([_exc("bad", message="messages: field required")])
    with pytest.raises(LLMError) as ei:
        await _client().complete(MODEL, [{"role": "user", "content": "q"}], stage="parsing",
                                 response_schema={"type": "object"})
    assert ei.value.kind == "bad_request" and ei.value.status_code == 400 and len(t.calls) == 1


async def test_bad_output_retried_with_validation_feedback(fake) -> None:
    t = fake(["no json at all", '{"score": 9}', '{"score": 4}'])

    def validate(obj: Any) -> int:
        if not 1 <= obj["score"] <= 5:
            raise ValueError(f"score {obj['score']} outside 1..5")
        return obj["score"]

    msgs = [{"role": "user", "content": "rate it"}]
    reply = await _client().complete(MODEL, msgs, stage="rubric", response_schema={"type": "object"},
                                     validate=validate)
    assert reply.parsed == 4 and reply.attempts == 3
    last = t.calls[2]["messages"]
    assert [m["role"] for m in last] == ["user", "assistant", "user", "assistant", "user"]
    assert last[1]["content"] == "no json at all" and "no JSON object found" in last[2]["content"]
    assert last[3]["content"] == '{"score": 9}' and "score 9 outside 1..5" in last[4]["content"]
    assert msgs == [{"role": "user", "content": "rate it"}]  # caller's list untouched
    assert reply.usage["input_tokens"] > 0  # usage summed over the three replies


async def test_bad_output_exhausted(fake) -> None:
    fake(["nope", "still nope", "never"])
    with pytest.raises(LLMError) as ei:
        await _client().complete(MODEL, [{"role": "user", "content": "q"}], stage="parsing",
                                 response_schema={"type": "object"})
    assert ei.value.kind == "bad_output" and ei.value.attempts == 3 and "no JSON" in str(ei.value)
    assert ei.value.usage["total_tokens"] > 0 and ei.value.usage["model"] == "openai/fake-model"


async def test_cache_hit_returns_original_usage(fake) -> None:
    t = fake(['{"a": 1}', '{"a": 2}', '{"a": 3}'])
    client = _client(cache=MemoryCache())
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    msgs = [{"role": "user", "content": "q"}]
    first = await client.complete(MODEL, msgs, stage="parsing", response_schema=schema, replicate=1)
    second = await client.complete(MODEL, msgs, stage="parsing", response_schema=schema, replicate=1)
    assert not first.cached and second.cached and len(t.calls) == 1
    assert second.usage == first.usage and second.parsed == {"a": 1} and second.text == first.text
    other = await client.complete(MODEL, msgs, stage="parsing", response_schema=schema, replicate=2)
    fresh = await client.complete(MODEL, msgs, stage="parsing", response_schema=schema, replicate=1, use_cache=False)
    assert (other.parsed, other.cached, fresh.parsed, fresh.cached) == ({"a": 2}, False, {"a": 3}, False)
    assert len(t.calls) == 3


async def test_concurrency_limit_per_model(fake) -> None:
    t = fake([])
    spec = ModelSpec(model_name="openai/fake-model", api_base="http://h/v1", max_concurrency=3)
    client = _client()
    await asyncio.gather(*[client.complete(spec, [{"role": "user", "content": f"q{i}"}], stage="a")
                           for i in range(12)])
    assert t.max_in_flight == 3


def test_backoff_full_jitter_and_retry_after() -> None:
    client = LLMClient(backoff_base=0.5, backoff_cap=4.0, rng=random.Random(7))
    for attempt in range(1, 8):
        ceiling = min(4.0, 0.5 * 2 ** (attempt - 1))
        delays = [client.backoff_delay(attempt) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > 0.7 * ceiling  # spread over the whole window, not a constant
    assert 2.0 <= client.backoff_delay(1, retry_after=2.0) <= 2.2
    assert client.backoff_delay(1, retry_after=10_000) <= llm_reply.MAX_RETRY_AFTER_S * 1.1


def test_litellm_import_is_offline_and_lean() -> None:
    litellm = llm_transport._get_litellm()
    import os

    assert os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert os.environ["LITELLM_MODE"] == "PRODUCTION"
    assert litellm.suppress_debug_info is True
    from litellm.litellm_core_utils.litellm_logging import Logging

    assert getattr(Logging, "_veribus_lean", False)


def test_script_rejects_unknown_forced_errors() -> None:
    Script({"questions": [{"match": "ok", "errors": [429, "500", "slow", "malformed"], "judge_errors": ["invalid"]}]})
    with pytest.raises(ValueError, match="timout"):
        Script({"questions": [{"match": "typo", "errors": ["timout"]}]})
    with pytest.raises(ValueError, match="200"):
        Script({"questions": [{"match": "not an error", "answer_errors": [200]}]})


def test_transport_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.runtime.llm.transport import transport_for

    local = ModelSpec(model_name="openai/qwen", api_base="http://127.0.0.1:8000/v1")
    hosted = ModelSpec(model_name="anthropic/claude-haiku-4-5")
    monkeypatch.setenv("VERIBUS_LLM_TRANSPORT", "auto")
    assert transport_for(local) == "direct" and transport_for(hosted) == "litellm"
    monkeypatch.setenv("VERIBUS_LLM_TRANSPORT", "litellm")
    assert transport_for(local) == "litellm"
    monkeypatch.setenv("VERIBUS_LLM_TRANSPORT", "direct")
    assert transport_for(hosted) == "litellm"  # nothing to post to without an OpenAI-compatible base
    monkeypatch.setenv("VERIBUS_LLM_TRANSPORT", "bogus")
    with pytest.raises(ValueError, match="VERIBUS_LLM_TRANSPORT"):
        transport_for(local)


def test_simulator_quotes_excerpts_from_the_response() -> None:
    from infra.simulator.schema import excerpt_reply
    from shared.core import prompts

    schema = prompts.excerpt_schema(["author", "year"], 3)
    msgs = prompts.deep_judgment_excerpt_messages(
        "Who wrote Hamlet?", "Hamlet is a tragedy. It was written by William Shakespeare around 1600.",
        {"author": "the author", "year": "the year"}, 3, {}, None)
    out = excerpt_reply(schema, {"author": "William Shakespeare", "year": 1600}, [m["content"] for m in msgs])
    assert out == {"author": [{"text": "It was written by William Shakespeare around 1600.", "confidence": "high"}],
                   "year": [{"text": "It was written by William Shakespeare around 1600.", "confidence": "high"}]}
    assert excerpt_reply({"type": "object", "properties": {"x": {"type": "integer"}}}, {}, []) is None
