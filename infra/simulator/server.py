"""An OpenAI-compatible, scriptable, deterministic LLM simulator (aiohttp).

Serves the offline demo, the tests and the load benchmarks without a real provider. Answers,
judge outputs, tool calls, latency and injected errors come from a script plus a seed, and the
randomness of one request is derived from a hash of (seed, request content, how many times that
content was seen), so concurrent interleaving does not change what each request gets.
Every response carries `system_fingerprint = "veribus-simulator"` so its output is labelled.
The script and settings live in `script`, the made-up judge replies in `schema`, the script for
a benchmark in `from_benchmark`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from statistics import NormalDist
from typing import Any

import msgspec
from aiohttp import web

from infra.simulator.schema import _content_text, _schema_in_messages, excerpt_reply, fill_schema, words_of
from infra.simulator.script import CONTENT_FAULTS, DELAY_FAULTS, Entry, Script, SimConfig

FINGERPRINT = "veribus-simulator"



_encode = msgspec.json.encode
_decode = msgspec.json.decode
_NORMAL = NormalDist()
_MAX_SEEN = 500_000  # occurrence counters kept before they are reset (bounds memory in long runs)
_MAX_DELAYS = 200_000  # drawn latencies kept for /simulator/delays (a bench run of 100,000 questions)






def _tokens(chars: int) -> int:
    return (chars + 3) // 4


class Simulator:
    """State of one simulator process: script, config, counters."""

    def __init__(self, script: Script | None = None, config: SimConfig | None = None,
                 keep_script: Path | None = None) -> None:
        self.script = script or Script()
        self.keep_script = keep_script  # where every script posted is kept (`--keep-script`)
        self.config = config or SimConfig()
        self._seed_bytes = str(self.config.seed).encode()
        self._seen: dict[bytes, int] = {}
        self._consumed: dict[tuple[int, str], int] = {}
        self._seq = 0
        mix = {k: v for k, v in self.config.error_mix.items() if v > 0}
        total = sum(mix.values()) or 1.0
        acc = 0.0
        self._mix: list[tuple[float, str]] = []
        for kind, weight in mix.items():
            acc += weight / total
            self._mix.append((acc, kind))
        self.recent: deque[dict[str, Any]] = deque(maxlen=64)
        # the latency drawn for each call, in call order, and which request drew it (a hedge's
        # copy repeats its first copy's body): the bench replays a run's own draws through a
        # pipeline without overhead to say what the distribution itself allowed
        self.delays: deque[tuple[str, float, str, float]] = deque(maxlen=_MAX_DELAYS)
        self.clock: Callable[[], float] = time.monotonic  # when a request arrived, and how long it has been here
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # the drawn latency's wait
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats: dict[str, Any] = {
            "requests": 0, "answer": 0, "judge": 0, "tool_call": 0, "matched": 0, "unmatched": 0,
            "errors_injected": {}, "by_model": {}, "in_flight": 0, "max_in_flight": 0,
            "prompt_tokens": 0, "completion_tokens": 0,
            "in_flight_by_model": {}, "max_in_flight_by_model": {}, "rejected_over_limit": 0,
        }

    def reset(self) -> None:
        """Zero the counters and the per-entry forced-error positions (tests call this)."""
        self.reset_stats()
        self._consumed.clear()
        self._seen.clear()
        self.recent.clear()
        self.delays.clear()

    # -- randomness: a pure function of (seed, request bytes, occurrence)
    def _uniforms(self, key: bytes) -> tuple[float, float, float, float]:
        """`key`: the request body's hash (`_body_hash`)."""
        if len(self._seen) > _MAX_SEEN:
            self._seen.clear()
        n = self._seen.get(key, 0)
        self._seen[key] = n + 1
        d = hashlib.blake2b(key + n.to_bytes(4, "little"), digest_size=32, key=self._seed_bytes[:64]).digest()
        return tuple(int.from_bytes(d[i:i + 7], "little") / 2.0**56 for i in (0, 8, 16, 24))  # type: ignore[return-value]

    def _latency_s(self, u: float) -> float:
        cfg = self.config
        if cfg.latency_ms <= 0:
            return 0.0
        if cfg.latency_dist == "fixed":
            return cfg.latency_ms / 1000
        if cfg.latency_dist == "uniform":
            return 2 * cfg.latency_ms * u / 1000
        z = _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
        return cfg.latency_ms * math.exp(cfg.latency_sigma * z) / 1000

    def _forced(self, entry: Entry | None, kind: str) -> Any:
        if entry is None:
            return None
        for name, seq in (("errors", entry.errors), (f"{kind}_errors", getattr(entry, f"{kind}_errors", []))):
            if not seq:
                continue
            pos = self._consumed.get((entry.index, name), 0)
            if pos < len(seq):
                self._consumed[(entry.index, name)] = pos + 1
                return seq[pos]
        return None

    def _count_error(self, kind: str) -> None:
        errs = self.stats["errors_injected"]
        errs[kind] = errs.get(kind, 0) + 1

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        stats = self.stats
        stats["requests"] += 1
        stats["in_flight"] += 1
        if stats["in_flight"] > stats["max_in_flight"]:
            stats["max_in_flight"] = stats["in_flight"]
        try:
            return await self._chat(request, self.clock())
        finally:
            stats["in_flight"] -= 1

    async def _chat(self, request: web.Request, arrived: float) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = _decode(raw)
        except msgspec.DecodeError as exc:
            return _error(400, f"request body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "'messages' must be a non-empty list", "invalid_request_error")
        model = str(body.get("model") or "simulator")
        messages: list[Any] = body["messages"]
        texts = [_content_text(m.get("content")) if isinstance(m, dict) else "" for m in messages]
        joined = "\n".join(texts)
        script = self.script
        entry = None
        if script._index or script._linear:
            words: set[str] = set()
            for t in texts:
                words.update(words_of(t))
            entry = script.find(joined, words)
        stats = self.stats
        if entry is None:
            stats["unmatched"] += 1
        else:
            stats["matched"] += 1
        by_model = stats["by_model"]
        by_model[model] = by_model.get(model, 0) + 1
        flying = stats["in_flight_by_model"]
        now_flying = flying.get(model, 0) + 1
        if self.config.max_in_flight and now_flying > self.config.max_in_flight:
            stats["rejected_over_limit"] += 1
            self._count_error("429")
            ra = self.config.retry_after_s
            return _error(429, f"simulated concurrency limit ({self.config.max_in_flight}) for model {model}",
                          "rate_limit_error", {"Retry-After": f"{ra:g}", "retry-after-ms": str(int(ra * 1000))})
        flying[model] = now_flying
        peaks = stats["max_in_flight_by_model"]
        if now_flying > peaks.get(model, 0):
            peaks[model] = now_flying
        try:
            return await self._respond(request, body, raw, model, messages, texts, joined, entry, arrived)
        finally:
            flying[model] -= 1

    async def _respond(self, request: web.Request, body: dict[str, Any], raw: bytes, model: str,
                       messages: list[Any], texts: list[str], joined: str, entry: Entry | None,
                       arrived: float) -> web.StreamResponse:
        stats = self.stats

        schema, judge = self._judge_schema(body, texts)
        tools = body.get("tools")
        kind = "judge" if judge else "answer"
        self.recent.append({"model": model, "kind": kind, "messages": messages, "entry": entry and entry.match})

        body_key = _body_hash(raw)
        u = self._uniforms(body_key)
        forced = self._forced(entry, kind)
        if forced is None and self.config.error_rate > 0 and u[0] < self.config.error_rate:
            forced = next((k for edge, k in self._mix if u[1] < edge), self._mix[-1][1] if self._mix else None)
        if forced is not None:
            resp = await self._inject(forced, model)
            if resp is not None:
                return resp

        delay = self._latency_s(u[2])
        # the key is equal for equal bodies; the arrival is on the machine's monotonic clock (s)
        self.delays.append((kind, round(delay * 1000, 3), body_key[:6].hex(), round(arrived, 4)))
        # the drawn latency runs from the request's arrival, as a provider's does: the time spent
        # reading, decoding and matching it here is part of it, not added to it (on a busy
        # machine that was ~1 % of the throughput bound C/(2L) at 300 ms: the bench's
        # `simulator_ceiling` measured 0.987 with minimal callers)
        wait = delay - (self.clock() - arrived)
        if wait > 0:
            await self.sleep(wait)

        tool_calls = None
        if tools and entry is not None and entry.tool_calls:
            # the agent's turn: assistant messages after the last user message (few-shot pairs
            # before the question are not agent turns)
            last_user = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                            default=-1)
            turn = sum(1 for m in messages[last_user + 1:] if isinstance(m, dict) and m.get("role") == "assistant")
            if turn < len(entry.tool_calls):
                tool_calls = self._tool_calls(entry.tool_calls[turn], turn, entry.index)
        if tool_calls is not None:
            stats["tool_call"] += 1
            content: str | None = None
        elif judge:
            stats["judge"] += 1
            content = self._judge_content(schema, entry, forced, texts)
        else:
            stats["answer"] += 1
            content = self._answer(entry, model, messages, texts)
            if forced == "empty":
                content = ""
        prompt_tokens = _tokens(len(joined))
        completion_tokens = _tokens(len(content or "") + (len(_encode(tool_calls)) if tool_calls else 0))
        stats["prompt_tokens"] += prompt_tokens
        stats["completion_tokens"] += completion_tokens
        self._seq += 1
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls is not None:
            message["tool_calls"] = tool_calls
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        rid = f"chatcmpl-sim-{self._seq}"
        finish = "tool_calls" if tool_calls is not None else "stop"
        if body.get("stream"):
            return await self._stream(request, rid, model, message, finish, usage)
        payload = {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage,
        }
        return web.Response(body=_encode(payload), content_type="application/json")

    def _judge_schema(self, body: dict[str, Any], texts: list[str]) -> tuple[dict[str, Any] | None, bool]:
        fmt = body.get("response_format")
        if isinstance(fmt, dict):
            if fmt.get("type") == "json_schema":
                js = fmt.get("json_schema") or {}
                schema = js.get("schema") if isinstance(js, dict) else None
                return (schema if isinstance(schema, dict) else None), True
            if fmt.get("type") == "json_object":
                return _schema_in_messages(texts), True
        if body.get("tools"):
            return None, False
        schema = _schema_in_messages(texts)
        return schema, schema is not None

    def _judge_content(self, schema: dict[str, Any] | None, entry: Entry | None, forced: Any,
                       texts: list[str] | None = None) -> str:
        if forced == "malformed":
            return "I think the answer is {\"unterminated\": "
        if forced == "invalid":
            return '{"simulated_invalid_output": true}'
        if forced == "empty":
            return ""
        values = entry.values if entry is not None else {}
        excerpts = excerpt_reply(schema, values, texts or []) if schema is not None else None
        if excerpts is not None:
            obj: Any = excerpts
        elif schema is None:
            obj = dict(values)
        else:
            obj = fill_schema(schema, values, self.script.true_fields)
        text = _encode(obj).decode()
        if forced == "fenced":
            return f"Here is the result:\n```json\n{text}\n```"
        return text

    def _answer(self, entry: Entry | None, model: str, messages: list[Any], texts: list[str]) -> str:
        if entry is not None:
            if entry.answers_by_model:
                text = entry.answers_by_model.get(model)
                if text is not None:
                    return text
            if entry.answer is not None:
                return entry.answer
            if entry.abstain:
                return str(self.script.defaults.get(
                    "abstain_answer", "I'm sorry, but I cannot provide an answer to that question."))
        last_user = ""
        for m, text in zip(reversed(messages), reversed(texts), strict=True):
            if isinstance(m, dict) and m.get("role") == "user":
                last_user = text
                break
        template = self.script.defaults.get("answer_template", "Simulated answer to: {question}")
        return str(template).replace("{question}", last_user)

    @staticmethod
    def _tool_calls(turn_calls: Any, turn: int, entry_index: int) -> list[dict[str, Any]]:
        calls = turn_calls if isinstance(turn_calls, list) else [turn_calls]
        out = []
        for j, call in enumerate(calls):
            if not isinstance(call, dict):
                continue
            fn = call.get("function") if isinstance(call.get("function"), dict) else call
            args = fn.get("arguments", {})
            out.append({
                "id": call.get("id") or f"call_sim_{entry_index}_{turn}_{j}",
                "type": "function",
                "function": {"name": str(fn.get("name", "tool")),
                             "arguments": args if isinstance(args, str) else _encode(args).decode()},
            })
        return out

    async def _inject(self, forced: Any, model: str) -> web.Response | None:
        """An injected failure; None when `forced` only alters the content (malformed, empty...)."""
        kind = str(forced)
        self._count_error(kind)
        if kind in CONTENT_FAULTS:
            return None
        if kind in DELAY_FAULTS:
            await asyncio.sleep(self.config.slow_ms / 1000)
            return None
        if kind == "429":
            ra = self.config.retry_after_s
            headers = {"Retry-After": f"{ra:g}", "retry-after-ms": str(int(ra * 1000))}
            return _error(429, f"simulated rate limit for model {model}", "rate_limit_error", headers)
        if kind.isdigit():
            return _error(int(kind), f"simulated server error {kind} for model {model}", "server_error")
        raise ValueError(f"unknown forced error {forced!r}")

    async def _stream(self, request: web.Request, rid: str, model: str, message: dict[str, Any],
                      finish: str, usage: dict[str, int]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": FINGERPRINT}
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if "tool_calls" in message:
            delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(message["tool_calls"])]
        chunks = [
            {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": usage},
        ]
        for chunk in chunks:
            await resp.write(b"data: " + _encode(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- admin endpoints
    async def handle_models(self, request: web.Request) -> web.Response:
        names = {"simulator"}
        for entry in self.script.entries:
            names.update(entry.answers_by_model)
        data = [{"id": n, "object": "model", "created": 0, "owned_by": FINGERPRINT} for n in sorted(names)]
        return web.Response(body=_encode({"object": "list", "data": data}), content_type="application/json")

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(body=_encode({"status": "ok", "simulator": FINGERPRINT,
                                          "entries": len(self.script.entries)}),
                            content_type="application/json")

    async def handle_script(self, request: web.Request) -> web.Response:
        try:
            raw = _decode(await request.read())
            if not isinstance(raw, dict):
                raise ValueError("script body must be a JSON object")
            count = self.script.merge(raw)
        except (ValueError, msgspec.DecodeError) as exc:
            return _error(400, str(exc), "invalid_request_error")
        if self.keep_script is not None:
            save_script(self.script, self.keep_script)
        return web.Response(body=_encode({"entries": count}), content_type="application/json")

    async def handle_stats(self, request: web.Request) -> web.Response:
        return web.Response(body=_encode(self.stats), content_type="application/json")

    async def handle_requests(self, request: web.Request) -> web.Response:
        return web.Response(body=_encode(list(self.recent)), content_type="application/json")

    async def handle_delays(self, request: web.Request) -> web.Response:
        """`[[kind, ms, request, arrived], ...]`: the latency drawn for each call since the start
        (or a reset), in call order, a short key of its request body (the same for a repeated
        request, as a hedge's copy is) and when the call arrived, in seconds of the machine's
        monotonic clock (`time.monotonic()`, which is `time.perf_counter()` on Linux: a bench
        places the calls on its own timeline); `?since=K` leaves out the first K."""
        since = max(0, int(request.query.get("since", "0") or 0))
        return web.Response(body=_encode(list(self.delays)[since:]), content_type="application/json")

    async def handle_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.Response(body=b'{"reset":true}', content_type="application/json")


def save_script(script: Script, path: Path) -> None:
    """Write the script as it stands to `path` (atomically, private to the user), so a simulator
    started again with `--keep-script path` answers as this one does."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(_encode(script.raw()))
    tmp.replace(path)


def _body_hash(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16).digest()


def _error(status: int, message: str, typ: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": typ, "param": None, "code": str(status)}}
    return web.Response(status=status, body=_encode(body), content_type="application/json", headers=headers)


SIMULATOR = web.AppKey("simulator", Simulator)


def create_app(script: Script | None = None, config: SimConfig | None = None,
               keep_script: Path | None = None) -> web.Application:
    """The aiohttp application; `app[SIMULATOR]` is the `Simulator` state."""
    sim = Simulator(script, config, keep_script)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SIMULATOR] = sim
    app.router.add_post("/v1/chat/completions", sim.handle_chat)
    app.router.add_post("/chat/completions", sim.handle_chat)
    app.router.add_get("/v1/models", sim.handle_models)
    app.router.add_get("/models", sim.handle_models)
    app.router.add_get("/health", sim.handle_health)
    app.router.add_post("/simulator/script", sim.handle_script)
    app.router.add_get("/simulator/stats", sim.handle_stats)
    app.router.add_get("/simulator/requests", sim.handle_requests)
    app.router.add_post("/simulator/reset", sim.handle_reset)
    app.router.add_get("/simulator/delays", sim.handle_delays)
    return app
