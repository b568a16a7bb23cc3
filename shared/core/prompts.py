"""Judge prompts, in one place. Each judge prompt quotes the question verbatim (the LLM
simulator matches its script entries on it) and asks for JSON matching a schema.
"""

from __future__ import annotations

import json
from typing import Any


def _custom(job_options: dict[str, Any], key: str) -> str:
    extra = (job_options.get("prompt_config") or {}).get(key)
    return f"\n\nAdditional instructions:\n{extra}" if extra else ""


def _chat(system: str, user: str, options: dict[str, Any], key: str) -> list[dict[str, str]]:
    """The two messages of every judge prompt: the system prompt, then the user text with the job's
    additional instructions for `key` (its `prompt_config`) appended."""
    return [{"role": "system", "content": system}, {"role": "user", "content": user + _custom(options, key)}]


def _schema_reply(schema: dict[str, Any]) -> str:
    """The closing line of the prompts that parse into a template's schema."""
    return f"Return only a JSON object that matches this JSON schema:\n{json.dumps(schema, sort_keys=True)}"


# The answering model's instruction when the run configures none (the reference gives every
# answering model a default one, and records it on the result).
DEFAULT_ANSWERING_SYSTEM_PROMPT = "You are a knowledgeable expert. Give a correct, concise answer to the question."


def answering_system_prompt(configured: str | None) -> str:
    """The system prompt the answering model is sent: the configured one, else the default."""
    return configured if configured and configured.strip() else DEFAULT_ANSWERING_SYSTEM_PROMPT


def answer_messages(
    question: str, system_prompt: str | None, few_shot: list[dict[str, str]] | None
) -> list[dict[str, str]]:
    """Messages for the answering model: system prompt (the default when none is configured),
    few-shot pairs, then the question."""
    msgs: list[dict[str, str]] = [{"role": "system", "content": answering_system_prompt(system_prompt)}]
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
        + _schema_reply(schema)
    )
    return _chat(system, user, options, "parsing")


# Reasoning first, verdict second (the reference's order: the judge quotes before it decides).
ABSTENTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "reasoning": {"type": "string"},
        "abstention_detected": {"type": "boolean"},
    },
    "required": ["reasoning", "abstention_detected"],
    "additionalProperties": False,
}

ABSTENTION_SYSTEM = """You decide whether a model's response openly declines to answer the question it was asked.
Base every decision on words that really occur in the response; never invent or reword a quote.

Work through these steps in order and stop at the first one that settles the case.

Step 1 - look for an explicit disclaimer, copied word for word. It must be a sentence in which the model says,
about THIS question, one of:
  * it cannot or will not act (for example "I can't answer that", "I won't provide", "I'm unable to give");
  * it cannot reach the information or the tools needed ("I do not have access to", "I can't retrieve",
    "I have no real-time access");
  * it does not know ("I have no information on", "I could not find any data about");
  * a policy forbids it ("that is against my guidelines", "I am not permitted to").
Put the exact sentence in your reasoning. No such sentence: abstention_detected = false, stop.

Step 2 - does the response still commit to an answer anyway? A commitment is an assertion offered as the
response's own answer: a plain yes or no, a named entity, a number, a category, a definite claim. A
conditional ("if A then B"), a list of places or steps for the reader to consult, or general background on
the topic is not a commitment.
  * A commitment is present: abstention_detected = false (the disclaimer only qualifies the answer), stop.
  * No commitment (only caveats, how-to advice, background, pointers elsewhere): abstention_detected = true, stop.

Step 3 - if steps 1 and 2 left it unclear, answer abstention_detected = false.

Keep these apart:
  * Disclaimers about the model's own ability (can't act, can't access, doesn't know) signal abstention.
    Hedges about the answer itself ("usually", "typically", "probably", "about") do not: "it is probably X"
    is a committed answer.
  * Caveats attached to a committed answer ("please double-check this with a current source") are not abstention.
  * Disclaiming ability and then giving only background, a method or places to look IS abstention, however
    long and informative the background is.
  * Reporting that a tool returned nothing is a factual report, not a refusal.

Reply with JSON: "reasoning" (the quote from step 1, or a note that there is none, then one sentence on
whether the response commits to an answer) followed by "abstention_detected" (the boolean verdict)."""


