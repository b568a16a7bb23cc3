"""Old import path of the result-set API (documented), kept as a re-export of
`shared.analysis.resultset`, its views and loaders, and `shared.store.reads`' result paging."""

from shared.analysis.aggregators import (
    AggregatorRegistry,
    ResultAggregator,
    list_aggregators,
    register_aggregator,
)
from shared.analysis.files import iter_results_from_file, normalise_result_dict
from shared.analysis.judgment_results import JudgmentResults, RubricJudgmentResults
from shared.analysis.resultset import VerificationResultSet
from shared.analysis.rubric_results import RubricResults
from shared.analysis.template_results import TemplateResults
from shared.store.reads import ResultFilter, RowSource, iter_pages, iter_result_json, open_source, resolve_run

__all__ = [
    "AggregatorRegistry", "JudgmentResults", "ResultAggregator", "ResultFilter", "RowSource", "RubricJudgmentResults",
    "RubricResults", "TemplateResults", "VerificationResultSet", "iter_pages", "iter_result_json",
    "iter_results_from_file", "list_aggregators", "normalise_result_dict", "open_source", "register_aggregator",
    "resolve_run",
]
