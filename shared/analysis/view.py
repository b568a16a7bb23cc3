"""The base of the result views: the rows every view shares and the pandas helpers they group with."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from shared.analysis.stats import model_matches
from shared.core.models import VerificationResult

if TYPE_CHECKING:
    import pandas as pd

from shared.analysis.aggregators import (
    DEFAULT_AGGREGATORS,
    AggregatorRegistry,
    ResultAggregator,
    _clean,
    _is_nan,
)

_BY_ALIASES = {"question": "question_id", "model": "answering_model", "answering": "answering_model",
               "parsing": "parsing_model", "judge": "parsing_model"}


def _by(by: str) -> str:
    return _BY_ALIASES.get(by, by)


def _ident(r: VerificationResult, *, text: bool = True, prompts: bool = True) -> dict[str, Any]:
    m = r.metadata
    row: dict[str, Any] = {
        "completed_without_errors": m.completed_without_errors,
        "error": m.error,
        "question_id": m.question_id,
        "template_id": m.template_id,
    }
    if text:
        row["question_text"] = m.question_text
        row["keywords"] = m.keywords
    row["replicate"] = m.replicate
    row["answering_model"] = m.answering_model
    row["parsing_model"] = m.parsing_model
    if prompts:
        row["answering_system_prompt"] = m.answering_system_prompt
        row["parsing_system_prompt"] = m.parsing_system_prompt
    return row


def _tail(r: VerificationResult) -> dict[str, Any]:
    m = r.metadata
    return {"execution_time": m.execution_time, "timestamp": m.timestamp, "run_name": m.run_name}


def _frame(rows: list[dict[str, Any]], columns: Sequence[str]) -> pd.DataFrame:
    # local import: pandas takes ~2 s to import; only DataFrame output needs it
    import pandas as pd

    return pd.DataFrame(rows, columns=list(columns))


def _group_dict(df: pd.DataFrame, by: str, value: str, fn: Callable[[Any], Any]) -> dict[Any, Any]:
    """{group: fn(values)} over rows whose `value` is not null (groups with None keys kept)."""
    by = _by(by)
    if df.empty or by not in df.columns:
        if not df.empty:
            raise KeyError(f"cannot group by {by!r}: columns are {list(df.columns)}")
        return {}
    sub = df[df[value].notna()]
    out: dict[Any, Any] = {}
    for key, grp in sub.groupby(by, dropna=False, sort=True):
        out[_key(key)] = fn(grp[value])
    return out


def _key(v: Any) -> Any:
    """A group key as a plain value: NaN -> None, 2.0 -> 2 (replicates become floats next to None)."""
    if _is_nan(v):
        return None
    v = _clean(v)
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _nested(df: pd.DataFrame, by: str, inner: str, value: str, agg: ResultAggregator, **kw: Any) -> dict[Any, dict[Any, Any]]:
    by = _by(by)
    if df.empty:
        return {}
    if by not in df.columns:
        raise KeyError(f"cannot group by {by!r}: columns are {list(df.columns)}")
    sub = df[df[inner].notna()]
    out: dict[Any, dict[Any, Any]] = {}
    for (key, name), grp in sub.groupby([by, inner], dropna=False, sort=True):
        out.setdefault(_key(key), {})[name] = agg.aggregate(grp[value], **kw)
    return out


class _View:
    """What every view shares: a list of results, iteration, filtering and grouping."""

    def __init__(self, results: Iterable[VerificationResult], aggregators: AggregatorRegistry | None = None) -> None:
        self.results: list[VerificationResult] = list(results)
        self._aggregators = aggregators.copy() if aggregators is not None else DEFAULT_AGGREGATORS.copy()

    def _new(self, results: Iterable[VerificationResult]) -> Any:
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.results = list(results)
        return clone

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self) -> Iterator[VerificationResult]:
        return iter(self.results)

    @overload
    def __getitem__(self, index: int) -> VerificationResult: ...
    @overload
    def __getitem__(self, index: slice) -> Any: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self._new(self.results[index])
        return self.results[index]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.results)} results)"

    # ---- aggregators ----
    def register_aggregator(self, name: str, aggregator: ResultAggregator) -> None:
        self._aggregators.register(name, aggregator)

    def list_aggregators(self) -> list[str]:
        return self._aggregators.names()

    # ---- filter / group ----
    def _filtered(
        self, question_ids: Sequence[str] | None = None, answering_models: Sequence[str] | None = None,
        parsing_models: Sequence[str] | None = None, replicates: Sequence[int | None] | None = None,
        completed_only: bool = False, run_names: Sequence[str] | None = None,
        predicate: Callable[[VerificationResult], bool] | None = None,
    ) -> list[VerificationResult]:
        qs = set(question_ids) if question_ids else None
        reps = set(replicates) if replicates else None
        runs = set(run_names) if run_names else None
        out = []
        for r in self.results:
            m = r.metadata
            if qs is not None and m.question_id not in qs:
                continue
            if answering_models and not any(model_matches(m.answering_model, m.answering.model_name, a)
                                            for a in answering_models):
                continue
            if parsing_models and not any(model_matches(m.parsing_model, m.parsing.model_name, p)
                                          for p in parsing_models):
                continue
            if reps is not None and m.replicate not in reps:
                continue
            if completed_only and not m.completed_without_errors:
                continue
            if runs is not None and m.run_name not in runs:
                continue
            if predicate is not None and not predicate(r):
                continue
            out.append(r)
        return out

    def _groups(self, key: Callable[[VerificationResult], Any]) -> dict[Any, Any]:
        grouped: dict[Any, list[VerificationResult]] = {}
        for r in self.results:
            grouped.setdefault(key(r), []).append(r)
        return {k: self._new(v) for k, v in grouped.items()}

    def group_by_question(self) -> dict[str, Any]:
        return self._groups(lambda r: r.metadata.question_id)

    def group_by_model(self, by: Literal["answering", "parsing", "both"] = "answering") -> dict[str, Any]:
        """Group by answering model (MCP servers included in the key), judge, or both."""
        if by not in ("answering", "parsing", "both"):
            raise ValueError(f"by must be 'answering', 'parsing' or 'both', got {by!r}")

        def key(r: VerificationResult) -> str:
            answering = r.metadata.answering_model
            mcp = r.template.answering_mcp_servers if r.template is not None else None
            if mcp:
                answering = f"{answering} + MCP[{','.join(sorted(mcp))}]"
            if by == "answering":
                return answering
            if by == "parsing":
                return r.metadata.parsing_model
            return f"{answering} / {r.metadata.parsing_model}"

        return self._groups(key)

    def group_by_replicate(self) -> dict[int | None, Any]:
        return self._groups(lambda r: r.metadata.replicate)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are different
        return False
