"""Result-set analysis API (`spec/000`-`spec/002` §7-10): the reference's names and shapes.

`VerificationResultSet` holds `VerificationResult`s and hands out four views:

- `TemplateResults` (`get_template_results()`): pass/fail, parsed fields, regex, usage;
- `RubricResults` (`get_rubrics_results()`): trait scores by type, aggregation;
- `JudgmentResults` (`get_judgment_results()`): deep-judgment excerpts, reasoning, risk;
- `RubricJudgmentResults` (`get_rubric_judgments_results()`): one row per trait per excerpt.

Each view converts to pandas DataFrames whose rows are the finest unit of that view, and
aggregates with named strategies (`mean`, `median`, `mode`, `majority_vote`, `first`, `count`,
plus any registered with `register_aggregator`).

Loading: `VerificationResultSet.from_store(settings, run_id=...)` reads `verification_results
FINAL` (the `result_json` column, keyset-paged) from the running projector over NATS, from a
ClickHouse server, or from the embedded chdb folder when no stack runs; `from_file(path)` reads
our JSON export, the reference's export (format 2.2), JSONL, or a `results.jsonl` report.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from shared.models import VerificationResult
from shared.stats import Proportion, compare_models, model_matches, pass_at_k_report

if TYPE_CHECKING:
    import pandas as pd

    from shared.config import Settings
    from shared.stats import PairedComparison, PassAtK
    from shared.store import QueryResult, Store


# --------------------------------------------------------------------------------------------
# Aggregators
# --------------------------------------------------------------------------------------------


class ResultAggregator(Protocol):
    """Anything with `aggregate(series, **kwargs)`: a pandas Series in, one value out."""

    def aggregate(self, series: Any, **kwargs: Any) -> Any: ...


def _numeric(series: Any) -> Any:
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


# --------------------------------------------------------------------------------------------
# Shared row pieces
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Template results
# --------------------------------------------------------------------------------------------

TEMPLATE_COLUMNS = [
    "completed_without_errors", "error", "recursion_limit_reached", "question_id", "template_id", "question_text",
    "keywords", "replicate", "answering_mcp_servers", "answering_model", "parsing_model",
    "answering_system_prompt", "parsing_system_prompt", "raw_llm_response", "field_name", "gt_value", "llm_value",
    "field_match", "field_type", "verify_result", "embedding_check_performed", "embedding_similarity_score",
    "embedding_model_used", "embedding_override_applied", "abstention_check_performed", "abstention_detected",
    "abstention_reasoning", "abstention_override_applied", "regex_validations_performed", "regex_overall_success",
    "execution_time", "timestamp", "run_name", "result_index",
]
REGEX_COLUMNS = [
    "completed_without_errors", "error", "question_id", "template_id", "replicate", "answering_model",
    "parsing_model", "pattern_name", "pattern_regex", "match_type", "expected", "matched", "extracted_value",
    "match_count", "match_start", "match_end", "full_match", "raw_llm_response", "timestamp", "run_name",
]
USAGE_COLUMNS = [
    "completed_without_errors", "error", "question_id", "template_id", "replicate", "answering_model",
    "parsing_model", "usage_stage", "input_tokens", "output_tokens", "total_tokens", "model_used",
    "input_audio_tokens", "cache_read_tokens", "output_audio_tokens", "reasoning_tokens",
    "agent_iterations", "agent_tool_calls", "agent_tools_used", "agent_suspect_failed_tool_calls",
    "timestamp", "run_name",
]


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are different
        return False


class TemplateResults(_View):
    """Template verification results: verdicts, parsed fields, checks, usage."""

    def with_template(self) -> list[VerificationResult]:
        return [r for r in self.results if r.template is not None and r.template.template_verification_performed]

    # ---- DataFrames ----
    def to_dataframe(self) -> pd.DataFrame:
        """One row per parsed field per result (ground truth vs judge extraction); a result with no
        template or no fields gets one row with the field columns empty. `result_index` is the
        result's position in this view."""
        rows: list[dict[str, Any]] = []
        for idx, r in enumerate(self.results):
            t = r.template
            gt = (t.parsed_gt_response if t else None) or {}
            llm = (t.parsed_llm_response if t else None) or {}
            names = sorted(set(gt) | set(llm)) or [None]
            for name in names:
                rows.append(self._field_row(r, idx, name, gt, llm))
        return _frame(rows, TEMPLATE_COLUMNS)

    def _field_row(self, r: VerificationResult, idx: int, name: str | None,
                   gt: dict[str, Any], llm: dict[str, Any]) -> dict[str, Any]:
        t = r.template
        gt_value = gt.get(name) if name is not None else None
        llm_value = llm.get(name) if name is not None else None
        match: bool | None = None
        if name is not None:
            if t is not None and t.field_results and name in t.field_results:
                match = t.field_results[name]
            else:
                match = (name in gt) == (name in llm) and _same(gt_value, llm_value)
        ftype = type(gt_value).__name__ if gt_value is not None else (
            type(llm_value).__name__ if llm_value is not None else None)
        m = r.metadata
        return {
            "completed_without_errors": m.completed_without_errors, "error": m.error,
            "recursion_limit_reached": t.recursion_limit_reached if t else False,
            "question_id": m.question_id, "template_id": m.template_id, "question_text": m.question_text,
            "keywords": m.keywords, "replicate": m.replicate,
            "answering_mcp_servers": t.answering_mcp_servers if t else None,
            "answering_model": m.answering_model, "parsing_model": m.parsing_model,
            "answering_system_prompt": m.answering_system_prompt, "parsing_system_prompt": m.parsing_system_prompt,
            "raw_llm_response": t.raw_llm_response if t else None,
            "field_name": name, "gt_value": gt_value, "llm_value": llm_value, "field_match": match,
            "field_type": ftype,
            "verify_result": t.verify_result if t else None,
            "embedding_check_performed": t.embedding_check_performed if t else False,
            "embedding_similarity_score": t.embedding_similarity_score if t else None,
            "embedding_model_used": t.embedding_model_used if t else None,
            "embedding_override_applied": t.embedding_override_applied if t else False,
            "abstention_check_performed": t.abstention_check_performed if t else False,
            "abstention_detected": t.abstention_detected if t else None,
            "abstention_reasoning": t.abstention_reasoning if t else None,
            "abstention_override_applied": t.abstention_override_applied if t else False,
            "regex_validations_performed": t.regex_validations_performed if t else False,
            "regex_overall_success": t.regex_overall_success if t else None,
            **_tail(r), "result_index": idx,
        }

    def to_regex_dataframe(self) -> pd.DataFrame:
        """One row per regex pattern checked per result."""
        rows: list[dict[str, Any]] = []
        for r in self.results:
            t = r.template
            if t is None or not t.regex_validations_performed or not t.regex_validation_results:
                continue
            details = t.regex_validation_details or {}
            extracted = t.regex_extraction_results or {}
            for name, matched in t.regex_validation_results.items():
                d = details.get(name) or {}
                value = extracted.get(name, d.get("matches_found"))
                rows.append({
                    **_ident(r, text=False, prompts=False),
                    "pattern_name": name, "pattern_regex": d.get("pattern") or d.get("regex"),
                    "match_type": d.get("match_type"), "expected": d.get("expected"), "matched": matched,
                    "extracted_value": value, "match_count": d.get("match_count"),
                    "match_start": d.get("match_start"), "match_end": d.get("match_end"),
                    "full_match": d.get("full_match"), "raw_llm_response": t.raw_llm_response,
                    "timestamp": r.metadata.timestamp, "run_name": r.metadata.run_name,
                })
        return _frame(rows, REGEX_COLUMNS)

    def to_usage_dataframe(self, totals_only: bool = False) -> pd.DataFrame:
        """One row per usage stage per result (the `total` entry excluded), or with
        `totals_only` one row per result with its totals (summed from stages when absent)."""
        rows: list[dict[str, Any]] = []
        for r in self.results:
            usage = (r.template.usage_metadata if r.template else None) or {}
            metrics = (r.template.agent_metrics if r.template else None) or {}
            if totals_only:
                total = usage.get("total")
                if not isinstance(total, dict):
                    stages = [v for k, v in usage.items() if k != "total" and isinstance(v, dict)]
                    if not stages:
                        continue
                    total = {key: sum(int(s.get(key) or 0) for s in stages)
                             for key in ("input_tokens", "output_tokens", "total_tokens")}
                entries = [("total", total)]
            else:
                entries = [(k, v) for k, v in usage.items() if k != "total" and isinstance(v, dict)]
            for stage, e in entries:
                inp, out = e.get("input_token_details") or {}, e.get("output_token_details") or {}
                i, o = e.get("input_tokens"), e.get("output_tokens")
                rows.append({
                    **_ident(r, text=False, prompts=False),
                    "usage_stage": stage, "input_tokens": i, "output_tokens": o,
                    "total_tokens": e.get("total_tokens") if e.get("total_tokens") is not None else (
                        (i or 0) + (o or 0) if i is not None or o is not None else None),
                    "model_used": e.get("model") or e.get("model_name"),
                    "input_audio_tokens": inp.get("audio"), "cache_read_tokens": inp.get("cache_read"),
                    "output_audio_tokens": out.get("audio"), "reasoning_tokens": out.get("reasoning"),
                    "agent_iterations": metrics.get("iterations"), "agent_tool_calls": metrics.get("tool_calls"),
                    "agent_tools_used": metrics.get("tools_used"),
                    "agent_suspect_failed_tool_calls": metrics.get("suspect_failed_tool_calls"),
                    "timestamp": r.metadata.timestamp, "run_name": r.metadata.run_name,
                })
        cols = [c for c in USAGE_COLUMNS if not (totals_only and c == "usage_stage")]
        for row in rows:
            if totals_only:
                row.pop("usage_stage", None)
        return _frame(rows, cols)

    # ---- summaries and aggregation ----
    def get_template_summary(self) -> dict[str, Any]:
        """Counts over results where template verification ran (`spec/002` §7.1 shape)."""
        rs = self.with_template()
        n = len(rs)
        passed = sum(1 for r in rs if r.template and r.template.verify_result is True)
        failed = sum(1 for r in rs if r.template and r.template.verify_result is False)
        return {
            "num_results": n, "num_passed": passed, "num_failed": failed,
            "pass_rate": passed / n if n else 0.0,
            "num_with_embedding": sum(1 for r in rs if r.template and r.template.embedding_check_performed),
            "num_with_regex": sum(1 for r in rs if r.template and r.template.regex_validations_performed),
            "num_with_abstention": sum(1 for r in rs if r.template and r.template.abstention_check_performed),
            "num_questions": len({r.metadata.question_id for r in rs}),
        }

    def _per_result(self) -> pd.DataFrame:
        return self.to_dataframe().drop_duplicates(subset=["result_index"])

    def aggregate_pass_rate(self, by: str = "question_id", **_: Any) -> dict[Any, float]:
        """{group: share of verdicts that passed}; results without a verdict are left out."""
        return _group_dict(self._per_result(), by, "verify_result", lambda s: float(_numeric(s).mean()))

    def pass_rate_table(self, by: str = "answering_model", confidence: float = 0.95) -> pd.DataFrame:
        """Pass rate per group with its Wilson interval: by, passed, n, pass_rate, ci_low, ci_high."""
        import pandas as pd

        by = _by(by)
        counts = _group_dict(self._per_result(), by, "verify_result",
                             lambda s: (int((_numeric(s) != 0).sum()), len(s)))
        rows = []
        for key, (passed, n) in counts.items():
            p = Proportion.of(passed, n, confidence)
            rows.append({by: key, "passed": passed, "n": n, "pass_rate": p.rate, "ci_low": p.ci_low,
                         "ci_high": p.ci_high})
        return pd.DataFrame(rows, columns=[by, "passed", "n", "pass_rate", "ci_low", "ci_high"])

    def aggregate_embedding_scores(self, strategy: str = "mean", by: str = "question_id", **kw: Any) -> dict[Any, Any]:
        agg = self._aggregators.get(strategy)
        df = self._per_result()
        df = df[df["embedding_check_performed"] == True]  # noqa: E712 - pandas mask
        return _group_dict(df, by, "embedding_similarity_score", lambda s: agg.aggregate(s, **kw))

    def aggregate_abstention_rate(self, by: str = "question_id", **_: Any) -> dict[Any, float]:
        df = self._per_result()
        df = df[df["abstention_check_performed"] == True]  # noqa: E712
        return _group_dict(df, by, "abstention_detected", lambda s: float(_numeric(s).mean()))

    def aggregate_regex_success_rate(self, pattern_name: str | None = None, by: str = "question_id",
                                     **_: Any) -> dict[Any, Any]:
        df = self.to_regex_dataframe()
        if pattern_name is not None:
            df = df[df["pattern_name"] == pattern_name]
            return _group_dict(df, by, "matched", lambda s: float(_numeric(s).mean()))
        return _nested(df, by, "pattern_name", "matched", MeanAggregator())

    # ---- accessors ----
    def get_verification_results(self, question_id: str | None = None) -> dict[str, bool | None]:
        return {r.metadata.result_id: r.template.verify_result for r in self.with_template()
                if r.template and (question_id is None or r.metadata.question_id == question_id)}

    def get_parsed_responses(self, question_id: str | None = None) -> dict[str, dict[str, Any]]:
        return {r.metadata.result_id: {"llm": r.template.parsed_llm_response, "ground_truth": r.template.parsed_gt_response}
                for r in self.with_template()
                if r.template and (question_id is None or r.metadata.question_id == question_id)}

    def get_embedding_scores(self, question_id: str | None = None) -> dict[str, float | None]:
        return {r.metadata.result_id: r.template.embedding_similarity_score for r in self.with_template()
                if r.template and r.template.embedding_check_performed
                and (question_id is None or r.metadata.question_id == question_id)}

    def filter(
        self, question_ids: Sequence[str] | None = None, answering_models: Sequence[str] | None = None,
        parsing_models: Sequence[str] | None = None, replicates: Sequence[int | None] | None = None,
        passed_only: bool = False, failed_only: bool = False, completed_only: bool = False,
        run_names: Sequence[str] | None = None,
    ) -> TemplateResults:
        def pred(r: VerificationResult) -> bool:
            v = r.template.verify_result if r.template else None
            return not ((passed_only and v is not True) or (failed_only and v is not False))

        return self._new(self._filtered(question_ids, answering_models, parsing_models, replicates,
                                        completed_only, run_names, pred))


