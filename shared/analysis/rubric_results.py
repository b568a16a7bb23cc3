"""`RubricResults` (`get_rubrics_results()`): trait scores by type, aggregation (`spec/002` §8)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from shared.core.models import VerificationResult

if TYPE_CHECKING:
    import pandas as pd

from shared.analysis.aggregators import AggregatorRegistry
from shared.analysis.view import _frame, _ident, _nested, _tail, _View

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
