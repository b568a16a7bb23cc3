"""Reading results from files: our JSON export, the reference's export (format 2.2), JSONL, or a
`results.jsonl` report."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.core.models import VerificationResult

if TYPE_CHECKING:

    pass


def normalise_result_dict(data: dict[str, Any]) -> dict[str, Any]:
    """A result dict from any supported file -> one `VerificationResult` validates.

    Reference exports (format 2.2) record failures in `metadata.failure` and have no
    `completed_without_errors`/`error` fields: derive them, so errors count as errors."""
    meta = data.get("metadata")
    if isinstance(meta, dict) and "completed_without_errors" not in meta:
        failure = meta.get("failure")
        meta = dict(meta)
        meta["completed_without_errors"] = failure is None
        if failure and meta.get("error") is None and isinstance(failure, dict):
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


def iter_results_from_file(path: str | Path) -> Iterator[VerificationResult]:
    """Results from a JSON export (ours or the reference's), a JSON list, or JSONL.

    Our export and the reference's write one result per line between a header line ending in
    `"results":[` and a closing `]}`; such files are read line by line (bounded memory). Other JSON
    is parsed whole."""
    p = Path(path)
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
