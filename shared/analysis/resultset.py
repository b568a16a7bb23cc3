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
ClickHouse server, or from the embedded chdb folder when no stack runs; it is bounded
(`max_results`, counted in SQL first). `stream(...)` hands out the same selection without
holding it (`StoredResults`: re-iterable, paged) and `iter_dataframes(...)` its rows in batches; `from_file(path)` reads
our JSON export, the reference's export (format 2.2), JSONL, or a `results.jsonl` report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.analysis.aggregators import AggregatorRegistry
from shared.analysis.export import flat_columns_for, flat_rows_from_results
from shared.analysis.files import iter_results_from_file
from shared.analysis.judgment_results import JudgmentResults, RubricJudgmentResults
from shared.analysis.rubric_results import RubricResults
from shared.analysis.stats import Proportion, compare_models, pass_at_k_report
from shared.analysis.stored import StoredResults
from shared.analysis.template_results import TemplateResults
from shared.analysis.view import _View
from shared.core.models import VerificationResult
from shared.core.verdict import errored, failed, verdict_of, verify_raised
from shared.store.engine import FolderHeld
from shared.store.reads import ResultFilter, iter_result_json, open_source

if TYPE_CHECKING:
    import pandas as pd

    from shared.analysis.stats import PairedComparison, PassAtK
    from shared.core.config import Settings
    from shared.store.reads import RowSource

MAX_RESULTS = 200_000  # from_store's default bound on what one result set holds


class ResultSetTooLarge(ValueError):
    """More results match than `from_store` may hold: stream them instead."""


