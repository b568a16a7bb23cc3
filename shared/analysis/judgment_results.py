"""Deep-judgment views: `JudgmentResults` (`get_judgment_results()`: excerpts, reasoning, risk) and
`RubricJudgmentResults` (`get_rubric_judgments_results()`: one row per trait per excerpt)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared.core.models import VerificationResult

if TYPE_CHECKING:
    import pandas as pd

from shared.analysis.aggregators import CountAggregator
from shared.analysis.view import _frame, _ident, _nested, _same, _tail, _View

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
