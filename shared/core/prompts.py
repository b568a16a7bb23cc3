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


# ---------------------------------------------------------------- deep judgment (templates and rubrics)
# Appended for services/parsing/deep_judgment.py, services/rubric/deep_judgment.py, shared/runtime/search.py and
# the embedding check. Every prompt still quotes the question verbatim (the simulator keys on it).


def _with_system(extra: str | None, body: str) -> str:
    """The parsing model's own system prompt (domain instructions) first, then the task's."""
    return f"{extra.strip()}\n\n{body}" if extra and extra.strip() else body


def excerpt_schema(attributes: list[str], max_excerpts: int) -> dict[str, Any]:
    """{attribute: [{"text", "confidence"[, "explanation"]}]} - one list of quotes per attribute."""
    item = {
        "type": "object",
        "properties": {
            "text": {"type": "string", "description": "verbatim quote from the response ('' when none)"},
            "confidence": {"type": "string", "enum": ["low", "medium", "high", "none"]},
            "explanation": {"type": "string", "description": "only when text is empty: why there is no evidence"},
        },
        "required": ["text", "confidence"],
    }
    return {
        "type": "object",
        "properties": {a: {"type": "array", "items": item, "maxItems": max_excerpts} for a in attributes},
        "required": list(attributes),
    }


def deep_judgment_excerpt_messages(
    question: str, response: str, attributes: dict[str, str], max_excerpts: int, options: dict[str, Any],
    system_prompt: str | None,
) -> list[dict[str, str]]:
    """Stage 1 of template deep judgment: verbatim evidence per template attribute."""
    guidance = "\n".join(f"- {name}: {desc}" for name, desc in attributes.items())
    system = _with_system(system_prompt, (
        "You extract verbatim evidence from a model's response. For each attribute listed, quote up to "
        f"{max_excerpts} exact passages of the response that show what the response says about it, each with a "
        "confidence: high (direct, explicit statement), medium (implied or indirect), low (weak or ambiguous). "
        "Quotes must be copied character for character from the response - never paraphrase, never quote this "
        "prompt. When the response has no evidence for an attribute (refusal, not mentioned) return one entry "
        'with empty text, confidence "none" and a short explanation. Reply with JSON only.'
    ))
    user = (
        f"Question:\n{question}\n\nResponse to analyze:\n<response>\n{response}\n</response>\n\n"
        f"Attributes:\n{guidance}\n\n"
        'Return JSON: {"<attribute>": [{"text": "exact quote", "confidence": "low|medium|high"}], ...} '
        "with every attribute as a key." + _custom(options, "deep_judgment_excerpts")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def excerpt_retry_feedback(failed: dict[str, list[dict[str, Any]]], threshold: float, scope: str) -> str:
    """The follow-up after quotes that were not found in the response (names each one and its score)."""
    lines = []
    for name, items in failed.items():
        for it in items:
            lines.append(f"- {name}: \"{it['text']}\" (best match {it['similarity_score']:.2f} < {threshold:.2f})")
    return (
        "These excerpts do not occur verbatim in the response:\n" + "\n".join(lines) + "\n\n"
        f"Quote {scope} again, copying exact spans of the response (same words, same order). If the response "
        'really has no evidence, return one entry with empty text, confidence "none" and an explanation. JSON only.'
    )


def _excerpt_lines(excerpts: list[dict[str, Any]]) -> list[str]:
    out = []
    for ex in excerpts:
        line = f'  [{ex.get("confidence", "medium")}] "{ex["text"]}"'
        if ex.get("hallucination_risk"):
            line += f' (hallucination risk: {ex["hallucination_risk"]}; {ex.get("hallucination_justification", "")})'
        out.append(line)
    return out


def deep_judgment_reasoning_messages(
    question: str, attributes: dict[str, str], excerpts: dict[str, list[dict[str, Any]]],
    explanations: dict[str, str], options: dict[str, Any], system_prompt: str | None,
) -> list[dict[str, str]]:
    """Stage 2 of template deep judgment: how the evidence determines each attribute's value."""
    blocks = []
    for name, desc in attributes.items():
        found = excerpts.get(name) or []
        head = f"- {name} ({desc}):"
        if found:
            blocks.append("\n".join([head, *_excerpt_lines(found)]))
        else:
            why = explanations.get(name)
            blocks.append(f"{head}\n  no verbatim evidence found" + (f" (judge's note: {why})" if why else ""))
    system = _with_system(system_prompt, (
        "You explain, attribute by attribute, what value the evidence supports and why. Use only the quoted "
        "evidence; when there is none, say so and what that implies (for example that the response did not "
        "answer). Be brief: two or three sentences per attribute. Reply with JSON only."
    ))
    user = (
        f"Question:\n{question}\n\nEvidence per attribute (verbatim excerpts of the response):\n"
        + "\n".join(blocks)
        + '\n\nReturn JSON: {"<attribute>": "reasoning", ...} with every attribute as a key.'
        + _custom(options, "deep_judgment_reasoning")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def deep_judgment_parameters_messages(
    question: str, response: str, schema: dict[str, Any], excerpts: dict[str, list[dict[str, Any]]],
    reasoning: dict[str, str], options: dict[str, Any], system_prompt: str | None,
) -> list[dict[str, str]]:
    """Stage 3 of template deep judgment: the normal structured parse, informed by the evidence."""
    msgs = parsing_messages(question, response, schema, options, system_prompt)
    evidence = []
    for name in schema.get("properties", {}):
        quotes = "; ".join(f'"{e["text"]}"' for e in excerpts.get(name) or []) or "none found"
        evidence.append(f"- {name}: excerpts: {quotes}\n  reasoning: {reasoning.get(name, '')}")
    msgs[-1]["content"] += (
        "\n\nEvidence gathered from the response (verbatim excerpts and reasoning per field) - base each field "
        "on it; do not fill a field with a value the evidence does not support:\n" + "\n".join(evidence)
    )
    return msgs


HALLUCINATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "excerpt_assessments": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "excerpt_id": {"type": "string"},
                    "hallucination_risk": {"type": "string", "enum": ["none", "low", "medium", "high"]},
                    "justification": {"type": "string"},
                },
                "required": ["excerpt_id", "hallucination_risk", "justification"],
            },
        }
    },
    "required": ["excerpt_assessments"],
}


