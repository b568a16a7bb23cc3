"""Result builders for the analysis tests: the four results behind spec/002 §7-9's examples and a
2 answering models x 2 judges x 3 replicates grid, plus a DataFrame-to-rows helper."""

from __future__ import annotations

from typing import Any

import pandas as pd

from shared.core.models import (
    ModelIdentity,
    VerificationResult,
    VerificationResultDeepJudgment,
    VerificationResultDeepJudgmentRubric,
    VerificationResultMetadata,
    VerificationResultRubric,
    VerificationResultTemplate,
)

TS = "2025-06-15T10:00:00Z"
CLAUDE = "claude-sonnet-4-5-20250514"
GPT = "gpt-4.1-mini-2025-04-14"
HAIKU = "claude-haiku-4-5-20251001"


def make(
    qid: str, model: str, verify: bool | None, *, judge: str = HAIKU, replicate: int | None = None,
    rubric: dict[str, Any] | None = None, embedding: bool = False, interface: str = "langchain",
    error: str | None = None, parsed: dict[str, Any] | None = None, gt: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None, deep: VerificationResultDeepJudgment | None = None,
    deep_rubric: VerificationResultDeepJudgmentRubric | None = None, regex: dict[str, Any] | None = None,
    run_name: str | None = "spec", with_template: bool = True,
) -> VerificationResult:
    answering = ModelIdentity(interface=interface, model_name=model)
    parsing = ModelIdentity(interface=interface, model_name=judge)
    rid = VerificationResultMetadata.compute_result_id(qid, answering, parsing, TS, replicate)
    meta = VerificationResultMetadata(
        question_id=qid, question_text="What is the putative target of venetoclax?" if qid == "q1" else f"Question {qid}?",
        raw_answer="BCL2", answering=answering, parsing=parsing, execution_time=1.2, timestamp=TS, result_id=rid,
        replicate=replicate, run_name=run_name, completed_without_errors=error is None, error=error,
        evaluation_mode="template_and_rubric" if rubric is not None else "template_only",
    )
    template = None
    if with_template:
        template = VerificationResultTemplate(
            raw_llm_response=f"The target is {(parsed or {'target': 'BCL2'}).get('target')}.",
            parsed_gt_response=gt if gt is not None else {"target": "BCL2"},
            parsed_llm_response=parsed if parsed is not None else {"target": "BCL2"},
            template_verification_performed=verify is not None, verify_result=verify,
            embedding_check_performed=embedding, embedding_similarity_score=0.92 if embedding else None,
            usage_metadata=usage, **(regex or {}),
        )
    rub = VerificationResultRubric(rubric_evaluation_performed=True, rubric_evaluation_strategy="batch", **rubric) \
        if rubric is not None else None
    return VerificationResult(metadata=meta, template=template, rubric=rub, deep_judgment=deep,
                              deep_judgment_rubric=deep_rubric)


def rows(df: pd.DataFrame, cols: list[str] | None = None) -> list[list[Any]]:
    """DataFrame values with pandas' missing markers (NaN, NA) as None."""
    sub = df if cols is None else df[cols]
    return [[None if _missing(v) else v for v in row] for row in sub.astype(object).values.tolist()]


def _missing(v: Any) -> bool:
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


DRUG = {"tp": 3.0, "fn": 1.0, "fp": 0.0, "precision": 1.0, "recall": 0.75, "f1": 0.857}


def spec_results() -> list[VerificationResult]:
    """The four results behind the examples of spec/002 §7-9."""
    return [
        make("q1", CLAUDE, True, embedding=True, rubric={
            "llm_trait_scores": {"safety": True, "clarity": 4}, "regex_trait_scores": {"has_citations": True},
            "callable_trait_scores": {"under_150w": True}, "metric_trait_scores": {"drug_coverage": DRUG},
            "metric_trait_confusion_lists": {"drug_coverage": {"tp": ["aspirin", "ibuprofen", "acetaminophen"],
                                                               "fn": ["naproxen"], "fp": [], "tn": []}}}),
        make("q1", GPT, False, rubric={"llm_trait_scores": {"safety": True, "clarity": 3},
                                       "regex_trait_scores": {"has_citations": False}}),
        make("q2", CLAUDE, True, rubric={"llm_trait_scores": {"safety": True, "clarity": 5},
                                         "regex_trait_scores": {"has_citations": True}}),
        make("q2", GPT, True, rubric={"llm_trait_scores": {"safety": True, "clarity": 4},
                                      "regex_trait_scores": {"has_citations": True}}),
    ]


USAGE = {
    "answer_generation": {"input_tokens": 100, "output_tokens": 50, "total_tokens": 150, "model": "m"},
    "parsing": {"input_tokens": 80, "output_tokens": 20, "total_tokens": 100},
    "total": {"input_tokens": 180, "output_tokens": 70, "total_tokens": 250},
}


def grid_results() -> list[VerificationResult]:
    """2 answering models x 2 judges x 3 replicates x 3 questions = 36 results.

    model-a passes q1 always, q2 on replicates 1-2, q3 never; model-b passes q1 on replicate 1,
    q2 always, q3 always except under judge-2 replicate 3, which errors."""
    out = []
    for model in ("model-a", "model-b"):
        for judge in ("judge-1", "judge-2"):
            for rep in (1, 2, 3):
                for q in ("q1", "q2", "q3"):
                    if model == "model-a":
                        v = {"q1": True, "q2": rep <= 2, "q3": False}[q]
                    else:
                        v = {"q1": rep == 1, "q2": True, "q3": True}[q]
                    error = "generate_answer: TimeoutError: model took too long" \
                        if (model, judge, rep, q) == ("model-b", "judge-2", 3, "q3") else None
                    rubric = {"llm_trait_scores": {"clarity": 2 + rep if v else 1, "safe": True},
                              "llm_trait_labels": {}, "regex_trait_scores": {"cites": bool(v)},
                              "metric_trait_scores": {"coverage": {"precision": 1.0 if v else 0.5, "recall": 0.5,
                                                                   "f1": 0.667 if v else 0.5}}}
                    out.append(make(q, model, None if error else v, judge=judge, replicate=rep,
                                    rubric=None if error else rubric, interface="litellm", error=error,
                                    parsed={"target": "BCL2" if v else "MCL1"}, usage=USAGE, run_name="grid"))
    return out
