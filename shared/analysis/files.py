"""Reading results from files: our JSON export, the reference's export (format 2.2), JSONL, a
`results.jsonl` report, our CSV and Parquet exports, and the reference's CSV."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from shared.analysis import reference_csv
from shared.core.models import FAILURE_GROUP_OF, VerificationResult


def normalise_result_dict(data: dict[str, Any]) -> dict[str, Any]:
    """A result dict from any supported file -> one `VerificationResult` validates.

    Reference exports (format 2.2) record failures in `metadata.failure` and have no
    `completed_without_errors`/`error` fields: derive them, so errors count as errors and verdicts
    (a wrong answer, an auto-fail, an abstention) as failed answers."""
    meta = data.get("metadata")
    if isinstance(meta, dict) and "completed_without_errors" not in meta:
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
    columns, as far as they go; see shared.analysis.reference_csv). `result_json` always starts
    with `{`, so the `'` our export puts before formula-like text (`csv_cells.spreadsheet_safe`) never
    reaches it: an escaped export reads back as exactly as a `--csv-raw` one. The other columns
    are read as written (the reference does not escape): a program reading them from our export
    should ask for `--csv-raw`."""
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
    # local import: pyarrow is heavy; only Parquet files need it
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
    is parsed whole. Parquet is told by its magic bytes, CSV by its `.csv` suffix. A file none of
    whose items is a result (`{}`, JSON of something else) is refused (ValueError), never read as
    0 results; an empty file or an export of none is 0 results."""
    p = Path(path)
    with p.open("rb") as bfh:
        magic = bfh.read(4)
    if magic == b"PAR1":
        yield from _iter_parquet(p)
        return
    if p.suffix.lower() == ".parquet":  # read as JSON it was said to be "not JSON" on its line 1
        raise ValueError(f"{p}: not a Parquet file (a Parquet file starts with the bytes PAR1)")
    found = skipped = 0
    for r in _iter_text_results(p):
        if r is None:
            skipped += 1
            continue
        found += 1
        yield r
    if skipped and not found:  # `{}` or any JSON without a result was read as 0 results, exit 0
        raise ValueError(f"{p}: not a results file: {skipped} item(s), none of them a result (a result has "
                         "'metadata'; expected an export with 'results', a list of results, JSONL or CSV)")


def _iter_text_results(p: Path) -> Iterator[VerificationResult | None]:
    """The results of a JSON, JSONL or CSV file, with None for each item that is not a result."""
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
                yield _result_of(json.loads(line))
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
        yield _result_of(item)