def hallucination_messages(question: str, items: list[dict[str, Any]], options: dict[str, Any]) -> list[dict[str, str]]:
    """Per-excerpt hallucination risk given external search results (one batched call)."""
    system = (
        "You assess whether claims quoted from a model's response are supported by external search results. "
        "Risk levels: none (search results clearly confirm the claim), low (mostly supported), medium (weak, "
        "partial or conflicting support), high (contradicted, or nothing in the results supports it). "
        "Reply with JSON only."
    )
    listing = "\n\n".join(
        f"[{it['excerpt_id']}] about {it['about']}:\nclaim: \"{it['excerpt']}\"\nsearch results:\n"
        f"{it['search_results'] or '(no results)'}"
        for it in items
    )
    user = (
        f"Question:\n{question}\n\nClaims and their search results:\n\n{listing}\n\n"
        f"Return only JSON matching: {json.dumps(HALLUCINATION_SCHEMA)}" + _custom(options, "deep_judgment_hallucination")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


EQUIVALENCE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"semantically_equivalent": {"type": "boolean"}, "reasoning": {"type": "string"}},
    "required": ["semantically_equivalent", "reasoning"],
    "additionalProperties": False,
}


def equivalence_messages(question: str, expected: str, parsed: str, options: dict[str, Any]) -> list[dict[str, str]]:
    """Embedding check: does the parsed answer mean the same as the ground truth, for this question?"""
    system = (
        "You decide whether two answers to the same question are semantically equivalent: they give the same "
        "core information and would lead to the same conclusion, even if worded or formatted differently. A "
        "different value, a more general or a more specific claim is NOT equivalent. Reply with JSON only."
    )
    user = (
        f"Question:\n{question}\n\nGround truth answer:\n{expected}\n\nModel answer (as parsed):\n{parsed}\n\n"
        f"Return only JSON matching: {json.dumps(EQUIVALENCE_SCHEMA)}" + _custom(options, "embedding_check")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


TRAIT_EXCERPT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "excerpts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "confidence": {"type": "string", "enum": ["low", "medium", "high"]},
                },
                "required": ["text", "confidence"],
            },
        }
    },
    "required": ["excerpts"],
}


