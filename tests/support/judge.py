"""A scripted judge with `LLMClient.complete`'s contract, for stage tests without a model."""

from __future__ import annotations

import json
from typing import Any

from shared.core import events
from shared.runtime.llm.reply import LLMReply, extract_json


class Judge:
    """Scripted judge with `LLMClient.complete`'s contract. Per stage: a value, or a list consumed in
    order (the last one repeats). A value is a dict (the JSON reply), a string (reply text, JSON-extracted
    when the call is structured), a callable(messages) returning one of those, or an exception to raise."""

    def __init__(self, by_stage: dict[str, Any]) -> None:
        self.by_stage = {k: list(v) if isinstance(v, list) else [v] for k, v in by_stage.items()}
        self.calls: list[dict[str, Any]] = []

    def stage_calls(self, stage: str) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["stage"] == stage]

    async def complete(self, model: events.ModelSpec, messages: list[dict[str, Any]], *, stage: str,
                       response_schema: dict[str, Any] | None = None, validate: Any = None, **_: Any) -> LLMReply:
        self.calls.append({"stage": stage, "messages": messages, "schema": response_schema})
        queue = self.by_stage[stage]
        value = queue.pop(0) if len(queue) > 1 else queue[0]
        if callable(value) and not isinstance(value, dict | list):
            value = value(messages)
        if isinstance(value, Exception):
            raise value
        usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15, "model": model.model_name}
        text = value if isinstance(value, str) else json.dumps(value)
        if response_schema is None and validate is None:
            return LLMReply(text=text, usage=usage)
        obj = extract_json(value) if isinstance(value, str) else value
        return LLMReply(text=text, usage=usage, parsed=validate(obj) if validate else obj)
