"""Judge prompts, in one place. Each judge prompt quotes the question verbatim (the LLM
simulator matches its script entries on it) and asks for JSON matching a schema.
"""

from __future__ import annotations

import json
from typing import Any


def _custom(job_options: dict[str, Any], key: str) -> str:
    extra = (job_options.get("prompt_config") or {}).get(key)
    return f"\n\nAdditional instructions:\n{extra}" if extra else ""


def answer_messages(
    question: str, system_prompt: str | None, few_shot: list[dict[str, str]] | None
) -> list[dict[str, str]]:
    """Messages for the answering model: system prompt, few-shot pairs, then the question."""
    msgs: list[dict[str, str]] = []
    if system_prompt:
        msgs.append({"role": "system", "content": system_prompt})
    for ex in few_shot or []:
        msgs.append({"role": "user", "content": ex.get("question", "")})
        msgs.append({"role": "assistant", "content": ex.get("answer", "")})
    msgs.append({"role": "user", "content": question})
    return msgs


def parsing_messages(
    question: str, response: str, schema: dict[str, Any], options: dict[str, Any], system_prompt: str | None
) -> list[dict[str, str]]:
    system = system_prompt or (
        "You are a meticulous evaluator. Extract the information asked for by the JSON schema from the "
        "response of another model. Report what the response says, not what is true. When the response "
        "does not state a value, choose the closest faithful reading or null when the schema allows it."
    )
    user = (
        f"Question:\n{question}\n\nResponse to parse:\n{response}\n\n"
        f"Return only a JSON object that matches this JSON schema:\n{json.dumps(schema, sort_keys=True)}"
        + _custom(options, "parsing")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


ABSTENTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "abstention_detected": {"type": "boolean"},
        "reasoning": {"type": "string"},
    },
    "required": ["abstention_detected", "reasoning"],
    "additionalProperties": False,
}


def abstention_messages(question: str, response: str, options: dict[str, Any]) -> list[dict[str, str]]:
    system = (
        "You decide whether a model abstained from answering. Abstention: explicit refusals "
        "('I cannot answer'), evasive replies that answer a different question, or pure deflection "
        "('consult an expert'). NOT abstention: qualified answers with caveats, partial answers, "
        "approximate or estimated values."
    )
    user = (
        f"Question:\n{question}\n\nResponse:\n{response}\n\n"
        f"Return only JSON matching: {json.dumps(ABSTENTION_SCHEMA)}" + _custom(options, "abstention_detection")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


SUFFICIENCY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"sufficient": {"type": "boolean"}, "reasoning": {"type": "string"}},
    "required": ["sufficient", "reasoning"],
    "additionalProperties": False,
}


def sufficiency_messages(
    question: str, response: str, schema: dict[str, Any], options: dict[str, Any]
) -> list[dict[str, str]]:
    system = (
        "You decide whether a response contains enough information to fill every field of a JSON "
        "schema. Judge only presence of information, not its correctness."
    )
    user = (
        f"Question:\n{question}\n\nResponse:\n{response}\n\nSchema to fill:\n{json.dumps(schema, sort_keys=True)}"
        f"\n\nReturn only JSON matching: {json.dumps(SUFFICIENCY_SCHEMA)}" + _custom(options, "sufficiency_detection")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def rubric_messages(
    question: str, response: str, traits_text: str, schema: dict[str, Any], options: dict[str, Any]
) -> list[dict[str, str]]:
    system = (
        "You grade a response against rubric traits. For each trait return the value its type asks for: "
        "true/false for boolean traits, an integer within the stated range for score traits, the exact "
        "class name for literal traits."
    )
    user = (
        f"Question:\n{question}\n\nResponse:\n{response}\n\nTraits:\n{traits_text}\n\n"
        f"Return only JSON matching: {json.dumps(schema, sort_keys=True)}" + _custom(options, "rubric_evaluation")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def metric_messages(
    question: str, response: str, trait_name: str, instructions: str, schema: dict[str, Any], options: dict[str, Any]
) -> list[dict[str, str]]:
    system = (
        "You classify the items a response mentions against reference lists, to build a confusion "
        "matrix. Copy items verbatim from the lists where they match."
    )
    user = (
        f"Question:\n{question}\n\nResponse:\n{response}\n\nMetric trait '{trait_name}':\n{instructions}\n\n"
        f"Return only JSON matching: {json.dumps(schema, sort_keys=True)}" + _custom(options, "rubric_evaluation")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
