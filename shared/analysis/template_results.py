"""`TemplateResults` (`get_template_results()`): pass/fail, parsed fields, regex, usage (`spec/002` §8)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared.analysis.stats import Proportion
from shared.core.models import VerificationResult
from shared.core.verdict import failed, verdict_of

if TYPE_CHECKING:
    import pandas as pd

from shared.analysis.aggregators import MeanAggregator, _numeric
from shared.analysis.view import _by, _frame, _group_dict, _ident, _nested, _same, _tail, _View

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
        """Counts over results where template verification ran (`spec/002` §7.1 shape). An error
        is never a pass nor a fail (`shared.core.verdict`): a template whose verify() raised is not
        in `num_failed` (nor in `num_passed`); `pass_rate` is passed / num_results."""
        rs = self.with_template()
        n = len(rs)
        passed = sum(1 for r in rs if verdict_of(r) is True)
        num_failed = sum(1 for r in rs if failed(r))
        return {
            "num_results": n, "num_passed": passed, "num_failed": num_failed,
            "pass_rate": passed / n if n else 0.0,
            "num_with_embedding": sum(1 for r in rs if r.template and r.template.embedding_check_performed),
            "num_with_regex": sum(1 for r in rs if r.template and r.template.regex_validations_performed),
            "num_with_abstention": sum(1 for r in rs if r.template and r.template.abstention_check_performed),
            "num_questions": len({r.metadata.question_id for r in rs}),
        }

    def _per_result(self) -> pd.DataFrame:
        return self.to_dataframe().drop_duplicates(subset=["result_index"])

    def _verdicts(self) -> pd.DataFrame:
        """One row per result with its `verdict` (`shared.core.verdict.verdict_of`: None for an
        error, whatever its verify_result says), what pass rates count."""
        df = self._per_result()
        return df.assign(verdict=[verdict_of(self.results[int(i)]) for i in df["result_index"]])

    def aggregate_pass_rate(self, by: str = "question_id", **_: Any) -> dict[Any, float]:
        """{group: share of verdicts that passed}; results without a verdict (errors too) are left out."""
        return _group_dict(self._verdicts(), by, "verdict", lambda s: float(_numeric(s).mean()))

    def pass_rate_table(self, by: str = "answering_model", confidence: float = 0.95) -> pd.DataFrame:
        """Pass rate per group with its Wilson interval: by, passed, n, pass_rate, ci_low, ci_high."""
        # local import: pandas takes ~2 s to import; only DataFrame output needs it
        import pandas as pd

        by = _by(by)
        counts = _group_dict(self._verdicts(), by, "verdict",
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
        """result_id -> `template.verify_result` as stored, as the reference returns it: a result
        in error may still hold True here. The verdict (an error is never a pass) is
        `shared.core.verdict.verdict_of`, which `filter(passed_only=True)` and the summaries use."""
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
            v = verdict_of(r)
            return not ((passed_only and v is not True) or (failed_only and v is not False))

        return self._new(self._filtered(question_ids, answering_models, parsing_models, replicates,
                                        completed_only, run_names, pred))