# --------------------------------------------------------------------------------------------
# Rubric results
# --------------------------------------------------------------------------------------------

TraitType = Literal["all", "llm", "llm_score", "llm_binary", "llm_literal", "regex", "callable", "metric"]
TRAIT_TYPES = ("all", "llm", "llm_score", "llm_binary", "llm_literal", "regex", "callable", "metric")
RUBRIC_COLUMNS = [
    "completed_without_errors", "error", "question_id", "template_id", "question_text", "keywords", "replicate",
    "answering_model", "parsing_model", "answering_system_prompt", "parsing_system_prompt",
    "trait_name", "trait_score", "trait_label", "trait_type", "evaluation_method", "metric_name",
    "confusion_tp", "confusion_fp", "confusion_fn", "confusion_tn",
    "execution_time", "timestamp", "run_name", "rubric_evaluation_performed", "rubric_evaluation_strategy",
]
RUBRIC_DJ_COLUMNS = ["trait_reasoning", "trait_excerpts", "trait_hallucination_risk"]


def llm_trait_type(name: str, value: Any, labels: Mapping[str, str]) -> str:
    """llm_binary for booleans, llm_literal for class-labelled traits, llm_score otherwise."""
    if isinstance(value, bool):
        return "llm_binary"
    if name in labels:
        return "llm_literal"
    return "llm_score"