def rubric_trait_excerpt_messages(
    question: str, response: str, trait_name: str, criteria: str, max_excerpts: int, options: dict[str, Any],
) -> list[dict[str, str]]:
    """Rubric deep judgment stage 1: verbatim passages that bear on one trait."""
    system = (
        f"You extract verbatim evidence for grading one rubric trait. Quote up to {max_excerpts} exact passages of "
        "the response that show whether it meets the trait (supporting or contradicting), each with a confidence "
        "(low|medium|high). Copy quotes character for character; never paraphrase. Reply with JSON only."
    )
    user = (
        f"Question:\n{question}\n\nResponse:\n<response>\n{response}\n</response>\n\n"
        f"Trait: {trait_name}\nCriteria: {criteria}\n\n"
        f"Return only JSON matching: {json.dumps(TRAIT_EXCERPT_SCHEMA)}" + _custom(options, "deep_judgment_rubric")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def rubric_trait_reasoning_messages(
    question: str, response: str | None, trait_name: str, criteria: str, excerpts: list[dict[str, Any]] | None,
    overall_risk: str | None, options: dict[str, Any],
) -> list[dict[str, str]]:
    """Rubric deep judgment stage 2: free-text reasoning, from the excerpts (or the whole response)."""
    system = (
        "You reason about whether a response meets one rubric trait, grounded in the evidence given. Write a short "
        "paragraph: what the evidence shows, what counts for and against, and your conclusion. Plain text."
    )
    if excerpts is not None:
        evidence = "Evidence (verbatim excerpts of the response):\n" + "\n".join(_excerpt_lines(excerpts))
        if overall_risk:
            evidence += f"\nOverall hallucination risk of these excerpts (from external search): {overall_risk}"
    else:
        evidence = f"Response:\n<response>\n{response or ''}\n</response>"
    user = (f"Question:\n{question}\n\nTrait: {trait_name}\nCriteria: {criteria}\n\n{evidence}"
            + _custom(options, "deep_judgment_rubric"))
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def rubric_trait_score_messages(
    question: str, trait_name: str, criteria: str, kind_text: str, reasoning: str, schema: dict[str, Any],
    options: dict[str, Any],
) -> list[dict[str, str]]:
    """Rubric deep judgment stage 3: the score that the reasoning supports."""
    system = "You turn a grader's reasoning into the trait's final value. Follow the reasoning's conclusion. JSON only."
    user = (
        f"Question:\n{question}\n\nTrait: {trait_name} [{kind_text}]\nCriteria: {criteria}\n\n"
        f"Reasoning:\n{reasoning}\n\nReturn only JSON matching: {json.dumps(schema, sort_keys=True)}"
        + _custom(options, "deep_judgment_rubric")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


PRESENCE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "results": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "trait_name": {"type": "string"},
                    "present": {"type": "boolean"},
                    "reasoning": {"type": "string"},
                },
                "required": ["trait_name", "present"],
            },
        }
    },
    "required": ["results"],
}


def rubric_presence_messages(
    question: str, response: str, concepts: list[tuple[str, str]], options: dict[str, Any]
) -> list[dict[str, str]]:
    """Dynamic rubric presence check: which concepts does the response engage with (one batched call)?"""
    system = (
        "You decide which evaluation concepts are meaningfully present in a response. A concept is PRESENT when "
        "the response engages with it substantively (discusses it, gives information on it, takes a position); "
        "ABSENT when it is not mentioned or only in passing. When a concept has several aspects, any substantive "
        "aspect makes it present. When uncertain, answer present. Judge each concept independently. JSON only."
    )
    listing = "\n".join(f"- {name}: {text}" for name, text in concepts)
    user = (
        f"Question:\n{question}\n\nConcepts to check:\n{listing}\n\nResponse:\n<response>\n{response}\n</response>\n\n"
        f"Return only JSON matching: {json.dumps(PRESENCE_SCHEMA)}" + _custom(options, "rubric_presence_check")
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
