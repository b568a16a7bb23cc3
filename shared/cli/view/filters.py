"""The viewer's filters: parsed from a query string, turned into a parameterised WHERE clause
over `verification_results`, and back into a query string for deep links.

Values never enter the SQL text: every one is a `{name:Type}` parameter."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import urlencode

from shared.core.verdict import SQL_ERRORED, SQL_FAILED, SQL_PASSED

STATUSES = ("passed", "failed", "errored")
MAX_VALUE = 500  # characters: a longer filter value is refused, not truncated silently


class FilterError(ValueError):
    """A filter value the viewer refuses (names the parameter and the problem)."""


def checked_value(name: str, raw: object, what: str = "filter") -> str:
    """A query parameter's value, stripped; FilterError naming the parameter when it is not text,
    too long or holds a NUL (a page's parameters and the filters share these checks)."""
    if not isinstance(raw, str):
        raise FilterError(f"{what} {name!r}: expected text")
    raw = raw.strip()
    if len(raw) > MAX_VALUE:
        raise FilterError(f"{what} {name!r}: longer than {MAX_VALUE} characters")
    if "\x00" in raw:
        raise FilterError(f"{what} {name!r}: contains a NUL character")
    return raw


@dataclass(frozen=True)
class Filters:
    """What the run, sample and compare pages narrow results by."""

    model: str = ""    # answering model: display string (`litellm:gpt-4o`) or model name
    judge: str = ""    # parsing model, same forms
    keyword: str = ""  # one of the question's keywords
    status: str = ""   # passed | failed | errored
    q: str = ""        # text search in question id/text, the response and the error

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> Filters:
        values: dict[str, str] = {}
        for f in fields(cls):
            values[f.name] = checked_value(f.name, query.get(f.name, ""))
        if values["status"] and values["status"] not in STATUSES:
            raise FilterError(f"filter 'status': {values['status']!r} is not one of {', '.join(STATUSES)}")
        return cls(**values)

    def active(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def with_(self, **changes: str) -> Filters:
        return replace(self, **changes)

    def query_string(self, **extra: Any) -> str:
        """The filters (and `extra`) as a URL query string, empty values left out."""
        items = [(f.name, getattr(self, f.name)) for f in fields(self)]
        items += [(k, str(v)) for k, v in extra.items() if v not in (None, "")]
        return urlencode([(k, v) for k, v in items if v])

    def sql(self, prefix: str = "f") -> tuple[str, dict[str, Any]]:
        """(condition, params): ANDed conditions, "1" when no filter is set."""
        clauses: list[str] = []
        params: dict[str, Any] = {}
        if self.model:
            clauses.append(f"(answering_model = {{{prefix}_m:String}} OR answering_model_name = {{{prefix}_m:String}})")
            params[f"{prefix}_m"] = self.model
        if self.judge:
            clauses.append(f"(parsing_model = {{{prefix}_j:String}} OR parsing_model_name = {{{prefix}_j:String}})")
            params[f"{prefix}_j"] = self.judge
        if self.keyword:
            clauses.append(f"has(keywords, {{{prefix}_k:String}})")
            params[f"{prefix}_k"] = self.keyword
        # an error (verify() raising included) is never a pass nor a fail: shared.core.verdict
        if self.status == "passed":
            clauses.append(SQL_PASSED)
        elif self.status == "failed":
            clauses.append(SQL_FAILED)
        elif self.status == "errored":
            clauses.append(SQL_ERRORED)
        if self.q:
            clauses.append(
                f"(positionCaseInsensitiveUTF8(question_text, {{{prefix}_q:String}}) > 0 "
                f"OR positionCaseInsensitiveUTF8(question_id, {{{prefix}_q:String}}) > 0 "
                f"OR positionCaseInsensitiveUTF8(raw_llm_response, {{{prefix}_q:String}}) > 0 "
                f"OR positionCaseInsensitiveUTF8(ifNull(error, ''), {{{prefix}_q:String}}) > 0)")
            params[f"{prefix}_q"] = self.q
        return (" AND ".join(clauses) or "1"), params
