"""The simulator's script for a benchmark: each question's expected answer and, from its
template's ground truth, the judge's parse, so an offline run passes."""

from __future__ import annotations

import ast
from typing import Any

from shared.core.benchmark.model import Benchmark
from shared.core.rubric import (
    LLMRubricTrait,
    RubricError,
)

SIMULATED_ANSWER = "Simulated answer"
def template_ground_truth(template_code: str | None) -> dict[str, Any] | None:
    """The literal dict a template assigns to `self.correct`, read with `ast` (never executed)."""
    if not template_code:
        return None
    try:
        tree = ast.parse(template_code)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr == "correct"
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and value is not None
            ):
                try:
                    found = ast.literal_eval(value)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    continue
                if isinstance(found, dict):
                    return found
    return None


def _default_judge_value(trait: LLMRubricTrait) -> Any:
    if trait.kind == "boolean":
        return trait.higher_is_better
    if trait.kind == "literal":
        names = trait.class_names()
        return names[-1] if trait.higher_is_better else names[0]
    return trait.max_score if trait.higher_is_better else trait.min_score


def simulator_script_for(benchmark: Benchmark) -> dict[str, Any]:
    """A default LLM-simulator script: right answers, parsed = template ground truth, best judge scores.

    Lets any benchmark (reference checkpoints included) run offline against the simulator.
    """
    entries: list[dict[str, Any]] = []
    for q in benchmark.questions:
        entry: dict[str, Any] = {"match": q.text, "answer": q.raw_answer or SIMULATED_ANSWER}
        truth = template_ground_truth(q.template_code)
        if truth is not None:
            entry["parsed"] = truth
        try:
            rubric = benchmark.rubric_for(q)
        except RubricError:
            rubric = None
        if rubric is not None and rubric.llm_traits:
            entry["judge"] = {t.name: _default_judge_value(t) for t in rubric.llm_traits}
        entries.append(entry)
    return {"questions": entries}