def abstention_messages(question: str, response: str, options: dict[str, Any]) -> list[dict[str, str]]:
    """Abstention check: did the model explicitly decline (verbatim disclaimer, no committed answer)?"""
    user = (
        f"Question:\n{question}\n\nResponse:\n<response>\n{response}\n</response>\n\n"
        "Does the response explicitly declare that it is not answering? Reasoning first, verdict second.\n"
        f"Return only JSON matching: {json.dumps(ABSTENTION_SCHEMA)}"
    )
    return _chat(ABSTENTION_SYSTEM, user, options, "abstention_detection")


SUFFICIENCY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"reasoning": {"type": "string"}, "sufficient": {"type": "boolean"}},
    "required": ["reasoning", "sufficient"],
    "additionalProperties": False,
}

SUFFICIENCY_SYSTEM = """You decide whether a model's response holds enough information to fill in an answer template.

Rule: the response is sufficient exactly when every REQUIRED field of the template schema has at least one
piece of the response that can be mapped onto it. Map leniently: a hedged, approximate or qualified value
counts as present. Optional fields, and fields that have a default, do not count either way - a missing
optional field never makes a response insufficient.

Which fields are required: those listed in the schema's "required" array (or otherwise marked as not optional).

A required field is satisfied when the response gives
  * an explicit value or statement for it,
  * a hedged or approximate value ("roughly 40", "most likely Y"),
  * a value that clearly follows from what the response says nearby,
  * a qualified answer that still commits to a value despite its caveats.
A required field is NOT satisfied when
  * nothing in the response could plausibly fill it,
  * the response says the information is unknown, unavailable or cannot be obtained,
  * the response stays so vague that no candidate value for that field can be read from it.

How to work: go through the required fields one at a time; use each field's description (and the question,
when a field's name or description is ambiguous) to see what it needs; be lenient - any plausible span counts.
Then give the verdict: sufficient only if every required field is satisfied. Judge presence, not correctness.

Reply with JSON: "reasoning" (one line per required field) followed by "sufficient" (the boolean verdict)."""


def required_fields(schema: dict[str, Any]) -> list[str]:
    """The schema's required fields (the ones sufficiency is judged on)."""
    req = schema.get("required")
    return [str(r) for r in req] if isinstance(req, list) else []


def sufficiency_messages(
    question: str, response: str, schema: dict[str, Any], options: dict[str, Any]
) -> list[dict[str, str]]:
    """Sufficiency check: can every required template field be filled from the response (leniently)?"""
    required = required_fields(schema)
    user = (
        f"Question:\n{question}\n\nResponse:\n<response>\n{response}\n</response>\n\n"
        f"Template schema:\n{json.dumps(schema, sort_keys=True)}\n\n"
        f"Required fields: {', '.join(required) if required else '(none listed)'}\n\n"
        "Can every required field be filled from the response? Reasoning first, verdict second.\n"
        f"Return only JSON matching: {json.dumps(SUFFICIENCY_SCHEMA)}"
    )
    return _chat(SUFFICIENCY_SYSTEM, user, options, "sufficiency_detection")


def _kind_text(trait: Any) -> str:
    if trait.kind == "boolean":
        return "boolean: true if the response meets the criterion, false if not"
    if trait.kind == "literal":
        return "literal: exactly one of the classes below, by its exact name"
    return f"score: an integer from {trait.min_score} (worst) to {trait.max_score} (best)" if getattr(
        trait, "higher_is_better", True) else (
        f"score: an integer from {trait.min_score} to {trait.max_score} (lower is better)")


