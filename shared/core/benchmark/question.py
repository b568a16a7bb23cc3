"""A benchmark question and the error that names what is wrong with a benchmark."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shared.core.ids import template_id_for
from shared.core.rubric import (
    Rubric,
)


class BenchmarkError(Exception):
    """A benchmark that cannot be used; the message says where (file, question, field) and why."""

    def __init__(
        self, message: str, *, path: str | None = None, question_id: str | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.question_id = question_id
        self.field = field


def first_words(text: str, limit: int = 40) -> str:
    """A short, single-line preview of a question for messages."""
    one_line = " ".join(str(text).split())
    return one_line if len(one_line) <= limit else one_line[: limit - 1].rstrip() + "…"


class Question(BaseModel):
    """One benchmark question: text, ground-truth answer, template source and its own rubric."""

    model_config = ConfigDict(extra="forbid")

    id: str
    text: str
    raw_answer: str | None = None
    template_code: str | None = None
    keywords: list[str] = Field(default_factory=list)
    finished: bool = True
    rubric: Rubric | None = None
    few_shot_examples: list[dict[str, str]] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def template_id(self) -> str:
        return template_id_for(self.template_code)

    def label(self) -> str:
        """`question <id> ('<first words>')`: how messages name this question."""
        return f"question {self.id} ({first_words(self.text)!r})"
