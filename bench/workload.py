"""The generated workload every benchmark and the stack tests use (written once): N questions
"what is i plus i?", each with an int template, and the simulator script that answers them
(one in `wrong_every` wrongly, so verdicts are a known mix)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import yaml

INT_TEMPLATE = '''from karenina.schemas.entities import BaseAnswer
from pydantic import Field

class Answer(BaseAnswer):
    value: int = Field(description="The number asked for")

    def model_post_init(self, __context):
        self.correct = {{"value": {n}}}

    def verify(self) -> bool:
{verify}
'''
VERIFY = 'return self.value == self.correct["value"]'

RUBRIC = {
    "llm_traits": [{"name": "Clarity", "kind": "boolean", "description": "The answer is clear."}],
    "regex_traits": [{"name": "NoApology", "pattern": "(?i)sorry", "invert_result": True}],
}


def int_template(n: int, verify: str = VERIFY) -> str:
    """Template code whose verify() passes exactly when the parsed `value` is `n`; tests give
    another `verify` body (unindented source) to attack the sandbox from the same template."""
    return INT_TEMPLATE.format(n=n, verify=textwrap.indent(verify, " " * 8).rstrip("\n"))


def generated_benchmark(path: Path, n: int, *, rubric: bool = False, wrong_every: int = 10, prefix: str = "Bench",
                        ids: str = "q{i:04d}") -> tuple[Path, dict[str, Any]]:
    """Write the benchmark (YAML, named `<prefix>-<n>` in lower case, with `RUBRIC` as its global
    rubric when `rubric`) and return it with the simulator script. Question i's id is
    `ids.format(i=i)`; the simulator answers `2i + 1` for every `wrong_every`-th question (none
    when 0) and `2i` otherwise, and judges every answer clear."""
    questions, script = [], []
    for i in range(n):
        text = f"{prefix} question {i}: what is {i} plus {i}?"
        questions.append({"id": ids.format(i=i), "question": text, "answer": str(2 * i),
                          "template": int_template(2 * i)})
        value = 2 * i + 1 if wrong_every and i % wrong_every == 0 else 2 * i
        script.append({"match": text, "answer": f"The sum is {value}.", "parsed": {"value": value},
                       "judge": {"Clarity": True}})
    doc: dict[str, Any] = {"name": f"{prefix.lower()}-{n}", "questions": questions}
    if rubric:
        doc["rubric"] = RUBRIC
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, {"questions": script}


def expected_verdicts(n: int, wrong_every: int = 10, ids: str = "q{i:04d}") -> dict[str, bool]:
    """The verdict each question of `generated_benchmark` gets."""
    return {ids.format(i=i): not (wrong_every and i % wrong_every == 0) for i in range(n)}