def trait_lines(traits: list[Any]) -> str:
    """Every trait the judge scores: name, kind with its range, description, and for literal traits
    each class with its own description (the class descriptions are what tell classes apart)."""
    lines = []
    for t in traits:
        lines.append(f"- {t.name} [{_kind_text(t)}]: {t.description or 'no description given'}")
        if t.kind == "literal":
            for i, (cname, cdesc) in enumerate((t.classes or {}).items()):
                lines.append(f"    class {i} \"{cname}\": {cdesc}")
    return "\n".join(lines)


RUBRIC_SYSTEM = """You grade a model's response against rubric traits, one value per trait.
- Use the trait names exactly as given.
- Boolean traits: true or false. Score traits: an integer inside the stated range. Literal traits: the exact
  name of one of the listed classes - read each class's description, pick the single class that fits the
  response best (the dominant one when several apply), never invent a class.
- Judge only what the response shows; apply each trait's criterion as written, weigh what speaks for and
  against, and be consistent across responses.
- Every trait must get a value."""


def rubric_messages(
    question: str, response: str, traits: list[Any], schema: dict[str, Any], options: dict[str, Any]
) -> list[dict[str, str]]:
    """LLM rubric traits (one batch, or one trait per call in the sequential strategy)."""
    user = (
        f"Question:\n{question}\n\nResponse:\n<response>\n{response}\n</response>\n\n"
        f"Traits:\n{trait_lines(traits)}\n\n"
        f"Return only JSON matching: {json.dumps(schema, sort_keys=True)}"
    )
    return _chat(RUBRIC_SYSTEM, user, options, "rubric_evaluation")


def metric_schema(full_matrix: bool) -> dict[str, Any]:
    """The four confusion lists (tn only in full-matrix mode), as the reference asks for them."""
    keys = ["tp", "fn", "fp"] + (["tn"] if full_matrix else [])
    return {
        "type": "object",
        "properties": {k: {"type": "array", "items": {"type": "string"}} for k in keys},
        "required": keys,
        "additionalProperties": False,
    }


METRIC_SYSTEM = """You analyse a response for a confusion matrix: you sort what it says into four lists.
- tp (true positives): content that SHOULD be in the answer and IS - copy the words as they appear IN THE
  ANSWER (a term or short phrase), not the instruction text.
- fn (false negatives): content that SHOULD be in the answer but is NOT - name the missing instruction content.
- tn (true negatives): content that should NOT be in the answer and is correctly absent - name those
  instructions.
- fp (false positives): content that should NOT be in the answer but IS - copy the words as they appear IN
  THE ANSWER.
Matching: exact wording, close variants and synonyms all count ("tumour" matches "neoplasm"), case does not
matter, and a more specific mention satisfies a general one ("lung cancer" satisfies "mention cancer").
Use short terms or phrases, never whole sentences; no duplicates within a list; when unsure whether an item
matches, include it."""