def _confusion(r: VerificationResult, trait: str) -> dict[str, int | None]:
    rub = r.rubric
    lists = (rub.metric_trait_confusion_lists or {}).get(trait) if rub else None
    scores = (rub.metric_trait_scores or {}).get(trait) if rub else None
    out: dict[str, int | None] = {}
    for k in ("tp", "fp", "fn", "tn"):
        if lists and isinstance(lists.get(k), list):
            out[k] = len(lists[k])
        elif scores and isinstance(scores.get(k), int | float):
            out[k] = int(scores[k])
        else:
            out[k] = None
    return out


class RubricResults(_View):
    """Rubric trait scores by type (`spec/002` §8.2, §9.3)."""

    def __init__(self, results: Iterable[VerificationResult], aggregators: AggregatorRegistry | None = None,
                 include_deep_judgment: bool = False) -> None:
        super().__init__(results, aggregators)
        self.include_deep_judgment = include_deep_judgment

    def with_rubric(self) -> list[VerificationResult]:
        return [r for r in self.results if r.rubric is not None and r.rubric.rubric_evaluation_performed]

    def to_dataframe(self, trait_type: TraitType = "all") -> pd.DataFrame:
        """One row per trait per result, one row per metric for metric traits (with the trait's
        confusion counts). With trait_type="all", a result without rubric data is one row with the
        trait columns empty, so errors stay visible."""
        if trait_type not in TRAIT_TYPES:
            raise ValueError(f"trait_type must be one of {', '.join(TRAIT_TYPES)}, got {trait_type!r}")
        rows: list[dict[str, Any]] = []
        for r in self.results:
            rub = r.rubric
            if rub is None or not rub.rubric_evaluation_performed:
                if trait_type == "all":
                    rows.append(self._row(r, None, None, None, None, None))
                continue
            if trait_type in ("all", "llm", "llm_score", "llm_binary", "llm_literal"):
                labels = rub.llm_trait_labels or {}
                for name, value in (rub.llm_trait_scores or {}).items():
                    kind = llm_trait_type(name, value, labels)
                    if trait_type in ("all", "llm") or trait_type == kind:
                        rows.append(self._row(r, name, value, kind, "llm", None, labels.get(name)))
            if trait_type in ("all", "regex"):
                for name, value in (rub.regex_trait_scores or {}).items():
                    rows.append(self._row(r, name, value, "regex", "regex", None))
            if trait_type in ("all", "callable"):
                for name, value in (rub.callable_trait_scores or {}).items():
                    rows.append(self._row(r, name, value, "callable", "callable", None))
            if trait_type in ("all", "metric"):
                for name, metrics in (rub.metric_trait_scores or {}).items():
                    conf = _confusion(r, name)
                    for metric, value in (metrics or {}).items():
                        rows.append(self._row(r, name, value, "metric", "metric", metric, None, conf))
        cols = RUBRIC_COLUMNS + (RUBRIC_DJ_COLUMNS if self.include_deep_judgment else [])
        return _frame(rows, cols)

    def _row(self, r: VerificationResult, name: str | None, value: Any, kind: str | None, method: str | None,
             metric: str | None, label: str | None = None, conf: dict[str, int | None] | None = None) -> dict[str, Any]:
        conf = conf or {}
        row = {
            **_ident(r), "trait_name": name, "trait_score": value, "trait_label": label, "trait_type": kind,
            "evaluation_method": method, "metric_name": metric,
            "confusion_tp": conf.get("tp"), "confusion_fp": conf.get("fp"), "confusion_fn": conf.get("fn"),
            "confusion_tn": conf.get("tn"), **_tail(r),
            "rubric_evaluation_performed": r.rubric.rubric_evaluation_performed if r.rubric else False,
            "rubric_evaluation_strategy": r.rubric.rubric_evaluation_strategy if r.rubric else None,
        }
        if self.include_deep_judgment:
            djr = r.deep_judgment_rubric
            excerpts = (djr.extracted_rubric_excerpts or {}).get(name) if djr and name else None
            risk = (djr.rubric_hallucination_risk_assessment or {}).get(name) if djr and name else None
            row["trait_reasoning"] = (djr.rubric_trait_reasoning or {}).get(name) if djr and name else None
            row["trait_excerpts"] = json.dumps(excerpts) if excerpts is not None else None
            row["trait_hallucination_risk"] = risk.get("overall_risk") if isinstance(risk, dict) else risk
        return row

    def get_trait_summary(self) -> dict[str, Any]:
        """Trait names by type and counts (`spec/002` §7.1 shape)."""
        rs = self.with_rubric()
        kinds: dict[str, set[str]] = {"llm": set(), "regex": set(), "callable": set(), "metric": set()}
        for r in rs:
            assert r.rubric is not None
            kinds["llm"].update(r.rubric.llm_trait_scores or {})
            kinds["regex"].update(r.rubric.regex_trait_scores or {})
            kinds["callable"].update(r.rubric.callable_trait_scores or {})
            kinds["metric"].update(r.rubric.metric_trait_scores or {})
        return {
            "num_results": len(rs),
            "llm_traits": sorted(kinds["llm"]), "regex_traits": sorted(kinds["regex"]),
            "callable_traits": sorted(kinds["callable"]), "metric_traits": sorted(kinds["metric"]),
            "num_questions": len({r.metadata.question_id for r in rs}),
        }

    def _aggregate(self, trait_type: TraitType, strategy: str, by: str, **kw: Any) -> dict[Any, dict[str, Any]]:
        agg = self._aggregators.get(strategy)
        return _nested(self.to_dataframe(trait_type=trait_type), by, "trait_name", "trait_score", agg, **kw)

    def aggregate_llm_traits(self, strategy: str = "mean", by: str = "question_id", **kw: Any) -> dict[Any, dict[str, Any]]:
        """{group: {trait: aggregated score}} over LLM traits (booleans count as 0/1 for numeric
        strategies)."""
        return self._aggregate("llm", strategy, by, **kw)

    def aggregate_regex_traits(self, strategy: str = "majority_vote", by: str = "question_id", **kw: Any) -> dict[Any, dict[str, Any]]:
        return self._aggregate("regex", strategy, by, **kw)

    def aggregate_callable_traits(self, strategy: str = "mean", by: str = "question_id", **kw: Any) -> dict[Any, dict[str, Any]]:
        return self._aggregate("callable", strategy, by, **kw)

    def aggregate_metric_traits(self, metric_name: str | None = None, strategy: str = "mean",
                                by: str = "question_id", **kw: Any) -> dict[Any, dict[str, Any]]:
        """With `metric_name`: {group: {trait: value}}; without: {group: {trait: {metric: value}}}."""
        agg = self._aggregators.get(strategy)
        df = self.to_dataframe(trait_type="metric")
        if metric_name is not None:
            return _nested(df[df["metric_name"] == metric_name], by, "trait_name", "trait_score", agg, **kw)
        if df.empty:
            return {}
        df = df.assign(_key=df["trait_name"] + "\x00" + df["metric_name"])
        flat = _nested(df, by, "_key", "trait_score", agg, **kw)
        out: dict[Any, dict[str, Any]] = {}
        for group, values in flat.items():
            for key, value in values.items():
                trait, metric = key.split("\x00", 1)
                out.setdefault(group, {}).setdefault(trait, {})[metric] = value
        return out

    def get_trait_scores(self, question_id: str | None = None) -> dict[str, dict[str, Any]]:
        """{result_id: all trait scores}."""
        return {r.metadata.result_id: r.rubric.get_all_trait_scores() for r in self.with_rubric()
                if r.rubric and (question_id is None or r.metadata.question_id == question_id)}

    def filter(
        self, question_ids: Sequence[str] | None = None, answering_models: Sequence[str] | None = None,
        parsing_models: Sequence[str] | None = None, replicates: Sequence[int | None] | None = None,
        trait_names: Sequence[str] | None = None, completed_only: bool = False,
        run_names: Sequence[str] | None = None,
    ) -> RubricResults:
        names = set(trait_names or [])

        def pred(r: VerificationResult) -> bool:
            return not names or bool(r.rubric and names & set(r.rubric.get_all_trait_scores()))

        return self._new(self._filtered(question_ids, answering_models, parsing_models, replicates,
                                        completed_only, run_names, pred))


