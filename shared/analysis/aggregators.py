"""Named aggregation strategies of the result views (`mean`, `median`, `mode`, `majority_vote`,
`first`, `count`, plus any registered with `register_aggregator`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any, Protocol


class ResultAggregator(Protocol):
    """Anything with `aggregate(series, **kwargs)`: a pandas Series in, one value out."""

    def aggregate(self, series: Any, **kwargs: Any) -> Any: ...


def _numeric(series: Any) -> Any:
    # local import: pandas takes ~2 s to import; only DataFrame output needs it
    import pandas as pd

    return pd.to_numeric(series.map(lambda v: float(v) if isinstance(v, bool) else v), errors="coerce")


def _clean(value: Any) -> Any:
    """numpy scalars -> Python scalars (so results compare and serialise as plain values)."""
    if hasattr(value, "item") and callable(value.item):
        with contextlib.suppress(ValueError, TypeError):
            return value.item()
    return value


class MeanAggregator:
    def aggregate(self, series: Any, **_: Any) -> float | None:
        v = _numeric(series).mean()
        return None if v is None or math.isnan(v) else float(v)


class MedianAggregator:
    def aggregate(self, series: Any, **_: Any) -> float | None:
        v = _numeric(series).median()
        return None if v is None or math.isnan(v) else float(v)


class ModeAggregator:
    def aggregate(self, series: Any, **_: Any) -> Any:
        m = series.dropna().mode()
        return _clean(m.iloc[0]) if len(m) else None


class MajorityVoteAggregator:
    """True when the share of true values is above `threshold` (default 0.5, strictly above)."""

    def aggregate(self, series: Any, threshold: float = 0.5, **_: Any) -> bool | None:
        vals = _numeric(series).dropna()
        if not len(vals):
            return None
        return bool((vals != 0).sum() / len(vals) > threshold)


class FirstAggregator:
    def aggregate(self, series: Any, **_: Any) -> Any:
        vals = series.dropna()
        return _clean(vals.iloc[0]) if len(vals) else None


class CountAggregator:
    """Occurrences of each value: {value: count}."""

    def aggregate(self, series: Any, include_none: bool = False, **_: Any) -> dict[Any, int]:
        counts = series.value_counts(dropna=not include_none)
        return {(None if _is_nan(k) else _clean(k)): int(v) for k, v in counts.items()}


def _is_nan(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


class AggregatorRegistry:
    """Named aggregation strategies; each view has its own copy of the defaults."""

    def __init__(self, initial: Mapping[str, ResultAggregator] | None = None) -> None:
        self._items: dict[str, ResultAggregator] = dict(initial or {})

    def register(self, name: str, aggregator: ResultAggregator) -> None:
        if not callable(getattr(aggregator, "aggregate", None)):
            raise TypeError(f"aggregator {name!r} must have an aggregate(series, **kwargs) method")
        if name in self._items:
            raise ValueError(f"aggregator {name!r} is already registered")
        self._items[name] = aggregator

    def get(self, name: str) -> ResultAggregator:
        if name not in self._items:
            raise KeyError(f"unknown aggregation strategy {name!r}; available: {', '.join(self._items)}")
        return self._items[name]

    def names(self) -> list[str]:
        return list(self._items)

    def copy(self) -> AggregatorRegistry:
        return AggregatorRegistry(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


DEFAULT_AGGREGATORS = AggregatorRegistry({
    "mean": MeanAggregator(), "median": MedianAggregator(), "mode": ModeAggregator(),
    "majority_vote": MajorityVoteAggregator(), "first": FirstAggregator(), "count": CountAggregator(),
})


def register_aggregator(name: str, aggregator: ResultAggregator) -> None:
    """Register a strategy for every view created from now on."""
    DEFAULT_AGGREGATORS.register(name, aggregator)


def list_aggregators() -> list[str]:
    return DEFAULT_AGGREGATORS.names()