def metric_messages(question: str, response: str, trait: Any, options: dict[str, Any]) -> list[dict[str, str]]:
    """A metric trait: tp/fn/fp(/tn) lists for the trait's instructions (tp_only or full_matrix)."""
    full = getattr(trait, "evaluation_mode", "tp_only") == "full_matrix"
    tp = "\n".join(f"  {i}. {x}" for i, x in enumerate(trait.tp_instructions or [], 1))
    parts = [f"Metric trait: {trait.name}"]
    if trait.description:
        parts.append(f"Description: {trait.description}")
    parts.append(f"Content that SHOULD be present (true-positive instructions):\n{tp}")
    if full:
        tn = "\n".join(f"  {i}. {x}" for i, x in enumerate(trait.tn_instructions or [], 1))
        parts.append(f"Content that should NOT be present (true-negative instructions):\n{tn}")
        parts.append(
            "fp here: words of the answer that match a true-negative instruction (same matching rules as tp). "
            "tn: the true-negative instructions the answer does not touch.")
    else:
        parts.append(
            "There are no true-negative instructions: leave tn out. fp here: words of the answer that try to "
            "satisfy a true-positive instruction but are wrong - items of the same kind or category as the "
            "expected ones that look like valid answers and are not. Do NOT list filler, explanations or other "
            "content that is not an attempt at one of the instructions.")
    user = (
        f"Question:\n{question}\n\nAnswer to analyse:\n<response>\n{response}\n</response>\n\n"
        + "\n\n".join(parts)
        + f"\n\nReturn only JSON matching: {json.dumps(metric_schema(full), sort_keys=True)}"
    )
    return _chat(METRIC_SYSTEM, user, options, "rubric_evaluation")


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
        "with every attribute as a key."
    )
    return _chat(system, user, options, "deep_judgment_excerpts")


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
    )
    return _chat(system, user, options, "deep_judgment_reasoning")


def deep_judgment_parameters_messages(
    question: str, response: str, schema: dict[str, Any], excerpts: dict[str, list[dict[str, Any]]],
    reasoning: dict[str, str], options: dict[str, Any], system_prompt: str | None,
) -> list[dict[str, str]]:
    """Stage 3 of template deep judgment: the structured parse, as in the reference, OF THE REASONING
    (each field's value is the one its reasoning concluded), not of the response again. `response`
    and `excerpts` are accepted for the callers' convenience and are not sent: the reasoning already
    carries the evidence."""
    del response, excerpts
    names = list(schema.get("properties", {})) or list(reasoning)
    block = "\n".join(f"- {name}: {reasoning.get(name) or '(no reasoning given)'}" for name in names)
    system = _with_system(system_prompt, (
        "You fill in a JSON schema from a grader's reasoning about a response. Each field of the schema has a "
        "reasoning paragraph that concludes what value the response gives for it; put that concluded value in "
        "the field. Where the reasoning concludes the response gives no value, use null when the schema allows "
        "it. Do not add values the reasoning does not support. Reply with JSON only."
    ))
    user = (
        f"Question:\n{question}\n\nReasoning per field:\n{block}\n\n"
        + _schema_reply(schema)
    )
    return _chat(system, user, options, "parsing")


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
        f"Return only JSON matching: {json.dumps(HALLUCINATION_SCHEMA)}"
    )
    return _chat(system, user, options, "deep_judgment_hallucination")


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
        f"Return only JSON matching: {json.dumps(EQUIVALENCE_SCHEMA)}"
    )
    return _chat(system, user, options, "embedding_check")


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
        f"Return only JSON matching: {json.dumps(TRAIT_EXCERPT_SCHEMA)}"
    )
    return _chat(system, user, options, "deep_judgment_rubric")


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
    user = (f"Question:\n{question}\n\nTrait: {trait_name}\nCriteria: {criteria}\n\n{evidence}")
    return _chat(system, user, options, "deep_judgment_rubric")


def rubric_trait_score_messages(
    question: str, trait_name: str, criteria: str, kind_text: str, reasoning: str, schema: dict[str, Any],
    options: dict[str, Any],
) -> list[dict[str, str]]:
    """Rubric deep judgment stage 3: the score that the reasoning supports."""
    system = "You turn a grader's reasoning into the trait's final value. Follow the reasoning's conclusion. JSON only."
    user = (
        f"Question:\n{question}\n\nTrait: {trait_name} [{kind_text}]\nCriteria: {criteria}\n\n"
        f"Reasoning:\n{reasoning}\n\nReturn only JSON matching: {json.dumps(schema, sort_keys=True)}"
    )
    return _chat(system, user, options, "deep_judgment_rubric")


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
        f"Return only JSON matching: {json.dumps(PRESENCE_SCHEMA)}"
    )
    return _chat(system, user, options, "rubric_presence_check")