# --------------------------------------------------------------------------------------------
# Deep judgment (templates)
# --------------------------------------------------------------------------------------------

JUDGMENT_COLUMNS = [
    "completed_without_errors", "error", "question_id", "template_id", "question_text", "keywords", "replicate",
    "answering_model", "parsing_model", "raw_llm_response", "deep_judgment_performed",
    "deep_judgment_search_enabled", "attribute_name", "gt_attribute_value", "llm_attribute_value",
    "attribute_match", "excerpt_index", "excerpt_text", "excerpt_confidence", "excerpt_similarity_score",
    "excerpt_search_results", "excerpt_hallucination_risk", "excerpt_hallucination_justification",
    "attribute_reasoning", "attribute_overall_risk", "attribute_has_excerpts", "deep_judgment_model_calls",
    "deep_judgment_excerpt_retries", "stages_completed", "execution_time", "timestamp", "run_name", "result_index",
]
RISK_LEVELS = ("none", "low", "medium", "high")


class JudgmentResults(_View):
    """Deep-judgment evidence of template parsing: excerpts, reasoning, hallucination risk."""

    def with_judgment(self) -> list[VerificationResult]:
        return [r for r in self.results if r.deep_judgment is not None and r.deep_judgment.deep_judgment_performed]

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (attribute x excerpt); an attribute without excerpts is one row with the
        excerpt columns empty; a result without deep judgment is one row with both empty."""
        rows: list[dict[str, Any]] = []
        for idx, r in enumerate(self.results):
            dj = r.deep_judgment
            if dj is None or not dj.deep_judgment_performed:
                rows.append(self._row(r, idx, None, None, None))
                continue
            excerpts = dj.extracted_excerpts or {}
            attrs = list(excerpts) or list(dj.hallucination_risk_assessment or {}) or list(dj.attribute_reasoning or {})
            if not attrs:
                rows.append(self._row(r, idx, None, None, None))
            for attr in attrs:
                items = excerpts.get(attr) or []
                if not items:
                    rows.append(self._row(r, idx, attr, None, None))
                for i, ex in enumerate(items):
                    rows.append(self._row(r, idx, attr, i, ex))
        return _frame(rows, JUDGMENT_COLUMNS)

    def _row(self, r: VerificationResult, idx: int, attr: str | None, i: int | None,
             ex: dict[str, Any] | None) -> dict[str, Any]:
        t, dj = r.template, r.deep_judgment
        gt = (t.parsed_gt_response or {}).get(attr) if t and attr else None
        llm = (t.parsed_llm_response or {}).get(attr) if t and attr else None
        ex = ex or {}
        return {
            **_ident(r, prompts=False), "raw_llm_response": t.raw_llm_response if t else None,
            "deep_judgment_performed": dj.deep_judgment_performed if dj else False,
            "deep_judgment_search_enabled": dj.deep_judgment_search_enabled if dj else False,
            "attribute_name": attr, "gt_attribute_value": gt, "llm_attribute_value": llm,
            "attribute_match": _same(gt, llm) if attr and (gt is not None or llm is not None) else None,
            "excerpt_index": i, "excerpt_text": ex.get("text"), "excerpt_confidence": ex.get("confidence"),
            "excerpt_similarity_score": ex.get("similarity_score"),
            "excerpt_search_results": ex.get("search_results"),
            "excerpt_hallucination_risk": ex.get("hallucination_risk"),
            "excerpt_hallucination_justification": ex.get("hallucination_justification"),
            "attribute_reasoning": (dj.attribute_reasoning or {}).get(attr) if dj and attr else None,
            "attribute_overall_risk": (dj.hallucination_risk_assessment or {}).get(attr) if dj and attr else None,
            "attribute_has_excerpts": i is not None,
            "deep_judgment_model_calls": dj.deep_judgment_model_calls if dj else 0,
            "deep_judgment_excerpt_retries": dj.deep_judgment_excerpt_retry_count if dj else 0,
            "stages_completed": dj.deep_judgment_stages_completed if dj else None,
            **_tail(r), "result_index": idx,
        }

    def get_extracted_excerpts(self, attribute_name: str | None = None,
                               question_id: str | None = None) -> dict[str, dict[str, list[dict[str, Any]]]]:
        """{result_id: {attribute: [excerpt, ...]}}."""
        out: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for r in self.with_judgment():
            if question_id is not None and r.metadata.question_id != question_id:
                continue
            ex = (r.deep_judgment.extracted_excerpts if r.deep_judgment else None) or {}
            if attribute_name is not None:
                ex = {attribute_name: ex[attribute_name]} if attribute_name in ex else {}
            if ex:
                out[r.metadata.result_id] = ex
        return out

    def get_reasoning(self, attribute_name: str | None = None) -> dict[str, dict[str, str]]:
        """{result_id: {attribute: reasoning}}."""
        out: dict[str, dict[str, str]] = {}
        for r in self.with_judgment():
            reasons = (r.deep_judgment.attribute_reasoning if r.deep_judgment else None) or {}
            if attribute_name is not None:
                reasons = {attribute_name: reasons[attribute_name]} if attribute_name in reasons else {}
            if reasons:
                out[r.metadata.result_id] = dict(reasons)
        return out

    def to_hallucination_risk_dataframe(self) -> pd.DataFrame:
        """One row per attribute with a risk assessment: ids, attribute_name, risk."""
        rows = []
        for r in self.with_judgment():
            for attr, risk in ((r.deep_judgment.hallucination_risk_assessment if r.deep_judgment else None) or {}).items():
                rows.append({"result_id": r.metadata.result_id, "question_id": r.metadata.question_id,
                             "answering_model": r.metadata.answering_model, "parsing_model": r.metadata.parsing_model,
                             "replicate": r.metadata.replicate, "attribute_name": attr, "risk": risk})
        return _frame(rows, ["result_id", "question_id", "answering_model", "parsing_model", "replicate",
                             "attribute_name", "risk"])

    def aggregate_hallucination_risk_distribution(self, by: str = "question_id") -> dict[Any, dict[str, int]]:
        """{group: {risk level: attributes}} (levels none/low/medium/high)."""
        df = self.to_hallucination_risk_dataframe()
        counts = _nested(df, by, "risk", "attribute_name", CountAggregator())
        return {g: {lvl: sum(v.values()) if isinstance(v, dict) else int(v) for lvl, v in levels.items()}
                for g, levels in counts.items()}

    def get_processing_metrics(self) -> dict[str, Any]:
        rs = [r.deep_judgment for r in self.with_judgment() if r.deep_judgment]
        calls = [d.deep_judgment_model_calls for d in rs]
        return {
            "num_results": len(rs), "total_model_calls": sum(calls),
            "avg_model_calls": sum(calls) / len(calls) if calls else 0.0,
            "total_excerpt_retries": sum(d.deep_judgment_excerpt_retry_count for d in rs),
            "num_with_search": sum(1 for d in rs if d.deep_judgment_search_enabled),
            "attributes_without_excerpts": sum(len(d.attributes_without_excerpts or []) for d in rs),
        }

    def filter(
        self, question_ids: Sequence[str] | None = None, answering_models: Sequence[str] | None = None,
        parsing_models: Sequence[str] | None = None, replicates: Sequence[int | None] | None = None,
        with_search_only: bool = False, performed_only: bool = False,
    ) -> JudgmentResults:
        def pred(r: VerificationResult) -> bool:
            dj = r.deep_judgment
            if performed_only and not (dj and dj.deep_judgment_performed):
                return False
            return not (with_search_only and not (dj and dj.deep_judgment_search_enabled))

        return self._new(self._filtered(question_ids, answering_models, parsing_models, replicates, predicate=pred))


# --------------------------------------------------------------------------------------------
# Deep judgment (rubrics)
# --------------------------------------------------------------------------------------------

RUBRIC_JUDGMENT_COLUMNS = [
    "completed_without_errors", "error", "question_id", "template_id", "question_text", "keywords", "replicate",
    "answering_model", "parsing_model", "trait_name", "trait_score", "trait_evaluated_with_deep_judgment",
    "trait_reasoning", "trait_model_calls", "trait_excerpt_retries", "trait_stages_completed",
    "trait_had_excerpts", "trait_validation_failed", "trait_overall_risk", "excerpt_index", "excerpt_text",
    "excerpt_confidence", "excerpt_similarity_score", "excerpt_search_results", "excerpt_hallucination_risk",
    "excerpt_hallucination_justification", "execution_time", "timestamp", "run_name",
]


class RubricJudgmentResults(_View):
    """Deep-judgment rubric evidence exploded to one row per trait per excerpt."""

    def with_judgment(self) -> list[VerificationResult]:
        return [r for r in self.results
                if r.deep_judgment_rubric is not None and r.deep_judgment_rubric.deep_judgment_rubric_performed]

    def to_dataframe(self) -> pd.DataFrame:
        rows: list[dict[str, Any]] = []
        for r in self.with_judgment():
            djr = r.deep_judgment_rubric
            assert djr is not None
            scores = {**(djr.standard_rubric_scores or {}), **(djr.deep_judgment_rubric_scores or {})}
            meta = djr.trait_metadata or {}
            traits = list(dict.fromkeys([*(djr.deep_judgment_rubric_scores or {}), *(djr.rubric_trait_reasoning or {}),
                                         *(djr.extracted_rubric_excerpts or {}), *meta]))
            for trait in traits:
                excerpts = (djr.extracted_rubric_excerpts or {}).get(trait) or []
                risk = (djr.rubric_hallucination_risk_assessment or {}).get(trait)
                tm = meta.get(trait) or {}
                base = {
                    **_ident(r, prompts=False), "trait_name": trait, "trait_score": scores.get(trait),
                    "trait_evaluated_with_deep_judgment": trait in (djr.deep_judgment_rubric_scores or {}),
                    "trait_reasoning": (djr.rubric_trait_reasoning or {}).get(trait),
                    "trait_model_calls": tm.get("model_calls"), "trait_excerpt_retries": tm.get("excerpt_retry_count"),
                    "trait_stages_completed": tm.get("stages_completed"), "trait_had_excerpts": tm.get("had_excerpts"),
                    "trait_validation_failed": trait in (djr.traits_without_valid_excerpts or [])
                    or bool(tm.get("excerpt_validation_failed")),
                    "trait_overall_risk": risk.get("overall_risk") if isinstance(risk, dict) else risk,
                    **_tail(r),
                }
                for i, ex in enumerate(excerpts or [None]):
                    ex = ex or {}
                    rows.append({**base, "excerpt_index": i if excerpts else None, "excerpt_text": ex.get("text"),
                                 "excerpt_confidence": ex.get("confidence"),
                                 "excerpt_similarity_score": ex.get("similarity_score"),
                                 "excerpt_search_results": ex.get("search_results"),
                                 "excerpt_hallucination_risk": ex.get("hallucination_risk"),
                                 "excerpt_hallucination_justification": ex.get("hallucination_justification")})
        return _frame(rows, RUBRIC_JUDGMENT_COLUMNS)

    def get_excerpt_count_summary(self) -> dict[str, dict[str, float]]:
        """{trait: {results, total_excerpts, mean_excerpts}}."""
        per: dict[str, list[int]] = {}
        for r in self.with_judgment():
            djr = r.deep_judgment_rubric
            assert djr is not None
            for trait, ex in (djr.extracted_rubric_excerpts or {}).items():
                per.setdefault(trait, []).append(len(ex or []))
        return {t: {"results": len(v), "total_excerpts": sum(v), "mean_excerpts": sum(v) / len(v)}
                for t, v in sorted(per.items())}

    def get_retry_summary(self) -> dict[str, dict[str, int]]:
        """{trait: {results, total_retries, validation_failures}}."""
        per: dict[str, dict[str, int]] = {}
        for r in self.with_judgment():
            djr = r.deep_judgment_rubric
            assert djr is not None
            for trait, tm in (djr.trait_metadata or {}).items():
                d = per.setdefault(trait, {"results": 0, "total_retries": 0, "validation_failures": 0})
                d["results"] += 1
                d["total_retries"] += int(tm.get("excerpt_retry_count") or 0)
                d["validation_failures"] += 1 if (tm.get("excerpt_validation_failed")
                                                  or trait in (djr.traits_without_valid_excerpts or [])) else 0
        return dict(sorted(per.items()))

    def filter(
        self, question_ids: Sequence[str] | None = None, answering_models: Sequence[str] | None = None,
        parsing_models: Sequence[str] | None = None, replicates: Sequence[int | None] | None = None,
    ) -> RubricJudgmentResults:
        return self._new(self._filtered(question_ids, answering_models, parsing_models, replicates))


# --------------------------------------------------------------------------------------------
# The result set
# --------------------------------------------------------------------------------------------


class VerificationResultSet(_View):
    """All results of one or more runs, with the views and loaders (`spec/002` §7)."""

    def __init__(self, results: Iterable[VerificationResult] = (), *, run_ids: Sequence[str] = (),
                 aggregators: AggregatorRegistry | None = None) -> None:
        super().__init__(results, aggregators)
        self.run_ids: list[str] = list(run_ids)

    # ---- views ----
    def get_template_results(self) -> TemplateResults:
        return TemplateResults(self.results, self._aggregators)

    def get_rubrics_results(self, include_deep_judgment: bool = False) -> RubricResults:
        return RubricResults(self.results, self._aggregators, include_deep_judgment=include_deep_judgment)

    def get_judgment_results(self) -> JudgmentResults:
        return JudgmentResults(self.results, self._aggregators)

    def get_rubric_judgments_results(self) -> RubricJudgmentResults:
        return RubricJudgmentResults(self.results, self._aggregators)

    # ---- filtering ----
    def filter(
        self, question_ids: Sequence[str] | None = None, answering_models: Sequence[str] | None = None,
        parsing_models: Sequence[str] | None = None, replicates: Sequence[int | None] | None = None,
        completed_only: bool = False, run_names: Sequence[str] | None = None, has_template: bool = False,
        has_rubric: bool = False, has_judgment: bool = False,
    ) -> VerificationResultSet:
        """A new set with the results that match every given criterion. Model filters accept the
        display string (`litellm:gpt-4o`) or the model name (`gpt-4o`)."""

        def pred(r: VerificationResult) -> bool:
            if has_template and not (r.template and r.template.template_verification_performed):
                return False
            if has_rubric and not (r.rubric and r.rubric.rubric_evaluation_performed):
                return False
            return not (has_judgment and not (r.deep_judgment and r.deep_judgment.deep_judgment_performed))

        return self._new(self._filtered(question_ids, answering_models, parsing_models, replicates,
                                        completed_only, run_names, pred))

    # ---- summaries ----
    def get_summary(self) -> dict[str, Any]:
        """Counts across the set: results, completed, per section, distinct questions/models."""
        rs = self.results
        verdicts = [r.template.verify_result for r in rs if r.template and r.template.verify_result is not None]
        passed = sum(1 for v in verdicts if v)
        p = Proportion.of(passed, len(verdicts))
        return {
            "num_results": len(rs),
            "num_completed": sum(1 for r in rs if r.metadata.completed_without_errors),
            "num_errors": sum(1 for r in rs if not r.metadata.completed_without_errors),
            "num_with_template": sum(1 for r in rs if r.template and r.template.template_verification_performed),
            "num_with_rubric": sum(1 for r in rs if r.rubric and r.rubric.rubric_evaluation_performed),
            "num_with_judgment": sum(1 for r in rs if r.deep_judgment and r.deep_judgment.deep_judgment_performed),
            "num_questions": len({r.metadata.question_id for r in rs}),
            "num_answering_models": len({r.metadata.answering_model for r in rs}),
            "num_parsing_models": len({r.metadata.parsing_model for r in rs}),
            "replicates": sorted({r.metadata.replicate for r in rs if r.metadata.replicate is not None}),
            "num_verdicts": len(verdicts), "num_passed": passed, "pass_rate": p.rate,
            "pass_rate_ci95": [p.ci_low, p.ci_high],
            "total_execution_time": sum(r.metadata.execution_time or 0.0 for r in rs),
        }

    def pass_rates(self, by: str = "answering_model", confidence: float = 0.95) -> pd.DataFrame:
        """Pass rate per group with Wilson intervals (see `TemplateResults.pass_rate_table`)."""
        return self.get_template_results().pass_rate_table(by=by, confidence=confidence)

    def pass_at_k(self, ks: Sequence[int] | None = None) -> PassAtK:
        """pass@k and pass^k across replicates, with per-question flakiness."""
        return pass_at_k_report(self.results, ks)

    def compare(self, model_a: str, model_b: str, other: VerificationResultSet | None = None) -> PairedComparison:
        """Paired comparison (exact McNemar, difference with a 95% interval) of two answering
        models; `other` reads model B from a second result set."""
        return compare_models(self.results, model_a, model_b, other.results if other is not None else None)

    def to_dataframe(self) -> pd.DataFrame:
        """One flat row per result (the CSV export's columns)."""
        import pandas as pd

        from shared.export import flat_columns_for, flat_rows_from_results

        cols = flat_columns_for(self.results)
        return pd.DataFrame(list(flat_rows_from_results(self.results, cols)), columns=cols)

    # ---- loading ----
    @classmethod
    def from_file(cls, path: str | Path) -> VerificationResultSet:
        """Read our JSON export, the reference export (format 2.2), JSONL (one result per line), or a
        report `results.jsonl` (the `result` of each line)."""
        return cls(iter_results_from_file(path))

    @classmethod
    def from_store(
        cls, settings: Settings, run_id: str | None = None, run_name: str | None = None, *,
        question_ids: Sequence[str] | None = None, answering_models: Sequence[str] | None = None,
        parsing_models: Sequence[str] | None = None, replicates: Sequence[int] | None = None,
        completed_only: bool = False, limit: int | None = None, page_size: int = 500,
    ) -> VerificationResultSet:
        """Load results from ClickHouse (`verification_results FINAL`), wherever it is: the running
        projector over NATS, a ClickHouse server, or the embedded chdb folder."""
        where = ResultFilter(run_id=run_id, run_name=run_name, question_ids=question_ids,
                             answering_models=answering_models, parsing_models=parsing_models,
                             replicates=replicates, completed_only=completed_only)
        with open_source(settings) as source:
            results: list[VerificationResult] = []
            run_ids: set[str] = set()
            for rid, blob in iter_result_json(source, where, page_size=page_size, limit=limit):
                run_ids.add(rid)
                results.append(VerificationResult.model_validate_json(blob))
        return cls(results, run_ids=sorted(run_ids))


# --------------------------------------------------------------------------------------------
# Reading rows from the store
# --------------------------------------------------------------------------------------------


class RowSource(Protocol):
    """Something that runs one read-only query: a store, or the projector over NATS."""

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult: ...


class StoreSource:
    """Reads through an open Store (its read-only handle)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
        return self.store.query_read_only(sql, params)


class NatsSource:
    """Reads through the projector (`veribus.query` request-reply); one connection per query."""

    def __init__(self, settings: Settings, timeout: float = 30.0) -> None:
        self.settings = settings
        self.timeout = timeout

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> QueryResult:
        from shared.query import _run_coro, query_via_nats

        return _run_coro(query_via_nats(self.settings, sql, params, self.timeout))


@contextlib.contextmanager
def open_source(settings: Settings) -> Iterator[RowSource]:
    """The place results are read from, the way `shared.query.run_query` picks it: a ClickHouse
    server directly; else the projector over NATS when a stack runs; else the chdb folder opened
    in this process (held open for the whole read, not reopened per page)."""
    from shared.query import NoProjector, query_via_nats
    from shared.store import open_store

    if not settings.clickhouse_url:
        from shared.query import _run_coro

        try:
            _run_coro(query_via_nats(settings, "SELECT 1", None, 10.0))
        except NoProjector:
            pass
        else:
            yield NatsSource(settings)
            return
    store = open_store(settings, migrate=not settings.clickhouse_url)
    try:
        yield StoreSource(store)
    finally:
        store.close()


class ResultFilter:
    """WHERE clause over `verification_results` for the loaders and exports (parameterised)."""

    def __init__(
        self, run_id: str | None = None, run_name: str | None = None, question_ids: Sequence[str] | None = None,
        answering_models: Sequence[str] | None = None, parsing_models: Sequence[str] | None = None,
        replicates: Sequence[int] | None = None, completed_only: bool = False,
    ) -> None:
        self.run_id, self.run_name = run_id, run_name
        self.question_ids = list(question_ids or [])
        self.answering_models = list(answering_models or [])
        self.parsing_models = list(parsing_models or [])
        self.replicates = list(replicates or [])
        self.completed_only = completed_only

    def sql(self) -> tuple[str, dict[str, Any]]:
        clauses: list[str] = []
        params: dict[str, Any] = {}
        if self.run_id:
            clauses.append("run_id = {f_run:String}")
            params["f_run"] = self.run_id
        if self.run_name:
            clauses.append("run_name = {f_run_name:String}")
            params["f_run_name"] = self.run_name
        if self.question_ids:
            clauses.append("question_id IN {f_q:Array(String)}")
            params["f_q"] = self.question_ids
        for col, key, models in (("answering", "f_am", self.answering_models), ("parsing", "f_pm", self.parsing_models)):
            if models:
                clauses.append(f"({col}_model IN {{{key}:Array(String)}} OR {col}_model_name IN {{{key}:Array(String)}})")
                params[key] = models
        if self.replicates:
            clauses.append("replicate IN {f_rep:Array(UInt32)}")
            params["f_rep"] = self.replicates
        if self.completed_only:
            clauses.append("completed_without_errors")
        return (" AND ".join(clauses) or "1"), params


def iter_pages(
    source: RowSource, columns: str, where: ResultFilter | None = None, *, page_size: int = 1000,
    limit: int | None = None, table: str = "verification_results",
) -> Iterator[QueryResult]:
    """Keyset-paged reads of `table FINAL` in (run_id, result_id) order: each page is one bounded
    query, so memory stays flat however many rows match. The page shrinks when the projector
    says a reply would exceed the NATS payload limit."""
    from shared.query import QueryError

    where = where or ResultFilter()
    cond, params = where.sql()
    # one run: the key's second column alone orders the rows (a predicate the primary key serves)
    key_pred = " AND result_id > {k_id:String}" if where.run_id else \
        " AND (run_id, result_id) > ({k_run:String}, {k_id:String})"
    after_run, after_id = "", ""
    first = True
    fetched = 0
    size = max(1, page_size)
    while limit is None or fetched < limit:
        n = size if limit is None else min(size, limit - fetched)
        keyset = "" if first else key_pred
        sql = (f"SELECT run_id, result_id, {columns} FROM {table} FINAL WHERE {cond}{keyset} "
               f"ORDER BY run_id, result_id LIMIT {int(n)}")
        p = dict(params)
        if not first:
            p["k_id"] = after_id
            if not where.run_id:
                p["k_run"] = after_run
        try:
            page = source.query(sql, p)
        except QueryError as exc:
            if "too large" in str(exc) and n > 1:
                size = max(1, n // 4)
                continue
            raise
        if not page.rows:
            return
        yield page
        fetched += len(page.rows)
        after_run, after_id = str(page.rows[-1][0]), str(page.rows[-1][1])
        first = False
        if len(page.rows) < n:
            return


def iter_result_json(source: RowSource, where: ResultFilter | None = None, *, page_size: int = 500,
                     limit: int | None = None) -> Iterator[tuple[str, str]]:
    """(run_id, result_json) of every matching row, streamed page by page."""
    for page in iter_pages(source, "result_json", where, page_size=page_size, limit=limit):
        for row in page.rows:
            blob = row[2]
            yield str(row[0]), blob.decode() if isinstance(blob, bytes | bytearray) else str(blob)


def resolve_run(source: RowSource, run: str) -> str:
    """A run id, or the latest run with that run name -> the run id (ValueError when none)."""
    res = source.query(
        "SELECT run_id FROM (SELECT run_id, requested_at AS at FROM runs FINAL WHERE run_id = {r:String} "
        "OR run_name = {r:String} UNION ALL SELECT run_id, max(ingested_at) AS at FROM verification_results "
        "FINAL WHERE run_id = {r:String} OR run_name = {r:String} GROUP BY run_id) ORDER BY (run_id = {r:String}) DESC, "
        "at DESC LIMIT 1", {"r": run})
    if not res.rows:
        raise ValueError(f"no run with id or name {run!r} in the store")
    return str(res.rows[0][0])


# --------------------------------------------------------------------------------------------
# Reading files
# --------------------------------------------------------------------------------------------


def normalise_result_dict(data: dict[str, Any]) -> dict[str, Any]:
    """A result dict from any supported file -> one `VerificationResult` validates.

    Reference exports (format 2.2) record failures in `metadata.failure` and have no
    `completed_without_errors`/`error` fields: derive them, so errors count as errors and verdicts
    (a wrong answer, an auto-fail, an abstention) as failed answers."""
    meta = data.get("metadata")
    if isinstance(meta, dict) and "completed_without_errors" not in meta:
        from shared.models import FAILURE_GROUP_OF

        failure = meta.get("failure")
        meta = dict(meta)
        group = (failure.get("group") or FAILURE_GROUP_OF.get(str(failure.get("category")), "system")
                 if isinstance(failure, dict) else ("system" if failure else None))
        # a verdict (wrong answer, auto-fail, abstention) completed; retry/system failures did not
        verdict = group in ("content", "autofail", "abstained")
        meta["completed_without_errors"] = failure is None or verdict
        if failure and not verdict and meta.get("error") is None and isinstance(failure, dict):
            reason = failure.get("reason") or failure.get("category") or "failed"
            meta["error"] = f"{failure.get('stage') or 'pipeline'}: {reason}"
        data = {**data, "metadata": meta}
    return data


def _result_of(item: Any) -> VerificationResult | None:
    if not isinstance(item, dict):
        return None
    if "metadata" not in item and isinstance(item.get("result"), dict):
        item = item["result"]  # a report results.jsonl line
    if "metadata" not in item:
        return None
    return VerificationResult.model_validate(normalise_result_dict(item))


def _iter_csv(p: Path) -> Iterator[VerificationResult]:
    """Our CSV export (its `result_json` column, exact) or the reference's CSV (rebuilt from its
    columns, as far as they go; see shared.reference_csv)."""
    import csv

    from shared import reference_csv

    csv.field_size_limit(1 << 30)
    with p.open("r", encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        ours = "result_json" in header
        if not ours and not reference_csv.is_reference_header(header):
            raise ValueError(f"{p}: not a results CSV (no result_json column and not the reference's columns; "
                             f"first columns: {', '.join(header[:5])})")
        for n, rec in enumerate(reader, 2):
            try:
                if ours and rec.get("result_json"):
                    yield VerificationResult.model_validate_json(rec["result_json"])
                else:
                    yield reference_csv.result_from_row(rec)
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{p}:{n}: {type(exc).__name__}: {exc}") from exc


def _iter_parquet(p: Path) -> Iterator[VerificationResult]:
    """Our Parquet export: every result is in its `result_json` column (read a row group at a time)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(str(p))
    if "result_json" not in pf.schema_arrow.names:
        raise ValueError(f"{p}: Parquet file without a result_json column (not a veribus export)")
    for i in range(pf.num_row_groups):
        for blob in pf.read_row_group(i, columns=["result_json"]).column("result_json").to_pylist():
            if blob:
                yield VerificationResult.model_validate_json(blob)