@contextlib.contextmanager
def _open_store(settings: Settings) -> Iterator[RowSource]:
    """`open_source` for the Python API. When no projector answers on `settings`' bus and another
    process holds the chdb folder, that is most often a local stack the caller's settings do
    not name (`Settings.from_env()` knows a bus from VERIBUS_NATS_URL only): say how to read
    through it, as the CLI does, instead of the bare lock."""
    with contextlib.ExitStack() as opened:
        try:
            source = opened.enter_context(open_source(settings))
        except FolderHeld as exc:
            pids = f" (pid {', '.join(map(str, sorted(exc.holders)))})" if exc.holders else ""
            raise FolderHeld(
                f"cannot read the results: the chdb folder {exc.path} is open in another process{pids} and no "
                f"projector answered at {settings.nats_url}. A local stack (`veribus up`) holds its folder: pass "
                "the settings the CLI uses, `shared.control.deployment.select().settings`, which find the stack "
                "of VERIBUS_HOME (`Settings.from_env()` knows a bus only from VERIBUS_NATS_URL); `veribus status` "
                "shows the stack (`veribus up` restarts what died). Otherwise (a `veribus view`, another "
                "command) try again when the folder is free", exc.path, exc.holders) from None
        yield source


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
        """Counts across the set: results, completed, per section, distinct questions/models, and
        the verdicts as every output counts them (`shared.core.verdict`): `num_errors` holds the
        results that did not complete and those whose template's verify() raised
        (`num_verify_raised`, which keep their false verdict but are never in `num_failed`)."""
        rs = self.results
        verdicts = [v for v in map(verdict_of, rs) if v is not None]  # an error is never a pass
        passed = sum(1 for v in verdicts if v)
        p = Proportion.of(passed, len(verdicts))
        return {
            "num_results": len(rs),
            "num_completed": sum(1 for r in rs if r.metadata.completed_without_errors),
            "num_errors": sum(1 for r in rs if errored(r)),
            "num_verify_raised": sum(1 for r in rs if verify_raised(r)),
            "num_with_template": sum(1 for r in rs if r.template and r.template.template_verification_performed),
            "num_with_rubric": sum(1 for r in rs if r.rubric and r.rubric.rubric_evaluation_performed),
            "num_with_judgment": sum(1 for r in rs if r.deep_judgment and r.deep_judgment.deep_judgment_performed),
            "num_questions": len({r.metadata.question_id for r in rs}),
            "num_answering_models": len({r.metadata.answering_model for r in rs}),
            "num_parsing_models": len({r.metadata.parsing_model for r in rs}),
            "replicates": sorted({r.metadata.replicate for r in rs if r.metadata.replicate is not None}),
            "num_verdicts": len(verdicts), "num_passed": passed, "num_failed": sum(1 for r in rs if failed(r)),
            "pass_rate": p.rate,
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
        # local import: pandas takes ~2 s to import; only DataFrame output needs it
        import pandas as pd


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
        max_results: int | None = MAX_RESULTS,
    ) -> VerificationResultSet:
        """Load results from ClickHouse (`verification_results FINAL`), wherever it is: the running
        projector over NATS, a ClickHouse server, or the embedded chdb folder.

        A result set lives in memory, so loading is bounded: with no `limit`, a selection of more
        than `max_results` rows (counted in SQL first) raises `ResultSetTooLarge` instead of
        filling the memory; pass `limit=N` for the first N, `max_results=None` to accept any size,
        or read it without holding it: `stream(...)` (re-iterable, paged) or `iter_dataframes(...)`.

        `settings` name the deployment: `shared.control.deployment.select().settings`, as the CLI
        picks it. Settings that name no running projector while another process (a local stack's
        projector) holds the chdb folder raise `FolderHeld`, saying what to pass instead."""
        where = ResultFilter(run_id=run_id, run_name=run_name, question_ids=question_ids,
                             answering_models=answering_models, parsing_models=parsing_models,
                             replicates=replicates, completed_only=completed_only)
        with _open_store(settings) as source:
            if limit is None and max_results is not None:
                n = len(StoredResults(source, where))
                if n > max_results:
                    raise ResultSetTooLarge(
                        f"{n:,} results match, more than from_store's max_results={max_results:,}: pass limit=N, "
                        "max_results=None, or stream them (VerificationResultSet.stream / iter_dataframes, "
                        "`veribus export`)")
            results: list[VerificationResult] = []
            run_ids: set[str] = set()
            for rid, blob in iter_result_json(source, where, page_size=page_size, limit=limit):
                run_ids.add(rid)
                results.append(VerificationResult.model_validate_json(blob))
        return cls(results, run_ids=sorted(run_ids))

    @staticmethod
    def stream(
        settings: Settings, run_id: str | None = None, run_name: str | None = None, *,
        question_ids: Sequence[str] | None = None, answering_models: Sequence[str] | None = None,
        parsing_models: Sequence[str] | None = None, replicates: Sequence[int] | None = None,
        completed_only: bool = False, page_size: int = 500,
    ) -> StoredResults:
        """The matching results without loading them: iterate as often as you like (each pass
        reads the store page by page); `len()` is a SQL count. Feed it to `report.summarize`,
        `gates.evaluate_gates`, the HTML report, or your own loop."""
        where = ResultFilter(run_id=run_id, run_name=run_name, question_ids=question_ids,
                             answering_models=answering_models, parsing_models=parsing_models,
                             replicates=replicates, completed_only=completed_only)
        return StoredResults(lambda: _open_store(settings), where, page_size=page_size)

    @staticmethod
    def iter_dataframes(settings: Settings, run_id: str | None = None, run_name: str | None = None, *,
                        batch_size: int = 5000, **filters: Any) -> Iterator[pd.DataFrame]:
        """The flat rows of `to_dataframe`, `batch_size` results per DataFrame, read page by page
        (a batch's trait columns are those its results carry)."""
        # local import: pandas takes ~2 s to import; only DataFrame output needs it
        import pandas as pd

        batch: list[VerificationResult] = []
        stream = VerificationResultSet.stream(settings, run_id, run_name, page_size=min(batch_size, 1000), **filters)
        for r in stream:
            batch.append(r)
            if len(batch) >= batch_size:
                cols = flat_columns_for(batch)
                yield pd.DataFrame(list(flat_rows_from_results(batch, cols)), columns=cols)
                batch = []
        if batch:
            cols = flat_columns_for(batch)
            yield pd.DataFrame(list(flat_rows_from_results(batch, cols)), columns=cols)
