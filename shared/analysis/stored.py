"""A run's results as a lazy, re-iterable stream from the store (issue 13: nothing loads a
whole run into memory).

`StoredResults` looks like a sequence of `VerificationResult`s to the report code (`len`, `for r
in ...`, truthiness) but holds none: every iteration runs keyset-paged queries of at most
`page_size` rows (`shared.store.reads.iter_pages`) and parses one page at a time, so a pass over a
100k-result run keeps one page in memory. Counts come from SQL.

`iter_sorted` streams in the report's file order (question, answering model, judge, replicate),
also keyset-paged; `for_questions` streams the results of a few questions (the appendix).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from shared.core.models import VerificationResult
from shared.store.reads import QueryError, ResultFilter, RowSource, iter_result_json

Opener = Callable[[], AbstractContextManager[RowSource]]

# the report's file order, with result_id last so the key is unique (keyset paging)
_SORT_KEY = "question_id, answering_model, parsing_model, ifNull(replicate, 0), result_id"


def _text(blob: Any) -> str:
    return blob.decode() if isinstance(blob, bytes | bytearray) else str(blob)


class StoredResults:
    """The results matching `where`, read page by page on every iteration (never all at once)."""

    def __init__(self, opener: Opener | RowSource, where: ResultFilter, *, page_size: int = 500) -> None:
        if callable(opener):
            self._opener: Opener = opener
        else:
            source = opener
            self._opener = lambda: contextlib.nullcontext(source)
        self.where = where
        self.page_size = max(1, int(page_size))
        self._len: int | None = None

    def _query(self, sql: str, params: dict[str, Any]) -> Any:
        with self._opener() as source:
            return source.query(sql, params)

    def __len__(self) -> int:
        if self._len is None:
            cond, params = self.where.sql()
            res = self._query(f"SELECT count() FROM verification_results FINAL WHERE {cond}", params)
            self._len = int(res.rows[0][0]) if res.rows else 0
        return self._len

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[VerificationResult]:
        with self._opener() as source:
            for _, blob in iter_result_json(source, self.where, page_size=self.page_size):
                yield VerificationResult.model_validate_json(blob)

    def __repr__(self) -> str:
        return f"StoredResults({self.where.run_id or self.where.run_name or 'all runs'}, page_size={self.page_size})"

    def answering_models(self) -> list[tuple[str, str]]:
        """(display string, model name) of each answering model of these results, in one query."""
        cond, params = self.where.sql()
        res = self._query(f"SELECT DISTINCT answering_model, answering_model_name FROM verification_results FINAL "
                          f"WHERE {cond} ORDER BY answering_model", params)
        return [(str(d), str(n)) for d, n in res.rows]

    def execution_time_by_model(self) -> list[tuple[str, int, float | None, float | None, float | None]]:
        """(answering model, results, p50, p95, max) of execution_time, aggregated in SQL."""
        cond, params = self.where.sql()
        res = self._query(
            "SELECT answering_model, count(), quantileExactInclusive(0.5)(execution_time), "
            "quantileExactInclusive(0.95)(execution_time), max(execution_time) FROM verification_results FINAL "
            f"WHERE {cond} GROUP BY answering_model ORDER BY answering_model", params)
        return [(str(r[0]), int(r[1]), float(r[2]), float(r[3]), float(r[4])) for r in res.rows]

    def iter_sorted(self, question_ids: Sequence[str] | None = None) -> Iterator[VerificationResult]:
        """In (question, answering model, judge, replicate) order, keyset-paged on that key."""
        cond, params = self.where.sql()
        if question_ids is not None:
            cond += " AND question_id IN {s_q:Array(String)}"
            params = {**params, "s_q": list(question_ids)}
        after: tuple[Any, ...] | None = None
        size = self.page_size
        with self._opener() as source:
            while True:
                key = ""
                p = dict(params)
                if after is not None:
                    key = (" AND (question_id, answering_model, parsing_model, ifNull(replicate, 0), result_id) > "
                           "({a_q:String}, {a_m:String}, {a_p:String}, {a_r:UInt32}, {a_id:String})")
                    p.update(zip(("a_q", "a_m", "a_p", "a_r", "a_id"), after, strict=True))
                try:
                    page = source.query(
                        f"SELECT {_SORT_KEY}, result_json FROM verification_results FINAL WHERE {cond}{key} "
                        f"ORDER BY {_SORT_KEY} LIMIT {size}", p)
                except QueryError as exc:  # the projector's reply would pass the NATS payload limit
                    if "too large" in str(exc) and size > 1:
                        size = max(1, size // 4)
                        continue
                    raise
                for row in page.rows:
                    yield VerificationResult.model_validate_json(_text(row[5]))
                if len(page.rows) < size:
                    return
                last = page.rows[-1]
                after = (str(last[0]), str(last[1]), str(last[2]), int(last[3] or 0), str(last[4]))

    def for_questions(self, question_ids: Sequence[str]) -> Iterator[VerificationResult]:
        return self.iter_sorted(question_ids)


def _sort_key(r: VerificationResult) -> tuple[str, str, str, int]:
    m = r.metadata
    return (m.question_id, m.answering_model, m.parsing_model, m.replicate or 0)


def iter_sorted(results: Iterable[VerificationResult]) -> Iterator[VerificationResult]:
    """Results in the report's file order: streamed from the store for `StoredResults`, sorted
    in memory for a list (a list is in memory already)."""
    if isinstance(results, StoredResults):
        return results.iter_sorted()
    return iter(sorted(results, key=_sort_key))


def for_questions(results: Iterable[VerificationResult], question_ids: Sequence[str]) -> Iterator[VerificationResult]:
    """The results of some questions in file order (from the store, or filtered from a list)."""
    if isinstance(results, StoredResults):
        return results.for_questions(question_ids)
    wanted = set(question_ids)
    return iter(sorted((r for r in results if r.metadata.question_id in wanted), key=_sort_key))