def iter_results_from_file(path: str | Path) -> Iterator[VerificationResult]:
    """Results from a JSON export (ours or the reference's), a JSON list, JSONL, a CSV export
    (ours or the reference's) or our Parquet export.

    Our export and the reference's write one result per line between a header line ending in
    `"results":[` and a closing `]}`; such files are read line by line (bounded memory). Other JSON
    is parsed whole. Parquet is told by its magic bytes, CSV by its `.csv` suffix."""
    p = Path(path)
    with p.open("rb") as bfh:
        magic = bfh.read(4)
    if magic == b"PAR1":
        yield from _iter_parquet(p)
        return
    if p.suffix.lower() == ".csv":
        yield from _iter_csv(p)
        return
    with p.open("r", encoding="utf-8") as fh:
        head = fh.readline()
        stripped = head.rstrip()
        if stripped.startswith("{") and stripped.endswith('"results":['):
            for line in fh:
                line = line.strip().rstrip(",")
                if not line or line in ("]}", "]"):
                    continue
                if line.startswith("]"):
                    break
                r = _result_of(json.loads(line))
                if r is not None:
                    yield r
            return
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if data is None or (isinstance(data, dict) and "results" not in data):
        # JSONL (a single-result JSON object is also one line of JSONL)
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = _result_of(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{n}: not JSON: {exc}") from exc
            if r is not None:
                yield r
        return
    items: Iterable[Any]
    if isinstance(data, list):
        items = data
    elif isinstance(data, dict) and isinstance(data.get("results"), list):
        items = data["results"]
    elif isinstance(data, dict) and isinstance(data.get("results"), dict):
        items = data["results"].values()  # older keyed exports
    else:
        raise ValueError(f"{p}: not a results file (expected an export with 'results', a list, or JSONL)")
    for item in items:
        r = _result_of(item)
        if r is not None:
            yield r
